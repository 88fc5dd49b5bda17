"""Prometheus metrics of a wrapped model (optional: `pip install "mira-hf[prometheus]"`).

    from prometheus_client import start_http_server
    from mira_hf.prometheus import register

    collector = register(model.mira, model_name="mixtral")   # the default registry
    start_http_server(9000)
    out = collector.track_generate(model, **inputs, max_new_tokens=64)   # or collector.record_tokens(n, seconds)

The collector reads `manager.stats()` on every scrape, so nothing is pushed from the decode loop. Counters
start again from zero after `model.mira.reset_stats()`; Prometheus' `rate()` treats that as a counter reset. A model
unloaded (`model.unload()`) or dropped leaves the registry with its metrics: the collector holds its manager weakly,
so a registry keeps no model alive, and a model loaded again may be registered under the same `model_name`.
"""

from __future__ import annotations

import threading
import time
import weakref

from .errors import ConfigError
from .report import optional_import

PROMETHEUS_EXTRA = "prometheus"


class MiraCollector:
    """A custom collector (`collect()` yields metric families) over one `ExpertManager`.

    Tokens per second comes from what the serving code reports, through `record_tokens(n, seconds)` or
    `track_generate(model, ...)`: the gauge shows the latest reported call; `mira_tokens_generated_total` and
    `mira_generation_seconds_total` give averages over any window with `rate()`.
    """

    def __init__(self, manager, model_name: str | None = None) -> None:
        self._core = optional_import("prometheus_client.core", PROMETHEUS_EXTRA, "MiraCollector")
        self._manager = weakref.ref(manager)
        self.model_name = model_name
        self._lock = threading.Lock()  # record_tokens (serving thread) and collect (HTTP thread) meet here
        self._tokens = 0
        self._seconds = 0.0
        self._last_tokens_per_s = 0.0

    @property
    def manager(self):
        """The `ExpertManager` this collector reads; None once its model is dropped."""
        return self._manager()

    @property
    def serving(self) -> bool:
        """Whether its model is still wrapped: neither dropped nor unloaded. A collector that is not exports nothing."""
        manager = self._manager()
        return manager is not None and not manager.closed

    def record_tokens(self, n: int, seconds: float) -> None:
        """Report that `n` tokens were generated in `seconds` of wall time."""
        if n < 0 or seconds < 0:
            raise ConfigError(f"record_tokens(n={n}, seconds={seconds}): both must be ≥ 0.")
        with self._lock:
            self._tokens += n
            self._seconds += seconds
            if seconds > 0:
                self._last_tokens_per_s = n / seconds

    def track_generate(self, model, *args, **kwargs):
        """`model.generate(*args, **kwargs)`, timed; its new tokens (all sequences) are recorded. Returns its output.
        An encoder-decoder's output holds the decoder's tokens only: a start token, then the new ones."""
        start = time.perf_counter()
        out = model.generate(*args, **kwargs)
        seconds = time.perf_counter() - start
        sequences = getattr(out, "sequences", out)
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            prompt_len = 1
        else:
            prompt = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
            prompt_len = prompt.shape[-1] if prompt is not None and hasattr(prompt, "shape") else 0
        self.record_tokens(sequences.shape[0] * max(sequences.shape[-1] - prompt_len, 0), seconds)
        return out

    def samples(self) -> list[tuple[str, str, str, list[str], list[tuple[list[str], float]]]]:
        """This model's metrics: (name, "gauge" or "counter", help, label names besides `model`, [(their values,
        value)]); none once its model is unloaded or dropped."""
        manager = self._manager()
        if manager is None or manager.closed:
            return []
        stats = manager.stats()
        with self._lock:
            tokens, seconds, last_rate = self._tokens, self._seconds, self._last_tokens_per_s
        per_layer = [([str(layer)], s["hit_rate"]) for layer, s in sorted(stats["per_layer"].items())]
        return [
            (
                "mira_hit_rate",
                "gauge",
                "Expert cache hits / expert uses since load or reset_stats().",
                [],
                [([], stats["hit_rate"])],
            ),
            (
                "mira_expert_hits",
                "counter",
                "Expert uses served from the device cache.",
                ["tier"],
                [(["hot"], stats["hot_hits"]), (["stage"], stats["stage_hits"])],
            ),
            ("mira_expert_misses", "counter", "Expert uses that needed a demand copy.", [], [([], stats["misses"])]),
            (
                "mira_expert_copies",
                "counter",
                "Expert copies issued to the device (demand and prefetch).",
                [],
                [([], stats["loads"])],
            ),
            ("mira_expert_evictions", "counter", "Experts evicted from the device cache.", [], [([], stats["evictions"])]),
            ("mira_h2d_bytes", "counter", "Bytes copied host to device for experts.", [], [([], stats["bytes_h2d"])]),
            ("mira_stall_seconds", "counter", "Seconds the compute waited for expert copies.", [], [([], stats["stall_s"])]),
            ("mira_forward_steps", "counter", "Forward steps (prefill or one decode step) seen.", [], [([], stats["steps"])]),
            ("mira_cache_capacity_bytes", "gauge", "Device bytes of the expert cache.", [], [([], stats["capacity_bytes"])]),
            (
                "mira_cache_resident_bytes",
                "gauge",
                "Device bytes of the expert cache holding an expert.",
                [],
                [([], stats["resident_bytes"])],
            ),
            (
                "mira_experts_kept_packed",
                "gauge",
                'Experts kept packed on the device beside the cache, decoded at each use (placement "mixed").',
                [],
                [([], stats["kept_packed_experts"])],
            ),
            ("mira_layer_hit_rate", "gauge", "Expert cache hit rate of one MoE layer.", ["layer"], per_layer),
            (
                "mira_tokens_generated",
                "counter",
                "Tokens generated, as reported by record_tokens/track_generate.",
                [],
                [([], tokens)],
            ),
            ("mira_generation_seconds", "counter", "Wall seconds of the generations reported.", [], [([], seconds)]),
            ("mira_tokens_per_second", "gauge", "Tokens per second of the latest reported generation.", [], [([], last_rate)]),
        ]

    def collect(self):
        """Called by the registry on every scrape (where this collector is registered on its own)."""
        return _families(self._core, [self])


def _families(core, collectors: list[MiraCollector]):
    """One metric family per name over `collectors`, each model's samples labelled with its `model_name` (no
    `model` label where there is one model without a name), as the text format wants: one TYPE line per name."""
    named = any(c.model_name for c in collectors)
    merged: dict[str, object] = {}
    for c in collectors:
        for name, kind, doc, labels, values in c.samples():
            family = merged.get(name)
            if family is None:
                make = core.GaugeMetricFamily if kind == "gauge" else core.CounterMetricFamily
                family = merged[name] = make(name, doc, labels=(["model"] if named else []) + labels)
            for label_values, value in values:
                family.add_metric(([c.model_name] if named else []) + label_values, value)
    yield from merged.values()


class _Models:
    """What `register` puts on a registry: the collectors of every model registered there, scraped as one."""

    def __init__(self) -> None:
        self._core = optional_import("prometheus_client.core", PROMETHEUS_EXTRA, "register()")
        self.collectors: list[MiraCollector] = []

    def add(self, collector: MiraCollector) -> None:
        self.collectors = [c for c in self.collectors if c.serving]  # unloaded or dropped models leave
        names = [c.model_name for c in self.collectors]
        if names and (not collector.model_name or None in names or collector.model_name in names):
            raise ConfigError(
                f"register(..., model_name={collector.model_name!r}): this registry already has the metrics of "
                f"model(s) named {names}. Give each model on one registry a distinct model_name (the `model` label of "
                "its samples), or give this one a registry of its own."
            )
        self.collectors.append(collector)

    def collect(self):
        return _families(self._core, [c for c in self.collectors if c.serving])


def register(manager, registry=None, model_name: str | None = None) -> MiraCollector:
    """Build a `MiraCollector` for `manager` (`model.mira`) and add its metrics to `registry` (default:
    prometheus_client's REGISTRY). Several models may share one registry, each with a distinct `model_name`: their
    samples then come in one family per metric, told apart by the `model` label."""
    collector = MiraCollector(manager, model_name=model_name)
    if registry is None:
        registry = optional_import("prometheus_client", PROMETHEUS_EXTRA, "register()").REGISTRY
    # kept on the registry itself, not in a table of this module's: a dropped registry takes its models' managers
    # (and their models) along in the same collection
    models = getattr(registry, "_mira_models", None)
    if models is None:
        models = _Models()
        models.add(collector)
        registry.register(models)
        registry._mira_models = models
    else:
        models.add(collector)
    return collector
