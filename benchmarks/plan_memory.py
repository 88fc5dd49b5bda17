"""How close a planned server's device memory comes to its total: the plan's parts against what the process allocates.

For the bundled model, at each --totals and --dtypes: plan the split of the total (`mira_hf.serve.planning.plan`, the
host costs fixed so the split does not follow the machine's load), apply it, decode --sequences random prompts with
transformers' continuous batching at the plan's KV cache and tokens per step (what `mira serve` runs), and record the
peak bytes allocated on the device against the total. With --history, the allocations live at that peak are grouped
by the line outside torch that made them (`torch.cuda.memory._record_memory_history`), largest first: where the bytes
the plan does not count come from.

    python benchmarks/plan_memory.py --history --out benchmarks/results/   # CUDA; DATE-DEVICE-plan-memory.json
    python benchmarks/plan_memory.py --smoke --out /tmp/                   # CPU: the plans and decodes, no peaks
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import device_slug, environment, print_table, write_json  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.bundled import bundled_model_path  # noqa: E402
from mira_hf.config import parse_bytes  # noqa: E402
from mira_hf.planner import StepCost  # noqa: E402
from mira_hf.serve import ServeConfig, planning  # noqa: E402
from mira_hf.serve import memory as serve_memory  # noqa: E402

HOST_COST = StepCost(use_s=1e-4, miss_s=1e-4)  # fixed: a measured host time would make the split follow the load
PARTS = ("weights_bytes", "activation_bytes", "expert_cache_bytes", "kv_cache_bytes")


def live_at_peak(trace: list[dict], start_bytes: int, top: int) -> list[dict]:
    """Replay a device trace of allocations and frees (`torch.cuda.memory._snapshot()["device_traces"][0]`) from
    `start_bytes` allocated: the allocations live when the most bytes were, grouped by the first frame outside
    torch, largest first (`top` of them)."""
    size, peak, at = start_bytes, start_bytes, -1
    for i, event in enumerate(trace):
        size += event["size"] if event["action"] == "alloc" else -event["size"] if event["action"] == "free_completed" else 0
        if size > peak:
            peak, at = size, i
    live: dict[int, dict] = {}
    for event in trace[: at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    groups: dict[str, list[int]] = {}
    for event in live.values():
        frame = next((f for f in event.get("frames", ()) if f"{os.sep}torch{os.sep}" not in f["filename"]), None)
        where = f"{frame['filename'].split('site-packages' + os.sep)[-1]}:{frame['line']} {frame['name']}" if frame else "?"
        entry = groups.setdefault(where, [0, 0])
        entry[0] += event["size"]
        entry[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return [dict(where=where, bytes=nbytes, allocations=count) for where, (nbytes, count) in ranked]


def measure(total: str, dtype: torch.dtype, device: str, args) -> dict:
    model = MiraMoEModel.from_pretrained(
        bundled_model_path(), MiraConfig(gpu_budget=0.1, device=device), dtype=dtype, progress=False
    )
    config = ServeConfig(
        device_memory=total,
        concurrency=args.sequences,
        prompt_tokens=args.prompt_tokens,
        default_max_tokens=args.new_tokens,
        max_batch_tokens=args.max_batch_tokens,
    )
    plan = planning.plan(model, config, HOST_COST)
    kv = planning.apply(model, plan)
    tokens = planning.batch_tokens(model, config)
    cb = serve_memory.batching_config(model, kv, tokens)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    prompts = torch.randint(3, vocab, (args.sequences, args.prompt_tokens), generator=g).tolist()
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    row = dict(total_bytes=parse_bytes(total, "total"), dtype=str(dtype).removeprefix("torch."), max_batch_tokens=tokens)
    row.update({part: getattr(plan, part) for part in PARTS}, kv_blocks=plan.kv_blocks, concurrency=plan.concurrency)
    on_cuda = device == "cuda"
    if on_cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        if args.history:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    outputs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    row["failed_requests"] = sum(o.error is not None for o in outputs.values())
    row["output_tokens"] = sum(len(o.generated_tokens) for o in outputs.values())
    if on_cuda:
        row["start_bytes"], row["peak_bytes"] = start, torch.cuda.max_memory_allocated()
        row["over_bytes"] = row["peak_bytes"] - row["total_bytes"]
        if args.history:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            row["live_at_peak"] = live_at_peak(snapshot["device_traces"][0], start, args.top)
    del model, outputs
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for DATE-DEVICE-plan-memory.json")
    p.add_argument("--totals", nargs="+", default=["256MiB", "1GiB"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--max-batch-tokens", type=int, default=None, help="tokens per step (default: the planner's)")
    p.add_argument("--history", action="store_true", help="CUDA: group the allocations live at the peak by their line")
    p.add_argument("--top", type=int, default=12, help="with --history: that many groups")
    p.add_argument("--smoke", action="store_true", help="CPU: one total and dtype, plans and decodes, no peaks")
    args = p.parse_args()
    on_gpu = torch.cuda.is_available() and not args.smoke
    if not on_gpu and not args.smoke:
        p.error("the peaks need a CUDA device; --smoke runs the plans on a CPU")
    device = "cuda" if on_gpu else "cpu"
    totals, dtypes = (args.totals[:1], args.dtypes[:1]) if args.smoke else (args.totals, args.dtypes)
    rows = [measure(total, getattr(torch, dtype), device, args) for total in totals for dtype in dtypes]
    columns = ["total_bytes", "dtype", *PARTS, "concurrency", "failed_requests", "peak_bytes", "over_bytes"]
    print_table(rows, [c for c in columns if any(c in r for r in rows)])
    for row in rows:
        for group in row.get("live_at_peak", ()):
            print(
                f"{row['total_bytes']} {row['dtype']}: {group['bytes']:>12,} B in {group['allocations']:>4} at {group['where']}"
            )
    env = environment()
    path = os.path.join(args.out, f"{env['date']}-{device_slug(env, on_gpu)}-plan-memory.json")
    write_json(path, dict(environment=env, args=vars(args), rows=rows))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
