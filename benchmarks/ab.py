"""Interleaved A/B: mira systems on one workload, alternated round by round in one process.

Decode speed of the default against LRU moves by ±5% (Mixtral shape) to ±30% (mira-tiny) between
machines and processes, so one row per system in separate runs cannot order systems that differ by
less (NOTES.md, "Measuring"). This script builds every system once, then alternates them round by round on
the same prompts (who goes first alternates too), and reports per system the median decode tokens/s,
stall time and hit rate, and the median, min and max of its per-round ratio to the first system.

Systems: run.py's mira systems (`lru`, `default`, `bf16`, `int4`, `int4-packed`), `heat-only` (the
default's policy without prediction) and `--variant`s, plus, on the bundled model, `default+learned`
(the default after `mira_hf.calibrate` on held-out windows the prompts never use).
Workloads: run.py's (`mixtral`, `qwen3`: random weights at real dimensions built on the GPU;
`bundled`: mira-tiny on its held-out text).

Every system's expert store stays in host memory for the whole run, allocated in build order. Where a
store lands moves its copy speed (on the H200 machine, memory allocated after ~32 GiB of others copies
~15% slower: NOTES.md, "Measuring"), so with Mixtral-size stores the systems built later are handicapped; the
`store_h2d_gbps` column shows it. Link-bound comparisons of large stores are fairer in run.py, which
builds one system at a time into freed memory.

    python benchmarks/ab.py --model bundled --out benchmarks/results/     # writes DATE-DEVICE-bundled-ab.json
    python benchmarks/ab.py --model mixtral --systems lru,default --variant nosplit:loader.split_copies=false \\
        --rounds 5 --new-tokens 48 --batch 0 --out benchmarks/results/  # ~3 minutes on an H200
    python benchmarks/ab.py --model mixtral --smoke --out /tmp            # CPU, tiny shape: checks the script
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run  # noqa: E402  (workloads, mira systems, --variant)
from bench.measure import generator, timed_decode  # noqa: E402
from common import build_config, device_slug, environment, print_table, sync, write_json  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel, calibrate  # noqa: E402

EXTRA_SYSTEMS = {"heat-only": dict(predictor=None), "default+learned": {}}  # default+learned: bundled only


def decode(model, prompt: torch.Tensor, new_tokens: int) -> dict:
    """Decode tokens/s (all sequences of the batch) after the first token, timed within the call that decodes
    (`timed_decode`), with mira's stall time and hit rate for the whole call."""
    model.mira.reset_stats()
    rate, got = timed_decode(generator(model), prompt, new_tokens)[:2]
    s = model.mira.stats()
    return {
        "tok_s": (rate or 0.0) * prompt.shape[0],
        "stall_ms_per_token": 1e3 * s["stall_s"] / max(got, 1),
        "hit_rate": s["hit_rate"],
        "predicting": s["prediction_active"] and s["prediction_paused_steps"] == 0,  # the payoff gate never paused it
        "paused_steps": s["prediction_paused_steps"],  # forward steps of this call run with prediction paused
        "gate": gate_state(model),
    }


def gate_state(model) -> dict | None:
    """The payoff gate's latest estimates (per block: prediction's host seconds, uses at risk; stall seconds per
    demand miss) and whether it predicts now: why a system did or did not predict. None without a predictor."""
    staging = model.mira.staging
    if staging.predictor is None:
        return None
    g = staging.gate
    return {"on": staging.gate_on, "active": g.active, "cost_per_block_s": g.cost_per_block,
            "at_risk_per_block": g.at_risk_per_block, "stall_per_miss_s": g.stall_per_miss}  # fmt: skip


def store_h2d_gbps(model, device: torch.device) -> float | None:
    """Host→device GB/s of copies from this system's expert store (every layer's first and last record,
    best of 3). Where a store lands in host memory moves its copy speed: on the H200 machine, memory
    allocated after ~32 GiB of others copies 15% slower (NOTES.md, "Measuring"), so a system built after others
    can lose for that reason alone. The table shows it beside each system."""
    if device.type != "cuda":
        return None
    store = model.mira.store
    # each record as it lies in the store: one piece (encoded) or one per tensor (uncompressed)
    pieces = [p for layer in store.layers for e in (0, store.num_experts(layer) - 1) for p in store.pieces(layer, e)]
    dst = torch.empty(max(store.record_bytes(layer) for layer in store.layers), dtype=torch.uint8, device=device)
    best = 0.0
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for offset, piece in pieces:
            dst[offset : offset + piece.numel()].copy_(piece, non_blocking=True)
        sync()
        best = max(best, sum(piece.numel() for _, piece in pieces) / (time.perf_counter() - t0) / 1e9)
    return best


def build_system(name: str, wl: run.Workload, budget: float, device: str, calib: torch.Tensor | None):
    model = wl.build(device)
    overrides = dict(EXTRA_SYSTEMS.get(name, run.MIRA_OVERRIDES.get(name, {})))
    MiraMoEModel.wrap(model, MiraConfig(gpu_budget=budget, device=device, **overrides))
    if name == "default+learned":
        calibrate(model, calib.to(device), progress=False)
    return model.eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory (gets DATE-DEVICE-MODEL-ab.json) or a .json path")
    ap.add_argument("--model", default="bundled", choices=sorted(run.WORKLOADS))
    ap.add_argument(
        "--systems", default=None, help="comma-separated; default: lru,default (+ default+learned,heat-only on bundled)"
    )
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE,...", help="as run.py's")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompt-len", type=int, default=None, help="default: 64 (bundled), 512 (random shapes)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="also decode this many sequences per round (0: batch 1 only)")
    ap.add_argument("--calib-windows", type=int, default=32, help="bundled: held-out windows for default+learned")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, 2 rounds of 8 tokens: checks the script")
    args = ap.parse_args()
    if args.smoke:
        args.device, args.rounds, args.new_tokens, args.batch = "cpu", 2, 8, min(args.batch, 2)
        args.prompt_len = args.prompt_len or 16
    label, shape, smoke_shape = run.WORKLOADS[args.model]
    bundled = shape is None
    wl = run.Workload(args.model, label, smoke_shape if args.smoke else shape, args.seed)
    names = (args.systems or ("lru,default,default+learned,heat-only" if bundled else "lru,default")).split(",")
    names = [n.strip() for n in names if n.strip()] + [run.add_variant(v) for v in args.variant]
    unknown = [n for n in names if n not in run.MIRA_OVERRIDES and n not in EXTRA_SYSTEMS]
    unknown += [] if bundled or "default+learned" not in names else ["default+learned"]  # needs held-out text
    if unknown:
        raise SystemExit(
            f"--systems: {unknown} not available for {args.model}; give some of "
            f"{sorted(run.MIRA_OVERRIDES) + ['heat-only']} (bundled also default+learned) or a --variant."
        )
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("ab: no CUDA device; --smoke (or --device cpu) checks the script", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    if (
        device.type == "cuda"
    ):  # its per-sequence-length graph builds would land on whichever system runs first (NOTES.md, "Measuring")
        torch.backends.cuda.enable_cudnn_sdp(False)
    prompt_len = args.prompt_len or (64 if bundled else 512)
    calib = None
    if bundled:
        from safetensors.torch import load_file

        heldout = load_file(os.path.join(run.bundled_dir(), "heldout_tokens.safetensors"))["input_ids"].long()  # [64, 256]
        calib, pool = heldout[: args.calib_windows], heldout[args.calib_windows :, :prompt_len]  # prompts never calibrated on
    else:
        vocab = build_config(wl.shape).vocab_size
        g = torch.Generator().manual_seed(args.seed + 1)
        pool = torch.randint(3, vocab, (max(args.rounds, args.batch, 1) + args.batch, prompt_len), generator=g)
    systems = {n: build_system(n, wl, args.budget, str(device), calib) for n in names}
    store_gbps = {n: store_h2d_gbps(m, device) for n, m in systems.items()}
    batches = ("b1", "b8") if args.batch else ("b1",)
    rows = {n: {b: [] for b in batches} for n in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]  # alternate who goes first
        p1 = pool[r % pool.shape[0]][None].to(device)
        pb = pool[(r * args.batch) % max(pool.shape[0] - args.batch + 1, 1) :][: args.batch].to(device)
        for n in order:
            with torch.no_grad():
                if r == 0:  # warm-up: kernels, allocator, pinned buffers, the heat tables (at both batch sizes)
                    decode(systems[n], p1, 4)
                    if args.batch:
                        decode(systems[n], pb, 4)
                rows[n]["b1"].append(decode(systems[n], p1, args.new_tokens))
                if args.batch:
                    rows[n]["b8"].append(decode(systems[n], pb, args.new_tokens))
    base = names[0]
    table = []
    for n in names:
        row = {"system": n, "store_h2d_gbps": store_gbps[n]}
        for b in batches:
            row[f"{b}_tok_s"] = statistics.median(x["tok_s"] for x in rows[n][b])
            row[f"{b}_stall_ms"] = statistics.median(x["stall_ms_per_token"] for x in rows[n][b])
            row[f"{b}_hit"] = statistics.median(x["hit_rate"] for x in rows[n][b])
            row[f"{b}_predicting"] = sum(x["predicting"] for x in rows[n][b]) / len(rows[n][b])  # share of rounds
            row[f"{b}_paused_steps"] = statistics.median(x["paused_steps"] for x in rows[n][b])
            ratios = [x["tok_s"] / y["tok_s"] for x, y in zip(rows[n][b], rows[base][b], strict=True)]  # same round
            row[f"{b}_vs_{base}_median"] = statistics.median(ratios)
            row[f"{b}_vs_{base}_min"], row[f"{b}_vs_{base}_max"] = min(ratios), max(ratios)
        table.append(row)
    cols = ["system", "store_h2d_gbps"] + [
        f"{b}_{k}"
        for b in batches
        for k in ("tok_s", f"vs_{base}_median", f"vs_{base}_min", f"vs_{base}_max", "stall_ms", "hit", "predicting")
    ]
    print_table(table, cols)
    result = {"env": environment(), "command": " ".join(["python"] + sys.argv), "args": vars(args), "model": label,
              "prompt_len": prompt_len, "baseline": base, "table": table, "rounds": rows,
              "wall_s": time.perf_counter() - t_start}  # fmt: skip
    slug = device_slug(result["env"], device.type == "cuda")
    name = f"{result['env']['date']}-{slug}-{args.model}-ab.json"
    out = args.out if args.out.endswith(".json") else os.path.join(args.out, name)
    write_json(out, result)
    print(f"wrote {out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
