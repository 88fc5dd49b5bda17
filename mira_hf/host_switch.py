"""`HostSwitch`: whether sending misses to the host pays, decided by timing forward steps both ways.

The planner (`host_compute.HostCosts.split`) sends a miss to the host when its cost model says the host
finishes it first. The model leaves out what is hard to predict: the device work queued ahead of a
block's rows, the worker's threads competing with the thread that drives the device, and that a miss
computed on the host leaves nothing in the cache, so its next use misses again. Where those dominate
(small experts at a few rows, beam search), planned host sends make decoding slower than copying every
miss. The switch measures instead of predicting: for each step width (the tokens of one forward step,
such as 1 at batch-1 decode, 4 in a 4-beam search, 8 at batch 8) it times steps with host sends and
steps without, and keeps host sends on for that width only while its steps are faster by `margin`.

Per width: first `rounds` rounds of four windows of `window` steps, host on, off, off, on (ABBA: a drift
over the round falls on both), then the faster choice, every step of it timed too. Every `recheck_steps`
steps the other choice gets one window again, so a change (the cache filled, the text moved) is seen. A
step is timed from its first block to the next step's first block (the time between steps, such as
sampling, is the same either way); each choice keeps its last `history` times and is compared by their
median, which a pause between two calls does not move. Widths above `max_width` (a prompt's prefill: its
experts stay on the device anyway) always plan host sends and are not timed. The exploring steps run
both ways, half of them the slower: the price of knowing.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Width:
    """One step width's times and plan."""

    times: dict[bool, deque] = field(default_factory=dict)  # host on? -> recent step seconds
    plan: list[bool] = field(default_factory=list)  # choices of the steps to come while exploring, next first
    choice: bool | None = None  # the faster, once decided
    since: int = 0  # steps run with `choice` since the last exploring window


class HostSwitch:
    """Per step width, whether a step plans host sends: `step(width)` at each step's first block (`clock`:
    seconds, injectable for tests)."""

    def __init__(
        self,
        window: int = 2,
        rounds: int = 1,
        recheck_steps: int = 128,
        margin: float = 0.03,
        history: int = 16,
        max_width: int = 64,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if window < 1 or rounds < 1 or recheck_steps < 1 or history < 1 or not 0 <= margin < 1:
            raise ValueError(
                f"HostSwitch(window={window}, rounds={rounds}, recheck_steps={recheck_steps}, history={history}, "
                f"margin={margin}): window, rounds, recheck_steps and history must be at least 1, margin in [0, 1)"
            )
        self.window, self.rounds, self.recheck_steps = window, rounds, recheck_steps
        self.margin, self.history, self.max_width, self.clock = margin, history, max_width, clock
        self.widths: dict[int, _Width] = {}
        self._step: tuple[_Width, bool, float] | None = None  # the step being timed: its width, choice, start

    def step(self, width: int) -> bool:
        """A forward step of `width` tokens starts (and the one before it ended): whether it plans host sends."""
        now = self.clock()
        if self._step is not None:  # the previous step's time: from its start to this one's
            w, on, t0 = self._step
            w.times[on].append(now - t0)
            if not w.plan:
                self._decide(w)
        self._step = None
        if width > self.max_width:
            return True
        w = self.widths.get(width)
        if w is None:
            w = self.widths[width] = _Width(times={True: deque(maxlen=self.history), False: deque(maxlen=self.history)})
        if not w.plan and w.choice is None:
            self._decide(w)
        if w.plan:
            on = w.plan.pop(0)
        else:
            on = w.choice
            w.since += 1
            if w.since >= self.recheck_steps:  # the other choice gets a window again
                w.since = 0
                w.plan = [not w.choice] * self.window
        self._step = (w, on, now)
        return on

    def _decide(self, w: _Width) -> None:
        """The faster choice from the times so far; with a choice not yet timed, a round of exploring first."""
        if w.times[True] and w.times[False]:
            w.choice = statistics.median(w.times[True]) < (1 - self.margin) * statistics.median(w.times[False])
            return
        for _ in range(self.rounds):  # ABBA
            w.plan += [True] * self.window + [False] * self.window + [False] * self.window + [True] * self.window

    def forget(self) -> None:
        """Drop every width's times and decisions (the model was moved or cast: its speeds changed)."""
        self.widths.clear()
        self._step = None

    def summary(self) -> dict[int, dict]:
        """Per width: the median step milliseconds with host sends and without, and the choice (None: exploring)."""
        out = {}
        for width, w in sorted(self.widths.items()):
            ms = {on: round(1e3 * statistics.median(t), 3) if t else None for on, t in w.times.items()}
            out[width] = {"host_ms": ms[True], "without_ms": ms[False], "host_sends": w.choice}
        return out
