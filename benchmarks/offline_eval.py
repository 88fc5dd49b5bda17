"""Offline evaluation of the expert cache (CPU): record routing traces, replay them through every
policy × predictor at several budgets, beside Belady's optimal demand cache on the same trace.

Models: the bundled trained mira-tiny on its held-out text (the learned predictor calibrated on
windows [0, calib_windows), evaluation on the next eval_windows), and a tiny random Mixtral
(mira_hf.testing recipe, `--random-layers` MoE layers) on random tokens, for contrast.

    python benchmarks/offline_eval.py [--quick] [--eval-windows 8] [--eval-tokens 128] [--no-sweep] [--out DIR]
    python benchmarks/offline_eval.py --zoo ~/.cache/mira-hf/zoo   (models from scripts/train_zoo.py)

With `--zoo DIR`, the evaluation runs over mira-tiny and every model of the zoo instead: per model its
routing statistics, then per budget Belady's bytes beside LRU, heat alone, the default uncalibrated
(heat + gate), calibrated on its own held-out text, and calibrated on another model's text (all share
mira-tiny's tokenizer), written to DIR/<date>-cpu-zoo-offline-eval.json and .md (see `zoo_main`). With
`--prompt-tokens P` too, each evaluation window's first P tokens are its prompt, served as one forward as `generate`
serves it; the counts are the decoding's after it, a row with the prompt counted as one step is added, and the
files are named ...-cpu-zoo-offline-eval-prompts. `--concurrency B` decodes B windows together (files ...-bB).

Then the best predictive configs are replayed again over stage_fraction × stage_probability (and
stage_lookahead 2) (`--no-sweep` skips it). A replay counts an expert in flight as a hit, as the runtime's
telemetry does: whether a copy arrives in time is for the GPU benchmarks to measure.

Prints a table per model and budget and the headline comparisons (bytes against Belady's, hit rate
against LRU, recall of the learned predictor against the gate, stall-causing misses against LRU's), and writes
DIR/<date>-cpu-offline-eval.json and .md (`-quick` appended with --quick).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from common import environment, print_table, write_json  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel, config  # noqa: E402
from mira_hf.bundled import bundled_model_path  # noqa: E402
from mira_hf.replay import belady, replay  # noqa: E402
from mira_hf.trace import record_trace  # noqa: E402

BUDGETS = (0.10, 0.25, 0.50)
POLICIES = config.POLICIES
PREDICTORS = tuple(p for p in config.PREDICTORS if p != "auto")  # "auto" is "learned" or "gate", both in the grid
DEFAULTS = MiraConfig()  # the grid runs at its stage_fraction and PredictorConfig; "default" is its policy + predictor
SWEEP_STAGE = (0.25, 0.5)
SWEEP_PROBABILITY = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)  # PredictorConfig.stage_probability: how likely a guess must be to be copied
SWEEP_STAGE_LOOKAHEAD = (2,)  # beside the default, at the default stage fraction and stage probability
COLUMNS = ["policy", "predictor", "hit%", "misses", "loads", "wasted", "MB/tok", "xBelady", "r@1", "r@2", "p@1", "p@2"]


def learned_predictor(model, calib_ids: torch.Tensor, epochs: int):
    """A calibrated `learned` predictor, or (None, why) when mira_hf.calibrate is not available."""
    try:
        from mira_hf.calibrate import calibrate
    except ImportError as exc:
        return None, f"mira_hf.calibrate unavailable: {exc}"
    saved = model.mira.predictor
    try:
        predictor = calibrate(model, calib_ids, epochs=epochs, max_tokens=calib_ids.numel(), progress=False)
    finally:
        model.mira.predictor = saved  # calibrate installs it; replays get it explicitly instead
    return predictor, None


def evaluate(name: str, model, trace, learned, budgets, sweep: bool) -> dict:
    """Every budget × policy × predictor on `trace`, Belady beside; optional parameter sweep."""
    router_probs = model.mira.router_probs
    predictors = [p for p in PREDICTORS if p != "learned" or learned is not None]
    out = {"belady": {}, "results": [], "sweep": []}

    def run(budget, policy, predictor, **kw):
        obj = learned if predictor == "learned" else None
        kw.setdefault("stage_fraction", DEFAULTS.cache.stage_fraction)
        kw.setdefault("predictor_config", DEFAULTS.prediction)
        r = replay(
            trace,
            budget=budget,
            policy=policy,
            predictor=None if obj is not None else predictor,
            predictor_obj=obj,
            router_probs=router_probs,
            heat=DEFAULTS.heat,
            priority=DEFAULTS.priority,
            **kw,
        )
        r["config"]["predictor"] = predictor
        return r

    for budget in budgets:
        best = belady(trace, budget=budget)
        out["belady"][budget] = best
        rows = [dict(policy="belady", predictor="(optimal)", **_row(best, best))]
        for policy in POLICIES:
            for predictor in predictors:
                r = run(budget, policy, predictor)
                out["results"].append(r)
                rows.append(dict(policy=policy, predictor=predictor or "-", **_row(r, best)))
        print(f"\n## {name}: budget {budget:.0%} ({out['results'][-1]['config']['slots']} slots), {trace.steps} tokens")
        out.setdefault("tables", {})[budget] = print_table(rows, COLUMNS)

    if sweep:
        for budget in budgets:
            top = sorted(
                (r for r in out["results"] if r["config"]["budget"] == budget and r["config"]["predictor"]),
                key=lambda r: -r["hit_rate"],
            )[: 2 if budget == 0.25 else 1]  # the comparisons' budget gets two configs
            rows = []
            for base in top:
                policy, predictor = base["config"]["policy"], base["config"]["predictor"]
                d_stage, d_pred = DEFAULTS.cache.stage_fraction, DEFAULTS.prediction
                grid = [(s, q, d_pred.stage_lookahead) for s in SWEEP_STAGE for q in SWEEP_PROBABILITY]
                grid += [(d_stage, d_pred.stage_probability, la) for la in SWEEP_STAGE_LOOKAHEAD]
                for stage, probability, lookahead in grid:
                    cfg = dataclasses.replace(d_pred, stage_probability=probability, stage_lookahead=lookahead)
                    r = run(budget, policy, predictor, stage_fraction=stage, predictor_config=cfg)
                    out["sweep"].append(r)
                    rows.append(
                        dict(
                            policy=policy,
                            predictor=predictor,
                            stage=stage,
                            stage_probability=probability,
                            stage_lookahead=lookahead,
                            **_row(r, out["belady"][budget]),
                        )
                    )
            print(f"\n## {name}: sweep at budget {budget:.0%}")
            out.setdefault("sweep_tables", {})[budget] = print_table(
                rows,
                [
                    "policy",
                    "predictor",
                    "stage",
                    "stage_probability",
                    "stage_lookahead",
                    "hit%",
                    "misses",
                    "loads",
                    "MB/tok",
                    "xBelady",
                ],
            )
    return out


def _row(r: dict, best: dict) -> dict:
    f = lambda v: None if v is None else round(v, 3)  # noqa: E731
    return {
        "hit%": round(100 * r["hit_rate"], 1),
        "misses": r["misses"],
        "loads": r["loads"],
        "wasted": r.get("prefetch_wasted"),
        "MB/tok": round(r["bytes_per_token"] / 1e6, 3),
        "xBelady": round(r["bytes_moved"] / best["bytes_moved"], 2) if best["bytes_moved"] else None,
        "r@1": f(r.get("recall@1")),
        "r@2": f(r.get("recall@2")),
        "p@1": f(r.get("precision@1")),
        "p@2": f(r.get("precision@2")),
    }


def comparisons(name: str, ev: dict) -> list[dict]:
    """The headline comparisons, at 25% (and 10% for hit rates): measurements, not verdicts."""

    def find(budget, policy, predictor):
        for r in ev["results"]:
            c = r["config"]
            if c["budget"] == budget and c["policy"] == policy and c["predictor"] == predictor:
                return r
        return None

    def label(r):
        text = f"{r['config']['policy']}+{r['config']['predictor'] or 'none'}"
        pc, default = r["config"]["predictor_config"], dataclasses.asdict(DEFAULTS.prediction)
        changed = [f"{k} {pc[k]}" for k in ("stage_probability", "stage_lookahead") if pc[k] != default[k]]
        stage = r["config"]["stage_fraction"]
        changed += [f"stage_fraction {stage}"] if stage != DEFAULTS.cache.stage_fraction else []
        return text + (f" ({', '.join(changed)})" if changed else "")

    out = []

    def check(cid, text):
        out.append(dict(model=name, comparison=cid, detail=text))
        print(f"[{name}] ({cid}) {text}")

    b = 0.25
    at = [r for r in ev["results"] if r["config"]["budget"] == b]
    bel = ev["belady"][b]["bytes_moved"]
    best = max(at, key=lambda r: r["hit_rate"])
    auto = "learned" if find(b, "lru", "learned") is not None else "gate"  # what "auto" resolves to once calibrated
    default = find(b, DEFAULTS.policy, auto if DEFAULTS.predictor == "auto" else DEFAULTS.predictor)
    fewest = min(at, key=lambda r: r["bytes_moved"])
    for what, r in (("best (highest hit rate)", best), ("MiraConfig() default", default), ("fewest bytes", fewest)):
        ratio = r["bytes_moved"] / bel
        check("bytes", f"25%: bytes moved by {what} config {label(r)} = {ratio:.2f} x Belady's")
    for bb in (0.10, 0.25):
        rows = [r for r in ev["results"] if r["config"]["budget"] == bb]
        top = max(rows, key=lambda r: r["hit_rate"])
        lru = find(bb, "lru", None)
        gain = 100 * (top["hit_rate"] - lru["hit_rate"])
        check(
            "hit rate",
            f"{bb:.0%}: best hit rate {100 * top['hit_rate']:.1f}% ({label(top)}) vs LRU {100 * lru['hit_rate']:.1f}%: "
            f"{gain:+.1f} points",
        )
    learned, gate = find(b, "lru", "learned"), find(b, "lru", "gate")
    if learned is None:
        check("recall", "learned predictor unavailable (mira_hf.calibrate missing)")
    else:
        r2 = learned["recall@2"]
        per = {
            layer: (row.get("recall@2"), gate["per_layer"][layer].get("recall@2"))
            for layer, row in learned["per_layer"].items()
            if row.get("recall@2") is not None
        }
        shown = ", ".join(f"L{layer} {lv:.3f}/{gv:.3f}" for layer, (lv, gv) in per.items())
        check(
            "recall",
            f"learned recall@2 = {r2:.3f} (precision@2 {learned['precision@2']:.3f}); learned/gate recall@2 per layer: {shown}",
        )
    # any configuration with prediction on, the sweep's included (the default's is among the byte comparisons)
    predictive = [r for r in at + [s for s in ev["sweep"] if s["config"]["budget"] == b] if r["config"]["predictor"]]
    fewest_misses = min(predictive, key=lambda r: r["misses"])
    lru = find(b, "lru", None)
    share = fewest_misses["misses"] / lru["misses"]
    check(
        "stalls",
        f"25%: stall-causing misses with prediction ({label(fewest_misses)}) = {fewest_misses['misses']} = "
        f"{share:.0%} of LRU's {lru['misses']}",
    )
    return out


def trace_info(trace) -> dict:
    return dict(
        steps=trace.steps,
        sequences=len(trace.sequence_starts),
        moe_layers=trace.num_layers,
        num_experts=trace.num_experts,
        top_k=trace.top_k,
        record_bytes=trace.record_bytes,
        expert_bytes=trace.expert_bytes,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI-sized: a few short windows, fewer epochs, no sweep")
    ap.add_argument("--calib-windows", type=int, default=32, help="held-out windows calibrating the learned predictor")
    ap.add_argument("--calib-tokens", type=int, default=256, help="tokens per calibration window (full-sequence forwards: cheap)")
    ap.add_argument("--eval-windows", type=int, default=8, help="held-out windows decoded for the evaluation trace")
    ap.add_argument("--eval-tokens", type=int, default=128, help="tokens per evaluation window (one forward per token)")
    ap.add_argument("--random-layers", type=int, default=6, help="MoE layers of the tiny random Mixtral")
    ap.add_argument("--random-eval-windows", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=30, help="calibration epochs of the learned predictor")
    ap.add_argument("--no-sweep", action="store_true", help="skip the stage_fraction / confidence / lookahead sweep")
    ap.add_argument("--no-random", action="store_true", help="skip the tiny random model")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; more only help big models: on a busy 2-core host OpenMP waits cost 100x",
    )
    ap.add_argument("--trace-dir", default=None, help="also save the recorded traces there (RoutingTrace.load reads them back)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--zoo", default=None, help="evaluate mira-tiny and the models of scripts/train_zoo.py in this directory")
    ap.add_argument("--zoo-models", nargs="*", default=None, help="with --zoo: only these models (mira-tiny is one)")
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="with --zoo: each evaluation window's first tokens are its prompt (one forward, as generate's prefill); "
        "the counts are the decoding's, and a row with the prompt counted as one step (HeatConfig.seed_from_prompt off) "
        "is added",
    )
    ap.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="with --zoo: windows decoded together, as batched generate decodes them (the use rates as generate keeps "
        "them, not a server's batch-aware estimates); with --prompt-tokens their prompts are one forward",
    )
    args = ap.parse_args()
    if args.zoo:
        from _zoo_eval import zoo_main

        zoo_main(args)
        return
    if args.quick:
        args.calib_windows, args.calib_tokens, args.eval_windows, args.eval_tokens = 4, 64, 2, 32
        args.random_eval_windows, args.epochs, args.no_sweep = 2, 3, True
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    defaults = dict(
        policy=DEFAULTS.policy,
        predictor=DEFAULTS.predictor,
        stage_fraction=DEFAULTS.cache.stage_fraction,
        prediction=dataclasses.asdict(DEFAULTS.prediction),
    )
    report: dict = dict(environment=environment(), args=vars(args), mira_config_defaults=defaults, models={}, comparisons=[])

    # -- the bundled trained model on held-out text ---------------------------------------------
    from safetensors.torch import load_file

    path = bundled_model_path()
    heldout = load_file(os.path.join(path, "heldout_tokens.safetensors"))["input_ids"].long()  # [64, 256]
    n = heldout.shape[0]
    if args.calib_windows + args.eval_windows > n:
        raise SystemExit(f"--calib-windows + --eval-windows must be <= {n} (held-out windows)")
    calib_ids = heldout[: args.calib_windows, : args.calib_tokens]
    eval_ids = heldout[args.calib_windows : args.calib_windows + args.eval_windows, : args.eval_tokens]
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=1.0, device="cpu"), dtype=torch.float32, progress=False)
    t = time.perf_counter()
    trace = record_trace(model, eval_ids, progress=False)
    timings["mira-tiny record"] = time.perf_counter() - t
    if args.trace_dir:
        trace.save(os.path.join(args.trace_dir, "mira-tiny-eval"))
    t = time.perf_counter()
    learned, why = learned_predictor(model, calib_ids, args.epochs)
    timings["mira-tiny calibrate"] = time.perf_counter() - t
    if why:
        print(f"learned predictor skipped: {why}")
    t = time.perf_counter()
    ev = evaluate("mira-tiny (trained, held-out text)", model, trace, learned, BUDGETS, sweep=not args.no_sweep)
    timings["mira-tiny replays"] = time.perf_counter() - t
    report["models"]["mira-tiny"] = dict(
        trace=trace_info(trace),
        calibration=dict(windows=list(calib_ids.shape), learned=getattr(learned, "summary", None), skipped=why),
        evaluation_windows=[args.calib_windows, args.calib_windows + args.eval_windows, args.eval_tokens],
        **ev,
    )

    # -- a tiny random Mixtral on random tokens (no structure to learn: the contrast) ----------------
    if not args.no_random:
        from transformers import AutoModelForCausalLM

        from mira_hf.testing import make_config

        cfg = make_config("mixtral")
        cfg.num_hidden_layers = args.random_layers
        torch.manual_seed(0)
        rnd = MiraMoEModel.wrap(AutoModelForCausalLM.from_config(cfg).eval(), MiraConfig(gpu_budget=1.0, device="cpu"))
        g = torch.Generator().manual_seed(0)
        r_calib = torch.randint(3, cfg.vocab_size, (args.calib_windows, args.calib_tokens), generator=g)
        r_eval = torch.randint(3, cfg.vocab_size, (args.random_eval_windows, args.eval_tokens), generator=g)
        t = time.perf_counter()
        r_trace = record_trace(rnd, r_eval, progress=False)
        if args.trace_dir:
            r_trace.save(os.path.join(args.trace_dir, "tiny-random-eval"))
        r_learned, r_why = learned_predictor(rnd, r_calib, args.epochs)
        timings["random record+calibrate"] = time.perf_counter() - t
        t = time.perf_counter()
        r_ev = evaluate(
            f"tiny random Mixtral ({args.random_layers} layers, random tokens)", rnd, r_trace, r_learned, BUDGETS, sweep=False
        )
        timings["random replays"] = time.perf_counter() - t
        report["models"]["tiny-random-mixtral"] = dict(
            trace=trace_info(r_trace), calibration=dict(learned=getattr(r_learned, "summary", None), skipped=r_why), **r_ev
        )

    print("\n## Comparisons")
    report["comparisons"] = comparisons("mira-tiny", ev)
    if not args.no_random:
        report["comparisons"] += comparisons("tiny-random", r_ev)
    timings["total"] = time.perf_counter() - t_start
    report["timings_s"] = {k: round(v, 1) for k, v in timings.items()}
    print("\ntimings (s):", report["timings_s"])

    stem = os.path.join(args.out, f"{report['environment']['date']}-cpu-offline-eval" + ("-quick" if args.quick else ""))
    write_json(stem + ".json", _rounded(report))
    with open(stem + ".md", "w") as f:
        f.write(markdown(report))
    print(f"wrote {stem}.json and {stem}.md")


def _rounded(obj):
    """Floats to 4 significant digits: the JSON stays small enough to commit."""
    if isinstance(obj, float):
        return float(f"{obj:.4g}")
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rounded(v) for v in obj]
    return obj


def markdown(report: dict) -> str:
    lines = ["# Offline evaluation (CPU replay)", "", f"Environment: `{report['environment']}`", ""]
    for name, m in report["models"].items():
        t = m["trace"]
        lines += [
            f"## {name}",
            "",
            f"{t['steps']} decode steps ({t['sequences']} sequences), {t['moe_layers']} MoE layers × "
            f"{t['num_experts'][0]} experts, top-{t['top_k']}, {t['record_bytes'][0]:,} bytes per expert.",
            "",
        ]
        for budget, table in m["tables"].items():
            lines += [f"### budget {float(budget):.0%}", "", _md_table(table), ""]
        for budget, table in m.get("sweep_tables", {}).items():
            lines += [f"### sweep at budget {float(budget):.0%}", "", _md_table(table), ""]
    lines += ["## Comparisons", ""]
    lines += [f"- [{c['model']}] ({c['comparison']}) {c['detail']}" for c in report["comparisons"]]
    lines += ["", f"Timings (s): {report['timings_s']}", ""]
    return "\n".join(lines)


def _md_table(text: str) -> str:
    rows = text.splitlines()
    out = ["| " + " | ".join(c.strip() for c in rows[0].split(" | ")) + " |"]
    out.append("|" + "---|" * len(rows[0].split(" | ")))
    out += ["| " + " | ".join(c.strip() for c in r.split(" | ")) + " |" for r in rows[2:]]
    return "\n".join(out)


if __name__ == "__main__":
    main()
