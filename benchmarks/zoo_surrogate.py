"""How much of the gap to Belady's loads is the routing's randomness: the zoo's evaluation traces against
memoryless surrogates with the same per-sequence use rates.

For each model of the zoo (and mira-tiny), the evaluation trace of `offline_eval.py --zoo` is recorded, and a
surrogate is drawn from it: in every sequence and layer, each step's experts are sampled anew (k distinct,
weighted by how often the sequence used each expert in that layer), independently of every other step. The
surrogate keeps what a use rate can know (which experts a sequence favours, per layer) and drops every
dependence between steps (reuse beyond the rates, bursts, drift within a sequence). Heat's loads over Belady's on
the real trace against the surrogate say whether the real routing's dependence between steps helps (lower) or
hurts (higher) an online cache. A plain pool (`pool_loads`: budget × experts slots, no STAGE tier) then ranks by
expected next use from each sequence's rates, known in advance (on a memoryless stream, the best an online ranking
can do: what is left over its own Belady's is the draws themselves) or counted as the sequence goes (what an online
count knows). The known-rate ranking is also given the next 1, 2 and 4 steps of each sequence's routing exactly (the
most a predictor of the coming tokens' routing could tell a cache): how far from Belady's a cache stays that knows
the rates and the next tokens' experts.

Per model and budget (10 / 25 / 50%), on the real trace and on the surrogate (`--draws` surrogates, seeds 0..n-1,
their mean): heat's and LRU's loads over Belady's (the cache's replay, demand loads only, no predictor), and the
pool's known-rate (without and with the next steps) and counted-rate rankings over the pool's Belady's.

    python benchmarks/zoo_surrogate.py --zoo ~/.cache/mira-hf/zoo [--zoo-models NAME ...] [--out DIR]

Writes DIR/<date>-cpu-zoo-surrogate.json and .md.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from _zoo_eval import TINY, add_window_args, load_windows, run_zoo, training_of  # noqa: E402
from offline_eval import BUDGETS, DEFAULTS  # noqa: E402

from mira_hf.replay import belady, replay  # noqa: E402
from mira_hf.trace import RoutingTrace, record_trace  # noqa: E402

HORIZONS = (1, 2, 4)  # steps of the coming routing a "known" ranking is also given exactly


def surrogate(trace: RoutingTrace, seed: int) -> RoutingTrace:
    """`trace` with each step's experts drawn anew from its sequence's use counts per layer (see the docstring)."""
    g = torch.Generator().manual_seed(seed)
    experts = trace.experts.clone()  # [steps, L, K]
    bounds = [*trace.sequence_starts, trace.steps]
    for a, b in zip(bounds, bounds[1:]):
        for layer in range(trace.num_layers):
            routed = trace.experts[a:b, layer]  # [n, K]
            k = int((routed[0] >= 0).sum())
            counts = torch.bincount(routed[routed >= 0], minlength=trace.num_experts[layer]).double()
            draws = torch.stack([torch.multinomial(counts, k, replacement=False, generator=g) for _ in range(b - a)])
            experts[a:b, layer, :k] = draws
    return dataclasses.replace(trace, experts=experts, hidden=None)


def pool_loads(trace: RoutingTrace, budget: float, ranking: str, horizon: int = 0) -> int:
    """Loads of one pool of `budget` × all experts slots, block by block (a step's layers in order), each miss
    evicting the resident expert not needed now whose next use is furthest: by Belady (`"belady"`: the trace's
    actual next use) or by expectation, layers until the expert's layer runs + L·(1/p − 1) steps, from a use rate p
    per layer: `"known"`, the expert's share of its sequence's steps (the sequence's true rate, known in advance:
    the best ranking an online cache could make on a memoryless stream with those rates); `"counted"`, its share of
    the sequence's steps so far, after one step's worth of a uniform prior (what an online count can know).
    `horizon` (with "known"): the next `horizon` steps of the sequence are known exactly too, as a predictor of the
    coming tokens' routing would know them at best: an expert used within them ranks by that use, the rest after
    them by their rates."""
    L = trace.num_layers
    slots = max(1, round(budget * sum(trace.num_experts)))
    routed = trace.experts.tolist()  # [steps][L][K]
    bounds = [*trace.sequence_starts, trace.steps]
    uses: dict[tuple[int, int], list[int]] = {}  # (layer, expert) -> its blocks' indices, ascending (Belady, horizons)
    for t, step in enumerate(routed if ranking == "belady" or horizon else ()):
        for layer, experts in enumerate(step):
            for e in experts:
                if e >= 0:
                    uses.setdefault((layer, e), []).append(t * L + layer)
    prior = {layer: sum(e >= 0 for e in routed[0][layer]) / trace.num_experts[layer] for layer in range(L)}
    resident: set[tuple[int, int]] = set()
    loads = 0
    for a, b in zip(bounds, bounds[1:]):
        counts: dict[tuple[int, int], float] = {}
        if ranking == "known":
            for step in routed[a:b]:
                for layer, experts in enumerate(step):
                    for e in experts:
                        if e >= 0:
                            counts[(layer, e)] = counts.get((layer, e), 0.0) + 1.0
        for t in range(a, b):
            seen = (b - a) if ranking == "known" else (t - a)  # steps the rates count
            for layer in range(L):
                block = t * L + layer
                need = {(layer, e) for e in routed[t][layer] if e >= 0}
                for key in need - resident:
                    loads += 1
                    if len(resident) >= slots:
                        candidates = resident - need
                        if ranking == "belady":
                            far = max(candidates, key=lambda k: _next_use(uses[k], block))
                        else:
                            ahead = dict(uses=uses, horizon=horizon, end=b * L) if horizon else None
                            far = max(
                                candidates,
                                key=lambda k: _expected_next(
                                    k, block, L, (counts.get(k, 0.0) + prior[k[0]] + 1e-9) / (seen + 1), ahead
                                ),
                            )
                        resident.discard(far)
                    resident.add(key)
                if ranking == "counted":
                    for key in need:
                        counts[key] = counts.get(key, 0.0) + 1.0
    return loads


def _expected_next(key: tuple[int, int], block: int, L: int, rate: float, ahead: dict | None) -> float:
    """Blocks from `block` until `key`'s next expected use: its layer's next turn, then 1/rate - 1 steps more on
    average; with `ahead` (`uses`, `horizon` steps, the sequence's `end`), a use within the horizon is known
    exactly and the rest rank after it."""
    wait = (key[0] - block % L - 1) % L + L * (1 / rate - 1)
    if ahead is None:
        return wait
    soon = _next_use(ahead["uses"].get(key, []), block)
    if soon < min(block + ahead["horizon"] * L, ahead["end"]):  # within the horizon and the sequence
        return soon - block
    return ahead["horizon"] * L + wait


def _next_use(blocks: list[int], block: int) -> int:
    """The first of `blocks` (ascending) after `block`; never used again: after every block."""
    i = bisect.bisect_right(blocks, block)
    return blocks[i] if i < len(blocks) else 1 << 60


def ratios(trace: RoutingTrace) -> dict:
    """Per budget: Belady's loads, and heat's and LRU's over them (demand loads only)."""
    out = {}
    kw = dict(stage_fraction=DEFAULTS.cache.stage_fraction, predictor_config=DEFAULTS.prediction)
    for budget in BUDGETS:
        best = belady(trace, budget=budget)["loads"]
        heat = replay(trace, budget=budget, policy=DEFAULTS.policy, heat=DEFAULTS.heat, **kw)["loads"]
        lru = replay(trace, budget=budget, policy="lru", **kw)["loads"]
        pool_best = pool_loads(trace, budget, "belady")
        out[str(budget)] = dict(
            belady_loads=best,
            heat=heat / best,
            lru=lru / best,
            known_rates=pool_loads(trace, budget, "known") / pool_best,  # over the same pool's Belady
            counted_rates=pool_loads(trace, budget, "counted") / pool_best,
            **{f"known_next{h}": pool_loads(trace, budget, "known", h) / pool_best for h in HORIZONS},
        )
    return out


def measure(name: str, path: str, args) -> dict:
    """One zoo model's rows: per budget, each metric on the real trace and its mean over the surrogates."""
    model, _, evaluation = load_windows(path, args)
    trace = record_trace(model, evaluation, progress=False)
    real = ratios(trace)
    drawn = [ratios(surrogate(trace, seed)) for seed in range(args.draws)]
    rows = {}
    for budget, r in real.items():
        rows[budget] = {}
        for metric in ("heat", "lru", "known_rates", "counted_rates", *(f"known_next{h}" for h in HORIZONS)):
            rows[budget][f"real_{metric}"] = r[metric]
            rows[budget][f"surrogate_{metric}"] = sum(d[budget][metric] for d in drawn) / len(drawn)
        heats = [d[budget]["heat"] for d in drawn]
        rows[budget]["surrogate_heat_spread"] = max(heats) - min(heats)
    print(f"## {name}", {b: {k: round(v, 3) for k, v in r.items()} for b, r in rows.items()}, flush=True)
    return dict(budgets=rows, training=None if name == TINY else training_of(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_window_args(ap)
    ap.add_argument("--draws", type=int, default=3, help="surrogates per model")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    run_zoo(ap.parse_args(), "cpu-zoo-surrogate", measure, markdown)


def markdown(report: dict) -> str:
    lines = [
        "# Heat and LRU over Belady's loads: real traces against memoryless surrogates (same per-sequence rates)",
        "",
        "| model | budget | heat, real | heat, surrogate | known rates, real | known rates, surrogate | counted rates, real "
        "| counted rates, surrogate | LRU, real | LRU, surrogate | "
        + " | ".join(f"known rates + next {h}, real" for h in HORIZONS)
        + " |",
        "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(HORIZONS),
    ]
    for name, model in report["models"].items():
        for budget, r in model["budgets"].items():
            lines.append(
                f"| {name} | {float(budget):.0%} | {r['real_heat']:.3f} | {r['surrogate_heat']:.3f} | "
                f"{r['real_known_rates']:.3f} | {r['surrogate_known_rates']:.3f} | {r['real_counted_rates']:.3f} | "
                f"{r['surrogate_counted_rates']:.3f} | {r['real_lru']:.3f} | {r['surrogate_lru']:.3f} | "
                + " | ".join(f"{r[f'real_known_next{h}']:.3f}" for h in HORIZONS)
                + " |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
