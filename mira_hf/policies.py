"""Eviction policies. Each ranks the resident experts of one slot pool; the cache asks for victims
and, when an expert is used, whether it may join HOT.

- `lru`: least recently used, the reactive baseline (every use joins HOT).
- `heat`: the adaptive cache: experts below the heat threshold go first, lowest score first; only
  experts at or above the threshold join HOT.
- `priority`: 0.6 · predicted probability of use soon + 0.3 · recency + 0.1 · transfer cost;
  the lowest score goes first, so predicted and costly experts are kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from .cache import Key
from .errors import ConfigError
from .heat import HeatTracker


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

    def demote(self, candidates: Iterable[Key]) -> Key | None:
        """Which HOT expert drops to STAGE when HOT is over its size (the same ranking as eviction)."""
        return self.victim(candidates)


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

    def __init__(self, heat: HeatTracker, keep_values: Callable[[list[Key]], list[float]] | None = None) -> None:
        super().__init__()
        self.heat = heat
        self.keep_values = keep_values or (lambda keys: [heat.score(*k) for k in keys])

    def admit_hot(self, key: Key) -> bool:
        return self.heat.is_hot(*key)

    def demote(self, candidates: Iterable[Key]) -> Key | None:
        # With one ranking the tiers are labels that no victim search depends on: the least recently
        # used HOT expert is relabelled, without ranking every slot again.
        return LRUPolicy.victim(self, candidates)

    def victim(self, candidates: Iterable[Key]) -> Key | None:
        keys = list(dict.fromkeys(candidates))
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
        if min(self.predicted_weight, self.recency_weight, self.cost_weight) < 0:
            raise ConfigError("PriorityConfig weights must be ≥ 0.")


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
