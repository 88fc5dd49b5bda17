"""`Loader`: host→device copies of expert records, on their own CUDA stream, ordered by events.

On CUDA, copies run on a dedicated stream so they overlap compute; the compute stream waits only on
the event of the expert it is about to use, and that wait is timed with CUDA events (`stall_s`).
Sources that are not page-locked (a pageable or disk-backed store) go through a small pinned staging
ring: the CPU copies a piece into a ring chunk, the copy engine moves the chunk. On CPU the same calls
run synchronously and the "device" arena is host memory.

A fine-grained model issues a few hundred copies per decode step, so the host time to issue one counts:
torch's `copy_` holds the issuing thread ~29 µs per host→device copy, the CUDA runtime's `cudaMemcpyAsync`
~5.7 µs (benchmarks/NOTES.md, "Host overhead"). Where the runtime torch loaded can be found, copies are issued
through it (`runtime_memcpy`), on the copy stream given by its handle, so no stream switch is needed either;
the bytes, the stream and the ordering are those of `copy_(non_blocking=True)`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import time
from collections import deque
from collections.abc import Sequence

import torch

LATENCY_SAMPLES = 4096  # copies whose issue-to-ready latency is kept (the latest ones)
LINK_SAMPLES = 32  # the latest timed copies the link's speed is taken over (`Loader.link_speed`)
LINK_MIN_SAMPLES = 4  # no speed from fewer

# A record's bytes as they lie in host memory: (offset in the record, uint8 host tensor), in record order.
Pieces = Sequence[tuple[int, torch.Tensor]]


H2D = 1  # cudaMemcpyHostToDevice


@functools.cache
def runtime_memcpy():
    """`cudaMemcpyAsync(dst, src, nbytes, kind, stream) -> error code` of the CUDA runtime torch loaded (ctypes), or
    None where it cannot be found: a CPU or ROCm build, no device, a runtime linked statically, or no /proc."""
    if torch.version.cuda is None or not torch.cuda.is_available():
        return None
    soname = f"/libcudart.so.{torch.version.cuda.split('.')[0]}"
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if soname in line}
        if len(paths) != 1:  # none loaded, or two runtimes: not known which is torch's
            return None
        fn = ctypes.CDLL(paths.pop()).cudaMemcpyAsync
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def cut(pieces: Pieces, at: int) -> tuple[list[tuple[int, torch.Tensor]], list[tuple[int, torch.Tensor]]]:
    """`pieces` split at record offset `at`: those before it and those from it on (a piece across it is cut)."""
    head, tail = [], []
    for offset, src in pieces:
        n = src.numel()
        if offset + n <= at:
            head.append((offset, src))
        elif offset >= at:
            tail.append((offset, src))
        else:
            head.append((offset, src[: at - offset]))
            tail.append((at, src[at - offset :]))
    return head, tail


class Loader:
    def __init__(
        self, device: torch.device, ring_bytes: int = 128 * 2**20, ring_chunks: int = 4, timeout_s: float = 60.0
    ) -> None:
        self.device = device
        self.timeout_s = timeout_s  # the longest the host waits for a copy before raising
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._ring_bytes = ring_bytes
        self._ring_chunks = ring_chunks
        self._ring: list[torch.Tensor] | None = None
        self._ring_events: list[torch.cuda.Event] = []
        self._ring_next = 0
        self._stalls: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self._stall_by_layer: dict[int, float] = {}  # resolved stall seconds per MoE layer
        # Issue-to-ready latency of each copy: on CUDA an event on an otherwise idle stream marks the issue
        # (it completes as soon as the GPU sees it), the copy's own done event the end; resolved lazily.
        self._clock = torch.cuda.Stream(device) if self.cuda else None
        self._pending_latency: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._latencies: deque[float] = deque(maxlen=LATENCY_SAMPLES)  # seconds
        # The link's speed as the copies meet it (`link_speed`), where asked for (`time_link`): each copy's bytes
        # between an event recorded on the copy stream before them and its done event, so queueing is left out.
        self.time_link = False
        self._transfers: deque[tuple[int, object, object]] = deque(maxlen=512)  # (bytes, start, done) not yet read
        self._link: deque[tuple[int, float]] = deque(maxlen=LINK_SAMPLES)  # (bytes, seconds) of the latest timed copies
        self._link_speed: float | None = None  # over `_link`, computed again when a copy joins it
        # host→device copies through the CUDA runtime (None: torch's copy_ on the current stream)
        self.memcpy = runtime_memcpy() if self.cuda else None
        self._handle = self.stream.cuda_stream if self.cuda else None
        self._index = self.stream.device.index if self.cuda else None

    # -- copies ---------------------------------------------------------------------------------
    def copy(self, dst: torch.Tensor, pieces: Pieces, src_pinned: bool, after: object = None, then=None) -> object:
        """Copy a host record into a device buffer. Returns the event that marks it done (None on CPU).

        `pieces`: the record's bytes as they lie in host memory, `(offset in dst, uint8 tensor)` in order
        (`ExpertStore.pieces`). `after`: an event the writes into the slot must wait for (the last compute that
        read it). `then`: work to run on the copy stream after the copy (e.g. dequantising into the slot); with
        it, `dst` is a buffer only `then` reads, so the bytes cross meanwhile and `then` waits for `after`.
        """
        return self.copy_split(dst, pieces, src_pinned, 0, after, then)[1]

    def copy_split(
        self, dst: torch.Tensor, pieces: Pieces, src_pinned: bool, split: int, after: object = None, then=None
    ) -> tuple[object, object]:
        """As `copy`, in two parts: returns (first, done), `first` the event that marks the bytes before
        offset `split` of dst landed (None if `split` is 0), so their reader can start while the rest crosses."""
        head, tail = cut(pieces, split) if split else ((), pieces)
        if not self.cuda:
            t0 = time.perf_counter()
            for offset, src in (*head, *tail):
                dst[offset : offset + src.numel()].copy_(src)
            if then is not None:
                then()
            self._latencies.append(time.perf_counter() - t0)
            return None, None
        issued = torch.cuda.Event(enable_timing=True)
        issued.record(self._clock)
        first = None
        # torch's copy_ and `then` work on the current stream; the runtime's copies and events name theirs, and need
        # the stream's device to be the current one (the stream context makes it so)
        switch = self.memcpy is None or then is not None or torch.cuda.current_device() != self._index
        with torch.cuda.stream(self.stream) if switch else contextlib.nullcontext():
            if after is not None and then is None:  # the bytes land in the slot
                self.stream.wait_event(after)
            start = None
            if self.time_link and then is None:
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
            if split:
                for offset, src in head:
                    self._copy_bytes(dst, offset, src, src_pinned)
                first = torch.cuda.Event()
                first.record(self.stream)
            for offset, src in tail:
                self._copy_bytes(dst, offset, src, src_pinned)
            if then is not None:
                if after is not None:  # `then` writes the slot
                    self.stream.wait_event(after)
                then()
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)
        self._pending_latency.append((issued, done))
        if start is not None:
            self._transfers.append((sum(src.numel() for _, src in pieces), start, done))
        if len(self._pending_latency) > 512:  # bounded; old copies are long done
            self._resolve_latency(len(self._pending_latency) - 256)
        return first, done

    def _copy_bytes(self, dst: torch.Tensor, offset: int, src: torch.Tensor, src_pinned: bool) -> None:
        """`src` (host bytes) into `dst` (device bytes) from `offset` on, asynchronously on the copy stream."""
        if src_pinned:
            self._h2d(dst, offset, src)
        else:
            self._copy_through_ring(dst[offset : offset + src.numel()], src)

    def _h2d(self, dst: torch.Tensor, offset: int, src: torch.Tensor) -> None:
        # `src` page-locked, both uint8; where the runtime cannot take them, torch's copy_ (which checks the sizes)
        n = src.numel()
        if self.memcpy is not None and offset + n <= dst.numel() and src.is_contiguous() and dst.is_contiguous():
            rc = self.memcpy(dst.data_ptr() + offset, src.data_ptr(), n, H2D, self._handle)
            if rc != 0:
                raise RuntimeError(f"cudaMemcpyAsync of {n} bytes to {self.device} failed with CUDA error {rc}")
            return
        with torch.cuda.stream(self.stream):
            dst[offset : offset + n].copy_(src, non_blocking=True)

    def _copy_through_ring(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._ring is None:
            chunk = max(self._ring_bytes // self._ring_chunks, 1)
            with torch.inference_mode(False):  # normal tensors, kept: written in and out of inference mode
                self._ring = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(self._ring_chunks)]
            self._ring_events = [torch.cuda.Event() for _ in self._ring]
            for ev in self._ring_events:
                ev.record(self.stream)
        chunk_bytes = self._ring[0].numel()
        for start in range(0, src.numel(), chunk_bytes):
            n = min(chunk_bytes, src.numel() - start)
            i = self._ring_next
            self._ring_next = (i + 1) % len(self._ring)
            self._wait_host(self._ring_events[i])  # the chunk's previous copy has left it
            self._ring[i][:n].copy_(src[start : start + n])
            self._h2d(dst, start, self._ring[i][:n])
            self._ring_events[i].record(self.stream)

    def _wait_host(self, event) -> None:
        """Block the host until `event` completes, or raise after `timeout_s` instead of hanging."""
        deadline = time.monotonic() + self.timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"a host→device copy did not finish within {self.timeout_s:.0f} s (LoaderConfig.copy_timeout_s)"
                )
            time.sleep(50e-6)

    # -- waiting --------------------------------------------------------------------------------
    def wait(self, ready: object, layer: int) -> None:
        """Make the compute stream wait for a copy; time the wait if it is not done yet."""
        if ready is None or ready.query():
            return
        compute = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(compute)
        compute.wait_event(ready)
        end.record(compute)
        self._stalls.append((layer, start, end))
        if len(self._stalls) > 512:  # keep the list bounded; old events are long done
            self._resolve(len(self._stalls) - 256)

    def mark_free(self) -> object:
        """A new event recorded on the compute stream: the last reads of the slots it is given to are enqueued.
        Slots released together share one; an event is never recorded again, so a slot's stays where it was."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def add_stall(self, layer: int, seconds: float) -> None:
        """Count a stall measured on the host (CPU device: a synchronous demand copy)."""
        self._stall_by_layer[layer] = self._stall_by_layer.get(layer, 0.0) + seconds

    def _resolve(self, n: int | None = None) -> None:
        n = len(self._stalls) if n is None else n
        for layer, start, end in self._stalls[:n]:
            end.synchronize()
            self.add_stall(layer, start.elapsed_time(end) / 1e3)
        del self._stalls[:n]

    def _resolve_latency(self, n: int | None = None) -> None:
        n = len(self._pending_latency) if n is None else n
        for issued, done in self._pending_latency[:n]:
            done.synchronize()
            self._latencies.append(max(issued.elapsed_time(done), 0.0) / 1e3)
        del self._pending_latency[:n]

    def stall_total(self) -> float:
        """Stall seconds so far of the copies whose timing is known, without waiting for any: on CUDA the
        waits whose end event has completed (in order), on CPU every synchronous demand copy."""
        done = 0
        for _layer, _start, end in self._stalls:
            if not end.query():
                break
            done += 1
        self._resolve(done)
        return sum(self._stall_by_layer.values())

    def link_speed(self) -> float | None:
        """Bytes per second over the latest timed copies (`time_link`; at most LINK_SAMPLES), reading only copies
        already done (no wait); None before LINK_MIN_SAMPLES of them."""
        joined = False
        while self._transfers and self._transfers[0][2].query():
            nbytes, start, done = self._transfers.popleft()
            self._link.append((nbytes, max(start.elapsed_time(done), 0.0) / 1e3))
            joined = True
        if joined:  # else the speed of the last call stands
            seconds = sum(s for _, s in self._link)
            enough = len(self._link) >= LINK_MIN_SAMPLES and seconds > 0
            self._link_speed = sum(n for n, _ in self._link) / seconds if enough else None
        return self._link_speed

    def latencies(self) -> list[float]:
        """Issue-to-ready seconds of the latest copies (at most LATENCY_SAMPLES; resolves pending ones: syncs)."""
        self._resolve_latency()
        return list(self._latencies)

    def stalls(self) -> dict[int, float]:
        """Stall seconds per MoE layer so far (resolves pending CUDA timings: syncs)."""
        self._resolve()
        return dict(self._stall_by_layer)

    def carry(self, other: Loader) -> None:
        """Take over `other`'s stall seconds and copy latencies so far (a loader that replaces it: `relocate`)."""
        for layer, seconds in other.stalls().items():
            self.add_stall(layer, seconds)
        self._latencies.extend(other.latencies())

    def reset_stalls(self) -> None:
        self._resolve()
        self._stall_by_layer.clear()
        self._resolve_latency()
        self._latencies.clear()

    def synchronize(self) -> None:
        if self.cuda:
            self.stream.synchronize()
