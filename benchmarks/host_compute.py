"""Host compute of missed experts (`MiraConfig(host_compute="auto")`) against copying every miss, on GPU shapes.

For each workload (the expert dimensions of Mixtral-8x7B, Qwen3-30B-A3B and gpt-oss-20b, cut to a few layers,
random bf16 weights with routers spread as trained ones are: `common.balance_routers`) and each expert budget
(25 % of the experts, and a consumer GPU's share: 8 GiB of Mixtral's 32 layers, 4 GiB of Qwen3's 48 and of
gpt-oss's 24, scaled to the layers kept), one model is wrapped once with uncompressed records and measured
three ways in the same process, on the same store:

    host     host_compute on: the planner sends each miss to the link or to the host cores
    without  the same model with the host path switched off (every miss copied): the same cache and predictor
    lru      the reactive baseline: LRU eviction, no prediction, every miss copied (batch 1 only)

Metrics: decode tokens/s at batch 1 (the median of `--rounds` measurements, the systems in turn and each round
in the other order, after a warm-up decode; the share of misses the host computed, the hit rate; x_limit: time
per token over the PCIe floor, Belady's bytes per token over LRU's routing at the measured H2D speed), at batch 8
and with beam search (4 beams; the median of `--batch-rounds` measurements, the order alternating): host against
without there, which it must never lose to. The greedy tokens of
host and without at batch 1 are compared too (host matmuls round differently: on random weights a flipped
token is possible, not an error).

    python benchmarks/host_compute.py --out benchmarks/results/      # H200: about 4-5 minutes (estimate printed)
    python benchmarks/host_compute.py --smoke --out /tmp             # CPU, tiny shapes, < 1 minute: checks the script

On the CPU (`--smoke`) the device is the host: the link is set to 10 MB/s so the host path runs; its numbers
measure nothing. Writes OUT/<date>-<device>-host-compute.json and .md.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

from bench.clock import START, Deadline, log  # noqa: E402, F401  (before torch: the log counts imports too)

if __name__ == "__main__":
    for _k, _v in (("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_VERBOSITY", "error")):
        os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import transformers  # noqa: E402
from bench import GB  # noqa: E402
from bench.limits import compute_limit  # noqa: E402
from bench.measure import (  # noqa: E402
    decode_phase,
    free_device_cache,
    generate_timed,
    measure_bandwidth,
    median_of,
    release_wrapped,
    routing_trace,
    timed_decode,
)
from bench.workloads import Workload, model_facts  # noqa: E402
from common import SHAPES, balance_routers, device_slug, environment, print_table, sync, write_json  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.host_compute import HostCosts  # noqa: E402

SHAPES.setdefault("gpt-oss-20b-8l", dict(SHAPES["gpt-oss-20b"], num_hidden_layers=8))
# key -> (label, GPU shape, smoke shape, consumer GPU bytes for the full model, full model's layers)
WORKLOADS = {
    "mixtral": ("Mixtral-8x7B experts, 8 layers", "mixtral-8x7b-8l", "mixtral-smoke", 8 * 2**30, 32),
    "qwen3": ("Qwen3-30B-A3B experts, 12 layers", "qwen3-30b-a3b-12l", "qwen3-smoke", 4 * 2**30, 48),
    "gpt-oss": ("gpt-oss-20b experts, 8 layers", "gpt-oss-20b-8l", "gpt-oss-smoke", 4 * 2**30, 24),
}
SYSTEMS = ("without", "host", "lru")  # batch 1, in this order, then reversed (the rounds alternate)
SMOKE_EXTRA = {"gpt-oss-smoke": "gpt_oss"}  # common.SMOKE_SHAPES has mixtral and qwen3
HOST_S_PER_BLOCK = 1e-3  # the estimate's host time per MoE block (Python, launches): small experts are launch-bound
SMOKE_LINK_BYTES_PER_S = 1e7  # --smoke: a slow "link" (2.4 ms per tiny record), so the host path runs on a CPU
COLUMNS = [
    "model",
    "budget",
    "system",
    "b1_tok_s",
    "x_limit",
    "host_share",
    "hit_rate",
    "b8_tok_s",
    "beam_tok_s",
    "same_tokens_b1",
    "logit_rel_diff",
]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mixtral,qwen3,gpt-oss", help="workloads: " + ",".join(WORKLOADS))
    ap.add_argument("--budgets", default="0.25,consumer", help="fractions of the expert bytes and/or 'consumer'")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=24, help="batch-1 decode tokens per system")
    ap.add_argument("--rounds", type=int, default=2, help="batch-1 measurements per system (the order alternates)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batch-tokens", type=int, default=12)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--beam-tokens", type=int, default=12)
    ap.add_argument(
        "--batch-rounds", type=int, default=1, help="batch and beam measurements per system (the order alternates; medians)"
    )
    ap.add_argument("--warmup-tokens", type=int, default=4)
    ap.add_argument("--time-budget-s", type=float, default=420.0, help="phases that would start after this are skipped")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, a few tokens: checks the script")
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in WORKLOADS]
    if bad:
        ap.error(f"--models: unknown {bad}; choose from {', '.join(WORKLOADS)}")
    if args.rounds < 1 or args.batch_rounds < 1:
        ap.error(f"--rounds {args.rounds}, --batch-rounds {args.batch_rounds}: give 1 or more")
    args.budgets = [b.strip() if b.strip() == "consumer" else float(b) for b in args.budgets.split(",") if b.strip()]
    if args.smoke:
        args.prompt_len, args.new_tokens, args.batch_tokens, args.beam_tokens, args.warmup_tokens = 8, 4, 2, 2, 1
        args.batch, args.budgets = min(args.batch, 4), args.budgets[:1]
    return args


def build(wl: Workload, device: str, smoke: bool):
    if smoke and wl.shape in SMOKE_EXTRA:
        from mira_hf.testing import make_config

        torch.manual_seed(wl.seed)
        return transformers.AutoModelForCausalLM.from_config(make_config(SMOKE_EXTRA[wl.shape]), dtype=torch.bfloat16).eval()
    return wl.build(device)


def spread_routers(model, prompt_len: int, seed: int) -> list[dict]:
    """`common.balance_routers`, also for blocks whose router is called `router` (gpt-oss)."""
    aliased = []
    for layer in model.model.layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and not hasattr(mlp, "gate") and hasattr(mlp, "router"):
            object.__setattr__(mlp, "gate", mlp.router)  # not a submodule: the state dict is unchanged
            aliased.append(mlp)
    try:
        g = torch.Generator().manual_seed(seed + 7)
        ids = torch.randint(3, model.config.vocab_size, (4, max(prompt_len, 64)), generator=g).to(model.device)
        return balance_routers(model, ids, seed=seed)
    finally:
        for mlp in aliased:
            object.__delattr__(mlp, "gate")


def budget_of(budget, facts: dict, consumer_full: int, full_layers: int) -> tuple[int | float, str]:
    if budget == "consumer":
        kept = facts["moe_layers"] / full_layers
        nbytes = int(consumer_full * kept)
        return nbytes, f"{consumer_full / 2**30:.0f} GiB full = {nbytes / 2**30:.2f} GiB"
    return budget, f"{budget:.0%}"


def use(model, system: str, predictor, policy: str) -> None:
    """Switch the wrapped model between systems in place: the eviction policy and predictor (the cache starts
    empty again: `relocate`), and the host path (the same store, the same slots)."""
    m = model.mira
    m.settings = m.settings.replaced(policy="lru" if system == "lru" else policy)
    m.predictor = None if system == "lru" else predictor
    switch = m.host.switch
    decided = dict(switch.widths) if switch is not None else {}
    m.relocate(m.store, m.budget, m.device)
    if switch is not None:  # `relocate` forgets the switch's decisions; a user's model keeps them between calls
        switch.widths.update(decided)
    if m.host.mode != "off":
        m.host.active = system == "host"


def logit_diff(model, ids, predictor, policy) -> float | None:
    """max |logit difference| / max |logit| of a prompt's forward (`ids` [1, T], T small enough for the host)
    with every miss computed on the host against the same forward with every miss copied."""
    m = model.mira
    if m.host.mode == "off":
        return None
    use(model, "host", predictor, policy)
    with torch.no_grad():
        model(ids[:, :2])  # measures the link and the host times, outside the comparison
    measured = m.host.costs
    use(model, "host", predictor, policy)  # an empty cache again: every expert misses
    m.host.set_costs(dataclasses.replace(m.host.costs, link_bytes_per_s=1.0, link_free_at=0.0))  # no copy can win
    with torch.no_grad():
        host = model(ids[:, :4]).logits.float()
        forced = m.stats()["host_computed"]
        m.host.active = False
        copied = model(ids[:, :4]).logits.float()
    m.host.set_costs(measured)  # kept for the phases after this one
    log(f"logits with {forced} misses computed on the host: max |difference| {(host - copied).abs().max().item():.3g}")
    return ((host - copied).abs().max() / copied.abs().max()).item()


def estimate(args, workloads: list[tuple[str, Workload]], bw_gbps: float) -> list[tuple[str, float]]:
    """Rough seconds per phase, printed before the run (the store's copy and page-locking at ~2 GB/s; decode
    at 75 % misses over the link at `bw_gbps` plus HOST_S_PER_BLOCK per MoE block)."""
    out = []
    for key, wl in workloads:
        facts = wl.facts
        setup = facts["expert_bytes"] / 2e9 + 10
        per_token = 0.75 * facts["top_k"] * facts["moe_layers"] * facts["raw_record_bytes"] / (bw_gbps * GB)
        per_token += facts["moe_layers"] * HOST_S_PER_BLOCK
        n = len(args.budgets)
        out.append((f"{key}: build + wrap x{n}", n * setup))
        out.append(
            (
                f"{key}: batch 1, 3 systems x{n}",
                n * (3 * args.rounds + 1) * (args.new_tokens + args.warmup_tokens + 2) * per_token,
            )
        )
        out.append((f"{key}: batch {args.batch}, 2 systems x{n}", n * 2 * (args.batch_tokens + 2) * per_token * 3))
        out.append((f"{key}: beam {args.beams}, 2 systems x{n}", n * 2 * (args.beam_tokens + 2) * per_token * 2))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA GPU visible: run on a GPU machine, or pass --smoke for the CPU check.", flush=True)
        return 2
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # it builds a graph per new sequence length (NOTES.md, "Measuring")
    if args.smoke:
        torch.set_num_threads(1)  # tiny matmuls: more threads only add noise on a shared CPU (the host worker sets its own)
    deadline = Deadline(args.time_budget_s)
    env = environment()
    slug = device_slug(env, on_gpu=not args.smoke)
    stem = os.path.join(args.out, f"{env['date']}-{slug}-host-compute")
    os.makedirs(args.out, exist_ok=True)
    result = dict(env=env, args=vars(args), command=" ".join(["benchmarks/host_compute.py", *sys.argv[1:]]), rows=[])
    result["bandwidth"] = measure_bandwidth(args.smoke)
    workloads = []
    for key in args.models:
        label, shape, smoke_shape, consumer, full_layers = WORKLOADS[key]
        wl = Workload(key, label, smoke_shape if args.smoke else shape, args.seed)
        with torch.device("meta"):
            wl.facts = model_facts(build(wl, "meta", args.smoke)) if not args.smoke else {}
        workloads.append((key, wl))
    if not args.smoke:
        plan = estimate(args, workloads, result["bandwidth"]["h2d_gbps"])
        for name, sec in plan:
            log(f"estimate: {name}: about {sec:.0f} s")
        log(
            f"estimate: total about {sum(s for _, s in plan):.0f} s (phases past --time-budget-s={args.time_budget_s:.0f} are skipped)"
        )
    try:
        for key, wl in workloads:
            _, _, _, consumer, full_layers = WORKLOADS[key]
            for budget in args.budgets:
                run_workload(args, result, key, wl, budget, consumer, full_layers, device, deadline)
                write_json(stem + ".json", result)
    finally:
        write_json(stem + ".json", result)
        text = render(result)
        with open(stem + ".md", "w") as f:
            f.write(text)
        log(f"wrote {stem}.json and .md")
    return 0


def run_workload(args, result, key, wl: Workload, budget, consumer, full_layers, device, deadline) -> None:
    t0 = time.perf_counter()
    model = build(wl, device, args.smoke)
    wl.facts = model_facts(model)
    shares = spread_routers(model, args.prompt_len, args.seed) if not args.smoke else None
    gpu_budget, budget_label = budget_of(budget, wl.facts, consumer, full_layers)
    cfg = MiraConfig(gpu_budget=gpu_budget, device=device, quantization=None, host_compute="on" if args.smoke else "auto")
    MiraMoEModel.wrap(model, cfg)
    m = model.mira
    if args.smoke:
        m.host.set_costs(HostCosts(link_bytes_per_s=SMOKE_LINK_BYTES_PER_S))  # host times still measured
    predictor, policy = m.predictor, m.settings.policy
    log(f"{key} / {budget_label}: built and wrapped in {time.perf_counter() - t0:.1f} s")
    pad = wl.facts["pad_token_id"]
    ids = wl.prompts(args.batch, args.prompt_len, wl.facts["vocab_size"], device)
    rows = {s: dict(model=key, budget=budget_label, system=s, router_shares=shares) for s in ("host", "without", "lru")}

    def gen(x, n, beams=1, probe=None):
        return generate_timed(model, x, n, beams, pad, deadline, probe)

    tokens, trace, speeds = {}, [], {s: [] for s in SYSTEMS}
    try:
        use(model, "without", predictor, policy)
        decode_phase(gen, ids[:1], args.warmup_tokens + 2, args.warmup_tokens, m)  # the process's first decode warms up
        order = [sys_ for r in range(args.rounds) for sys_ in (SYSTEMS if r % 2 == 0 else SYSTEMS[::-1])]
        for system in order:  # batch 1: the systems in turn, each round in the other order
            if deadline.remaining() <= 0:
                rows[system]["notes"] = "skipped: time budget"
                continue
            use(model, system, predictor, policy)
            recording = system == "lru" and not trace  # Belady's floor replays the routing of an exact system
            d = decode_phase(gen, ids[:1], args.new_tokens, args.warmup_tokens, m, trace if recording else None)
            speeds[system].append(d["tok_s"])
            if len(speeds[system]) > 1:
                rows[system]["b1_tok_s_rounds"] = speeds[system]
                rows[system]["b1_tok_s"] = statistics.median(speeds[system])
                continue
            s = m.stats()
            out = (
                model.generate(
                    ids[:1], max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad
                )
                if system != "lru"
                else None
            )
            if out is not None:
                tokens[system] = out[0, args.prompt_len :].tolist()
            rows[system].update(
                b1_tok_s=d["tok_s"],
                hit_rate=d.get("hit_rate"),
                host_share=s["host_computed"] / max(s["misses"], 1),
                stall_share=d.get("stall_share"),
                h2d_bytes_per_token=d.get("h2d_bytes_per_step"),
            )
            if system == "host" and m.host.mode != "off":
                if m.host.switch is not None:  # batch 1's decision (`use` forgets it between systems)
                    rows[system]["host_switch_b1"] = {str(w): v for w, v in m.host.switch.summary().items()}
                rows[system]["host_lag_ms"] = 1e3 * m.host.costs.host_lag_s
                rows[system]["link_gbps_measured"] = (m.host.costs.link_bytes_per_s or 0) / GB
                rows[system]["host_ms_1row"] = {
                    layer: 1e3 * m.host.costs.host_time(layer, 1) for layer in list(m.host.costs.host_s)[:1]
                }
            log(
                f"{key} / {budget_label} / {system}: batch 1 {d['tok_s'] or 0:.2f} tok/s, host share {rows[system]['host_share']:.2f}"
            )
        if trace:
            limit = compute_limit(wl.facts, routing_trace(trace, m), result["bandwidth"])
            for r in rows.values():
                r["limit_s"], r["belady_bytes_per_token"] = limit["limit_s"], limit["belady_bytes_per_token"]
                if r.get("b1_tok_s"):
                    r["x_limit"] = 1.0 / r["b1_tok_s"] / limit["limit_s"]
        if deadline.remaining() > 0:
            rows["host"]["logit_rel_diff"] = logit_diff(model, ids[:1], predictor, policy)
        if tokens.get("host") is not None and tokens.get("without") is not None:
            same = sum(a == b for a, b in zip(tokens["host"], tokens["without"]))
            rows["host"]["same_tokens_b1"] = f"{same}/{len(tokens['without'])}"
        batch = {s: {"b8_tok_s": [], "beam_tok_s": []} for s in ("without", "host")}
        pairs = [p for r in range(args.batch_rounds) for p in (("without", "host"), ("host", "without"))[r % 2]]
        for system in pairs:  # batch 8 and beam search, each round in the other order
            if deadline.remaining() <= 0:
                rows[system]["notes"] = "batch/beam skipped: time budget"
                continue
            use(model, system, predictor, policy)
            gen(ids, args.warmup_tokens)
            m.reset_stats()
            rate = timed_decode(gen, ids, args.batch_tokens)[0]
            batch[system]["b8_tok_s"].append(args.batch * rate if rate else None)
            rows[system]["host_share_b8"] = m.stats()["host_computed"] / max(m.stats()["misses"], 1)
            gen(ids[:1], args.warmup_tokens, beams=args.beams)
            t, n, _ = gen(ids[:1], args.beam_tokens, beams=args.beams)
            batch[system]["beam_tok_s"].append(n / t)
            if system == "host" and m.host.switch is not None:  # per step width: host sends kept?
                rows[system]["host_switch"] = {str(w): v for w, v in m.host.switch.summary().items()}
            log(
                f"{key} / {budget_label} / {system}: batch {args.batch} {batch[system]['b8_tok_s'][-1] or 0:.2f} tok/s, "
                f"beam {batch[system]['beam_tok_s'][-1]:.2f} tok/s"
            )
        for system, metrics in batch.items():  # the medians of the rounds measured
            for metric, values in metrics.items():
                if values:
                    rows[system][metric] = median_of(values, rows[system], metric)
    finally:
        result["rows"].extend(rows.values())
        release_wrapped(m)
        model = m = None  # drop the model before the next is built
        free_device_cache()
        sync()


def render(result: dict) -> str:
    rows = result["rows"]
    lines = [
        "# Host compute of missed experts",
        "",
        f"`{result['command']}` on {result['env'].get('device')} ({result['env'].get('cpu_count')} host cores), "
        f"torch {result['env']['torch']}, transformers {result['env']['transformers']}, {result['env']['date']}.",
        "",
        'host: `MiraConfig(host_compute="auto", quantization=None)`; without: the same model with the host path off; '
        "lru: LRU eviction, no prediction. Tokens/s of decode after the first token; host_share: misses computed on the "
        "host / all misses (batch 1); same_tokens_b1: greedy tokens equal to without's.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in COLUMNS) + " |")
    print_table(rows, COLUMNS)
    return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return "" if v is None else str(v)


if __name__ == "__main__":
    sys.exit(main())
