#!/usr/bin/env python3
"""Write docs/images/heatmap.png, the README's heat map: the bundled mira-tiny model continuing a prompt on the CPU
with a quarter of its expert bytes cached, drawn by `model.mira.plot_heatmap()` (the notebook's code path).

    PYTHONPATH=. python docs/make_heatmap.py          # ~10 s; rerun when the bundled model changes
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoTokenizer

from mira_hf import MiraConfig, MiraMoEModel
from mira_hf.bundled import bundled_model_path

PROMPT = "def fibonacci(n):"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "images" / "heatmap.png")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    path = bundled_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=0.25, device="cpu"), dtype=torch.float32, progress=False)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    fig = model.mira.plot_heatmap()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=150)
    print(f"wrote {args.out} (hit rate {model.mira.stats()['hit_rate']:.1%} over {args.max_new_tokens} new tokens)")


if __name__ == "__main__":
    main()
