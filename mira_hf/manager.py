"""`ExpertManager`: store + cache + loader, behind a few verbs the proxies call.

Per block call the proxy does `plan = begin(layer, experts)`, then for each expert in `plan.order`
(resident experts first, misses in the order their copies were issued) `acquire` → compute →
`release`, and finally `end(plan)`. A miss is copied into a slot as soon as one can be taken, so
copies overlap the compute of experts already resident. `prefetch` (for predictors) stages experts
into STAGE slots ahead of the router.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .cache import ExpertCache, Key, Slot, SlotPool
from .errors import BudgetError, ConcurrencyError, ConfigError, LoaderError, UnsupportedOperationError
from .heat import HeatConfig, HeatTracker
from .layout import IdentityCodec, PackedWeights, split_point
from .loader import Loader
from .payoff import PayoffGate
from .policies import HeatPolicy, LRUPolicy, PriorityConfig, PriorityPolicy
from .predictors import Predictor, PredictorConfig
from .store import ExpertStore
from .telemetry import Telemetry


@dataclass(frozen=True)
class LayerInfo:
    """What the manager knows of one MoE layer."""

    ordinal: int  # 0..L-1 over MoE layers, in model order: the key used everywhere
    name: str  # module path of the routed experts, e.g. "model.layers.3.mlp.experts"
    num_experts: int
    top_k: int


@dataclass
class BlockPlan:
    """State of one block call: which experts, in which order, which copies are still to issue."""

    layer: int
    order: list[int]
    pending: deque = field(default_factory=deque)  # misses not yet given a slot
    slots: dict[int, Slot] = field(default_factory=dict)  # expert -> slot pinned by this plan
    loading: set[int] = field(default_factory=set)  # demand-loaded experts this plan still pins
    predictions: dict | None = None  # the predictor's guesses, staged once the block's own experts are in use


@dataclass(frozen=True)
class BudgetPlan:
    """How a byte budget becomes slots. Computed (and validated) before anything changes."""

    budget_bytes: int
    pool_of_layer: dict[int, Hashable]
    slot_bytes: dict[Hashable, int]
    n_slots: dict[Hashable, int]
    buffer_bytes: dict[str, int] = field(default_factory=dict)  # codec buffers taken from the budget first

    @property
    def capacity_bytes(self) -> int:
        """Bytes of all slots."""
        return sum(self.n_slots[g] * self.slot_bytes[g] for g in self.n_slots)

    @property
    def device_bytes(self) -> int:
        """Everything the manager allocates on the device: slots and codec buffers (≤ budget_bytes)."""
        return self.capacity_bytes + sum(self.buffer_bytes.values())


def device_buffers(placement: str, codec, layouts: Mapping[int, object]) -> dict[str, int]:
    """Device buffers the manager allocates beside the slots for a compressed transfer format, by name:
    placement "dequant": "staging", one record (the largest) that copies land in before they are
    decoded into their slot (copies and decodes run in order on one copy stream, so one is enough);
    placement "packed": "scratch", where the codec's `linear` decodes a weight (codecs with
    `scratch_bytes`: lossless). None for uncompressed records ("raw")."""
    if placement == "dequant":
        return {"staging": max(layout.nbytes for layout in layouts.values())}
    scratch = getattr(codec, "scratch_bytes", None)
    if placement == "packed" and scratch is not None:
        return {"scratch": max(scratch(layout) for layout in layouts.values())}
    return {}


def plan_budget(
    layers: Sequence[LayerInfo], record_bytes: dict[int, int], budget_bytes: int, buffers: Mapping[str, int] | None = None
) -> BudgetPlan:
    """Split `budget_bytes` into slots, one pool per distinct record size, in proportion to each
    pool's share of all expert bytes, after taking out the codec's device `buffers` (see
    `device_buffers`). Raises `BudgetError` below the minimum working set: those buffers plus the
    top-k experts of one layer in every pool."""
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
    n_slots = {}
    for g in total:
        share = slots_budget * total[g] // all_bytes
        n_slots[g] = min(experts[g], share // g)
    minimum = sum(top_k[g] * g for g in total) + reserved
    if any(n_slots[g] < top_k[g] for g in total):
        extra = f" and {reserved:,} bytes of codec buffers ({', '.join(buffers)})" if reserved else ""
        raise BudgetError(
            f"gpu_budget of {budget_bytes:,} bytes is below the minimum working set of this model: "
            f"{minimum:,} bytes (the top-k experts of one layer{extra}; {all_bytes:,} bytes hold every expert). "
            f"Give MiraConfig(gpu_budget=...) at least {minimum:,} bytes, e.g. a fraction ≥ {minimum / all_bytes:.3f}."
        )
    return BudgetPlan(budget_bytes, pool_of_layer, {g: g for g in total}, n_slots, buffers)


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


def _expected_distance(d: int, num_layers: int, p: float, q: float) -> float:
    """Layers until the next use of an expert whose layer runs in `d` layers and uses it with
    probability `q` this time and `p` (its use rate) each later step: d + L·(1 − q) / p."""
    return d + num_layers * (1 - q) / p


class ExpertManager:
    """Shared by every proxy of one model (`model.mira`)."""

    def __init__(
        self,
        store: ExpertStore,
        layers: Sequence[LayerInfo],
        budget: BudgetPlan,
        device: torch.device,
        policy: str = "lru",
        stage_fraction: float = 0.25,
        demand_inflight_bytes: int = 64 * 2**20,
        ring_bytes: int = 128 * 2**20,
        copy_timeout_s: float = 60.0,
        heat: HeatConfig | None = None,
        priority: PriorityConfig | None = None,
        predictor: Predictor | None = None,
        predictor_config: PredictorConfig | None = None,
        warmup_steps: int = 3,
        placement: str = "dequant",
        split_copies: bool = True,
        split_min_bytes: int = 0,  # MiraConfig's default: LoaderConfig.split_min_bytes
    ) -> None:
        self.layers = {li.ordinal: li for li in layers}
        self._first_ordinal, self._last_ordinal = min(self.layers), max(self.layers)
        self.telemetry = Telemetry()
        self.heat = HeatTracker({li.ordinal: li.num_experts for li in layers}, heat)
        self.predictor = predictor
        self.predictor_config = predictor_config or PredictorConfig()
        # Prediction pauses while it costs more host time than the stalls it could remove (PredictorConfig.pause_unprofitable).
        self._gate = PayoffGate(self.predictor_config.payoff_window_steps)
        self.warmup_steps = warmup_steps  # first steps: prefetches only fill free slots, nothing is evicted
        self._predicted: dict[Key, float] = {}  # latest predicted probability of use this step
        # layer -> latest [E] prediction: for a layer not yet run this step, or (layers in _next_step) for its next step
        self._layer_probs: dict[int, list[float]] = {}
        self._next_step: set[int] = set()  # layers whose _layer_probs entry is for the next step (kept across steps)
        self._precision: float | None = None  # running precision of the predictor's guesses
        self._pending_predictions: dict[int, list[tuple[int, set[int]]]] = {}  # target layer -> [(distance, set)]
        self._ahead: dict[int, dict] = {}  # layer -> predictions made by predict_ahead, for its begin()
        self.host_only: frozenset[Key] = frozenset()  # experts that never keep a slot (set_host_only)
        self.recorder = None  # optional callable(layer, hidden [T,H], top_k_index [T,K]): traces, calibration
        self.batch = None  # mira_hf.batching.BatchUsage once enabled (serving): batch-aware use rates
        self.router_probs = None  # (layer, hidden) -> [T, E] router probabilities, set by the model wrapper
        self.fingerprint: dict = {}  # identifies the wrapped model (files made for another model are refused)
        self.quantization: str | None = None  # the transfer format in use (MiraConfig.quantization, "auto" resolved)
        self._lock = threading.RLock()
        # What `_place` builds the cache and loader from, kept for `relocate`.
        self._slot_options = dict(
            policy=policy,
            priority=priority,
            stage_fraction=stage_fraction,
            demand_inflight_bytes=demand_inflight_bytes,
            ring_bytes=ring_bytes,
            copy_timeout_s=copy_timeout_s,
            placement=placement,
            split_copies=split_copies,
            split_min_bytes=split_min_bytes,
        )
        self._place(store, budget, device)
        self._last_layer = -1
        self._forward_lock = threading.Lock()  # one forward step at a time (see enter_forward)
        self._forward_owner: int | None = None

    def _place(self, store: ExpertStore, budget: BudgetPlan, device: torch.device) -> None:
        """Build everything that depends on the records, the slot plan and the device: the loader, the
        slot arenas and codec buffers, and an empty cache (`__init__`, and `relocate` after a cast or move)."""
        o = self._slot_options
        layers = list(self.layers.values())
        self.store = store
        # Demand copies a block keeps in flight (see CacheConfig.demand_inflight_bytes): ≥ 2 per layer.
        self._depth = {li.ordinal: max(2, -(-o["demand_inflight_bytes"] // store.record_bytes(li.ordinal))) for li in layers}
        self.budget = budget
        self.device = device
        self.loader = Loader(device, o["ring_bytes"], timeout_s=o["copy_timeout_s"])
        pause = self.predictor_config.pause_unprofitable
        self._gate_on = device.type == "cuda" if pause is None else pause
        # How a slot holds an expert: "raw" (checkpoint bytes), "dequant" (packed records dequantised
        # into a slot of the checkpoint dtype) or "packed" (packed records, computed from as they are).
        self.placement = o["placement"] if store.quantized else "raw"
        # Speculative copies of the next layer's guesses (PredictorConfig.speculate_bytes): only where a
        # copy lands in its slot as is ("dequant" decodes whole records) and the link can idle (CUDA).
        spec = self.predictor_config.speculate_bytes
        spec = (48 * 2**20 if device.type == "cuda" else 0) if spec is None else spec
        self.speculate_bytes = spec if self.placement != "dequant" else 0
        # Records copied in two parts where a slot holds them as they are (LoaderConfig.split_copies): the
        # tensors of the first matmul, then the rest, so the first matmul (and its decode) overlaps the rest.
        split = o["split_copies"] and self.placement != "dequant"
        self._split = {
            li.ordinal: split_point(store.layout(li.ordinal))
            if split and store.record_bytes(li.ordinal) >= o["split_min_bytes"]
            else None
            for li in layers
        }
        self._cut_short: dict[Key, Slot] = {}  # speculative copies cut short, until finished or dropped
        self._staged: dict[int, list[Slot]] = {}  # layer -> slots given to its prefetches since its last block
        largest = max(budget.slot_bytes.values())
        tier_factor = {"pinned": 1.0, "pageable": 2.0, "disk": 4.0}  # relative reload cost per byte
        self._cost = {
            li.ordinal: min(1.0, store.record_bytes(li.ordinal) / largest * tier_factor[store.tier(li.ordinal)] / 4.0)
            for li in layers
        }
        pools = {}
        self._arena: dict[Hashable, torch.Tensor] = {}
        for g, n in budget.n_slots.items():
            n_stage = int(n * o["stage_fraction"])
            pools[g] = SlotPool(budget.slot_bytes[g], n, n_stage, self._make_policy(o["policy"], o["priority"]))
            # One allocation per pool, made once: slots are views, so the budget is never exceeded.
            self._arena[g] = torch.empty((n, budget.slot_bytes[g]), dtype=torch.uint8, device=device)
        # Codec buffers, taken from the budget by the plan: "dequant" copies land in one staging record
        # and are decoded into their slot on the copy stream; "packed" lossless decodes into a scratch.
        need = device_buffers(self.placement, store.codec, {li.ordinal: store.layout(li.ordinal) for li in layers})
        short = {k: n for k, n in need.items() if n > budget.buffer_bytes.get(k, 0)}
        if short:
            raise BudgetError(
                f"placement {self.placement!r} needs device buffers {need} but the budget plan reserves "
                f"{budget.buffer_bytes}: plan it with plan_budget(..., buffers=device_buffers(placement, codec, layouts))."
            )
        self._buffers = {k: torch.empty(n, dtype=torch.uint8, device=device) for k, n in need.items()}
        self.cache = ExpertCache(pools, budget.pool_of_layer)
        self._views: dict[tuple, object] = {}  # (pool, slot, layer) -> tensors or PackedWeights

    def relocate(self, store: ExpertStore, budget: BudgetPlan, device: torch.device) -> None:
        """Serve from `store` (e.g. re-encoded by a cast, or rewritten by `load_state_dict`) with slots
        planned by `budget` on `device` (the model moved there). Every copy in flight finishes first; the
        cache starts empty (what it held is stale or elsewhere). Counters, heat and the predictor stay."""
        with self._lock:
            self.loader.synchronize()
            self._drop_speculation()
            self._arena.clear()
            self._buffers.clear()
            self._views.clear()
            self._ahead.clear()
            self._place(store, budget, device)

    def _make_policy(self, name: str, priority: PriorityConfig | None):
        if name == "heat":
            return HeatPolicy(self.heat, self.keep_values)
        if name == "priority":
            return PriorityPolicy(
                predicted=lambda k: self._predicted.get(k, 0.0),
                step=lambda: self.telemetry.steps,
                cost=lambda k: self._cost[k[0]],
                config=priority,
            )
        return LRUPolicy()

    # -- forward steps --------------------------------------------------------------------------
    def __deepcopy__(self, memo):
        raise UnsupportedOperationError(
            "a mira-hf model cannot be deep-copied: its experts live in one host store and GPU arena shared by its "
            "proxies. Load a second model with MiraMoEModel.from_pretrained(...), or call model.unload() first."
        )

    def __reduce_ex__(self, protocol):
        raise UnsupportedOperationError(
            "a mira-hf model cannot be pickled (torch.save(model), multiprocessing): its experts live in a host store "
            "and GPU arena. Save it with model.save_pretrained(dir) (a full transformers checkpoint, experts included)."
        )

    def enter_forward(self, new_sequence: bool = False) -> None:
        """A forward step of the model starts. Steps are serialised: a second thread calling the
        same model waits for the first step to finish (steps of two generate calls interleave
        safely: the expert cache holds no per-sequence state)."""
        if not self._forward_lock.acquire(timeout=600):
            raise ConcurrencyError(
                "this model has been busy in another thread for 10 minutes; mira-hf runs one forward step at a "
                "time per model. Load one model per thread, or serialise your calls."
            )
        self._forward_owner = threading.get_ident()
        with self._lock:
            if self._last_layer >= 0:
                self._end_step()
            self._last_layer = -1
            if new_sequence:
                for layer in self._next_step:  # made from the last sequence's last token: not about this prompt
                    self._layer_probs.pop(layer, None)
                self._next_step.clear()
                if hasattr(self.predictor, "new_sequence"):
                    self.predictor.new_sequence()

    def exit_forward(self) -> None:
        """The forward step ended (normally or by an exception, KeyboardInterrupt included)."""
        if self._forward_owner != threading.get_ident():
            return  # this thread never entered (its enter_forward raised)
        with self._lock:
            if self._last_layer >= 0:
                self._end_step()
            self._last_layer = -1
        self._forward_owner = None
        self._forward_lock.release()

    # -- the verbs ------------------------------------------------------------------------------
    def begin(
        self,
        layer: int,
        experts: Sequence[int],
        hidden: torch.Tensor | None = None,
        top_k_index: torch.Tensor | None = None,
    ) -> BlockPlan:
        """Start a block call needing `experts` of `layer`: count hits and misses, pin what is
        resident, issue copies for misses while slots can be taken, and ask the predictor about later
        layers (its guesses are staged by `end`, after this block's own copies)."""
        with self._lock:
            ahead = self._ahead.pop(layer, None)  # before a step boundary would clear it
            if layer <= self._last_layer:
                self._end_step()
            self._last_layer = layer
            if self.recorder is not None and hidden is not None:
                self.recorder(layer, hidden, top_k_index)
            self.heat.activate(layer, list(experts))
            if self.batch is not None:
                self.batch.observe(layer, experts, top_k_index)
            self._layer_probs.pop(layer, None)  # its block runs now: the guesses are spent
            self._next_step.discard(layer)
            self._score_predictions(layer, experts)
            self._expire_prefetches(layer)
            stats = self.telemetry.layer(layer)
            ready, in_flight, finishing, misses = [], [], [], []
            stage_hits = 0
            plan = BlockPlan(layer, [])
            for e in experts:
                slot = self.cache.lookup((layer, e))
                if slot is None:
                    misses.append(e)
                    continue
                if slot.partial:  # a speculative copy cut short: the rest is a demand load (a miss)
                    finishing.append(e)
                    slot.pins += 1
                    plan.slots[e] = slot
                    plan.loading.add(e)
                    continue
                # Labels (one meaning everywhere, `tier_of`): a "stage" hit is the first use of an expert
                # copied ahead of need, a miss the prediction avoided; a "hot" hit reuses a kept expert.
                if slot.prefetched and not slot.used_since_load:
                    stage_hits += 1  # for PayoffGate
                    stats.stage_hits += 1
                else:
                    stats.hot_hits += 1
                slot.pins += 1
                plan.slots[e] = slot
                if slot.ready is not None and slot.ready.query():
                    slot.ready = slot.first_ready = None  # landed: its later readers need no wait (no CUDA call per hit)
                (in_flight if slot.ready is not None else ready).append(e)
            stats.misses += len(misses) + len(finishing)
            self._gate.count_block(stage_hits, len(misses) + len(finishing))
            self.telemetry.count_uses(len(experts) - len(misses) - len(finishing), len(experts))
            plan.order = ready + in_flight + finishing + misses
            plan.pending.extend(misses)
            self._drop_speculation(layer)  # guesses for this block that it does not use
            try:
                for e in finishing:
                    self._finish(plan.slots[e])
                self._issue(plan)
                if ahead is not None:
                    plan.predictions = ahead
                elif self.predicting and hidden is not None and top_k_index is not None:
                    t0 = time.perf_counter()
                    self.predictor.observe(layer, hidden, top_k_index)
                    plan.predictions = self.predictor.predict(layer, hidden)
                    if self.loader.cuda:  # no predict_ahead: finish the non-blocking copies before `end` reads them
                        torch.cuda.current_stream(self.device).synchronize()
                    self._gate.charge(time.perf_counter() - t0)
            except BaseException:
                self._unpin(plan)  # the caller never gets the plan, so it cannot end() it
                raise
            return plan

    def predict_ahead(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor) -> None:
        """Let the predictor see this block's routing and guess later layers *before* the block's host
        sync (the proxy's expert counts): on CUDA its device work and its copy to the host are then
        finished by that one sync instead of needing one of their own. `begin` uses the result."""
        if not self.predicting:
            return
        with self._lock:
            t0 = time.perf_counter()
            self.predictor.observe(layer, hidden, top_k_index)
            self._ahead[layer] = self.predictor.predict(layer, hidden)
            self._gate.charge(time.perf_counter() - t0)

    def acquire(self, plan: BlockPlan, expert: int, first_part: bool = False) -> dict[str, torch.Tensor]:
        """The device tensors of `expert`, once its copy is done (the compute stream waits on it). With
        `first_part`, once the tensors of its first matmul are in: the caller must `acquire_rest` before
        it reads any other tensor."""
        with self._lock:
            slot = plan.slots.get(expert)
            if slot is None:
                self._issue(plan, at_least_one=True)  # misses are acquired in issue order: this is the next one
                slot = plan.slots[expert]
            if first_part and slot.first_ready is not None:
                self.loader.wait(slot.first_ready, plan.layer)
            else:
                slot.first_ready = None
                self.loader.wait(slot.ready, plan.layer)
            if slot.prefetched and not slot.used_since_load:
                self.telemetry.layer(plan.layer).prefetch_used += 1
                self.heat.feedback(plan.layer, expert, used=True)
            self.cache.use(slot)
            return self._slot_views(plan.layer, slot)

    def acquire_rest(self, plan: BlockPlan, expert: int) -> None:
        """After `acquire(..., first_part=True)`: the compute stream also waits for the rest of the record."""
        slot = plan.slots[expert]
        if slot.first_ready is not None:
            with self._lock:
                slot.first_ready = None
                self.loader.wait(slot.ready, plan.layer)

    def release(self, plan: BlockPlan, expert: int) -> None:
        """The block has enqueued its last read of `expert`: its slot may be reused after that."""
        with self._lock:
            slot = plan.slots.pop(expert)
            slot.free = self.loader.mark_free(slot.free)
            slot.pins -= 1
            plan.loading.discard(expert)
            if self.host_only and (plan.layer, expert) in self.host_only and not slot.pins:
                self.cache.remove((plan.layer, expert))  # used and gone: its slot serves the cached experts
            self._issue(plan)

    def end(self, plan: BlockPlan) -> None:
        """Unpin whatever the plan still holds (normal end, or an exception mid-block), then stage
        the predicted experts of later layers. Staging waits until now because, before the block's
        experts are used, its fresh demand loads still fill the STAGE tier; on CUDA the block's
        compute is already queued, so these copies still overlap it."""
        with self._lock:
            self._unpin(plan)
            t0 = time.perf_counter()
            if plan.predictions:
                predictions, plan.predictions = plan.predictions, None
                self._stage(plan.layer, predictions)
            elif self.batch is not None and not self.predicting and self.staging_enabled:
                if guess := self.batch.next_layer_guess(plan.layer):
                    self._copy_likely(*guess)
            if plan.layer == self._last_ordinal and self.staging_enabled:
                self._stage_next_step()
            if self.predicting:
                self._gate.charge(time.perf_counter() - t0)

    def prefetch(self, layer: int, experts: Sequence[int], probabilities: Sequence[float] | None = None) -> int:
        """Stage `experts` of `layer` (with their probabilities of use) into STAGE slots ahead of need;
        returns how many copies started. A guess never evicts a pinned or awaited expert, nor one
        expected to be needed sooner than the guess itself (nor a HOT one, under the lru and priority
        policies); it stops at the first expert that finds no slot."""
        with self._lock:
            started = 0
            for i, e in enumerate(experts):
                if self.cache.lookup((layer, e)) is not None or (layer, e) in self.host_only:
                    continue
                p = 1.0 if probabilities is None else probabilities[i]
                slot = self._load((layer, e), staged=True, evict=self._warmed_up, probability=p)
                if slot is None:
                    break
                started += 1
            return started

    # -- prediction -----------------------------------------------------------------------------
    def _stage(self, layer: int, predictions: dict[int, torch.Tensor]) -> None:
        """Record each target layer's guesses (they rank evictions and are scored), then copy the
        likely experts (most likely first) of the next `stage_lookahead` layers, nearest first.
        A target at or before `layer` is a guess for the *next* step (the learned predictor's next-step
        head): it ranks evictions from now until that layer's next block, and only the first layer's is
        copied (`_stage_next_step`, once the step's last layer has run)."""
        cfg = self.predictor_config
        for target in sorted(predictions):
            probs = predictions[target]
            if target <= layer:  # that layer has run this step: its entry was spent
                self._layer_probs[target] = probs.tolist()
                self._next_step.add(target)
                continue
            values = probs.tolist()
            self._layer_probs[target] = values  # the nearest prediction comes last and wins
            chosen = [e for e, v in enumerate(values) if v >= cfg.confidence]
            chosen.sort(key=values.__getitem__, reverse=True)  # most likely first (stable: ties by index)
            self._pending_predictions.setdefault(target, []).append((target - layer, set(chosen)))
            for e in chosen:
                self._predicted[(target, e)] = max(self._predicted.get((target, e), 0.0), values[e])
            if target - layer <= cfg.stage_lookahead and self.staging_enabled:
                self._copy_likely(target, chosen, values)
            if target == layer + 1 and self.speculate_bytes:
                self._speculate(target, chosen, values)

    def _speculate(self, layer: int, guesses: Sequence[int], values: Sequence[float]) -> None:
        """Start copying the first `speculate_bytes` of the likeliest of `guesses` (most likely first)
        not yet resident: that copy runs while the link would otherwise wait for `layer`'s router (see
        `PredictorConfig.speculate_bytes`); `begin` finishes it if the guess was right, else drops it.
        Only records larger than `speculate_bytes` are speculated on, so every such copy is cut short and
        a wrong one never stays to take a slot (small records move fast: a whole-record guess is what
        `stage_probability` decides)."""
        if self.store.record_bytes(layer) <= self.speculate_bytes:
            return
        for e in guesses:
            if self.cache.lookup((layer, e)) is None and (layer, e) not in self.host_only:
                self._load((layer, e), staged=True, evict=self._warmed_up, probability=values[e], nbytes=self.speculate_bytes)
                return

    def _finish(self, slot: Slot) -> None:
        """Copy the rest of a record whose speculative copy was cut short: its block needs it."""
        layer, expert = slot.key
        src = self.store.record(layer, expert)
        n = slot.partial
        try:
            self._copy_into(slot, src, n, src.numel(), self.store.tier(layer) == "pinned")
        except Exception as exc:  # the slot keeps its first bytes; the block's caller unpins it
            raise LoaderError(
                f"loading the rest of expert {expert} of MoE layer {layer} to {self.device} failed: {exc}. "
                "The cache was left consistent; the next call loads it again."
            ) from exc
        slot.partial = 0
        stats = self.telemetry.layer(layer)
        stats.bytes_h2d += src.numel() - n  # one load, counted when its copy started
        stats.speculated_used += 1

    def _copy_into(self, slot: Slot, src: torch.Tensor, start: int, end: int, pinned: bool, after: object = None) -> None:
        """Copy bytes [start, end) of the record `src` into `slot` (not "dequant": the bytes land as they
        are). In two parts when the tensors of the first matmul end inside the range (`slot.first_ready`
        marks them); when they ended before `start`, the slot's previous copy brought them and its event
        marks them."""
        s = self._split[slot.key[0]]
        split = s - start if s is not None and start < s < end else 0
        before = slot.ready if s is not None and 0 < start and s <= start else None
        dst = self._arena[self.cache.pool_of_layer[slot.key[0]]][slot.index]
        first, slot.ready = self.loader.copy_split(dst[start:end], src[start:end], pinned, split, after)
        slot.first_ready = first if split else before

    def _drop_speculation(self, layer: int | None = None) -> None:
        """Free the slots of speculative copies cut short (of `layer`, or all): nobody will finish them."""
        if not self._cut_short:
            return
        for key in [k for k in self._cut_short if layer is None or k[0] == layer]:
            slot = self._cut_short.pop(key)
            if self.cache.lookup(key) is not slot or not slot.partial or slot.pins:
                continue  # evicted since, finished, or being finished by its block
            self.cache.remove(key)
            self.telemetry.layer(key[0]).prefetch_wasted += 1
            self.heat.feedback(*key, used=False)

    @property
    def predicting(self) -> bool:
        """Whether the predictor runs now: there is one, and the payoff gate has not paused it."""
        return self.predictor is not None and (self._gate.active or not self._gate_on)

    @property
    def staging_enabled(self) -> bool:
        """Whether predictions are turned into copies now: only while the predictor has been right
        often enough (predictions are still made and scored, so staging resumes when it recovers)."""
        return self._precision is None or self._precision >= self.predictor_config.min_precision

    def _stage_next_step(self) -> None:
        """The last layer's block has run: copy the likely experts of the first layer's next block, from
        its next-step guess (the learned predictor's next-step head). No guess made within a step reaches
        the first layer, so without this its misses always stall."""
        first = self._first_ordinal
        values = self._layer_probs.get(first) if first in self._next_step else None
        if values is not None:
            self._copy_likely(first, sorted(range(len(values)), key=lambda e: -values[e]), values)

    def _copy_likely(self, layer: int, order: Sequence[int], values: Sequence[float]) -> None:
        """Prefetch `layer`'s guesses (`order`: most likely first) with probability ≥ `stage_probability`,
        at most `max_staged_per_layer` (default 2 · top-k)."""
        cfg = self.predictor_config
        cap = cfg.max_staged_per_layer or 2 * self.layers[layer].top_k
        staged = [e for e in order if values[e] >= cfg.stage_probability][:cap]
        self.prefetch(layer, staged, [values[e] for e in staged])

    @property
    def _warmed_up(self) -> bool:
        """Past the first forward steps: before that, guesses only fill free slots (nothing is evicted)."""
        return self.telemetry.steps >= self.warmup_steps

    def _score_predictions(self, layer: int, experts: Sequence[int]) -> None:
        actual = set(experts)
        decay = self.predictor_config.precision_decay
        for distance, predicted in self._pending_predictions.pop(layer, ()):
            tp = len(predicted & actual)
            self.telemetry.count_prediction(layer, distance, tp, len(predicted) - tp, len(actual) - tp)
            if predicted and distance <= self.predictor_config.stage_lookahead:  # guesses that may be staged
                p = tp / len(predicted)
                self._precision = p if self._precision is None else decay * self._precision + (1 - decay) * p

    def _expire_prefetches(self, layer: int) -> None:
        """This layer's block is running: its prefetches no longer wait (used ones are pinned now).
        Only slots given to a prefetch of this layer can be awaiting (`_staged`): no scan of the pool,
        which holds hundreds of slots with fine-grained experts."""
        for slot in self._staged.pop(layer, ()):
            if slot.key is not None and slot.key[0] == layer:
                slot.awaiting = False

    def _end_step(self) -> None:
        self._drop_speculation()
        if self._gate_on and self.predictor is not None:
            self._gate.end_step(self.loader.stall_total())
        self.telemetry.end_step()
        self.heat.end_step()
        if self.batch is not None:
            self.batch.end_step(self.heat.use_rate)
        self._predicted.clear()
        kept = {layer: self._layer_probs[layer] for layer in self._next_step if layer in self._layer_probs}
        self._layer_probs.clear()
        self._layer_probs.update(kept)  # next-step guesses rank evictions until their layer runs again
        self._pending_predictions.clear()
        self._ahead.clear()

    # -- internals ------------------------------------------------------------------------------
    def _unpin(self, plan: BlockPlan) -> None:
        for slot in plan.slots.values():
            slot.free = self.loader.mark_free(slot.free)
            slot.pins -= 1
        plan.slots.clear()
        plan.loading.clear()
        plan.pending.clear()

    def _issue(self, plan: BlockPlan, at_least_one: bool = False) -> None:
        """Issue the block's pending misses, in order, while fewer than its depth are in flight."""
        while plan.pending and (at_least_one or len(plan.loading) < self._depth[plan.layer]):
            e = plan.pending[0]
            slot = self._load((plan.layer, e), staged=False)
            if slot is None:
                return  # every slot is pinned by this block: the next release makes room
            plan.pending.popleft()
            slot.pins += 1
            plan.slots[e] = slot
            plan.loading.add(e)
            at_least_one = False

    def layers_until(self, layer: int) -> int:
        """Layers from now until `layer`'s block runs again (1..L); layers run in order each step."""
        n = len(self.layers)
        d = (layer - self._last_layer) % n
        return d if d > 0 else n

    def expected_distance(self, key: Key, probability: float | None = None) -> float:
        """Expected distance to the next use of `key`, in layers. Its layer runs again in `d` layers
        and uses it with probability q, else a step (L layers) later with probability p (its recent
        use rate), and so on: E = d + L·(1 − q) / p. q is `probability` if given, else the predictor's
        latest guess for that layer when there is one (this step, layer not yet run), else p."""
        p = max(float(self.heat.use_rate[key[0]][key[1]]), 1e-3)
        if probability is None:
            guesses = self._layer_probs.get(key[0])
            probability = p if guesses is None else guesses[key[1]]
        return _expected_distance(self.layers_until(key[0]), len(self.layers), p, probability)

    def keep_values(self, keys: Sequence[Key]) -> list[float] | np.ndarray:
        """How much keeping each resident expert is worth: 1 / `expected_distance`. The least valuable
        expert is the best victim (Belady's rule with the future replaced by that expectation).
        Batched: a victim search ranks every unpinned slot (hundreds with fine-grained experts), so
        from 32 keys on it runs in NumPy (float64, the same arithmetic as the loop, so the same values)."""
        L = len(self.layers)
        if len(keys) >= 32:
            return self._keep_values_np(keys)
        per_layer: dict[int, tuple] = {}
        out = []
        for layer, e in keys:
            known = per_layer.get(layer)
            if known is None:
                guesses = self._layer_probs.get(layer)
                known = per_layer[layer] = (self.layers_until(layer), self.heat.use_rate[layer].tolist(), guesses)
            d, rates, guesses = known
            p = rates[e] if rates[e] > 1e-3 else 1e-3
            q = p if guesses is None else guesses[e]
            out.append(p / (d * p + L * (1 - q)))  # 1 / _expected_distance(d, L, p, q), inlined: hot loop
        return out

    def _keep_values_np(self, keys: Sequence[Key]) -> np.ndarray:
        n, L = len(keys), len(self.layers)
        pairs = np.fromiter(itertools.chain.from_iterable(keys), np.intp, 2 * n).reshape(n, 2)
        layers, experts = pairs[:, 0], pairs[:, 1]
        p = self.heat.use_rates(layers, experts).astype(np.float64)
        p[p <= 1e-3] = 1e-3
        q = p.copy()
        for layer, guesses in self._layer_probs.items():  # the layers with a guess: a few
            at = layers == layer
            if at.any():
                q[at] = np.asarray(guesses, dtype=np.float64)[experts[at]]
        d = (layers - self._last_layer) % L  # layers_until, for every key at once
        d[d == 0] = L
        return p / (d * p + L * (1 - q))

    def _load(
        self, key: Key, staged: bool, evict: bool = True, probability: float = 1.0, nbytes: int | None = None
    ) -> Slot | None:
        """Give `key` a slot and copy its record there (its first `nbytes` only: a speculative copy)."""
        # A guess may only displace an expert expected to be needed later than the guess itself
        # (Belady's rule on expected distances): when transfers are the bottleneck, evicting an expert
        # needed sooner costs the same transfer the guess might save.
        admit = None
        if staged:
            horizon = self.expected_distance(key, probability)
            admit = lambda k: self.expected_distance(k) > horizon  # noqa: E731
        slot, evicted = self.cache.allocate(key, staged, evict=evict, prefetch_may_evict=admit)
        if slot is None:
            return None
        if staged:
            self._staged.setdefault(key[0], []).append(slot)
        layer = key[0]
        stats = self.telemetry.layer(layer)
        if evicted is not None:
            ev_stats = self.telemetry.layer(evicted.key[0])
            ev_stats.evictions += 1
            if evicted.wasted_prefetch:
                ev_stats.prefetch_wasted += 1
                self.heat.feedback(*evicted.key, used=False)
        t0 = time.perf_counter()
        try:
            src = self.store.record(*key)
            n = src.numel() if nbytes is None else min(nbytes, src.numel())
            pinned = self.store.tier(layer) == "pinned"
            if self.placement == "dequant":
                staging, views = self._buffers["staging"][: src.numel()], self._slot_views(layer, slot)
                layout, dtype = self.store.layout(layer), self.store.dtype(layer)
                decode = lambda: self.store.codec.decode(staging, layout, dtype, out=views)  # noqa: E731
                slot.first_ready = None
                slot.ready = self.loader.copy(staging, src, pinned, after=slot.free, then=decode)
            else:
                self._copy_into(slot, src, 0, n, pinned, after=slot.free)
            slot.partial = n if n < src.numel() else 0
            if slot.partial:
                self._cut_short[key] = slot
        except Exception as exc:  # a CUDA OOM, a bad page in a memory-mapped file, an injected fault...
            self.cache.remove(key)
            raise LoaderError(
                f"loading expert {key[1]} of MoE layer {key[0]} to {self.device} failed: {exc}. "
                "The cache was left consistent; the next call loads it again."
            ) from exc
        if not self.loader.cuda and not staged:
            self.loader.add_stall(layer, time.perf_counter() - t0)
        stats.loads += 1
        stats.bytes_h2d += n
        if staged:
            stats.prefetches += 1
        if nbytes is not None:
            stats.speculated += 1
        return slot

    def _slot_views(self, layer: int, slot: Slot):
        """What the proxy computes with: typed views into the slot, or the packed record itself."""
        g = self.cache.pool_of_layer[layer]
        # keyed by layer too: layers sharing a pool (one record size) may lay their records out differently
        # (lossless: per-layer escape room; other shapes of the same size)
        key = (g, slot.index, layer)
        views = self._views.get(key)
        if views is None:
            record = self._arena[g][slot.index]
            if self.placement == "packed":
                layout = self.store.layout(layer)
                views = PackedWeights(
                    self.store.codec, record[: layout.nbytes], layout, self.store.dtype(layer), self._buffers.get("scratch")
                )
            else:
                views = IdentityCodec().decode(record, self.store.raw_layout(layer))
            self._views[key] = views
        return views

    # -- telemetry ------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters so far: hits, misses, hit_rate, loads, evictions, bytes_h2d, stall_s, per_layer, ..."""
        with self._lock:
            stalls = self.loader.stalls()
            for layer, s in stalls.items():
                self.telemetry.layer(layer).stall_s = s
            out = self.telemetry.summary()
            lat = sorted(self.loader.latencies())
            out.update(
                load_latency_p50_s=lat[len(lat) // 2] if lat else None,  # one copy, from issue to ready
                load_latency_p95_s=lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else None,
                budget_bytes=self.budget.budget_bytes,
                capacity_bytes=self.cache.capacity_bytes,
                buffer_bytes=self.buffer_bytes,
                resident_bytes=self.cache.resident_bytes,
                slots=sum(self.budget.n_slots.values()),
                device=str(self.device),
                quantization=self.quantization,
                placement=self.placement,
                host_only_experts=len(self.host_only),
                prediction_active=self.predicting,  # the predictor runs now (False without one, or paused by the payoff gate)
                prediction_paused_steps=self._gate.paused_steps,
            )
            return out

    @property
    def device_bytes(self) -> int:
        """Bytes the manager holds on the device: the slot arenas and the codec buffers (≤ budget_bytes)."""
        return sum(a.numel() for a in self._arena.values()) + self.buffer_bytes

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    def reset_stats(self) -> None:
        """Zero the counters (not the cache contents, heat scores or predictor state)."""
        with self._lock:
            self.loader.reset_stalls()
            self.telemetry.reset()
            self._gate.reset_stats()

    def set_host_only(self, experts: Mapping[int, Sequence[int]]) -> None:
        """Mark experts as host-only: `{layer: [expert, ...]}` (replaces the previous marking; `{}` clears
        it). A host-only expert is never prefetched and gives its slot back as soon as its block has used
        it, so it never holds a GPU slot between uses; it is still computed whenever the router picks it
        (outputs do not change). Meant for experts a calibration set never routes to
        (`mira_hf.calibrate(..., host_only_unused=True)`)."""
        keys = set()
        for layer, es in experts.items():
            li = self.layers.get(layer)
            bad = [e for e in es if li is None or not (isinstance(e, int) and 0 <= e < li.num_experts)]
            if li is None or bad:
                have = {L: info.num_experts for L, info in self.layers.items()}
                raise ConfigError(
                    f"set_host_only: layer {layer!r} experts {list(es)!r} do not exist in this model "
                    f"(MoE layer ordinal -> experts: {have}). Give {{layer: [expert indices]}}."
                )
            keys.update((layer, e) for e in es)
        with self._lock:
            self.host_only = frozenset(keys)
            for key in keys:
                slot = self.cache.lookup(key)
                if slot is not None and not slot.pins:
                    self.cache.remove(key)

    def save_predictor(self, directory: str) -> None:
        """Save the calibrated predictor (safetensors + JSON) so `MiraConfig(predictor_path=...)` loads it."""
        save = getattr(self.predictor, "save", None)
        if save is None:
            raise ConfigError(
                f"the active predictor ({getattr(self.predictor, 'name', None)!r}) has nothing to save: only a "
                "calibrated 'learned' predictor does. Run mira_hf.calibrate(model, data) first."
            )
        save(directory, self.fingerprint)

    def save_store(self, directory: str) -> None:
        """Save the (quantized) expert records so a later load with `MiraConfig(store_path=directory)`
        reads them instead of quantising again."""
        if not self.store.quantized:
            raise ConfigError("save_store() saves quantized records; this model moves experts uncompressed (quantization=None).")
        self.store.save(directory, self.fingerprint)

    def expert_counts(self) -> dict[int, list[int]]:
        """Activations per expert of each MoE layer since load (or `heat.reset()`)."""
        return {layer: c.tolist() for layer, c in self.heat.counts.items()}

    def heat_scores(self) -> dict[int, list[float]]:
        """Current heat score of each expert of each MoE layer, in [0, 1]."""
        return {layer: s.tolist() for layer, s in self.heat.scores.items()}

    def hit_rate_history(self) -> list[float]:
        """Hit rate of each forward step so far (bounded: the latest 4096 steps)."""
        return list(self.telemetry.hit_rate_history)

    def heat_table(self):
        """pandas DataFrame, one row per (layer, expert): heat score, activation count, resident tier."""
        from .report import heat_table

        return heat_table(self)

    def plot_heatmap(self, value: str = "score"):
        """matplotlib Figure: layer × expert heat map of `value` ("score" or "count")."""
        from .report import plot_heatmap

        return plot_heatmap(self, value=value)

    def plot_hit_rate(self):
        """matplotlib Figure: hit rate per forward step."""
        from .report import plot_hit_rate

        return plot_hit_rate(self)

    def tier_of(self, layer: int, expert: int) -> str | None:
        """ "hot" (on the device and used since its copy), "stage" (on the device or in flight, copied ahead of
        its use and not used yet) or None (not on the device). The same labels as `stats()`' `hot_hits` and
        `stage_hits`; the cache's eviction groups (`ExpertCache`) are its own business."""
        slot = self.cache.lookup((layer, expert))
        if slot is None:
            return None
        return "hot" if slot.used_since_load else "stage"

    def close(self) -> None:
        """Release the device arena (after unload)."""
        self.loader.synchronize()
        self._arena.clear()
        self._buffers.clear()
        self._views.clear()
