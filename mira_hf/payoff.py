"""`PayoffGate`: whether prediction can pay for the host time it costs, reviewed every few forward steps.

A prediction costs host time at every block (the predictor's kernels and the copy of its guesses to
the host, scoring, staging bookkeeping, the prefetch copies' calls). The most it can save is the stall
of every use that would miss without it: the demand misses left, plus the uses its prefetches served.
On a model whose records cross in microseconds (the bundled mira-tiny, or any model whose misses land
before the compute needs them) nothing stalls, so prediction is pure cost and decode is host-bound:
there the gate pauses it (the cache policy keeps running, ranking by recent use). On a link-bound model
(Mixtral shape) a miss stalls for milliseconds, far more than prediction costs a block, and the gate
keeps it on, also through windows in which it staged little (the precision gate paused staging, or the
guesses were wrong): wrongly predicting costs at most its host time; wrongly pausing, the stalls.
Measured, not assumed (benchmarks/NOTES.md, "Launch-bound decode"):

- while predicting, per block: host seconds spent on prediction (`cost`; none of it a wait for the device: a
  predictor reads a block's routing on the host only once the block has synchronised, `Predictor.routed`);
- always, per block: uses at risk (demand misses, and uses served by a prefetch), and the stall seconds
  per demand miss, as the loader measures them (CUDA events around the compute stream's wait; on CPU the
  synchronous copy).

At the end of each window of `window_steps` steps: prediction stays (or comes back) on while
uses at risk per block × stall per miss ≥ cost per block, each from the latest window that measured it.
Until all three have been measured it predicts. While paused, one window in every `probe_every`
predicts again, so the cost estimate follows a workload that changes.
"""

from __future__ import annotations


class PayoffGate:
    def __init__(self, window_steps: int = 32, probe_every: int = 32) -> None:
        self.window_steps = window_steps
        self.probe_every = probe_every  # while paused, every this many windows one predicts again
        self.active = True  # whether the manager predicts and stages now
        self.paused_steps = 0  # forward steps run with prediction paused (telemetry; reset with the stats)
        self.cost_per_block: float | None = None  # host seconds of prediction per block (latest active window)
        self.at_risk_per_block: float | None = None  # demand misses + uses served by a prefetch, per block
        self.stall_per_miss: float | None = None  # stall seconds per demand miss (latest window with misses)
        self._steps = self._blocks = self._at_risk = self._misses = 0
        self._host_s = 0.0
        self._stall_at_start = 0.0  # the loader's stall total when this window began (it starts at 0)
        self._paused_windows = 0

    def charge(self, seconds: float) -> None:
        """Host time spent on prediction (predictor calls, staging)."""
        self._host_s += seconds

    def count_block(self, stage_hits: int, misses: int) -> None:
        """One block: its uses served by a prefetch, and its demand misses."""
        self._blocks += 1
        self._at_risk += stage_hits + misses
        self._misses += misses

    def end_step(self, stall_s_total: float) -> None:
        """A forward step ended; `stall_s_total` is the loader's stall total so far (resolved copies)."""
        self._steps += 1
        if not self.active:
            self.paused_steps += 1
        if self._steps < self.window_steps:
            return
        if self._misses:
            self.stall_per_miss = max(stall_s_total - self._stall_at_start, 0.0) / self._misses
        if self._blocks:
            self.at_risk_per_block = self._at_risk / self._blocks
            if self.active:
                self.cost_per_block = self._host_s / self._blocks
        self.active = self.pays()
        self._paused_windows = 0 if self.active else self._paused_windows + 1
        if self._paused_windows >= self.probe_every:  # a probe: measure the cost again
            self.active, self._paused_windows = True, 0
        self._steps = self._blocks = self._at_risk = self._misses = 0
        self._host_s = 0.0
        self._stall_at_start = stall_s_total

    def reset_stats(self) -> None:
        """The loader's stall total restarts at 0 (ExpertManager.reset_stats); the paused-step count too."""
        self.paused_steps = 0
        self._stall_at_start = 0.0

    def pays(self) -> bool:
        """Whether the stall prediction could remove per block (all of it) is at least what it costs per block."""
        if self.cost_per_block is None or self.stall_per_miss is None or self.at_risk_per_block is None:
            return True  # not measured yet
        return self.at_risk_per_block * self.stall_per_miss >= self.cost_per_block
