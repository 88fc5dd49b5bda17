"""Copies ahead of the router at steps of many tokens: how many of the loads stall, by replay.

A Mixtral-like routing (8 MoE layers of 8 experts, top-2, skewed popularity) decoded by 119 sequences at once, so every
expert of a layer is used at every step, replayed through the runtime's cache with the heat policy, batch-aware use
estimates and no predictor (what `mira serve` runs at such batches), at expert caches of 85% and 92% of the expert
bytes. Belady's loads are the fewest any demand cache with those slots makes; "stalls" are the loads made on demand
(the block waits for them), the rest were copied ahead during earlier blocks. The first step loads every expert on
demand (a cold cache), so `stalls_after_first_step` is what the steady state pays.

A replay counts a copy made ahead as no stall; on the device it can still land late. A timing model over the same
run gives the wait: each block computes for --block-ms, each copy crosses the link for --copy-ms, one at a time in
the order issued; the host issues a block's copies (its misses and the copies ahead after it) when the previous
block ends on the device (--host-lead blocks earlier: the host runs ahead of the device); a copy cannot start before
the last block that used its victim has finished; a block starts when the one before it has ended and its experts
have landed. The defaults are the Mixtral shape on an H200 at 119 sequences (78 ms per step of 8 layers; 352 MB at
55 GB/s). `model_wait_ms_per_step` is the time blocks wait for copies after the first step. --lookahead runs each
budget with `PredictorConfig.batch_stage_lookahead` set to each value.

    python benchmarks/batch_staging.py --out benchmarks/results/    # CPU, < 1 minute; DATE-cpu-batch-staging[-LABEL].json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import environment, print_table, write_json  # noqa: E402

from mira_hf.cache import ExpertCache  # noqa: E402
from mira_hf.config import PredictorConfig  # noqa: E402
from mira_hf.manager import ExpertManager  # noqa: E402
from mira_hf.replay import belady, replay  # noqa: E402
from mira_hf.trace import RoutingTrace  # noqa: E402

LAYERS, EXPERTS, TOP_K, RECORD_BYTES = 8, 8, 2, 352 * 2**20  # Mixtral 8x7B's expert: 3 x 4096 x 14336 bf16


def busy_trace(sequences: int, steps: int, seed: int = 0) -> RoutingTrace:
    g = torch.Generator().manual_seed(seed)
    shares = torch.softmax(torch.randn(LAYERS, EXPERTS, generator=g) * 0.5, -1)  # per-layer popularity
    tokens = sequences * steps
    routed = torch.stack([torch.multinomial(shares[i].expand(tokens, EXPERTS), TOP_K, generator=g) for i in range(LAYERS)], 1)
    return RoutingTrace(routed, None, [0], [EXPERTS] * LAYERS, [RECORD_BYTES] * LAYERS)


@contextlib.contextmanager
def recorded(events: list):
    """Record the runtime's blocks and copies while a replay runs: ("block", layer, experts) when a block begins,
    ("copy", key, victim key or None) for each copy, in the order the runtime makes them."""
    begin, allocate = ExpertManager.begin, ExpertCache.allocate

    def recording_begin(self, layer, experts, *rest, **kw):
        events.append(("block", layer, tuple(experts)))
        return begin(self, layer, experts, *rest, **kw)

    def recording_allocate(self, key, *rest, **kw):
        slot, evicted = allocate(self, key, *rest, **kw)
        if slot is not None:
            events.append(("copy", key, evicted.key if evicted is not None else None))
        return slot, evicted

    ExpertManager.begin, ExpertCache.allocate = recording_begin, recording_allocate
    try:
        yield events
    finally:
        ExpertManager.begin, ExpertCache.allocate = begin, allocate


def timed_wait(events: list, block_ms: float, copy_ms: float, host_lead: int, skip_blocks: int) -> float:
    """Milliseconds blocks wait for copies under the timing model (module docstring), after the first `skip_blocks`."""
    ends: list[float] = []  # device end time of each block
    landed: dict = {}  # key -> when its latest copy lands
    last_end: dict = {}  # key -> end time of the latest block that used it
    link = wait = 0.0
    block = -1
    for event in events:
        if event[0] == "block":
            block += 1
            _, layer, experts = event
            before = ends[-1] if ends else 0.0
            start = max([before] + [landed.get((layer, e), 0.0) for e in experts])
            if block >= skip_blocks:
                wait += start - before
            ends.append(start + block_ms)
            for e in experts:
                last_end[(layer, e)] = ends[-1]
        else:
            _, key, victim = event
            issue = ends[block - 1 - host_lead] if block - 1 - host_lead >= 0 else 0.0
            link = max(link, issue, last_end.get(victim, 0.0)) + copy_ms
            landed[key] = link
    return wait


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequences", type=int, default=119)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.85, 0.92])
    ap.add_argument("--lookahead", type=int, nargs="+", default=[PredictorConfig.batch_stage_lookahead])
    ap.add_argument("--block-ms", type=float, default=9.7, help="timing model: one block's compute")
    ap.add_argument("--copy-ms", type=float, default=6.4, help="timing model: one record over the link")
    ap.add_argument("--host-lead", type=int, default=0, help="timing model: blocks the host runs ahead")
    ap.add_argument("--label", default="", help="suffix of the result file's name (what the run measures)")
    ap.add_argument("--out", default=None, help="directory for DATE-cpu-batch-staging[-LABEL].json")
    args = ap.parse_args()
    trace = busy_trace(args.sequences, args.steps)
    rows = []
    for budget, ahead in [(b, a) for b in args.budgets for a in args.lookahead]:
        bound = belady(trace, budget=budget, concurrency=args.sequences)
        with recorded([]) as events:
            r = replay(
                trace,
                budget=budget,
                policy="heat",
                concurrency=args.sequences,
                predictor_config=PredictorConfig(batch_stage_lookahead=ahead),
            )
        cold = LAYERS * EXPERTS  # the first step loads each expert once, on demand
        wait = timed_wait(events, args.block_ms, args.copy_ms, args.host_lead, skip_blocks=LAYERS)
        rows.append(
            dict(
                budget=budget,
                lookahead=ahead,
                uses=r["uses"],
                belady_loads=bound["loads"],
                loads=r["loads"],
                stalls=r["misses"],
                stalls_after_first_step=r["misses"] - cold,
                copies_ahead=r["prefetches"],
                copies_ahead_unused=r["prefetch_wasted"],
                stall_share_after_first_step=round((r["misses"] - cold) / max(1, r["loads"] - cold), 3),
                model_wait_ms_per_step=round(wait / (args.steps - 1), 2),
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
