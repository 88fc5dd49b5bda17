"""Timing helpers shared by the GPU check scripts (medians; CUDA events on the GPU)."""

from __future__ import annotations

import statistics
import sys
import time

import torch


def cuda_time_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() over `reps` eager runs, timed with CUDA events (includes the
    host's launch overhead whenever the GPU waits for it, as the runtime would see it)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_time_ms(fn, reps: int, calls: int = 10) -> float | None:
    """Median GPU-only milliseconds of fn(): `calls` runs captured in one CUDA graph, replayed
    `reps` times (no host overhead). None if fn cannot be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError as exc:
        print(f"graph capture failed ({exc!r:.120}); eager timings only", file=sys.stderr)
        torch.cuda.synchronize()
        return None
    return cuda_time_ms(graph.replay, reps, warmup=1) / calls


def cpu_time_ms(fn, reps: int) -> float:
    """Median wall-clock milliseconds of fn() over `reps` runs, after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
