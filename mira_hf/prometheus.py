"""Prometheus metrics of a wrapped model (optional: `pip install "mira-hf[prometheus]"`).

    from prometheus_client import start_http_server
    from mira_hf.prometheus import register

    collector = register(model.mira, model_name="mixtral")   # the default registry
    start_http_server(9000)
    out = collector.track_generate(model, **inputs, max_new_tokens=64)   # or collector.record_tokens(n, seconds)

The collector reads `manager.stats()` on every scrape, so nothing is pushed from the decode loop. Counters
start again from zero after `model.mira.reset_stats()`; Prometheus' `rate()` treats that as a counter reset.
"""

from __future__ import annotations

import threading
import time

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
        self.manager = manager
        self._label_names = ["model"] if model_name else []
        self._label_values = [model_name] if model_name else []
        self._lock = threading.Lock()  # record_tokens (serving thread) and collect (HTTP thread) meet here
        self._tokens = 0
        self._seconds = 0.0
        self._last_tokens_per_s = 0.0

    def record_tokens(self, n: int, seconds: float) -> None:
        """Report that `n` tokens were generated in `seconds` of wall time."""
        if n < 0 or seconds < 0:
            raise ValueError(f"record_tokens(n={n}, seconds={seconds}): both must be ≥ 0.")
        with self._lock:
            self._tokens += n
            self._seconds += seconds
            if seconds > 0:
                self._last_tokens_per_s = n / seconds

    def track_generate(self, model, *args, **kwargs):
        """`model.generate(*args, **kwargs)`, timed; its new tokens (all sequences) are recorded. Returns its output."""
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        start = time.perf_counter()
        out = model.generate(*args, **kwargs)
        seconds = time.perf_counter() - start
        sequences = getattr(out, "sequences", out)
        prompt_len = input_ids.shape[-1] if input_ids is not None else 0
        self.record_tokens(sequences.shape[0] * max(sequences.shape[-1] - prompt_len, 0), seconds)
        return out

    def collect(self):
        """Called by the registry on every scrape."""
        core = self._core
        stats = self.manager.stats()
        with self._lock:
            tokens, seconds, last_rate = self._tokens, self._seconds, self._last_tokens_per_s
        names, values = self._label_names, self._label_values

        def gauge(name: str, doc: str, value: float, extra: dict[str, str] | None = None):
            family = core.GaugeMetricFamily(name, doc, labels=names + list(extra or {}))
            family.add_metric(values + list((extra or {}).values()), value)
            return family

        def counter(name: str, doc: str, value: float):
            family = core.CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        yield gauge("mira_hit_rate", "Expert cache hits / expert uses since load or reset_stats().", stats["hit_rate"])
        hits = core.CounterMetricFamily("mira_expert_hits", "Expert uses served from the device cache.", labels=names + ["tier"])
        hits.add_metric(values + ["hot"], stats["hot_hits"])
        hits.add_metric(values + ["stage"], stats["stage_hits"])
        yield hits
        yield counter("mira_expert_misses", "Expert uses that needed a demand copy.", stats["misses"])
        yield counter("mira_expert_copies", "Expert copies issued to the device (demand and prefetch).", stats["loads"])
        yield counter("mira_expert_evictions", "Experts evicted from the device cache.", stats["evictions"])
        yield counter("mira_h2d_bytes", "Bytes copied host to device for experts.", stats["bytes_h2d"])
        yield counter("mira_stall_seconds", "Seconds the compute waited for expert copies.", stats["stall_s"])
        yield counter("mira_forward_steps", "Forward steps (prefill or one decode step) seen.", stats["steps"])
        yield gauge("mira_cache_capacity_bytes", "Device bytes of the expert cache.", stats["capacity_bytes"])
        yield gauge("mira_cache_resident_bytes", "Device bytes of the expert cache holding an expert.", stats["resident_bytes"])
        yield gauge(
            "mira_experts_kept_packed",
            'Experts kept packed on the device beside the cache, decoded at each use (placement "mixed").',
            stats["kept_packed_experts"],
        )
        layer_rate = core.GaugeMetricFamily(
            "mira_layer_hit_rate", "Expert cache hit rate of one MoE layer.", labels=names + ["layer"]
        )
        for layer, s in sorted(stats["per_layer"].items()):
            layer_rate.add_metric(values + [str(layer)], s["hit_rate"])
        yield layer_rate
        yield counter("mira_tokens_generated", "Tokens generated, as reported by record_tokens/track_generate.", tokens)
        yield counter("mira_generation_seconds", "Wall seconds of the generations reported.", seconds)
        yield gauge("mira_tokens_per_second", "Tokens per second of the latest reported generation.", last_rate)


def register(manager, registry=None, model_name: str | None = None) -> MiraCollector:
    """Build a `MiraCollector` for `manager` (`model.mira`) and register it (default: prometheus_client's REGISTRY).
    Give each model a distinct `model_name` when several share one registry."""
    collector = MiraCollector(manager, model_name=model_name)
    if registry is None:
        registry = optional_import("prometheus_client", PROMETHEUS_EXTRA, "register()").REGISTRY
    registry.register(collector)
    return collector
