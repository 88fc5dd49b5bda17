"""How one system is measured: warm-up, TTFT, decode and beam tokens/s per phase, peak GPU memory, mira's transfer
counters over the decode steps, the routing of the batch-1 decode, host and pinned memory, copy bandwidths."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass

import torch
from common import device_bandwidth, h2d_bandwidth, sync
from transformers import StoppingCriteria, StoppingCriteriaList

from . import GB
from .clock import Deadline
from .workloads import Workload


@dataclass(frozen=True)
class Settings:
    device: str
    prompt_len: int
    new_tokens: int
    batch: int
    beams: int
    beam_tokens: int
    accelerate_tokens: int
    warmup_tokens: int
    seed: int


class FirstStep(StoppingCriteria):
    """Called by generate after every step; at the first one (prefill done) it notes the time and a
    snapshot of mira's counters, so decode-phase numbers exclude the prefill. It keeps the sequences
    so far (`ids`, no copy). Never stops anything."""

    def __init__(self, manager=None) -> None:
        self.manager = manager
        self.t: float | None = None
        self.counters: dict | None = None
        self.ids: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.ids = input_ids
        if self.t is None:
            sync()
            self.t = time.perf_counter()
            self.counters = mira_counters(self.manager) if self.manager is not None else None
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def mira_counters(manager) -> dict:
    s = manager.stats()  # resolves pending stall timings (one sync)
    keys = ("bytes_h2d", "stall_s", "hits", "misses", "loads", "prefetches", "prefetch_used", "speculated", "speculated_used")
    return {k: s.get(k) or 0 for k in keys}


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def generate_timed(
    model, ids: torch.Tensor, new: int, beams: int, pad_id: int, deadline: Deadline | None, probe=None, extra=None
):
    """Greedy (or beam) generate of exactly `new` tokens; returns (seconds, tokens generated, end time).
    Fewer tokens only when the time guard's max_time cut the call (`deadline`; None: no guard). `extra`: more
    generate keywords (`compiled_generate_kwargs`: a static cache and generate's compilation)."""
    kw = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        num_beams=beams,
        pad_token_id=pad_id,
    )
    if deadline is not None:
        kw["max_time"] = deadline.max_time()
    if probe is not None:
        kw["stopping_criteria"] = StoppingCriteriaList([probe])
    kw.update(extra or {})
    sync()
    t0 = time.perf_counter()
    out = model.generate(ids, **kw)
    sync()
    t1 = time.perf_counter()
    return t1 - t0, int(out.shape[1] - ids.shape[1]), t1


def generator(model, pad_id: int = 0, deadline: Deadline | None = None, extra=None):
    """`generate_timed` on `model` as the `gen(x, n, beams=1, probe=None)` that `timed_decode` and `decode_phase`
    call."""

    def gen(x, n, beams=1, probe=None):
        return generate_timed(model, x, n, beams, pad_id, deadline, probe, extra)

    return gen


def timed_decode(
    gen, x: torch.Tensor, new: int, beams: int = 1, manager=None
) -> tuple[float | None, int, FirstStep, float, float]:
    """One generate of `new` tokens whose decode is timed within the call: from the end of its first step (the
    `FirstStep` probe: prefill and first token) to its end. Returns (decode steps per second, None if it made
    fewer than two tokens; tokens generated; the probe; the call's seconds; its end time). Taking a separately
    timed one-token generate off the call's time instead lets that call's own prefill, copies included, swamp a
    decode of a few steps."""
    probe = FirstStep(manager)
    total, got, end = gen(x, new, beams=beams, probe=probe)
    rate = (got - 1) / (end - probe.t) if got > 1 and probe.t is not None and end > probe.t else None
    return rate, got, probe, total, end


def median_of(speeds: list, row: dict, name: str) -> float | None:
    """The median of a phase's measured `speeds` (None where too few tokens were timed); with more than one,
    `row[name + "_rounds"]` keeps them all."""
    if len(speeds) > 1:
        row[name + "_rounds"] = speeds
    timed = [v for v in speeds if v]
    return statistics.median(timed) if timed else None


def release_wrapped(manager) -> None:
    """Free what a wrapped model holds beyond its Python objects, before the next system is built: its device arena
    (`ExpertManager.close`), its host-compute worker and its store's host memory."""
    manager.close()
    manager.host.close()
    manager.store.close()


def compiled_generate_kwargs(on_cpu: bool, mode: str = "reduce-overhead") -> dict:
    """generate keywords that compile the model's forward as a user would (`compile_config`, the whole graph, a
    static cache); each experts proxy stays one opaque operator inside it. On a CPU generate compiles only if told."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, mode=mode)
    config._compile_all_devices = on_cpu
    return dict(cache_implementation="static", compile_config=config)


class OutOfTime(Exception):
    """The time guard ran out before a generate call: the rest of the system is skipped."""


class PeakMemory:
    """max_memory_allocated over phases (reset before each, so each phase's peak is known too)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.phases: dict[str, float] = {}

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def stop(self, phase: str) -> None:
        if self.cuda:
            self.phases[phase] = torch.cuda.max_memory_allocated() / GB

    @property
    def overall(self) -> float | None:
        return max(self.phases.values()) if self.phases else None


@dataclass(frozen=True)
class Phase:
    """One timed generate of a system: `key` names it in the results and the per-phase peaks ("b1", "b8",
    "beam"), `name` in the notes; `trace` receives the phase's routing (mira systems only); with `tokens`
    a decode phase's result holds its generated ids."""

    key: str
    name: str
    ids: torch.Tensor  # [B, S] prompts
    new_tokens: int
    beams: int = 1
    trace: list | None = None
    tokens: bool = False


def standard_phases(ids: torch.Tensor, s: Settings, new: int, beam_new: int, traces: dict | None = None) -> list[Phase]:
    """Batch-1 decode, batch-`s.batch` decode and beam-`s.beams`, in the order every system is measured.
    `traces` maps "b1"/"b8" to the list that phase's routing goes to."""
    traces = traces or {}
    return [
        Phase("b1", "batch-1 decode", ids[:1], new, 1, traces.get("b1")),
        Phase("b8", f"batch-{s.batch} decode", ids[: s.batch], new, 1, traces.get("b8")),
        Phase("beam", f"beam-{s.beams}", ids[:1], beam_new, s.beams),
    ]


def run_phases(
    model, phases: list[Phase], warmup: int, deadline: Deadline, pad_id: int, row: dict, manager=None
) -> dict[str, dict]:
    """Run `phases` in order, each warmed up at its own shapes: decode phases through `decode_phase` (TTFT,
    tokens/s and, for a mira model, its counters), beam phases as one timed call. Returns {key: result};
    `row` gets the peak GPU memory (overall and per phase) and, where the time guard cut or skipped a
    phase, status "partial" and a note."""
    peak = PeakMemory(any(p.ids.is_cuda for p in phases))
    results: dict[str, dict] = {}

    def gen(x, n, beams=1, probe=None):
        if deadline.remaining() <= 0:
            raise OutOfTime
        return generate_timed(model, x, n, beams, pad_id, deadline, probe)

    for p in phases:
        peak.start()
        try:
            if p.beams == 1:
                d = decode_phase(gen, p.ids, p.new_tokens, warmup, manager, p.trace, p.tokens)
            else:
                gen(p.ids, warmup, beams=p.beams)
                total, got, _ = gen(p.ids, p.new_tokens, beams=p.beams)
                d = dict(total_s=total, new_tokens=got, tok_s=got / total)
        except OutOfTime:
            row["status"] = "partial"
            row["notes"].append(f"time budget spent: skipped from {p.name} on")
            break
        finally:
            peak.stop(p.key)
        if d["new_tokens"] < p.new_tokens:
            row["status"] = "partial"
            row["notes"].append(f"{p.name} cut at {d['new_tokens']}/{p.new_tokens} tokens by the time guard")
        results[p.key] = d
    row["peak_gpu_gb"] = peak.overall
    row["peak_gpu_gb_by_phase"] = dict(peak.phases)
    return results


# The row's name of each phase result's value; decode_phase gives the mira counters only for a mira model.
ROW_KEYS = {
    "b1": dict(
        ttft_s="ttft_s",
        total_s="total_b1_s",
        new_tokens="new_tokens_b1",
        tok_s="decode_tok_s_b1",
        decode_s="decode_s_b1",
        h2d_bytes_per_step="h2d_bytes_per_token",
        h2d_gbps="h2d_gbps_decode",
        stall_share="stall_share",
        stall_s_per_step="stall_s_per_token",
        hit_rate="hit_rate",
        loads_per_step="loads_per_token",
        prefetches_per_step="prefetches_per_token",
    ),
    "b8": dict(
        ttft_s="ttft_b8_s",
        total_s="total_b8_s",
        new_tokens="new_tokens_b8",
        h2d_bytes_per_step="h2d_bytes_per_step_b8",
        h2d_gbps="h2d_gbps_decode_b8",
        stall_share="stall_share_b8",
        hit_rate="hit_rate_b8",
    ),
    "beam": dict(total_s="beam_s", new_tokens="beam_tokens", tok_s="beam_tok_s"),
}


def phase_metrics(results: dict[str, dict], batch: int) -> dict:
    """The flat row fields of `run_phases`' results (the keys of the phases that ran): batch-8 tokens/s
    count every sequence of the batch."""
    out = {
        name: results[phase][key]
        for phase, names in ROW_KEYS.items()
        if phase in results
        for key, name in names.items()
        if key in results[phase]
    }
    if "b1" in results:
        tok_s = results["b1"]["tok_s"]
        out["time_per_token_s"] = 1.0 / tok_s if tok_s else None
    if "b8" in results:
        tok_s = results["b8"]["tok_s"]
        out["decode_tok_s_b8"] = batch * tok_s if tok_s else None
    return out


def measure(
    model,
    row: dict,
    wl: Workload,
    s: Settings,
    deadline: Deadline,
    manager=None,
    trace: list | None = None,
    accelerate: bool = False,
) -> None:
    """Fill `row` with TTFT, decode tok/s (batch 1 and `s.batch`), beam tok/s, peak memory and, for a
    mira model (`manager`), decode-phase transfer counters. `trace` receives the batch-1 routing."""
    new = s.accelerate_tokens if accelerate else s.new_tokens
    beam_new = s.accelerate_tokens if accelerate else s.beam_tokens
    ids = wl.prompts(s.batch, s.prompt_len, wl.facts["vocab_size"], s.device)
    phases = standard_phases(ids, s, new, beam_new, {"b1": trace})
    results = run_phases(model, phases, s.warmup_tokens, deadline, wl.facts["pad_token_id"], row, manager)
    row.update(phase_metrics(results, s.batch))


def decode_phase(
    gen, x: torch.Tensor, new: int, warmup: int, manager=None, trace: list | None = None, tokens: bool = False
) -> dict:
    """Warm up at the same shapes, time the first token alone (TTFT), then `new` tokens, whose decode steps/s are
    timed within that call (`timed_decode`). Mira's counters are taken between the first step and the end. With
    `tokens`, the result also holds the timed call's generated ids (a list per sequence)."""
    gen(x, warmup)
    ttft = gen(x, 1)[0]
    if manager is not None:
        manager.reset_stats()
    recorder_before = manager.recorder if manager is not None else None
    if manager is not None and trace is not None:
        # stays on the device, no sync: one tiny copy per block
        manager.recorder = lambda layer, hidden, top_k_index: trace.append((layer, top_k_index.detach().clone()))
    try:
        rate, got, probe, total, end = timed_decode(gen, x, new, manager=manager)
    finally:
        if manager is not None:
            manager.recorder = recorder_before
    out = dict(ttft_s=ttft, total_s=total, new_tokens=got, tok_s=rate)
    if tokens and probe.ids is not None:
        out["tokens"] = probe.ids[:, x.shape[1] :].tolist()
    if manager is not None and probe.counters is not None and got > 1:
        c = _delta(mira_counters(manager), probe.counters)
        decode_s, steps = end - probe.t, got - 1
        out.update(
            decode_s=decode_s,
            h2d_bytes_per_step=c["bytes_h2d"] / steps,
            h2d_gbps=c["bytes_h2d"] / decode_s / GB,
            stall_share=c["stall_s"] / decode_s,
            stall_s_per_step=c["stall_s"] / steps,
            hit_rate=c["hits"] / max(c["hits"] + c["misses"], 1),
            loads_per_step=c["loads"] / steps,
            prefetches_per_step=c["prefetches"] / steps,
            # how often a copy ahead of the router was for an expert its block then used
            prefetch_used_share=c["prefetch_used"] / c["prefetches"] if c["prefetches"] else None,
            speculated_per_step=c["speculated"] / steps,
            speculated_used_share=c["speculated_used"] / c["speculated"] if c["speculated"] else None,
        )
    return out


def trace_steps(records: list) -> list[dict[int, list[int]]]:
    """Recorder calls → forward steps (a new step starts when the layer does not increase), each a
    map layer → sorted experts used. Step 0 is the prefill."""
    steps: list[dict[int, list[int]]] = []
    last = None
    for layer, idx in records:
        if last is None or layer <= last:
            steps.append({})
        steps[-1][layer] = sorted(set(idx.reshape(-1).tolist()))
        last = layer
    return steps


def routing_trace(records: list, manager) -> dict:
    """What the limit replays: the recorded routing as forward steps, with the cache's pools, slots and
    record bytes (`limits.compute_limit`'s `trace`)."""
    return dict(
        steps=trace_steps(records),
        pool_of_layer=dict(manager.budget.pool_of_layer),
        n_slots=dict(manager.budget.n_slots),
        record_bytes={layer: manager.store.record_bytes(layer) for layer in manager.store.layers},
    )


def free_device_cache() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def empty_host_cache() -> None:
    """Give cached pinned blocks back to the OS (the pinned allocator keeps freed blocks for reuse,
    which lets the next mira store skip pinning; between workloads it only costs host RAM)."""
    if not torch.cuda.is_available():
        return
    for fn in (getattr(torch.accelerator, "empty_host_cache", None), getattr(torch._C, "_host_emptyCache", None)):
        if fn is not None:
            with contextlib.suppress(Exception):
                fn()
                return


def host_rss_gb() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / GB
    except OSError:
        return None
    return None


def pinned_host_gb() -> float | None:
    if not torch.cuda.is_available():
        return None
    try:
        stats = torch.cuda.host_memory_stats()
    except Exception:
        return None
    for key in ("allocated_bytes.current", "allocated_bytes.all.current", "reserved_bytes.current"):
        if key in stats:
            return stats[key] / GB
    return None


def measure_bandwidth(smoke: bool) -> dict:
    if smoke or not torch.cuda.is_available():
        a = torch.empty(64 * 2**20, dtype=torch.uint8)
        b = torch.empty_like(a)
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            b.copy_(a)
            times.append(time.perf_counter() - t0)
        t = sorted(times[1:])[1]
        return dict(
            h2d_gbps=a.numel() / t / GB,
            h2d_pageable_gbps=None,
            device_gbps=2 * a.numel() / t / GB,
            measured_on="CPU memcpy stand-in (smoke)",
        )
    out = dict(
        h2d_gbps=h2d_bandwidth(),
        h2d_pageable_gbps=h2d_bandwidth(pinned=False),
        device_gbps=device_bandwidth(),
        measured_on="this GPU",
    )
    free_device_cache()
    return out
