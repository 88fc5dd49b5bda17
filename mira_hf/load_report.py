"""Where a load's time goes: seconds and bytes per stage, from cheap wall-clock counters.

`from_pretrained` fills one `LoadReport`; `model.mira_load_report()` returns it. Host stages are timed
with `perf_counter` around work the loader does anyway; device stages (encoding, the copy of records
back to the host) with CUDA events on the encoder's stream, read once the load has synchronised at its
end, so measuring adds no synchronisation to the per-expert loop. On the CPU a device stage is timed
like a host one.

Stages run on several threads at once (a reader ahead of the encoder, the record-cache writer in the
background), so their seconds add up to more than the load's wall time; `wait` is the time the encoder
spent waiting for the reader, which is what reading costs the load beyond its overlap. Device spans are
stream time between two events: work another thread queued on the same stream in between is counted too.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch

# stage -> what it measures (the order a load goes through them)
STAGES = {
    "download": "resolving a hub id's shards in the Hugging Face cache, downloading those not there (within model)",
    "model": "transformers loading the model without its routed experts (non-expert weights)",
    "read": "reading expert pieces from the checkpoint's shards and casting them (host threads)",
    "h2d": "copying the read pieces to the encoding device",
    "plan": "sizing records from the weights (lossless plan pass, on the encoding device)",
    "pin": "allocating and page-locking the store's host slabs (ahead, on a background thread, when planned)",
    "pin_wait": "the loader waiting for a slab page-locked ahead",
    "encode": "encoding records (on the encoding device)",
    "d2h": "copying encoded records into the host slabs",
    "copy": "copying uncompressed experts into the host slabs",
    "cache_read": "reading records from the record cache (checksums included)",
    "wait": "the encoder waiting for the next expert to be read",
    "cache_write": "writing the record cache (in the background: after the load returned)",
}


class LoadReport:
    """Seconds and bytes per stage of one load (`STAGES`), and the load's wall time. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}
        self._bytes: dict[str, int] = {}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event, int]] = []
        self._start = time.perf_counter()
        self.wall_s: float | None = None  # from the report's creation to `finish`

    def add(self, stage: str, seconds: float, nbytes: int = 0) -> None:
        if stage not in STAGES:
            raise KeyError(f"unknown load stage {stage!r}; known: {', '.join(STAGES)}")
        with self._lock:
            self._seconds[stage] = self._seconds.get(stage, 0.0) + seconds
            self._bytes[stage] = self._bytes.get(stage, 0) + nbytes

    @contextmanager
    def span(self, stage: str, nbytes: int = 0):
        """Time the block (wall clock) as `stage`, moving `nbytes`."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - t0, nbytes)

    @contextmanager
    def device_span(self, stage: str, device: torch.device, nbytes: int = 0):
        """Time the work the block queues on `device`'s current stream (CUDA events, read at `finish`),
        or the block itself on the CPU."""
        if device.type != "cuda":
            with self.span(stage, nbytes):
                yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(device))
        try:
            yield
        finally:
            end.record(torch.cuda.current_stream(device))
            with self._lock:
                self._events.append((stage, start, end, nbytes))

    def finish(self) -> None:
        """The load has returned: read the device spans (waiting for their last event) and the wall time."""
        with self._lock:
            events, self._events = self._events, []
        for stage, start, end, nbytes in events:
            end.synchronize()
            self.add(stage, start.elapsed_time(end) / 1e3, nbytes)
        if self.wall_s is None:
            self.wall_s = time.perf_counter() - self._start

    def as_dict(self) -> dict:
        """{"wall_s": load seconds, "stages": {stage: {"seconds", "bytes", "gbps"}}} for the stages seen."""
        with self._lock:
            stages = {
                s: dict(
                    seconds=self._seconds[s],
                    bytes=self._bytes[s],
                    gbps=self._bytes[s] / self._seconds[s] / 1e9 if self._bytes[s] and self._seconds[s] > 0 else None,
                )
                for s in STAGES
                if s in self._seconds
            }
        return dict(wall_s=self.wall_s, stages=stages)

    def __str__(self) -> str:
        d = self.as_dict()
        parts = []
        for stage, v in d["stages"].items():
            rate = f", {v['bytes'] / 1e9:.2f} GB at {v['gbps']:.2f} GB/s" if v["gbps"] else ""
            parts.append(f"{stage} {v['seconds']:.2f} s{rate}")
        wall = f"{d['wall_s']:.2f} s" if d["wall_s"] is not None else "running"
        return f"load {wall}: " + "; ".join(parts)

    def __repr__(self) -> str:
        return f"LoadReport({self})"
