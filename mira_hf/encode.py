"""Encoding expert records at load time: where the codec computes, and how many experts at once.

A codec whose records are computed from the weights (lossless, int8/int4) costs a pass over every
expert at load. `RecordEncoder` runs that pass on the CUDA device when the model has one (each expert
is copied there, encoded into a device record and copied back: the host only moves bytes), else on
host threads, several experts at once (torch releases the GIL inside its ops). Either way the record's
bits are those of the codec's own `encode`: the device only changes where the same ops run.

Device memory while loading: one expert's tensors, one record and the codec's temporaries (bounded
by its step size, ~1 GB for the lossless code), given back when the load ends; it is not taken from
`gpu_budget`, which the cache allocates afterwards.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

Expert = Callable[[int], Mapping[str, torch.Tensor]]  # e -> {tensor name: expert e's tensor}


def default_workers() -> int:
    """Host threads for encoding on a CPU: the cores this process may use, at most 16."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 16))


class RecordEncoder:
    """Computes expert records (and the layouts that depend on the weights) on one device.

    device: where the codec computes: a CUDA device, or the CPU (`workers` experts at once).
    progress: a byte-counting progress bar (tqdm) per pass.
    """

    def __init__(self, device: torch.device | str = "cpu", workers: int | None = None, progress: bool = False) -> None:
        self.device = torch.device(device)
        # On a GPU one expert at a time: the device is busy with one expert's ops already, and the
        # host's part (reading the next expert) overlaps through the copy.
        self.workers = 1 if self.device.type != "cpu" else (workers or default_workers())
        self.progress = progress
        self.experts_encoded = 0  # experts encoded by this encoder (tests count them)
        self._lock = threading.Lock()
        self._buffers = threading.local()
        self._bar = None

    def __repr__(self) -> str:
        return f"RecordEncoder(device={str(self.device)!r}, workers={self.workers})"

    # -- the two passes --------------------------------------------------------------------------
    def plan_layer(self, codec, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], num_experts: int, expert: Expert):
        """The layer's record layout; a codec that plans from the weights (`expert_sizes`,
        `plan_from_sizes`) reads every expert here, on this encoder's device."""
        sizes_of = getattr(codec, "expert_sizes", None)
        if sizes_of is None:
            return codec.plan(specs)
        nbytes = _raw_bytes(specs)
        sizes = self._map(num_experts, lambda e: sizes_of(self._here(expert(e))), nbytes, f"planning {codec.name} records")
        return codec.plan_from_sizes(specs, sizes)

    def encode_layer(
        self,
        codec,
        layout,
        num_experts: int,
        expert: Expert,
        sink: Callable[[int, torch.Tensor], None],
        extra: dict | None = None,
    ) -> None:
        """Encode every expert of a layer; `sink(e, record)` takes each record (a host uint8 tensor
        [layout.nbytes], valid until `sink` returns; called from worker threads on a CPU)."""
        extra = extra or {}

        def one(e: int) -> None:
            record = self._record(layout.nbytes)
            codec.encode(self._here(expert(e)), layout, record, **extra)
            host = record if record.device.type == "cpu" else self._host_record(layout.nbytes).copy_(record)
            sink(e, host)
            with self._lock:
                self.experts_encoded += 1

        self._map(num_experts, one, _entries_bytes(layout), f"encoding {codec.name} records")

    def encode_into(self, codec, layout, num_experts: int, expert: Expert, slab: torch.Tensor, extra: dict | None = None) -> None:
        """`encode_layer` into the rows of a host slab [E, layout.nbytes]: a CPU encoder writes each
        record in place, a device encoder copies it there."""
        if self.device.type == "cpu":
            extra = extra or {}

            def one(e: int) -> None:
                codec.encode(self._here(expert(e)), layout, slab[e], **extra)
                with self._lock:
                    self.experts_encoded += 1

            self._map(num_experts, one, _entries_bytes(layout), f"encoding {codec.name} records")
        else:
            self.encode_layer(codec, layout, num_experts, expert, lambda e, record: slab[e].copy_(record), extra)

    def finish(self) -> None:
        """Give back the device memory the encoding used (its buffers and the allocator's cache)."""
        self._buffers = threading.local()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    @contextmanager
    def progress_pass(self, desc: str, total_bytes: int):
        """One progress bar (bytes of weights, ETA) over every layer encoded or planned inside."""
        self._bar = _bar(self.progress and total_bytes > 0, total_bytes, desc)
        try:
            yield
        finally:
            if self._bar is not None:
                self._bar.close()
            self._bar = None

    # -- helpers -------------------------------------------------------------------------------
    def _here(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: t if t.device == self.device else t.to(self.device) for n, t in tensors.items()}

    def _record(self, nbytes: int) -> torch.Tensor:
        """This thread's record buffer on the device (reused expert after expert)."""
        buf = getattr(self._buffers, "record", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers.record = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]

    def _host_record(self, nbytes: int) -> torch.Tensor:
        """This thread's host buffer a device record is copied into (pinned: the copy runs at link speed)."""
        buf = getattr(self._buffers, "host", None)
        if buf is None or buf.numel() < nbytes:
            pin = self.device.type == "cuda"
            buf = self._buffers.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        return buf[:nbytes]

    def _map(self, n: int, fn: Callable[[int], object], nbytes_each: int, desc: str) -> list:
        own = self._bar is None  # a layer on its own gets its own bar
        bar = _bar(self.progress, n * nbytes_each, desc) if own else self._bar
        try:
            if self.workers == 1 or n == 1:
                out = []
                for e in range(n):
                    out.append(fn(e))
                    bar and bar.update(nbytes_each)
                return out
            with ThreadPoolExecutor(min(self.workers, n), thread_name_prefix="mira-encode") as pool:
                futures = [pool.submit(fn, e) for e in range(n)]
                out = []
                for f in futures:  # in order: the first failure is raised, the rest finish or are dropped
                    out.append(f.result())
                    bar and bar.update(nbytes_each)
                return out
        finally:
            if own and bar is not None:
                bar.close()


def _raw_bytes(specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    n = 0
    for shape, dtype in specs.values():
        k = dtype.itemsize
        for d in shape:
            k *= d
        n += k
    return n


def _entries_bytes(layout) -> int:
    entries = getattr(layout, "entries", None)
    return sum(e.numel * e.dtype.itemsize for e in entries) if entries else layout.nbytes


def _bar(enabled: bool, total: int, desc: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)


def encoder_for(device: torch.device, expert_bytes: int, progress: bool) -> RecordEncoder:
    """Encode on `device` when it is a CUDA device with room for one expert, its record and the codec's
    temporaries (~1 GB), else on host threads."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if free > 2 * expert_bytes + 2**31:
            return RecordEncoder(device, progress=progress)
    return RecordEncoder("cpu", progress=progress)
