"""The server's device-memory plan (`ServeConfig.device_memory`): measure the loaded model, split the total
between the expert cache and the KV cache with `mira_hf.planner`, and resize the expert cache to its part.

The KV part becomes `ContinuousBatchingConfig(num_blocks=...)`: transformers' scheduler then admits a request
only when blocks are free for it, so requests beyond the planned concurrency wait in its queue (and a running
one that outgrows the cache is moved off the device and resumed later) instead of running out of memory.
"""

from __future__ import annotations

import os

import torch

from ..budget import plan_budget, plan_records
from ..config import parse_bytes
from ..errors import BudgetError, ConfigError
from ..host_time import MIN_BLOCKS
from ..planner import HitRateCurve, MemoryPlan, ModelFootprint, RequestMix, StepCost, plan_memory
from . import memory

# Tokens per forward step when the plan sets them (ServeConfig.max_batch_tokens unset): transformers' default of
# 8192 reserves activations and attention masks for 8192 tokens, several GiB on a large vocabulary; 2048 still
# takes a 512-token prompt in one step beside a batch of decode tokens.
PLANNED_BATCH_TOKENS = 2048


def footprint(model, max_batch_tokens: int) -> ModelFootprint:
    """What the loaded (wrapped) model takes and needs on its device, in `ModelFootprint`'s terms."""
    manager = model.mira
    weights = memory.device_weight_bytes(model)
    layers = list(manager.layers.values())
    pool_of = manager.budget.pool_of_layer  # layer -> slot bytes of its pool
    expert_bytes = sum(pool_of[li.ordinal] * li.num_experts for li in layers)
    buffers = sum(manager.budget.buffer_bytes.values())
    minimum = _minimum_expert_bytes(layers, pool_of, manager.budget.buffer_bytes, expert_bytes)
    text = model.config.get_text_config()
    return ModelFootprint(
        weights_bytes=weights,
        expert_bytes=expert_bytes + buffers,
        record_bytes=sum(manager.store.record_bytes(li.ordinal) for li in layers) / len(layers),
        min_expert_bytes=minimum,
        kv_bytes_per_token=memory.kv_bytes_per_token(model),
        page_tokens=memory.DEFAULT_PAGE_TOKENS,
        kv_overhead_per_token=cache_token_overhead(text, model.dtype.itemsize, max_batch_tokens),
        activation_bytes=step_activation_bytes(text, model.dtype.itemsize, max_batch_tokens, max(li.top_k for li in layers)),
        all_fit_bytes=_all_fit_bytes(manager, minimum, expert_bytes + buffers) if manager.placement == "mixed" else 0,
    )


def _all_fit_bytes(manager, lo: int, hi: int) -> int:
    """The smallest expert cache in [lo, hi] whose "mixed" plan puts every expert on the device (slots plus the
    experts kept packed), found by bisection: keeping more packed only ever needs fewer bytes."""
    experts = sum(li.num_experts for li in manager.layers.values())

    def all_fit(budget_bytes: int) -> bool:
        plan = slot_plan(manager, budget_bytes, "mixed")
        return sum(plan.n_slots.values()) + sum(map(len, plan.kept.values())) == experts

    return _smallest(lo, hi, all_fit)


def _minimum_expert_bytes(layers, pool_of, buffers, expert_bytes: int) -> int:
    """The smallest budget `plan_budget` accepts: the codec buffers and the top-k experts of a layer in every pool,
    found by bisection over what plan_budget itself accepts, so that the two never disagree."""
    return _smallest(1, expert_bytes + sum(buffers.values()), lambda mid: plan_budget(layers, pool_of, mid, buffers) is not None)


def _smallest(lo: int, hi: int, holds) -> int:
    """The smallest budget in [lo, hi] for which `holds(budget)` (false below it, true from it on; a `BudgetError` is
    false), by bisection; `hi` if none below it holds."""
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            ok = holds(mid)
        except BudgetError:
            ok = False
        lo, hi = (lo, mid) if ok else (mid + 1, hi)
    return lo


def _flash_attention(text) -> bool:
    return "flash" in str(getattr(text, "_attn_implementation", "") or "")


def _attention_masks(text) -> int:
    """Attention masks transformers' paged attention keeps, each [max_batch_tokens, cache tokens + max_batch_tokens]
    in the model's dtype: one, two with sliding-window layers, none under flash attention (5.17 to 5.24)."""
    if _flash_attention(text):
        return 0
    return 2 if getattr(text, "sliding_window", None) else 1


def cache_token_overhead(text, itemsize: int, max_batch_tokens: int) -> int:
    """Bytes beside K and V that transformers' paged attention takes per cached token (its memory handler, 5.17 to
    5.24): the K and V read back at the attention peak (heads repeated for eager/sdpa) and its read index, plus one
    column of each attention mask (`_attention_masks`)."""
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    at_peak = 2 * kv_heads if _flash_attention(text) else 2 * heads + kv_heads
    return at_peak * head_dim * itemsize + 8 + _attention_masks(text) * max_batch_tokens * itemsize


def step_activation_bytes(text, itemsize: int, max_batch_tokens: int, top_k: int) -> int:
    """Activations of one forward step of `max_batch_tokens` tokens: transformers' per-token peak (fp32 logits or
    the attention's projections, the larger) and input buffers, plus the routed experts' rows (K per token: the
    gathered inputs, the up projection, the activation and the outputs, and fp32 sums), plus the attention masks'
    columns for the step's own tokens ([max_batch_tokens, max_batch_tokens] each)."""
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    hidden = text.hidden_size
    lm_head = hidden * itemsize + text.vocab_size * 4
    attention = itemsize * (hidden + heads * head_dim + 2 * kv_heads * head_dim + (2 * heads + kv_heads) * head_dim)
    inter = getattr(text, "moe_intermediate_size", None) or getattr(text, "intermediate_size", hidden * 4)
    experts = top_k * (3 * hidden + 3 * inter) * itemsize + hidden * 4
    masks = _attention_masks(text) * max_batch_tokens * itemsize
    return max_batch_tokens * (max(lm_head, attention) + experts + 64 + masks)


def batch_tokens(model, config) -> int:
    """Tokens per forward step under a plan: as set, else `PLANNED_BATCH_TOKENS` (on a CPU, the server's CPU default)."""
    if config.max_batch_tokens is not None:
        return config.max_batch_tokens
    return memory.CPU_DEFAULT_BATCH_TOKENS if model.device.type == "cpu" else PLANNED_BATCH_TOKENS


def hit_rate_curve(model, routing_trace: str | None) -> HitRateCurve:
    """From a routing trace of this model, replayed: a `mira_hf.trace.RoutingTrace` file, or the directory `mira
    calibrate` wrote (its routers' top-k per token); else the estimate for evenly spread routing."""
    layers = list(model.mira.layers.values())
    if routing_trace is None:
        return HitRateCurve.uniform([li.num_experts for li in layers], max(li.top_k for li in layers))
    if os.path.isdir(routing_trace):
        return HitRateCurve.from_trace(calibration_trace(model, routing_trace))
    from ..trace import RoutingTrace

    return HitRateCurve.from_trace(RoutingTrace.load(routing_trace, model.mira.fingerprint))


CALIBRATION_TOPK = "router_topk.safetensors"  # what `mira calibrate --out DIR` writes: topk.<layer> [N, K], chunk_lengths


def missing_trace_files(routing_trace: str) -> list[str]:
    """The files `hit_rate_curve` would read from `routing_trace` that do not exist: a directory's `CALIBRATION_TOPK`,
    or a trace file's .safetensors and .json (`mira_hf.trace.trace_files`). Checked before a model loads."""
    from ..trace import trace_files

    if os.path.isdir(routing_trace):
        files = [os.path.join(routing_trace, CALIBRATION_TOPK)]
    else:
        files = list(trace_files(routing_trace))
    return [path for path in files if not os.path.isfile(path)]


def calibration_trace(model, directory: str):
    """The routing `mira calibrate` recorded in `directory` (teacher-forced: each chunk one sequence, token by
    token) as a `RoutingTrace` of this model, refused if its layers or experts are not this model's."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ..trace import RoutingTrace

    path = os.path.join(directory, CALIBRATION_TOPK)
    if not os.path.isfile(path):
        raise ConfigError(
            f"routing_trace={directory!r} is a directory without {CALIBRATION_TOPK}: give a directory written by mira calibrate, or a RoutingTrace file."
        )
    try:
        tensors = load_file(path)
    except (OSError, SafetensorError) as exc:
        raise ConfigError(f"{path} is not a readable .safetensors file ({exc}): calibrate this model again.") from exc
    layers = sorted(model.mira.layers.values(), key=lambda li: li.ordinal)
    picks = [tensors.get(f"topk.{li.ordinal}") for li in layers]
    if any(p is None or p.dim() != 2 or p.numel() == 0 for p in picks) or f"topk.{len(layers)}" in tensors:
        found = sorted(k for k in tensors if k.startswith("topk."))
        raise ConfigError(f"{path} holds {found}, not the {len(layers)} MoE layers of this model: calibrate this model again.")
    top = [max(int(p.max()) + 1, 1) for p in picks]
    low = min(int(p.min()) for p in picks)
    if any(t > li.num_experts for t, li in zip(top, layers)) or low < 0 or len({p.shape for p in picks}) != 1:
        raise ConfigError(f"{path} routes to experts this model does not have: calibrate this model again.")
    lengths = tensors.get("chunk_lengths")
    if lengths is None or int(lengths.sum()) != picks[0].shape[0]:
        raise ConfigError(
            f"{path} has no chunk_lengths that add up to its {picks[0].shape[0]} tokens: the file was cut short or "
            "edited. Calibrate this model again (mira calibrate MODEL --data ... --out DIR)."
        )
    starts = [0, *lengths.cumsum(0).tolist()[:-1]]
    record = [model.mira.store.record_bytes(li.ordinal) for li in layers]
    experts = torch.stack([p.long() for p in picks], dim=1)  # [N, L, K]
    return RoutingTrace(experts, None, starts, [li.num_experts for li in layers], record)


def plan(model, config, cost: StepCost | None = None, curve: HitRateCurve | None = None) -> MemoryPlan:
    """The split of `config.device_memory` for `model` under `config`'s request mix and fixed parts (`curve`:
    hit rates measured elsewhere, instead of `config.routing_trace` or the even-routing estimate; `cost`: the step
    cost, whose host terms are measured on `model` unless it sets them, `step_cost`)."""
    cost = step_cost(model, cost)
    total = parse_bytes(config.device_memory, "device_memory")
    max_tokens = batch_tokens(model, config)
    fp = footprint(model, max_tokens)
    mix = RequestMix(prompt_tokens=config.prompt_tokens, new_tokens=config.default_max_tokens, concurrency=config.concurrency)
    experts = _expert_cache_bytes(config.expert_cache_memory, fp)
    kv = None if config.kv_cache_memory is None else parse_bytes(config.kv_cache_memory, "kv_cache_memory")
    curve = curve or hit_rate_curve(model, config.routing_trace)
    return plan_memory(total, fp, mix, curve, cost, experts, kv)


# Sequences per probe step (`probe_host_time`): blocks of different widths tell the per-use cost from the per-block one.
PROBE_BATCHES = (1, 4, 16)
PROBE_TOKENS = 2  # tokens per sequence in each probe step
MAX_PROBE_STEPS = 24  # a model of one MoE layer needs 16 steps for `MIN_BLOCKS`


def step_cost(model, cost: StepCost | None = None) -> StepCost:
    """`cost` (default `StepCost()`) with the host's work per expert use and per miss measured on `model`
    (`mira_hf.host_time`): fitted over the blocks it has run since its counters were last reset, else over a probe
    run now (`probe_host_time`). A cost that sets `use_s` or `miss_s` is kept as given."""
    cost = cost or StepCost()
    if cost.use_s or cost.miss_s:
        return cost
    return cost.with_host_time(model.mira.telemetry.blocks.fit() or probe_host_time(model))


def probe_host_time(model):
    """Fit the host time per expert use and per miss (`mira_hf.host_time.HostUseCost`, None if the blocks run do
    not suffice) over a few forward steps of random tokens (`PROBE_BATCHES` sequences of `PROBE_TOKENS` tokens), as
    the host-compute planner measures its host at load (more rounds on a model of few MoE layers). The probe leaves no trace in what the runtime decides
    with: counters, heat scores and use rates, and the predictor's sequence state are reset after it (the experts
    it copied stay cached)."""
    manager = model.mira
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    manager.reset_stats()
    with torch.inference_mode():
        for i in range(MAX_PROBE_STEPS):  # every batch once, and more rounds while too few blocks were timed
            if i >= len(PROBE_BATCHES) and manager.telemetry.blocks.blocks >= MIN_BLOCKS:
                break
            ids = torch.randint(0, vocab, (PROBE_BATCHES[i % len(PROBE_BATCHES)], PROBE_TOKENS), generator=g)
            model(input_ids=ids.to(model.device), use_cache=False)
    measured = manager.telemetry.blocks.fit()
    manager.reset_stats()
    manager.heat.reset()
    manager.staging.new_sequence()
    return measured


def _expert_cache_bytes(value, fp: ModelFootprint) -> int | None:
    if value is None:
        return None
    if isinstance(value, float) and not isinstance(value, bool):
        if not 0 < value <= 1:
            raise ConfigError(f"expert_cache_memory={value}: a float is a share of all expert bytes, in (0, 1].")
        return int(value * fp.expert_bytes)
    return parse_bytes(value, "expert_cache_memory")


def slot_plan(manager, budget_bytes: int, placement: str):
    """The `BudgetPlan` of `budget_bytes` for `manager`'s records held by `placement` (BudgetPlan.placement), as
    planned at load; raises `BudgetError` below the minimum working set."""
    store = manager.store
    layers = list(manager.layers.values())
    layouts = {li.ordinal: store.layout(li.ordinal) for li in layers} if store.quantized else {}
    raw_bytes = {li.ordinal: store.raw_layout(li.ordinal).nbytes for li in layers}
    return plan_records(layers, budget_bytes, placement, store.codec, layouts, raw_bytes)


def resize_expert_cache(model, budget_bytes: int) -> None:
    """Give the model's expert cache `budget_bytes` (slots re-planned as at load, the cache emptied). Nothing
    changes if the plan is refused (below the minimum working set)."""
    manager = model.mira
    budget = slot_plan(manager, budget_bytes, manager.placement)
    if (budget.n_slots, budget.kept) != (manager.budget.n_slots, manager.budget.kept):
        manager.relocate(manager.store, budget, manager.device)


def apply(model, planned: MemoryPlan) -> int:
    """Resize the expert cache to the plan; returns the KV bytes to give transformers' batching."""
    resize_expert_cache(model, planned.expert_cache_bytes)
    return planned.kv_cache_bytes
