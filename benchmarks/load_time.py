"""Load time of `MiraMoEModel.from_pretrained` on a Mixtral-shape bf16 checkpoint: uncompressed records
(quantization=None), the default format on a first load (record cache empty: every expert encoded)
and on a second load (the records read from the cache).

    python benchmarks/load_time.py --dir /data/mixtral-8l            # GPU: real dims, 8 layers, ~6 min
    python benchmarks/load_time.py --dir /tmp/tiny --smoke           # CPU, tiny dims, seconds

The checkpoint (random weights, written with save_pretrained; built on the GPU when there is one) is
written once into --dir and reused. Each load runs in a fresh process, so no allocator, page-pinning
or import state carries over; the operating system's page cache does (the checkpoint was just
written or read), the same for every run. Prints a table and writes
benchmarks/results/<date>-<device>-load-time.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
from common import budget_arg, build_config, device_slug, environment, print_table, write_json  # noqa: E402

RUNS = (("none", None), ("first", "default"), ("cached", "default"))  # in this order: "cached" reads what "first" wrote


def checkpoint_config(layers: int, smoke: bool):
    """Mixtral-8x7B's dimensions, or with `smoke` the tests' tiny Mixtral (`mira_hf.testing`), at `layers` layers."""
    return build_config("mixtral-smoke" if smoke else "mixtral-8x7b-8l", num_hidden_layers=layers)


def write_checkpoint(path: str, layers: int, smoke: bool) -> dict:
    """The checkpoint in `path` (written unless one of this shape is there): its size and write time."""
    from transformers import AutoModelForCausalLM

    config = checkpoint_config(layers, smoke)
    marker = os.path.join(path, "load_time_shape.json")
    shape = dict(layers=layers, smoke=smoke, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size)
    if os.path.exists(marker) and json.load(open(marker)) == shape:
        return dict(written=False, bytes=_dir_bytes(path))
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)  # trained-like exponents; the default init leaves some tensors constant
    model.cpu().save_pretrained(path)  # from host memory: what any writer of a checkpoint does
    del model
    with open(marker, "w") as f:
        json.dump(shape, f)
    return dict(written=True, bytes=_dir_bytes(path), write_s=time.perf_counter() - t0)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def child(args) -> None:
    """One timed load in this process; prints one JSON line."""
    from mira_hf import MiraConfig, MiraMoEModel
    from mira_hf.config import LoaderConfig

    q = None if args.child == "none" else args.quantization
    cfg = MiraConfig(gpu_budget=args.budget, quantization=q, loader=LoaderConfig(record_cache=args.cache))
    if torch.cuda.is_available():
        torch.cuda.init()  # CUDA's start-up is not load time
    t0 = time.perf_counter()
    model = MiraMoEModel.from_pretrained(args.dir, cfg, progress=False)
    load_s = time.perf_counter() - t0
    store, cache = model.mira.store, model.mira.record_cache
    t1 = time.perf_counter()
    if cache is not None:
        cache.wait()  # the entry is written in the background: what a next load can use
    print(
        "RESULT "
        + json.dumps(
            dict(
                load_s=load_s,
                cache_write_after_load_s=time.perf_counter() - t1,
                quantization=model.mira.quantization,
                encoded_experts=store.encoder.experts_encoded,
                encoder=repr(store.encoder),
                store_bytes=store.nbytes,
                tiers=store.tier_bytes(),
                stages=model.mira_load_report().as_dict(),  # after the cache write: its seconds are in
            )
        ),
        flush=True,
    )


def cpu_encode_rate(smoke: bool, experts: int) -> dict:
    """CPU encode GB/s of the default lossless code on the checkpoint's expert tensors, one thread vs all cores."""
    from mira_hf.encode import RecordEncoder
    from mira_hf.quant import make_codec

    config = checkpoint_config(1, smoke)
    inter, H = config.intermediate_size, config.hidden_size
    torch.manual_seed(0)
    fused = {
        "gate_up_proj": (torch.randn(experts, 2 * inter, H) * 0.02).to(torch.bfloat16),
        "down_proj": (torch.randn(experts, H, inter) * 0.02).to(torch.bfloat16),
    }
    specs = {n: (tuple(t.shape[1:]), t.dtype) for n, t in fused.items()}
    gb = sum(t.numel() * 2 for t in fused.values()) / 1e9
    codec = make_codec("lossless", code="classes")
    out = {}
    for label, workers in (("1 thread", 1), ("all cores", None)):
        enc = RecordEncoder("cpu", workers=workers)
        t0 = time.perf_counter()
        layout = enc.plan_layer(codec, specs, experts, lambda e: {n: t[e] for n, t in fused.items()})
        slab = torch.empty(experts, layout.nbytes, dtype=torch.uint8)
        enc.encode_into(codec, layout, experts, lambda e: {n: t[e] for n, t in fused.items()}, slab)
        out[label] = dict(gbps=gb / (time.perf_counter() - t0), workers=enc.workers)
    return dict(weights_gb=gb, experts=experts, **out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where the checkpoint is written (and reused)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--budget", default=None, help="gpu_budget (default: 20GiB on a GPU, 0.5 with --smoke)")
    ap.add_argument("--quantization", default="auto", help="the default runs' quantization ('auto': MiraConfig's default)")
    ap.add_argument("--smoke", action="store_true", help="tiny dims on the CPU (quantization='lossless')")
    ap.add_argument("--time-limit", type=float, default=460.0, help="seconds for the whole run")
    ap.add_argument("--cpu-encode-experts", type=int, default=2, help="experts in the CPU encode measurement (0: skip)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--child", choices=[r[0] for r in RUNS], help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.budget is None:
        args.budget = "0.5" if args.smoke else "20GiB"
    if args.smoke and args.quantization == "auto":
        args.quantization = "lossless"  # "auto" encodes only on a GPU
    if args.child:
        args.budget = budget_arg(args.budget)
        child(args)
        return 0

    start = time.perf_counter()
    deadline = start + args.time_limit
    on_gpu = torch.cuda.is_available() and not args.smoke
    checkpoint = write_checkpoint(args.dir, args.layers, args.smoke)
    print(f"checkpoint: {args.dir} ({checkpoint['bytes'] / 1e9:.2f} GB)", flush=True)
    cache = args.dir.rstrip("/") + ".records"
    shutil.rmtree(cache, ignore_errors=True)
    rows, failed = [], []
    for label, quantization in RUNS:
        left = deadline - time.perf_counter()
        if left < 10:
            failed.append(f"{label}: not run (time limit)")
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--child", label, "--dir", args.dir, "--cache", cache]
        cmd += ["--budget", str(args.budget), "--quantization", args.quantization]
        t0 = time.perf_counter()
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            failed.append(f"{label}: over the time limit ({left:.0f} s)")
            continue
        wall = time.perf_counter() - t0
        line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
        if run.returncode != 0 or not line:
            failed.append(f"{label}: exit {run.returncode}: {run.stderr.strip().splitlines()[-1:] or run.stdout[-500:]}")
            continue
        row = dict(run=label, quantization_asked=quantization or "None", **json.loads(line[0][len("RESULT ") :]))
        row["process_s"] = wall
        rows.append(row)
        print(f"{label}: {row['load_s']:.2f} s", flush=True)
    base = next((r["load_s"] for r in rows if r["run"] == "none"), None)
    for r in rows:
        r["vs_none"] = r["load_s"] / base if base else None
    encode = None
    if args.cpu_encode_experts and deadline - time.perf_counter() > 60:
        encode = cpu_encode_rate(args.smoke, args.cpu_encode_experts)
    cols = ["run", "quantization", "load_s", "vs_none", "encoded_experts", "store_bytes", "cache_write_after_load_s", "process_s"]
    if rows:
        print_table(rows, cols)
    if encode:
        print(
            f"CPU encode ({encode['weights_gb']:.2f} GB of bf16 weights): "
            + ", ".join(f"{k} {v['gbps']:.3f} GB/s" for k, v in encode.items() if isinstance(v, dict))
        )
    for r in rows:
        print(f"{r['run']} stages (seconds summed over threads, GB, GB/s):")
        for stage, v in r["stages"]["stages"].items():
            rate = f"{v['bytes'] / 1e9:9.2f} GB {v['gbps']:7.2f} GB/s" if v["gbps"] else ""
            print(f"  {stage:<12}{v['seconds']:8.2f} s {rate}")
    for f in failed:
        print("NOT MEASURED:", f)
    env = environment()
    result = dict(
        benchmark="load_time",
        command=" ".join(sys.argv),
        environment=env,
        checkpoint=dict(path=args.dir, layers=args.layers, smoke=args.smoke, **checkpoint),
        budget=args.budget,
        rows=rows,
        ratios={r["run"]: r["vs_none"] for r in rows},
        cpu_encode=encode,
        not_measured=failed,
        total_s=time.perf_counter() - start,
    )
    path = os.path.join(args.out, f"{env['date']}-{device_slug(env, on_gpu)}-load-time.json")
    write_json(path, result)
    print(f"wrote {path}")
    shutil.rmtree(cache, ignore_errors=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
