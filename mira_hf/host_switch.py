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
both ways, half of them the slower: the price of knowing. Where the answer is clear early, less is paid: once at
least a window (and two steps) each way has been timed and every recent step with host sends took longer than every
recent step without them by `stop_margin`, the width turns host sends off without timing the rest of its plan.

Host sends can save at most the time a step waits for copies (a miss the host computes is one the link
need not carry; a copy that lands in time costs the step nothing). So where the manager reports that
wait (`step(width, stall_s)`), a width starts with one window without host sends, and while those steps
wait for copies less than `margin` of their time, host sends could not win by the margin: the width
stays without them and is not explored (at a high hit rate, or where prefetching hides the copies); the
recheck looks at the wait again and explores once it has grown.
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
    stalls: deque | None = None  # recent steps without host sends: seconds each waited for copies (None: unknown)
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
        stop_margin: float = 0.1,
        history: int = 16,
        max_width: int = 64,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if window < 1 or rounds < 1 or recheck_steps < 1 or history < 1 or not 0 <= margin < 1 or not stop_margin >= margin:
            raise ValueError(
                f"HostSwitch(window={window}, rounds={rounds}, recheck_steps={recheck_steps}, history={history}, "
                f"margin={margin}, stop_margin={stop_margin}): window, rounds, recheck_steps and history must be at "
                "least 1, margin in [0, 1), stop_margin at least margin"
            )
        self.window, self.rounds, self.recheck_steps = window, rounds, recheck_steps
        self.margin, self.stop_margin, self.history, self.max_width, self.clock = margin, stop_margin, history, max_width, clock
        self.widths: dict[int, _Width] = {}
        # the step being timed: its width, choice, start, and the copy waits reported at its start (None: unknown)
        self._step: tuple[_Width, bool, float, float | None] | None = None

    def step(self, width: int, stall_s: float | None = None) -> bool:
        """A forward step of `width` tokens starts (and the one before it ended): whether it plans host sends.
        `stall_s`: the seconds the device has waited for copies so far, in total (None: not known)."""
        now = self.clock()
        if self._step is not None:  # the previous step's time: from its start to this one's
            w, on, t0, stall0 = self._step
            w.times[on].append(now - t0)
            if not on and w.stalls is not None and stall_s is not None and stall0 is not None:
                w.stalls.append(max(stall_s - stall0, 0.0))  # the total restarts at zero when stats are reset
            if not w.plan:
                self._decide(w)
            elif True in w.plan and self._clearly_slower(w):  # a clear loss: the rest of the exploring is left out
                w.plan, w.choice, w.since = [], False, 0
        self._step = None
        if width > self.max_width:
            return True
        w = self.widths.get(width)
        if w is None:
            w = self.widths[width] = _Width(times={True: deque(maxlen=self.history), False: deque(maxlen=self.history)})
            if stall_s is not None:  # a window without host sends first: what they could save at most
                w.stalls, w.plan = deque(maxlen=self.history), [False] * self.window
        if not w.plan and w.choice is None:
            self._decide(w)
        if w.plan:
            on = w.plan.pop(0)
        else:
            on = w.choice
            w.since += 1
            if w.since >= self.recheck_steps:  # the other choice gets a window again, unless it could not pay
                w.since = 0
                if w.choice or not self._cannot_pay(w):
                    w.plan = [not w.choice] * self.window
        self._step = (w, on, now, stall_s)
        return on

    def _cannot_pay(self, w: _Width) -> bool:
        """Whether the recent steps without host sends waited for copies less than `margin` of their time, so
        that host sends, which save at most that wait, could not be faster by the margin."""
        if not w.stalls or not w.times[False]:
            return False
        return statistics.median(w.stalls) < self.margin * statistics.median(w.times[False])

    def _clearly_slower(self, w: _Width) -> bool:
        """Whether a window of steps each way has been timed and every recent step with host sends took longer than
        every recent step without them by `stop_margin`: host sends are then turned off without timing more of them."""
        on, off = w.times[True], w.times[False]
        timed = len(on) >= max(self.window, 2) and len(off) >= self.window  # two: a layer's first use measures its host times
        return timed and min(on) > (1 + self.stop_margin) * max(off)

    def _decide(self, w: _Width) -> None:
        """The faster choice from the times so far; with a choice not yet timed, a round of exploring first,
        unless host sends could not pay (`_cannot_pay`)."""
        if not w.times[True] and self._cannot_pay(w):
            w.choice = False
            return
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
        """Per width: the median step milliseconds with host sends and without, the choice (None: exploring) and,
        where reported, the median milliseconds a step without host sends waited for copies."""
        out = {}
        for width, w in sorted(self.widths.items()):
            ms = {on: round(1e3 * statistics.median(t), 3) if t else None for on, t in w.times.items()}
            out[width] = {"host_ms": ms[True], "without_ms": ms[False], "host_sends": w.choice}
            if w.stalls:
                out[width]["stall_ms"] = round(1e3 * statistics.median(w.stalls), 3)  # without host sends
        return out
