"""GPU check of the lossless codec: bytes saved, copy and decode time, and bit-exactness.

For a Mixtral-8x7B expert (H=4096, I=14336, bf16) with two weight distributions, "normal"
(N(0, 0.02), random init) and "trained" (the bundled mira-tiny's trained expert weights, resampled
to the Mixtral shape), it reports:

    compressed bytes / raw bytes and the escape rate; encode time on the GPU;
    H2D time of one expert from pinned memory, raw vs compressed (median of CUDA-event timings);
    decode time of one record into bf16 (Triton bulk kernel + escape scatter; eager and CUDA graph);
    raw vs compressed + decode per expert, and the effective link speed-up;
    torch.equal of the Triton decode (and the torch reference) with the original weights;

then loads the bundled model twice with quantization="lossless" (placements "dequant" and "packed",
bf16, 25 % budget) and checks its logits and its greedy and beam generate() against the unwrapped
model (torch.equal). Prints a table, writes JSON. Under 60 s on an H200.

    python benchmarks/lossless_gpu_check.py --out benchmarks/results/lossless_gpu_check.json
    python benchmarks/lossless_gpu_check.py --smoke --out /tmp/lossless_smoke.json   # CPU, small shape
    python benchmarks/lossless_gpu_check.py --cpu --out benchmarks/results/DATE-cpu-lossless.json  # CPU, Mixtral shape
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import module_version  # noqa: E402
from timing import cpu_time_ms, cuda_time_ms, graph_time_ms  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel, bundled_model_path  # noqa: E402
from mira_hf.config import QuantConfig  # noqa: E402
from mira_hf.quant import LosslessCodec, triton_available  # noqa: E402

SHAPES = {"mixtral": (4096, 14336), "smoke": (256, 512)}  # (H, I)


def trained_values() -> torch.Tensor:
    """Every routed-expert weight of the bundled trained model, flat bf16."""
    from safetensors.torch import load_file

    sd = load_file(os.path.join(bundled_model_path(), "model.safetensors"))
    return torch.cat([t.reshape(-1) for k, t in sd.items() if ".experts." in k]).bfloat16()


def make_expert(dist: str, H: int, I: int, device: torch.device) -> dict[str, torch.Tensor]:  # noqa: E741
    g = torch.Generator(device=device).manual_seed(0)
    shapes = {"gate_up_proj": (2 * I, H), "down_proj": (H, I)}
    if dist == "normal":
        return {n: (torch.randn(s, generator=g, device=device) * 0.02).bfloat16() for n, s in shapes.items()}
    pool = trained_values().to(device)
    return {n: pool[torch.randint(pool.numel(), s, generator=g, device=device)] for n, s in shapes.items()}


def check_expert(dist: str, H: int, I: int, device: torch.device, reps: int, code: str = "nibble") -> dict:  # noqa: E741
    cuda = device.type == "cuda"
    weights = make_expert(dist, H, I, device)
    codec = LosslessCodec(code=code)
    fused = {n: w[None] for n, w in weights.items()}  # one expert: [1, ...]
    t0 = time.perf_counter()
    layout = codec.plan_experts(fused)
    record_dev = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    escapes = codec.encode(weights, layout, record_dev)  # on the weights' device
    if cuda:
        torch.cuda.synchronize()
    encode_s = time.perf_counter() - t0
    raw_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    numel = sum(w.numel() for w in weights.values())
    row: dict = {
        "dist": dist,
        "code": code,
        "H": H,
        "I": I,
        "device": str(device),
        "raw_bytes": raw_bytes,
        "record_bytes": layout.nbytes,
        "ratio": layout.nbytes / raw_bytes,
        "escape_rate": sum(escapes.values()) / numel,
        "escapes": escapes,
        "plan_encode_s": encode_s,
        "encode_GBps": raw_bytes / encode_s / 1e9,
    }
    out = {n: torch.empty_like(w) for n, w in weights.items()}
    ref = codec.decode(record_dev, layout, torch.bfloat16, backend="torch")
    row["torch_ref_exact"] = all(torch.equal(ref[n], weights[n]) for n in weights)
    if cuda:
        pinned_record = record_dev.cpu().pin_memory()
        pinned_raw = torch.empty(raw_bytes, dtype=torch.uint8).pin_memory()
        raw_dev = torch.empty(raw_bytes, dtype=torch.uint8, device=device)
        row["h2d_raw_ms"] = cuda_time_ms(lambda: raw_dev.copy_(pinned_raw, non_blocking=True), reps)
        row["h2d_record_ms"] = cuda_time_ms(lambda: record_dev.copy_(pinned_record, non_blocking=True), reps)
        row["h2d_GBps"] = layout.nbytes / row["h2d_record_ms"] / 1e6
        backend = "triton" if triton_available() else "torch"
        row["decode_backend"] = backend

        def decode():
            codec.decode(record_dev, layout, torch.bfloat16, out=out, backend=backend)

        row["decode_ms"] = cuda_time_ms(decode, reps)
        row["decode_gpu_ms"] = graph_time_ms(decode, reps)
        row["decode_out_GBps"] = raw_bytes / row["decode_ms"] / 1e6
        decode()
        torch.cuda.synchronize()
        row["triton_exact"] = all(torch.equal(out[n], weights[n]) for n in weights)
        # one expert fetched: raw copy, vs compressed copy then decode (serial: the worst case, no overlap)
        row["per_expert_raw_ms"] = row["h2d_raw_ms"]
        row["per_expert_lossless_ms"] = row["h2d_record_ms"] + row["decode_ms"]
        row["speedup"] = row["per_expert_raw_ms"] / row["per_expert_lossless_ms"]
        if code == "classes" and backend == "triton":
            row["launch_sweep"] = sweep_classes_launch(record_dev, layout, weights, reps)
    else:
        row["decode_backend"] = "torch"
        row["decode_ms"] = cpu_time_ms(lambda: codec.decode(record_dev, layout, torch.bfloat16, out=out), reps)
        row["triton_exact"] = None
    return row


def sweep_classes_launch(record: torch.Tensor, layout, weights: dict, reps: int) -> list[dict]:
    """Bulk-decode time of the classes kernel per launch shape (blocks of 256 per program, warps), each
    checked bit for bit against the torch reference, so the module default can be chosen from it."""
    from mira_hf.quant import triton_kernels
    from mira_hf.quant.lossless_bits import decode_words_classes_torch

    rows = []
    ref = {n: decode_words_classes_torch(record, layout.entry(n)) for n in weights}
    outs = {n: torch.empty_like(w) for n, w in weights.items()}
    for r in (1, 2, 4, 8, 16):
        for warps in (1, 2, 4, 8):

            def bulk(r=r, warps=warps):
                for n in weights:
                    triton_kernels.lossless_classes_decode(record, layout.entry(n), outs[n], r, warps)

            ms = cuda_time_ms(bulk, reps)
            exact = all(torch.equal(outs[n].view(-1).view(torch.int16), ref[n]) for n in weights)
            rows.append({"blocks_per_program": r, "warps": warps, "bulk_ms": ms, "exact": exact})
            print(f"  classes launch R={r} warps={warps}: {ms:.3f} ms, exact {exact}", flush=True)
    return rows


def check_model(device: torch.device, codes=("nibble",)) -> list[dict]:
    """The bundled model with lossless transfer vs the unwrapped model: logits and tokens, bit for bit."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ids = load_file(os.path.join(bundled_model_path(), "heldout_tokens.safetensors"))["input_ids"][:2, :32].long().to(device)
    ref = AutoModelForCausalLM.from_pretrained(bundled_model_path(), dtype=torch.bfloat16).to(device).eval()
    prompt = ids[:1, :12]
    kws = {"greedy": dict(do_sample=False), "beam4": dict(do_sample=False, num_beams=4)}
    with torch.no_grad():
        ref_logits = ref(ids).logits
    ref_tokens = {k: ref.generate(prompt, max_new_tokens=16, min_new_tokens=16, **kw) for k, kw in kws.items()}
    del ref
    rows = []
    for code, placement in [(c, p) for c in codes for p in ("dequant", "packed")]:
        quant = QuantConfig(placement=placement, lossless_code=code)
        cfg = MiraConfig(device=str(device), gpu_budget=0.25, quantization="lossless", quant=quant)
        model = MiraMoEModel.from_pretrained(bundled_model_path(), cfg, dtype=torch.bfloat16, progress=False)
        with torch.no_grad():
            logits = model(ids).logits
        row = {"code": code, "placement": placement, "logits_equal": torch.equal(logits, ref_logits)}
        for k, kw in kws.items():
            row[f"{k}_equal"] = torch.equal(model.generate(prompt, max_new_tokens=16, min_new_tokens=16, **kw), ref_tokens[k])
        s = model.mira.stats()
        row.update(
            record_bytes=model.mira.store.record_bytes(0),
            raw_record_bytes=model.mira.store.raw_layout(0).nbytes,
            bytes_h2d=s["bytes_h2d"],
            device_bytes=model.mira.device_bytes,
            budget_bytes=s["budget_bytes"],
            within_budget=model.mira.device_bytes <= s["budget_bytes"],
        )
        rows.append(row)
        model.unload()
        del model
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write (a directory gets lossless_gpu_check.json)")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions (median reported)")
    parser.add_argument("--smoke", action="store_true", help="CPU, small expert shape: checks the script, not the GPU")
    parser.add_argument("--cpu", action="store_true", help="CPU, Mixtral shape: ratios, escapes, CPU encode/decode speed")
    parser.add_argument("--codes", default="nibble,classes", help="exponent codes to check (QuantConfig.lossless_code)")
    args = parser.parse_args()
    codes = [c for c in args.codes.split(",") if c]
    if args.smoke or args.cpu:
        device, shape = torch.device("cpu"), "smoke" if args.smoke else "mixtral"
    else:
        if not torch.cuda.is_available():
            print(
                "lossless_gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False); --smoke runs on CPU", file=sys.stderr
            )
            return 2
        if not triton_available():
            print("lossless_gpu_check: triton is not importable: decode timings are the torch reference", file=sys.stderr)
        device, shape = torch.device("cuda"), "mixtral"
    t_start = time.perf_counter()
    H, I = SHAPES[shape]  # noqa: E741
    experts = []
    for code in codes:
        for dist in ("normal", "trained"):
            experts.append(check_expert(dist, H, I, device, args.reps if device.type == "cuda" else 3, code))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    models = check_model(device, codes)

    cols = [
        ("code", "{}"),
        ("dist", "{}"),
        ("ratio", "{:.4f}"),
        ("escape_rate", "{:.2e}"),
        ("encode_GBps", "{:.2f}"),
        ("h2d_raw_ms", "{:.3f}"),
        ("h2d_record_ms", "{:.3f}"),
        ("decode_ms", "{:.3f}"),
        ("decode_gpu_ms", "{:.3f}"),
        ("per_expert_lossless_ms", "{:.3f}"),
        ("speedup", "{:.3f}"),
        ("triton_exact", "{}"),
        ("torch_ref_exact", "{}"),
    ]
    print(f"expert {H}x{I} bf16 on {device}")
    print(" | ".join(c for c, _ in cols))
    for r in experts:
        print(" | ".join(f.format(r[c]) if r.get(c) is not None else "-" for c, f in cols))
    mcols = [
        "code",
        "placement",
        "logits_equal",
        "greedy_equal",
        "beam4_equal",
        "record_bytes",
        "raw_record_bytes",
        "within_budget",
    ]
    print("bundled mira-tiny, bf16, lossless vs unwrapped")
    print(" | ".join(mcols))
    for r in models:
        print(" | ".join(str(r[c]) for c in mcols))
    exact = all(r["torch_ref_exact"] and r["triton_exact"] in (True, None) for r in experts) and all(
        r["logits_equal"] and r["greedy_equal"] and r["beam4_equal"] for r in models
    )
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "smoke": args.smoke,
        "shape": shape,
        "torch": torch.__version__,
        "triton": module_version("triton"),
        "python": platform.python_version(),
        "reps": args.reps,
        "cpu_threads": torch.get_num_threads(),
        "wall_s": time.perf_counter() - t_start,
        "all_exact": exact,
        "experts": experts,
        "models": models,
    }
    path = args.out if args.out.endswith(".json") else os.path.join(args.out, "lossless_gpu_check.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"all exact: {exact}; wrote {path} ({result['wall_s']:.1f} s)")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
