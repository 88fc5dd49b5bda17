"""How one system is measured: warm-up, TTFT, decode and beam tokens/s per phase, peak GPU memory, mira's transfer
counters over the decode steps, the routing of the batch-1 decode, host and pinned memory, copy bandwidths."""

from __future__ import annotations

import contextlib
import gc
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
    snapshot of mira's counters, so decode-phase numbers exclude the prefill. Never stops anything."""

    def __init__(self, manager=None) -> None:
        self.manager = manager
        self.t: float | None = None
        self.counters: dict | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.t is None:
            sync()
            self.t = time.perf_counter()
            self.counters = mira_counters(self.manager) if self.manager is not None else None
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def mira_counters(manager) -> dict:
    s = manager.stats()  # resolves pending stall timings (one sync)
    return {k: s.get(k) or 0 for k in ("bytes_h2d", "stall_s", "hits", "misses", "loads", "prefetches")}


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def generate_timed(model, ids: torch.Tensor, new: int, beams: int, pad_id: int, deadline: Deadline, probe=None):
    """Greedy (or beam) generate of exactly `new` tokens; returns (seconds, tokens generated, end time).
    Fewer tokens only when the time guard's max_time cut the call."""
    kw = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        num_beams=beams,
        pad_token_id=pad_id,
        max_time=deadline.max_time(),
    )
    if probe is not None:
        kw["stopping_criteria"] = StoppingCriteriaList([probe])
    sync()
    t0 = time.perf_counter()
    out = model.generate(ids, **kw)
    sync()
    t1 = time.perf_counter()
    return t1 - t0, int(out.shape[1] - ids.shape[1]), t1


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
    pad = wl.facts["pad_token_id"]
    new = s.accelerate_tokens if accelerate else s.new_tokens
    beam_new = s.accelerate_tokens if accelerate else s.beam_tokens
    ids = wl.prompts(s.batch, s.prompt_len, wl.facts["vocab_size"], s.device)
    peak = PeakMemory(s.device.startswith("cuda"))

    def gen(x, n, beams=1, probe=None):
        if deadline.remaining() <= 0:
            raise OutOfTime
        return generate_timed(model, x, n, beams, pad, deadline, probe)

    phases = [
        ("b1", "batch-1 decode", ids[:1], new, 1),
        ("b8", f"batch-{s.batch} decode", ids, new, 1),
        ("beam", f"beam-{s.beams}", ids[:1], beam_new, s.beams),
    ]
    for key, name, x, n, beams in phases:
        peak.start()
        try:
            if beams == 1:
                d = decode_phase(gen, x, n, s.warmup_tokens, manager, trace if key == "b1" else None)
            else:
                gen(x, s.warmup_tokens, beams=beams)
                d = dict(zip(("total_s", "new_tokens"), gen(x, n, beams=beams)[:2]))
        except OutOfTime:
            row["status"] = "partial"
            row["notes"].append(f"time budget spent: skipped from {name} on")
            break
        finally:
            peak.stop(key)
        if d["new_tokens"] < n:
            row["status"] = "partial"
            row["notes"].append(f"{name} cut at {d['new_tokens']}/{n} tokens by the time guard")
        if key == "b1":
            row.update(ttft_s=d["ttft_s"], total_b1_s=d["total_s"], new_tokens_b1=d["new_tokens"], decode_tok_s_b1=d["tok_s"])
            row["time_per_token_s"] = 1.0 / d["tok_s"] if d["tok_s"] else None
            if "h2d_bytes_per_step" in d:
                row.update(
                    decode_s_b1=d["decode_s"],
                    h2d_bytes_per_token=d["h2d_bytes_per_step"],
                    h2d_gbps_decode=d["h2d_gbps"],
                    stall_share=d["stall_share"],
                    stall_s_per_token=d["stall_s_per_step"],
                    hit_rate=d["hit_rate"],
                    loads_per_token=d["loads_per_step"],
                    prefetches_per_token=d["prefetches_per_step"],
                )
        elif key == "b8":
            row.update(ttft_b8_s=d["ttft_s"], total_b8_s=d["total_s"], new_tokens_b8=d["new_tokens"])
            row["decode_tok_s_b8"] = s.batch * d["tok_s"] if d["tok_s"] else None
            if "h2d_bytes_per_step" in d:
                row.update(
                    h2d_bytes_per_step_b8=d["h2d_bytes_per_step"],
                    h2d_gbps_decode_b8=d["h2d_gbps"],
                    stall_share_b8=d["stall_share"],
                    hit_rate_b8=d["hit_rate"],
                )
        else:
            row.update(beam_s=d["total_s"], beam_tokens=d["new_tokens"], beam_tok_s=d["new_tokens"] / d["total_s"])
    row["peak_gpu_gb"] = peak.overall
    row["peak_gpu_gb_by_phase"] = dict(peak.phases)


def decode_phase(gen, x: torch.Tensor, new: int, warmup: int, manager=None, trace: list | None = None) -> dict:
    """Warm up at the same shapes, time the first token alone (TTFT), then `new` tokens. Decode steps/s =
    (tokens - 1) / (total - TTFT). Mira's counters are taken between the first step and the end."""
    gen(x, warmup)
    ttft = gen(x, 1)[0]
    if manager is not None:
        manager.reset_stats()
    probe = FirstStep(manager)
    recorder_before = manager.recorder if manager is not None else None
    if manager is not None and trace is not None:
        # stays on the device, no sync: one tiny copy per block
        manager.recorder = lambda layer, hidden, top_k_index: trace.append((layer, top_k_index.detach().clone()))
    try:
        total, got, end = gen(x, new, probe=probe)
    finally:
        if manager is not None:
            manager.recorder = recorder_before
    out = dict(ttft_s=ttft, total_s=total, new_tokens=got, tok_s=(got - 1) / (total - ttft) if got > 1 and total > ttft else None)
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
