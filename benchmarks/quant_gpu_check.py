"""GPU check of the packed expert codecs: Triton kernels vs the torch reference, and timings.

For a Mixtral expert (H=4096, I=14336) and a small one (H=192, I=384), bf16 random weights,
and each codec (int8, int4, nf4 when bitsandbytes imports):

    bytes per expert, metadata share, pinned H2D time of one record (vs the bf16 expert),
    dequant time into bf16 (Triton; bitsandbytes for nf4), fused linear time (gate_up + down) at
    T=1 and T=8, max/mean relative error vs the original weights, and kernel-vs-reference
    agreement (max abs diff of the dequantised weights, max relative diff of linear outputs).

Times are medians of CUDA-event timings: `*_ms` eager (host launch overhead included, as an
eager runtime sees it) and `*_gpu_ms` from CUDA-graph replays (GPU time only).

Prints a table and writes DIR/quant_gpu_check.json. Runs in well under 90 s on an H200.

    python benchmarks/quant_gpu_check.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import module_version, write_json  # noqa: E402
from timing import cuda_time_ms, graph_time_ms  # noqa: E402

from mira_hf.quant import make_codec, triton_available  # noqa: E402

SHAPES = {"mixtral": (4096, 14336), "small": (192, 384)}  # (H, I)
TOKENS = (1, 8)


def rel_errors(w: torch.Tensor, w_hat: torch.Tensor) -> dict[str, float]:
    w, d = w.float(), (w_hat.float() - w.float())
    return {
        "rel_fro": (d.norm() / w.norm()).item(),  # ||w - w_hat|| / ||w||
        "max_rel": (d.abs().max() / w.abs().max()).item(),  # max |w - w_hat| / max |w|
        "mean_rel": (d.abs().mean() / w.abs().mean()).item(),  # mean |w - w_hat| / mean |w|
    }


def check_codec(codec_name: str, shape_name: str, H: int, I: int, reps: int) -> dict:  # noqa: E741
    dev = torch.device("cuda")
    torch.manual_seed(0)
    # standard HF layout: F.linear(x, W); transposed copies check the x @ W path
    weights = {
        "gate_up_proj": torch.randn(2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02,
        "down_proj": torch.randn(H, I, device=dev, dtype=torch.bfloat16) * 0.02,
    }
    codec = make_codec(codec_name)
    layout = codec.plan({k: (tuple(v.shape), v.dtype) for k, v in weights.items()})
    rec_gpu = torch.empty(layout.nbytes, dtype=torch.uint8, device=dev)
    t0 = time.perf_counter()
    codec.encode(weights, layout, rec_gpu)  # plain torch ops: quantising on the GPU is quick
    torch.cuda.synchronize()
    encode_s = time.perf_counter() - t0
    rec_host = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=True)
    rec_host.copy_(rec_gpu)
    dense_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    dense_host = torch.empty(dense_bytes, dtype=torch.uint8, pin_memory=True)
    dense_dev = torch.empty_like(dense_host, device=dev)

    row: dict = {
        "codec": codec_name,
        "shape": shape_name,
        "H": H,
        "I": I,
        "bytes_per_expert": layout.nbytes,
        "bf16_bytes_per_expert": dense_bytes,
        "compression": dense_bytes / layout.nbytes,
        "meta_share": layout.meta_share,
        "encode_gpu_s": encode_s,
    }
    row["h2d_ms"] = cuda_time_ms(lambda: rec_gpu.copy_(rec_host, non_blocking=True), reps)
    row["h2d_bf16_ms"] = cuda_time_ms(lambda: dense_dev.copy_(dense_host, non_blocking=True), reps)
    row["h2d_GBps"] = layout.nbytes / row["h2d_ms"] / 1e6

    out = {k: torch.empty_like(v) for k, v in weights.items()}
    kw = {} if codec_name == "nf4" else {"backend": "torch"}
    ref = codec.decode(rec_gpu, layout, torch.bfloat16, **kw)
    row["dequant_ms"] = cuda_time_ms(lambda: codec.decode(rec_gpu, layout, torch.bfloat16, out=out), reps)
    row["dequant_gpu_ms"] = graph_time_ms(lambda: codec.decode(rec_gpu, layout, torch.bfloat16, out=out), reps)
    if codec_name != "nf4":
        row["dequant_ref_ms"] = cuda_time_ms(lambda: codec.decode(rec_gpu, layout, torch.bfloat16, backend="torch"), reps)
    got = codec.decode(rec_gpu, layout, torch.bfloat16, out=out)
    row["dequant_vs_ref_max_abs"] = max((got[k].float() - ref[k].float()).abs().max().item() for k in weights)
    errs = {k: rel_errors(weights[k], got[k]) for k in weights}
    for key in ("rel_fro", "max_rel", "mean_rel"):
        row[f"w_{key}"] = max(e[key] for e in errs.values())

    # placement (b): fused linear vs x @ decode(W).T, and vs a resident bf16 matmul
    agree = []
    for T in TOKENS:
        x_gu = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        x_dn = torch.randn(T, I, device=dev, dtype=torch.bfloat16)
        for name, x in (("gate_up_proj", x_gu), ("down_proj", x_dn)):
            y = codec.linear(x, rec_gpu, layout, name, False)
            y_ref = x @ ref[name].T
            agree.append(((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item())

        def fused(x_gu=x_gu, x_dn=x_dn):
            codec.linear(x_gu, rec_gpu, layout, "gate_up_proj", False)
            codec.linear(x_dn, rec_gpu, layout, "down_proj", False)

        def dense(x_gu=x_gu, x_dn=x_dn):
            x_gu @ weights["gate_up_proj"].T
            x_dn @ weights["down_proj"].T

        row[f"linear_T{T}_ms"] = cuda_time_ms(fused, reps)
        row[f"linear_T{T}_gpu_ms"] = graph_time_ms(fused, reps)
        row[f"dense_bf16_T{T}_ms"] = cuda_time_ms(dense, reps)
    if codec_name != "nf4":  # transposed layout ([in, out], x @ W) through the same kernel
        wt = {"gate_up_t": weights["gate_up_proj"].T.contiguous(), "down_t": weights["down_proj"].T.contiguous()}
        lt = codec.plan({k: (tuple(v.shape), v.dtype) for k, v in wt.items()})
        rt = torch.empty(lt.nbytes, dtype=torch.uint8, device=dev)
        codec.encode(wt, lt, rt)
        ref_t = codec.decode(rt, lt, torch.bfloat16, backend="torch")
        for T in TOKENS:
            for name, k in (("gate_up_t", H), ("down_t", I)):
                x = torch.randn(T, k, device=dev, dtype=torch.bfloat16)
                y = codec.linear(x, rt, lt, name, True)
                y_ref = x @ ref_t[name]
                agree.append(((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item())
        x1 = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
        row["linear_T1_transposed_gate_up_gpu_ms"] = graph_time_ms(lambda: codec.linear(x1, rt, lt, "gate_up_t", True), reps)
    row["linear_vs_ref_max_rel"] = max(agree)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for quant_gpu_check.json")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions (median reported)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("quant_gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if not triton_available():
        print("quant_gpu_check: triton is not importable: timings below are the torch reference", file=sys.stderr)
    codecs = ["int8", "int4"]
    try:
        import bitsandbytes  # noqa: F401

        codecs.append("nf4")
    except ImportError:
        print("quant_gpu_check: bitsandbytes not importable, nf4 skipped", file=sys.stderr)

    t_start = time.perf_counter()
    rows = []
    for shape_name, (H, I) in SHAPES.items():  # noqa: E741
        for codec_name in codecs:
            rows.append(check_codec(codec_name, shape_name, H, I, args.reps))
            torch.cuda.empty_cache()

    cols = [
        ("shape", "{}"),
        ("codec", "{}"),
        ("bytes_per_expert", "{:,}"),
        ("meta_share", "{:.2%}"),
        ("h2d_ms", "{:.3f}"),
        ("h2d_bf16_ms", "{:.3f}"),
        ("dequant_ms", "{:.3f}"),
        ("dequant_gpu_ms", "{:.3f}"),
        ("linear_T1_ms", "{:.3f}"),
        ("linear_T1_gpu_ms", "{:.3f}"),
        ("linear_T8_gpu_ms", "{:.3f}"),
        ("dense_bf16_T1_ms", "{:.3f}"),
        ("w_rel_fro", "{:.2e}"),
        ("w_max_rel", "{:.2e}"),
        ("dequant_vs_ref_max_abs", "{:.1e}"),
        ("linear_vs_ref_max_rel", "{:.1e}"),
    ]
    print(" | ".join(c for c, _ in cols))
    for r in rows:
        print(" | ".join(f.format(r[c]) if r.get(c) is not None else "-" for c, f in cols))
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": module_version("triton"),
        "bitsandbytes": module_version("bitsandbytes"),
        "python": platform.python_version(),
        "reps": args.reps,
        "wall_s": time.perf_counter() - t_start,
        "rows": rows,
    }
    path = os.path.join(args.out, "quant_gpu_check.json")
    write_json(path, result)
    print(f"wrote {path} ({result['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
