"""Experts split by neuron between the host and the GPU (`MiraConfig(host_compute="split")`) against copying
whole experts, on GPU shapes.

For each workload (`host_compute.py`'s: the expert dimensions of Mixtral-8x7B, Qwen3-30B-A3B and gpt-oss-20b cut
to a few layers, random bf16 weights, routers spread as trained ones are) and expert budget, the same model is
wrapped once per system, one after the other in the same process:

    lru             LRU eviction, no prediction, whole experts copied uncompressed (batch 1 only: its routing
                    gives Belady's floor)
    without         the default cache and predictor, whole experts copied uncompressed
    lossless        whole experts copied in the lossless format (0.69x the bytes)
    lossless-dequant  the same, each record decoded once per copy into a slot of bf16 (not at every use)
    default         MiraConfig's defaults (quantization="auto": lossless for large experts, uncompressed for small)
    split-X         host_compute="split", host_share=X, device parts copied uncompressed
    split-X-lossless  the same with the device parts in the lossless format
    split-X-auto    the same with quantization="auto" (the format `default` picks)

`--speculate-mib N,...` measures every system but lru once more per N with `PredictorConfig(speculate_bytes=N MiB)`
(named `<system>-specN`): how much of the next layer's likeliest guess is copied while the link would idle.

Metrics: decode tokens/s at batch 1 (median of `--rounds`), batch 8 and beam search (4 beams; medians of
`--batch-rounds`), each decode timed from its first step's end; x_limit: time per token over the PCIe floor
(Belady's bytes per token of whole uncompressed experts over LRU's routing, at the measured H2D speed);
x_limit_lossless: over the same floor in the lossless format's bytes (Belady's count of copies times the lossless
record's bytes, read off a system that stores whole experts so: the floor of the default); the
bytes each system moved per token, its hit rate, the largest logit difference against `without` (or `lossless`,
both exact) on a prompt (split rounds differently: not bit-exact).

    python benchmarks/host_split.py --models mixtral --out benchmarks/results/      # H200: ~5 minutes per budget
    python benchmarks/host_split.py --smoke --out /tmp                             # CPU, tiny shapes: checks the script

`--compile`: every generate compiles the model as a user would (generate's `compile_config`, a static cache; each
experts proxy one opaque operator in the graph): the layers' launches, norms and attention fused around the blocks.

Writes OUT/<date>-<device>-host-split.json and .md (`-host-split-compiled` with `--compile`).
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
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
    compiled_generate_kwargs,
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
from common import device_slug, environment, print_table, sync, write_json  # noqa: E402
from host_compute import WORKLOADS, _fmt, budget_of, build, spread_routers  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.config import PredictorConfig, QuantConfig  # noqa: E402

TITLE = "Experts split by neuron between the host and the GPU"
COLUMNS = [
    "model",
    "budget",
    "system",
    "b1_tok_s",
    "x_limit",
    "x_limit_lossless",
    "hit_rate",
    "h2d_gb_per_token",
    "b8_tok_s",
    "beam_tok_s",
    "b8_parts_copied",
    "beam_parts_copied",
    "logit_rel_diff",
]

# copies ahead of the router per step and the share of them whose block then used the expert (speculative ones apart)
GUESS_COLUMNS = ("prefetches_per_step", "prefetch_used_share", "speculated_per_step", "speculated_used_share")


def parse_args(argv=None, doc: str = __doc__, systems: str = "lru,without,lossless,split,split-lossless"):
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mixtral", help="workloads: " + ",".join(WORKLOADS))
    ap.add_argument("--budgets", default="consumer,0.25", help="fractions of the expert bytes and/or 'consumer'")
    ap.add_argument("--shares", default="0.25", help="host_share values of the split systems")
    ap.add_argument("--systems", default=systems)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batch-tokens", type=int, default=12, help="0: no batch phase")
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--beam-tokens", type=int, default=12, help="0: no beam-search phase")
    ap.add_argument("--batch-rounds", type=int, default=1, help="batch and beam phases per system (medians)")
    ap.add_argument("--warmup-tokens", type=int, default=4)
    ap.add_argument("--time-budget-s", type=float, default=540.0, help="phases that would start after this are skipped")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    ap.add_argument(
        "--floor-from",
        help="an earlier result file of the same workloads, budgets and seed: its lru rows give the floor's bytes (Belady's), "
        "over this run's measured link speed",
    )
    ap.add_argument(
        "--speculate-mib",
        default="",
        help="PredictorConfig.speculate_bytes values (MiB): each system but lru once more with each, named -specN",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="every generate compiles the model (compile_config, a static cache) as a user would; each system compiles afresh",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, a few tokens: checks the script")
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in WORKLOADS]
    if bad:
        ap.error(f"--models: unknown {bad}; choose from {', '.join(WORKLOADS)}")
    args.budgets = [b.strip() if b.strip() == "consumer" else float(b) for b in args.budgets.split(",") if b.strip()]
    args.shares = [float(s) for s in args.shares.split(",") if s.strip()]
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.speculate_mib = [int(v) for v in args.speculate_mib.split(",") if v.strip()]
    if args.smoke:
        args.prompt_len, args.new_tokens, args.batch_tokens, args.beam_tokens, args.warmup_tokens = 8, 4, 2, 2, 1
        args.batch, args.budgets, args.rounds = min(args.batch, 4), args.budgets[:1], 1
    return args


def configs(args, gpu_budget, device: str, facts: dict | None = None) -> list[tuple[str, MiraConfig]]:
    """(system, its config) in the order measured: lru first (its routing gives the floor). `facts`: the
    workload's `model_facts`."""
    base = dict(gpu_budget=gpu_budget, device=device)
    out = []
    for system in args.systems:
        if system == "lru":
            out.append((system, MiraConfig(**base, quantization=None, policy="lru", predictor=None)))
        elif system == "without":
            out.append((system, MiraConfig(**base, quantization=None)))
        elif system == "lossless":
            out.append((system, MiraConfig(**base, quantization="lossless")))
        elif system == "lossless-dequant":
            out.append((system, MiraConfig(**base, quantization="lossless", quant=QuantConfig(placement="dequant"))))
        elif system == "default":
            out.append((system, MiraConfig(**base)))
        elif system in ("split", "split-lossless", "split-auto"):
            q = {"split": None, "split-lossless": "lossless", "split-auto": "auto"}[system]
            for share in args.shares:
                name = system.replace("split", f"split-{share:g}")
                out.append((name, MiraConfig(**base, quantization=q, host_compute="split", host_share=share)))
        else:
            raise SystemExit(
                f"--systems: unknown {system!r}; choose from lru, without, lossless, lossless-dequant, default, split, split-lossless, split-auto"
            )
    for mib in args.speculate_mib:  # the same systems with another speculation size (the split's idle link)
        speculating = PredictorConfig(speculate_bytes=mib * 2**20)
        out += [
            (f"{n}-spec{mib}", dataclasses.replace(c, prediction=speculating)) for n, c in out if n != "lru" and "-spec" not in n
        ]
    return out


def main(argv=None, configs_of=configs, slug: str = "host-split", title: str = TITLE, args=None, extra=None) -> int:
    """Runs the workloads of `args` (parsed from `argv` if None), each system `configs_of(args, gpu_budget, device,
    facts)` names, and writes OUT/<date>-<device>-<slug>.json and .md (headed `title`; `extra`: more result fields)."""
    args = args if args is not None else parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA GPU visible: run on a GPU machine, or pass --smoke for the CPU check.", flush=True)
        return 2
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # it builds a graph per new sequence length (NOTES.md, "Measuring")
    deadline = Deadline(args.time_budget_s)
    env = environment()
    slug += "-compiled" if args.compile else ""
    stem = os.path.join(args.out, f"{env['date']}-{device_slug(env, on_gpu=not args.smoke)}-{slug}")
    os.makedirs(args.out, exist_ok=True)
    result = dict(
        env=env, args=vars(args), command=" ".join([os.path.relpath(os.path.abspath(sys.argv[0]), REPO), *sys.argv[1:]]), rows=[]
    )
    result["bandwidth"] = measure_bandwidth(args.smoke)
    result.update(extra or {})
    try:
        for key in args.models:
            label, shape, smoke_shape, consumer, full_layers = WORKLOADS[key]
            for budget in args.budgets:
                wl = Workload(key, label, smoke_shape if args.smoke else shape, args.seed)
                run_workload(args, result, key, wl, budget, consumer, full_layers, device, deadline, configs_of)
                write_json(stem + ".json", result)
    finally:
        write_json(stem + ".json", result)
        with open(stem + ".md", "w") as f:
            f.write(render(result, title))
        log(f"wrote {stem}.json and .md")
    return 0


def run_workload(args, result, key, wl: Workload, budget, consumer, full_layers, device, deadline, configs_of=configs) -> None:
    model = build(wl, device, args.smoke)
    wl.facts = model_facts(model)
    if not args.smoke:
        spread_routers(model, args.prompt_len, args.seed)
    gpu_budget, budget_label = budget_of(budget, wl.facts, consumer, full_layers)
    pad = wl.facts["pad_token_id"]
    ids = wl.prompts(args.batch, args.prompt_len, wl.facts["vocab_size"], device)
    rows, trace, reference = [], [], None
    limit = None

    extra = compiled_generate_kwargs(on_cpu=device == "cpu") if args.compile else None

    def gen(x, n, beams=1, probe=None):
        return generate_timed(model, x, n, beams, pad, deadline, probe, extra)

    base = model  # each system wraps a copy (unloading a lossless store decodes every expert on the CPU: minutes)
    for system, cfg in configs_of(args, gpu_budget, device, wl.facts):
        if deadline.remaining() <= 0:
            rows.append(dict(model=key, budget=budget_label, system=system, notes="skipped: time budget"))
            continue
        if args.compile:
            torch._dynamo.reset()  # each system compiles its own graphs
        t0 = time.perf_counter()
        model = MiraMoEModel.wrap(copy.deepcopy(base), cfg)
        m = model.mira
        row = dict(model=key, budget=budget_label, system=system, wrap_s=time.perf_counter() - t0)
        row["codec"] = m.store.codec.name
        row["record_bytes"] = m.store.record_bytes(m.first_ordinal)
        row["expert_slots"] = sum(m.budget.n_slots.values())
        row["store_tiers"] = m.store.tier_bytes()  # bytes of records per tier: pinned, pageable, disk
        try:
            decode_phase(gen, ids[:1], args.warmup_tokens + 2, args.warmup_tokens, m)  # warm-up
            speeds = []
            for r in range(args.rounds):
                recording = system == "lru" and r == 0
                d = decode_phase(gen, ids[:1], args.new_tokens, args.warmup_tokens, m, trace if recording else None)
                speeds.append(d["tok_s"])
                if r == 0:
                    row.update(
                        hit_rate=d.get("hit_rate"),
                        h2d_gb_per_token=(d.get("h2d_bytes_per_step") or 0) / GB,
                        stall_share=d.get("stall_share"),
                        **{k: d.get(k) for k in GUESS_COLUMNS},
                    )
            timed = [s for s in speeds if s]  # None: a decode no longer than its first token (a few tokens on a busy CPU)
            row["b1_tok_s_rounds"], row["b1_tok_s"] = speeds, statistics.median(timed) if timed else None
            if m.host.active:
                row["host_costs"] = host_costs(m)
            if system == "lru" and trace:
                limit = compute_limit(wl.facts, routing_trace(trace, m), result["bandwidth"])
            with torch.no_grad():
                logits = model(ids[:1, :4]).logits.float()
            if (
                system in ("without", "lossless", "lossless-dequant", "default") and reference is None
            ):  # exact: the unwrapped model's logits
                reference = logits
            elif reference is not None and system != "lru":
                row["logit_rel_diff"] = ((logits - reference).abs().max() / reference.abs().max()).item()
            log(
                f"{key} / {budget_label} / {system}: batch 1 {row['b1_tok_s'] or 0:.2f} tok/s, hit rate {row['hit_rate'] or 0:.2f}"
            )
            if system != "lru" and deadline.remaining() > 0 and args.batch_tokens > 0:
                gen(ids, args.warmup_tokens)
                before, speeds = m.stats(), []
                for _ in range(args.batch_rounds):
                    rate = timed_decode(gen, ids, args.batch_tokens)[0]
                    speeds.append(args.batch * rate if rate else None)
                row["b8_parts_copied"] = copied_share(before, m.stats())
                row["b8_tok_s"] = median_of(speeds, row, "b8_tok_s")
                log(f"{key} / {budget_label} / {system}: batch {args.batch} {row['b8_tok_s'] or 0:.2f}")
            if system != "lru" and deadline.remaining() > 0 and args.beam_tokens > 0:
                gen(ids[:1], args.warmup_tokens, beams=args.beams)
                before, speeds = m.stats(), []
                for _ in range(args.batch_rounds):
                    t, n, _ = gen(ids[:1], args.beam_tokens, beams=args.beams)
                    speeds.append(n / t)
                row["beam_tok_s"] = median_of(speeds, row, "beam_tok_s")
                row["beam_parts_copied"] = copied_share(before, m.stats())
                log(f"{key} / {budget_label} / {system}: beam {row['beam_tok_s']:.2f}")
        except Exception as exc:  # recorded with its traceback; the next systems still run
            row["notes"] = f"failed: {type(exc).__name__}: {exc}"
            traceback.print_exc()
        finally:
            rows.append(row)
            release_wrapped(m)
            model = m = None
            free_device_cache()
            sync()
    earlier = []
    if limit is None and args.floor_from:  # the floor depends on the routing only: the same model, prompt and budget
        with open(args.floor_from) as f:
            earlier = [r for r in json.load(f)["rows"] if (r["model"], r["budget"], r["system"]) == (key, budget_label, "lru")]
        if earlier:  # its Belady bytes over this machine's link (the earlier file's host may have had another)
            per_token = earlier[0]["belady_bytes_per_token"]
            own = compute_limit(wl.facts, None, result["bandwidth"])  # this device's own bound, for the max
            transfer_s = per_token / (result["bandwidth"]["h2d_gbps"] * GB)
            limit = dict(limit_s=max(own["compute_s"], transfer_s), belady_bytes_per_token=per_token)
    if limit is not None:
        raw = next((r["record_bytes"] for r in rows + earlier if r["system"] == "lru"), None)
        lossless = next((r["record_bytes"] for r in rows if r.get("codec") == "lossless" and "split" not in r["system"]), None)
        for r in rows:
            r["limit_s"], r["belady_bytes_per_token"] = limit["limit_s"], limit["belady_bytes_per_token"]
            if r.get("b1_tok_s"):
                r["x_limit"] = 1.0 / r["b1_tok_s"] / limit["limit_s"]
                if raw and lossless:
                    r["x_limit_lossless"] = r["x_limit"] * raw / lossless
    result["rows"].extend(rows)
    base = None
    free_device_cache()


def host_costs(m) -> dict:
    """What the split's planner measured after batch 1 (seconds): the link, a host job's fixed cost and lag, and
    the first split layer's host time per expert part by rows."""
    c = m.host.costs
    table = c.host_s.get(m.first_ordinal, {})
    return dict(
        link_gb_per_s=c.link_bytes_per_s / GB if c.link_bytes_per_s else None,
        host_overhead_s=c.host_overhead_s,
        host_lag_s=c.host_lag_s,
        host_part_s={str(n): t for n, t in sorted(table.items())},
        host_part_bytes=m.host.parts.expert_bytes(m.first_ordinal) if m.host.parts is not None else None,
    )


def copied_share(before: dict, after: dict) -> float | None:
    """Of the expert uses between two `stats()`, the share whose host part was copied to the device (split)."""
    uses = after["hits"] + after["misses"] - before["hits"] - before["misses"]
    return (after["parts_copied"] - before["parts_copied"]) / uses if uses else None


def render(result: dict, title: str = TITLE) -> str:
    lines = [
        f"# {title}",
        "",
        f"`{result['command']}` on {result['env'].get('device')} ({result['env'].get('cpu_count')} host cores), "
        f"torch {result['env']['torch']}, transformers {result['env']['transformers']}, {result['env']['date']}.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for r in result["rows"]:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in COLUMNS) + " |")
    print_table(result["rows"], COLUMNS)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
