"""`offline_eval.py --zoo DIR`: the cache's defaults over mira-tiny and the trained zoo (scripts/train_zoo.py).

Per model: routing statistics of the evaluation trace (skew: share of the top 20% experts; reuse: share of a
token's experts the previous token also used; benchmarks/routing_stats.py), then per budget (10%, 25%, 50%)
Belady's bytes beside

- `lru`: the reactive baseline;
- `heat`: the default policy without prediction;
- `default, uncalibrated`: `MiraConfig()` before `calibrate` ("auto" is then the gate predictor);
- `default, calibrated`: after `calibrate` on the model's own held-out text ("auto" is the learned predictor);
- `default, cross-domain`: calibrated on another model's held-out text (another domain; every zoo model shares
  mira-tiny's tokenizer, so any model's text is valid input for any other).

Each row: bytes moved × Belady's, hit rate and its gain over LRU, stall-causing misses as a share of LRU's,
recall and precision at 1 and 2 layers ahead (of the guesses counted: probability ≥ `PredictorConfig.confidence`).
Per budget also where the bytes went (`decomposition`): demand loads, prefetches used and prefetches never used,
each × Belady's loads. Windows: calibration on held-out rows [0, calib_windows), evaluation on the next
eval_windows rows (as for mira-tiny in the main mode), cross-domain calibration on the other model's rows
[0, calib_windows).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import torch
from common import environment, print_table, write_json
from offline_eval import BUDGETS, DEFAULTS, _md_table, _rounded, learned_predictor, trace_info
from routing_stats import routing_stats
from safetensors.torch import load_file

from mira_hf import ConfigError, MiraConfig, MiraMoEModel
from mira_hf.bundled import bundled_model_path
from mira_hf.replay import belady, replay
from mira_hf.trace import record_trace

TINY = "mira-tiny"
COLUMNS = ["config", "hit%", "vs LRU", "stalls/LRU", "xBelady", "r@1", "p@1", "r@2", "p@2"]
# What a default has to do on every model (bytes as × Belady's; hit rate as points over LRU's).
GOALS = dict(calibrated_25=1.3, hit_gain_25=0.10, uncalibrated_25=1.5, calibrated_other=1.4, cross_domain_loss=0.1)


def zoo_models(zoo_dir: str, only: list[str] | None) -> list[tuple[str, str, str]]:
    """(name, path, domain) of mira-tiny and every model scripts/train_zoo.py wrote into `zoo_dir`."""
    index = os.path.join(zoo_dir, "zoo.json")
    if not os.path.exists(index):
        raise SystemExit(f"{index} not found: train the zoo first (python scripts/train_zoo.py --dir {zoo_dir}).")
    models = [(TINY, bundled_model_path(), "python-sources")]
    for name, info in json.load(open(index))["models"].items():
        models.append((name, os.path.join(zoo_dir, name), info["domain"]))
    return [m for m in models if only is None or m[0] in only]


def training_of(path: str) -> dict:
    """What reproduces a zoo model's weights (`scripts/train_zoo.py --models NAME --steps STEPS --minutes 1e9` with
    the seed; the text is fingerprinted): from its training_report.json."""
    r = json.load(open(os.path.join(path, "training_report.json")))
    return dict(
        steps=r["steps"],
        seed=r["args"]["seed"],
        heldout_loss=r["heldout_loss"],
        corpus_sha256=r["data"]["corpus_sha256"],
        date_utc=r["date_utc"],
    )


def trace_routing_stats(trace) -> dict:
    """routing_stats of a recorded trace: each sequence's steps are consecutive tokens."""
    B = len(trace.sequence_starts)
    S = trace.steps // B
    experts = trace.experts[: B * S].reshape(B, S, trace.num_layers, -1)  # [B, S, L, K]
    layers = [experts[:, :, layer] for layer in range(trace.num_layers)]
    return routing_stats(layers, list(trace.num_experts))


def add_window_args(ap) -> None:
    """The zoo's arguments and the windows `load_windows` cuts: --zoo, --zoo-models, --calib-*, --eval-*."""
    ap.add_argument("--zoo", required=True, help="the directory scripts/train_zoo.py wrote")
    ap.add_argument("--zoo-models", nargs="*", default=None)
    ap.add_argument("--calib-windows", type=int, default=32, help="held-out windows that calibrate (before the evaluation's)")
    ap.add_argument("--calib-tokens", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--eval-tokens", type=int, default=128)


def load_windows(path: str, args) -> tuple[object, torch.Tensor, torch.Tensor]:
    """(the zoo model at `path` wrapped on the CPU in fp32, its calibration windows, its evaluation windows): the
    held-out tokens cut by `args.calib_windows`/`calib_tokens` and `eval_windows`/`eval_tokens`."""
    heldout = load_file(os.path.join(path, "heldout_tokens.safetensors"))["input_ids"].long()  # [64, 256]
    calib_ids = heldout[: args.calib_windows, : args.calib_tokens]
    eval_ids = heldout[args.calib_windows : args.calib_windows + args.eval_windows, : args.eval_tokens]
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=1.0, device="cpu"), dtype=torch.float32, progress=False)
    return model, calib_ids, eval_ids


def new_report(args, **fields) -> dict:
    """A result's opening: the environment, the arguments (but where it is written), `fields`, no models yet."""
    return dict(environment=environment(), args={k: v for k, v in vars(args).items() if k != "out"}, **fields, models={})


def write_report(report: dict, out: str, name: str, markdown_text: str) -> None:
    """OUT/<date>-<name>.json (figures rounded) and .md."""
    stem = os.path.join(out, f"{report['environment']['date']}-{name}")
    write_json(stem + ".json", _rounded(report))
    with open(stem + ".md", "w") as f:
        f.write(markdown_text)
    print(f"wrote {stem}.json and {stem}.md")


def run_zoo(args, name: str, measure, markdown_of) -> None:
    """`measure(model name, path, args) -> dict` for each zoo model, on one CPU thread, into one report with the
    run's seconds, written as OUT/<date>-<name>.json and .md (`markdown_of(report)`)."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    report = new_report(args)
    for model_name, path, _ in zoo_models(args.zoo, args.zoo_models):
        report["models"][model_name] = measure(model_name, path, args)
    report["timings_s"] = round(time.perf_counter() - start, 1)
    write_report(report, args.out, name, markdown_of(report))


def evaluate_model(name: str, path: str, cross: tuple[str, torch.Tensor], args) -> dict:
    model, calib_ids, eval_ids = load_windows(path, args)
    cross_name, cross_ids = cross
    timings = {}
    t = time.perf_counter()
    trace = record_trace(model, eval_ids, progress=False)
    timings["record"] = time.perf_counter() - t
    t = time.perf_counter()
    learned, why = learned_predictor(model, calib_ids, args.epochs)
    crossed, why_cross = learned_predictor(model, cross_ids[: args.calib_windows, : args.calib_tokens], args.epochs)
    timings["calibrate"] = time.perf_counter() - t
    if why or why_cross:
        raise SystemExit(f"calibration unavailable: {why or why_cross}")
    router_probs = model.mira.router_probs
    configs = {
        "lru": dict(policy="lru"),
        "heat": dict(policy=DEFAULTS.policy),
        "default, uncalibrated": dict(policy=DEFAULTS.policy, predictor="gate"),
        "default, calibrated": dict(policy=DEFAULTS.policy, predictor_obj=learned),
        f"default, calibrated on {cross_name}": dict(policy=DEFAULTS.policy, predictor_obj=crossed),
    }
    prompt, concurrency = getattr(args, "prompt_tokens", 0), getattr(args, "concurrency", 1)
    if prompt:  # what seeding the use rates from the prompt's shares gives: the same default without it
        configs["default, calibrated, prompt as one step"] = dict(
            policy=DEFAULTS.policy, predictor_obj=learned, heat=dataclasses.replace(DEFAULTS.heat, seed_from_prompt=False)
        )
    out = dict(
        family=model.config.model_type,
        trace=trace_info(trace),
        routing=trace_routing_stats(trace),
        cross_domain_text=cross_name,
        budgets={},
    )
    t = time.perf_counter()
    for budget in BUDGETS:
        try:
            best = belady(trace, budget=budget, prompt_tokens=prompt, concurrency=concurrency)
        except ConfigError as e:  # a batch's block needs more experts than the budget's slots: no bound to compare with
            if "slots" not in str(e):
                raise  # anything else (prompts that do not line up with the batch) is the caller's to fix
            print(f"\n## {name}: budget {budget:.0%} skipped: {e}")
            continue
        results = {}
        for label, kw in configs.items():
            results[label] = replay(
                trace,
                budget=budget,
                router_probs=router_probs,
                stage_fraction=DEFAULTS.cache.stage_fraction,
                predictor_config=DEFAULTS.prediction,
                priority=DEFAULTS.priority,
                prompt_tokens=prompt,
                concurrency=concurrency,
                batch_aware=False,  # batched generate's use rates, not a server's estimates
                **{"heat": DEFAULTS.heat, **kw},
            )
        lru = results["lru"]
        rows = [dict(config="belady", **{"hit%": round(100 * best["hit_rate"], 1), "xBelady": 1.0})]
        for label, r in results.items():
            rows.append(
                {
                    "config": label,
                    "hit%": round(100 * r["hit_rate"], 1),
                    "vs LRU": round(100 * (r["hit_rate"] - lru["hit_rate"]), 1),
                    "stalls/LRU": round(r["misses"] / lru["misses"], 3) if lru["misses"] else None,
                    "xBelady": round(r["bytes_moved"] / best["bytes_moved"], 3) if best["bytes_moved"] else None,
                    **{
                        f"{m[0]}@{d}": None if r.get(f"{m}@{d}") is None else round(r[f"{m}@{d}"], 3)
                        for d in (1, 2)
                        for m in ("recall", "precision")
                    },
                }
            )
        prompts = f", each window's first {prompt} tokens its prompt" if prompt else ""
        print(f"\n## {name}: budget {budget:.0%} ({lru['config']['slots']} slots), {lru['tokens']} tokens decoded{prompts}")
        table = print_table(rows, COLUMNS)
        out["budgets"][str(budget)] = dict(
            belady=dict(bytes_moved=best["bytes_moved"], hit_rate=best["hit_rate"], misses=best.get("misses")),
            decomposition={label: decomposition(r, best) for label, r in results.items()},
            rows=rows,
            table=table,
        )
    timings["replays"] = time.perf_counter() - t
    out["timings_s"] = {k: round(v, 1) for k, v in timings.items()}
    return out


def decomposition(r: dict, best: dict) -> dict:
    """Where a replay's loads went, × Belady's loads: demand loads (misses copied when needed), prefetches its
    blocks used, prefetches never used."""
    if not best["loads"]:
        return {}
    used = r["prefetch_used"]
    parts = dict(demand=r["loads"] - r["prefetches"], prefetch_used=used, prefetch_unused=r["prefetches"] - used)
    return {k: round(v / best["loads"], 3) for k, v in parts.items()}


def goals(name: str, m: dict) -> dict:
    """How each model's default compares with what it has to do (GOALS): the measured value and the margin."""
    by = {b: {r["config"]: r for r in m["budgets"][b]["rows"]} for b in m["budgets"]}
    cross = next((k for rows in by.values() for k in rows if k.startswith("default, calibrated on")), None)
    row = lambda b, config, key: by[b][config][key] if b in by else None  # noqa: E731 (a budget skipped: no value)
    g = {}
    g["calibrated_25"] = row("0.25", "default, calibrated", "xBelady")
    gain = row("0.25", "default, calibrated", "vs LRU")
    g["hit_gain_25"] = None if gain is None else gain / 100
    g["uncalibrated_25"] = row("0.25", "default, uncalibrated", "xBelady")
    g["calibrated_10"] = row("0.1", "default, calibrated", "xBelady")
    g["calibrated_50"] = row("0.5", "default, calibrated", "xBelady")
    losses = [by[b][cross]["xBelady"] - by[b]["default, calibrated"]["xBelady"] for b in by]
    g["cross_domain_loss"] = max(losses) if losses else None
    limits = dict(calibrated_25=GOALS["calibrated_25"], uncalibrated_25=GOALS["uncalibrated_25"])
    limits.update(calibrated_10=GOALS["calibrated_other"], calibrated_50=GOALS["calibrated_other"])
    limits.update(cross_domain_loss=GOALS["cross_domain_loss"])
    met = {k: None if g[k] is None else g[k] <= limit for k, limit in limits.items()}
    met["hit_gain_25"] = None if g["hit_gain_25"] is None else g["hit_gain_25"] >= GOALS["hit_gain_25"]
    return dict(values=g, met=met)


def zoo_main(args) -> None:
    torch.set_num_threads(args.threads)
    if args.quick:
        args.calib_windows, args.calib_tokens, args.eval_windows, args.eval_tokens, args.epochs = 4, 64, 2, 32, 3
    start = time.perf_counter()
    models = zoo_models(args.zoo, args.zoo_models)
    every = zoo_models(args.zoo, None)
    texts = {name: load_file(os.path.join(path, "heldout_tokens.safetensors"))["input_ids"].long() for name, path, _ in every}
    names = [m[0] for m in every]
    report = new_report(
        args,
        mira_config_defaults=dict(policy=DEFAULTS.policy, predictor=DEFAULTS.predictor),
        goals=GOALS,
        zoo_fingerprint=json.load(open(os.path.join(args.zoo, "zoo.json")))["fingerprint"],
    )
    for name, path, domain in models:
        other = names[(names.index(name) + 1) % len(names)]  # the next model's text: another domain
        m = evaluate_model(name, path, (other, texts[other]), args)
        m["domain"] = domain
        m["training"] = None if name == TINY else training_of(path)
        m["goals"] = goals(name, m)
        report["models"][name] = m
    report["timings_s"] = round(time.perf_counter() - start, 1)
    print("\n## Goals per model (values; False = not met)")
    for name, m in report["models"].items():
        print(name, m["goals"]["values"], {k: v for k, v in m["goals"]["met"].items() if v is False})
    suffix = ("-prompts" if args.prompt_tokens else "") + (f"-b{args.concurrency}" if args.concurrency > 1 else "")
    suffix += "-quick" if args.quick else ""
    write_report(report, args.out, "cpu-zoo-offline-eval" + suffix, markdown(report))


def markdown(report: dict) -> str:
    lines = ["# Offline evaluation over the model zoo (CPU replay)", "", f"Environment: `{report['environment']}`", ""]
    lines += [
        "| model | family | experts × top-k | domain | training steps | top-20% share | reuse | × Belady 10/25/50% (calibrated) |"
    ]
    lines += ["|---|---|---|---|---|---|---|---|"]
    for name, m in report["models"].items():
        t, r = m["trace"], m["routing"]
        x = [m["budgets"][b]["rows"] for b in m["budgets"]]
        cal = [next(row["xBelady"] for row in rows if row["config"] == "default, calibrated") for rows in x]
        lines.append(
            f"| {name} | {m['family']} | {t['num_experts'][0]} × {t['top_k']} | {m['domain']} | "
            f"{(m.get('training') or {}).get('steps', 'bundled')} | "
            f"{r['top20_share']['mean']:.3f} (uniform {r['chance_top20_share']:.3f}) | "
            f"{r['reuse']['mean']:.3f} (chance {r['chance_reuse']:.3f}) | {' / '.join(f'{v:.2f}' for v in cal)} |"
        )
    lines.append("")
    for name, m in report["models"].items():
        lines += [f"## {name}", ""]
        for budget, b in m["budgets"].items():
            lines += [f"### budget {float(budget):.0%}", "", _md_table(b["table"]), ""]
            parts = [
                f"{label}: {' + '.join(f'{v:.3f} {k}' for k, v in d.items() if v)}"
                for label, d in b.get("decomposition", {}).items()
                if label != "lru"
            ]
            lines += ["Loads × Belady's (demand, prefetch used, prefetch unused): " + "; ".join(parts) + ".", ""]
        lines += [f"Goals: {m['goals']['values']}; not met: {[k for k, v in m['goals']['met'].items() if not v]}", ""]
    lines += [f"Total time {report['timings_s']} s", ""]
    return "\n".join(lines)
