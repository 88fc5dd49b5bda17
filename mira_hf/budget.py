"""Budget planning: how `MiraConfig.gpu_budget` becomes device buffers and slots, resolved once.

`resolve_budget_bytes` turns the configured budget (bytes, a fraction of the experts' bytes, or None:
what the device has free) into bytes; `plan_records` splits them into the codec's device buffers and
one slot pool per record size (`BudgetPlan`). The model plans once at wrap (and again after a cast or
move, `relocate`); the manager and its arena only read the plan.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from .config import MiraConfig
from .errors import BudgetError, ConfigError

TIER_COST = {"pinned": 1.0, "pageable": 2.0, "disk": 4.0}  # relative reload cost per byte of each host tier


@dataclass(frozen=True)
class LayerInfo:
    """What the manager knows of one MoE layer."""

    ordinal: int  # 0..L-1 over MoE layers, in model order: the key used everywhere
    name: str  # module path of the routed experts, e.g. "model.layers.3.mlp.experts"
    num_experts: int
    top_k: int


@dataclass(frozen=True)
class BudgetPlan:
    """How a byte budget becomes slots. Computed (and validated) before anything changes."""

    budget_bytes: int
    pool_of_layer: dict[int, Hashable]
    slot_bytes: dict[Hashable, int]
    n_slots: dict[Hashable, int]
    buffer_bytes: dict[str, int] = field(default_factory=dict)  # codec buffers taken from the budget first
    # How a slot holds an expert: "raw" (checkpoint bytes), "dequant" (packed records dequantised into a
    # slot of the checkpoint dtype), "packed" (packed records, computed from as they are) or "mixed" (slots as
    # "dequant", and the experts of `kept` held packed outside the cache).
    placement: str = "raw"
    # "mixed": layer -> the experts kept on the device as packed records (never evicted, decoded at each use), and
    # layer -> the bytes of one such record. Empty otherwise, and where every expert has a decoded slot.
    kept: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    kept_bytes: Mapping[int, int] = field(default_factory=dict)

    @property
    def slot_placement(self) -> str:
        """How a slot of the pools holds its expert: `placement`, with "mixed" slots holding decoded records."""
        return "dequant" if self.placement == "mixed" else self.placement

    @property
    def capacity_bytes(self) -> int:
        """Bytes of all slots."""
        return sum(self.n_slots[g] * self.slot_bytes[g] for g in self.n_slots)

    @property
    def device_bytes(self) -> int:
        """Everything the manager allocates on the device: slots, kept records and codec buffers (≤ budget_bytes)."""
        kept = sum(len(es) * self.kept_bytes[layer] for layer, es in self.kept.items())
        return self.capacity_bytes + kept + sum(self.buffer_bytes.values())

    def reload_costs(self, store, layers: Iterable[int]) -> dict[int, float]:
        """Relative cost of reloading an expert of each of `layers` from `store` (an `ExpertStore`), in
        (0, 1]: its record's bytes against the largest slot's, times how slow its host tier is."""
        largest = max(self.slot_bytes.values())
        return {layer: min(1.0, store.record_bytes(layer) / largest * TIER_COST[store.tier(layer)] / 4.0) for layer in layers}


def expert_keys(
    layers: Mapping[int, LayerInfo], experts: Mapping[int, Sequence[int]], caller: str, takes: str = "{layer: [expert indices]}"
) -> set[tuple[int, int]]:
    """The `(layer, expert)` keys of `{layer: [expert, ...]}`, each checked against `layers` (ordinal ->
    `LayerInfo`); a ConfigError naming `caller`, the model's layers and what `caller` takes (`takes`) otherwise."""
    keys = set()
    have = {L: info.num_experts for L, info in layers.items()}
    for given, values in experts.items():
        layer, es = _index(given), _indices(values)  # numpy and torch integers too (a heat table's rows give those)
        li = layers.get(layer)
        bad = es is None or any(e is None or li is None or not 0 <= e < li.num_experts for e in es)
        if li is None or bad:
            raise ConfigError(
                f"{caller}: layer {given!r} experts {values!r} do not exist in this model "
                f"(MoE layer ordinal -> experts: {have}). Give {takes}."
            )
        keys.update((layer, e) for e in es)
    return keys


def _index(value):
    """`value` as an int where it is an integer of any kind (int, numpy, a torch scalar), else as it is."""
    try:
        return operator.index(value) if not isinstance(value, bool) else value
    except TypeError:
        return value


def _indices(values) -> list | None:
    """The integers of an iterable (a list, a tensor, an array), each None where it is not one; None where `values`
    is no iterable of them (a bare number)."""
    try:
        items = values.tolist() if hasattr(values, "tolist") else list(values)
    except TypeError:
        return None
    items = items if isinstance(items, list) else [items]
    return [v if isinstance(v, int) and not isinstance(v, bool) else None for v in map(_index, items)]


def device_buffers(placement: str, codec, layouts: Mapping[int, object]) -> dict[str, int]:
    """Device buffers the manager allocates beside the slots for a compressed transfer format, by name:
    placement "dequant": "staging", one record (the largest) that copies land in before they are
    decoded into their slot (copies and decodes run in order on one copy stream, so one is enough);
    placement "packed": "scratch", where the codec's `linear` decodes a weight (codecs with
    `scratch_bytes`: lossless); "mixed": both. None for uncompressed records ("raw")."""
    buffers = {}
    if placement in ("dequant", "mixed"):
        buffers["staging"] = max(layout.nbytes for layout in layouts.values())
    scratch = getattr(codec, "scratch_bytes", None)
    if placement in ("packed", "mixed") and scratch is not None:
        # imported here: it imports torch, and the CLI's help reads this module without importing torch
        from .quant.cast import scratch_bytes as cast_scratch

        buffers["scratch"] = max(cast_scratch(scratch, layout) for layout in layouts.values())
    return buffers


def plan_budget(
    layers: Sequence[LayerInfo],
    record_bytes: dict[int, int],
    budget_bytes: int,
    buffers: Mapping[str, int] | None = None,
    placement: str = "raw",
    round_up_from: float | None = None,
    fraction_of: int | None = None,
) -> BudgetPlan:
    """Split `budget_bytes` into slots, one pool per distinct record size, in proportion to each
    pool's share of all expert bytes, after taking out the codec's device `buffers` (see
    `device_buffers`); a pool whose share is below the top-k experts of one of its layers gets those,
    and the other pools share the rest in the same proportion. Below the minimum working set (those
    buffers plus the top-k experts of one layer in every pool) raises `BudgetError`, unless
    `round_up_from` gives the fraction the budget was derived from: a share of the experts' bytes is
    then raised to that minimum, with a warning, and the plan's `budget_bytes` is the budget in use. `fraction_of`:
    the bytes a fractional budget is a share of (every expert uncompressed and whole, as `resolve_budget_bytes`
    takes them), where the records are not those; the messages' fractions are of it."""
    buffers = dict(buffers or {})
    reserved = sum(buffers.values())
    slots_budget = max(budget_bytes - reserved, 0)
    pool_of_layer = _pools_by_size(record_bytes)
    total = {g: 0 for g in set(pool_of_layer.values())}
    experts = dict.fromkeys(total, 0)
    top_k = dict.fromkeys(total, 0)
    for li in layers:
        g = pool_of_layer[li.ordinal]
        total[g] += li.num_experts * g  # records of a pool fill at most a slot of g bytes
        experts[g] += li.num_experts
        top_k[g] = max(top_k[g], li.top_k)
    all_bytes = sum(total.values())
    least = {g: top_k[g] * g for g in total}  # bytes of each pool's smallest working set
    minimum = sum(least.values()) + reserved
    base = fraction_of or all_bytes
    if budget_bytes < minimum and round_up_from is not None:
        # A fraction is relative to the experts: one too small for this model means "as little as works".
        warnings.warn(
            f"mira-hf: gpu_budget={round_up_from} ({budget_bytes:,} bytes) is below the minimum working set of "
            f"this model; using {minimum:,} bytes (a fraction of {minimum / base:.3f}: {_working_set(total)}). "
            "Give a larger fraction, or a byte budget, to choose the budget yourself.",
            stacklevel=3,
        )
        budget_bytes, slots_budget = minimum, minimum - reserved
    if budget_bytes < minimum:
        extra = f" and {reserved:,} bytes of codec buffers ({', '.join(buffers)})" if reserved else ""
        raise BudgetError(
            f"gpu_budget of {budget_bytes:,} bytes is below the minimum working set of this model: "
            f"{minimum:,} bytes ({_working_set(total)}{extra}; {all_bytes:,} bytes hold every expert). "
            f"Give MiraConfig(gpu_budget=...) at least {minimum:,} bytes, e.g. a fraction ≥ {minimum / base:.3f}."
        )
    share = _shares(total, least, slots_budget)
    n_slots = {g: min(experts[g], share[g] // g) for g in total}
    return BudgetPlan(budget_bytes, pool_of_layer, {g: g for g in total}, n_slots, buffers, placement)


def _shares(total: Mapping[int, int], least: Mapping[int, int], slots_budget: int) -> dict[int, int]:
    """Bytes of `slots_budget` (at least the sum of `least`) for each pool: in proportion to its experts' bytes
    (`total`), except that a pool whose share is below its `least` gets that, and the others share what is left."""
    share = {}
    while True:
        free = [g for g in total if g not in share]
        left = slots_budget - sum(share.values())
        weight = sum(total[g] for g in free)
        short = [g for g in free if left * total[g] // weight < least[g]]
        if not short:
            return share | {g: left * total[g] // weight for g in free}
        share.update((g, least[g]) for g in short)


def _working_set(total: Mapping[int, int]) -> str:
    """What the minimum working set of a model with these pools is, in words."""
    if len(total) == 1:
        return "the top-k experts of one layer"
    return f"the top-k experts of one layer of each of its {len(total)} expert sizes"


# Record sizes within this share of a larger one share its pool (slots of the larger size): lossless
# records differ by a few escape entries from layer to layer, and a pool per layer would round each
# layer's share of the budget down to whole slots separately.
POOL_MERGE_SHARE = 1 / 16


def _pools_by_size(record_bytes: Mapping[int, int]) -> dict[int, int]:
    """layer -> pool key (the pool's slot size in bytes): each distinct record size, except that a size
    within POOL_MERGE_SHARE below a larger one joins that one's pool."""
    pool_of_size: dict[int, int] = {}
    for size in sorted(set(record_bytes.values()), reverse=True):
        larger = min((g for g in pool_of_size.values() if size >= g * (1 - POOL_MERGE_SHARE)), default=None)
        pool_of_size[size] = larger if larger is not None else size
    return {layer: pool_of_size[size] for layer, size in record_bytes.items()}


# gpu_budget=None: the experts' share of the device memory left free, after the non-expert weights; the rest is
# headroom for activations and the KV cache.
FREE_MEMORY_SHARE = 0.9


def default_budget_bytes(free_bytes: int, expert_bytes: int, non_expert_bytes: int) -> int:
    """The expert budget of `gpu_budget=None` on a CUDA device: every expert if they fit in 90% of the free device
    memory less the non-expert weights still to move there, else that much (at least 1 byte). `mira env` suggests it."""
    return max(min(expert_bytes, int(free_bytes * FREE_MEMORY_SHARE) - non_expert_bytes), 1)


def resolve_budget_bytes(cfg: MiraConfig, all_bytes: int, device, bytes_to_move: Callable[[], int]) -> int:
    """`cfg.gpu_budget` in bytes. A fraction is a share of `all_bytes` (every routed expert, uncompressed);
    None is every expert on a CPU, and on CUDA every expert that fits in 90% of the device's free memory
    less `bytes_to_move()` (the model's weights still to move there)."""
    if cfg.gpu_budget is None:
        if device.type != "cuda":
            return all_bytes
        import torch

        return default_budget_bytes(torch.cuda.mem_get_info(device)[0], all_bytes, bytes_to_move())
    if isinstance(cfg.gpu_budget, float):
        return max(int(cfg.gpu_budget * all_bytes), 1)
    return cfg.gpu_budget_bytes


def plan_records(
    layers: Sequence[LayerInfo],
    budget_bytes: int,
    placement: str,
    codec,
    layouts: Mapping[int, object],
    raw_bytes: Mapping[int, int],
    round_up_from: float | None = None,
    fraction_of: int | None = None,
) -> BudgetPlan:
    """The plan for records laid out as `layouts` (per layer; empty for uncompressed records, whose
    sizes are `raw_bytes`) held in slots by `placement`: a "packed" slot holds a record as it is, any
    other placement a record of the checkpoint dtype ("mixed": see `keep_packed`). `round_up_from`, `fraction_of`: see
    `plan_budget`."""
    slot_bytes = {layer: layout.nbytes for layer, layout in layouts.items()} if placement == "packed" else dict(raw_bytes)
    buffers = device_buffers(placement, codec, layouts)
    plan = plan_budget(layers, slot_bytes, budget_bytes, buffers, placement, round_up_from, fraction_of)
    if placement == "mixed":
        return keep_packed(plan, layers, {layer: layout.nbytes for layer, layout in layouts.items()})
    return plan


def keep_packed(plan: BudgetPlan, layers: Sequence[LayerInfo], packed_bytes: Mapping[int, int]) -> BudgetPlan:
    """Placement "mixed": where `plan`'s decoded slots cannot hold every expert, but would with some experts kept
    packed on the device beside them (`packed_bytes` per layer, smaller than a slot), the plan that keeps the fewest
    packed and gives every other expert a slot, so nothing is ever copied again; else `plan` itself. A batch that
    uses every expert at every step then decodes the kept ones (a fraction of a millisecond on a GPU each) instead
    of copying the missing ones across the link. Experts are kept one layer at a time, in turn (each layer's block
    decodes about as many), the highest-numbered first, and each layer keeps at least its top-k experts in slots."""
    experts = {li.ordinal: li.num_experts for li in layers}
    pool = plan.pool_of_layer
    held = {g: 0 for g in plan.n_slots}  # experts each pool would hold
    for layer, n in experts.items():
        held[pool[layer]] += n
    if all(plan.n_slots[g] >= held[g] for g in held):
        return plan  # every expert has a decoded slot already
    room = plan.budget_bytes - sum(plan.buffer_bytes.values())
    need = sum(held[g] * g for g in held)  # bytes of every expert decoded
    kept = dict.fromkeys(experts, 0)
    most = {li.ordinal: li.num_experts - li.top_k for li in layers if packed_bytes[li.ordinal] < pool[li.ordinal]}
    while need > room and any(kept[layer] < most[layer] for layer in most):
        for layer in sorted(most):
            if need <= room:
                break
            if kept[layer] < most[layer]:
                kept[layer] += 1
                need -= pool[layer] - packed_bytes[layer]
    if need > room:
        return plan  # not even that holds every expert: slots only
    n_slots = {g: 0 for g in held}
    for layer, n in experts.items():
        n_slots[pool[layer]] += n - kept[layer]
    keep = {layer: tuple(range(experts[layer] - k, experts[layer])) for layer, k in kept.items() if k}
    return replace(plan, n_slots=n_slots, kept=keep, kept_bytes={layer: packed_bytes[layer] for layer in keep})
