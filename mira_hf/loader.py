"""`Loader`: host→device copies of expert records, on their own CUDA stream, ordered by events.

On CUDA, copies run on a dedicated stream so they overlap compute; the compute stream waits only on
the event of the expert it is about to use, and that wait is timed with CUDA events (`stall_s`).
Sources that are not page-locked (a pageable or disk-backed store) go through a small pinned staging
ring: the CPU copies a piece into a ring chunk, the copy engine moves the chunk. On CPU the same calls
run synchronously and the "device" arena is host memory.

Those ring copies take the host's time, so they run on a worker thread (`background`, on by default on CUDA):
the thread that drives the device hands a copy over and goes on launching compute, and gets back a `Queued` that
stands for the copy's event until the worker has issued it. Copies from page-locked memory are issued at once,
unless the worker still holds copies: then they queue behind them, so every copy reaches the copy stream in the
order it was asked for (two copies into one slot land in that order).

A fine-grained model issues a few hundred copies per decode step, so the host time to issue one counts:
torch's `copy_` holds the issuing thread ~29 µs per host→device copy, the CUDA runtime's `cudaMemcpyAsync`
~5.7 µs (benchmarks/NOTES.md, "Host overhead"). Where the runtime torch loaded can be found, copies are issued
through it (`runtime_memcpy`), on the copy stream given by its handle, so no stream switch is needed either;
the bytes, the stream and the ordering are those of `copy_(non_blocking=True)`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import os
import time
import weakref
from collections import deque
from collections.abc import Sequence

import torch

LATENCY_SAMPLES = 4096  # copies whose issue-to-ready latency is kept (the latest ones)

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


class Queued:
    """One event of a copy handed to the copy worker: stands for it (`query`, `wait`, `synchronize`, as a
    torch.cuda.Event's) until the worker has issued the copy. `event()` blocks until then and gives the real event
    (None on a CPU device, where the copy is then done), or raises the error the copy raised. `query` never raises:
    a copy that failed is not done, and its error surfaces where it is waited for."""

    __slots__ = ("_future", "_index", "_timeout_s")

    def __init__(self, future: concurrent.futures.Future, index: int, timeout_s: float) -> None:
        self._future, self._index, self._timeout_s = future, index, timeout_s

    def issued(self) -> bool:
        """Whether the worker has issued the copy (or failed at it)."""
        return self._future.done()

    def event(self):
        try:
            return self._future.result(self._timeout_s)[self._index]
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"a host→device copy was not issued within {self._timeout_s:.0f} s (LoaderConfig.copy_timeout_s)"
            ) from None

    def query(self) -> bool:
        if not self._future.done() or self._future.exception() is not None:
            return False
        ev = self._future.result()[self._index]
        return ev is None or ev.query()

    def wait(self, stream=None) -> None:  # what `Stream.wait_event` calls
        ev = self.event()
        if ev is not None:
            ev.wait(stream)

    def synchronize(self) -> None:
        ev = self.event()
        if ev is not None:
            ev.synchronize()


def _settled(future: concurrent.futures.Future | None) -> None:
    """Wait for `future` without raising what it raised (that surfaces where its copy is waited for)."""
    if future is not None:
        concurrent.futures.wait([future])


class Loader:
    def __init__(
        self,
        device: torch.device,
        ring_bytes: int = 128 * 2**20,
        ring_chunks: int = 4,
        timeout_s: float = 60.0,
        background: bool | None = None,
    ) -> None:
        self.device = device
        self.timeout_s = timeout_s  # the longest the host waits for a copy before raising
        self.cuda = device.type == "cuda"
        # Copies from memory that is not page-locked run on a worker thread (module docstring); None: on CUDA. On a
        # CPU device every source counts as such, so with True each copy into the arena overlaps the compute.
        self.background = self.cuda if background is None else background
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_pid: int | None = None
        self._last: concurrent.futures.Future | None = None  # the worker's latest copy: all before it are issued
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
        offset `split` of dst landed (None if `split` is 0), so their reader can start while the rest crosses.
        With `background`, a copy from memory that is not page-locked (and any copy while the worker holds some)
        returns `Queued` events at once and runs on the worker."""
        if self.background and (not src_pinned or not self.cuda or (self._last is not None and not self._last.done())):
            issued = self._issued()
            future = self._worker().submit(self._copy_in_worker, dst, pieces, src_pinned, split, after, then, issued)
            self._last = future
            first, done = Queued(future, 0, self.timeout_s), Queued(future, 1, self.timeout_s)
            if issued is not None:
                self._note_latency(issued, done)
            return (first if split else None), done
        issued = self._issued()
        first, done = self._copy_now(dst, pieces, src_pinned, split, after, then, issued)
        if issued is not None:
            self._note_latency(issued, done)
        return first, done

    def _issued(self):
        """An event marking when a copy was asked for (CUDA: on an otherwise idle stream; CPU: None)."""
        if not self.cuda:
            return None
        issued = torch.cuda.Event(enable_timing=True)
        issued.record(self._clock)
        return issued

    def _note_latency(self, issued, done) -> None:
        self._pending_latency.append((issued, done))
        if len(self._pending_latency) > 512:  # bounded; old copies are long done
            self._resolve_latency(len(self._pending_latency) - 256)

    def _worker(self) -> concurrent.futures.ThreadPoolExecutor:
        """The copy worker (one thread: copies are issued in the order asked for), started at the first copy it
        takes and in a forked child again; stopped when the loader is dropped (it holds no reference to it)."""
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mira-copies")
            self._pool_pid, self._last = os.getpid(), None
            weakref.finalize(self, self._pool.shutdown, wait=False)
        return self._pool

    def _copy_in_worker(self, *args) -> tuple[object, object]:
        with torch.no_grad():  # autograd's mode is the thread's: `then` writes slots, and records nothing
            return self._copy_now(*args)

    def _copy_now(self, dst, pieces: Pieces, src_pinned: bool, split: int, after, then, issued) -> tuple[object, object]:
        """`copy_split`'s copy, issued on this thread (the caller's, or the worker's)."""
        head, tail = cut(pieces, split) if split else ((), pieces)
        if not self.cuda:
            t0 = time.perf_counter()
            for offset, src in (*head, *tail):
                dst[offset : offset + src.numel()].copy_(src)
            if then is not None:
                then()
            self._latencies.append(time.perf_counter() - t0)
            return None, None
        first = None
        # torch's copy_ and `then` work on the current stream; the runtime's copies and events name theirs, and need
        # the stream's device to be the current one (the stream context makes it so)
        switch = self.memcpy is None or then is not None or torch.cuda.current_device() != self._index
        with torch.cuda.stream(self.stream) if switch else contextlib.nullcontext():
            if after is not None and then is None:  # the bytes land in the slot
                self.stream.wait_event(after)
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
        """Make the compute stream wait for a copy; time the wait if it is not done yet. A copy still with the
        worker (`Queued`) is waited for on the host until the worker has issued it (on a CPU device: done it); its
        error, if it failed, is raised here."""
        if ready is None or ready.query():
            return
        if not self.cuda:  # a `Queued` copy on a CPU device: the host waits for the copy itself
            t0 = time.perf_counter()
            ready.event()
            self.add_stall(layer, time.perf_counter() - t0)
            return
        compute = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(compute)  # before the host waits for the worker: the device may idle meanwhile
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
            if isinstance(done, Queued):
                try:
                    done = done.event()
                except Exception:  # the copy failed (its error is raised where it is waited for): no latency
                    continue
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
        """Wait for every copy asked for so far (those the worker holds too; a failed one's error is not raised)."""
        _settled(self._last)
        if self.cuda:
            self.stream.synchronize()
