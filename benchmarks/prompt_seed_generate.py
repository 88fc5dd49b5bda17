"""Seeding the use rates from a prompt (`HeatConfig.seed_from_prompt`) when the model generates what follows.

`offline_eval.py --prompt-tokens` measures seeding on a trace of held-out text: the tokens after the prompt are the
text's own continuation. A user's decode steps route the model's own tokens instead, which can route unlike the
prompt. Here each model reads a prompt of held-out text and generates greedily; the cache's loads per decode step
are counted with seeding on and off, on the same prompts in the same order, one wrapped model per setting whose
cache carries from prompt to prompt as in a session. The tokens must be the same both ways (exactness).

Models: mira-tiny and the trained zoo (`scripts/train_zoo.py`), on the CPU, uncalibrated default otherwise.

    python benchmarks/prompt_seed_generate.py --zoo /tmp/zoo --out benchmarks/results/
    python benchmarks/prompt_seed_generate.py --smoke --out /tmp     # mira-tiny, one budget, two short prompts
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from _zoo_eval import zoo_models  # noqa: E402
from common import environment, print_table, write_json  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.bundled import bundled_model_path  # noqa: E402
from mira_hf.heat import HeatConfig  # noqa: E402
from mira_hf.testing import step  # noqa: E402

FIRST_ROW = 32  # held-out rows from here on: never the rows offline_eval calibrates on


def generate_loads(path: str, budget: float, seed: bool, prompts: torch.Tensor, new_tokens: int) -> dict:
    """Greedy generation after each prompt on one wrapped model: decode loads and hits, and the tokens."""
    cfg = MiraConfig(device="cpu", gpu_budget=budget, heat=HeatConfig(seed_from_prompt=seed))
    model = MiraMoEModel.from_pretrained(path, cfg, progress=False).eval()
    loads = hits = steps = 0
    tokens = []
    with torch.inference_mode():
        for ids in prompts:
            out, past = step(model, ids[None])
            tok = out.logits[:, -1:].argmax(-1)
            before = model.mira.stats()
            seq = [int(tok)]
            for _ in range(new_tokens - 1):
                out, past = step(model, tok, past)
                tok = out.logits[:, -1:].argmax(-1)
                seq.append(int(tok))
            after = model.mira.stats()
            loads += after["loads"] - before["loads"]
            hits += after["hits"] - before["hits"]
            steps += new_tokens - 1
            tokens.append(seq)
    return dict(loads_per_step=loads / steps, hits_per_step=hits / steps, tokens=tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zoo", default=None, help="directory of the trained zoo (mira-tiny alone without it)")
    ap.add_argument("--models", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--budgets", default="0.1,0.25,0.5")
    ap.add_argument("--prompt-tokens", default="64,192")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.smoke:
        args.budgets, args.prompt_tokens, args.new_tokens, args.prompts = "0.25", "16", 6, 2
    only = args.models.split(",") if args.models else None
    models = zoo_models(args.zoo, only) if args.zoo else [("mira-tiny", bundled_model_path(), "python-sources")]
    rows = []
    for name, path, _domain in models:
        heldout = load_file(os.path.join(path, "heldout_tokens.safetensors"))["input_ids"].long()
        for p in (int(x) for x in args.prompt_tokens.split(",")):
            prompts = heldout[FIRST_ROW : FIRST_ROW + args.prompts, :p]
            for budget in (float(b) for b in args.budgets.split(",")):
                on = generate_loads(path, budget, True, prompts, args.new_tokens)
                off = generate_loads(path, budget, False, prompts, args.new_tokens)
                if on["tokens"] != off["tokens"]:
                    raise SystemExit(f"{name}: the tokens differ with and without seeding: outputs must not change")
                rows.append(
                    dict(
                        model=name,
                        prompt_tokens=p,
                        budget=budget,
                        loads_seeded=on["loads_per_step"],
                        loads_one_step=off["loads_per_step"],
                        ratio=on["loads_per_step"] / off["loads_per_step"] if off["loads_per_step"] else None,
                        hits_seeded=on["hits_per_step"],
                        hits_one_step=off["hits_per_step"],
                    )
                )
                print_table(rows[-1:], list(rows[-1]))
    report = dict(
        environment=environment(),
        args=vars(args),
        what="loads per decode step of greedy generation after held-out prompts, seeding the use rates from the "
        "prompt (seeded) against the prompt counted as one step (one_step); one wrapped model per setting, the "
        "prompts in the same order",
        rows=rows,
    )
    name = f"{time.strftime('%Y-%m-%d')}-cpu-prompt-seed-generate{'-smoke' if args.smoke else ''}.json"
    write_json(os.path.join(args.out, name), report)
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
