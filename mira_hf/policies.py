"""Eviction policies. Each ranks the resident experts of one slot pool; the cache asks for victims
and, when an expert is used, whether it may join HOT.

- `lru`: least recently used, the reactive baseline (every use joins HOT).
- `heat`: the adaptive cache: experts below the heat threshold go first, lowest score first; only
  experts at or above the threshold join HOT.
- `priority`: 0.6 · predicted probability of use soon + 0.3 · recency + 0.1 · transfer cost;
  the lowest score goes first, so predicted and costly experts are kept.

A policy sees the running model only through a `PolicyContext`: the heat tracker, the eviction
valuation (`ExpectedDistance`: how many layers until an expert is needed again), the predicted
probabilities, the step clock and each layer's reload cost. New policies register themselves by name
(`mira_hf.registry.register_policy`), as the built-ins at the end of this module do.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import numpy as np

from .cache import Key, SlotTable
from .errors import check_finite
from .heat import HeatTracker
from .registry import register_policy


class LRUPolicy:
    """Least recently used. A load counts as a use."""

    name = "lru"
    one_ranking = False

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def inserted(self, key: Key, staged: bool) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def used(self, key: Key) -> None:
        self._order.move_to_end(key)

    def removed(self, key: Key) -> None:
        self._order.pop(key, None)

    def admit_hot(self, key: Key) -> bool:
        return True

    def victim(self, candidates: Iterable[Key]) -> Key | None:
        allowed = set(candidates)
        for key in self._order:
            if key in allowed:
                return key
        return None

    def victim_slots(self, table: SlotTable, slots: np.ndarray) -> int:
        """`victim` on a pool's arrays: the slot among `slots` allocated or used longest ago."""
        return int(slots[table.stamp[slots].argmin()])

    def demote(self, candidates: AbstractSet[Key]) -> Key | None:
        """Which HOT expert drops to STAGE when HOT is over its size: the least recently used.
        `candidates` iterate least recently used first (the order this policy keeps for them)."""
        return next(iter(candidates), None)

    lru_demote = demote  # `demote` takes the least recently used: the cache may take it without asking


def _expected_distance(d: int, num_layers: int, p: float, q: float) -> float:
    """Layers until the next use of an expert whose layer runs in `d` layers and uses it with
    probability `q` this time and `p` (its use rate) each later step: d + L·(1 − q) / p."""
    return d + num_layers * (1 - q) / p


class ExpectedDistance:
    """Eviction valuation: the expected distance, in layers, to each expert's next use, and its inverse,
    how much keeping a resident expert is worth. Layers run in order each step; `last_layer()` is the
    MoE layer whose block ran last (-1 before the step's first), `guesses()` the predictor's latest
    [E] probabilities per layer (only layers with a guess)."""

    def __init__(
        self,
        heat: HeatTracker,
        num_layers: int,
        last_layer: Callable[[], int],
        guesses: Callable[[], Mapping[int, Sequence[float]]],
    ) -> None:
        self.heat, self.num_layers, self.last_layer, self.guesses = heat, num_layers, last_layer, guesses
        self._guess_arrays: dict[int, tuple[Sequence[float], np.ndarray]] = {}  # layer -> (its guesses, as an array)

    def layers_until(self, layer: int) -> int:
        """Layers from now until `layer`'s block runs again (1..L); layers run in order each step."""
        n = self.num_layers
        d = (layer - self.last_layer()) % n
        return d if d > 0 else n

    def expected_distance(self, key: Key, probability: float | None = None) -> float:
        """Expected distance to the next use of `key`, in layers. Its layer runs again in `d` layers
        and uses it with probability q, else a step (L layers) later with probability p (its recent
        use rate), and so on: E = d + L·(1 − q) / p. q is `probability` if given, else the predictor's
        latest guess for that layer when there is one (this step, layer not yet run), else p."""
        p = max(float(self.heat.use_rate[key[0]][key[1]]), 1e-3)
        if probability is None:
            guesses = self.guesses().get(key[0])
            probability = p if guesses is None else guesses[key[1]]
        return _expected_distance(self.layers_until(key[0]), self.num_layers, p, probability)

    def keep_values(self, keys: Sequence[Key]) -> list[float] | np.ndarray:
        """How much keeping each resident expert is worth: 1 / `expected_distance`. The least valuable
        expert is the best victim (Belady's rule with the future replaced by that expectation).
        Batched: a victim search ranks every unpinned slot (hundreds with fine-grained experts), so
        from 32 keys on it runs in NumPy (float64, the same arithmetic as the loop, so the same values)."""
        L = self.num_layers
        if len(keys) >= 32:
            return self._keep_values_np(keys)
        all_guesses = self.guesses()
        per_layer: dict[int, tuple] = {}
        out = []
        for layer, e in keys:
            known = per_layer.get(layer)
            if known is None:
                guesses = all_guesses.get(layer)
                known = per_layer[layer] = (self.layers_until(layer), self.heat.use_rate[layer].tolist(), guesses)
            d, rates, guesses = known
            p = rates[e] if rates[e] > 1e-3 else 1e-3
            q = p if guesses is None else guesses[e]
            out.append(p / (d * p + L * (1 - q)))  # 1 / _expected_distance(d, L, p, q), inlined: hot loop
        return out

    def _keep_values_np(self, keys: Sequence[Key]) -> np.ndarray:
        pairs = np.fromiter(itertools.chain.from_iterable(keys), np.intp, 2 * len(keys)).reshape(len(keys), 2)
        return self.keep_values_at(pairs[:, 0], pairs[:, 1])

    def keep_values_at(self, layers: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """`keep_values` of the experts (layers[i], experts[i]) ([n] integer arrays) -> [n] float64."""
        p, q, d = self._terms(layers, experts)
        return p / (d * p + self.num_layers * (1 - q))

    def expected_distances(self, layers: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """`expected_distance` (no probability given) of (layers[i], experts[i]) -> [n] float64, the same
        arithmetic in the same order, so the same values."""
        p, q, d = self._terms(layers, experts)
        return d + self.num_layers * (1 - q) / p

    def _terms(self, layers: np.ndarray, experts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per expert: its use rate p (floored at 1e-3), its layer's probability q of using it and the layers
        d until that layer runs (`expected_distance`'s terms), in float64 and intp."""
        L = self.num_layers
        p = self.heat.use_rates(layers, experts).astype(np.float64)  # [n]
        np.maximum(p, 1e-3, out=p)
        q = p.copy()
        for layer, guesses in self.guesses().items():  # the layers with a guess: a few
            at = layers == layer
            if at.any():
                q[at] = self._guess_array(layer, guesses)[experts[at]]
        d = (layers - self.last_layer()) % L  # layers_until, for every key at once
        d[d == 0] = L
        return p, q, d

    def _guess_array(self, layer: int, guesses: Sequence[float]) -> np.ndarray:
        """`guesses` (a layer's latest [E] list) as float64, converted once per list rather than per search."""
        known = self._guess_arrays.get(layer)
        if known is None or known[0] is not guesses:
            known = self._guess_arrays[layer] = (guesses, np.asarray(guesses, dtype=np.float64))
        return known[1]


@dataclass(frozen=True)
class PolicyContext:
    """What an eviction policy may read of the running model."""

    heat: HeatTracker  # activation counts, heat scores and use rates per expert
    valuation: ExpectedDistance  # layers until each expert's next use
    predicted: Callable[[Key], float]  # the predictor's latest probability that the expert is used this step
    step: Callable[[], int]  # forward steps so far
    cost: Callable[[Key], float]  # the expert's reload cost in [0, 1] (record size and host tier)


class HeatPolicy(LRUPolicy):
    """Evict the expert least worth keeping; HOT only at or above the heat threshold.

    The victim is the unpinned expert, HOT or STAGE alike (`one_ranking`), with the lowest
    `keep_values(keys)`: from the manager, 1 / the expected distance to its next use, in layers (its
    recent use rate, and the predictor's probability when its layer is predicted). Layers run in
    order every step, so an expert of the layer just computed is needed last; plain recency gets
    this backwards (the least recently used expert belongs to the layer that runs next). The HOT
    tier (heat ≥ threshold) labels the experts that matter lately; it no longer shields them from a
    victim search, since the ranking already weighs how often each is used."""

    name = "heat"
    one_ranking = True

    def __init__(
        self,
        heat: HeatTracker,
        keep_values: Callable[[list[Key]], Sequence[float]],
        keep_values_at: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
    ) -> None:
        super().__init__()
        self.heat = heat
        self.keep_values = keep_values
        self.keep_values_at = keep_values_at  # the same values from [n] layer and expert arrays
        if keep_values_at is None:
            self.victim_slots = None  # the cache then asks `victim` by keys

    def admit_hot(self, key: Key) -> bool:
        return self.heat.is_hot(*key)

    def victim_slots(self, table: SlotTable, slots: np.ndarray) -> int | None:
        """`victim` on a pool's arrays: the least `keep_values_at`, ties to the least recently used. Inside
        `ExpertCache.ranking_once` a slot's value is computed once (elementwise, so the same values)."""
        memo = table.ranked
        if memo is None:
            values = self.keep_values_at(table.layer[slots], table.expert[slots])  # [n]
        else:
            values = memo[slots]
            todo = np.isnan(values)
            if todo.any():
                at = slots[todo]
                memo[at] = self.keep_values_at(table.layer[at], table.expert[at])
                values = memo[slots]
        tied = slots[values == values.min()]
        return int(tied[0] if len(tied) == 1 else tied[table.stamp[tied].argmin()])

    # `demote` is LRU's: with one ranking the tiers are labels that no victim search depends on, so
    # the least recently used HOT expert is relabelled without ranking every slot again.

    def victim(self, candidates: Iterable[Key]) -> Key | None:
        keys = candidates if isinstance(candidates, list) else list(candidates)  # a repeat ties with itself
        if not keys:
            return None
        values = np.asarray(self.keep_values(keys))
        tied = np.flatnonzero(values == values.min())
        if len(tied) > 1:  # equal value: the least recently used of them
            tied_set = {keys[i] for i in tied}
            return next((k for k in self._order if k in tied_set), keys[tied[0]])
        return keys[tied[0]]


@dataclass(frozen=True)
class PriorityConfig:
    """Weights of the priority score (`policy="priority"`, `MiraConfig.priority`); each term is in [0, 1]
    and the expert with the lowest weighted sum is evicted."""

    predicted_weight: float = 0.6  # × the predictor's probability that the expert is used soon
    recency_weight: float = 0.3  # × 1 / (1 + forward steps since its last use)
    cost_weight: float = 0.1  # × its reload cost (record size, ×2 from a pageable store, ×4 from disk; scaled to [0, 1])

    def __post_init__(self) -> None:
        for name in ("predicted_weight", "recency_weight", "cost_weight"):
            check_finite(f"PriorityConfig.{name}", getattr(self, name), "≥ 0")


class PriorityPolicy(LRUPolicy):
    """Evict the expert least worth keeping: unlikely to be used soon, not used lately, cheap to reload."""

    name = "priority"

    def __init__(
        self,
        predicted: Callable[[Key], float],
        step: Callable[[], int],
        cost: Callable[[Key], float],
        config: PriorityConfig | None = None,
    ) -> None:
        super().__init__()
        self.predicted, self.step, self.cost = predicted, step, cost
        self.config = config or PriorityConfig()
        self._last_use: dict[Key, int] = {}

    def inserted(self, key: Key, staged: bool) -> None:
        super().inserted(key, staged)
        self._last_use[key] = self.step()

    def used(self, key: Key) -> None:
        super().used(key)
        self._last_use[key] = self.step()

    def removed(self, key: Key) -> None:
        super().removed(key)
        self._last_use.pop(key, None)

    def score(self, key: Key) -> float:
        c = self.config
        recency = 1.0 / (1.0 + self.step() - self._last_use.get(key, self.step()))
        return c.predicted_weight * self.predicted(key) + c.recency_weight * recency + c.cost_weight * self.cost(key)

    def victim(self, candidates: Iterable[Key]) -> Key | None:
        allowed = set(candidates)
        if not allowed:
            return None
        rank = {k: i for i, k in enumerate(self._order)}
        return min(allowed, key=lambda k: (self.score(k), rank.get(k, -1)))

    def demote(self, candidates: AbstractSet[Key]) -> Key | None:
        return self.victim(candidates)  # the HOT label drops by the same score as eviction


register_policy("lru", lambda context, settings: LRUPolicy())
register_policy(
    "heat",
    lambda context, settings: HeatPolicy(context.heat, context.valuation.keep_values, context.valuation.keep_values_at),
)
register_policy(
    "priority",
    lambda context, settings: PriorityPolicy(context.predicted, context.step, context.cost, settings.priority),
)
