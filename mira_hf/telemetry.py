"""Counters of what the cache and loader did, per MoE layer, and the derived summary.

Definitions (kept everywhere): a *use* is one expert needed by one block call. It is a *hit* when the
expert is in HOT or STAGE (copy done or in flight) at that moment, a *miss* when a demand load must be
issued. `hit_rate = hits / (hits + misses)`. `bytes_h2d` counts every byte copied, prefetches included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .host_time import BlockClock


@dataclass
class LayerStats:
    hot_hits: int = 0
    stage_hits: int = 0
    misses: int = 0
    host_computed: int = 0  # misses computed on the host instead of copied (MiraConfig.host_compute); also misses
    parts_copied: int = 0  # host_compute="split": uses whose host part was copied and computed on the device
    loads: int = 0  # copies issued (demand + prefetch)
    prefetches: int = 0
    prefetch_used: int = 0  # prefetched experts used before eviction
    prefetch_wasted: int = 0  # prefetched experts evicted unused
    speculated: int = 0  # speculative copies (part of a likely next expert, into idle link time); also prefetches
    speculated_used: int = 0  # ... whose expert was used (the copy was finished) / the rest were dropped
    evictions: int = 0
    bytes_h2d: int = 0
    stall_s: float = 0.0

    @property
    def hits(self) -> int:
        return self.hot_hits + self.stage_hits

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        uses = self.hits + self.misses
        d.update(hits=self.hits, hit_rate=(self.hits / uses) if uses else 0.0)
        return d


@dataclass
class Telemetry:
    """Per-layer counters plus a bounded history of per-step hit rates (for plots)."""

    layers: dict[int, LayerStats] = field(default_factory=dict)
    steps: int = 0
    history_limit: int = 4096
    hit_rate_history: list[float] = field(default_factory=list)
    # (target layer, distance) -> [true positives, false positives, false negatives]
    predictions: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    blocks: BlockClock = field(default_factory=BlockClock)  # host time per block against its uses and misses
    _step_hits: int = 0
    _step_uses: int = 0

    def layer(self, layer: int) -> LayerStats:
        s = self.layers.get(layer)
        if s is None:
            s = self.layers[layer] = LayerStats()
        return s

    def count_uses(self, hits: int, uses: int) -> None:
        """A block call counted its `uses` experts, `hits` of them resident: its host time starts (`blocks`)."""
        self._step_hits += hits
        self._step_uses += uses
        self.blocks.start(uses, uses - hits)

    def count_prediction(self, layer: int, distance: int, tp: int, fp: int, fn: int) -> None:
        c = self.predictions.setdefault((layer, distance), [0, 0, 0])
        c[0] += tp
        c[1] += fp
        c[2] += fn

    def end_step(self) -> None:
        """Close one forward step: append its hit rate to the bounded history."""
        if self._step_uses:
            self.hit_rate_history.append(self._step_hits / self._step_uses)
            if len(self.hit_rate_history) > self.history_limit:
                del self.hit_rate_history[: len(self.hit_rate_history) - self.history_limit]
        self._step_hits = self._step_uses = 0
        self.steps += 1

    def summary(self) -> dict:
        total = LayerStats()
        for s in self.layers.values():
            for f in dataclasses.fields(LayerStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
        out = total.as_dict()
        out["steps"] = self.steps
        out["per_layer"] = {layer: s.as_dict() for layer, s in sorted(self.layers.items())}
        tp = sum(c[0] for c in self.predictions.values())
        fp = sum(c[1] for c in self.predictions.values())
        fn = sum(c[2] for c in self.predictions.values())
        out["predictor_precision"] = tp / (tp + fp) if tp + fp else None
        out["predictor_recall"] = tp / (tp + fn) if tp + fn else None
        for (layer, d), (tp, fp, fn) in sorted(self.predictions.items()):
            pl = out["per_layer"].setdefault(layer, LayerStats().as_dict())
            pl[f"recall@{d}"] = tp / (tp + fn) if tp + fn else None
            pl[f"precision@{d}"] = tp / (tp + fp) if tp + fp else None
        return out

    def reset(self) -> None:
        self.layers.clear()
        self.hit_rate_history.clear()
        self.predictions.clear()
        self.steps = self._step_hits = self._step_uses = 0
        self.blocks.reset()
