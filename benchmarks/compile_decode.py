"""Decode speed with and without torch.compile, Mixtral and Qwen3 shapes: the unwrapped model (all
experts resident) and the mira-hf model at each budget, each generating with a static cache eagerly
and compiled by generate (`compile_config`, fullgraph=True). Checks that compiled tokens equal eager ones.

Under compilation each experts proxy is one opaque operator (mira::experts): the rest of each layer
(attention, norms, router, shared experts) is compiled around it. The operator is tagged
cudagraph_unsafe, so "reduce-overhead" compiles without CUDA graphs for graphs that hold it.

    python benchmarks/compile_decode.py --out benchmarks/results/        # GPU: DATE-DEVICE-compile-decode.json
    python benchmarks/compile_decode.py --smoke --out /tmp               # CPU, tiny shapes: checks the script
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run  # noqa: E402  (run.py's workloads and their --smoke shapes)
from bench.measure import compiled_generate_kwargs, generator, timed_decode  # noqa: E402
from common import device_slug, environment, print_table, random_model_on_device, write_json  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402


def generate_kwargs(mode: str, compile_mode: str, on_cpu: bool) -> dict:
    kw = dict(do_sample=False, pad_token_id=0, cache_implementation="static")
    if mode == "eager":
        return dict(kw, disable_compile=True)
    return dict(kw, **compiled_generate_kwargs(on_cpu, compile_mode))


def decode(model, prompt: torch.Tensor, new_tokens: int, kw: dict, warmup: int) -> tuple[dict, torch.Tensor]:
    """Decode tokens/s after the first token, timed within the call that decodes (`timed_decode`), and the tokens
    (prompt included)."""
    gen = generator(model, extra=kw)
    for _ in range(warmup):  # compiles (prefill and decode graphs) and fills caches
        gen(prompt, new_tokens)
    rate, _, probe, _, _ = timed_decode(gen, prompt, new_tokens)
    return {"tok_s": (rate or 0.0) * prompt.shape[0], "ms_per_step": 1e3 / rate if rate else None}, probe.ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory (gets DATE-DEVICE-compile-decode.json) or a .json path")
    ap.add_argument("--model", action="append", choices=["mixtral", "qwen3"], help="default: both")
    ap.add_argument("--budget", action="append", type=float, help="mira gpu_budget fractions (default: 1.0 and 0.25)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile-mode", default="reduce-overhead", help="CompileConfig.mode (transformers' default)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, few tokens: checks the script")
    args = ap.parse_args()
    if args.smoke:
        args.device, args.prompt_len, args.new_tokens, args.warmup = "cpu", 8, 4, 1
    models = args.model or ["mixtral", "qwen3"]
    budgets = args.budget or [1.0, 0.25]
    env = environment()
    rows = []
    for key in models:
        _, shape, smoke_shape = run.WORKLOADS[key]
        shape = smoke_shape if args.smoke else shape
        systems = [("resident", None)] + [("mira", b) for b in budgets]
        for system, budget in systems:
            model = random_model_on_device(shape, device=args.device)
            if budget is not None:
                MiraMoEModel.wrap(model, MiraConfig(gpu_budget=budget, device=args.device))
            g = torch.Generator().manual_seed(1)
            prompt = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt_len), generator=g).to(args.device)
            tokens = {}
            for mode in ("eager", "compiled"):
                torch._dynamo.reset()  # each system compiles its own graphs
                kw = generate_kwargs(mode, args.compile_mode, args.device == "cpu")
                row = dict(model=shape, system=system, budget=budget, mode=mode, batch=args.batch)
                try:
                    result, tokens[mode] = decode(model, prompt, args.new_tokens, kw, args.warmup)
                    row.update(result, status="ok")
                except Exception as exc:  # a failure is a row of the table, not the end of the run
                    row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:300])
                if mode == "compiled" and len(tokens) == 2:
                    row["same_tokens"] = bool(torch.equal(tokens["eager"], tokens["compiled"]))
                rows.append(row)
                print(row, flush=True)
            del model
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    columns = ["model", "system", "budget", "mode", "batch", "tok_s", "ms_per_step", "same_tokens", "status"]
    table = print_table(rows, columns)
    on_gpu = args.device != "cpu"
    out = args.out
    if not out.endswith(".json"):
        out = os.path.join(out, f"{env['date']}-{device_slug(env, on_gpu)}-compile-decode.json")
    write_json(out, dict(environment=env, settings=vars(args), rows=rows, table=table))
    print(f"wrote {out}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
