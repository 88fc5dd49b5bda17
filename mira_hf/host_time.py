"""Host time per expert use and per miss: what the block protocol costs the host, measured on the running model.

Once copies are hidden, a fine-grained model decodes at the speed of its host work: per block the proxy's loop
over the used experts (launches, the manager's per-use bookkeeping) and per miss a victim search and a copy to
issue. `BlockClock` times every block call, from the manager counting its hits (in `begin`) to `end` (with its deferred
part, run at the manager's next verb), and fits

    block_s ≈ fixed_s + use_s · uses + miss_s · misses

by least squares over the blocks seen so far (running sums: a few additions per block). The serving planner
(`mira_hf.planner.StepCost`) adds `use_s` per expert use and `miss_s` per missed expert to its step time; the
per-block `fixed_s` is a cost per step whatever the batch, counted in `StepCost.step_overhead_s`.

Where the device is the host (CPU) the block's time also holds the experts' matmuls and the records' copies; on
CUDA both are queued and the time is the host's own work (plus waits for the staging ring when the store is
pageable). Terms the blocks cannot tell apart are folded: at one token per step every block uses top-k experts,
so `fixed_s` cannot be separated from `use_s` and is counted per use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

MIN_BLOCKS = 16  # blocks timed before a fit is given
_CONDITION_LIMIT = 1e8  # above this the terms are not told apart by the blocks seen: the fit drops one


@dataclass(frozen=True)
class HostUseCost:
    """Fitted host seconds of one block call: `fixed_s` + `use_s` per expert use + `miss_s` per missed expert.
    `terms`: the terms the blocks could tell apart (the others are 0 and folded into those kept)."""

    use_s: float
    miss_s: float
    fixed_s: float
    blocks: int
    terms: tuple[str, ...]


class BlockClock:
    """Running least-squares fit of block host time against expert uses and misses (see the module docstring)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.blocks = 0
        self._moments = [0.0] * 9  # Σ1 Σu Σm Σuu Σum Σmm Σy Σuy Σmy
        self._open: tuple[float, int, int] | None = None
        self._last: tuple[int, int] | None = None  # (uses, misses) of the block stopped last

    def start(self, uses: int, misses: int) -> None:
        """A block call with `uses` experts, `misses` of them not resident, starts its host work now."""
        self._open = (time.perf_counter(), uses, misses)

    def stop(self) -> None:
        """The block call started last has ended (nothing if none is open: an exception before `start`)."""
        if self._open is None:
            return
        t0, u, m = self._open
        self._open = None
        self._last = (u, m)
        self.add(u, m, time.perf_counter() - t0)

    def extend(self, seconds: float) -> None:
        """The block stopped last took `seconds` more host time (its deferred end, `ExpertManager.end`)."""
        if self._last is None:
            return
        u, m = self._last
        s = self._moments
        s[6] += seconds
        s[7] += u * seconds
        s[8] += m * seconds

    def add(self, uses: int, misses: int, seconds: float) -> None:
        """One block of `uses` expert uses and `misses` misses took `seconds` of host time."""
        s = self._moments
        s[0] += 1
        s[1] += uses
        s[2] += misses
        s[3] += uses * uses
        s[4] += uses * misses
        s[5] += misses * misses
        s[6] += seconds
        s[7] += uses * seconds
        s[8] += misses * seconds
        self.blocks += 1

    def fit(self) -> HostUseCost | None:
        """The least-squares terms (None before `MIN_BLOCKS` blocks). Terms the blocks cannot tell apart are dropped
        in this order: the fixed cost (folded into the per-use one), then the per-miss one; a negative term (noise)
        is dropped too and the rest refitted."""
        if self.blocks < MIN_BLOCKS:
            return None
        n, su, sm, suu, sum_, smm, sy, suy, smy = self._moments
        gram = np.array([[n, su, sm], [su, suu, sum_], [sm, sum_, smm]], np.float64)  # [3, 3] over (fixed, use, miss)
        rhs = np.array([sy, suy, smy], np.float64)  # [3]
        names = ("fixed", "use", "miss")
        for keep in ((0, 1, 2), (1, 2), (0, 1), (1,)):
            g = gram[np.ix_(keep, keep)]
            scale = np.sqrt(np.diag(g))
            if not scale.all() or np.linalg.cond(g / np.outer(scale, scale)) > _CONDITION_LIMIT:
                continue
            x = np.linalg.solve(g, rhs[list(keep)])
            if (x < 0).any():
                continue
            terms = dict(zip(keep, x.tolist()))
            return HostUseCost(
                use_s=terms.get(1, 0.0),
                miss_s=terms.get(2, 0.0),
                fixed_s=terms.get(0, 0.0),
                blocks=self.blocks,
                terms=tuple(names[i] for i in keep),
            )
        return None
