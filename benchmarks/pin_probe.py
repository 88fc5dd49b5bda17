"""Host memory and copy speed of a pinned expert slab: torch's pinned allocator against `mira_hf.pinned`.

    python benchmarks/pin_probe.py --out DIR     # ~1 minute on a GPU machine; writes DIR/<date>-<device>-pin-probe.json

For slab sizes of real models (a Mixtral-8x7B layer of bf16 experts, its lossless records, a Qwen3-30B
layer), allocates the slab both ways and reports the host memory it takes (drop of MemAvailable), the
allocation time, and host→device GB/s of whole-record copies from it to the GPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import device_slug, environment, print_table, write_json  # noqa: E402

from mira_hf.pinned import pinned_empty  # noqa: E402
from mira_hf.resources import available_host_bytes  # noqa: E402

GB = 1e9
SLABS = {  # name: (experts, record bytes)
    "mixtral layer bf16": (8, 3 * 4096 * 14336 * 2),
    "mixtral layer lossless": (8, 243_023_360),
    "qwen3-30b layer bf16": (128, 3 * 2048 * 768 * 2),
}


def measure(name: str, experts: int, record: int, how: str) -> dict:
    gc.collect()
    time.sleep(0.5)
    before = available_host_bytes()
    t0 = time.perf_counter()
    if how == "torch":
        slab = torch.empty(experts * record, dtype=torch.uint8, pin_memory=True)
    else:
        slab = pinned_empty(experts * record)
    slab.view(experts, record)[:, ::4096].fill_(1)  # touch every page (torch's pinned pages are touched already)
    alloc_s = time.perf_counter() - t0
    time.sleep(0.5)
    after = available_host_bytes()
    dst = torch.empty(record, dtype=torch.uint8, device="cuda")
    records = slab.view(experts, record)
    dst.copy_(records[-1], non_blocking=True)  # warm-up: the first copy from fresh memory maps its pages
    torch.cuda.synchronize()
    n = min(experts, 8)
    t0 = time.perf_counter()
    for e in range(n):
        dst.copy_(records[e], non_blocking=True)
    torch.cuda.synchronize()
    gbps = n * record / (time.perf_counter() - t0) / GB
    row = {
        "slab": name,
        "allocator": how,
        "slab_gb": experts * record / GB,
        "host_gb_taken": (before - after) / GB if before is not None and after is not None else None,
        "alloc_s": alloc_s,
        "h2d_gbps": gbps,
        "is_pinned": bool(slab.is_pinned()),
    }
    del slab, records, dst
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    time.sleep(0.5)
    freed = available_host_bytes()
    row["host_gb_kept_after_free"] = (before - freed) / GB if before is not None and freed is not None else None
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("pin_probe: needs a CUDA device", file=sys.stderr)
        return 2
    torch.empty(1, device="cuda")
    rows = []
    for name, (experts, record) in SLABS.items():
        for how in ("mira", "torch"):  # mira first: torch's allocator keeps its blocks cached after the free
            rows.append(measure(name, experts, record, how))
            print(rows[-1], flush=True)
    print_table(rows, list(rows[0]))
    env = environment()
    out = {"env": env, "command": " ".join(["python"] + sys.argv), "rows": rows}
    path = os.path.join(args.out, f"{env['date']}-{device_slug(env, True)}-pin-probe.json")
    write_json(path, out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
