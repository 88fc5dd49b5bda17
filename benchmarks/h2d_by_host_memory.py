"""Host→device GB/s from freshly page-locked memory as the process holds more and more host memory.

    OUT=DIR python benchmarks/h2d_by_host_memory.py    # ~20 s on a GPU machine; writes DIR/ballast.json

Allocates a Mixtral-layer slab (2.82 GB, `mira_hf.pinned.pinned_empty`), times 8 record copies to the GPU,
then adds 8 GiB of touched ordinary memory ("ballast") and repeats, up to 48 GiB. On the H200 machine (one
NUMA node of 52 GB reported, 128 GB in all) copies from memory allocated after ~32 GiB of ballast ran at
45-47 GB/s instead of 55: where a store lands in host memory moves the copy speed, so systems built later
in one process can copy slower (benchmarks/NOTES.md, "Measuring").
"""

import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.getcwd())
from mira_hf.pinned import pinned_empty  # noqa: E402

RECORD = 352321536  # one Mixtral-8x7B expert in bf16


def bw(n: int = 8 * RECORD) -> float:
    """GB/s of 8 record copies from a fresh page-locked slab (after one warm-up copy)."""
    src = pinned_empty(n)
    src[::4096].fill_(1)
    dst = torch.empty(RECORD, dtype=torch.uint8, device="cuda")
    dst.copy_(src[:RECORD], non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for e in range(8):
        dst.copy_(src[e * RECORD : (e + 1) * RECORD], non_blocking=True)
    torch.cuda.synchronize()
    return 8 * RECORD / (time.perf_counter() - t) / 1e9


torch.empty(1, device="cuda")
out = {"fresh": bw()}
ballast = []
for gb in range(6):
    ballast.append(np.ones(8 * 2**30, dtype=np.uint8))
    out[f"after_{8 * (gb + 1)}GiB_ballast"] = bw()
    print(out, flush=True)
json.dump(out, open(os.path.join(os.environ["OUT"], "ballast.json"), "w"))
