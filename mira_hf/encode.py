"""Encoding expert records at load time: where the codec computes, and how many experts at once.

A codec whose records are computed from the weights (lossless, int8/int4) costs a pass over every
expert at load. `RecordEncoder` runs that pass on the CUDA device when the model has one (each expert
is copied there, encoded into a device record and copied back: the host only moves bytes), else on
host threads, several experts at once (torch releases the GIL inside its ops). Either way the record's
bits are those of the codec's own `encode`: the device only changes where the same ops run.

Device memory while loading: one expert's tensors, one record and the codec's temporaries (bounded
by its step size, ~1 GB for the lossless code), given back when the load ends; it is not taken from
`gpu_budget`, which the cache allocates afterwards.

The way back (`decode_layer`: `state_dict()`, `save_pretrained`, `unload()`, writes and casts) runs where the
records were encoded too, for codecs whose values do not depend on where they are decoded (`exact`): the host's
decode of lossless records is several times slower than the save around it (benchmarks/NOTES.md, "Saving").
Device memory for one expert at a time, given back after each layer; where the device has no room for it, the
host decodes.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch

from .cpu_threads import own_cpu_threads
from .load_report import LoadReport

Expert = Callable[[int], Mapping[str, torch.Tensor]]  # e -> {tensor name: expert e's tensor}
Alloc = Callable[..., torch.Tensor]  # (shape, dtype=...) -> a new tensor, as torch.empty
T = TypeVar("T")
# Threads reading experts ahead of the encoder (each `pread`s one expert's pieces with the GIL released):
# one thread copies the page cache at ~1.3 GB/s (benchmarks/NOTES.md, "Loading"); memory bandwidth and
# the host-to-device link allow several times that.
READERS = 8
# Device memory left free beside a decode on the device (`RecordEncoder.decode_layer`), for a model that runs meanwhile.
DECODE_MARGIN_BYTES = 2**30
# The page-locked buffers a decode on the device copies its tensors back through (two; torch's allocator keeps them).
BACK_CHUNK_BYTES = 32 * 2**20


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

    def __init__(
        self,
        device: torch.device | str = "cpu",
        workers: int | None = None,
        progress: bool = False,
        stash_bytes: int = 0,
        report: LoadReport | None = None,
        readers: int | None = None,
    ) -> None:
        """stash_bytes: device memory (outside the cache budget, only while loading) that keeps experts
        read for planning until they are encoded, so each is read from the checkpoint and copied to the
        device once; experts beyond it are read again. report: where the load's stage timings go.
        readers: threads reading experts ahead of the encoder (default: `READERS`, at most the cores)."""
        self.device = torch.device(device)
        self.report = report if report is not None else LoadReport()
        self.readers = readers or min(READERS, default_workers())
        # On a GPU one expert at a time: the device is busy with one expert's ops already, and the
        # host's part (reading the next expert) overlaps through the copy.
        self.workers = 1 if self.device.type != "cpu" else (workers or default_workers())
        self.progress = progress
        self.experts_encoded = 0  # experts encoded by this encoder (tests count them)
        self.experts_decoded_on_device = 0  # experts `decode_layer` decoded on the device (tests and benchmarks count them)
        self._lock = threading.Lock()
        self._buffers = threading.local()
        self._bar = None
        self._stash: dict[tuple, dict[str, torch.Tensor]] = {}
        self._stash_left = stash_bytes if self.device.type != "cpu" else 0

    def __repr__(self) -> str:
        return f"RecordEncoder(device={str(self.device)!r}, workers={self.workers})"

    # -- the two passes --------------------------------------------------------------------------
    def plan_layer(
        self, codec, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], num_experts: int, expert: Expert, key=None
    ):
        """The layer's record layout; a codec that plans from the weights (`expert_sizes`,
        `plan_from_sizes`) reads every expert here, on this encoder's device (kept there for
        `encode_*(key=key)` while the stash has room)."""
        sizes_of = getattr(codec, "expert_sizes", None)
        if sizes_of is None:
            plan_from = getattr(codec, "plan_experts_from", None)  # records shaped by the checkpoint's tensors
            return plan_from(specs, num_experts, expert) if plan_from is not None else codec.plan(specs)
        nbytes = _raw_bytes(specs)

        def sizes(e: int, tensors: Mapping[str, torch.Tensor]):
            if key is not None and self._stash_left >= nbytes:
                self._stash[(key, e)] = dict(tensors)
                self._stash_left -= nbytes
            with self.report.device_span("plan", self.device, nbytes):
                return sizes_of(tensors)

        sizes = self._map(num_experts, expert, sizes, nbytes)
        return codec.plan_from_sizes(specs, sizes)

    def encode_layer(
        self,
        codec,
        layout,
        num_experts: int,
        expert: Expert,
        sink: Callable[[int, torch.Tensor], object],
        extra: dict | None = None,
        key=None,
    ) -> None:
        """Encode every expert of a layer; `sink(e, record)` takes each record (uint8 [layout.nbytes] on
        this encoder's device, valid until `sink` returns; called from worker threads on a CPU)."""
        extra = extra or {}
        nbytes = _entries_bytes(layout)

        def one(e: int, tensors: Mapping[str, torch.Tensor]) -> None:
            record = self._record(layout.nbytes)
            with self.report.device_span("encode", self.device, nbytes):
                codec.encode(tensors, layout, record, **extra)
            with self.report.device_span("d2h", self.device, layout.nbytes):
                sink(e, record)
            self._count()

        self._map(num_experts, expert, one, _entries_bytes(layout), key)

    def encode_into(
        self, codec, layout, num_experts: int, expert: Expert, slab: torch.Tensor, extra: dict | None = None, key=None
    ) -> None:
        """`encode_layer` into the rows of a host slab [E, layout.nbytes]: a CPU encoder writes each
        record in place, a device encoder copies it there (one copy; at link speed into a pinned slab)."""
        if self.device.type != "cpu":
            self.encode_layer(codec, layout, num_experts, expert, lambda e, record: slab[e].copy_(record), extra, key)
            return
        extra = extra or {}

        nbytes = _entries_bytes(layout)

        def one(e: int, tensors: Mapping[str, torch.Tensor]) -> None:
            with self.report.span("encode", nbytes):
                codec.encode(tensors, layout, slab[e], **extra)
            self._count()

        self._map(num_experts, expert, one, _entries_bytes(layout), key)

    def decode_layer(self, codec, records: torch.Tensor, layout, dtype: torch.dtype, alloc: Alloc = torch.empty):
        """A layer's records (uint8 [E, R] in host memory) decoded into new host tensors `name -> [E, ...]` of
        `dtype` from `alloc(shape, dtype=...)`, filled expert by expert. On a CUDA encoder, with an exact codec
        and room on the device, each record is copied there, decoded by the codec's kernels and its tensors
        copied back into their rows; else decoded on the host."""
        E, out = records.shape[0], {}

        def rows(e: int, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            """Expert e's rows of the outputs (allocated at the first expert decoded)."""
            for name, t in tensors.items():
                if name not in out:
                    out[name] = alloc((E, *t.shape), dtype=dtype)
            return {name: out[name][e] for name in tensors}

        first = 0
        if self._decodes(codec, layout):
            with torch.cuda.device(self.device):  # its current stream orders the copies and the events
                first = self._decode_on_device(codec, records, layout, dtype, rows)
        for e in range(first, E):
            # into its rows where the codec writes into given tensors (once the first expert has made them)
            given = {name: t[e] for name, t in out.items()} or None
            decoded = codec.decode(records[e], layout, dtype, out=given)
            for name, row in rows(e, decoded).items():
                if decoded[name].data_ptr() != row.data_ptr():
                    row.copy_(decoded[name])
        return out

    def _decodes(self, codec, layout) -> bool:
        """Whether to decode on this device: CUDA, a codec whose values are the same wherever it decodes, and
        free memory for a record, its tensors and the codec's temporaries with DECODE_MARGIN_BYTES to spare
        (what a model running meanwhile may allocate)."""
        if self.device.type != "cuda" or not codec.exact:
            return False
        try:
            free, _ = torch.cuda.mem_get_info(self.device)
        except RuntimeError:  # no CUDA in this process (forked after its parent used it): the host decodes
            return False
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)  # the allocator's own
        return free > layout.nbytes + 2 * _entries_bytes(layout) + DECODE_MARGIN_BYTES

    def _decode_on_device(self, codec, records: torch.Tensor, layout, dtype: torch.dtype, rows) -> int:
        """Decode experts on the device in order, until done or out of its memory: the count whose rows are
        written."""
        done = 0
        try:
            back = _BackToHost()
            record = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
            for e in range(records.shape[0]):
                # the record buffer is written again only after the last expert's decode: one stream orders them
                record.copy_(records[e], non_blocking=True)  # asynchronous from a pinned slab
                decoded = codec.decode(record, layout, dtype)
                for name, row in rows(e, decoded).items():
                    back.copy(decoded[name], row)
                back.land()
                done = e + 1
                with self._lock:
                    self.experts_decoded_on_device += 1
        except torch.OutOfMemoryError:  # the model took the room meanwhile: the host decodes the rest
            pass
        finally:
            back = record = decoded = None
            torch.cuda.empty_cache()  # not kept outside gpu_budget
        return done

    def finish(self) -> None:
        """Give back the device memory the encoding used (its buffers and the allocator's cache)."""
        self._buffers = threading.local()
        self._stash.clear()
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
    def _count(self) -> None:
        with self._lock:
            self.experts_encoded += 1

    def _record(self, nbytes: int) -> torch.Tensor:
        """This thread's record buffer on the device (reused expert after expert)."""
        buf = getattr(self._buffers, "record", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers.record = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]

    def _map(
        self, n: int, expert: Expert, fn: Callable[[int, Mapping[str, torch.Tensor]], object], nbytes_each: int, key=None
    ) -> list:
        """[fn(e, expert e's tensors on this device) for e < n]. Experts are read (`expert(e)`) on
        `readers` threads ahead of the codec when the reader says it is thread-safe (`expert.thread_safe`,
        the checkpoint's pread reader), else one at a time; the codec's work runs on `workers` threads
        (CPU), or on the device while the host threads read the next experts."""
        own = self._bar is None  # a layer on its own gets its own bar
        bar = _bar(self.progress, n * nbytes_each, "encoding records") if own else self._bar
        read_lock = None if getattr(expert, "thread_safe", False) else threading.Lock()

        def read(e: int) -> Mapping[str, torch.Tensor]:
            stashed = self._stash.pop((key, e), None) if key is not None else None
            if stashed is not None:  # read and copied here while planning
                return stashed
            if read_lock is None:
                return expert(e)
            with read_lock:
                return expert(e)

        def step(e: int, tensors: Mapping[str, torch.Tensor]):
            out = fn(e, {k: t if t.device == self.device else t.to(self.device) for k, t in tensors.items()})
            if bar is not None:
                bar.update(nbytes_each)
            return out

        try:
            if self.device.type != "cpu" or self.workers == 1 or n == 1:
                ahead = read_ahead(n, read, self.readers if read_lock is None else 1)
                try:
                    out = []
                    for e in range(n):
                        with self.report.span("wait"):
                            tensors = next(ahead)
                        out.append(step(e, tensors))
                    return out
                finally:
                    ahead.close()
            # one intra-op thread per worker: the experts are the parallelism (no oversubscribed cores)
            with ThreadPoolExecutor(
                min(self.workers, n), thread_name_prefix="mira-encode", initializer=own_cpu_threads, initargs=(1,)
            ) as pool:
                futures = [pool.submit(lambda e: step(e, read(e)), e) for e in range(n)]
                return [f.result() for f in futures]  # in order; the first failure is raised
        finally:
            if own and bar is not None:
                bar.close()


class _BackToHost:
    """Device tensors copied into host tensors through two page-locked buffers in turn: the host copies one
    chunk into its destination while the next crosses the link (a copy straight into pageable memory crosses
    at a fraction of the link's speed, and the host touches the destination's pages meanwhile)."""

    def __init__(self, chunk_bytes: int = BACK_CHUNK_BYTES) -> None:
        self._buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._turn = 0
        self._pending = None  # (destination bytes, buffer bytes, the event after its copy)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the device tensor `src` into the contiguous host tensor `dst` (done once `land` returns)."""
        src, dst = src.contiguous().view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
        step = self._buffers[0].numel()
        for a in range(0, src.numel(), step):
            buffer = self._buffers[self._turn][: min(step, src.numel() - a)]
            self._turn ^= 1  # the other buffer's chunk was copied out by the `land` below, before this one is reused
            buffer.copy_(src[a : a + step], non_blocking=True)
            crossed = torch.cuda.Event()
            crossed.record()
            self.land()
            self._pending = (dst[a : a + step], buffer, crossed)

    def land(self) -> None:
        """Copy the chunk that crossed last into its destination."""
        if self._pending is not None:
            dst, buffer, crossed = self._pending
            crossed.synchronize()
            dst.copy_(buffer)
            self._pending = None


def read_ahead(n: int, read: Callable[[int], T], readers: int) -> Iterator[T]:
    """read(e) for e < n, in order, computed on `readers` threads with at most `readers + 1` results
    waiting (bounded memory: that many experts). Close the iterator to stop early: reads not started are
    cancelled and running ones finish before it returns."""
    with ThreadPoolExecutor(max(1, readers), thread_name_prefix="mira-read") as pool:
        pending: deque = deque()
        try:
            for e in range(n):
                while len(pending) <= readers and e + len(pending) < n:
                    pending.append(pool.submit(read, e + len(pending)))
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()


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


def encoder_for(
    device: torch.device, expert_bytes: int, progress: bool, keep_free_bytes: int = 0, report: LoadReport | None = None
) -> RecordEncoder:
    """Encode on `device` when it is a CUDA device with room for one expert, its record and the codec's
    temporaries (~1 GB), else on host threads. Readers ahead of the encoder hold up to two experts each on
    the device (one being copied, one waiting); the device memory beyond them and `keep_free_bytes` (what
    the loaded model will take there) stashes experts between planning and encoding."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        working = 2 * expert_bytes + 2**31
        if free > working:
            per_reader = 2 * max(expert_bytes, 1)
            readers = int(max(1, min(READERS, default_workers(), (free - working) // per_reader)))
            stash = max(free - working - readers * per_reader - keep_free_bytes - 2**30, 0)
            return RecordEncoder(device, progress=progress, stash_bytes=stash, report=report, readers=readers)
    return RecordEncoder("cpu", progress=progress, report=report)
