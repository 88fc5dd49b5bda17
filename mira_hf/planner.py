"""One device budget for serving: how many bytes go to expert slots and how many to KV-cache blocks.

A server with `total` bytes of device memory pays first for what does not move (the non-expert weights and
the activations of one forward step), then splits the rest between the expert cache and the paged KV cache.
More KV blocks let more sequences decode together (each step carries more tokens); more expert slots make each
step's experts more likely to be resident. The planner picks the split with the highest expected throughput:

    tokens/s(c) = c / (step_overhead_s + c · token_s + uses(c) · use_s
                       + misses(c) · (miss_s + record_bytes / link_bytes_per_s))

for c concurrent sequences (1 ≤ c ≤ the request mix's concurrency) whose whole context (prompt + completion,
in whole KV blocks) fits the KV part, with the rest of the memory as expert cache (at most every expert; what
is left beyond that goes back to the KV cache). use_s and miss_s are the host's work per expert use and per miss
(measured on the running model, `mira_hf.host_time`). misses(c) = uses(c) × (1 − hit rate), with uses(c) the
expert uses per step and the hit rate read from a `HitRateCurve`: measured by replaying a routing trace at each concurrency (`HitRateCurve.from_trace`, the
runtime's own cache and policy over the trace's requests), or, without a trace, the estimate for routing
spread evenly over the experts (`HitRateCurve.uniform`). Either part can be fixed by the caller; the planner
then gives the other what is left. Pure arithmetic: no torch, no device.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

from .errors import BudgetError, ConfigError

FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # budget shares a curve is measured at
CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r}: must be an integer ≥ 1.")


@dataclass(frozen=True)
class RequestMix:
    """What the server is expected to serve: tokens per prompt and per completion, and how many sequences should
    decode at once at most (the planner may choose fewer when memory is better spent on experts)."""

    prompt_tokens: int = 512
    new_tokens: int = 256
    concurrency: int = 32

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "new_tokens", "concurrency"):
            _positive_int(f"RequestMix.{name}", getattr(self, name))


@dataclass(frozen=True)
class StepCost:
    """Time model of one decode step (defaults: an H200 with pinned host memory; set from measurements).

    `use_s` and `miss_s` are the host's work per expert use (the proxy's loop and the manager's bookkeeping) and
    per missed expert (a victim search and a copy to issue), beside the link's time for its bytes: measured on the
    running model (`mira_hf.host_time`, `with_host_time`); 0 where not measured."""

    link_bytes_per_s: float = 50e9  # host-to-device copies of expert records
    step_overhead_s: float = 0.008  # per step whatever the batch: launches, non-expert weights, sampling
    token_s: float = 0.0002  # per token of the batch: attention over its context, expert compute
    use_s: float = 0.0  # host seconds per expert use (each distinct expert a layer's block needs)
    miss_s: float = 0.0  # host seconds per missed expert, beyond its bytes on the link

    def __post_init__(self) -> None:
        times = (self.step_overhead_s, self.token_s, self.use_s, self.miss_s)
        if not (self.link_bytes_per_s > 0 and min(times) >= 0):
            raise ConfigError(f"StepCost({self}): link_bytes_per_s must be > 0 and the times ≥ 0.")

    def step_s(self, concurrency: int, missed_bytes: float, uses: float = 0.0, misses: float = 0.0) -> float:
        """Seconds of one step of `concurrency` tokens with `uses` expert uses, `misses` of them missed, moving
        `missed_bytes` over the link."""
        host = uses * self.use_s + misses * self.miss_s
        return self.step_overhead_s + concurrency * self.token_s + host + missed_bytes / self.link_bytes_per_s

    def with_host_time(self, measured) -> StepCost:
        """This cost with the host terms of a `mira_hf.host_time.HostUseCost` (None: unchanged)."""
        if measured is None:
            return self
        return replace(self, use_s=measured.use_s, miss_s=measured.miss_s)


@dataclass(frozen=True)
class HitRateCurve:
    """Expert-cache hit rate against the cache's share of all expert bytes, per concurrency (tokens per step).

    points: concurrency -> ((share, hit rate), ...) in ascending share; uses_per_step: concurrency -> expert uses
    per step over all MoE layers (the distinct experts each layer's block needs, summed); source: where the
    numbers come from. Between measured concurrencies values are interpolated on a log scale; beyond the
    largest measured one the curve at that one is used (and uses grow at most to every expert)."""

    points: Mapping[int, tuple[tuple[float, float], ...]]
    uses_per_step: Mapping[int, float]
    source: str
    max_uses_per_step: float | None = None  # every expert of every layer: uses can grow no further

    def __post_init__(self) -> None:
        if not self.points or set(self.points) != set(self.uses_per_step):
            raise ConfigError("HitRateCurve: give points and uses_per_step for the same concurrencies (at least one).")
        for c, pts in self.points.items():
            shares = [s for s, _ in pts]
            if not pts or shares != sorted(shares) or any(not (0 <= h <= 1) for _, h in pts):
                raise ConfigError(
                    f"HitRateCurve: concurrency {c}: points must be (share, hit rate in [0, 1]) by ascending share."
                )

    def hit_rate(self, concurrency: int, share: float) -> float:
        return self._between(concurrency, lambda c: _interpolate(self.points[c], share))

    def uses(self, concurrency: int) -> float:
        largest = max(self.uses_per_step)
        if concurrency > largest:  # beyond the measurements: uses grow as the union of more tokens, up to every expert
            per_token = self.uses_per_step[min(self.uses_per_step)] / min(self.uses_per_step)
            grown = self.uses_per_step[largest] + (concurrency - largest) * per_token
            return min(grown, self.max_uses_per_step or grown)
        return self._between(concurrency, self.uses_per_step.__getitem__)

    def _between(self, concurrency: int, value) -> float:
        known = sorted(self.points)
        if concurrency <= known[0]:
            return value(known[0])
        if concurrency >= known[-1]:
            return value(known[-1])
        i = bisect.bisect_left(known, concurrency)
        lo, hi = known[i - 1], known[i]
        if hi == concurrency:
            return value(hi)
        t = (math.log(concurrency) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return (1 - t) * value(lo) + t * value(hi)

    @classmethod
    def from_trace(
        cls,
        trace,
        concurrencies: Sequence[int] = CONCURRENCIES,
        shares: Sequence[float] = FRACTIONS,
        policy: str = "heat",
    ) -> HitRateCurve:
        """Replay a `mira_hf.trace.RoutingTrace` (recorded from this model) through the runtime's cache at each
        concurrency and budget share (`mira_hf.replay.replay`, batch-aware ranking from concurrency 2 as served).
        Shares below the model's minimum working set are skipped; concurrencies beyond the trace's steps too."""
        from .replay import replay  # the replay module builds managers: imported only when a curve is measured

        points, uses = {}, {}
        for c in concurrencies:
            if c > trace.steps:
                continue
            row = []
            for share in shares:
                try:
                    r = replay(trace, budget=share, policy=policy, concurrency=c)
                except BudgetError:
                    continue  # below the minimum working set
                row.append((share, r["hit_rate"]))
                uses[c] = r["uses_per_step"]
            if row:
                points[c] = tuple(row)
        if not points:
            raise ConfigError(
                f"HitRateCurve.from_trace: the trace ({trace.steps} steps) gives no point at {list(concurrencies)}."
            )
        every = float(sum(trace.num_experts))
        return cls(points, uses, f"replay of a {trace.steps}-step routing trace ({policy} policy)", every)

    @classmethod
    def uniform(cls, num_experts: Sequence[int], top_k: int, concurrencies: Sequence[int] = CONCURRENCIES) -> HitRateCurve:
        """The estimate without a trace: routing spread evenly over the experts, where a cache holding a share s of
        the experts hits a share s of the uses; a step of c tokens uses E·(1 − (1 − K/E)^c) experts per layer."""
        points = {c: ((0.0, 0.0), (1.0, 1.0)) for c in concurrencies}
        uses = {c: sum(e * (1 - (1 - min(top_k, e) / e) ** c) for e in num_experts) for c in concurrencies}
        return cls(points, uses, "estimate for evenly spread routing (no routing trace)", float(sum(num_experts)))


def _interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1] * (x / xs[0] if xs[0] > 0 else 1.0)  # towards 0 hits at an empty cache
    if x >= xs[-1]:
        return points[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class ModelFootprint:
    """What the planner needs to know of the served model (bytes)."""

    weights_bytes: int  # non-expert weights and buffers on the device
    expert_bytes: int  # every routed expert, as the cache holds them (record bytes × experts)
    record_bytes: float  # one expert record (the mean over layers): what a miss moves
    min_expert_bytes: int  # the smallest cache the model can run with (top-k experts of a layer, codec buffers)
    kv_bytes_per_token: int  # K and V of one token over all layers
    page_tokens: int = 256  # tokens per KV block
    kv_overhead_per_token: int = 0  # other bytes that grow with the cache's tokens (attention masks, read buffers)
    activation_bytes: int = 0  # one forward step's activations at the step's token limit
    # The smallest expert cache that holds every routed expert on the device, where that is less than expert_bytes
    # (placement "mixed" keeps a few packed, decoded at each use: a cost the step model leaves out); 0: expert_bytes.
    all_fit_bytes: int = 0


@dataclass(frozen=True)
class MemoryPlan:
    """The split of `total_bytes`. Bytes; `concurrency`: sequences whose whole context fits the KV part."""

    total_bytes: int
    weights_bytes: int
    activation_bytes: int
    expert_cache_bytes: int
    kv_cache_bytes: int  # K and V only (what becomes KV blocks)
    kv_blocks: int
    concurrency: int
    expected_hit_rate: float
    expected_tokens_per_s: float
    curve_source: str
    fixed: tuple[str, ...] = ()  # the parts the caller set ("expert_cache", "kv_cache")
    candidates: tuple[dict, ...] = field(default=(), repr=False)  # every concurrency considered, with its numbers

    def as_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        from .report import format_bytes

        how = "as set" if self.fixed else "planned"
        return "\n".join(
            [
                f"device memory plan ({how}; {format_bytes(self.total_bytes)} in all):",
                f"  weights on the device   {format_bytes(self.weights_bytes)}",
                f"  activations (one step)  {format_bytes(self.activation_bytes)}",
                f"  expert cache            {format_bytes(self.expert_cache_bytes)}"
                + (" (fixed)" if "expert_cache" in self.fixed else ""),
                f"  KV cache                {format_bytes(self.kv_cache_bytes)}, {self.kv_blocks} blocks, "
                f"{self.concurrency} sequences at once" + (" (fixed)" if "kv_cache" in self.fixed else ""),
                f"  expected hit rate {self.expected_hit_rate:.1%}, ~{self.expected_tokens_per_s:.0f} tokens/s "
                f"(hit rates: {self.curve_source})",
            ]
        )


def plan_memory(
    total_bytes: int,
    model: ModelFootprint,
    mix: RequestMix,
    curve: HitRateCurve,
    cost: StepCost | None = None,
    expert_cache_bytes: int | None = None,
    kv_cache_bytes: int | None = None,
) -> MemoryPlan:
    """Split `total_bytes` (see the module docstring). `expert_cache_bytes` / `kv_cache_bytes` fix a part (the KV
    part as K and V bytes); the other gets the rest. Raises `BudgetError` when the weights, one step's activations,
    the smallest expert cache and one sequence's KV blocks do not fit, or fixed parts exceed the total."""
    cost = cost or StepCost()
    per_token = model.kv_bytes_per_token + model.kv_overhead_per_token  # what one cached token costs in all
    seq_tokens = -(-(mix.prompt_tokens + mix.new_tokens) // model.page_tokens) * model.page_tokens
    room = total_bytes - model.weights_bytes - model.activation_bytes
    one_seq = seq_tokens * per_token
    if room < model.min_expert_bytes + one_seq:
        parts = (
            f"the weights ({model.weights_bytes:,}), one step's activations ({model.activation_bytes:,}), the smallest "
            f"expert cache ({model.min_expert_bytes:,}) and one sequence's KV cache ({one_seq:,} for {seq_tokens} tokens)"
        )
        held = "holds the weights and one step's activations but not also" if room >= 0 else "cannot hold"
        raise BudgetError(
            f"device memory of {total_bytes:,} bytes {held} what it must: {parts}. Give at least "
            f"{total_bytes - room + model.min_expert_bytes + one_seq:,} bytes, or shorter requests."
        )
    fixed = tuple(n for n, v in (("expert_cache", expert_cache_bytes), ("kv_cache", kv_cache_bytes)) if v is not None)

    def kv_share(kv_bytes: int) -> int:  # K and V bytes of a KV part that also pays its per-token overhead
        return kv_bytes * model.kv_bytes_per_token // per_token

    all_fit = model.all_fit_bytes or model.expert_bytes  # past this, more expert cache holds nothing more

    def evaluate(c: int, experts: int, kv_total: int) -> dict:
        share = 1.0 if experts >= all_fit else experts / model.expert_bytes
        hit = curve.hit_rate(c, share)
        uses = curve.uses(c)
        misses = uses * (1 - hit)
        step_s = cost.step_s(c, misses * model.record_bytes, uses, misses)
        return dict(
            concurrency=c,
            expert_cache_bytes=experts,
            kv_bytes=kv_total,
            hit_rate=hit,
            step_s=step_s,
            tokens_per_s=c / step_s,
        )

    if expert_cache_bytes is not None or kv_cache_bytes is not None:
        if expert_cache_bytes is not None and kv_cache_bytes is not None:
            kv_total = kv_cache_bytes * per_token // model.kv_bytes_per_token
            experts = expert_cache_bytes
        elif expert_cache_bytes is not None:
            experts, kv_total = expert_cache_bytes, room - expert_cache_bytes
        else:
            kv_total = kv_cache_bytes * per_token // model.kv_bytes_per_token
            experts = min(room - kv_total, all_fit)
        if experts + kv_total > room or experts < model.min_expert_bytes or kv_total < one_seq:
            given = {"expert_cache": f"the expert cache given takes {expert_cache_bytes or 0:,}"}
            given["kv_cache"] = (
                f"the KV cache given takes {kv_total:,} with its per-token buffers ({kv_cache_bytes or 0:,} of K and V)"
            )
            taken = (expert_cache_bytes or 0) + (kv_total if kv_cache_bytes is not None else 0)
            other = "KV" if fixed[0] == "expert_cache" else "expert"
            rest = "" if len(fixed) == 2 or taken > room else f", leaving {room - taken:,} for the {other} cache"
            raise BudgetError(
                f"the parts given do not fit {total_bytes:,} bytes of device memory: after the weights and one step's "
                f"activations {room:,} are left for the expert cache (at least {model.min_expert_bytes:,}) and the KV cache "
                f"with its buffers (at least {one_seq:,}, one sequence); {' and '.join(given[n] for n in fixed)}{rest}. "
                "Give less to the parts fixed, or more device memory."
            )
        c = max(1, min(mix.concurrency, kv_total // one_seq))
        chosen, candidates = evaluate(c, experts, kv_total), ()
    else:
        candidates = []
        for c in range(1, mix.concurrency + 1):
            kv_total = c * one_seq
            experts = min(room - kv_total, all_fit)
            if experts < model.min_expert_bytes:
                break
            candidates.append(evaluate(c, experts, kv_total))
        # The highest throughput; among those within 1% of it, the most sequences (shorter queues for the same speed).
        best = max(r["tokens_per_s"] for r in candidates)
        chosen = max((r for r in candidates if r["tokens_per_s"] >= 0.99 * best), key=lambda r: r["concurrency"])
        chosen = dict(chosen, kv_bytes=room - chosen["expert_cache_bytes"])  # what experts cannot use goes to KV
        candidates = tuple(candidates)
    kv = kv_share(chosen["kv_bytes"])
    blocks = kv // (model.page_tokens * model.kv_bytes_per_token)
    concurrency = max(1, min(mix.concurrency, blocks * model.page_tokens // seq_tokens))
    chosen = evaluate(concurrency, chosen["expert_cache_bytes"], chosen["kv_bytes"])  # at the concurrency that fits
    return MemoryPlan(
        total_bytes=total_bytes,
        weights_bytes=model.weights_bytes,
        activation_bytes=model.activation_bytes,
        expert_cache_bytes=chosen["expert_cache_bytes"],
        kv_cache_bytes=blocks * model.page_tokens * model.kv_bytes_per_token,
        kv_blocks=blocks,
        concurrency=concurrency,
        expected_hit_rate=chosen["hit_rate"],
        expected_tokens_per_s=chosen["tokens_per_s"],
        curve_source=curve.source,
        fixed=fixed,
        candidates=candidates,
    )
