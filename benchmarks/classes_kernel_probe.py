"""Where the classes-code decode kernel spends its time (GPU probe, one Mixtral-shaped tensor).

Times a copy of the library's kernel (`mira_hf.quant.triton_kernels._lossless_classes_kernel`, bf16
path) with parts replaced by constants (ablations: their output is wrong, only their time matters) and
one alternative prefix sum (a matmul with a triangular matrix on the tensor cores, exact: group bit
counts are small integers), over launch shapes, each exact variant checked bit for bit against the
torch reference; the nibble kernel on the same tensor for scale. Prints a table and writes JSON.
(`2026-11-30-nvidia-h200-classes-kernel-probe*.json` were measured on the earlier rank-table format,
whose exponent lookup was a gather: NOTES.md, "Transfer formats".)

    python benchmarks/classes_kernel_probe.py --out /tmp/probe.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_json  # noqa: E402
from timing import cuda_time_ms, graph_time_ms  # noqa: E402

from mira_hf.quant import LosslessCodec  # noqa: E402
from mira_hf.quant import triton_kernels as tk  # noqa: E402
from mira_hf.quant.lossless_bits import CLASS_BLOCK, decode_words_classes_torch  # noqa: E402
from mira_hf.quant.record import section_view  # noqa: E402


@triton.jit
def _probe_kernel(
    sm_ptr, cls_ptr, boff_ptr, extra_ptr, exps_ptr, out_ptr, n, n_blocks,
    SCAN: tl.constexpr, EXTRA: tl.constexpr, LUT: tl.constexpr, R: tl.constexpr, BLK: tl.constexpr,
):  # fmt: skip
    # the library kernel's bf16 PACK path; SCAN: 0 none (ablation), 1 associative_scan, 2 triangular dot
    G: tl.constexpr = BLK // 4
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * R + tl.arange(0, R)
    grp = (blk * G)[:, None] + tl.arange(0, G)[None, :]
    i = grp * 4
    gmask = i < n
    cb = tl.load(cls_ptr + grp, mask=gmask, other=0).to(tl.int32)
    c0, c1, c2, c3 = cb & 3, (cb >> 2) & 3, (cb >> 4) & 3, (cb >> 6) & 3
    n0, n1, n2 = tk._class_bits(c0), tk._class_bits(c1), tk._class_bits(c2)
    nbits = n0 + n1 + n2 + tk._class_bits(c3)
    if SCAN == 1:
        lb = tl.associative_scan(nbits, 1, tk._add) - nbits
    elif SCAN == 2:
        a = tl.arange(0, G)
        strict_upper = (a[:, None] < a[None, :]).to(tl.float16)  # [G, G]: sum over earlier groups
        lb = tl.dot(nbits.to(tl.float16), strict_upper, out_dtype=tl.float32).to(tl.int32)
    else:
        lb = nbits * 0
    if EXTRA:
        w = tk._group_fields(extra_ptr, boff_ptr, blk, n_blocks, lb, nbits, gmask)
    else:
        w = lb
    s4 = tl.load(sm_ptr + grp, mask=gmask, other=0)
    if LUT:
        t0, t1, t2, t3 = tl.load(exps_ptr), tl.load(exps_ptr + 1), tl.load(exps_ptr + 2), tl.load(exps_ptr + 3)
        lo = tl.load(exps_ptr + 4)
        x0 = tk._class_exponent(c0, w, t0, t1, t2, t3, lo)
        w = w >> n0
        x1 = tk._class_exponent(c1, w, t0, t1, t2, t3, lo)
        w = w >> n1
        x2 = tk._class_exponent(c2, w, t0, t1, t2, t3, lo)
        w = w >> n2
        x3 = tk._class_exponent(c3, w, t0, t1, t2, t3, lo)
    else:
        x0, x1, x2, x3 = c0 + w, c1 + w, c2 + w, c3 + w
    h0 = tk._class_high_word(s4 & 0xFF, x0)
    h1 = tk._class_high_word((s4 >> 8) & 0xFF, x1)
    h2 = tk._class_high_word((s4 >> 16) & 0xFF, x2)
    h3 = tk._class_high_word((s4 >> 24) & 0xFF, x3)
    word = h0.to(tl.int64) | (h1.to(tl.int64) << 16) | (h2.to(tl.int64) << 32) | (h3.to(tl.int64) << 48)
    tl.store(out_ptr + grp, word, mask=gmask)


VARIANTS = {  # name: (SCAN, EXTRA, LUT); "full" and "dot" decode correctly
    "full": (1, True, 1),
    "dot": (2, True, 1),
    "no-scan": (0, True, 1),
    "no-extra": (1, False, 1),
    "no-lut": (1, True, 0),
    "loads-only": (0, False, 0),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(1, 14336, 4096, generator=g, device=dev) * 0.02).bfloat16()
    codec = LosslessCodec(code="classes")
    layout = codec.plan_experts({"w": w})
    record = torch.empty(layout.nbytes, dtype=torch.uint8, device=dev)
    codec.encode({"w": w[0]}, layout, record)
    entry = layout.entry("w")
    n = entry.numel
    ref = decode_words_classes_torch(record, entry)
    sec = {s: section_view(record, entry.section(s)) for s in ("sm", "cls", "extra")}
    boff = section_view(record, entry.section("boff"), torch.int32)
    exps = section_view(record, entry.section("exps"), torch.int32)
    out = torch.empty(n, dtype=torch.int16, device=dev)
    n_blocks = triton.cdiv(n, CLASS_BLOCK)
    rows = []

    def library():
        tk.lossless_classes_decode(record, entry, out.view(torch.bfloat16))

    rows.append({"variant": "library", "ms": cuda_time_ms(library, args.reps), "gpu_ms": graph_time_ms(library, args.reps)})
    rows[-1]["exact"] = bool(torch.equal(out, ref))
    for name, (scan, extra, use_lut) in VARIANTS.items():
        for r, warps in ((1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (8, 4), (16, 4), (16, 8)):
            if scan == 2 and r < 16:
                continue  # tl.dot needs 16 rows

            def run(r=r, warps=warps, scan=scan, extra=extra, use_lut=use_lut):
                _probe_kernel[(triton.cdiv(n_blocks, r),)](
                    sec["sm"].view(torch.int32), sec["cls"], boff, sec["extra"], exps, out.view(torch.int64), n, n_blocks,
                    SCAN=scan, EXTRA=extra, LUT=use_lut, R=r, BLK=CLASS_BLOCK, num_warps=warps,
                )  # fmt: skip

            try:
                out.zero_()
                ms = cuda_time_ms(run, args.reps)
                row = {"variant": name, "R": r, "warps": warps, "ms": ms, "exact": bool(torch.equal(out, ref))}
            except Exception as exc:  # a shape a backend refuses: recorded, not fatal
                row = {"variant": name, "R": r, "warps": warps, "error": f"{type(exc).__name__}: {exc}"[:300]}
            rows.append(row)
            print(row, flush=True)
    # the nibble kernel on the same tensor, for scale
    nib = LosslessCodec()
    nlayout = nib.plan_experts({"w": w})
    nrecord = torch.empty(nlayout.nbytes, dtype=torch.uint8, device=dev)
    nib.encode({"w": w[0]}, nlayout, nrecord)
    rows.append(
        {
            "variant": "nibble-library",
            "ms": cuda_time_ms(lambda: tk.lossless_decode(nrecord, nlayout.entry("w"), out.view(torch.bfloat16)), args.reps),
        }
    )
    print(rows[0], rows[-1])
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "numel": n,
        "wall_s": time.perf_counter() - t0,
        "rows": rows,
    }
    path = os.path.join(args.out, "classes_kernel_probe.json") if os.path.isdir(args.out) else args.out
    write_json(path, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
