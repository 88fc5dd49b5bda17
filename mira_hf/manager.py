"""`ExpertManager`: the block protocol the proxies call and the forward-step lifecycle.

Per block call the proxy does `observe(layer, hidden, top_k_index)` (the block's routing, once,
before its host sync), `plan = begin(layer, experts)`, then for each expert in `plan.order`
(resident experts first, misses in the order their copies were issued) `acquire` → compute →
`release`, and finally `end(plan)`. A miss is copied into a slot as soon as one can be taken, so
copies overlap the compute of experts already resident. `prefetch` stages experts into STAGE slots
ahead of the router.

The manager composes the stages: the slot plan (`budget.BudgetPlan`), the device memory
(`arena.DeviceArena`), the cache and its eviction policy (`cache`, `policies`, built from the
registry), the copies (`loader`) and prediction-driven staging (`staging.Staging`); what it shows
(`stats()`, `tier_of`, the notebook views) comes from `report.NotebookViews`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .arena import DeviceArena
from .budget import BudgetPlan, LayerInfo, expert_keys
from .cache import ExpertCache, Key, Slot, SlotPool
from .config import chosen_quantizations
from .errors import ConcurrencyError, ConfigError, LoaderError, UnsupportedOperationError
from .heat import HeatTracker
from .host_compute import host_compute_for
from .loader import Loader
from .neuron_split import SplitWeights
from .normal_tensors import builds_normal_tensors
from .policies import ExpectedDistance, PolicyContext
from .registry import POLICIES
from .report import NotebookViews
from .settings import ManagerSettings
from .staging import Staging
from .store import ExpertStore
from .telemetry import Telemetry


@dataclass
class BlockPlan:
    """State of one block call: which experts, in which order, which copies are still to issue."""

    layer: int
    order: list[int]
    pending: deque = field(default_factory=deque)  # misses not yet given a slot
    slots: dict[int, Slot] = field(default_factory=dict)  # expert -> slot pinned by this plan
    loading: set[int] = field(default_factory=set)  # demand-loaded experts this plan still pins
    predictions: Mapping | None = None  # the predictor's guesses, staged once the block's own experts are in use
    host: list[int] = field(default_factory=list)  # misses computed on the host, not copied (host_compute)
    # host_compute="split": the experts whose host parts the host computes, and those copied to the device
    host_parts: list[int] = field(default_factory=list)
    parts_copied: list[int] = field(default_factory=list)
    ready: int = 0  # how many experts at the head of `order` were resident with their copies landed at `begin`
    kept: int = 0  # how many experts after those are kept packed beside the cache (placement "mixed")
    job: object = None  # the block's host job (host_compute.HostJob), started by `begin` where given its inputs


# What to do where expert parameters are placeholders that no change reaches (`ExpertManager.held_as_placeholders`).
PLACEHOLDERS_REMEDY = (
    "Write experts with model.load_state_dict(...) (which encodes them), or load the model with quantization=None (and "
    "host_compute other than 'split') to change them in place."
)


_BUSY = (
    "this model has been busy in another thread for 10 minutes; mira-hf runs one forward step at a time per model. "
    "Load one model per thread, or serialise your calls."
)


# Every manager of this process, and those whose bookkeeping lock a fork holds (`_before_fork`).
_MANAGERS: weakref.WeakSet[ExpertManager] = weakref.WeakSet()
_FORKING: list[ExpertManager] = []


def _before_fork() -> None:
    """Fork where no thread is inside a manager's bookkeeping (its `_lock`), so the child's copy is consistent."""
    _FORKING[:] = list(_MANAGERS)
    for manager in _FORKING:
        manager._lock.acquire()


def _after_fork_in_parent() -> None:
    for manager in _FORKING:
        manager._lock.release()
    _FORKING.clear()


def _after_fork_in_child() -> None:
    for manager in _FORKING:
        manager._forked()
    _FORKING.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


class ExpertManager(NotebookViews):
    """Shared by every proxy of one model (`model.mira`).

    `settings`: a `ManagerSettings` (default: its defaults); keywords given beside it replace single
    fields (`ExpertManager(store, layers, plan, device, policy="heat")`). `predictor`: what stages
    experts (None: demand loads only); `router_probs` and `fingerprint`: the wrapped model's routers
    and identity, kept for files and replays made from this model; `record_cache`: where its encoded
    records are cached (`mira_hf.record_cache.RecordCache`; None: not cached)."""

    def __init__(
        self,
        store: ExpertStore,
        layers: Sequence[LayerInfo],
        budget: BudgetPlan,
        device: torch.device,
        settings: ManagerSettings | None = None,
        *,
        predictor=None,
        router_probs=None,
        fingerprint: dict | None = None,
        record_cache=None,
        host_parts=None,
        **fields,
    ) -> None:
        settings = settings or ManagerSettings()
        if fields:
            settings = settings.replaced(**fields)
        self.settings = settings
        self.layers = {li.ordinal: li for li in layers}
        self.first_ordinal, self.last_ordinal = min(self.layers), max(self.layers)
        self.telemetry = Telemetry()
        self.heat = HeatTracker({li.ordinal: li.num_experts for li in layers}, settings.heat)
        self.predictor_config = settings.predictor_config
        # The stages it owns read it back weakly, so that a dropped manager is freed at once (`mira_hf.weak`).
        me = weakref.proxy(self)
        self.staging = Staging(me, predictor, settings.predictor_config)
        self.valuation = ExpectedDistance(self.heat, len(self.layers), lambda: me._last_layer, lambda: me.staging.layer_probs)
        self.steps_run = 0  # forward steps since wrapping: the policies' clock (`reset_stats` zeroes the telemetry's count)
        self._policy_context = PolicyContext(
            heat=self.heat,
            valuation=self.valuation,
            predicted=lambda k: me.staging.predicted.get(k, 0.0),
            step=lambda: me.steps_run,
            cost=lambda k: me._cost[k[0]],
        )
        self.host_only: frozenset[Key] = frozenset()  # experts that never keep a slot (set_host_only)
        self.recorder = None  # optional callable(layer, hidden [T,H], top_k_index [T,K]): traces, calibration
        self.router_probs = router_probs  # (layer, hidden) -> [T, E] router probabilities of the wrapped model
        self._fingerprint: dict = fingerprint or {}  # as wrapped; `fingerprint` hashes the routers as they are now
        self.router_fields: Callable[[], dict] | None = None  # the routers' hash now (set by the model: targets.router_fields)
        self.quantization = settings.quantization
        self.record_cache = record_cache  # the RecordCache the records were read from or written to (None: off)
        self.batch = None  # mira_hf.batching.BatchUsage once enabled (serving): batch-aware use rates
        self._batch_index = None  # the routing `observe` saw last, for `batch` in `begin`
        self._lock = threading.RLock()
        self._last_layer = -1
        self._prompt = False  # this forward starts a sequence: its blocks of several tokens are a prompt's
        self._prompt_sequences = 1  # ... of this many sequences, each of the same number of tokens
        self._prompt_index: torch.Tensor | None = None  # a prompt's block's routing [T, K] `observe` saw last
        self._tail: tuple[BlockPlan, Sequence[int]] | None = None  # the last block's deferred `end` (see `end`)
        self.host = host_compute_for(settings.host_compute, host_parts)  # misses computed on the host (host_compute.py)
        # The experts as whole tensors (parameters, state dict, casts): the store, or with host parts (neuron_split)
        # the store's device parts joined to them.
        self.whole = store if host_parts is None else SplitWeights(store, host_parts)
        self._place(store, budget, device)
        # (layers, quick) -> None: the expert parameters' check (`ExpertState.edited`, set by the model), run by every
        # block (`begin`): in full where no step hook entered, quick within a step the hook checked in full
        self.step_check: Callable[..., None] | None = None
        self.closed = False  # unloaded (`close`)
        self._forward_lock = threading.Lock()  # one forward step at a time (see enter_forward)
        self._forward_owner: int | None = None
        self._step_running: Callable[[int], bool] | None = None  # (thread) -> whether the open step still runs
        _MANAGERS.add(self)

    @builds_normal_tensors
    def _place(self, store: ExpertStore, budget: BudgetPlan, device: torch.device) -> None:
        """Build everything that depends on the records, the slot plan and the device: the loader, the
        arena and an empty cache (`__init__`, and `relocate` after a cast, a move, a `load_state_dict` or an edit).
        Normal tensors whatever the caller's mode: a relocate reached inside `torch.inference_mode()` builds slots
        that later forwards outside it write."""
        s = self.settings
        self.store, self.budget, self.device = store, budget, device
        self.placement = budget.placement  # how a slot holds an expert (BudgetPlan.placement)
        # Demand copies a block keeps in flight (see CacheConfig.demand_inflight_bytes): ≥ 2 per layer.
        self._depth = {layer: max(2, -(-s.demand_inflight_bytes // store.record_bytes(layer))) for layer in self.layers}
        old, self.loader = getattr(self, "loader", None), Loader(device, s.ring_bytes, timeout_s=s.copy_timeout_s)
        if old is not None:  # relocate: the stalls and copy latencies so far are counters, which only reset_stats() resets
            self.loader.carry(old)
        self.staging.place(device, budget.slot_placement)
        self._staged: dict[int, list[Slot]] = {}  # layer -> slots given to its prefetches since its last block
        self._cost = budget.reload_costs(store, self.layers)  # the eviction policies' `cost` of each layer
        make_policy = POLICIES.get(s.policy).factory
        pools = {
            g: SlotPool(budget.slot_bytes[g], n, int(n * s.stage_fraction), make_policy(self._policy_context, s))
            for g, n in budget.n_slots.items()
        }
        self.arena = DeviceArena(store, budget, device, self.loader, s.split_copies, s.split_min_bytes)
        self.cache = ExpertCache(pools, budget.pool_of_layer)
        self.host.place(store, self.layers, device)
        self.loader.time_link = self.host.active and self.loader.cuda  # the planner's link speed, from the copies

    def relocate(self, store: ExpertStore, budget: BudgetPlan, device: torch.device) -> None:
        """Serve from `store` (e.g. re-encoded by a cast, or rewritten by `load_state_dict`) with slots
        planned by `budget` on `device` (the model moved there). Every copy in flight finishes first; the
        cache starts empty (what it held is stale or elsewhere). Counters, heat and the predictor stay."""
        with self._lock:
            self._settle()
            self.loader.synchronize()
            self.staging.drop_speculation()
            self.arena.close()
            self.staging.forget_ahead()
            self._place(store, budget, device)

    def experts_changed(self) -> None:
        """The expert weights changed in a way torch does not count (writes through `p.data`, as in
        `p.data.mul_(0.5)`, or into the store's memory): the cache, whose copies are stale, starts empty, so the next
        forward computes with the changed experts. Changes torch counts (`p.mul_(0.5)` under `no_grad`,
        `load_state_dict`) need no call: the next forward finds them. Where the store holds the experts encoded or
        split with the host, their parameters are placeholders on the meta device that no write reaches: that raises
        `UnsupportedOperationError`, and `load_state_dict` is the way to change them."""
        held = self.held_as_placeholders
        if held is not None:
            raise UnsupportedOperationError(
                f"experts_changed(): the store holds the experts {held}, and their parameters are placeholders on the "
                f"meta device that no write reaches, so there is nothing new to copy. {self.placeholders_remedy}"
            )
        self.relocate(self.store, self.budget, self.device)

    @property
    def held_as_placeholders(self) -> str | None:
        """How the store holds experts whose parameters are placeholders on the meta device ("lossless-encoded",
        "split with the host", ...), or None where they are its records (uncompressed)."""
        if self.host.parts is not None:
            return "split with the host"
        return f"{self.store.codec.name}-encoded" if self.store.quantized else None

    @property
    def placeholders_remedy(self) -> str:
        """What to do to change experts whose parameters are placeholders (`held_as_placeholders`)."""
        codec = self.store.codec
        if not self.store.writable:
            return (
                f"The store holds the checkpoint's own {codec.name} bytes, into which no other values can be written: "
                f"to change experts, load the checkpoint dequantized (MiraMoEModel.from_pretrained(path, "
                f"quantization_config={codec.dequantized_config}): plain weights), or call model.unload()."
            )
        return PLACEHOLDERS_REMEDY

    @property
    def fingerprint(self) -> dict:
        """What identifies the wrapped model for the files made from it (predictors, stores; others' are refused):
        its shape, and a hash of its routers' weights as they are now (a `load_state_dict`, an edit or a cast since
        wrapping makes it another model's)."""
        return self._fingerprint if self.router_fields is None else {**self._fingerprint, **self.router_fields()}

    @property
    def kept(self) -> Mapping[Key, object]:
        """The experts kept packed beside the cache (placement "mixed"; `BudgetPlan.kept`), each to its
        `PackedWeights`: membership and `len` as of a set."""
        return self.arena.kept

    @property
    def predictor(self):
        """The predictor staging experts (None: demand loads only); settable (calibration swaps it)."""
        return self.staging.predictor

    @predictor.setter
    def predictor(self, predictor) -> None:
        self.staging.predictor = predictor

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

    def enter_forward(self, new_sequence: bool = False, sequences: int = 1, running: Callable[[int], bool] | None = None) -> None:
        """A forward step of the model starts (`new_sequence`: the first of `sequences` sequences, whose blocks are
        their prompts'). Steps are serialised: a second thread calling the same model waits for the first step to
        finish (steps of two generate calls interleave safely: the expert cache holds no per-sequence state).
        `running`: (thread) -> whether this step still runs in that thread (`step_hooks.running_in`), read by
        threads waiting for their turn (`_take_turn`)."""
        if self._forward_owner == threading.get_ident():
            # This thread's last step never ended: torch runs a forward hook marked `always_call` when the forward
            # raises an Exception, not a KeyboardInterrupt (Ctrl-C in a notebook). A model's forward does not run
            # inside itself, so that step is over: end it now rather than wait for it.
            self.exit_forward()
        self._take_turn()
        if self.closed:  # unloaded while this step waited for its turn: the model runs as the unwrapped one
            self._forward_lock.release()
            return
        self._forward_owner, self._step_running = threading.get_ident(), running
        with self._lock:
            self._settle()
            self._close_step()
            self._prompt, self._prompt_sequences = new_sequence, sequences
            if new_sequence:
                self.staging.new_sequence()

    @contextlib.contextmanager
    def turn(self):
        """Around every block call: one outside a forward step this thread entered (a compiled graph leaves the step
        hooks out, `mira_hf.ops`; a block called on its own, `model.model.layers[i].mlp(h)`) holds the model's forward
        lock while it runs, as a step does, so that another thread's step or block waits for it rather than
        interleave with it in the expert cache. Inside this thread's step it holds the lock already."""
        if self._forward_owner == threading.get_ident():
            yield
            return
        self._take_turn()
        try:
            if self.closed:
                raise UnsupportedOperationError(
                    "this MoE block's model was unloaded (model.unload()) while the call waited for its turn: its experts "
                    "module is back in the model. Call the block the model holds now."
                )
            yield
        finally:
            self._forward_lock.release()

    def _forked(self) -> None:
        """In the child of a fork, which has only the thread that forked: a lock another thread held (a step of a
        thread generating while another forked) would never be released there, and the child would hang at its
        first call. The locks start free, and a step (or a block called on its own) of another thread is dropped
        with what it held: its last block's deferred end and the pins of the block it was running."""
        self._lock = threading.RLock()
        if self._forward_owner == threading.get_ident():  # forked from inside this thread's own step: it goes on
            return
        self._forward_lock = threading.Lock()
        self._forward_owner = self._step_running = None
        self._tail = None
        self.cache.unpin_all()

    def _take_turn(self) -> None:
        """Take the model's forward lock, waiting up to 10 minutes (`ConcurrencyError`). A step left open by a thread
        whose forward no longer runs (a KeyboardInterrupt skips the hooks that end a step; or the thread ended) is
        ended by the waiting thread, which then takes its turn, rather than wait for that thread's next call."""
        deadline = time.monotonic() + 600
        while not self._forward_lock.acquire(timeout=0.5):
            with self._lock:
                owner, running = self._forward_owner, self._step_running
                if owner is not None and owner != threading.get_ident() and running is not None and not running(owner):
                    self._end_step_of_owner()
            if time.monotonic() > deadline:
                raise ConcurrencyError(_BUSY)

    def exit_forward(self) -> None:
        """The forward step ended (normally or by an exception, KeyboardInterrupt included)."""
        if self._forward_owner != threading.get_ident():
            return  # this thread never entered (its enter_forward raised)
        with self._lock:
            if self._forward_owner == threading.get_ident():  # (not ended meanwhile by a waiting thread: `_take_turn`)
                self._end_step_of_owner()

    def _end_step_of_owner(self) -> None:
        """End the open step (with `_lock` held) and give the forward lock back."""
        try:
            try:
                self._settle()  # its copies may fail: the step still ends and the next may start
            finally:
                self._close_step()
        finally:
            self._forward_owner = self._step_running = None
            self._forward_lock.release()

    def _prompt_shares(self, layer: int, experts: Sequence[int], index: torch.Tensor) -> tuple[list[float], int]:
        """(each of `experts`' share of a prompt's block `index` [T, K], the tokens of one of its sequences): of one
        sequence, its rows over the tokens; of B sequences of P tokens each, the chance that a step of B tokens, one
        from each, uses it (1 - Π_b (1 - share in b)), which is what a decode step's use measures."""
        T = index.shape[0]
        B = self._prompt_sequences if T % self._prompt_sequences == 0 else 1
        P, E = T // B, len(self.heat.scores[layer]) + 1  # the EP sentinel's index is the layer's expert count
        seq = torch.arange(B, device=index.device).repeat_interleave(P * index.shape[1])  # [T*K] each row's sequence
        counts = torch.bincount(seq * E + index.reshape(-1), minlength=B * E).view(B, E)[:, list(experts)].cpu()
        shares = counts[0].double() / P if B == 1 else 1 - (1 - counts.double() / P).prod(0)
        return shares.tolist(), P

    def _close_step(self) -> None:
        """End the open step, if a block ran in it."""
        if self._last_layer >= 0:
            self._end_step()
        self._last_layer = -1

    def _end_step(self) -> None:
        self.steps_run += 1
        self._prompt = False
        self.staging.end_step(self.loader.stall_total())
        self.telemetry.end_step()
        self.heat.end_step()
        if self.batch is not None:
            self.batch.end_step(self.heat.use_rate)

    # -- the verbs ------------------------------------------------------------------------------
    def observe(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor) -> None:
        """The routing of `layer`'s block (hidden [T, H], top_k_index [T, K]), once per block call and
        before the block's host sync: traces and calibration (`recorder`) record it, and the predictor
        sees it and guesses later layers (on CUDA its device work and its copy to the host are then
        finished by that one sync). `begin` stages the guesses once the block's own copies are issued."""
        with self._lock:
            self._settle()
            if self.recorder is not None:
                self.recorder(layer, hidden, top_k_index)
            self.staging.observe(layer, hidden, top_k_index)
            self._prompt_index = top_k_index if self._prompt else None
            self.host.block(layer, hidden.shape[0], self.loader.stall_total)
            if self.batch is not None:
                self._batch_index = top_k_index

    def begin(
        self,
        layer: int,
        experts: Sequence[int],
        rows: Sequence[int] | None = None,
        inputs: Callable[[int], torch.Tensor] | None = None,
    ) -> BlockPlan:
        """Start a block call needing `experts` of `layer`: count hits and misses, pin what is
        resident and issue copies for misses while slots can be taken (the guesses `observe` made are
        staged by `end`, after this block's own copies). `rows`: each expert's rows (host compute: `plan.host`).
        `inputs(e)`: expert e's rows [n, H]; given with `rows`, the block's host work starts here (`plan.job`),
        before its copies are queued: the host's share of the block is on its path from the block's start,
        and queueing copies takes the driving thread a while (host_compute="split": once the block's misses are
        known and before the rest of its bookkeeping, its host parts placed against the copies it is about to queue)."""
        with self._lock:
            self._settle()
            if self.step_check is not None:
                # each block checks its own layer's expert parameters before it computes (`ExpertState.edited`): in
                # full in a step no forward hook entered (a compiled graph leaves them out; a block called on its
                # own), which checks nothing at its start; within a step the hook checked in full, only for a
                # parametrization standing in for the experts' tensors for one call (peft's LoRA on experts)
                self.step_check([layer], quick=self._forward_owner is not None)
            ahead = self.staging.take_ahead(layer)  # before a step boundary would clear it
            if layer <= self._last_layer and self._forward_owner is None:
                # no forward hook ends the step here (a compiled graph; a block called on its own): an earlier layer
                # starts the next one. Under a hook a layer may come again within its step (looped decoders).
                self._end_step()
            self._last_layer = layer
            plan = BlockPlan(layer, [], predictions=ahead)
            if self.loader.time_link:
                self.host.observe_link(self.loader.link_speed())
            ready, kept, in_flight, finishing, misses = [], [], [], [], []
            stage_hits = 0
            where, pinned = self.cache.pool(layer).where, plan.slots
            for e in experts:
                slot = where.get((layer, e))
                if slot is None:
                    (kept if (layer, e) in self.kept else misses).append(e)
                    continue
                pinned[e] = slot
                if slot.partial:  # a speculative copy cut short: the rest is a demand load (a miss)
                    finishing.append(e)
                    plan.loading.add(e)
                    continue
                # Labels (one meaning everywhere, `tier_of`): a "stage" hit is the first use of an expert
                # copied ahead of need, a miss the prediction avoided; a "hot" hit reuses a kept expert.
                if slot.prefetched and not slot.used_since_load:
                    stage_hits += 1  # for PayoffGate
                if slot.ready is not None and slot.ready.query():
                    slot.ready = slot.first_ready = None  # landed: its later readers need no wait (no CUDA call per hit)
                (in_flight if slot.ready is not None else ready).append(e)
            if self.host.parts is not None and rows is not None:  # split: before the rest of the block's bookkeeping
                self._start_parts(plan, experts, rows, inputs, copies=len(misses) + len(finishing))
            index = self._prompt_index
            if self._prompt and index is not None and index.shape[0] > 1 and self.heat.config.seed_from_prompt:
                self.heat.activate(layer, list(experts), *self._prompt_shares(layer, experts, index))  # the prompt's shares
            else:
                self.heat.activate(layer, list(experts))
            self.staging.block_started(layer, experts)
            if self.batch is not None:
                self.batch.observe(layer, experts, self._batch_index)
            self._expire_prefetches(layer)
            self.cache.pin(list(pinned.values()))
            stats = self.telemetry.layer(layer)
            stats.stage_hits += stage_hits
            stats.hot_hits += len(ready) + len(kept) + len(in_flight) - stage_hits
            stats.misses += len(misses) + len(finishing)
            self.staging.gate.count_block(stage_hits, len(misses) + len(finishing))
            self.telemetry.count_uses(len(experts) - len(misses) - len(finishing), len(experts))
            if self.host.active and misses and rows is not None:  # the misses the host finishes sooner: no copy, no slot
                misses, plan.host = self.host.split(layer, misses, dict(zip(experts, rows)), self.heat.use_rate[layer])
                stats.host_computed += len(plan.host)
            plan.order = ready + kept + in_flight + finishing + misses
            plan.ready, plan.kept = len(ready), len(kept)
            plan.pending.extend(misses)
            self.staging.drop_speculation(layer)  # guesses for this block that it does not use
            try:
                if plan.host and inputs is not None:  # whole misses on the host: computing while the copies are queued
                    plan.job = self.host.start(layer, plan.host, inputs)
                for e in finishing:
                    self._finish(plan.slots[e])
                self._issue(plan)
            except BaseException:
                self._unpin(plan)  # the caller never gets the plan, so it cannot end() it
                raise
            return plan

    def _start_parts(self, plan: BlockPlan, experts: Sequence[int], rows: Sequence[int], inputs, copies: int) -> None:
        """host_compute="split": place the block's host parts (`plan.host_parts` on the host, `plan.parts_copied`
        copied to the device) against the `copies` of its misses, which `begin` queues next, and start the
        host's job (`inputs` given)."""
        layer = plan.layer
        misses = [self.store.record_bytes(layer)] * copies  # a speculative copy cut short counted whole
        plan.parts_copied, plan.host_parts = self.host.place_parts(layer, list(experts), rows, misses)
        self.telemetry.layer(layer).parts_copied += len(plan.parts_copied)
        if plan.host_parts and inputs is not None:
            plan.job = self.host.start(layer, plan.host_parts, inputs)

    def acquire(self, plan: BlockPlan, expert: int, first_part: bool = False) -> dict[str, torch.Tensor]:
        """The device tensors of `expert`, once its copy is done (the compute stream waits on it). With
        `first_part`, once the tensors of its first matmul are in: the caller must `acquire_rest` before
        it reads any other tensor. An expert kept packed (placement "mixed") is its `PackedWeights`, at once."""
        with self._lock:
            slot = plan.slots.get(expert)
            if slot is None:
                packed = self.kept.get((plan.layer, expert))
                if packed is not None:
                    return packed
                self._issue(plan, at_least_one=True)  # misses are acquired in issue order: this is the next one
                slot = plan.slots[expert]
            if first_part and slot.first_ready is not None:
                self.loader.wait(slot.first_ready, plan.layer)
            else:
                slot.first_ready = None
                self.loader.wait(slot.ready, plan.layer)
            self._first_use_of_prefetch(plan.layer, expert, slot)
            self.cache.use(slot)
            return self.arena.views(plan.layer, slot)

    def acquire_group(self, plan: BlockPlan, experts: Sequence[int]) -> None:
        """`acquire` for experts that had landed at `begin` (`plan.order[:plan.ready]`) and are computed together
        from their pool's slots (`slot_views`): their uses are booked in order, nothing is waited for and no views
        are made (`weights` gives one expert's where needed)."""
        with self._lock:
            slots = [plan.slots[e] for e in experts]
            for e, slot in zip(experts, slots):
                self._first_use_of_prefetch(plan.layer, e, slot)
            self.cache.use_many(slots)

    def _first_use_of_prefetch(self, layer: int, expert: int, slot: Slot) -> None:
        """A prefetched expert's first use since its copy: counted, and its guess rewarded in the heat scores."""
        if slot.prefetched and not slot.used_since_load:
            self.telemetry.layer(layer).prefetch_used += 1
            self.heat.feedback(layer, expert, used=True)

    def weights(self, plan: BlockPlan, expert: int) -> dict[str, torch.Tensor]:
        """The device tensors of an acquired `expert` (what `acquire` returns)."""
        return self.arena.views(plan.layer, plan.slots[expert])

    def slot_views(self, layer: int) -> dict[str, torch.Tensor] | None:
        """`layer`'s tensors in every slot of its pool, [n_slots, ...] each (`DeviceArena.slab_views`), for
        computing many acquired experts in one grouped matmul (`plan.slots[e].index` is expert e's row); None
        where slots hold packed records."""
        return self.arena.slab_views(layer)

    def acquire_rest(self, plan: BlockPlan, expert: int) -> None:
        """After `acquire(..., first_part=True)`: the compute stream also waits for the rest of the record."""
        slot = plan.slots.get(expert)  # None: kept packed
        if slot is not None and slot.first_ready is not None:
            with self._lock:
                slot.first_ready = None
                self.loader.wait(slot.ready, plan.layer)

    def release(self, plan: BlockPlan, expert: int) -> None:
        """The block has enqueued its last read of `expert`: its slot may be reused after that."""
        if expert in plan.slots:  # not kept packed
            self.release_group(plan, [expert])

    def release_group(self, plan: BlockPlan, experts: Sequence[int]) -> None:
        """`release` for experts whose last reads were enqueued together (one grouped matmul): one device event
        marks all their slots free, and the block's pending misses are issued once, with all of them unpinned."""
        with self._lock:
            free = self.loader.mark_free()
            slots = [plan.slots.pop(e) for e in experts]
            for slot in slots:
                slot.free = free
            self.cache.pin(slots, by=-1)
            plan.loading.difference_update(experts)
            if self.host_only:
                for e, slot in zip(experts, slots):
                    if (plan.layer, e) in self.host_only and not slot.pins:
                        self.cache.remove((plan.layer, e))  # used and gone: its slot serves the cached experts
            self._issue(plan)

    def end(self, plan: BlockPlan, grouped: Sequence[int] = (), later: bool = False) -> None:
        """Unpin whatever the plan still holds (normal end, or an exception mid-block), then stage the predicted
        experts of later layers. Staging waits until now because, before the block's experts are used, its fresh
        demand loads still fill the STAGE tier; on CUDA the block's compute is queued, so these copies overlap it.

        `grouped`: experts the block computed together from their slots without `acquire_group` (all of its
        experts, resident at `begin`): their uses are booked first, as `acquire_group` and `release_group` would.
        `later`: within a forward step, all of this waits until the manager's next verb (the next block's
        `observe` or `begin`, or the step's end), so the host does it while the device runs the layers queued
        after the block instead of the device waiting for it; the manager does the same things in the same
        order, only later (a slot freed by this block is free once the device has run a little more)."""
        with self._lock:
            self._settle()
            if later and self._forward_owner == threading.get_ident():
                self.telemetry.blocks.stop()  # the block's host time so far; its tail's is added when it runs
                self._tail = (plan, grouped)
                return
            self._end(plan, grouped)
            self.telemetry.blocks.stop()  # the block's host time against its uses and misses (host_time.py)
            if self._forward_owner is None and plan.layer == self.last_ordinal:
                # a step no forward hook entered (a compiled graph leaves them out): its last MoE layer ends it,
                # as the hooks end theirs, rather than the next step's first block
                self._close_step()

    def _end(self, plan: BlockPlan, grouped: Sequence[int]) -> None:
        if grouped:
            self.acquire_group(plan, grouped)
            self.release_group(plan, grouped)
        self._unpin(plan)
        predictions, plan.predictions = plan.predictions, None
        self.staging.block_ended(plan.layer, predictions)

    def _settle(self) -> None:
        """Finish the last block's deferred `end` (see `end`), if any. Every verb that reads or changes the cache,
        the heat or the staging calls this first, under the lock. Only the thread running the forward step does:
        the slot-free events must follow the block's work on its thread's stream (another thread, such as a metrics
        reader, sees the counters as of the block before)."""
        if self._tail is None or self._forward_owner != threading.get_ident():
            return
        tail, self._tail = self._tail, None
        t0 = time.perf_counter()
        self._end(*tail)
        self.telemetry.blocks.extend(time.perf_counter() - t0)

    def prefetch(self, layer: int, experts: Sequence[int], probabilities: Sequence[float] | None = None) -> int:
        """Stage `experts` of `layer` (with their probabilities of use) into STAGE slots ahead of need;
        returns how many copies started. A guess never evicts a pinned or awaited expert, nor one
        expected to be needed sooner than the guess itself (nor a HOT one, under the lru and priority
        policies); it stops at the first expert that finds no slot."""
        with self._lock:
            self._settle()  # first: a deferred block end changes what the ranking reads (uses, guesses)
            started = 0
            with self.cache.ranking_once():  # nothing the ranking reads changes between the guesses
                for i, e in enumerate(experts):
                    if not self.wants((layer, e)):
                        continue
                    p = 1.0 if probabilities is None else probabilities[i]
                    slot = self._load((layer, e), staged=True, evict=self._warmed_up, probability=p)
                    if slot is None:
                        break
                    started += 1
            return started

    def prefetch_part(self, key: Key, probability: float, nbytes: int) -> Slot | None:
        """Stage the first `nbytes` of `key`'s record (a speculative copy, `Staging`): its block finishes
        the copy if it uses the expert; `drop_partial` frees the slot otherwise. None: no slot was free."""
        with self._lock:
            self._settle()
            return self._load(key, staged=True, evict=self._warmed_up, probability=probability, nbytes=nbytes)

    def wants(self, key: Key) -> bool:
        """Whether a copy of `key` ahead of need could help: not on the device (in a slot or kept packed), and not
        host-only."""
        return self.cache.lookup(key) is None and key not in self.host_only and key not in self.kept

    def wanted(self, layer: int) -> list[bool]:
        """`wants((layer, e))` for every expert e of `layer` at once, read from its pool's arrays (a guess list at a
        large batch names every expert of a layer, nearly all resident)."""
        out = np.ones(self.layers[layer].num_experts, bool)  # [E]
        t = self.cache.pool(layer).table
        out[t.expert[t.layer == layer]] = False
        if self.host_only:
            out[[e for at, e in self.host_only if at == layer]] = False
        out[list(self.budget.kept.get(layer, ()))] = False
        return out.tolist()

    def drop_partial(self, key: Key, slot: Slot) -> None:
        """Free `slot` if it still holds the unfinished speculative copy of `key` (unpinned): a wasted guess."""
        if self.cache.lookup(key) is not slot or not slot.partial or slot.pins:
            return  # evicted since, finished, or being finished by its block
        self.cache.remove(key)
        self.telemetry.layer(key[0]).prefetch_wasted += 1
        self.heat.feedback(*key, used=False)

    @property
    def _warmed_up(self) -> bool:
        """Past the first forward steps: before that, guesses only fill free slots (nothing is evicted)."""
        return self.steps_run >= self.settings.warmup_steps

    # -- internals ------------------------------------------------------------------------------
    def _finish(self, slot: Slot) -> None:
        """Copy the rest of a record whose speculative copy was cut short: its block needs it."""
        layer, expert = slot.key
        end, n = self.store.record_bytes(layer), slot.partial
        try:
            self.arena.copy_into(slot, n, end, self.store.tier(layer) == "pinned")
        except Exception as exc:  # the slot keeps its first bytes; the block's caller unpins it
            raise LoaderError(
                f"loading the rest of expert {expert} of MoE layer {layer} to {self.device} failed: {exc}. "
                "The cache was left consistent; the next call loads it again."
            ) from exc
        slot.partial = 0
        stats = self.telemetry.layer(layer)
        stats.bytes_h2d += end - n  # one load, counted when its copy started
        stats.speculated_used += 1

    def _expire_prefetches(self, layer: int) -> None:
        """This layer's block is running: its prefetches no longer wait (used ones are pinned now).
        Only slots given to a prefetch of this layer can be awaiting (`_staged`): no scan of the pool,
        which holds hundreds of slots with fine-grained experts."""
        for slot in self._staged.pop(layer, ()):
            if slot.key is not None and slot.key[0] == layer:
                slot.awaiting = False

    def _unpin(self, plan: BlockPlan) -> None:
        free = self.loader.mark_free() if plan.slots else None
        slots = list(plan.slots.values())
        for slot in slots:
            slot.free = free
        self.cache.pin(slots, by=-1)
        plan.slots.clear()
        plan.loading.clear()
        plan.pending.clear()

    def _issue(self, plan: BlockPlan, at_least_one: bool = False) -> None:
        """Issue the block's pending misses, in order, while fewer than its depth are in flight (their victims
        ranked once: nothing the ranking reads changes between them)."""
        if not plan.pending:
            return
        with self.cache.ranking_once():
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

    def _load(
        self, key: Key, staged: bool, evict: bool = True, probability: float = 1.0, nbytes: int | None = None
    ) -> Slot | None:
        """Give `key` a slot and copy its record there (its first `nbytes` only: a speculative copy)."""
        # A guess may only displace an expert expected to be needed later than the guess itself
        # (Belady's rule on expected distances): when transfers are the bottleneck, evicting an expert
        # needed sooner costs the same transfer the guess might save.
        admit = None
        if staged:
            horizon = self.valuation.expected_distance(key, probability)
            admit = lambda layers, experts: self.valuation.expected_distances(layers, experts) > horizon  # noqa: E731
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
            size = self.store.record_bytes(layer)
            n = size if nbytes is None else min(nbytes, size)
            self.arena.fill(slot, n, self.store.tier(layer) == "pinned")
            slot.partial = n if n < size else 0
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
        self.host.copy_issued(n)
        if staged:
            stats.prefetches += 1
        if nbytes is not None:
            stats.speculated += 1
        return slot

    @property
    def device_bytes(self) -> int:
        """Bytes the manager holds on the device: the slot arenas and the codec buffers (≤ budget_bytes)."""
        return self.arena.device_bytes

    def reset_stats(self) -> None:
        """Zero the counters (not the cache contents, heat scores or predictor state). Experts copied ahead of need
        and not yet used count as prefetches of the new window, whose first use or eviction it counts."""
        with self._lock:
            self._settle()
            self.loader.reset_stalls()
            self.telemetry.reset()
            for key in self.cache.resident():
                slot = self.cache.lookup(key)
                if slot.prefetched and not slot.used_since_load:
                    self.telemetry.layer(key[0]).prefetches += 1
            self.staging.gate.reset_stats()
            if self.batch is not None:
                self.batch.reset_check()

    def set_host_only(self, experts: Mapping[int, Sequence[int]]) -> None:
        """Mark experts as host-only: `{layer: [expert, ...]}` (replaces the previous marking; `{}` clears
        it). A host-only expert is never prefetched and gives its slot back as soon as its block has used
        it, so it never holds a GPU slot between uses; it is still computed whenever the router picks it
        (outputs do not change). Meant for experts a calibration set never routes to
        (`mira_hf.calibrate(..., host_only_unused=True)`)."""
        keys = expert_keys(self.layers, experts, "set_host_only")
        with self._lock:
            self._settle()
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
        if self.host.parts is not None:
            raise ConfigError(
                "save_store() saves whole experts' records, but with host_compute='split' the store holds each expert's "
                "device part only. Wrap the model without host_compute='split' to save its records."
            )
        if not self.store.quantized:
            formats = ", ".join(repr(q) for q in chosen_quantizations() if q not in ("auto", None))
            raise ConfigError(
                "save_store() saves encoded expert records, which a later load reads instead of encoding them again; "
                "this model keeps its experts uncompressed (quantization=None), as a load reads them from the checkpoint "
                f"itself: there is nothing to save. Wrap or load the model with quantization set to one of {formats} to save "
                "its records."
            )
        if not self.store.writable:  # a checkpoint's own format: a load serves the checkpoint's bytes, never a store
            raise ConfigError(
                f"save_store() saves records that a load encodes, but this model serves its checkpoint's own "
                f"{self.store.codec.name} bytes, which every load reads from the checkpoint itself: there is nothing to save."
            )
        if self.store.cast_in_place:
            raise ConfigError(
                f"save_store() saves records that a load of the model encodes, but the model was cast after loading and "
                f"its {self.store.codec.name} records kept their own dtype: they decode to it and are cast at every use. "
                "Save the store before the cast, or cast the model back first."
            )
        self.store.save(directory, self.fingerprint)

    def close(self) -> None:
        """Release the device arena (after unload): no slot is left, so no expert is on the device (`stats()`); the
        host worker thread ends. A step or block waiting for its turn then finds the model unloaded (`turn`)."""
        self.closed = True
        self.loader.synchronize()
        self.arena.close()
        self.cache = ExpertCache({}, {})
        self.host.close()
