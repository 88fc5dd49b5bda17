"""End-to-end benchmark: mira-hf vs all-resident transformers vs accelerate offload, with the limit.

One process, one GPU. For each workload (Mixtral-8x7B shape with 8 layers, Qwen3-30B-A3B shape with
12 layers, both random-initialised in bf16 at real dimensions; the bundled trained `mira-tiny` with
real routing) and each expert budget, it measures the same prompts under each system:

    resident    all experts on the GPU (plain transformers)
    accelerate  transformers + accelerate offload: save_pretrained, then from_pretrained(device_map="auto",
                max_memory={0: non-expert + budget + 2 GB, "cpu": "100GiB"}), as a user would set it up
    lru         reactive expert cache: MiraConfig(gpu_budget=B, policy="lru", predictor=None)
    default     MiraConfig(gpu_budget=B): whatever the library's defaults are
    int4        MiraConfig(gpu_budget=B, quantization="int4"), when the library supports it

Metrics: TTFT (512-token prompt, batch 1), decode tokens/s at batch 1 and 8 (64 new tokens), beam-4
tokens/s (32 new tokens), peak GPU memory, and for mira: host→device bytes per token, achieved H2D
bandwidth, share of decode time stalled, hit rate. The limit per decode token is
max(bytes a token touches / device-memory bandwidth, Belady's bytes per token / pinned H2D bandwidth),
with Belady's optimal cache (same slot count) replayed over the routing trace recorded here.

    python benchmarks/run.py                          # H200 defaults: finishes inside 9 minutes
    python benchmarks/run.py --smoke --out /tmp/bench # CPU, tiny shapes, seconds
    python benchmarks/run.py --from-json FILE.json    # re-render FILE.md / FILE.png from a result

Writes OUT/<date>-<device>.json (after every system, so an interrupted run keeps what it measured),
OUT/<date>-<device>.md and OUT/<date>-<device>.png, and prints the tables and the headline ratios
(a --smoke run prints what it ran and no ratios: its tiny shapes on a CPU measure nothing).
"""

from __future__ import annotations

import time

_T_START = time.perf_counter()  # the time guard counts from here, imports included

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections import defaultdict  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

if __name__ == "__main__":  # before transformers is imported; not when a test imports this file
    # Quiet, offline Hugging Face: no progress bars, no hub calls (the GPU machine has no internet).
    for _k, _v in (
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_VERBOSITY", "error"),
        ("TOKENIZERS_PARALLELISM", "false"),
    ):
        os.environ.setdefault(_k, _v)

import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import transformers  # noqa: E402
from common import (  # noqa: E402
    device_bandwidth,
    device_slug,
    environment,
    h2d_bandwidth,
    print_table,
    random_model_on_device,
    sync,
    write_json,
)
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList  # noqa: E402

import mira_hf.config  # noqa: E402
from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.replay import belady_misses  # noqa: E402
from model_adapters import get_adapter  # noqa: E402

# workload key -> (label, shape on the GPU, shape in --smoke: common.SMOKE_SHAPES); shape None = the bundled trained model
WORKLOADS = {
    "mixtral": ("Mixtral-8x7B shape, 8 layers (random bf16)", "mixtral-8x7b-8l", "mixtral-smoke"),
    "qwen3": ("Qwen3-30B-A3B shape, 12 layers (random bf16)", "qwen3-30b-a3b-12l", "qwen3-smoke"),
    "bundled": ("mira-tiny, bundled trained model (real routing)", None, None),
}
SYSTEMS = ["resident", "accelerate", "lru", "default", "bf16", "int4", "int4-packed"]  # display order; --variant appends
MIRA_SYSTEMS = ["lru", "default", "bf16", "int4", "int4-packed"]
SYSTEM_LABELS = {
    "resident": "all resident (transformers)",
    "accelerate": "transformers + accelerate offload",
    "lru": "mira-hf reactive LRU cache",
    "default": "mira-hf default",
    "bf16": "mira-hf default policy, uncompressed (bf16) transfer",
    "int4": "mira-hf int4 transfer (dequantised into bf16 slots)",
    "int4-packed": "mira-hf int4, experts kept packed on the GPU",
}
# MiraConfig fields of each mira system, on top of gpu_budget and device.
MIRA_OVERRIDES: dict[str, dict] = {
    "lru": dict(policy="lru", predictor=None, quantization=None),
    "default": {},
    "bf16": dict(quantization=None),
    "int4": dict(quantization="int4"),
    "int4-packed": dict(quantization="int4", quant=mira_hf.config.QuantConfig(placement="packed")),
}
# Every row carries these keys (None when not applicable); tests/test_bench_smoke.py checks them.
METRIC_KEYS = (
    "system",
    "label",
    "budget",
    "status",
    "error",
    "notes",
    "setup_s",
    "ttft_s",
    "decode_tok_s_b1",
    "decode_tok_s_b8",
    "beam_tok_s",
    "peak_gpu_gb",
    "h2d_bytes_per_token",
    "h2d_gbps_decode",
    "stall_share",
    "hit_rate",
    "time_per_token_s",
    "x_limit",
    "x_own_limit",
)
GB = 1e9
ACCELERATE_GPU_MARGIN_BYTES = 2 * 10**9  # "+ 2 GB" on top of mira's non-expert + budget bytes
COMPARE_MODEL, COMPARE_BUDGET = "mixtral", 0.25  # where the headline comparisons are read


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T_START:6.1f}s] {msg}", flush=True)


# -- settings and the time guard ------------------------------------------------------------------
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


class Deadline:
    """The global time guard: systems that would not finish in time are skipped with a note."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - _T_START

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()

    def max_time(self) -> float:
        """A bound for one generate call: what is left plus some grace, so one slow call cannot run away."""
        return max(self.remaining(), 0.0) + 10.0


# -- workloads ------------------------------------------------------------------------------------
@dataclass
class Workload:
    key: str
    label: str
    shape: str | None  # a SHAPES key; None = the bundled model
    seed: int
    facts: dict = field(default_factory=dict)  # filled from the first model built
    checkpoint: str | None = None  # saved copy for accelerate (random shapes only)
    checkpoint_save_s: float | None = None
    _scratch: str | None = None  # a temporary folder of this workload (checkpoint, accelerate's offload)

    def build(self, device: str):
        """A fresh model: random shapes are built directly on `device` (same seed, so the same weights
        every time); the bundled model is loaded on the CPU (mira wraps it from there)."""
        if self.shape is not None:
            return random_model_on_device(self.shape, device=device, seed=self.seed)
        return AutoModelForCausalLM.from_pretrained(bundled_dir(), dtype=torch.bfloat16).eval()

    def prompts(self, batch: int, length: int, vocab: int, device: str) -> torch.Tensor:
        """[batch, length] token ids: held-out text for the bundled model, else seeded random ids."""
        if self.shape is None:
            from safetensors.torch import load_file

            flat = load_file(os.path.join(bundled_dir(), "heldout_tokens.safetensors"))["input_ids"].reshape(-1)
            if flat.numel() < batch * length:
                raise ValueError(f"held-out tokens hold {flat.numel()} ids, fewer than {batch} prompts of {length}.")
            ids = flat[: batch * length].view(batch, length)  # 512-token prompts = two consecutive 256-token rows
        else:
            g = torch.Generator().manual_seed(self.seed + 1)
            ids = torch.randint(3, vocab, (batch, length), generator=g)  # 0..2 are special ids
        return ids.long().to(device)

    def scratch(self, tmp_root: str, name: str) -> str:
        """A fresh folder `name` in this workload's temporary folder (removed by `cleanup`)."""
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix=f"mira-bench-{self.key}-", dir=tmp_root)
        path = os.path.join(self._scratch, name)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return path

    def save_checkpoint(self, model, tmp_root: str) -> str:
        """Save `model` once as a local transformers checkpoint (bf16, large shards) for accelerate."""
        if self.checkpoint is None:
            need = int(self.facts["total_bytes"] * 1.05) + 2 * 10**9
            free = shutil.disk_usage(tmp_root).free
            if free < need:
                raise RuntimeError(
                    f"not enough disk in {tmp_root} to save the model: {free / GB:.1f} GB free, {need / GB:.1f} GB needed. "
                    "Point --tmp-dir at a disk with room."
                )
            path = self.scratch(tmp_root, "checkpoint")
            t0 = time.perf_counter()
            model.save_pretrained(path, max_shard_size="5GB")
            self.checkpoint_save_s = time.perf_counter() - t0
            self.checkpoint = path
        return self.checkpoint

    def cleanup(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        self._scratch = self.checkpoint = None


def bundled_dir() -> str:
    try:
        from mira_hf.bundled import bundled_model_path

        return bundled_model_path()
    except ImportError:
        return os.path.join(REPO, "mira_hf", "bundled", "mira-tiny")


def model_facts(model) -> dict:
    """Byte counts of a freshly built (unwrapped) model; the routed experts found by its adapter."""
    adapter = get_adapter(model.config.model_type)
    experts = adapter.find_experts(model) if adapter else []
    expert_bytes = sum(p.numel() * p.element_size() for _, m in experts for p in m.parameters(recurse=False))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == emb.data_ptr()
    non_expert = total - expert_bytes
    E = experts[0][1].num_experts if experts else 0
    cfg = model.config
    top_k = getattr(cfg, "num_experts_per_tok", None) or 1
    return dict(
        model_type=cfg.model_type,
        moe_layers=len(experts),
        num_experts=E,
        top_k=top_k,
        vocab_size=cfg.vocab_size,
        total_bytes=total,
        expert_bytes=expert_bytes,
        non_expert_bytes=non_expert,
        # A token reads one row of the input embedding table, so the table is left out of "touched".
        non_expert_touched_bytes=non_expert - (0 if tied else emb.numel() * emb.element_size()),
        raw_record_bytes=expert_bytes // max(len(experts) * E, 1),
        pad_token_id=_pad_id(model),
        max_positions=getattr(cfg, "max_position_embeddings", None),
    )


def _pad_id(model) -> int:
    gen = getattr(model, "generation_config", None)
    for v in (
        getattr(gen, "pad_token_id", None),
        getattr(model.config, "pad_token_id", None),
        getattr(gen, "eos_token_id", None),
    ):
        if isinstance(v, list):
            v = v[0] if v else None
        if isinstance(v, int):
            return v
    return 0


# -- measuring ------------------------------------------------------------------------------------
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


# -- systems --------------------------------------------------------------------------------------
def new_row(system: str, budget: float | None) -> dict:
    row = dict.fromkeys(METRIC_KEYS)
    row.update(system=system, label=SYSTEM_LABELS[system], budget=budget, status="ok", notes=[])
    return row


def mira_config(system: str, budget: float, device: str) -> MiraConfig:
    return MiraConfig(gpu_budget=budget, device=device, **MIRA_OVERRIDES[system])


def add_variant(spec: str) -> str:
    """Register a mira system from `NAME:field=value,...` (`--variant`), e.g.
    `heat-only:predictor=none` or `depth8:cache.demand_inflight_bytes=3000000000`. Returns NAME."""
    name, _, fields = spec.partition(":")
    name = name.strip()
    if not name or name in SYSTEM_LABELS:
        raise SystemExit(f"--variant {spec!r}: give a new system name before ':' (taken: {', '.join(SYSTEM_LABELS)})")
    kw: dict = {}
    nested: dict[str, dict] = defaultdict(dict)
    for item in filter(None, (f.strip() for f in fields.split(","))):
        key, _, text = item.partition("=")
        value = _parse_value(text.strip())
        if "." in key:
            outer, inner = key.split(".", 1)
            nested[outer.strip()][inner.strip()] = value
        else:
            kw[key.strip()] = value
    defaults = MiraConfig()
    for outer, inner in nested.items():
        kw[outer] = dataclasses.replace(getattr(defaults, outer), **inner)
    MiraConfig(**kw)  # fail now, not after an hour of measurements
    SYSTEMS.append(name)
    MIRA_SYSTEMS.append(name)
    SYSTEM_LABELS[name] = f"mira-hf variant: {fields.strip() or 'defaults'}"
    MIRA_OVERRIDES[name] = kw
    return name


def _parse_value(text: str):
    if text.lower() == "none":
        return None
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def int4_supported() -> bool:
    return "int4" in getattr(mira_hf.config, "QUANTIZATIONS", ())


def estimate_s(system: str, wl: Workload, budget: float | None, done: list[dict], s: Settings) -> float:
    """Rough seconds a system needs (the time guard skips it when less is left)."""
    if s.device == "cpu":
        return 1.0
    same = [r.get("system_s") or 0.0 for r in done if r["system"] == system and r["status"] == "ok"]
    if same:
        return max(same)
    total = wl.facts.get("total_bytes", 0)
    if system == "resident":
        return 10.0
    if system in MIRA_SYSTEMS:
        mira = [r.get("system_s") or 0.0 for r in done if r["system"] in MIRA_SYSTEMS and r["status"] == "ok"]
        return max(mira) * (0.6 if system == "int4" else 1.0) if mira else total / GB + 15.0
    # accelerate: save + load at ~1 GB/s, then ~3 + 2 tokens-worth of forwards per phase, each moving
    # the offloaded weights from pageable memory at ~6 GB/s (measured earlier: 0.36 tok/s on Mixtral 8l)
    gpu = wl.facts.get("non_expert_bytes", 0) + int((budget or 0) * wl.facts.get("expert_bytes", 0))
    forwards = 3 * s.warmup_tokens + 2 + 2 * s.accelerate_tokens + s.accelerate_tokens
    save = 0.0 if wl.checkpoint or wl.shape is None else total / GB
    return save + total / GB + forwards * max(total - gpu, 0) / 6e9


def run_system(
    system: str, wl: Workload, budget: float | None, s: Settings, deadline: Deadline, args, done: list[dict], traces: dict
) -> dict:
    row = new_row(system, budget)
    t0 = time.perf_counter()
    model = manager = None
    try:
        if system.startswith("int4") and not int4_supported():
            row["status"] = "n/a"
            row["notes"].append(f"this mira-hf has no int4 (MiraConfig quantizations: {list(mira_hf.config.QUANTIZATIONS)})")
            return row
        if system == "accelerate" and wl.key not in args.accelerate_models:
            row["status"] = "skipped"
            row["notes"].append(f"not in --accelerate-models ({','.join(args.accelerate_models)})")
            return row
        est = estimate_s(system, wl, budget, done, s)
        if deadline.remaining() < est:
            row["status"] = "skipped"
            row["notes"].append(
                f"time budget: {deadline.remaining():.0f} s left of {deadline.budget_s:.0f} s, about {est:.0f} s needed"
            )
            return row
        log(f"{wl.key} / {system}" + ("" if budget is None else f" / budget {budget:.0%}") + f" (about {est:.0f} s)")
        if system == "accelerate":
            model = setup_accelerate(row, wl, budget, s, args)
            measure(model, row, wl, s, deadline, accelerate=True)
        else:
            t = time.perf_counter()
            model = wl.build(s.device)
            row["build_s"] = time.perf_counter() - t
            wl.facts = wl.facts or model_facts(model)
            _check_positions(wl, s, row)
            if system == "resident":
                model.to(s.device)
            else:
                t = time.perf_counter()
                MiraMoEModel.wrap(model, mira_config(system, budget, s.device))
                row["wrap_s"] = time.perf_counter() - t
                manager = model.mira
                row["mira_config"] = _config_summary(model._mira_config)
                row["cache"] = dict(
                    slots=sum(manager.budget.n_slots.values()),
                    record_bytes=manager.store.record_bytes(0),
                    budget_bytes=manager.budget.budget_bytes,
                    capacity_bytes=manager.budget.capacity_bytes,
                    store_bytes=manager.store.nbytes,
                    store_tiers=manager.store.tier_bytes(),
                    quantization=manager.quantization,  # MiraConfig's "auto" resolved
                    placement=manager.placement,
                )
            _free_device_cache()
            row["setup_s"] = time.perf_counter() - t0
            row["gpu_gb_after_setup"] = torch.cuda.memory_allocated() / GB if torch.cuda.is_available() else None
            trace = [] if manager is not None else None
            measure(model, row, wl, s, deadline, manager=manager, trace=trace)
            if trace:
                traces[(system, budget)] = dict(
                    steps=trace_steps(trace),
                    pool_of_layer=dict(manager.budget.pool_of_layer),
                    n_slots=dict(manager.budget.n_slots),
                    record_bytes={layer: manager.store.record_bytes(layer) for layer in manager.store.layers},
                )
                row["routing_steps_b1"] = len(traces[(system, budget)]["steps"])
    except Exception as exc:  # one system failing (an OOM, a missing feature) must not end the run
        row["status"] = "error"
        row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        log(f"{wl.key} / {system}: ERROR {row['error'][:300]}")
        print("".join(traceback.format_exception(exc)[-6:]), flush=True)
    finally:
        row["host_rss_gb"] = _host_rss_gb()  # with the system loaded (its expert store included)
        t = time.perf_counter()
        if model is not None or row["status"] == "error":
            _teardown(model)
            model = manager = None  # the manager reaches the model's blocks (router closures)
            _free_device_cache()
        row["teardown_s"] = time.perf_counter() - t
        row["system_s"] = time.perf_counter() - t0
        row["host_rss_after_gb"] = _host_rss_gb()  # after teardown: host memory the system did not give back
        row["pinned_host_gb"] = _pinned_host_gb()  # torch's pinned allocator only (expert slabs are locked in place)
    return row


def setup_accelerate(row: dict, wl: Workload, budget: float, s: Settings, args):
    """Save the model to local disk (once per workload), then load it as a user would with accelerate's
    offload and the same GPU memory mira gets (non-expert + budget bytes + 2 GB)."""
    t0 = time.perf_counter()
    _empty_host_cache()  # accelerate keeps the offloaded weights in host RAM: give back mira's cached pinned blocks
    if wl.shape is None:
        path = bundled_dir()  # already a local checkpoint
    elif wl.checkpoint is None:
        model = wl.build(s.device)
        wl.facts = wl.facts or model_facts(model)
        path = wl.save_checkpoint(model, args.tmp_dir)
        del model
        _free_device_cache()
        row["save_s"] = wl.checkpoint_save_s
    else:
        path = wl.checkpoint
    if not wl.facts:
        wl.facts = model_facts(wl.build("cpu"))
    _check_positions(wl, s, row)
    budget_bytes = int(budget * wl.facts["expert_bytes"])
    gpu_bytes = wl.facts["non_expert_bytes"] + budget_bytes
    offload_dir = wl.scratch(args.tmp_dir, "offload")
    if s.device.startswith("cuda"):
        max_memory = {torch.device(s.device).index or 0: gpu_bytes + ACCELERATE_GPU_MARGIN_BYTES, "cpu": "100GiB"}
    else:
        # On a CPU there is no device to offload from: cap the CPU at mira's GPU bytes and let the
        # rest go to disk, so the offload path (hooks, per-forward loads) is at least exercised.
        max_memory = {"cpu": gpu_bytes}
        row["notes"].append("CPU: accelerate offloads to disk here (no GPU); times are not comparable")
    row["accelerate_max_memory"] = {str(k): v for k, v in max_memory.items()}
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        path, device_map="auto", max_memory=max_memory, offload_folder=offload_dir, dtype=torch.bfloat16
    )
    model.eval()
    row["load_s"] = time.perf_counter() - t
    placement = defaultdict(int)
    for dev in (getattr(model, "hf_device_map", None) or {}).values():
        placement[str(dev)] += 1
    row["device_map_modules"] = dict(placement)
    on_device = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cuda")
    offloaded = wl.facts["total_bytes"] - on_device if s.device.startswith("cuda") else None
    row["offloaded_bytes"] = offloaded
    if offloaded is not None:
        # accelerate moves every offloaded weight to the GPU in every forward (an estimate, not counted)
        row["h2d_bytes_per_token"] = offloaded
        row["notes"].append("h2d bytes/token estimated: every offloaded weight moves each forward")
    _free_device_cache()
    row["setup_s"] = time.perf_counter() - t0
    row["gpu_gb_after_setup"] = torch.cuda.memory_allocated() / GB if torch.cuda.is_available() else None
    return model


def _check_positions(wl: Workload, s: Settings, row: dict) -> None:
    limit = wl.facts.get("max_positions")
    need = s.prompt_len + max(s.new_tokens, s.beam_tokens)
    if limit and need > limit:
        row["notes"].append(f"prompt + new tokens = {need} exceeds max_position_embeddings={limit}")


def _config_summary(cfg: MiraConfig) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if not dataclasses.is_dataclass(getattr(cfg, f.name))}


def _teardown(model) -> None:
    """Drop a model and whatever it holds on the device and in pinned host memory. A wrapped model
    is not unloaded (that would rebuild its experts on the host only to drop them)."""
    if model is None:
        return
    manager = model.__dict__.get("mira")
    if manager is not None:
        with contextlib.suppress(Exception):  # best effort: the run goes on either way
            manager.close()
        with contextlib.suppress(Exception):
            manager.store.close()


def _free_device_cache() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _empty_host_cache() -> None:
    """Give cached pinned blocks back to the OS (the pinned allocator keeps freed blocks for reuse,
    which lets the next mira store skip pinning; between workloads it only costs host RAM)."""
    if not torch.cuda.is_available():
        return
    for fn in (getattr(torch.accelerator, "empty_host_cache", None), getattr(torch._C, "_host_emptyCache", None)):
        if fn is not None:
            with contextlib.suppress(Exception):
                fn()
                return


def _host_rss_gb() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / GB
    except OSError:
        return None
    return None


def _pinned_host_gb() -> float | None:
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


# -- the limit ------------------------------------------------------------------------------------
def belady_bytes(
    steps: list[dict[int, list[int]]], pool_of_layer: dict, n_slots: dict, record_bytes: dict, count_from: int = 1
) -> int:
    """Bytes Belady's optimal cache must load over steps[count_from:], with `n_slots[pool]` slots per
    pool (pools are independent). Earlier steps (the prefill) only warm the cache."""
    blocks = [(i, layer, experts) for i, step in enumerate(steps) for layer, experts in sorted(step.items())]
    misses = belady_misses(blocks, pool_of_layer, n_slots, count_from)
    return sum(n * record_bytes[layer] for layer, n in misses.items())


def compute_limit(facts: dict, trace: dict | None, bw: dict) -> dict:
    """Seconds per decode token no system can beat, and its two parts."""
    record = trace["record_bytes"][min(trace["record_bytes"])] if trace else facts["raw_record_bytes"]
    touched = facts["non_expert_touched_bytes"] + facts["top_k"] * facts["moe_layers"] * record
    out = dict(
        touched_bytes_per_token=touched,
        record_bytes=record,
        device_gbps=bw["device_gbps"],
        h2d_gbps=bw["h2d_gbps"],
        compute_s=touched / (bw["device_gbps"] * GB),
        belady_bytes_per_token=None,
        transfer_s=None,
        slots=None,
        decode_steps=None,
    )
    if trace and len(trace["steps"]) > 1:
        steps = trace["steps"]
        if "belady_bytes" not in trace:  # once per trace: the JSON is rewritten after every system
            trace["belady_bytes"] = belady_bytes(steps, trace["pool_of_layer"], trace["n_slots"], trace["record_bytes"])
        per_token = trace["belady_bytes"] / (len(steps) - 1)
        out.update(
            belady_bytes_per_token=per_token,
            transfer_s=per_token / (bw["h2d_gbps"] * GB),
            slots=sum(trace["n_slots"].values()),
            decode_steps=len(steps) - 1,
        )
    out["limit_s"] = max(out["compute_s"], out["transfer_s"] or 0.0)
    out["bound"] = "transfer (Belady / H2D)" if (out["transfer_s"] or 0.0) > out["compute_s"] else "device memory (bytes touched)"
    return out


# -- comparisons ----------------------------------------------------------------------------------
def comparisons(result: dict) -> list[dict]:
    """Headline ratios on the Mixtral shape at 25% (measurements, no verdicts); a ratio is None when a number
    is missing. A smoke run has none: its tiny shapes on a CPU say nothing about performance."""
    if result["args"].get("smoke"):
        return []
    m = result["models"].get(COMPARE_MODEL, {})
    rows = {
        r["system"]: r for r in m.get("rows", []) if r["budget"] in (None, COMPARE_BUDGET) and r["status"] in ("ok", "partial")
    }

    def val(system, key):
        r = rows.get(system)
        return None if r is None else r.get(key)

    def ratio(a, b):
        return a / b if a is not None and b else None

    out = []

    def add(name, value, unit="×", detail=""):
        out.append(dict(name=name, value=value, unit=unit, detail=detail))

    add(
        "default vs accelerate: decode tok/s (batch 1)",
        ratio(val("default", "decode_tok_s_b1"), val("accelerate", "decode_tok_s_b1")),
    )
    add("default vs accelerate: TTFT", ratio(val("accelerate", "ttft_s"), val("default", "ttft_s")))
    add("default vs accelerate: beam-4 tok/s", ratio(val("default", "beam_tok_s"), val("accelerate", "beam_tok_s")))
    add("int4 vs accelerate: TTFT", ratio(val("accelerate", "ttft_s"), val("int4", "ttft_s")))
    for sname in ("int4", "int4-packed"):
        add(
            f"{sname} vs bf16 transfer: decode tok/s (batch 1)",
            ratio(val(sname, "decode_tok_s_b1"), val("bf16", "decode_tok_s_b1")),
        )
    add("default vs lru: decode tok/s (batch 1)", ratio(val("default", "decode_tok_s_b1"), val("lru", "decode_tok_s_b1")))
    add("default time/token over the limit", val("default", "x_limit"), unit="× limit")
    facts = m.get("facts") or {}
    bound = (facts["non_expert_bytes"] + int(COMPARE_BUDGET * facts["expert_bytes"])) / GB if facts else None
    peaks = {sname: val(sname, "peak_gpu_gb") for sname in MIRA_SYSTEMS if val(sname, "peak_gpu_gb") is not None}
    worst = max(peaks.values()) if peaks and bound else None
    detail = ", ".join(f"{k} {v:.2f} GB" for k, v in peaks.items())
    add("peak GPU memory of mira over non-expert weights + budget", ratio(worst, bound), detail=detail)
    return out


def format_comparison(c: dict) -> str:
    if c["value"] is None:
        return f"{c['name']}: not measured in this run"
    return f"{c['name']}: {c['value']:.3g}{c['unit']}" + (f" [{c['detail']}]" if c["detail"] else "")


# -- output ---------------------------------------------------------------------------------------
TABLE_COLUMNS = [
    "system",
    "budget",
    "status",
    "TTFT s",
    "b1 tok/s",
    "b8 tok/s",
    "beam tok/s",
    "peak GB",
    "MB h2d/tok",
    "H2D GB/s",
    "stall",
    "hit",
    "ms/tok",
    "x limit",
    "x own",
]


def _n(v, fmt="{:.3g}"):
    return "" if v is None else fmt.format(v)


def table_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in _sorted_rows(rows):
        out.append(
            {
                "system": r["system"],
                "budget": "" if r["budget"] is None else f"{r['budget']:.0%}",
                "status": r["status"],
                "TTFT s": _n(r["ttft_s"]),
                "b1 tok/s": _n(r["decode_tok_s_b1"]),
                "b8 tok/s": _n(r["decode_tok_s_b8"]),
                "beam tok/s": _n(r["beam_tok_s"]),
                "peak GB": _n(r["peak_gpu_gb"], "{:.2f}"),
                "MB h2d/tok": _n(None if r["h2d_bytes_per_token"] is None else r["h2d_bytes_per_token"] / 1e6),
                "H2D GB/s": _n(r["h2d_gbps_decode"]),
                "stall": _n(None if r["stall_share"] is None else 100 * r["stall_share"], "{:.0f}%"),
                "hit": _n(None if r["hit_rate"] is None else 100 * r["hit_rate"], "{:.0f}%"),
                "ms/tok": _n(None if r["time_per_token_s"] is None else 1e3 * r["time_per_token_s"]),
                "x limit": _n(r["x_limit"]),
                "x own": _n(r.get("x_own_limit")),  # absent in results older than the column
            }
        )
    return out


COST_COLUMNS = [
    "system",
    "budget",
    "build s",
    "wrap s",
    "save s",
    "load s",
    "setup s",
    "system s",
    "GPU GB set up",
    "peak GB b1/b8/beam",
    "host RSS GB loaded/after",
    "torch pinned GB",
]


def cost_rows(rows: list[dict]) -> list[dict]:
    """Where each system's time and memory went (set-up, totals), for planning the next run."""
    out = []
    for r in _sorted_rows(rows):
        if r["status"] in ("n/a", "skipped"):
            continue
        peaks = r.get("peak_gpu_gb_by_phase") or {}
        out.append(
            {
                "system": r["system"],
                "budget": "" if r["budget"] is None else f"{r['budget']:.0%}",
                "build s": _n(r.get("build_s"), "{:.1f}"),
                "wrap s": _n(r.get("wrap_s"), "{:.1f}"),
                "save s": _n(r.get("save_s"), "{:.1f}"),
                "load s": _n(r.get("load_s"), "{:.1f}"),
                "setup s": _n(r.get("setup_s"), "{:.1f}"),
                "system s": _n(r.get("system_s"), "{:.1f}"),
                "GPU GB set up": _n(r.get("gpu_gb_after_setup"), "{:.2f}"),
                "peak GB b1/b8/beam": "/".join(_n(peaks.get(k), "{:.1f}") for k in ("b1", "b8", "beam")) if peaks else "",
                "host RSS GB loaded/after": "/".join(_n(r.get(k), "{:.1f}") for k in ("host_rss_gb", "host_rss_after_gb")),
                "torch pinned GB": _n(r.get("pinned_host_gb"), "{:.1f}"),
            }
        )
    return out


def _sorted_rows(rows: list[dict]) -> list[dict]:
    order = {s: i for i, s in enumerate(SYSTEMS)}
    return sorted(rows, key=lambda r: (r["budget"] or 0, order.get(r["system"], len(order))))


def render_table(rows: list[dict], cost: bool = False) -> str:
    shown = cost_rows(rows) if cost else table_rows(rows)
    if not shown:
        return "(nothing measured)"
    with contextlib.redirect_stdout(io.StringIO()):
        return print_table(shown, COST_COLUMNS if cost else TABLE_COLUMNS)


def limit_lines(m: dict) -> list[str]:
    lines = []
    resident = next((r for r in m.get("rows", []) if r["system"] == "resident" and r["time_per_token_s"]), None)
    for budget, lim in sorted(m.get("limits", {}).items()):
        text = (
            f"limit at budget {float(budget):.0%}: {1e3 * lim['limit_s']:.3g} ms/token, bound by {lim['bound']} = "
            f"max({lim['touched_bytes_per_token'] / GB:.3g} GB touched / {lim['device_gbps']:.0f} GB/s = {1e3 * lim['compute_s']:.3g} ms"
        )
        if lim["transfer_s"] is not None:
            text += (
                f", Belady {lim['belady_bytes_per_token'] / 1e6:.0f} MB/token ({lim['slots']} slots, {lim['decode_steps']} steps)"
                f" / {lim['h2d_gbps']:.1f} GB/s = {1e3 * lim['transfer_s']:.3g} ms)"
            )
        else:
            text += "; no routing trace, so no transfer term)"
        if resident:
            text += f"; all resident (transformers): {1e3 * resident['time_per_token_s']:.3g} ms/token = {resident['time_per_token_s'] / lim['limit_s']:.3g}× limit"
        lines.append(text)
    return lines


def row_notes(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        budget = "" if r["budget"] is None else f" @ {r['budget']:.0%}"
        if r["error"]:
            out.append(f"{r['system']}{budget}: ERROR {r['error'][:400]}")
        for n in r["notes"]:
            out.append(f"{r['system']}{budget}: {n}")
    return out


def facts_line(m: dict) -> str:
    f = m.get("facts")
    if not f:
        return "(no model built)"
    return (
        f"{f['moe_layers']} MoE layers × {f['num_experts']} experts, top-{f['top_k']}; experts {f['expert_bytes'] / GB:.2f} GB "
        f"({f['raw_record_bytes'] / 1e6:.1f} MB each), non-expert {f['non_expert_bytes'] / GB:.2f} GB"
        + "".join(f"; budget {float(b):.0%} = {v / GB:.2f} GB" for b, v in sorted(m.get("budget_bytes", {}).items()))
    )


def render_markdown(result: dict) -> str:
    env, bw = result["env"], result.get("bandwidth", {})
    out = [
        f"# mira-hf benchmark: {env.get('device')} ({env.get('date')})",
        "",
        f"torch {env.get('torch')}, transformers {env.get('transformers')}, Python {env.get('python')}, {env.get('cpu_count')} CPUs. "
        f"Measured in this run: pinned H2D {bw.get('h2d_gbps', 0):.1f} GB/s, pageable H2D {bw.get('h2d_pageable_gbps') or 0:.1f} GB/s, "
        f"device memory {bw.get('device_gbps', 0):.0f} GB/s ({bw.get('measured_on', '')}).",
        "",
        f"Command: `{result.get('command', '')}`"
        + ("  **(smoke: tiny shapes on CPU, numbers mean nothing)**" if result["args"].get("smoke") else ""),
        "",
        "## How to read this",
        "",
        "Every system runs the same prompts on the same random-initialised weights (the bundled model: trained weights). "
        "`resident` keeps every expert on the GPU: the speed transformers reaches when memory is no object. `accelerate` is "
        'what a user gets from `device_map="auto"` with the same GPU memory (+2 GB): offloaded weights cross the link at '
        "every forward. `lru` is a reactive expert cache (load on router miss, evict least recently used: mixtral-offloading "
        "and MoE-Infinity style); `default` is mira-hf as it ships; `int4*` move 4-bit experts (lossy, opt-in). "
        "Look first at ms/tok and `x limit`: the limit is the time the link must spend on the bytes Belady's optimal "
        "cache of the same size would move for this very routing (or the time to read the touched weights from device "
        "memory, if larger), so 1.0 is the best any exact demand cache can do at this budget, and the "
        "resident row shows how far transformers itself is from it. Random weights route almost uniformly (no reuse to "
        "exploit), so on them the bytes per expert decide; the bundled model shows real routing.",
        "",
        "Columns: TTFT = time to first token, 512-token prompt, batch 1; b1/b8 tok/s = decode tokens/s at batch 1 / 8, "
        "excluding the first token; beam tok/s = new tokens / time with 4 beams; MB h2d/tok, H2D GB/s, stall (share of decode "
        "time waiting for experts) and hit (expert-cache hit rate) are batch-1 decode numbers from mira's counters; "
        "ms/tok = batch-1 time per decode token; x limit = ms/tok over the limit below (uncompressed records); "
        "x own = ms/tok over the same limit computed for the system's own record sizes and slot count (a compressed "
        "format, lossless included, lowers the bytes any cache must move).",
    ]
    for m in result["models"].values():
        out += ["", f"## {m['label']}", "", facts_line(m), ""]
        out += [f"- {line}" for line in ([] if result["args"].get("smoke") else limit_lines(m))]
        out += ["", render_table(m.get("rows", [])), "", "Set-up and memory:", "", render_table(m.get("rows", []), cost=True)]
        notes = row_notes(m.get("rows", [])) + m.get("notes", [])
        if notes:
            out += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    if result.get("comparisons"):
        out += ["", f"## Comparisons (Mixtral-8x7B shape, 8 layers, budget {COMPARE_BUDGET:.0%})", ""]
        out += [f"- {format_comparison(c)}" for c in result["comparisons"]]
    if result.get("skipped"):
        out += ["", "## Skipped", ""] + [f"- {n}" for n in result["skipped"]]
    return "\n".join(out) + "\n"


def render_plot(result: dict, path: str) -> str | None:
    """PNG: per workload, tokens/s per system (batch 1, batch 8, beam) and batch-1 time per token split
    into compute and stall, with the limit. Returns None, or why no plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); rerun with --from-json on this JSON to plot"
    models = [m for m in result["models"].values() if any(r["status"] in ("ok", "partial") for r in m.get("rows", []))]
    if not models:
        return "nothing measured"
    fig, axes = plt.subplots(len(models), 2, figsize=(15, 4.2 * len(models)), squeeze=False)
    order = {s: i for i, s in enumerate(SYSTEMS)}
    for m, (ax_tps, ax_ms) in zip(models, axes):
        rows = sorted(
            (r for r in m["rows"] if r["status"] in ("ok", "partial")),
            key=lambda r: (r["budget"] or 0, order.get(r["system"], len(order))),
        )
        names = [r["system"] + ("" if r["budget"] is None else f"\n{r['budget']:.0%}") for r in rows]
        x = list(range(len(rows)))
        width = 0.27
        for j, (metric, label) in enumerate(
            (("decode_tok_s_b1", "decode, batch 1"), ("decode_tok_s_b8", "decode, batch 8"), ("beam_tok_s", "beam 4"))
        ):
            vals = [r.get(metric) or 0 for r in rows]
            ax_tps.bar([i + (j - 1) * width for i in x], vals, width, label=label)
        ax_tps.set_yscale("log")
        ax_tps.set_xticks(x, names, fontsize=8)
        ax_tps.set_ylabel("tokens / s (log)")
        ax_tps.set_title(f"{m['label']}: throughput", fontsize=10)
        ax_tps.legend(fontsize=8)
        # time per token at batch 1: compute + stall (mira), whole bar for systems without a split
        ms = [1e3 * (r["time_per_token_s"] or 0) for r in rows]
        stall = [1e3 * min(r.get("stall_s_per_token") or 0, r["time_per_token_s"] or 0) for r in rows]
        compute = [t - st for t, st in zip(ms, stall)]
        split = [r["system"] != "accelerate" for r in rows]  # resident: all compute; accelerate: transfers inside
        ax_ms.bar(x, [c if s else 0 for c, s in zip(compute, split)], 0.6, label="compute", color="tab:blue")
        ax_ms.bar(
            x,
            [st if s else 0 for st, s in zip(stall, split)],
            0.6,
            bottom=compute,
            label="stall (waiting for experts)",
            color="tab:red",
        )
        ax_ms.bar(
            x,
            [t if not s else 0 for t, s in zip(ms, split)],
            0.6,
            label="accelerate (offload transfers not split out)",
            color="tab:gray",
        )
        cap = max([t for t, r in zip(ms, rows) if r["system"] != "accelerate"] or [max(ms or [1])]) * 1.6 or 1
        for i, t in enumerate(ms):
            if t > cap:
                ax_ms.text(i, cap * 0.97, f"{t:.0f} ms ↑", ha="center", va="top", fontsize=8)
        for i, r in enumerate(rows):
            lim = m.get("limits", {}).get(str(r["budget"] if r["budget"] is not None else COMPARE_BUDGET))
            if lim is None and m.get("limits"):
                lim = next(iter(m["limits"].values()))
            if lim:
                ax_ms.plot([i - 0.35, i + 0.35], [1e3 * lim["limit_s"]] * 2, "k--", lw=1, label="limit" if i == 0 else None)
        ax_ms.set_ylim(0, cap)
        ax_ms.set_xticks(x, names, fontsize=8)
        ax_ms.set_ylabel("ms per token, batch 1")
        ax_ms.set_title(f"{m['label']}: time per decode token", fontsize=10)
        ax_ms.legend(fontsize=8)
    fig.suptitle(f"mira-hf benchmark, {result['env'].get('device')}, {result['env'].get('date')}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_outputs(result: dict, stem: str, plot: bool = False) -> None:
    """JSON first (the record); the Markdown and the plot are derived from it, and a failure in either
    is noted in the JSON rather than ending the run (--from-json renders them again)."""
    write_json(stem + ".json", result)
    renders = [("md", lambda: _write_text(stem + ".md", render_markdown(result)))]
    if plot:
        renders.append(
            ("plot", lambda: result.__setitem__("plot", render_plot(result, stem + ".png") or os.path.basename(stem + ".png")))
        )
    for name, render in renders:
        try:
            render()
            result.get("output_errors", {}).pop(name, None)
        except Exception as exc:
            result.setdefault("output_errors", {})[name] = f"{type(exc).__name__}: {exc}"
            log(f"could not write the {name}: {exc}")
    write_json(stem + ".json", result)


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def print_summary(result: dict, stem: str) -> None:
    print("\n" + "=" * 100, flush=True)
    bw = result.get("bandwidth", {})
    print(
        f"{result['env'].get('device')}  pinned H2D {bw.get('h2d_gbps', 0):.1f} GB/s, device memory {bw.get('device_gbps', 0):.0f} GB/s, "
        f"run {result.get('elapsed_s', 0):.0f} s",
        flush=True,
    )
    for m in result["models"].values():
        print(f"\n## {m['label']}\n{facts_line(m)}", flush=True)
        for line in [] if result["args"].get("smoke") else limit_lines(m):
            print("  " + line, flush=True)
        if m.get("rows"):
            print(render_table(m["rows"]), flush=True)
            print(render_table(m["rows"], cost=True), flush=True)
        for n in row_notes(m.get("rows", [])) + m.get("notes", []):
            print("  - " + n, flush=True)
    if result.get("skipped"):
        print("\nskipped: " + "; ".join(result["skipped"]), flush=True)
    if result.get("comparisons"):
        print(f"\ncomparisons (Mixtral 8 layers, budget {COMPARE_BUDGET:.0%}):", flush=True)
        for c in result["comparisons"]:
            print("  " + format_comparison(c), flush=True)
    print(
        f"\nwrote {stem}.json, {stem}.md"
        + (f", {stem}.png" if result.get("plot", "").endswith(".png") else f" (no plot: {result.get('plot')})"),
        flush=True,
    )


# -- main -----------------------------------------------------------------------------------------
# --smoke caps these options (tiny shapes on a CPU: enough tokens to exercise every code path)
SMOKE_LIMITS = dict(prompt_len=16, new_tokens=4, beam_tokens=3, accelerate_tokens=3, time_budget_s=300.0)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mixtral,bundled,qwen3", help="workloads, in run order: mixtral, qwen3, bundled")
    ap.add_argument("--budgets", default="0.25", help="expert budgets as fractions of all expert bytes, e.g. 0.10,0.25,0.50")
    ap.add_argument(
        "--systems", default="resident,lru,default,int4,accelerate", help="systems, in run order: " + ",".join(SYSTEMS)
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:FIELD=VALUE,...",
        help="an extra mira system (run after --systems), e.g. heat-only:predictor=none or x:cache.stage_fraction=0.5",
    )
    ap.add_argument("--accelerate-models", default="mixtral", help="workloads that also run the (slow) accelerate system")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64, help="decode tokens at batch 1 and at --batch")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--beam-tokens", type=int, default=32)
    ap.add_argument(
        "--accelerate-tokens", type=int, default=4, help="decode and beam tokens for accelerate (about 3 s per token)"
    )
    ap.add_argument("--warmup-tokens", type=int, default=2)
    ap.add_argument(
        "--time-budget-s", type=float, default=500.0, help="skip systems that would not finish within this (from start)"
    )
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    ap.add_argument(
        "--tmp-dir", default=os.environ.get("TMPDIR") or "/tmp", help="where accelerate's saved checkpoint goes (removed after)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cudnn-sdpa",
        choices=("on", "off"),
        default="off",
        help="PyTorch's cuDNN attention backend. off (default): it is suspected of building a graph per new sequence "
        "length, which made the first system measured on a workload slower than the rest (NOTES.md, 'Measuring'); "
        "benchmarks/first_call_probe.py checks that",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, a few tokens: checks the script in seconds")
    ap.add_argument("--from-json", metavar="FILE", help="only re-render FILE's .md and .png from a result JSON")
    args = ap.parse_args(argv)
    args.models = _split(args.models, WORKLOADS, "--models")
    args.systems = _split(args.systems, SYSTEMS, "--systems") + [add_variant(v) for v in args.variant]
    args.accelerate_models = _split(args.accelerate_models, WORKLOADS, "--accelerate-models")
    args.budgets = [float(b.rstrip("%")) / (100 if b.endswith("%") else 1) for b in args.budgets.split(",") if b.strip()]
    if not args.budgets or any(not 0 < b <= 1 for b in args.budgets):
        ap.error(f"--budgets: fractions in (0, 1], got {args.budgets}")
    if args.smoke:
        for name, value in SMOKE_LIMITS.items():
            setattr(args, name, min(getattr(args, name), value))
    return args


def _split(text: str, allowed, flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad:
        raise SystemExit(f"{flag}: unknown {bad}; choose from {', '.join(allowed)}")
    return items


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
    _free_device_cache()
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
        stem = os.path.splitext(args.from_json)[0]
        write_outputs(result, stem, plot=True)
        print_summary(result, stem)
        return 0
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA GPU visible: run on a GPU machine, or pass --smoke for the CPU check.", flush=True)
        return 2
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning)  # generate's flag warnings; errors still raise
    device = "cpu" if args.smoke else "cuda"
    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(args.cudnn_sdpa == "on")  # the same for every system of the run
    if args.smoke:
        torch.set_num_threads(1)  # tiny matmuls: extra threads only add overhead (and noise on a busy machine)
    s = Settings(
        device,
        args.prompt_len,
        args.new_tokens,
        args.batch,
        args.beams,
        args.beam_tokens,
        args.accelerate_tokens,
        args.warmup_tokens,
        args.seed,
    )
    deadline = Deadline(args.time_budget_s)
    env = environment()
    slug = device_slug(env) + ("-smoke" if args.smoke else "")
    stem = os.path.join(args.out, f"{env['date']}-{slug}")
    os.makedirs(args.out, exist_ok=True)
    result = dict(
        env=env,
        args={k: v for k, v in vars(args).items()},
        command=" ".join([os.path.relpath(sys.argv[0], REPO) if sys.argv[0] else "run.py", *sys.argv[1:]]),
        int4_supported=int4_supported(),
        models={},
        skipped=[],
    )
    log(f"{env.get('device')}: torch {env['torch']}, transformers {env['transformers']}; writing {stem}.*")
    try:
        result["bandwidth"] = measure_bandwidth(args.smoke)
        bw = result["bandwidth"]
        log(f"bandwidth: pinned H2D {bw['h2d_gbps']:.1f} GB/s, device memory {bw['device_gbps']:.0f} GB/s")
        for key in args.models:
            label, shape, smoke_shape = WORKLOADS[key]
            if args.smoke:  # say what ran: a tiny stand-in, not the real shape
                label = f"{smoke_shape or 'mira-tiny'} (smoke: tiny stand-in on the CPU)"
            wl = Workload(key, label, smoke_shape if args.smoke else shape, args.seed)
            m = result["models"][key] = dict(label=label, shape=wl.shape, rows=[], limits={}, budget_bytes={}, notes=[])
            traces: dict = {}
            try:
                plan = [(sname, None) for sname in args.systems if sname == "resident"]
                plan += [(sname, b) for b in args.budgets for sname in args.systems if sname != "resident"]
                for sname, budget in plan:
                    row = run_system(sname, wl, budget, s, deadline, args, m["rows"], traces)
                    m["rows"].append(row)
                    m["facts"] = wl.facts
                    for b in args.budgets:
                        if wl.facts:
                            m["budget_bytes"][str(b)] = int(b * wl.facts["expert_bytes"])
                    if row["status"] == "skipped" and "time budget" in " ".join(row["notes"]):
                        result["skipped"].append(f"{key}/{sname}" + ("" if budget is None else f"@{budget:.0%}"))
                    try:
                        _finish_model(m, wl, traces, bw, args)
                    except Exception as exc:  # a bug in the bookkeeping must not cost the measurements
                        m["notes"].append(f"limit not computed: {type(exc).__name__}: {exc}")
                    result["elapsed_s"] = deadline.elapsed()
                    write_outputs(result, stem)
                    log(f"{key} / {sname}: {row['status']} in {row['system_s']:.1f} s. {_one_line(row)}")
            finally:
                wl.cleanup()
                _empty_host_cache()
    finally:
        try:
            result["comparisons"] = comparisons(result)
        except Exception as exc:
            result["comparisons"] = []
            result.setdefault("output_errors", {})["comparisons"] = f"{type(exc).__name__}: {exc}"
        result["elapsed_s"] = deadline.elapsed()
        write_outputs(result, stem, plot=True)
        print_summary(result, stem)
    return 0


def _one_line(row: dict) -> str:
    parts = [
        ("TTFT", row["ttft_s"], "{:.3g} s"),
        ("b1", row["decode_tok_s_b1"], "{:.3g} tok/s"),
        ("b8", row["decode_tok_s_b8"], "{:.3g} tok/s"),
        ("beam", row["beam_tok_s"], "{:.3g} tok/s"),
        ("peak", row["peak_gpu_gb"], "{:.2f} GB"),
        ("hit", row["hit_rate"], "{:.0%}"),
        ("stall", row["stall_share"], "{:.0%}"),
    ]
    return ", ".join(f"{name} {fmt.format(v)}" for name, v, fmt in parts if v is not None)


def _finish_model(m: dict, wl: Workload, traces: dict, bw: dict, args) -> None:
    """Limits per budget (from the LRU trace, else another exact mira system's), and each row's
    time per token as a multiple of its budget's limit (resident and accelerate: the first budget's)."""
    if not wl.facts:
        return
    for b in args.budgets:
        trace = next((traces[(sname, b)] for sname in ("lru", "default", "int4") if (sname, b) in traces), None)
        lim = compute_limit(wl.facts, trace, bw)
        if trace is not None:
            lim["trace_from"] = next(sname for sname in ("lru", "default", "int4") if (sname, b) in traces)
            lim["routing_trace_decode"] = [
                [step.get(layer, []) for layer in sorted(trace["record_bytes"])] for step in trace["steps"][1:]
            ]
        m["limits"][str(b)] = lim
    for r in m["rows"]:
        lim = m["limits"].get(str(r["budget"] if r["budget"] is not None else args.budgets[0]))
        if lim and r["time_per_token_s"]:
            r["x_limit"] = r["time_per_token_s"] / lim["limit_s"]
        own = traces.get((r["system"], r["budget"]))
        if own is not None and r["time_per_token_s"]:
            # the same floor for this system's own format and slot count: Belady over its own routing
            # trace with its own record sizes (a compressed format lowers the bytes any cache must move)
            own_lim = compute_limit(wl.facts, own, bw)
            r["own_limit_s"] = own_lim["limit_s"]
            r["own_belady_bytes_per_token"] = own_lim["belady_bytes_per_token"]
            r["x_own_limit"] = r["time_per_token_s"] / own_lim["limit_s"]
    for b in args.budgets:
        if ("lru", b) in traces and ("default", b) in traces:  # both bit-exact: the same tokens, the same routing
            m.setdefault("routing_identical_lru_default", {})[str(b)] = (
                traces[("lru", b)]["steps"] == traces[("default", b)]["steps"]
            )


if __name__ == "__main__":
    sys.exit(main())
