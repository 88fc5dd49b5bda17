"""Whether the device can wait for the host without the host waiting: a stream told to wait for a value in
page-locked host memory (the driver's `cuStreamWaitValue32`), which a host thread writes when its work is done.

With `host_compute="split"`, the thread that drives the device waits for each block's host parts before it queues
the block's combine and the next layer's launches. Told to wait on the device instead, the stream holds the combine
until the host thread writes its flag, and the driving thread queues on (built so and measured, not kept: NOTES.md,
"Host compute"). This probe checks, on the device:

    available       the driver has the call and the stream accepts a wait on host memory
    holds           a queued kernel has not run 20 ms later, before the flag is written (false where that kernel's
                    launch, a first one, loads its module: the launch then waits for the stream, holding the thread)
    release_us      from the host's write of the flag to the held work's end (median of 20)
    data_ok         a copy queued after the wait reads what the host wrote before the flag (200 trials)
    issue_us        the host's cost of queueing one wait (median of 1000)
    threaded        a worker thread computes a quarter of a Mixtral-size expert (bf16, one row) and writes its
                    output and the flag; the driving thread queues the wait, the copy back and 40 small kernels
                    without waiting: its time to queue them against waiting for the worker first

    python benchmarks/device_wait_probe.py --out benchmarks/results/     # GPU: ~20 s
Writes OUT/<date>-<device>-device-wait-probe.json.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import os
import statistics
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import device_slug, environment, write_json  # noqa: E402

WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ


def driver_wait():
    """(cuStreamWaitValue32, cuMemHostGetDevicePointer) from the CUDA driver, or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    wait = getattr(lib, "cuStreamWaitValue32_v2", None) or getattr(lib, "cuStreamWaitValue32", None)
    devptr = getattr(lib, "cuMemHostGetDevicePointer_v2", None) or getattr(lib, "cuMemHostGetDevicePointer", None)
    if wait is None or devptr is None:
        return None
    wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    wait.restype = ctypes.c_int
    devptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    devptr.restype = ctypes.c_int
    return wait, devptr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("device_wait_probe: needs a CUDA device", file=sys.stderr)
        return 2
    torch.cuda.init()
    faulthandler.dump_traceback_later(60, exit=True)  # a wait never released: the stacks, then exit
    result: dict = {"env": environment()}
    fns = driver_wait()
    result["available"] = fns is not None
    if fns is None:
        return _write(args, result)
    wait, devptr = fns
    flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    dptr = ctypes.c_uint64()
    rc = devptr(ctypes.byref(dptr), ctypes.c_void_p(flag.data_ptr()), 0)
    result["devptr_rc"], result["devptr_equals_host"] = rc, dptr.value == flag.data_ptr()
    stream = torch.cuda.current_stream()
    handle = ctypes.c_void_p(stream.cuda_stream)
    x = torch.ones(1024, device="cuda")

    def queue_wait(value: int) -> int:
        return wait(handle, dptr.value, value, WAIT_GEQ)

    rc = queue_wait(1)
    result["wait_rc"] = rc
    print(result, flush=True)
    if rc != 0:
        flag[0] = 1
        torch.cuda.synchronize()
        result["available"] = False
        return _write(args, result)
    # Every flag is written by another thread, started before anything is queued, as the host worker would: the
    # driving thread may block in a launch (a kernel's first launch loads its module) while its stream waits.
    releaser = _release(flag, 1, 0.05)
    done = torch.cuda.Event()
    (x * 2).sum()
    done.record()
    time.sleep(0.02)
    result["holds"] = not done.query()
    releaser.join()
    done.synchronize()
    print(result, flush=True)

    releases, value = [], 1
    for _ in range(20):
        value += 1
        written: list[float] = []
        releaser = _release(flag, value, 0.005, written)
        queue_wait(value)
        y = x * 2
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        releases.append(1e6 * (time.perf_counter() - written[0]))
        releaser.join()
        del y
    result["release_us"] = statistics.median(releases)
    print(result, flush=True)

    src = torch.zeros(4096, dtype=torch.bfloat16, pin_memory=True)
    ok = 0
    for i in range(200):
        value += 1
        releaser = _release(flag, value, 0.002, fill=(src, float(i % 97)))
        queue_wait(value)
        dst = src.to("cuda", non_blocking=True)
        releaser.join()
        ok += bool((dst == float(i % 97)).all().item())
        torch.cuda.synchronize()
    result["data_ok"], result["data_trials"] = ok, 200
    print(result, flush=True)

    flag[0] = value + 10**6  # every wait below is already met: only the host's cost of queueing it
    torch.cuda.synchronize()
    issue = []
    for _ in range(1000):
        t0 = time.perf_counter()
        queue_wait(value)
        issue.append(1e6 * (time.perf_counter() - t0))
    torch.cuda.synchronize()
    result["issue_us"] = statistics.median(issue)
    print(result, flush=True)
    value += 10**6

    result["threaded"] = _threaded(queue_wait, flag, value)
    return _write(args, result)


def _release(flag, value: int, delay: float, written: list | None = None, fill=None) -> threading.Thread:
    """A thread that, after `delay` seconds, fills `fill` = (tensor, value) if given, then writes `value` to `flag`."""

    def run() -> None:
        time.sleep(delay)
        if fill is not None:
            fill[0].fill_(fill[1])
        if written is not None:
            written.append(time.perf_counter())
        flag[0] = value

    t = threading.Thread(target=run)
    t.start()
    return t


def _threaded(queue_wait, flag: torch.Tensor, value: int) -> dict:
    """A worker computes a host part; the driving thread queues the dependent work with and without waiting."""
    H, share = 4096, 3584  # a quarter of Mixtral's 14336 neurons
    w_up = torch.randn(2 * share, H, dtype=torch.bfloat16)
    w_down = torch.randn(H, share, dtype=torch.bfloat16)
    row = torch.randn(1, H, dtype=torch.bfloat16)
    out = torch.empty(1, H, dtype=torch.bfloat16, pin_memory=True)
    acc = torch.zeros(1, H, dtype=torch.bfloat16, device="cuda")

    def part(release: int | None) -> None:
        gate, up = (row @ w_up.t()).chunk(2, dim=-1)
        out.copy_((torch.nn.functional.silu(gate) * up) @ w_down.t())
        if release is not None:
            flag[0] = release

    def dependent() -> None:
        acc.add_(out.to("cuda", non_blocking=True))
        for _ in range(40):
            acc.mul_(1.0)

    rows = {"blocking_ms": [], "device_wait_ms": [], "part_ms": []}
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        part(None)
        rows["part_ms"].append(1e3 * (time.perf_counter() - t0))
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        worker = threading.Thread(target=part, args=(None,))
        worker.start()
        worker.join()
        dependent()
        rows["blocking_ms"].append(1e3 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
        value += 1
        t0 = time.perf_counter()
        worker = threading.Thread(target=part, args=(value,))
        worker.start()
        queue_wait(value)
        dependent()
        rows["device_wait_ms"].append(1e3 * (time.perf_counter() - t0))
        worker.join()
        torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in rows.items()}


def _write(args, result: dict) -> int:
    print(result, flush=True)
    path = os.path.join(args.out, f"{result['env']['date']}-{device_slug(result['env'], True)}-device-wait-probe.json")
    write_json(path, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
