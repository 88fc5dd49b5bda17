"""Exactness at real dimensions: the wrapped model's bf16 outputs against the unwrapped model's, bit for bit.

Tiny test models can hide a difference that only real matrix sizes show: on a GPU, cuBLAS's `mm`, torch's
grouped kernel and its batched kernel pick different tilings (so different summation orders) once the matrices
are large. This builds real-dimension shapes (`common.SHAPES`, cut to `--layers` layers) with random weights on
the device, and for every exact configuration of the store (the checkpoint's bytes; lossless records kept packed
in the cache or decoded into it) compares with `torch.equal`: the logits of a `--prompt-len`-token prefill, the
logits of a one-token forward, and `--new-tokens` greedy tokens. Prints a table and writes
`<date>-<device>-fidelity-real-dims.json`.

    python benchmarks/fidelity_real_dims.py --out $OUT                    # GPU, about 2 minutes
    python benchmarks/fidelity_real_dims.py --smoke --out /tmp/f          # CPU, tiny shapes: checks the script
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from common import build_config, device_slug, environment, print_table, write_json  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.config import QuantConfig  # noqa: E402

# (name, MiraConfig keywords): every store and placement that promises the unwrapped model's bits
CONFIGS = (
    ("raw", dict(quantization=None)),
    ("lossless-packed", dict(quantization="lossless", quant=QuantConfig(placement="packed"))),
    ("lossless-dequant", dict(quantization="lossless", quant=QuantConfig(placement="dequant"))),
)


def outputs(model, ids: torch.Tensor, new_tokens: int) -> dict:
    with torch.no_grad():
        prefill = model(input_ids=ids).logits  # [1, S, V]
        one = model(input_ids=ids[:, :1]).logits  # [1, 1, V]
        again = model(input_ids=ids).logits  # [1, S, V] with the experts the first call left resident
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    tokens = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
    return dict(prefill=prefill, one=one, again=again, tokens=tokens)


def compare(ref: dict, got: dict) -> dict:
    row = {}
    for key in ("prefill", "one", "again"):
        row[f"{key}_equal"] = torch.equal(ref[key], got[key])
        row[f"{key}_max_abs_diff"] = (ref[key].float() - got[key].float()).abs().max().item()
    row["tokens_equal"] = torch.equal(ref["tokens"], got["tokens"])
    row["exact"] = row["prefill_equal"] and row["one_equal"] and row["again_equal"] and row["tokens_equal"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for the JSON")
    ap.add_argument("--shape", action="append", help="keys of common.SHAPES (default: Mixtral and Qwen3)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--budget", type=float, default=0.5, help="gpu_budget fraction of the wrapped models")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # its per-length graph builds add nothing here
    shapes = args.shape or (["mixtral-smoke", "qwen3-smoke"] if args.smoke else ["mixtral-8x7b-8l", "qwen3-30b-a3b-12l"])
    from transformers import AutoModelForCausalLM

    rows, t_start = [], time.perf_counter()
    for shape in shapes:
        config = build_config(shape)
        config.num_hidden_layers = min(args.layers, config.num_hidden_layers)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        impl = getattr(model.config, "_experts_implementation", None)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (1, args.prompt_len), generator=g).to(device)
        ref = outputs(model, ids, args.new_tokens)
        for name, kw in CONFIGS:
            row = dict(shape=shape, layers=config.num_hidden_layers, config=name, experts_implementation=str(impl))
            t0 = time.perf_counter()
            try:
                model = MiraMoEModel.wrap(model, MiraConfig(gpu_budget=args.budget, device=device, **kw))
                row.update(compare(ref, outputs(model, ids, args.new_tokens)))
            except Exception as exc:  # keep the other rows
                row.update(exact=False, error=f"{type(exc).__name__}: {exc}"[:300])
            finally:
                if hasattr(model, "mira"):
                    model = MiraMoEModel.unload(model)
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            print(f"{shape} {name}: exact={row['exact']} ({row['seconds']:.1f} s)", flush=True)
        del model, ref
        if device == "cuda":
            torch.cuda.empty_cache()
    env = environment()
    result = dict(env=env, command=" ".join(sys.argv), dtype="bfloat16", rows=rows, seconds=time.perf_counter() - t_start)
    print_table(
        rows,
        [
            "shape",
            "config",
            "experts_implementation",
            "prefill_equal",
            "prefill_max_abs_diff",
            "one_equal",
            "again_equal",
            "tokens_equal",
            "exact",
        ],
    )
    path = os.path.join(args.out, f"{env['date']}-{device_slug(env, device == 'cuda')}-fidelity-real-dims.json")
    os.makedirs(args.out, exist_ok=True)
    write_json(path, result)
    print(f"wrote {path}")
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
