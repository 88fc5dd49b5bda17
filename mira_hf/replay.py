"""Offline evaluation: replay a `RoutingTrace` through the runtime's cache, policies and predictors.

`replay` drives a real `ExpertManager` (the same cache, policy, predictor and telemetry code the
model runs) over a synthetic expert store whose records are tiny: slot counts come from the real
record sizes and the real budget, so hits, misses and loads are those of the real model, while the
arena costs a few kilobytes. `belady` is the bound: Belady's MIN on the same requests, the fewest
loads (bytes) any demand cache with those slots can achieve. `lru_reference` is an independent
LRU simulator that tests hold the manager to.

Requests, in order: step by step (one token), MoE layer by layer, the distinct experts of that block.
A block's experts are needed together: all of them are resident while the block computes.
With `concurrency=B` a step decodes B tokens at once, one from each of B streams (the trace cut into B
contiguous parts, as B sequences decoding together), and a block needs the union of their experts.
With `prompt_tokens=P` each sequence's first P tokens are its prompt, served as `generate` serves one: a forward
that starts the sequence, whose blocks need the union of the P tokens' experts at once; the counts (loads,
hits, bytes) are the decoding's, after each prompt, and the prompts' loads are reported beside them. With both,
the B streams' sequences must start together: B prompts are one forward (as batched `generate` runs them), rows
in stream order.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import time
from collections import OrderedDict, defaultdict
from collections.abc import Hashable, Iterator

import torch

from .batching import enable as enable_batch_aware
from .budget import BudgetPlan, LayerInfo, plan_budget
from .config import CacheConfig
from .cpu_threads import cpu_threads
from .errors import ConfigError
from .heat import HeatConfig
from .layout import ALIGN_BYTES
from .manager import ExpertManager
from .policies import PriorityConfig
from .predictors import Predictor, PredictorConfig, RouterProbs, build_predictor
from .registry import PREDICTORS
from .store import ExpertStore
from .trace import RoutingTrace

_TINY_RECORD_UNITS = 16  # the largest pool's synthetic record is 16 × 256 B; smaller pools keep their size ratio


def replay(
    trace: RoutingTrace,
    *,
    budget: float,
    policy: str = "lru",
    predictor: str | None = None,
    router_probs: RouterProbs | None = None,
    predictor_obj: Predictor | None = None,
    stage_fraction: float | None = None,
    predictor_config: PredictorConfig | None = None,
    heat: HeatConfig | None = None,
    priority: PriorityConfig | None = None,
    reset_predictor_per_sequence: bool = False,
    concurrency: int = 1,
    batch_aware: bool | None = None,
    prompt_tokens: int = 0,
) -> dict:
    """Replay `trace` through an `ExpertManager` holding `budget` (a fraction of all expert bytes).

    predictor: a name as in `MiraConfig.predictor` (None: demand loads only). "gate", "global" and
        "auto" need `router_probs` (a wrapped model's `model.mira.router_probs`); "learned" needs
        `predictor_obj` (a calibrated `mira_hf.learned.LearnedPredictor`).
    predictor_obj: a ready predictor (observe/predict/reset); overrides `predictor`. It is `reset()`
        first, so repeated replays with one object are independent.
    stage_fraction, predictor_config, heat, priority: as in `MiraConfig` (None: its defaults).
    reset_predictor_per_sequence: call `predictor.reset()` at each new sequence (a new KV cache).
        Off by default because the runtime never does: a served model keeps its cache, heat and
        predictor state from one `generate` to the next, and a new prompt is just a jump in routing.
        Only with concurrency 1.
    concurrency: tokens per step (B streams decoding together; see the module docstring).
    batch_aware: rank by batch-aware use estimates (`mira_hf.batching`, as the server does); None: when
        concurrency > 1.
    prompt_tokens: each sequence's first tokens served as its prompt (the module docstring); counts are then the
        decoding's (`prompt_loads`: the prompts' own). With concurrency B, the streams' sequences start together
        and B prompts are one forward (pass batch_aware=False for `generate`'s estimates rather than a server's).

    Returns counts in the telemetry's definitions (`misses` = uses whose expert was neither
    resident nor in flight: the stall-causing ones), `bytes_moved` = loads × real record bytes
    (prefetches included), per-token bytes, predictor recall/precision at 1 and 2 layers ahead
    (mean over the layers where defined, and per layer), and the configuration.
    """
    t0 = time.perf_counter()
    _check_concurrency(trace, concurrency)
    if reset_predictor_per_sequence and concurrency > 1:
        raise ConfigError(
            f"reset_predictor_per_sequence with concurrency={concurrency}: one predictor serves every stream, so a reset "
            "at one stream's new sequence would reset the others' too. Pass concurrency=1, or leave the reset off."
        )
    _check_prompts(prompt_tokens)
    layers = _layer_infos(trace)
    real = _real_plan(trace, layers, budget)
    tiny = _tiny_records(real)
    plan = BudgetPlan(
        sum(real.n_slots[g] * tiny[g] for g in real.n_slots), dict(real.pool_of_layer), dict(tiny), dict(real.n_slots)
    )
    store = ExpertStore()
    for li in layers:
        store.add_layer(
            li.ordinal, {"record": torch.zeros((li.num_experts, tiny[plan.pool_of_layer[li.ordinal]]), dtype=torch.uint8)}
        )

    cfg = predictor_config or PredictorConfig()
    stage_fraction = CacheConfig().stage_fraction if stage_fraction is None else stage_fraction
    needs_hidden = predictor_obj is not None or (predictor is not None and PREDICTORS.get(predictor).uses_hidden)
    if needs_hidden and (trace.hidden is None or trace.hidden.shape[0] != trace.steps):  # [steps, L, H] needed
        raise ConfigError(f"predictor {predictor!r} needs the trace's hidden states, but this trace has none.")
    if needs_hidden:
        _check_same_model(trace, layers, router_probs, predictor_obj)
    pred = _predictor(predictor, predictor_obj, layers, router_probs, cfg)
    manager = ExpertManager(
        store,
        layers,
        plan,
        torch.device("cpu"),
        policy=policy,
        stage_fraction=stage_fraction,
        heat=heat,
        priority=priority,
        predictor=pred,
        predictor_config=cfg,
    )

    if batch_aware or (batch_aware is None and concurrency > 1):
        enable_batch_aware(manager)
    with cpu_threads(1):  # every op here takes microseconds: OpenMP fork/join would cost more than it saves
        prompts = _drive(manager, trace, pred, reset_predictor_per_sequence, concurrency, prompt_tokens)

    stats = _minus(manager.stats(), prompts)
    steps = trace.steps // concurrency - prompts["steps"]
    loads = {layer: s["loads"] for layer, s in stats["per_layer"].items()}
    bytes_moved = sum(loads[li] * trace.record_bytes[li] for li in loads)
    uses = stats["hits"] + stats["misses"]
    per_layer = {}
    for layer, s in stats["per_layer"].items():
        row = {k: s[k] for k in ("hit_rate", "hits", "misses", "loads", "prefetches", "prefetch_used", "prefetch_wasted")}
        row.update({k: v for k, v in s.items() if k.startswith(("recall@", "precision@"))})
        per_layer[layer] = row
    out = dict(
        config=dict(
            budget=budget,
            policy=policy,
            predictor=getattr(pred, "name", None) if predictor_obj is not None else predictor,
            stage_fraction=stage_fraction,
            predictor_config=dataclasses.asdict(cfg),
            reset_predictor_per_sequence=reset_predictor_per_sequence,
            concurrency=concurrency,
            prompt_tokens=prompt_tokens,
            batch_aware=manager.batch is not None,
            slots=sum(real.n_slots.values()),
            stage_slots=sum(int(n * stage_fraction) for n in real.n_slots.values()),
            capacity_bytes=real.capacity_bytes,
        ),
        steps=steps,
        tokens=steps * concurrency,
        uses=uses,
        uses_per_step=uses / steps if steps else 0.0,
        hits=stats["hits"],
        stage_hits=stats["stage_hits"],
        misses=stats["misses"],
        hit_rate=stats["hits"] / uses if uses else 0.0,
        loads=stats["loads"],
        prefetches=stats["prefetches"],
        prefetch_used=stats["prefetch_used"],
        prefetch_wasted=stats["prefetch_wasted"],
        evictions=stats["evictions"],
        bytes_moved=bytes_moved,
        bytes_per_token=bytes_moved / (steps * concurrency) if steps else 0.0,
        prompt_loads=sum(prompts["loads"].values()),
        per_layer=per_layer,
        use_rate_decays=manager.heat.use_rate_decays(),  # the heat tracker's memory per layer at the end
        seconds=time.perf_counter() - t0,
    )
    for d in (1, 2):
        for what in ("recall", "precision"):
            values = [r[f"{what}@{d}"] for r in per_layer.values() if r.get(f"{what}@{d}") is not None]
            out[f"{what}@{d}"] = sum(values) / len(values) if values else None
    return out


def belady(trace: RoutingTrace, *, budget: float, concurrency: int = 1, prompt_tokens: int = 0) -> dict:
    """Belady's MIN on the trace's requests, per slot pool, with the slots `replay` would have:
    on a miss with no free slot, evict the resident expert used again farthest in the future (never
    one the current block needs). No demand cache with these slots moves fewer bytes. With `prompt_tokens`
    as `replay`'s: the prompts' blocks are requests too, and the decoding's misses are counted."""
    _check_concurrency(trace, concurrency)
    _check_prompts(prompt_tokens)
    layers = _layer_infos(trace)
    real = _real_plan(trace, layers, budget)
    blocks = [
        (step, layer, needed)
        for step, layer, needed, _ in _blocks(trace, tensors=False, concurrency=concurrency, prompt_tokens=prompt_tokens)
    ]
    prompts = _prompt_spans(trace, prompt_tokens, concurrency)
    for step, layer, needed in blocks:
        n = real.n_slots[real.pool_of_layer[layer]]
        if len(needed) > n and step not in prompts:  # a prompt's block streams the rest through, as at runtime
            raise ConfigError(f"a block of layer {layer} needs {len(needed)} experts but its pool has {n} slots.")
    misses = {li.ordinal: 0 for li in layers}
    misses.update(belady_misses(blocks, real.pool_of_layer, real.n_slots, uncounted=set(prompts)))
    return _demand_summary(trace, misses, sum(misses.values()), concurrency, prompt_tokens)


def belady_misses(
    blocks: list[tuple[int, int, list[int]]],
    pool_of_layer: dict,
    n_slots: dict,
    count_from: int = 0,
    uncounted: frozenset[int] | set[int] = frozenset(),
) -> dict[int, int]:
    """Misses per layer of Belady's MIN over `blocks` = (step, layer, distinct experts) in execution
    order, one cache of `n_slots[pool]` slots per pool (pools are independent). On a miss with the pool
    full, the resident expert used again farthest ahead is evicted, never one the current block needs;
    a block needing more experts than its pool has slots streams the rest through. Misses of steps
    before `count_from`, and of the steps in `uncounted`, are not counted (a prefill that only warms the cache)."""
    misses: dict[int, int] = defaultdict(int)
    for pool, slots in n_slots.items():
        mine = [b for b in blocks if pool_of_layer[b[1]] == pool]
        for layer, n in _belady_pool(mine, slots, count_from, uncounted).items():
            misses[layer] += n
    return dict(misses)


def _belady_pool(
    blocks: list[tuple[int, int, list[int]]], slots: int, count_from: int, uncounted: frozenset[int] | set[int] = frozenset()
) -> dict[int, int]:
    uses: dict[tuple[int, int], list[int]] = defaultdict(list)  # (layer, expert) -> block indices
    for b, (_, layer, experts) in enumerate(blocks):
        for e in experts:
            uses[(layer, e)].append(b)
    never = len(blocks)

    def next_use(key: tuple[int, int], b: int) -> int:
        u = uses[key]
        j = bisect.bisect_right(u, b)
        return u[j] if j < len(u) else never

    cache: dict[tuple[int, int], int] = {}  # resident key -> its next use
    heap: list[tuple[int, tuple[int, int]]] = []  # (-next use, key), stale entries skipped lazily
    misses: dict[int, int] = defaultdict(int)
    for b, (step, layer, experts) in enumerate(blocks):
        needed = {(layer, e) for e in experts}
        for key in needed & cache.keys():
            cache[key] = next_use(key, b)
            heapq.heappush(heap, (-cache[key], key))
        for key in sorted(needed - cache.keys()):
            if step >= count_from and step not in uncounted:
                misses[layer] += 1
            if len(cache) >= slots:
                held = []  # valid entries of experts this block needs: not evictable now
                victim = None
                while heap:
                    neg, candidate = heapq.heappop(heap)
                    if cache.get(candidate) != -neg:
                        continue  # stale
                    if candidate in needed:
                        held.append((neg, candidate))
                        continue
                    victim = candidate
                    del cache[victim]
                    break
                for entry in held:
                    heapq.heappush(heap, entry)
                if victim is None:
                    continue  # the block needs more experts than there are slots: this one streams through
            cache[key] = next_use(key, b)
            heapq.heappush(heap, (-cache[key], key))
    return misses


def lru_reference(trace: RoutingTrace, budget: float) -> dict:
    """An LRU demand cache simulated independently of the manager, with the manager's conventions:
    slots from `plan_budget`, one LRU order per pool, current-block experts never evicted, and after
    a block its resident experts count as used first, then the ones it loaded (the runtime's order)."""
    layers = _layer_infos(trace)
    real = _real_plan(trace, layers, budget)
    order: dict[Hashable, OrderedDict] = {g: OrderedDict() for g in real.n_slots}  # oldest first
    misses = {li.ordinal: 0 for li in layers}
    for _, layer, needed, _ in _blocks(trace, tensors=False):
        lru, n = order[real.pool_of_layer[layer]], real.n_slots[real.pool_of_layer[layer]]
        hits = [(layer, e) for e in needed if (layer, e) in lru]
        loads = [(layer, e) for e in needed if (layer, e) not in lru]
        misses[layer] += len(loads)
        block = set(hits) | set(loads)
        victims = [k for k in lru if k not in block][: max(0, len(lru) + len(loads) - n)]
        for k in victims:
            del lru[k]
        for k in hits + loads:
            lru[k] = None
            lru.move_to_end(k)
    return _demand_summary(trace, misses, sum(misses.values()))


def _drive(
    manager: ExpertManager,
    trace: RoutingTrace,
    pred: Predictor | None,
    reset_per_sequence: bool,
    concurrency: int = 1,
    prompt_tokens: int = 0,
) -> dict:
    """Feed every block of the trace to `manager` as the proxies do during decoding (a prompt's blocks as during a
    prefill). Returns what the prompts' forwards counted: each of `_COUNTERS` per layer, and their "steps"."""
    placeholder = torch.zeros((1, 1))  # predictors that ignore hidden states still need a [T, H] argument
    has_hidden = trace.hidden is not None and trace.hidden.shape[0] == trace.steps
    starts = set(trace.sequence_starts[1:]) if concurrency == 1 else set()
    spans = _prompt_spans(trace, prompt_tokens, concurrency)
    counted: dict = {"steps": sum(end - start for start, end in spans.items()), **{k: defaultdict(int) for k in _COUNTERS}}
    before = None
    for step, layer, needed, top_k_index in _blocks(trace, concurrency=concurrency, prompt_tokens=prompt_tokens):
        if layer == 0:  # one decode step = one forward of the model: the runtime's step hooks
            if step:
                manager.exit_forward()
                if before is not None:  # the prompt's forward ended: what it counted is not the decoding's
                    _add(counted, manager.stats(), before)
                    before = None
            if pred is not None and reset_per_sequence and step in starts:
                pred.reset()
            if step in spans:
                before = manager.stats()
            manager.enter_forward(new_sequence=step in spans, sequences=concurrency)
        if step in spans:  # the prompts' tokens
            tokens = _prompt_token_steps(trace, step, spans[step], concurrency)
            hidden = trace.hidden[tokens, layer] if has_hidden else placeholder.expand(len(tokens), 1)
        else:
            hidden = trace.hidden[_token_steps(trace, step, concurrency), layer] if has_hidden else placeholder
        manager.observe(layer, hidden, top_k_index)  # hidden [T, H], top_k_index [T, K]
        block = manager.begin(layer, needed)
        for e in block.order:
            manager.acquire(block, e)
            manager.release(block, e)
        manager.end(block)
    if trace.steps:
        manager.exit_forward()
        if before is not None:
            _add(counted, manager.stats(), before)
    return counted


_COUNTERS = ("loads", "hits", "hot_hits", "stage_hits", "misses", "prefetches", "prefetch_used", "prefetch_wasted", "evictions")


def _add(counted: dict, after: dict, before: dict) -> None:
    """Add the per-layer counters `after` minus `before` (two `manager.stats()`) to `counted`."""
    for layer, s in after["per_layer"].items():
        for k in _COUNTERS:
            counted[k][layer] += s[k] - before["per_layer"].get(layer, {}).get(k, 0)


def _minus(stats: dict, prompts: dict) -> dict:
    """`manager.stats()` without what the prompts' forwards counted (`_drive`'s return)."""
    out = dict(stats, per_layer={})
    for layer, s in stats["per_layer"].items():
        row = dict(s)
        for k in _COUNTERS:
            row[k] = s[k] - prompts[k][layer]
        uses = row["hits"] + row["misses"]
        row["hit_rate"] = row["hits"] / uses if uses else 0.0
        out["per_layer"][layer] = row
    for k in _COUNTERS:
        out[k] = stats[k] - sum(prompts[k].values())
    return out


# -- helpers --------------------------------------------------------------------------------------
def _layer_infos(trace: RoutingTrace) -> list[LayerInfo]:
    return [LayerInfo(layer, f"layer{layer}", trace.num_experts[layer], trace.top_k) for layer in range(trace.num_layers)]


def _real_plan(trace: RoutingTrace, layers: list[LayerInfo], budget: float) -> BudgetPlan:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
        raise ConfigError(f"budget={budget!r}: a fraction of all expert bytes in (0, 1].")
    record = {li.ordinal: trace.record_bytes[li.ordinal] for li in layers}
    return plan_budget(layers, record, int(budget * trace.expert_bytes))


def _tiny_records(real: BudgetPlan) -> dict[Hashable, int]:
    """A small record size per pool, keeping the pools' size ratio (the priority policy's cost term)."""
    largest = max(real.slot_bytes.values())
    return {g: ALIGN_BYTES * max(1, round(_TINY_RECORD_UNITS * b / largest)) for g, b in real.slot_bytes.items()}


def _predictor(name, obj, layers, router_probs, cfg) -> Predictor | None:
    if obj is not None:
        reset = getattr(obj, "reset", None)
        if reset is not None:
            reset()
        return obj
    if name is None:
        return None
    if PREDICTORS.get(name).needs_path:
        raise ConfigError(
            f"predictor={name!r} is replayed from a calibrated object: pass predictor_obj=LearnedPredictor(...) "
            "(e.g. mira_hf.calibrate's result)."
        )
    return build_predictor(name, layers, router_probs, cfg)


def _check_same_model(trace: RoutingTrace, layers: list[LayerInfo], router_probs, predictor_obj) -> None:
    """The routers or predictor given take the trace's hidden states and guess its layers' experts: each is applied
    to the first step's hidden state of every layer, and one of another model (another width, other layers or
    expert counts) is refused here rather than failing inside a matmul of the replay."""
    expected = {li.ordinal: li.num_experts for li in layers}
    for what, guess in (("router_probs", router_probs), ("predictor_obj", predictor_obj)):
        if guess is None:
            continue
        for i, li in enumerate(layers):
            hidden = trace.hidden[0, i][None]  # [1, H]
            try:
                if what == "router_probs":
                    width = guess.width(li.ordinal) if hasattr(guess, "width") else hidden.shape[1]  # a RouterTable's rows
                    if width != hidden.shape[1]:
                        raise RuntimeError(f"its routers take rows of width {width}")
                    out = guess(li.ordinal, hidden)
                    sizes = {} if out is None else {li.ordinal: out.shape[-1]}
                else:
                    sizes = {t: p.shape[-1] for t, p in dict(guess.predict(li.ordinal, hidden)).items()}
            except (RuntimeError, KeyError, IndexError) as exc:
                problem = f"cannot be applied to layer {li.ordinal}'s hidden states of width {hidden.shape[1]} ({exc})"
            else:
                wrong = {t: n for t, n in sizes.items() if expected.get(t) != n}
                if not wrong:
                    continue
                have = {t: expected.get(t) for t in wrong}
                problem = f"guesses {wrong} experts for layers where the trace has {have}"
            recorded = trace.fingerprint.get("model_type")
            raise ConfigError(
                f"{what} {problem[:300]}: it is another model's than the trace's. Pass the {what} of the model the trace "
                f"was recorded from{f' (a {recorded} model)' if recorded else ''}."
            )


def _check_concurrency(trace: RoutingTrace, concurrency: int) -> None:
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= max(trace.steps, 1):
        raise ConfigError(
            f"concurrency={concurrency!r}: give the tokens decoded per step, an int from 1 to the trace's {trace.steps} steps."
        )


def _check_prompts(prompt_tokens: int) -> None:
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 0:
        raise ConfigError(f"prompt_tokens={prompt_tokens!r}: give an int ≥ 1 (0: every token decoded one by one).")


def _prompt_spans(trace: RoutingTrace, prompt_tokens: int, concurrency: int = 1) -> dict[int, int]:
    """{(batch) step where sequences start: the step after their prompts} (a prompt is at most its sequence but its
    last token). With concurrency B, each of the B streams must have its sequences start at the same steps."""
    if not prompt_tokens:
        return {}
    part = trace.steps // concurrency
    per_stream = [[s - j * part for s in trace.sequence_starts if j * part <= s < (j + 1) * part] for j in range(concurrency)]
    starts = per_stream[0]
    if any(other != starts for other in per_stream) or not starts or starts[0] != 0:
        raise ConfigError(
            f"prompt_tokens={prompt_tokens} with concurrency={concurrency}: the trace's {concurrency} streams of {part} steps "
            "do not start their sequences at the same steps; prompts of a batch are one forward. Give sequences of one "
            "length (a multiple of the stream length), or concurrency=1."
        )
    ends = [*starts[1:], part]
    return {s: min(s + prompt_tokens, e - 1) for s, e in zip(starts, ends) if min(s + prompt_tokens, e - 1) > s}


def _prompt_token_steps(trace: RoutingTrace, start: int, end: int, concurrency: int) -> list[int]:
    """The trace steps of the prompts at batch steps [start, end): each stream's in turn (as a batch's rows)."""
    part = trace.steps // concurrency
    return [j * part + s for j in range(concurrency) for s in range(start, end)]


def _token_steps(trace: RoutingTrace, step: int, concurrency: int) -> list[int]:
    """The trace steps decoded together at batch step `step`: one from each of `concurrency` contiguous parts."""
    part = trace.steps // concurrency
    return [step + j * part for j in range(concurrency)]


def _blocks(
    trace: RoutingTrace, tensors: bool = True, concurrency: int = 1, prompt_tokens: int = 0
) -> Iterator[tuple[int, int, list[int], torch.Tensor | None]]:
    """(step, layer, distinct experts sorted, top_k_index [B, K] or None) of every block, in order (B = concurrency;
    padding of a token's row is kept as -1 in the index when B > 1). A prompt's block (`prompt_tokens`) is one per
    layer at its first step, with [P, K] (padding dropped)."""
    rows = trace.experts.tolist()  # one conversion, not one per block
    padded = bool((trace.experts < 0).any())
    spans = _prompt_spans(trace, prompt_tokens, concurrency)
    step = 0
    while step < trace.steps // concurrency:
        if step in spans:  # the prompts: one block per layer, each token's picks without padding
            tokens = _prompt_token_steps(trace, step, spans[step], concurrency)
            for layer in range(trace.num_layers):
                picks = [[e for e in rows[t][layer] if e >= 0] for t in tokens]
                needed = sorted({e for row in picks for e in row})
                index = torch.tensor([e for row in picks for e in row]).view(len(tokens), -1) if tensors else None
                yield step, layer, needed, index
            step = spans[step]
            continue
        if concurrency == 1:
            for layer, row in enumerate(rows[step]):
                if padded:
                    row = [e for e in row if e >= 0]
                yield step, layer, sorted(set(row)), torch.tensor([row]) if tensors else None
        else:
            together = [rows[s] for s in _token_steps(trace, step, concurrency)]
            for layer in range(trace.num_layers):
                picks = [per_layer[layer] for per_layer in together]  # [B][K]
                needed = sorted({e for row in picks for e in row if e >= 0})
                yield step, layer, needed, torch.tensor(picks) if tensors else None
        step += 1


def _demand_summary(
    trace: RoutingTrace, misses: dict[int, int], total: int, concurrency: int = 1, prompt_tokens: int = 0
) -> dict:
    spans = _prompt_spans(trace, prompt_tokens, concurrency)
    blocks = _blocks(trace, tensors=False, concurrency=concurrency, prompt_tokens=prompt_tokens)
    uses = sum(len(needed) for step, _, needed, _ in blocks if step not in spans)
    bytes_moved = sum(misses[layer] * trace.record_bytes[layer] for layer in misses)
    steps = (trace.steps if concurrency == 1 else trace.steps // concurrency) - sum(e - s for s, e in spans.items())
    return dict(
        steps=steps,
        uses=uses,
        misses=total,
        loads=total,
        hits=uses - total,
        hit_rate=(uses - total) / uses if uses else 0.0,
        bytes_moved=bytes_moved,
        bytes_per_token=bytes_moved / (steps * concurrency) if steps else 0.0,
        per_layer={layer: dict(misses=m) for layer, m in misses.items()},
    )
