"""The server's Prometheus metrics: mira-hf's expert-cache collector (`mira_hf.prometheus`) plus request counts
and latency, KV-cache blocks and queue depth of the batching manager, all in one registry per app."""

from __future__ import annotations

import threading

from ..report import optional_import
from . import memory

SERVE_EXTRA = "serve"


class ServeCollector:
    """Requests by endpoint and status, their wall seconds, requests in flight, and the batching manager's KV
    blocks and queue depth (read on every scrape)."""

    def __init__(self, cb_manager_of, model_name: str, plan_of=lambda: None) -> None:
        self._core = optional_import("prometheus_client.core", SERVE_EXTRA, "the /metrics endpoint")
        self._cb_manager_of = cb_manager_of  # () -> the ContinuousBatchingManager, or None before it exists
        self._model = model_name
        self._plan_of = plan_of  # () -> the device-memory plan (mira_hf.planner.MemoryPlan), or None
        self._lock = threading.Lock()  # request handlers (event loop) and scrapes meet here
        self._requests: dict[tuple[str, str], int] = {}
        self._seconds: dict[str, float] = {}
        self._in_flight = 0

    def started(self) -> None:
        with self._lock:
            self._in_flight += 1

    def finished(self, endpoint: str, status: int, seconds: float) -> None:
        with self._lock:
            self._in_flight -= 1
            key = (endpoint, str(status))
            self._requests[key] = self._requests.get(key, 0) + 1
            self._seconds[endpoint] = self._seconds.get(endpoint, 0.0) + seconds

    def collect(self):
        core = self._core
        with self._lock:
            requests, seconds, in_flight = dict(self._requests), dict(self._seconds), self._in_flight
        label = [self._model]
        family = core.CounterMetricFamily(
            "mira_serve_requests", "HTTP requests answered, by endpoint and status code.", labels=["model", "endpoint", "status"]
        )
        for (endpoint, status), n in sorted(requests.items()):
            family.add_metric(label + [endpoint, status], n)
        yield family
        family = core.CounterMetricFamily(
            "mira_serve_request_seconds", "Wall seconds from request to last byte, by endpoint.", labels=["model", "endpoint"]
        )
        for endpoint, s in sorted(seconds.items()):
            family.add_metric(label + [endpoint], s)
        yield family
        yield self._gauge("mira_serve_requests_in_flight", "Requests received and not yet answered in full.", in_flight)

        cb = self._cb_manager_of()
        kv = memory.kv_usage(cb) if cb is not None else None
        if kv is not None:
            yield self._gauge("mira_serve_kv_blocks", "Blocks of the paged KV cache.", kv["blocks_total"])
            if kv["blocks_used"] is not None:
                yield self._gauge(
                    "mira_serve_kv_blocks_used",
                    "Blocks of the paged KV cache not free: held by requests, or kept for prefix reuse.",
                    kv["blocks_used"],
                )
            yield self._gauge("mira_serve_kv_cache_bytes", "Bytes of the paged KV cache.", kv["bytes"])
            yield self._gauge("mira_serve_kv_block_tokens", "Tokens per KV block (all layers).", kv["tokens_per_block"])
        depth = memory.queue_depth(cb) if cb is not None else None
        if depth is not None:
            yield self._gauge("mira_serve_queue_waiting", "Requests queued for the batch, not yet started.", depth["waiting"])
            yield self._gauge("mira_serve_batch_active", "Requests in the running batch.", depth["active"])
        plan = self._plan_of()
        if plan is not None:
            family = self._core.GaugeMetricFamily(
                "mira_serve_plan_bytes",
                "The device-memory plan, by part: total, weights, activations, expert_cache, kv_cache.",
                labels=["model", "part"],
            )
            for part, value in (
                ("total", plan.total_bytes),
                ("weights", plan.weights_bytes),
                ("activations", plan.activation_bytes),
                ("expert_cache", plan.expert_cache_bytes),
                ("kv_cache", plan.kv_cache_bytes),
            ):
                family.add_metric([self._model, part], value)
            yield family
            yield self._gauge(
                "mira_serve_plan_concurrency", "Sequences whose whole context the planned KV cache holds.", plan.concurrency
            )
            yield self._gauge(
                "mira_serve_plan_expected_hit_rate", "Expert-cache hit rate the plan expects.", plan.expected_hit_rate
            )

    def _gauge(self, name: str, doc: str, value: float):
        family = self._core.GaugeMetricFamily(name, doc, labels=["model"])
        family.add_metric([self._model], value)
        return family


def build_registry(model, model_name: str, cb_manager_of, plan_of=lambda: None):
    """A fresh registry with mira-hf's collector (when the model is wrapped) and a `ServeCollector`.
    Returns `(registry, mira_collector or None, serve_collector)`."""
    prometheus_client = optional_import("prometheus_client", SERVE_EXTRA, "the /metrics endpoint")
    from ..prometheus import register

    registry = prometheus_client.CollectorRegistry()
    manager = getattr(model, "mira", None)
    mira = register(manager, registry=registry, model_name=model_name) if manager is not None else None
    serve = ServeCollector(cb_manager_of, model_name, plan_of)
    registry.register(serve)
    return registry, mira, serve
