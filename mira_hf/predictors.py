"""Expert predictors: guess which experts upcoming layers will route to, so they can be staged.

One interface: `observe(layer, hidden, top_k_index)` sees routing as it happens (the proxy calls it
for every block, before computing); `predict(layer, hidden)` returns `{target_layer: probs [E]}`
for layers ahead, each value the probability that the expert is used by at least one token of the
current step; a target at or before `layer` means that layer's routing at the *next* step (the
learned predictor's next-step head: such guesses rank evictions, and the first layer's are copied at
the end of a step). A wrong guess costs
bandwidth, never a token: the true expert is always computed.

- `gate`: the router of layer L+d applied to layer L's hidden state (no training); each expert's
  probability is how often the router's expert of that rank has been used, measured online
  (`RankCalibration`).
- `markov`: transition probabilities between experts of consecutive layers and consecutive tokens,
  learnt online, chained up to 3 layers ahead, candidates up to a cumulative probability of 0.8.
- `global`: at the first MoE layer of a step, one prediction for every layer (previous token's
  routing, combined with the routers applied to the new token's hidden state).
- `position`: each layer's recent expert frequency over a sliding window of tokens (long sequences).
- `hybrid`: `markov` for the first tokens of a sequence, `position` after.
- `learned`: a small trained network per layer (see `mira_hf.learned`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from .config import PredictorConfig  # defined beside the other configs; importable from here too
from .errors import ConfigError
from .registry import PREDICTORS, register_predictor

RouterProbs = Callable[[int, torch.Tensor], "torch.Tensor | None"]  # (layer, hidden [T,H]) -> [T,E] probabilities


class Predictor(Protocol):
    """`observe` and `predict` run before the block's host sync (on CUDA the routing is still on the device, and a
    read of it there would make the host wait for all the device's queued work, copies included); a predictor may
    also define `routed(layer)`, called once that block has synchronised, to read what it kept (`KeptRouting`).
    `predict` may return a mapping computed when first read: staging reads it after the sync."""

    name: str

    def observe(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor) -> None: ...
    def predict(self, layer: int, hidden: torch.Tensor) -> Mapping[int, torch.Tensor]: ...
    def reset(self) -> None: ...


def token_union(per_token: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T, E] per-token probabilities → [E] probability that some token uses the expert.
    Each token uses `top_k` experts, so an expert with share q of a token is used with ≈ min(1, k·q)."""
    if per_token.shape[0] == 1:  # a decode step: two kernels instead of five (launch-bound small models)
        return (per_token[0].float() * top_k).clamp_(0, 1)
    p = (per_token.float() * top_k).clamp_(0, 1)  # [T, E]
    return 1 - torch.prod(1 - p, dim=0)  # [E]


# Up to this many tokens per block (decode steps, small batches) the gate predictor scores on the host:
# fewer kernel launches than scoring on the device, whose launches cost more host time than scoring a
# few thousand numbers on the host does. Longer blocks (prefill) score on the device and copy [E] per target.
HOST_SCORING_TOKENS = 64


class RankCalibration:
    """How often the expert a router ranks r-th for its layer, applied `distance` layers early, is used by
    that layer's next block: measured online, so the gate's guesses are probabilities of use whatever the
    router (a softmax over 8 or 128 experts, DeepSeek-V3's sigmoid scores with a selection bias), its
    top-k and the distance. Ranks below 4·top-k are counted one by one, the rest together; before any
    decode step is seen every rank reads the chance rate top-k / E (weight `PRIOR_STEPS` steps), so an
    unmeasured guess is never staged. Measured on one-token blocks (decode steps); a block of T tokens
    reads the table per token and takes the union."""

    PRIOR_STEPS = 2.0

    def __init__(self, num_experts: int, top_k: int) -> None:
        self.num_experts, self.top_k = num_experts, top_k
        self.ranks = min(num_experts, 4 * top_k)  # ranks counted one by one; the rest share the last bucket
        self.used = np.zeros(self.ranks + 1)  # [R + 1] uses of the expert at each rank bucket
        self.seen = np.zeros(self.ranks + 1)  # [R + 1] guesses at each rank bucket
        rest = num_experts - self.ranks
        self._prior = np.full(self.ranks + 1, top_k / num_experts) * self.PRIOR_STEPS
        self._prior_seen = np.full(self.ranks + 1, self.PRIOR_STEPS)
        self._prior_seen[-1] *= max(rest, 1)
        self._prior[-1] *= max(rest, 1)
        self._pending: np.ndarray | None = None  # [E] rank bucket of each expert in the last decode guess
        self._bucket_of_rank = np.minimum(np.arange(num_experts), self.ranks)  # [E] rank -> its bucket
        self._seen_per_step = np.bincount(self._bucket_of_rank, minlength=self.ranks + 1).astype(np.float64)  # [R + 1]

    def probabilities(self, scores: torch.Tensor) -> torch.Tensor:
        """`scores` [T, E] (the router's selection scores for T tokens) -> [E] probability that some token
        uses the expert, from the measured use rate of each expert's rank."""
        table = (self.used + self._prior) / (self.seen + self._prior_seen)  # [R + 1]
        if scores.shape[0] == 1:  # a decode step, scored on the host: one argsort, one scatter, one gather
            s = scores.detach().float().cpu().numpy()[0]  # [E]
            bucket = np.empty(s.shape[0], np.intp)
            bucket[np.argsort(-s, kind="stable")] = self._bucket_of_rank
            self._pending = bucket
            return torch.from_numpy(table[bucket].astype(np.float32))
        # a block of tokens (prefill) where its scores are, so a device block needs no sync here; one [E] copy
        # to the host, non-blocking (the proxy's sync completes it, as for the rest of the block's guesses)
        self._pending = None  # the layer's latest guess is this block's: not scored
        s = scores.detach().float()
        order = torch.argsort(s, dim=1, descending=True, stable=True)  # [T, E] experts, best first
        ranks = torch.from_numpy(self._bucket_of_rank).to(s.device, non_blocking=True).expand_as(order)
        bucket = torch.empty_like(order).scatter_(1, order, ranks)  # [T, E] rank bucket of each expert
        per_token = torch.from_numpy(table.astype(np.float32)).to(s.device, non_blocking=True)[bucket]  # [T, E]
        return (1 - torch.prod(1 - per_token, dim=0)).to("cpu", non_blocking=True)

    def observe(self, experts: torch.Tensor) -> None:
        """The layer's block used `experts` (top_k_index [1, K]): score the last decode guess for it."""
        if self._pending is None:
            return
        bucket, self._pending = self._pending, None
        if experts.shape[0] != 1:
            return  # a block of several tokens: the guess was for one
        self.seen += self._seen_per_step  # every rank bucket was guessed once per expert in it
        idx = experts.detach().cpu().numpy()[0]  # [K] distinct experts of one token (-1: padding)
        self.used += np.bincount(bucket[idx[idx >= 0]], minlength=self.ranks + 1)

    def reset(self) -> None:
        self.used[:] = 0
        self.seen[:] = 0
        self._pending = None


class GatePredictor:
    """The router of layer L+d applied to layer L's hidden state, for d = 1..lookahead.

    Where every target's router is one linear map (`router_probs.linear(layer)`, a wrapped model's
    `RouterTable`), a decode step costs one matmul per target, a concatenation and one device→host
    copy into a pinned buffer kept per layer; the scoring and the union over tokens run on the host
    (`host_scores`) once the proxy's sync has brought the logits. On a model whose copies take
    microseconds, host time per block is its decode speed (benchmarks/NOTES.md, "Launch-bound decode")."""

    name = "gate"

    def __init__(self, layers: list[int], top_k: dict[int, int], router_probs: RouterProbs, config: PredictorConfig) -> None:
        self.layers, self.top_k, self.router_probs, self.config = layers, top_k, router_probs, config
        self._plans: dict[int, tuple | None] = {}  # layer -> (targets, routers, host scorers), or None
        self._buffers: dict[int, torch.Tensor] = {}  # layer -> pinned [HOST_SCORING_TOKENS, ΣE] logits (CUDA)
        self._index_buffers: dict[int, torch.Tensor] = {}  # layer -> pinned [1, K] routing of its last decode block (CUDA)
        self._unscored: dict[int, tuple] = {}  # layer -> (calibrations, routing on the host once synchronised): `routed`
        self.calibration: dict[tuple[int, int], RankCalibration] = {}  # (target, distance) -> measured use per rank

    def _calibration(self, target: int, distance: int, num_experts: int) -> RankCalibration:
        cal = self.calibration.get((target, distance))
        if cal is None:
            cal = self.calibration[(target, distance)] = RankCalibration(num_experts, self.top_k[target])
        return cal

    def observe(self, layer, hidden, top_k_index) -> None:
        """Keep the block's routing to score the decode guesses made for `layer` once it is on the host
        (`routed`): on CUDA a non-blocking copy into a pinned buffer that the block's sync completes, so
        observing makes the host wait for nothing (a blocking copy here would wait for all the device's queued
        work, copies included, and charge that wait to prediction: `PayoffGate`)."""
        self._unscored.pop(layer, None)  # kept from a block `routed` never saw (a paused gate): stale
        cals = [self.calibration.get((layer, d)) for d in range(1, self.config.lookahead + 1)]
        cals = [c for c in cals if c is not None and c._pending is not None]  # a decode guess to score
        if not cals:
            return
        if top_k_index.shape[0] != 1:
            for cal in cals:  # a block of several tokens only drops the guesses (they were for one token)
                cal.observe(top_k_index)
            return
        self._unscored[layer] = (cals, self._index_to_host(layer, top_k_index.detach()))

    def _index_to_host(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        """A decode block's routing `index` [1, K] on the host once the block has synchronised: on CUDA a
        non-blocking copy into this layer's pinned buffer (as `_to_host`), else `index` itself."""
        if index.device.type != "cuda":
            return index
        buf = _pinned(self._index_buffers, layer, tuple(index.shape), index.dtype)
        buf.copy_(index, non_blocking=True)
        return buf

    def routed(self, layer: int) -> None:
        """`layer`'s block has synchronised with the device (its experts are known on the host): score the decode
        guesses for it against the routing `observe` kept."""
        pending = self._unscored.pop(layer, None)
        if pending is not None:
            cals, experts = pending
            for cal in cals:
                cal.observe(experts)

    @torch.no_grad()  # guesses, never part of a graph (a forward with autograd on reaches here too)
    def predict(self, layer, hidden):
        plan = self._plan(layer)
        if plan is not None:
            targets, routers, scorers = plan
            parts = [r.logits(hidden) for r in routers]  # [T, E_t] each
            if hidden.shape[0] <= HOST_SCORING_TOKENS:
                flat = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [T, ΣE]
                return host_scores(targets, scorers, self._to_host(layer, flat))
            probs = [r.probs_from(logits) for r, logits in zip(routers, parts)]
        else:
            targets = self._targets(layer)
            probs = [self.router_probs(t, hidden) for t in targets]
            targets, probs = [t for t, p in zip(targets, probs) if p is not None], [p for p in probs if p is not None]
        if not probs:
            return {}
        # scored on the host: the rank of each expert per token, read through the measured use per rank
        return {t: self._calibration(t, t - layer, p.shape[1]).probabilities(p) for t, p in zip(targets, probs)}

    def _targets(self, layer: int) -> list[int]:
        """The MoE layers within `lookahead` of `layer` whose experts take rows of its width (one of another
        width is another stack's: a vision encoder's experts beside the text decoder's)."""
        width = getattr(self.router_probs, "width", None)
        return [
            layer + d
            for d in range(1, self.config.lookahead + 1)
            if layer + d in self.top_k and (width is None or width(layer + d) == width(layer))
        ]

    def _plan(self, layer: int) -> tuple | None:
        """The targets of `layer`, their routers as linear maps, and per target the router with its selection
        bias on the host and its `RankCalibration` (what `host_scores` scores with). None: no target, or some router is not
        one linear map."""
        if layer not in self._plans:
            targets = self._targets(layer)
            linear = getattr(self.router_probs, "linear", None)
            routers = [linear(t) for t in targets] if linear is not None and targets else None
            if routers is None or any(r is None for r in routers):
                self._plans[layer] = None
            else:
                on_host = [r if r.correction is None else replace(r, correction=r.correction.detach().cpu()) for r in routers]
                scorers = [(r, self._calibration(t, t - layer, r.weight.shape[0])) for t, r in zip(targets, on_host)]
                self._plans[layer] = (targets, routers, scorers)
        return self._plans[layer]

    def _to_host(self, layer: int, logits: torch.Tensor) -> torch.Tensor:
        """`logits [T, ΣE]` on the host: on CUDA a non-blocking copy into this layer's pinned buffer, read
        after the block's sync, in the same block, before the layer's next prediction overwrites it."""
        if logits.device.type != "cuda":
            return logits.detach()
        buf = _pinned(self._buffers, layer, (HOST_SCORING_TOKENS, logits.shape[1]), logits.dtype)
        view = buf[: logits.shape[0]]
        view.copy_(logits, non_blocking=True)
        return view

    def reset(self) -> None:
        for cal in self.calibration.values():
            cal.reset()
        self._unscored.clear()

    def forget_routers(self) -> None:
        """Take the routers from `router_probs` again at their next use (a cast or move of the model replaced
        their buffers, e.g. a selection bias, which the plans hold)."""
        self._plans.clear()
        self._buffers.clear()
        self._index_buffers.clear()


def _pinned(buffers: dict[int, torch.Tensor], layer: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`layer`'s page-locked host buffer of `shape` and `dtype` in `buffers`, made (or remade) when it has another."""
    buf = buffers.get(layer)
    if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype:
        with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode (serving runs in it)
            buf = buffers[layer] = torch.empty(shape, dtype=dtype, pin_memory=True)
    return buf


def _pinned_rows(buffers: dict[int, torch.Tensor], layer: int, like: torch.Tensor) -> torch.Tensor:
    """A page-locked view of `like`'s shape and dtype in `layer`'s buffer, kept while it has rows enough (a
    power of two of them), so blocks of varying length reuse one allocation."""
    rows, rest = like.shape[0], tuple(like.shape[1:])
    buf = buffers.get(layer)
    if buf is None or buf.shape[0] < rows or tuple(buf.shape[1:]) != rest or buf.dtype != like.dtype:
        buf = _pinned(buffers, layer, (1 << max(rows - 1, 0).bit_length(), *rest), like.dtype)
    return buf[:rows]


class KeptRouting:
    """Routing that predictors learn from, read on the host without waiting for the device: `keep` takes a
    block's `top_k_index` [T, K] before its host sync (on CUDA a non-blocking copy into a pinned buffer per
    layer, and an event after it), `settle` hands each kept block's routing to `apply(layer, index)` on the
    host, in the order kept. Staging settles at `routed` (after the block's sync, which has completed the
    copy) and a predictor before it reads what `apply` built; a read before the sync waits for the copy's
    event only. A layer kept again before it was settled settles first (its buffer is about to be rewritten),
    so at most one block per layer waits. Tokens a router sent to no expert (over an expert's capacity: Switch
    Transformers'), whose routing names the sentinel E, are left out: `apply` gets only rows of real experts, and
    nothing for a block without any."""

    def __init__(self, apply: Callable[[int, torch.Tensor], None], num_experts: Mapping[int, int]) -> None:
        self._apply, self._num_experts = apply, num_experts
        self._buffers: dict[int, torch.Tensor] = {}  # layer -> pinned [rows, K] (CUDA)
        self._events: dict[int, torch.cuda.Event] = {}  # layer -> its last copy's event (CUDA)
        self._kept: list[tuple[int, torch.Tensor, torch.cuda.Event | None]] = []

    def keep(self, layer: int, index: torch.Tensor) -> None:
        if any(kept == layer for kept, _, _ in self._kept):
            self.settle()
        index, event = index.detach(), None
        if index.device.type == "cuda":
            host = _pinned_rows(self._buffers, layer, index)
            host.copy_(index, non_blocking=True)
            event = self._events.get(layer)
            if event is None:
                event = self._events[layer] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(index.device))
            index = host
        self._kept.append((layer, index, event))

    def settle(self) -> None:
        kept, self._kept = self._kept, []
        for layer, index, event in kept:
            if event is not None:
                event.synchronize()  # done by the block's sync unless read before it
                index = index.clone()  # the layer's buffer is rewritten by its next block; `apply` may keep rows
            E = self._num_experts[layer]
            if int(index.max()) >= E:  # some token went to no expert: the sentinel E
                index = index[(index < E).all(dim=1)]
                if not index.shape[0]:
                    continue
            self._apply(layer, index)

    def clear(self) -> None:
        self._kept.clear()


class Deferred(Mapping):
    """`{target layer: [E] probability}` computed by `compute()` when first read: a prediction that needs
    the block's own routing on the host, which staging reads after the block's sync."""

    def __init__(self, compute: Callable[[], dict[int, torch.Tensor]]) -> None:
        self._compute, self._values = compute, None

    def _get(self) -> dict[int, torch.Tensor]:
        if self._values is None:
            self._values = self._compute()
        return self._values

    def __getitem__(self, target: int) -> torch.Tensor:
        return self._get()[target]

    def __iter__(self):
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def host_scores(targets: list[int], scorers: list[tuple], host: torch.Tensor) -> Deferred:
    """`{target layer: [E] probability of use}` from the concatenated router logits of the targets for the block's
    tokens (`host [T, ΣE]`), scored on the host when first read, as the device path scores: each target's router
    scoring (`RouterLinear.probs_from`), then its `RankCalibration`. Read only after the device→host copy is done
    (the proxy's sync). `scorers`: per target, its router (selection bias on the host) and calibration."""

    def scores() -> dict[int, torch.Tensor]:
        values, start = {}, 0
        for target, (router, calibration) in zip(targets, scorers):
            E = router.weight.shape[0]
            values[target] = calibration.probabilities(router.probs_from(host[:, start : start + E]))
            start += E
        return values

    return Deferred(scores)


class MarkovPredictor:
    """Counts of expert → expert transitions: layer L → L+1 (same token) and token t → t+1 (same layer)."""

    name = "markov"

    def __init__(self, layers: list[int], num_experts: dict[int, int], top_k: dict[int, int], config: PredictorConfig) -> None:
        self.layers, self.num_experts, self.top_k, self.config = layers, num_experts, top_k, config
        self._routing = KeptRouting(self._count, num_experts)
        self.reset()

    def reset(self) -> None:
        self._routing.clear()
        E = self.num_experts
        # Laplace prior: before any evidence every transition is equally likely.
        self.cross = {L: torch.ones(E[L], E[L + 1]) for L in self.layers if L + 1 in E}
        self.temporal = {L: torch.ones(E[L], E[L]) for L in self.layers}
        self._prev_token: dict[int, torch.Tensor] = {}  # layer -> experts of the previous token [K]
        self._current: dict[int, torch.Tensor] = {}  # layer -> experts of the current step's last token
        self.tokens = 0
        self._recent_hits = deque(maxlen=self.config.markov_recheck_tokens)
        self._best_accuracy = 0.0
        self._since_check = 0

    def observe(self, layer, hidden, top_k_index) -> None:
        self._routing.keep(layer, top_k_index)  # counted on the host once the block has synchronised

    def routed(self, layer: int) -> None:
        self._routing.settle()

    def _count(self, layer: int, idx: torch.Tensor) -> None:
        """Count the transitions into `layer`'s block, whose routing is `idx` [T, K] (on the host)."""
        last = idx[-1]
        if layer - 1 in self._current and layer - 1 in self.cross:
            prev = self._current[layer - 1]
            self.cross[layer - 1][prev.unsqueeze(1), last.unsqueeze(0)] += 1
        if layer in self._prev_token:
            predicted = self._chain_temporal(layer)
            self._recent_hits.append(float(predicted[last].mean()))
            self.temporal[layer][self._prev_token[layer].unsqueeze(1), last.unsqueeze(0)] += 1
        if idx.shape[0] > 1:  # a prefill block: transitions between its own consecutive tokens
            a, b = idx[:-1], idx[1:]
            self.temporal[layer].index_put_(
                (a.repeat_interleave(b.shape[1], 1).reshape(-1), b.repeat(1, a.shape[1]).reshape(-1)),
                torch.ones(a.numel() * b.shape[1]),
                accumulate=True,
            )
        self._current[layer] = last
        self._prev_token[layer] = last
        if layer == self.layers[-1]:
            self.tokens += idx.shape[0]
            self._maybe_reestimate(idx.shape[0])

    def _chain_temporal(self, layer: int) -> torch.Tensor:
        """Per-expert probability of use at `layer` from the previous token's experts there."""
        row = self.temporal[layer][self._prev_token[layer]]  # [K, E]
        return token_union(row / row.sum(dim=1, keepdim=True), self.top_k[layer])

    def predict(self, layer, hidden):
        return Deferred(lambda: self._predict(layer))  # from this block's routing: read after its sync

    def _predict(self, layer: int) -> dict[int, torch.Tensor]:
        self._routing.settle()
        if layer not in self._current:
            return {}  # reset since the block
        out = {}
        dist = torch.zeros(self.num_experts[layer])
        dist[self._current[layer]] = 1.0 / len(self._current[layer])  # where the last token went at L
        for d in range(1, max(self.config.lookahead, 3) + 1):
            src, target = layer + d - 1, layer + d
            if src not in self.cross:
                break
            m = self.cross[src]
            dist = dist @ (m / m.sum(dim=1, keepdim=True))  # [E_target], probabilities multiplied along the chain
            cross = _cumulative_cut(dist, self.config.markov_cumulative)
            probs = (cross * self.top_k[target]).clamp(0, 1)
            if target in self._prev_token:
                probs = torch.maximum(probs, self._chain_temporal(target))
            out[target] = probs
        return out

    def _maybe_reestimate(self, n: int) -> None:
        self._since_check += n
        if self.tokens < self.config.markov_warmup_tokens:
            return  # the estimate from the first tokens of the run is still forming
        if self._since_check < self.config.markov_recheck_tokens or not self._recent_hits:
            return
        self._since_check = 0
        acc = sum(self._recent_hits) / len(self._recent_hits)
        self._best_accuracy = max(self._best_accuracy, acc)
        if acc < self._best_accuracy - 0.1:  # the text changed: forget old evidence, keep a little
            for table in (*self.cross.values(), *self.temporal.values()):
                table.mul_(0.1).add_(0.9)
            self._best_accuracy = acc


def _cumulative_cut(dist: torch.Tensor, mass: float) -> torch.Tensor:
    """Keep the most likely entries up to `mass` cumulative probability; zero the rest."""
    values, order = dist.sort(descending=True)
    keep = (values.cumsum(0) - values) < mass
    out = torch.zeros_like(dist)
    out[order[keep]] = dist[order[keep]]
    return out


class GlobalPredictor:
    """At the first MoE layer of a step, predict every later layer at once."""

    name = "global"

    def __init__(self, layers, num_experts, top_k, router_probs: RouterProbs, config: PredictorConfig) -> None:
        self.layers, self.num_experts, self.top_k, self.router_probs, self.config = (
            layers,
            num_experts,
            top_k,
            router_probs,
            config,
        )
        self._prev: dict[int, torch.Tensor] = {}
        self._routing = KeptRouting(self._remember, num_experts)

    def observe(self, layer, hidden, top_k_index) -> None:
        self._routing.keep(layer, top_k_index[-1:])

    def routed(self, layer: int) -> None:
        self._routing.settle()

    def _remember(self, layer: int, last: torch.Tensor) -> None:
        p = torch.zeros(self.num_experts[layer])
        p[last[0]] = 1.0
        self._prev[layer] = p

    def predict(self, layer, hidden):
        if layer != self.layers[0]:
            return {}
        # the routers' guesses are launched now, where the hidden state is, and read after the block's sync
        gates = {t: self.router_probs(t, hidden) for t in self.layers[1:]}
        unions = {t: token_union(g, self.top_k[t]) for t, g in gates.items() if g is not None}
        return Deferred(lambda: self._combine(unions))

    def _combine(self, unions: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        self._routing.settle()
        on_host = (
            dict(zip(unions, torch.cat(list(unions.values())).cpu().split([len(u) for u in unions.values()]))) if unions else {}
        )
        out = {}
        for target in self.layers[1:]:
            p = on_host.get(target)
            p = p if p is not None else torch.zeros(self.num_experts[target])
            prev = self._prev.get(target)
            out[target] = torch.maximum(p, prev) if prev is not None else p
        return out

    def reset(self) -> None:
        self._routing.clear()
        self._prev.clear()


class PositionPredictor:
    """Recent frequency of each expert per layer, over a sliding window of tokens."""

    name = "position"

    def __init__(self, layers, num_experts, top_k, config: PredictorConfig) -> None:
        self.layers, self.num_experts, self.top_k, self.config = layers, num_experts, top_k, config
        self._routing = KeptRouting(self._count, num_experts)
        self.reset()

    def reset(self) -> None:
        self._routing.clear()
        self._window = {L: deque(maxlen=self.config.position_window_tokens) for L in self.layers}
        self._freq = {L: torch.zeros(self.num_experts[L]) for L in self.layers}

    def observe(self, layer, hidden, top_k_index) -> None:
        self._routing.keep(layer, top_k_index[-self.config.position_window_tokens :])

    def routed(self, layer: int) -> None:
        self._routing.settle()

    def _count(self, layer: int, rows: torch.Tensor) -> None:
        window, freq = self._window[layer], self._freq[layer]
        for row in rows:
            if len(window) == window.maxlen:
                freq[window[0]] -= 1
            window.append(row)
            freq[row] += 1

    def predict(self, layer, hidden):
        return Deferred(lambda: self._predict(layer))

    def _predict(self, layer: int) -> dict[int, torch.Tensor]:
        self._routing.settle()
        out = {}
        for d in range(1, self.config.lookahead + 1):
            target = layer + d
            if target in self._freq and self._window[target]:
                out[target] = (self._freq[target] / len(self._window[target])).clamp(0, 1)
        return out


class HybridPredictor:
    """Markov for the first tokens of a sequence, position-based after."""

    name = "hybrid"

    def __init__(self, markov: MarkovPredictor, position: PositionPredictor, switch_tokens: int) -> None:
        self.markov, self.position, self.switch_tokens = markov, position, switch_tokens
        self.sequence_tokens = 0  # tokens of the current sequence (reset by `new_sequence`)

    def observe(self, layer, hidden, top_k_index) -> None:
        self.markov.observe(layer, hidden, top_k_index)
        self.position.observe(layer, hidden, top_k_index)
        if layer == self.markov.layers[-1]:
            self.sequence_tokens += top_k_index.shape[0]

    def routed(self, layer: int) -> None:
        self.markov.routed(layer)
        self.position.routed(layer)

    def predict(self, layer, hidden):
        use = self.markov if self.sequence_tokens < self.switch_tokens else self.position
        return use.predict(layer, hidden)

    def new_sequence(self) -> None:
        """A new sequence starts (a forward with an empty KV cache): Markov leads again."""
        self.sequence_tokens = 0

    def reset(self) -> None:
        self.markov.reset()
        self.position.reset()
        self.sequence_tokens = 0


@dataclass(frozen=True)
class PredictorSpec:
    """What a predictor factory gets (`mira_hf.registry.register_predictor`): the MoE layers, the
    prediction settings, and where available the model's routers, the calibrated file's directory, the
    model and its fingerprint."""

    layers: Sequence  # LayerInfo of every MoE layer, in model order
    config: PredictorConfig
    router_probs: RouterProbs | None = None  # (layer, hidden [T, H]) -> [T, E]; None in a replay without routers
    path: str | None = None  # MiraConfig.predictor_path
    model: object = None
    fingerprint: dict | None = None

    @property
    def ordinals(self) -> list[int]:
        return [li.ordinal for li in self.layers]

    @property
    def num_experts(self) -> dict[int, int]:
        return {li.ordinal: li.num_experts for li in self.layers}

    @property
    def top_k(self) -> dict[int, int]:
        return {li.ordinal: li.top_k for li in self.layers}


def build_predictor(name, layers, router_probs: RouterProbs, config: PredictorConfig, path=None, model=None, fingerprint=None):
    """The predictor registered as `name` for these layers (None: no prediction)."""
    if name is None:
        return None
    entry = PREDICTORS.get(name)
    if entry.uses_routers and router_probs is None:
        raise ConfigError(
            f"predictor={name!r} applies the model's routers, but none were given. In an offline replay pass "
            "router_probs=model.mira.router_probs (a wrapped model's routers)."
        )
    return entry.factory(PredictorSpec(layers, config, router_probs, path, model, fingerprint))


def _auto(spec: PredictorSpec):
    """ "learned" from `spec.path` when given, else "gate" (needs no training)."""
    return PREDICTORS.get("learned" if spec.path is not None else "gate").factory(spec)


register_predictor("auto", _auto, uses_routers=True)
register_predictor("gate", lambda s: GatePredictor(s.ordinals, s.top_k, s.router_probs, s.config), uses_routers=True)
register_predictor("markov", lambda s: MarkovPredictor(s.ordinals, s.num_experts, s.top_k, s.config))
register_predictor(
    "global", lambda s: GlobalPredictor(s.ordinals, s.num_experts, s.top_k, s.router_probs, s.config), uses_routers=True
)
register_predictor("position", lambda s: PositionPredictor(s.ordinals, s.num_experts, s.top_k, s.config))
register_predictor(
    "hybrid",
    lambda s: HybridPredictor(
        MarkovPredictor(s.ordinals, s.num_experts, s.top_k, s.config),
        PositionPredictor(s.ordinals, s.num_experts, s.top_k, s.config),
        s.config.hybrid_switch_tokens,
    ),
)
