"""Where the default cache's loads go, over mira-tiny and the model zoo (CPU replay), × Belady's loads.

Per model and budget (10 / 25 / 50%), on the evaluation trace of `offline_eval.py --zoo` (the same windows and
calibration):

- `heat`: heat alone (demand loads only): its excess over 1 is what eviction by expected distance loses to
  Belady's knowledge of the future;
- `oracle_next_step`: heat with the true routing of each layer's next step as its next-step guess (what a perfect
  next-step head could give the ranking; no within-step guesses);
- the default once calibrated: `demand` loads, prefetches used (`prefetch_used`) and never used
  (`prefetch_unused`), their `total`; `serving_minus_heat` = demand + prefetch_used − heat's loads (what
  prediction changed in the loads that serve a use: its guesses rank evictions, its copies evict);
  `prefetch_evicted_reloaded`: copies ahead of need whose victim was demand-loaded again within one step.

    python benchmarks/zoo_loads.py --zoo ~/.cache/mira-hf/zoo [--zoo-models NAME ...] [--out DIR]

Writes DIR/<date>-cpu-zoo-loads.json and .md.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from _zoo_eval import add_window_args, load_windows, run_zoo  # noqa: E402
from offline_eval import BUDGETS, DEFAULTS, learned_predictor  # noqa: E402

import mira_hf.replay as replay_module  # noqa: E402
from mira_hf.replay import belady, replay  # noqa: E402
from mira_hf.trace import record_trace  # noqa: E402

COLUMNS = (
    "heat",
    "oracle_next_step",
    "demand",
    "prefetch_used",
    "prefetch_unused",
    "total",
    "serving_minus_heat",
    "prefetch_evicted_reloaded",
)


class NextStepOracle:
    """A predictor that knows each layer's routing at the next step (its next-step guess, probability 0.999)."""

    name = "oracle-next-step"

    def __init__(self, experts: torch.Tensor, num_experts: int) -> None:
        self.experts, self.num_experts = experts, num_experts  # [steps, L, K]
        self.step = -1

    def observe(self, layer, hidden, top_k_index) -> None:
        self.step += layer == 0

    def predict(self, layer, hidden):
        p = torch.zeros(self.num_experts)
        if self.step + 1 < self.experts.shape[0]:
            p[self.experts[self.step + 1, layer]] = 0.999
        return {layer: p}

    def reset(self) -> None:
        self.step = -1


def _allocations(manager) -> list:
    """Record every slot the manager's cache gives out: (block number, key, staged, evicted key or None)."""
    log, cache, begin = [], manager.cache, manager.begin
    allocate, blocks = cache.allocate, [0]

    def counted_begin(layer, experts, rows=None):
        blocks[0] += 1
        return begin(layer, experts, rows)

    def logged(key, staged, evict=True, prefetch_may_evict=None):
        slot, evicted = allocate(key, staged, evict=evict, prefetch_may_evict=prefetch_may_evict)
        if slot is not None:
            log.append((blocks[0], key, staged, None if evicted is None else evicted.key))
        return slot, evicted

    manager.begin, cache.allocate = counted_begin, logged
    return log


@contextmanager
def _allocation_logs():
    """The allocation logs (`_allocations`) of every manager `replay` builds inside this block."""
    made, logs = replay_module.ExpertManager, []

    def logging_manager(*args, **kwargs):
        manager = made(*args, **kwargs)
        logs.append(_allocations(manager))
        return manager

    replay_module.ExpertManager = logging_manager
    try:
        yield logs
    finally:
        replay_module.ExpertManager = made


def _harmful(log: list, layers: int) -> int:
    """Copies ahead of need whose victim was demand-loaded again within `layers` blocks (one step)."""
    demand: dict = {}
    for block, key, staged, _ in log:
        if not staged:
            demand.setdefault(key, []).append(block)
    return sum(
        1
        for block, _, staged, victim in log
        if staged and victim is not None and any(block < b <= block + layers for b in demand.get(victim, ()))
    )


def measure(trace, learned, router_probs) -> dict:
    kw = dict(
        policy=DEFAULTS.policy,
        router_probs=router_probs,
        stage_fraction=DEFAULTS.cache.stage_fraction,
        predictor_config=DEFAULTS.prediction,
        heat=DEFAULTS.heat,
    )
    out = {}
    for budget in BUDGETS:
        best = belady(trace, budget=budget)["loads"]
        heat = replay(trace, budget=budget, **kw)["loads"]
        oracle = replay(trace, budget=budget, predictor_obj=NextStepOracle(trace.experts, trace.num_experts[0]), **kw)
        with _allocation_logs() as logs:
            r = replay(trace, budget=budget, predictor_obj=learned, **kw)
        used = r["prefetch_used"]
        demand = r["loads"] - r["prefetches"]
        row = dict(
            heat=heat,
            oracle_next_step=oracle["loads"],
            demand=demand,
            prefetch_used=used,
            prefetch_unused=r["prefetches"] - used,
            total=r["loads"],
            serving_minus_heat=demand + used - heat,
            prefetch_evicted_reloaded=_harmful(logs[0], trace.num_layers),
        )
        out[str(budget)] = dict(belady_loads=best, **{k: round(v / best, 3) for k, v in row.items()})
        print(budget, out[str(budget)], flush=True)
    return out


def measure_model(name: str, path: str, args) -> dict:
    """One zoo model: its evaluation trace replayed with the learned predictor calibrated on its own text."""
    model, calib, evaluation = load_windows(path, args)
    trace = record_trace(model, evaluation, progress=False)
    learned, why = learned_predictor(model, calib, args.epochs)
    if learned is None:
        raise SystemExit(why)
    print(f"## {name}", flush=True)
    return measure(trace, learned, model.mira.router_probs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_window_args(ap)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    run_zoo(ap.parse_args(), "cpu-zoo-loads", measure_model, markdown)


def markdown(report: dict) -> str:
    lines = [
        "# Where the default cache's loads go (CPU replay, × Belady's loads)",
        "",
        f"Environment: `{report['environment']}`",
        "",
    ]
    lines += ["| model | budget | " + " | ".join(COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
    for name, budgets in report["models"].items():
        for budget, row in budgets.items():
            lines.append(f"| {name} | {float(budget):.0%} | " + " | ".join(f"{row[c]:.3f}" for c in COLUMNS) + " |")
    lines += ["", f"Total time {report['timings_s']} s", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
