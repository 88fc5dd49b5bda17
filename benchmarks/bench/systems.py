"""What the benchmark compares: all experts resident, accelerate offload, and mira-hf configurations (plus
`--variant`s); `run_system` sets one up, measures it and tears it down, and never lets one failure end the run."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict

import torch
from transformers import AutoModelForCausalLM

import mira_hf.config
from mira_hf import MiraConfig, MiraMoEModel

from . import GB
from .clock import Deadline, log, log_failure
from .measure import Settings, empty_host_cache, free_device_cache, host_rss_gb, measure, pinned_host_gb, routing_trace
from .workloads import Workload, bundled_dir, model_facts

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
ACCELERATE_GPU_MARGIN_BYTES = 2 * 10**9  # "+ 2 GB" on top of mira's non-expert + budget bytes


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
            free_device_cache()
            row["setup_s"] = time.perf_counter() - t0
            row["gpu_gb_after_setup"] = torch.cuda.memory_allocated() / GB if torch.cuda.is_available() else None
            trace = [] if manager is not None else None
            measure(model, row, wl, s, deadline, manager=manager, trace=trace)
            if trace:
                traces[(system, budget)] = routing_trace(trace, manager)
                row["routing_steps_b1"] = len(traces[(system, budget)]["steps"])
    except Exception as exc:  # one system failing (an OOM, a missing feature) must not end the run
        log_failure(row, exc, f"{wl.key} / {system}")
    finally:
        row["host_rss_gb"] = host_rss_gb()  # with the system loaded (its expert store included)
        t = time.perf_counter()
        if model is not None or row["status"] == "error":
            _teardown(model)
            model = manager = None  # the manager reaches the model's blocks (router closures)
            free_device_cache()
        row["teardown_s"] = time.perf_counter() - t
        row["system_s"] = time.perf_counter() - t0
        row["host_rss_after_gb"] = host_rss_gb()  # after teardown: host memory the system did not give back
        row["pinned_host_gb"] = pinned_host_gb()  # torch's pinned allocator only (expert slabs are locked in place)
    return row


def setup_accelerate(row: dict, wl: Workload, budget: float, s: Settings, args):
    """Save the model to local disk (once per workload), then load it as a user would with accelerate's
    offload and the same GPU memory mira gets (non-expert + budget bytes + 2 GB)."""
    t0 = time.perf_counter()
    empty_host_cache()  # accelerate keeps the offloaded weights in host RAM: give back mira's cached pinned blocks
    if wl.shape is None:
        path = bundled_dir()  # already a local checkpoint
    elif wl.checkpoint is None:
        model = wl.build(s.device)
        wl.facts = wl.facts or model_facts(model)
        path = wl.save_checkpoint(model, args.tmp_dir)
        del model
        free_device_cache()
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
    free_device_cache()
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
