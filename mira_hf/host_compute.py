"""Experts computed on the host, where their weights are: a second path for misses beside the link.

A miss is normally served by copying the expert's record to the device. The host holds every record
already, and its cores are a resource separate from the link: for a few tokens, computing the expert
on the host and moving only the tokens' hidden rows there (D2H) and the outputs back (H2D) can finish
sooner than the copy, and it runs while the link moves the other misses. Per block, `HostCosts.split`
walks the misses in the order they would be copied and sends each to the path that finishes it first:
the link (its measured speed, the record's bytes, the copies already queued ahead) or the host (the
host time of that layer's expert for its rows, measured by a short micro-benchmark per layer shape at
the layer's first planned block and refined by every host computation since).

`HostCompute` runs the host experts of a block as one job on a dedicated worker thread (torch's CPU
threads set there, pinned away from one core left to the Python thread), with the proxy's own
per-expert math (`MiraExperts._host_expert`: the same up projection, gate function and down projection
as on the device). Resident experts and copied misses compute on the device meanwhile; the proxy puts
the host outputs into the same rows the device would have filled, and the combine is unchanged.

Inexact by nature, so opt-in (`MiraConfig(host_compute=...)`): the host's matmuls round differently
from the device's (another BLAS, another summation order), so an expert computed on the host differs
from the device's result in the last bits of its dtype. Where the device is the host (CPU), the same
kernels run and the outputs are usually bit-identical.

Only uncompressed records are computed on the host (views of the record, nothing decoded): an encoded
record (lossless, int8/int4/nf4, a checkpoint's FP8/MXFP4) would need a host decode per use, which costs
more than its copy. Blocks of many tokens (prefill) stay on the device: an expert with more than
`MAX_HOST_ROWS` rows in a block is never computed on the host.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .cpu_threads import own_cpu_threads
from .errors import ConfigError
from .host_switch import HostSwitch

# An expert with more rows than this in one block is computed on the device (a prefill's experts have
# hundreds: the host's matmul time grows with rows, the copy's does not).
MAX_HOST_ROWS = 16
# Row counts of the micro-benchmark of a layer shape (decode at batch 1 is 1 row per expert; batch 8 and
# beam 4 give a few rows to the popular ones). Host times between them are interpolated.
BENCH_ROWS = (1, 2, 4, 8, 16)
BENCH_REPEATS = 3  # best of, after one warm-up call
# Weight of a new host timing in its row count's estimate (online refinement).
REFINE_WEIGHT = 0.25
# Bytes of the link probe (copied twice: the small copy's time is the per-copy overhead).
LINK_PROBE_BYTES = 16 * 2**20
LINK_PROBE_SMALL_BYTES = 64 * 2**10
# A link speed from the slope of two probe copies is kept only within 1/MIN_SLOPE_OF_AVERAGE of the large copy's
# average (its fixed cost is a few percent of 16 MiB's time); beyond, timer or scheduling noise made the slope.
MIN_SLOPE_OF_AVERAGE = 0.8
RESULT_TIMEOUT_S = 600.0  # a host job that takes longer raises instead of hanging the forward


@dataclass
class HostCosts:
    """The cost model the planner decides with (seconds; no torch). Tests inject one; otherwise the
    link is measured at the first planned block and each layer's host times at its first one.

    `host_s`: layer -> {rows: seconds of one expert of that layer on that many rows} (layers of one
    shape share one table). `link_free_at`: `time.perf_counter()` when the copies queued so far are
    expected to be done (advanced by `copy_issued`)."""

    link_bytes_per_s: float | None = None
    copy_overhead_s: float = 20e-6  # fixed cost of one copy (issue, DMA setup)
    host_overhead_s: float = 100e-6  # fixed cost of one block's host job: D2H, hand-off to the worker, H2D
    # What host jobs have taken lately beyond their plan (moving average): the device work queued ahead of a
    # block's rows, which its D2H copy waits for, and contention with the thread that drives the device.
    host_lag_s: float = 0.0
    host_s: dict[int, dict[int, float]] = field(default_factory=dict)
    max_rows: int = MAX_HOST_ROWS
    link_free_at: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def copy_s(self, nbytes: int) -> float:
        """Seconds the link takes for one record of `nbytes` once it is free."""
        return self.copy_overhead_s + nbytes / self.link_bytes_per_s

    def host_time(self, layer: int, rows: int) -> float:
        """Seconds of one expert of `layer` on `rows` rows on the host: linear between measured row counts,
        extended past the largest by the slope of the last two."""
        table = self.host_s[layer]
        with self._lock:
            points = sorted(table.items())
        if rows <= points[0][0]:
            return points[0][1]
        for (r0, t0), (r1, t1) in zip(points, points[1:]):
            if rows <= r1:
                return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        r1, t1 = points[-1]
        r0, t0 = points[-2] if len(points) > 1 else (0, 0.0)
        return t1 + max(t1 - t0, 0.0) / (r1 - r0) * (rows - r1)

    def copy_issued(self, nbytes: int, now: float | None = None) -> None:
        """A copy of `nbytes` was queued on the link (demand, prefetch or speculative)."""
        now = time.perf_counter() if now is None else now
        self.link_free_at = max(now, self.link_free_at) + self.copy_s(nbytes)

    def split(
        self, layer: int, misses: Sequence[int], rows: Sequence[int], nbytes: int, now: float | None = None
    ) -> tuple[list[int], list[int]]:
        """(copied, host): `misses` (in copy order, with their `rows` in this block) sent each to the path
        that finishes it first. The link's finish time starts at the copies queued ahead; the host's at
        its job's fixed cost and lag (the worker is idle at a block's start). Ties go to the link (exact)."""
        now = time.perf_counter() if now is None else now
        link_t = max(self.link_free_at - now, 0.0)
        host_t = None
        copied, host = [], []
        copy = self.copy_s(nbytes)
        for e, n in zip(misses, rows):
            start = self.job_start_s() if host_t is None else host_t
            h = None if n > self.max_rows else start + self.host_time(layer, n)
            if h is not None and h < link_t + copy:
                host.append(e)
                host_t = h
            else:
                copied.append(e)
                link_t += copy
        return copied, host

    def balance(
        self,
        layer: int,
        experts: Sequence[int],
        rows: Sequence[int],
        nbytes: int,
        now: float | None = None,
        ahead: Sequence[int] = (),
    ) -> list[int]:
        """host_compute="split": which of a block's `experts` (with their `rows`) have their host parts (`nbytes`
        each) copied to the device and computed there, so that the block's later path ends soonest. The host
        computes its parts one after another from its job's start; the link copies after what is queued and
        after the copies of `ahead` bytes each that the block is about to queue (its misses). Parts move most
        host time first (the host's time grows with rows, the copy's does not), while a move brings the later
        of the two ends earlier: ties stay on the host (the link is busy enough with misses)."""
        now = time.perf_counter() if now is None else now
        link_t = max(self.link_free_at - now, 0.0) + sum(map(self.copy_s, ahead))
        times = [self.host_time(layer, n) for n in rows]
        host_t = self.job_start_s() + sum(times)
        copy, left, moved = self.copy_s(nbytes), len(experts), []
        for i in sorted(range(len(experts)), key=lambda i: -times[i]):  # stable: ties keep the router's order
            after = host_t - times[i] if left > 1 else 0.0  # the last part moved: no host job at all
            if max(after, link_t + copy) >= max(host_t, link_t):
                break
            host_t, link_t, left = after, link_t + copy, left - 1
            moved.append(experts[i])
        return moved

    def job_start_s(self) -> float:
        """Seconds from planning a block until its host job's first expert can start."""
        return self.host_overhead_s + self.host_lag_s

    def job_s(self, layer: int, rows: Sequence[int]) -> float:
        """Planned seconds of a host job of `layer`'s experts with `rows` rows each (without the lag)."""
        return self.host_overhead_s + sum(self.host_time(layer, n) for n in rows)

    def observe_job(self, planned_s: float, seconds: float) -> None:
        """A host job planned at `planned_s` (`job_s`) took `seconds` from its start to its outputs: the
        excess refines `host_lag_s`."""
        with self._lock:
            self.host_lag_s = (1 - REFINE_WEIGHT) * self.host_lag_s + REFINE_WEIGHT * max(seconds - planned_s, 0.0)

    def observe(self, layer: int, rows: int, seconds: float) -> None:
        """One host computation of an expert of `layer` on `rows` rows took `seconds`: refine its estimate."""
        table = self.host_s.get(layer)
        if table is None:
            return
        with self._lock:
            old = table.get(rows)
            table[rows] = seconds if old is None else (1 - REFINE_WEIGHT) * old + REFINE_WEIGHT * seconds


# (the expert's index, its weights: name -> host tensor, rows x [n, H] on the host) -> [n, H] on the host
ExpertFn = Callable[[int, Mapping[str, torch.Tensor], torch.Tensor], torch.Tensor]


def _echo(expert: int, weights: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return x.clone()  # a job without an expert: what a host job costs beyond its experts


def _init_worker(cpus: set[int] | None, threads: int) -> None:
    """The host worker thread's setup: its cores and torch's CPU threads."""
    if cpus is not None:
        try:
            os.sched_setaffinity(0, cpus)  # this thread only; torch's CPU threads it starts inherit it
        except OSError:
            pass  # a container may forbid it: unpinned, still correct
    own_cpu_threads(threads)


def own_tensors(module: torch.nn.Module, skip) -> list[str]:
    """Names of `module`'s parameters and buffers, except those under a top-level name in `skip`."""
    return [n for n, _ in (*module.named_parameters(), *module.named_buffers()) if n.split(".")[0] not in skip]


def host_expert_math(proxy, layout) -> tuple[ExpertFn | None, int]:
    """(`proxy`'s per-expert math for the host, its hidden size H) for a `MiraExperts` proxy whose records
    have the raw `layout`. The math is None where the experts module keeps tensors of its own (other than
    a post-expert norm, a per-route norm, or what its layout applies around the experts' sum, all applied on the
    device): they live on the device, so the host cannot compute it."""
    down = next(t.shape for t in layout.tensors if t.name == proxy._down)
    hidden = down[1] if proxy._down_transposed else down[0]  # [I, H] transposed, else [H, I]
    around = {"post_expert_norm", proxy._route_norm, *proxy.experts_layout.outside}  # applied on the device
    return (None if own_tensors(proxy.base, around) else proxy._host_expert), hidden


def worker_cpus(reserved: int = 1) -> set[int] | None:
    """The cores the host worker is pinned to: every core this process may use but the first `reserved`
    (left to the Python thread that drives the device). None: not pinned (one core, or no affinity API)."""
    getter = getattr(os, "sched_getaffinity", None)
    if getter is None:
        return None
    cpus = sorted(getter(0))
    return set(cpus[reserved:]) if len(cpus) > reserved else None


class HostComputeOff:
    """`MiraConfig(host_compute="off")`: every miss is copied; the manager's hooks do nothing."""

    mode, active, switch, parts = "off", False, None, None

    def place(self, store, layers: Mapping[int, object], device: torch.device) -> None:
        pass

    def register(self, layer: int, fn: ExpertFn | None, hidden_size: int) -> None:
        pass

    def block(self, layer: int, width: int, stall_s: Callable[[], float] | None = None) -> None:
        pass

    def copy_issued(self, nbytes: int) -> None:
        pass

    def measured(self) -> None:
        return None

    def close(self) -> None:
        pass


def host_compute_for(mode: str, parts=None) -> HostCompute | HostComputeOff:
    """The host path of a manager for `MiraConfig.host_compute` (`mode`); `parts`: the experts' host parts
    (`neuron_split.HostParts`, mode "split")."""
    return HostComputeOff() if mode == "off" else HostCompute(mode, parts=parts)


class HostCompute:
    """The host path of one manager: which layers can run on the host, the cost model, the worker.

    `mode`: "on" (plan every miss; refuses encoded records), "auto" (plan where it can pay: a CUDA
    device and uncompressed records, and, per step width, only while steps that plan host sends are
    measured faster than steps that do not: `switch`; otherwise inactive) or "split" (no miss is sent
    whole: the proxy has every expert's host part, `parts`, computed here). `threads`: torch CPU threads
    of the worker (None: the cores it is pinned to). `costs`: an injected cost model (tests); None: measured."""

    def __init__(
        self,
        mode: str,
        threads: int | None = None,
        costs: HostCosts | None = None,
        switch: HostSwitch | None = None,
        parts=None,
    ) -> None:
        self.mode = mode
        self.parts = parts  # neuron_split.HostParts (mode "split")
        self.costs = costs if costs is not None else HostCosts()
        self.switch = switch if switch is not None else (HostSwitch() if mode == "auto" else None)
        self.sending = mode != "split"  # whether this step plans whole misses on the host (the switch's choice for its width)
        self._last_layer = None  # the last block's layer: a block at or before it starts a step
        self.active = False
        self._injected = costs is not None  # an injected cost model is kept; a measured one is measured again by `place`
        self._overhead_known = self._injected
        self._fns: dict[int, tuple[ExpertFn, int]] = {}  # layer -> (the proxy's expert math, hidden size)
        cpus = worker_cpus()
        self.threads = threads or (len(cpus) if cpus else max(1, (os.cpu_count() or 2) - 1))
        self._cpus = cpus
        self._pool, self._pid = self._new_worker(), os.getpid()
        self.store = self.device = None

    def _new_worker(self) -> ThreadPoolExecutor:
        # The initializer holds no reference to self: an idle worker must not keep the manager (and its store) alive.
        return ThreadPoolExecutor(
            1, thread_name_prefix="mira-host", initializer=_init_worker, initargs=(self._cpus, self.threads)
        )

    def _worker(self) -> ThreadPoolExecutor:
        """This process's worker: a process forked after the model was used has no copy of the parent's
        thread (its queue would never be served), so it starts its own."""
        if self._pid != os.getpid():
            self._pool, self._pid = self._new_worker(), os.getpid()
        return self._pool

    def place(self, store, layers: Mapping[int, object], device: torch.device) -> None:
        """Serve from `store` on `device` (at wrap, and again after a cast or move): decide whether the host
        path is active and forget host timings (the dtype or the records may have changed)."""
        raw = not store.quantized or self.mode == "split"  # split: the host parts are uncompressed
        if self.mode == "on" and not raw:
            raise ConfigError(
                f"host_compute='on' computes experts from their uncompressed records on the host, but this model's "
                f"records are encoded ({store.codec.name}): decoding one on the host per use costs more than copying it. "
                "Load with quantization=None (or 'auto', which stays uncompressed with host_compute='on'), or use "
                "host_compute='auto' (off where records are encoded) or 'off'."
            )
        self.store, self.device = store, device
        self.active = raw and (self.mode in ("on", "split") or device.type == "cuda")
        if device.type == "cuda":  # the worker waits on this device's events and page-locks its outputs
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._worker().submit(torch.cuda.set_device, index).result()
        if not self._injected:  # measured again: the device, the dtype or the records may have changed
            self.costs, self._overhead_known = HostCosts(), False
        self.costs.link_free_at = 0.0
        if self.switch is not None:
            self.switch.forget()
        self._last_layer, self.sending = None, self.mode != "split"

    def measured(self) -> dict | None:
        """What the planner has measured on this machine, for `stats()["host_costs"]` (None while inactive): per
        unit the host computes (a host part with host_compute="split", else a whole expert), of the first layer
        measured, its seconds on the host at one row and at four (a 4-beam search's rows per expert) and its copy's
        seconds over the link's measured speed; the link's speed; what host jobs took beyond their plan lately
        (docs/usage.md, "Split each expert between the host and the GPU", says what these times told apart on the
        machines measured)."""
        if not self.active:
            return None
        c = self.costs
        layer = min(c.host_s, default=None)
        nbytes, timed = None, layer is not None and bool(c.host_s[layer])
        if layer is not None:
            nbytes = self.parts.expert_bytes(layer) if self.parts is not None else self.store.record_bytes(layer)
        return dict(
            unit="host part" if self.parts is not None else "expert",
            layer=layer,
            unit_bytes=nbytes,
            host_s_one_row=c.host_time(layer, 1) if timed else None,
            host_s_four_rows=c.host_time(layer, 4) if timed else None,
            copy_s=c.copy_s(nbytes) if nbytes is not None and c.link_bytes_per_s else None,
            link_bytes_per_s=c.link_bytes_per_s,
            host_lag_s=c.host_lag_s,
        )

    def set_costs(self, costs: HostCosts) -> None:
        """Plan with `costs` from now on, kept as given (only what it lacks is measured: the link speed if None,
        the host times of layers missing from `host_s`)."""
        self.costs, self._injected, self._overhead_known = costs, True, True

    def register(self, layer: int, fn: ExpertFn | None, hidden_size: int) -> None:
        """The proxy of `layer` computes its experts on the host with `fn` (None: this layer cannot, e.g. its
        experts module keeps device tensors of its own besides the experts)."""
        if fn is None:
            self._fns.pop(layer, None)
        else:
            self._fns[layer] = (fn, hidden_size)

    # -- planning (manager.observe and begin, under its lock) ---------------------------------------
    def block(self, layer: int, width: int, stall_s: Callable[[], float] | None = None) -> None:
        """A block of `layer` runs `width` tokens: at a step's first block, the switch decides the step
        (`stall_s()`: the seconds the device has waited for copies so far, what host sends could save)."""
        if self.active and self.switch is not None and (self._last_layer is None or layer <= self._last_layer):
            self.sending = self.switch.step(width, stall_s() if stall_s is not None else None)
        self._last_layer = layer

    def split(self, layer: int, misses: list[int], rows: Mapping[int, int], use_rate=None) -> tuple[list[int], list[int]]:
        """(copied, host) for this block's misses (`rows`: expert -> its rows in the block); measures the link
        and the layer's host times first if unknown. `use_rate[e]`: how often expert e is used lately (the heat
        tracker's): misses are planned most used first, so the link, whose copies stay in the cache, carries
        the experts likeliest to be used again and the host the rest (a host-served miss takes no slot)."""
        if not (self.active and self.sending) or layer not in self._fns or min(rows[e] for e in misses) > self.costs.max_rows:
            return misses, []
        if use_rate is not None:
            misses = sorted(misses, key=lambda e: -use_rate[e])  # stable: ties keep the router's order
        n = [rows[e] for e in misses]
        self._measured(layer)
        return self.costs.split(layer, misses, n, self.store.record_bytes(layer))

    def place_parts(
        self, layer: int, experts: list[int], rows: Sequence[int], misses: Sequence[int] = ()
    ) -> tuple[list[int], list[int]]:
        """host_compute="split": (copied, host) for the host parts of a block's `experts`, before its misses'
        copies (`misses`: each one's bytes) are queued: an expert with more than `max_rows` rows (a prefill's)
        has its host part copied and computed on the device, and so do those `HostCosts.balance` moves off a
        host that would finish after the link. Measures the link and the layer's host times first if unknown,
        and books the parts' copies on the link. On a CPU device (no link: both paths use the same cores) every
        part with few rows stays on the host, unless a cost model was injected."""
        limit, nbytes = self.costs.max_rows, self.parts.expert_bytes(layer)
        crowded = [e for e, n in zip(experts, rows) if n > limit]
        small = [(e, n) for e, n in zip(experts, rows) if n <= limit]
        moved = []
        if small and layer in self._fns and (self.device.type != "cpu" or self._injected):
            self._measured(layer)
            moved = self.costs.balance(layer, [e for e, _ in small], [n for _, n in small], nbytes, ahead=misses)
        copied = crowded + moved
        for _ in copied:
            self.copy_issued(nbytes)
        return copied, [e for e, _ in small if e not in moved]

    def observe_link(self, bytes_per_s: float | None) -> None:
        """The link's speed as the latest copies met it (`Loader.link_speed`; None: not known yet): planned with
        from now on instead of the probe's, which one busy moment of the host can misread (an injected cost
        model keeps its own)."""
        if bytes_per_s is not None and not self._injected:
            self.costs.link_bytes_per_s = bytes_per_s

    def copy_issued(self, nbytes: int) -> None:
        """A copy of `nbytes` was queued (on CUDA: asynchronous; on a CPU a copy is done when it returns)."""
        if self.costs.link_bytes_per_s is not None and self.device.type == "cuda":
            self.costs.copy_issued(nbytes)

    # -- running (the proxy) -----------------------------------------------------------------------
    def weights(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Expert `expert` of `layer` as typed views of its host record, or of its host part (no copy)."""
        if self.parts is not None:
            return self.parts.weights(layer, expert)
        # the host computes only from uncompressed stores, where each fused tensor's expert slice is contiguous
        return {name: v[expert] for name, v in self.store.expert_views(layer).items()}

    def start(self, layer: int | None, experts: Sequence[int], inputs: Callable[[int], torch.Tensor]) -> HostJob:
        """Start computing `experts` of `layer` on the host: `inputs(e)` is expert e's rows [n_e, H] on the
        device. Their rows go to the host in one copy; the worker computes each expert in turn."""
        submitted = time.perf_counter()
        xs = [inputs(e) for e in experts]
        x = torch.cat(xs) if len(xs) > 1 else xs[0]  # [N, H]
        ready = None
        if x.device.type == "cuda":
            host_x = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            host_x.copy_(x, non_blocking=True)  # [N, H] D2H, ordered after the rows were computed
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(x.device))
        else:
            host_x = x.contiguous()
        sizes = [t.shape[0] for t in xs]
        fn = self._fns[layer][0] if layer in self._fns else _echo
        weights = (lambda e: {}) if fn is _echo else (lambda e: self.weights(layer, e))  # noqa: E731
        planned = self.costs.job_s(layer, sizes) if layer in self.costs.host_s else None  # None: not timed
        future = self._worker().submit(self._run, layer, list(experts), sizes, host_x, ready, fn, weights, planned, submitted)
        return HostJob(future, list(experts), sizes, x.device)

    def _run(
        self, layer, experts: list[int], sizes: list[int], x: torch.Tensor, ready, fn: ExpertFn, weights, planned, submitted
    ) -> torch.Tensor:
        # On the worker thread. x [N, H] on the host, experts' rows back to back in `sizes`; `planned`: the
        # job's planned seconds (None: not planned), `submitted`: when `start` was called.
        if ready is not None:
            ready.synchronize()  # the rows have landed
        outs, a = [], 0
        with torch.no_grad():
            for e, n in zip(experts, sizes):
                t0 = time.perf_counter()
                outs.append(fn(e, weights(e), x[a : a + n]))  # [n, H]; the views' cost counts too
                self.costs.observe(layer, n, time.perf_counter() - t0)
                a += n
        y = torch.cat(outs) if len(outs) > 1 else outs[0]  # [N, H]
        if ready is not None:
            pinned = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)  # the H2D copy reads it asynchronously
            pinned.copy_(y)
            y = pinned
        if planned is not None:
            self.costs.observe_job(planned, time.perf_counter() - submitted)
        return y

    # -- measuring ---------------------------------------------------------------------------------
    def _measured(self, layer: int) -> None:
        """Measure the link and `layer`'s host times where they are not known yet."""
        if self.costs.link_bytes_per_s is None:
            self._measure_link(layer)
        if layer not in self.costs.host_s:
            self._measure_layer(layer)

    def _measure_link(self, layer: int) -> None:
        """Link speed and per-copy overhead from host→device copies of a record's first bytes (up to 64 KiB,
        and up to 16 MiB; the transient device buffer is freed at once). On CPU, a memcpy."""
        record = max((piece for _, piece in self.store.pieces(layer, 0)), key=torch.Tensor.numel)  # as it lies in host memory
        big = min(LINK_PROBE_BYTES, record.numel())
        small = max(min(LINK_PROBE_SMALL_BYTES, big // 4), 1)
        dst = torch.empty(big, dtype=torch.uint8, device=self.device)
        src = record  # from where the loader copies it: a pageable or disk record crosses at its (slower) speed

        def timed(n: int) -> float:
            times = []
            for _ in range(6):
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                t0 = time.perf_counter()
                dst[:n].copy_(src[:n], non_blocking=True)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                times.append(time.perf_counter() - t0)
            return min(times[1:])

        t_small, t_big = timed(small), timed(big)  # `dst` is freed on return
        # The slope is the speed and what is left of the small copy the fixed cost, where the two timings agree
        # with that: a slope steeper than the large copy's own average, or far flatter (a small copy delayed by
        # a busy host: a link several times faster than it is would send the block's work to it), gives way to
        # the average alone, which counts the fixed cost in.
        average = max(t_big, 1e-9) / big
        slope = (t_big - t_small) / (big - small) if big > small else 0.0
        per_byte = slope if MIN_SLOPE_OF_AVERAGE * average <= slope <= average else average
        overhead = max(t_small - small * per_byte, 0.0)
        self.costs.link_bytes_per_s, self.costs.copy_overhead_s = 1.0 / per_byte, overhead

    def _measure_layer(self, layer: int) -> None:
        """Host seconds of one expert of `layer` per row count in BENCH_ROWS (on the worker, with the
        proxy's math), shared by every layer of the same shape; and the fixed cost of a host job (a round
        trip through the worker), once. Each timed call reads another expert, so its weights come from
        memory as in use (one expert read again would be served from the CPU's caches when it fits)."""
        shape = (self.store.raw_layout(layer).signature, self._fns[layer][1])
        for other, table in self.costs.host_s.items():
            if other in self._fns and (self.store.raw_layout(other).signature, self._fns[other][1]) == shape:
                self.costs.host_s[layer] = table
                return
        fn, hidden = self._fns[layer]
        dtype = self.store.dtype(layer)
        E = self.store.num_experts(layer)

        def bench() -> dict[int, float]:
            table, calls = {}, 0
            rng = torch.Generator().manual_seed(0)  # its own: the process's generator is the user's (seeded sampling)
            with torch.no_grad():
                for n in (r for r in BENCH_ROWS if r <= self.costs.max_rows):
                    x = torch.randn(n, hidden, dtype=dtype, generator=rng)
                    times = []
                    for _ in range(BENCH_REPEATS + 1):  # the first call warms up
                        t0 = time.perf_counter()
                        fn(calls % E, self.weights(layer, calls % E), x)
                        calls += 1
                        times.append(time.perf_counter() - t0)
                    table[n] = min(times[1:])
            return table

        self.costs.host_s[layer] = self._worker().submit(bench).result(RESULT_TIMEOUT_S)
        if not self._overhead_known:
            self._measure_overhead(hidden, dtype)
            self._overhead_known = True

    def _measure_overhead(self, hidden: int, dtype: torch.dtype) -> None:
        """A host job's fixed cost: rows to the host, a hand-off to the worker and back, outputs to the device."""
        x = torch.zeros(1, hidden, dtype=dtype, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # not the queued work of the block being planned
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            self.start(None, [0], lambda e: x).collect()  # no layer: the rows come back unchanged
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - t0)
        self.costs.host_overhead_s = statistics.median(times)

    def close(self) -> None:
        self.active = False  # unloaded: nothing is planned or measured any more
        if self._pid == os.getpid():  # a forked child's copy of the parent's pool has no thread to join
            self._pool.shutdown(wait=True)


class HostJob:
    """The host experts of one block, computing on the worker."""

    def __init__(self, future: Future, experts: list[int], sizes: list[int], device: torch.device) -> None:
        self.future, self.experts, self.sizes, self.device = future, experts, sizes, device

    def collect(self) -> list[tuple[int, torch.Tensor]]:
        """Wait for the worker, copy the outputs to the device (one H2D on the current stream), and return
        each expert's rows [n_e, H] there, in the order `start` got them."""
        y = self.future.result(RESULT_TIMEOUT_S)  # [N, H] on the host
        if self.device.type == "cuda":
            y = y.to(self.device, non_blocking=True)  # the pinned allocator keeps the buffer until the copy is done
        out, a = [], 0
        for e, n in zip(self.experts, self.sizes):
            out.append((e, y[a : a + n]))
            a += n
        return out
