"""Copies ahead of the router at steps of many tokens: how many of the loads stall, by replay.

A Mixtral-like routing (8 MoE layers of 8 experts, top-2, skewed popularity) decoded by 119 sequences at once, so every
expert of a layer is used at every step, replayed through the runtime's cache with the heat policy, batch-aware use
estimates and no predictor (what `mira serve` runs at such batches), at expert caches of 85% and 92% of the expert
bytes. Belady's loads are the fewest any demand cache with those slots makes; "stalls" are the loads made on demand
(the block waits for them), the rest were copied ahead during earlier blocks. The first step loads every expert on
demand (a cold cache), so `stalls_after_first_step` is what the steady state pays.

    python benchmarks/batch_staging.py --out benchmarks/results/    # CPU, < 1 minute; DATE-cpu-batch-staging[-LABEL].json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import environment, print_table, write_json  # noqa: E402

from mira_hf.replay import belady, replay  # noqa: E402
from mira_hf.trace import RoutingTrace  # noqa: E402

LAYERS, EXPERTS, TOP_K, RECORD_BYTES = 8, 8, 2, 352 * 2**20  # Mixtral 8x7B's expert: 3 x 4096 x 14336 bf16


def busy_trace(sequences: int, steps: int, seed: int = 0) -> RoutingTrace:
    g = torch.Generator().manual_seed(seed)
    shares = torch.softmax(torch.randn(LAYERS, EXPERTS, generator=g) * 0.5, -1)  # per-layer popularity
    tokens = sequences * steps
    routed = torch.stack([torch.multinomial(shares[i].expand(tokens, EXPERTS), TOP_K, generator=g) for i in range(LAYERS)], 1)
    return RoutingTrace(routed, None, [0], [EXPERTS] * LAYERS, [RECORD_BYTES] * LAYERS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequences", type=int, default=119)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.85, 0.92])
    ap.add_argument("--label", default="", help="suffix of the result file's name (what the run measures)")
    ap.add_argument("--out", default=None, help="directory for DATE-cpu-batch-staging[-LABEL].json")
    args = ap.parse_args()
    trace = busy_trace(args.sequences, args.steps)
    rows = []
    for budget in args.budgets:
        bound = belady(trace, budget=budget, concurrency=args.sequences)
        r = replay(trace, budget=budget, policy="heat", concurrency=args.sequences)
        cold = LAYERS * EXPERTS  # the first step loads each expert once, on demand
        rows.append(
            dict(
                budget=budget,
                uses=r["uses"],
                belady_loads=bound["loads"],
                loads=r["loads"],
                stalls=r["misses"],
                stalls_after_first_step=r["misses"] - cold,
                copies_ahead=r["prefetches"],
                copies_ahead_unused=r["prefetch_wasted"],
                stall_share_after_first_step=round((r["misses"] - cold) / max(1, r["loads"] - cold), 3),
            )
        )
    columns = list(rows[0])
    print_table(rows, columns)
    env = environment()
    result = dict(env=env, command=" ".join(sys.argv), args=vars(args), rows=rows)
    if args.out:
        name = f"{env['date']}-cpu-batch-staging{'-' + args.label if args.label else ''}.json"
        write_json(os.path.join(args.out, name), result)
        print("wrote", os.path.join(args.out, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
