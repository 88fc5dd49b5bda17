"""`Staging`: turns a predictor's guesses into copies ahead of the router.

Per block the manager hands the staging stage the block's routing (`observe`, before the proxy's host
sync), the experts it used (`block_started`: guesses are scored, spent guesses dropped) and, once its
own copies are queued, the moment to stage (`block_ended`). The stage keeps the latest guess per layer
(they also rank evictions: `guesses`, `predicted`), the running precision that switches copying off
while guesses are poor, the payoff gate that pauses prediction while it costs more host time than the
stalls it could remove (`mira_hf.payoff`), and speculative copies: the first bytes of the next layer's
likeliest guess, finished by its block if used and dropped otherwise.

It copies only through the manager's public verbs (`prefetch`, `prefetch_part`, `wants`,
`drop_partial`) and reads its layer table, record sizes and telemetry.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from .cache import Key, Slot
from .config import PredictorConfig
from .payoff import PayoffGate

if TYPE_CHECKING:
    from .manager import ExpertManager
    from .predictors import Predictor


class Staging:
    """Prediction-driven staging of one manager's experts."""

    def __init__(self, manager: ExpertManager, predictor: Predictor | None, config: PredictorConfig) -> None:
        self.manager = manager
        self.predictor = predictor
        self.config = config
        # Prediction pauses while it costs more host time than the stalls it could remove (PredictorConfig.pause_unprofitable).
        self.gate = PayoffGate(config.payoff_window_steps)
        self.predicted: dict[Key, float] = {}  # latest predicted probability of use this step
        # layer -> latest [E] prediction: for a layer not yet run this step, or (layers in next_step) for its next step
        self.layer_probs: dict[int, list[float]] = {}
        self.next_step: set[int] = set()  # layers whose layer_probs entry is for the next step (kept across steps)
        self.precision: float | None = None  # running precision of the predictor's guesses
        self._pending: dict[int, list[tuple[int, set[int]]]] = {}  # target layer -> [(distance, guessed set)]
        self._ahead: dict[int, Mapping] = {}  # layer -> predictions made by `observe`, for its block
        self.cut_short: dict[Key, Slot] = {}  # speculative copies cut short, until finished or dropped
        self.gate_on = False
        self.speculate_bytes = 0

    def place(self, device: torch.device, placement: str) -> None:
        """Settings that follow the device and the placement (at construction and after `relocate`)."""
        pause = self.config.pause_unprofitable
        self.gate_on = device.type == "cuda" if pause is None else pause
        # Speculative copies of the next layer's guesses (PredictorConfig.speculate_bytes): only where a
        # copy lands in its slot as is ("dequant" decodes whole records) and the link can idle (CUDA).
        spec = self.config.speculate_bytes
        spec = (48 * 2**20 if device.type == "cuda" else 0) if spec is None else spec
        self.speculate_bytes = spec if placement != "dequant" else 0
        self.cut_short = {}

    @property
    def predicting(self) -> bool:
        """Whether the predictor runs now: there is one, and the payoff gate has not paused it."""
        return self.predictor is not None and (self.gate.active or not self.gate_on)

    @property
    def enabled(self) -> bool:
        """Whether predictions are turned into copies now: only while the predictor has been right
        often enough (predictions are still made and scored, so staging resumes when it recovers)."""
        return self.precision is None or self.precision >= self.config.min_precision

    # -- per block ------------------------------------------------------------------------------
    def observe(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor) -> None:
        """Let the predictor see this block's routing (hidden [T, H], top_k_index [T, K]) and guess later
        layers, before the block's host sync: on CUDA its device work and its copy to the host are then
        finished by that one sync instead of needing one of their own."""
        if not self.predicting:
            return
        t0 = time.perf_counter()
        self.predictor.observe(layer, hidden, top_k_index)
        self._ahead[layer] = self.predictor.predict(layer, hidden)
        self.gate.charge(time.perf_counter() - t0)

    def take_ahead(self, layer: int) -> dict | None:
        """The guesses `observe` made at `layer`'s block (None: none), once."""
        return self._ahead.pop(layer, None)

    def forget_ahead(self) -> None:
        """Drop guesses made for blocks that have not begun (the cache they were for is gone)."""
        self._ahead.clear()

    def block_started(self, layer: int, experts: Sequence[int]) -> None:
        """`layer`'s block runs now with `experts`: its guesses are spent, and scored."""
        self.layer_probs.pop(layer, None)
        self.next_step.discard(layer)
        actual = set(experts)
        decay = self.config.precision_decay
        telemetry = self.manager.telemetry
        routed = getattr(self.predictor, "routed", None)
        if routed is not None:  # the block's routing is on the host now: the predictor reads what `observe` kept
            t0 = time.perf_counter()
            routed(layer)
            if self.predicting:
                self.gate.charge(time.perf_counter() - t0)
        for distance, predicted in self._pending.pop(layer, ()):
            tp = len(predicted & actual)
            telemetry.count_prediction(layer, distance, tp, len(predicted) - tp, len(actual) - tp)
            if predicted and distance <= self.config.stage_lookahead:  # guesses that may be staged
                p = tp / len(predicted)
                self.precision = p if self.precision is None else decay * self.precision + (1 - decay) * p

    def block_ended(self, layer: int, predictions: Mapping | None) -> None:
        """`layer`'s block has queued its compute: stage its guesses (and, after the last layer, the first
        layer's next-step guess); at steps of many tokens without a predictor, the batch's guesses for the next
        `batch_stage_lookahead` blocks, across the end of the step."""
        t0 = time.perf_counter()
        batch = self.manager.batch
        guesses = []
        if predictions:
            self.stage(layer, predictions)
        elif batch is not None and not self.predicting and self.enabled:  # batch-aware use rates stand in
            guesses = batch.guesses_after(layer, self.config.batch_stage_lookahead)
            for guess in guesses:
                self._copy_likely(*guess)
        if layer == self.manager.last_ordinal and self.enabled and not guesses:
            self._stage_next_step()
        if self.predicting:
            self.gate.charge(time.perf_counter() - t0)

    def stage(self, layer: int, predictions: Mapping[int, torch.Tensor]) -> None:
        """Record each target layer's guesses (they rank evictions and are scored), then copy the
        likely experts (most likely first) of the next `stage_lookahead` layers, nearest first.
        A target at or before `layer` is a guess for the *next* step (the learned predictor's next-step
        head): it ranks evictions from now until that layer's next block, and only the first layer's is
        copied (`_stage_next_step`, once the step's last layer has run)."""
        cfg = self.config
        for target in sorted(predictions):
            probs = predictions[target]
            if target <= layer:  # that layer has run this step: its entry was spent
                self.layer_probs[target] = probs.tolist()
                self.next_step.add(target)
                continue
            values = probs.tolist()
            self.layer_probs[target] = values  # the nearest prediction comes last and wins
            chosen = [e for e, v in enumerate(values) if v >= cfg.confidence]
            chosen.sort(key=values.__getitem__, reverse=True)  # most likely first (stable: ties by index)
            self._pending.setdefault(target, []).append((target - layer, set(chosen)))
            for e in chosen:
                self.predicted[(target, e)] = max(self.predicted.get((target, e), 0.0), values[e])
            if target - layer <= cfg.stage_lookahead and self.enabled:
                self._copy_likely(target, chosen, values)
            if target == layer + 1 and self.speculate_bytes:
                self._speculate(target, chosen, values)

    def _speculate(self, layer: int, guesses: Sequence[int], values: Sequence[float]) -> None:
        """Start copying the first `speculate_bytes` of the likeliest of `guesses` (most likely first)
        not yet resident: that copy runs while the link would otherwise wait for `layer`'s router (see
        `PredictorConfig.speculate_bytes`); `begin` finishes it if the guess was right, else it is dropped.
        Only records larger than `speculate_bytes` are speculated on, so every such copy is cut short and
        a wrong one never stays to take a slot (small records move fast: a whole-record guess is what
        `stage_probability` decides)."""
        manager = self.manager
        if manager.store.record_bytes(layer) <= self.speculate_bytes:
            return
        for e in guesses:
            if manager.wants((layer, e)):
                slot = manager.prefetch_part((layer, e), values[e], self.speculate_bytes)
                if slot is not None and slot.partial:
                    self.cut_short[(layer, e)] = slot
                return

    def _stage_next_step(self) -> None:
        """The last layer's block has run: copy the likely experts of the first layer's next block, from
        its next-step guess (the learned predictor's next-step head), or, where steps carry many tokens and no
        predictor guesses across the step, from the batch's use rates (`BatchUsage.guess`). No guess made within
        a step reaches the first layer, so without this its misses always stall."""
        first = self.manager.first_ordinal
        values = self.layer_probs.get(first) if first in self.next_step else None
        if values is not None:
            self._copy_likely(first, sorted(range(len(values)), key=lambda e: -values[e]), values)
        elif self.manager.batch is not None and (guess := self.manager.batch.guess(first)):
            self._copy_likely(*guess)  # steps of many tokens: the batch's use rates guess the first layer's next block

    def _copy_likely(self, layer: int, order: Sequence[int], values: Sequence[float]) -> None:
        """Prefetch `layer`'s guesses (`order`: most likely first) with probability ≥ `stage_probability` that are
        neither resident nor in flight, at most `max_staged_per_layer` (default 2 · top-k) of them."""
        cfg = self.config
        cap = 2 * self.manager.layers[layer].top_k if cfg.max_staged_per_layer is None else cfg.max_staged_per_layer
        # the cap counts copies: at a large batch every expert is likely and the resident ones, the most used, rank first
        wanted = self.manager.wanted(layer)
        likely = (e for e in order if values[e] >= cfg.stage_probability and wanted[e])
        staged = list(itertools.islice(likely, cap))
        self.manager.prefetch(layer, staged, [values[e] for e in staged])

    def drop_speculation(self, layer: int | None = None) -> None:
        """Free the slots of speculative copies cut short (of `layer`, or all): nobody will finish them."""
        if not self.cut_short:
            return
        for key in [k for k in self.cut_short if layer is None or k[0] == layer]:
            self.manager.drop_partial(key, self.cut_short.pop(key))

    # -- per step -------------------------------------------------------------------------------
    def end_step(self, stall_total_s: float) -> None:
        """A forward step ended: drop unfinished speculation, review the payoff, forget this step's guesses
        (next-step guesses stay: they rank evictions until their layer runs again)."""
        self.drop_speculation()
        if self.gate_on and self.predictor is not None:
            self.gate.end_step(stall_total_s)
        self.predicted.clear()
        kept = {layer: self.layer_probs[layer] for layer in self.next_step if layer in self.layer_probs}
        self.layer_probs.clear()
        self.layer_probs.update(kept)
        self._pending.clear()
        self._ahead.clear()

    def new_sequence(self) -> None:
        """A forward with an empty KV cache starts: next-step guesses made from the last sequence's last
        token are not about this prompt."""
        for layer in self.next_step:
            self.layer_probs.pop(layer, None)
        self.next_step.clear()
        if hasattr(self.predictor, "new_sequence"):
            self.predictor.new_sequence()
