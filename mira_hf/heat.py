"""Per-expert heat scores: the adaptive cache's memory of which experts matter lately.

One score in [0, 1] per (layer, expert):
- +0.1 per activation;
- ×0.95 per idle period (a period in which the expert was not activated);
- a sliding window of activation counts: when a window closes, each expert's count, normalised by
  the layer's largest count, is added with a small gain (a burst counts once, not per token);
- prediction feedback: a staged expert that was used +0.03, one evicted unused −0.05.
An expert with score ≥ `hot_threshold` (0.3) belongs in HOT; below it, it is the first to go.
The clock is forward steps by default (deterministic, reproducible); `clock="wall"` uses the
100 ms decay period and 500 ms window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError, check_count, check_finite, check_fraction


@dataclass(frozen=True)
class HeatConfig:
    """The heat score of each expert (`policy="heat"`), a number in [0, 1] (`MiraConfig.heat`)."""

    activation_gain: float = 0.1  # added to an expert's score each time a block uses it
    decay_per_period: float = 0.95  # an expert's score is multiplied by this after each period it was not used
    window_periods: int = 5  # periods per counting window (5 × 100 ms = a 500 ms window on the wall clock)
    window_gain: float = 0.1  # when a window closes: + this × the expert's count over the layer's largest count
    used_prefetch_gain: float = 0.03  # added when an expert copied ahead of need is used
    wasted_prefetch_penalty: float = 0.05  # taken away when an expert copied ahead of need is evicted unused
    hot_threshold: float = 0.3  # the heat policy counts an expert as frequently used from this score on
    clock: str = "steps"  # "steps": one period per forward step (reproducible); "wall": one per `period_s`
    period_s: float = 0.1  # seconds per period with clock="wall"
    # Memory of each expert's use rate (the eviction ranking's estimate of how likely its layer uses it next
    # step), as the weight of the past per forward step. None: chosen per layer, online, among
    # `USE_RATE_DECAYS`: the one that has predicted that layer's next step best lately (how long routing
    # stays put differs between models and layers, from ~2 steps to ~50).
    use_rate_decay: float | None = None
    # A prompt's blocks (the forward that starts a sequence) move the use rates by each expert's share of the prompt's
    # tokens (of B prompts: the chance that one of B tokens, one from each, uses it), as that many decode steps would,
    # up to one memory's worth (`prompt_keep`); False: a prompt's block counts as one step using every expert it
    # names. Trained models generating after held-out prompts load fewer experts with it; a model whose generated
    # tokens route unlike its prompt (random weights) loads more (benchmarks/NOTES.md, "Eviction").
    seed_from_prompt: bool = True

    def __post_init__(self) -> None:
        for name in ("activation_gain", "window_gain", "used_prefetch_gain", "wasted_prefetch_penalty"):
            check_fraction(f"HeatConfig.{name}", getattr(self, name), "[0, 1]")  # a change of a score in [0, 1]
        clock = self.clock.strip().lower() if isinstance(self.clock, str) else self.clock
        if clock not in ("steps", "wall"):
            raise ConfigError(f"HeatConfig.clock={self.clock!r}: supported are 'steps' and 'wall' (any case).")
        object.__setattr__(self, "clock", clock)
        check_fraction("HeatConfig.decay_per_period", self.decay_per_period, "(0, 1]")
        check_count("HeatConfig.window_periods", self.window_periods, 1, "periods per counting window")
        check_finite("HeatConfig.period_s", self.period_s, "> 0", "seconds")
        check_fraction("HeatConfig.hot_threshold", self.hot_threshold, "[0, 1]")
        if self.use_rate_decay is not None:
            check_fraction("HeatConfig.use_rate_decay", self.use_rate_decay, "[0, 1)", ", or None (chosen online)")


# Candidate memories of the use rate (HeatConfig.use_rate_decay=None): about 2 to 50 forward steps.
USE_RATE_DECAYS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98)
SCORE_DECAY = 0.99  # weight of the past in each candidate's running prediction loss (~100 steps)
_TINY = 1e-9
_P_FLOOR = 1e-3  # a probability is never taken as 0 or 1 in the loss (the valuation's floor, too)


def prompt_keep(decay, tokens: int):
    """The weight of the past that a prompt of `tokens` tokens leaves in a use rate of memory `decay`: the prompt
    counts as that many decode steps, at most one memory's worth (1 / (1 - decay) steps, which leaves ~1/e of the
    past). A prompt is read, not generated, and the tokens generated after it may route otherwise (NOTES.md,
    "Eviction"): it fills the average once, and what decoding used before keeps a share."""
    return decay ** np.minimum(tokens, 1 / (1 - decay))


class UseRates:
    """Each expert's probability of being used by its layer's next block, as exponential moving averages of
    its per-step use, one per candidate memory (`decays`); per layer, the candidate whose estimates have
    predicted the layer's steps best (running log loss, each step scored before it updates the averages).
    All layers in one [candidates, layers, max experts] table: one NumPy pass per forward step."""

    def __init__(self, num_experts: list[int], decays: tuple[float, ...]) -> None:
        width = max(num_experts, default=0)
        self.candidates = tuple(decays)
        self.decays = np.asarray(decays, np.float32)[:, None, None]  # [C, 1, 1]
        self.ema = np.zeros((len(decays), len(num_experts), width), np.float32)  # [C, L, E]
        self.loss = np.zeros((len(decays), len(num_experts)), np.float64)  # [C, L] running log loss
        self.best = np.full(len(num_experts), len(decays) // 2, np.intp)  # [L] candidate in use per layer
        self._rows = np.arange(len(num_experts))
        padded = np.arange(width)[None, :] >= np.asarray(num_experts, np.intp)[:, None]  # [L, E] not an expert
        self._valid = None if not padded.any() else ~padded
        self._work = np.zeros_like(self.ema)
        self._mask = np.zeros(self.ema.shape, bool)
        self._unused = np.zeros(self.ema.shape[1:], bool)  # [L, E]

    def update(self, active: np.ndarray, out: np.ndarray) -> None:
        """One step's use (`active` [L, E] bool); writes each layer's best estimates into `out` [L, E]."""
        # In place, into buffers made once: temporaries of this size would each be a fresh mapping of memory.
        p, mask = self._work, self._mask  # [C, L, E] float32, bool
        np.clip(self.ema, _P_FLOOR, 1 - _P_FLOOR, out=p)
        unused = np.logical_not(active, out=self._unused)
        np.negative(p, out=p, where=unused)  # the log probability of what happened: log p if used, log1p(-p) if not
        np.log1p(p, out=p, where=unused)
        np.log(p, out=p, where=active)
        if self._valid is not None:
            p *= self._valid
        self.loss *= SCORE_DECAY
        self.loss -= p.sum(axis=2)
        self.ema *= self.decays
        np.multiply(1 - self.decays, active, out=p)
        self.ema += p
        np.less(self.ema, _TINY, out=mask)
        np.putmask(self.ema, mask, 0)  # no float32 denormals (slow arithmetic): far below any floor anyway
        self.best = self.loss.argmin(axis=0)
        out[:] = self.ema[self.best, self._rows]

    def seed(self, shares: np.ndarray, rows: np.ndarray, tokens: int, out: np.ndarray) -> None:
        """A prompt's routing: layer rows `rows` used each expert in `shares` [L, E] of `tokens` tokens. Each average
        moves as that many decode steps with those shares would move it in expectation, up to one memory's worth
        (`prompt_keep`); nothing is scored (a prompt's block is not one step's prediction). Writes the best
        estimates into `out`."""
        keep = prompt_keep(self.decays, tokens)  # [C, 1, 1]
        ema = self.ema[:, rows]  # [C, n, E]
        ema *= keep
        ema += (1 - keep) * shares[rows]
        ema[ema < _TINY] = 0  # no float32 denormals, as in `update`
        self.ema[:, rows] = ema
        out[rows] = self.ema[self.best[rows], rows]

    def decay(self, row: int) -> float:
        """The memory in use now for the layer of table row `row`."""
        return self.candidates[int(self.best[row])]

    def reset(self) -> None:
        self.ema[:] = 0
        self.loss[:] = 0


class HeatTracker:
    """Scores and counts for every expert of every MoE layer, on the host (tiny: L × E numbers). NumPy
    arrays, not tensors: `activate` runs once per MoE block, and on models whose copies take
    microseconds host time per block is what decode speed is made of (a torch op costs ~5 µs on the
    host, a NumPy one ~1 µs)."""

    def __init__(self, num_experts: dict[int, int], config: HeatConfig | None = None) -> None:
        self.config = config or HeatConfig()
        self.layers = sorted(num_experts)
        self.scores = {layer: np.zeros(num_experts[layer], np.float32) for layer in self.layers}
        self.counts = {layer: np.zeros(num_experts[layer], np.int64) for layer in self.layers}
        self._active = {layer: np.zeros(num_experts[layer], bool) for layer in self.layers}
        self._step_active_table = np.zeros((len(self.layers), max(num_experts.values(), default=0)), bool)
        self._step_active = {layer: self._step_active_table[i, : num_experts[layer]] for i, layer in enumerate(self.layers)}
        # A prompt's blocks (`activate(..., shares=...)`): each expert's share of the block's tokens, per layer
        self._step_shares = np.zeros(self._step_active_table.shape, np.float32)  # [L, E]
        self._prompt_rows: list[int] = []  # table rows of the layers whose blocks this step were a prompt's
        self._prompt_tokens = 0
        self._window = {layer: np.zeros(num_experts[layer], np.float32) for layer in self.layers}
        # Share of recent forward steps in which each expert was used (`HeatConfig.use_rate_decay`): an estimate of
        # the probability that its layer will use it next time, for eviction by expected next use. One
        # table [layers, max experts] so a victim search over hundreds of slots reads it in one NumPy gather
        # (`use_rates`); `use_rate[layer]` are views of its rows.
        self._use_rate_table = np.zeros((len(self.layers), max(num_experts.values(), default=0)), np.float32)
        self._row_of_layer = np.zeros(max(self.layers, default=-1) + 1, np.intp)  # layer -> its row of the table
        self._row_of_layer[self.layers] = np.arange(len(self.layers))
        self.use_rate = {layer: self._use_rate_table[i, : num_experts[layer]] for i, layer in enumerate(self.layers)}
        decay = self.config.use_rate_decay
        self._rates = None if decay is not None else UseRates([num_experts[layer] for layer in self.layers], USE_RATE_DECAYS)
        self._periods_in_window = 0
        self._last_tick = time.monotonic()

    def activate(self, layer: int, experts: list[int], shares: list[float] | None = None, tokens: int = 1) -> None:
        """`layer`'s block used `experts`. For a prompt's block of `tokens` tokens, `shares` gives each expert's
        share of them (its rows over the tokens): at the step's end the use rates move as that many decode steps
        with those shares would, instead of counting the block as one step that used every expert it names (a
        long prompt names nearly all, which says nothing of which ones the next tokens use)."""
        if shares is not None:
            row = int(self._row_of_layer[layer])
            self._step_shares[row, experts] = shares
            self._prompt_rows.append(row)
            self._prompt_tokens = max(self._prompt_tokens, tokens)
        if self.config.clock == "wall":
            self._tick_wall()
        s, n, w, a, sa = (
            self.scores[layer],
            self.counts[layer],
            self._window[layer],
            self._active[layer],
            self._step_active[layer],
        )
        gain = self.config.activation_gain
        for e in experts:  # a few experts per block: scalar updates beat building an index array
            s[e] = min(s[e] + gain, 1.0)
            n[e] += 1
            w[e] += 1
            a[e] = sa[e] = True

    def feedback(self, layer: int, expert: int, used: bool) -> None:
        """A staged expert was used (+) or evicted unused (−)."""
        delta = self.config.used_prefetch_gain if used else -self.config.wasted_prefetch_penalty
        s = self.scores[layer]
        s[expert] = float(min(1.0, max(0.0, float(s[expert]) + delta)))

    def end_step(self) -> None:
        """A forward step ended: one period passes on the step clock."""
        decay = self.config.use_rate_decay
        if self._prompt_rows:
            self._seed_from_prompt()
        elif self._rates is not None:
            self._rates.update(self._step_active_table, self._use_rate_table)
        else:
            u, a = self._use_rate_table, self._step_active_table
            u *= np.float32(decay)
            u += np.float32(1 - decay) * a
        self._step_active_table[:] = False
        if self.config.clock == "steps":
            self._end_period()

    def _seed_from_prompt(self) -> None:
        rows = np.asarray(sorted(set(self._prompt_rows)), np.intp)
        shares, tokens = self._step_shares, self._prompt_tokens
        if self._rates is not None:
            self._rates.seed(shares, rows, tokens, self._use_rate_table)
        else:
            keep = np.float32(prompt_keep(np.float32(self.config.use_rate_decay), tokens))
            u = self._use_rate_table
            u[rows] = keep * u[rows] + (1 - keep) * shares[rows]
        shares[rows] = 0
        self._prompt_rows.clear()
        self._prompt_tokens = 0

    def use_rate_decays(self) -> dict[int, float]:
        """The memory of each layer's use rates now (`HeatConfig.use_rate_decay`, or the one chosen online)."""
        fixed = self.config.use_rate_decay
        return {layer: fixed if self._rates is None else self._rates.decay(i) for i, layer in enumerate(self.layers)}

    def use_rates(self, layers: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """`use_rate` of each (layers[i], experts[i]) pair, in one gather (float32)."""
        width = self._use_rate_table.shape[1]
        return self._use_rate_table.ravel().take(
            self._row_of_layer.take(layers) * width + experts
        )  # np.take on the flat table: ~2× faster than 2-D fancy indexing

    def score(self, layer: int, expert: int) -> float:
        return float(self.scores[layer][expert])

    def is_hot(self, layer: int, expert: int) -> bool:
        return float(self.scores[layer][expert]) >= self.config.hot_threshold

    def _tick_wall(self) -> None:
        now = time.monotonic()
        periods = int((now - self._last_tick) / self.config.period_s)
        for _ in range(min(periods, 1000)):  # after 1000 idle periods every score is ~0 anyway
            self._end_period()
        self._last_tick += periods * self.config.period_s

    def _end_period(self) -> None:
        c = self.config
        for layer in self.layers:
            idle = ~self._active[layer]
            self.scores[layer][idle] *= np.float32(c.decay_per_period)
            self._active[layer][:] = False
        self._periods_in_window += 1
        if self._periods_in_window >= c.window_periods:
            for layer in self.layers:
                w, s = self._window[layer], self.scores[layer]
                top = w.max()
                if top > 0:
                    s += np.float32(c.window_gain) * w / top
                    np.minimum(s, np.float32(1.0), out=s)
                w[:] = 0
            self._periods_in_window = 0

    def reset(self) -> None:
        for layer in self.layers:
            for t in (self.scores, self.counts, self._active, self._step_active, self._window, self.use_rate):
                t[layer][:] = 0
        if self._rates is not None:
            self._rates.reset()
        self._step_shares[:] = 0
        self._prompt_rows.clear()
        self._prompt_tokens = 0
        self._periods_in_window = 0
