"""Host time to issue one host→device copy of an expert-sized piece, and the speed it crosses at: torch's `copy_`
(inside a stream context, as the loader issues copies) against `cudaMemcpyAsync` called directly on the same
pointers, from memory page-locked in place (`mira_hf.pinned.pinned_empty`, cudaHostRegister) and from torch's
pinned allocator. Each variant runs twice (the first round includes one-time initialisation). Then the host time of
what else the loader does per copy (`ops`): a new event recorded on a stream, with timing and without, a stream
switch (`torch.cuda.stream` entered and left), a stream waiting for an event.

    python benchmarks/copy_issue_probe.py --out DIR     # GPU; DIR/DATE-DEVICE-copy-issue-probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from common import device_slug, environment, write_json  # noqa: E402

from mira_hf.pinned import pinned_empty  # noqa: E402

PIECE = 6 * 2**20  # a Qwen3-30B-A3B expert's gate_up_proj in bf16
COPIES = 60
OPS = 2000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="", help="appended to the file name")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.cuda.init()
    stream = torch.cuda.Stream(dev)
    with open("/proc/self/maps") as maps:
        path = next(line.split()[-1] for line in maps if "/libcudart.so" in line)
    runtime = ctypes.CDLL(path)
    runtime.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    sources = {"registered": pinned_empty(1 << 30), "torch_pinned": torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)}
    dst = torch.empty(PIECE, dtype=torch.uint8, device=dev)

    def torch_copy(src, at):
        with torch.cuda.stream(stream):
            dst.copy_(src[at : at + PIECE], non_blocking=True)

    def direct_copy(src, at):
        assert runtime.cudaMemcpyAsync(dst.data_ptr(), src.data_ptr() + at, PIECE, 1, stream.cuda_stream) == 0

    rows = []
    for rnd in range(2):
        for memory, src in sources.items():
            for how, fn in (("torch copy_", torch_copy), ("cudaMemcpyAsync", direct_copy)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i in range(COPIES):
                    fn(src, (i * PIECE) % (src.numel() - PIECE))
                issued = time.perf_counter() - t0
                torch.cuda.synchronize()
                total = time.perf_counter() - t0
                rows.append(
                    dict(round=rnd, memory=memory, copy=how, issue_us=1e6 * issued / COPIES, gbps=PIECE * COPIES / total / 1e9)
                )
                print(rows[-1])
    done = torch.cuda.Event()
    done.record(stream)
    kept = []  # the events stay alive until the end (destroying them is timed apart)
    ops = {
        "event_timing_record": lambda: kept.append(_recorded(stream, True)),
        "event_plain_record": lambda: kept.append(_recorded(stream, False)),
        "stream_switch": lambda: _switch(stream),
        "stream_wait_event": lambda: stream.wait_event(done),
    }
    op_us = {}
    for rnd in range(2):
        for name, fn in ops.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(OPS):
                fn()
            op_us[f"{name}_round{rnd}"] = 1e6 * (time.perf_counter() - t0) / OPS
        t0 = time.perf_counter()
        n = len(kept)
        kept.clear()
        op_us[f"event_destroy_round{rnd}"] = 1e6 * (time.perf_counter() - t0) / n
    print(op_us)
    env = environment()
    write_json(
        os.path.join(
            args.out,
            f"{time.strftime('%Y-%m-%d')}-{device_slug(env)}-copy-issue-probe{'-' + args.label if args.label else ''}.json",
        ),
        dict(environment=env, piece_bytes=PIECE, copies=COPIES, rows=rows, ops=OPS, op_us=op_us),
    )


def _recorded(stream, timing: bool):
    ev = torch.cuda.Event(enable_timing=timing)
    ev.record(stream)
    return ev


def _switch(stream) -> None:
    with torch.cuda.stream(stream):
        pass


if __name__ == "__main__":
    main()
