"""The run's clock: the time guard (`Deadline`) and the log count from this module's import, which
`benchmarks/run.py` does before torch and transformers load."""

from __future__ import annotations

import time
import traceback

START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {msg}", flush=True)


def log_failure(row: dict, exc: BaseException, where: str, frames: int = 8) -> None:
    """A failure becomes the row's status and error (not the end of the run): logged with the traceback's tail."""
    row["status"] = "error"
    row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    log(f"{where}: ERROR {row['error'][:300]}")
    print("".join(traceback.format_exception(exc)[-frames:]), flush=True)


class Deadline:
    """The global time guard: systems that would not finish in time are skipped with a note."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - START

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()

    def max_time(self) -> float:
        """A bound for one generate call: what is left plus some grace, so one slow call cannot run away."""
        return max(self.remaining(), 0.0) + 10.0
