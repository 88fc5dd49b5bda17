"""What `host_compute="auto"` costs at a step width where its switch has turned host sends off.

`host_compute.py` found Qwen3-size experts at a consumer budget slower at batch 8 with host_compute="auto" than
without it, in rounds after the switch had decided against host sends at that width. This probe takes the
wrapped model of that workload apart, on one store and cache, and alternates batch-`--batch` decodes among
variants round by round (the order rotating), after one decode per variant that lets the switch decide:

    without         the host path switched off (every miss copied)
    auto            host_compute="auto" as shipped
    auto-untimed    the same, with the loader's per-copy link timing off
    auto-prefill    the same as auto, except that steps wider than the switch's widest timed width (a
                    prompt's prefill) plan no host sends
    quiet           the host path on but never sending (no switch): what its bookkeeping alone costs
    quiet-untimed   quiet, with the per-copy link timing off

Reported per variant: the median decode tokens/s (all sequences), its ratio to `without` per round, stall
seconds and misses per step, the misses the host computed, and the switch's summary.

    python benchmarks/host_switch_probe.py --out benchmarks/results/          # GPU, about 2 minutes
    python benchmarks/host_switch_probe.py --smoke --out /tmp                 # CPU, tiny shape: checks the script
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import statistics  # noqa: E402

import host_compute as hc  # noqa: E402
import torch  # noqa: E402
from bench.clock import Deadline, log  # noqa: E402
from bench.measure import generate_timed, release_wrapped, timed_decode  # noqa: E402
from bench.workloads import Workload, model_facts  # noqa: E402
from common import device_slug, environment, print_table, write_json  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.host_compute import HostCosts  # noqa: E402
from mira_hf.host_switch import HostSwitch  # noqa: E402

VARIANTS = ("without", "auto", "auto-untimed", "auto-prefill", "quiet", "quiet-untimed")


class ProbeSwitch(HostSwitch):
    """ "auto"'s switch, except that steps wider than `max_width` (prefills) plan host sends only while
    `prefill_sends`."""

    prefill_sends = True

    def step(self, width: int, stall_s: float | None = None) -> bool:
        return super().step(width, stall_s) and (self.prefill_sends or width <= self.max_width)


def apply(model, variant: str, switch: ProbeSwitch, predictor, policy) -> None:
    m = model.mira
    m.host.switch = switch  # attached while `use` relocates: the step a variant left pending is dropped, not timed
    hc.use(model, "without" if variant == "without" else "host", predictor, policy)
    if variant.startswith("quiet"):
        m.host.switch, m.host.sending = None, False
    m.loader.time_link = m.host.active and not variant.endswith("untimed")
    switch.prefill_sends = variant != "auto-prefill"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen3", choices=sorted(hc.WORKLOADS))
    ap.add_argument("--budget", default="consumer", help="a fraction of the expert bytes, or 'consumer'")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--time-budget-s", type=float, default=400.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    budget = args.budget if args.budget == "consumer" else float(args.budget)
    if args.smoke:
        args.batch, args.prompt_len, args.tokens, args.rounds = 2, 8, 3, 1
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    deadline = Deadline(args.time_budget_s)
    env = environment()
    label, shape, smoke_shape, consumer, full_layers = hc.WORKLOADS[args.model]
    wl = Workload(args.model, label, smoke_shape if args.smoke else shape, args.seed)
    model = hc.build(wl, device, args.smoke)
    wl.facts = model_facts(model)
    if not args.smoke:
        hc.spread_routers(model, args.prompt_len, args.seed)
    gpu_budget, budget_label = hc.budget_of(budget, wl.facts, consumer, full_layers)
    MiraMoEModel.wrap(
        model, MiraConfig(gpu_budget=gpu_budget, device=device, quantization=None, host_compute="on" if args.smoke else "auto")
    )
    m = model.mira
    if args.smoke:
        m.host.set_costs(HostCosts(link_bytes_per_s=hc.SMOKE_LINK_BYTES_PER_S))
    switch = m.host.switch = ProbeSwitch()  # also on the CPU (--smoke: "on"), where it decides as "auto"'s would
    predictor, policy = m.predictor, m.settings.policy
    ids = wl.prompts(args.batch, args.prompt_len, wl.facts["vocab_size"], device)
    pad = wl.facts["pad_token_id"]
    gen = lambda x, n, beams=1, probe=None: generate_timed(model, x, n, beams, pad, deadline, probe)  # noqa: E731
    per = {v: dict(tok_s=[], stall_ms_per_step=[], misses_per_step=[], host_computed=[]) for v in VARIANTS}
    first = {}
    try:
        for r in range(args.rounds + 1):  # round 0: each variant once, the switch deciding (reported apart)
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            for v in order:
                if deadline.remaining() <= 0:
                    break
                apply(model, v, switch, predictor, policy)
                m.reset_stats()
                rate, got = timed_decode(gen, ids, args.tokens)[:2]
                s = m.stats()
                steps = max(got, 1)
                row = dict(
                    tok_s=(rate or 0.0) * args.batch,
                    stall_ms_per_step=1e3 * s["stall_s"] / steps,
                    misses_per_step=s["misses"] / steps,
                    host_computed=s["host_computed"],
                )
                if r == 0:
                    first[v] = row
                else:
                    for k, val in row.items():
                        per[v][k].append(val)
                log(f"round {r} {v}: {row['tok_s']:.1f} tok/s, host computed {row['host_computed']}")
    finally:
        release_wrapped(m)
    rows = []
    for v in VARIANTS:
        d = per[v]
        if not d["tok_s"]:
            continue
        ratios = [a / b for a, b in zip(d["tok_s"], per["without"]["tok_s"]) if b]
        rows.append(
            dict(
                variant=v,
                tok_s=statistics.median(d["tok_s"]),
                vs_without=statistics.median(ratios) if ratios else None,
                vs_without_min=min(ratios) if ratios else None,
                vs_without_max=max(ratios) if ratios else None,
                stall_ms_per_step=statistics.median(d["stall_ms_per_step"]),
                misses_per_step=statistics.median(d["misses_per_step"]),
                host_computed=sum(d["host_computed"]),
                first_tok_s=first.get(v, {}).get("tok_s"),
                rounds=d["tok_s"],
            )
        )
    cols = [
        "variant",
        "tok_s",
        "vs_without",
        "vs_without_min",
        "vs_without_max",
        "stall_ms_per_step",
        "misses_per_step",
        "host_computed",
        "first_tok_s",
    ]
    print_table(rows, cols)
    slug = device_slug(env, on_gpu=not args.smoke)
    result = dict(
        env=env, args=vars(args), budget=budget_label, rows=rows, switch={str(w): s for w, s in switch.summary().items()}
    )
    write_json(os.path.join(args.out, f"{env['date']}-{slug}-host-switch-probe-{args.model}.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
