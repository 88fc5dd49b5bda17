"""Interleaved A/B of decode speed between two revisions of the package, for showing that a change meant to
keep behaviour (a refactor) left speed and outputs unchanged.

Each revision is a tree holding `mira_hf/` and `model_adapters/` (an older one made with `git archive`; the
newer one this checkout by default). The measuring code is this checkout's `benchmarks/` and uses only what
every revision offers: `MiraMoEModel.wrap`, `MiraConfig(gpu_budget, device[, quantization])`, `generate` and the manager's
`stats()`, `reset_stats()`. Every measurement runs in a fresh process that imports its revision through
PYTHONPATH (and checks that it did), so no allocator, pinned-memory or import state carries over; the
revisions alternate process by process and who goes first alternates pair by pair, so drift over the run
(heat, other tenants) falls on both. Each process builds the workload (bench's: random weights at real
dimensions built on the GPU, or the bundled trained model on its held-out text), wraps it with the default
configuration, keeps the last prompt position's logits, and decodes greedily at batch 1 (and batch
`--batch`) `--repeats` times through bench's phase loop.

Reported per revision: median decode tokens/s, hit rate and stall share; per pair the new/old ratio of
tokens/s (median, min, max over pairs); and whether the revisions agree: the same greedy tokens, the same
logits (`torch.equal`, with the largest difference where they are not).

    git archive 58f42eb mira_hf model_adapters | (mkdir -p /tmp/ab_old && tar -x -C /tmp/ab_old)
    python benchmarks/ab_revisions.py --old /tmp/ab_old --model mixtral --out benchmarks/results/   # GPU, est. 3.5 min
    python benchmarks/ab_revisions.py --old /tmp/ab_old --model bundled --smoke --out /tmp/ab        # CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # bench/ and common; never the checkout's root: each process imports its own tree

import torch  # noqa: E402
from common import device_slug, environment, print_table, write_json  # noqa: E402

MODELS = ("mixtral", "qwen3", "bundled")  # bench.workloads.WORKLOADS keys


# Per model on an H200: pairs by default, the batch of the second decode (0: batch 1 only) and the estimated seconds
# of one process (start-up, build, wrap with the default's encoding, logits, two repeats of the decodes; from
# run.py's measured wrap and decode times). The random shapes decode at 15-30 tok/s and their batched decode moves
# most experts per step, so they run batch 1.
DEFAULTS = {
    "mixtral": dict(pairs=2, batch=0, process_s=50.0),
    "qwen3": dict(pairs=3, batch=0, process_s=30.0),
    "bundled": dict(pairs=6, batch=8, process_s=12.0),
}
SMOKE = dict(pairs=2, batch=2, process_s=10.0, new_tokens=6, prompt_len=16, repeats=1)
RESULT_TAG = "AB_RESULT "


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="a tree with the older mira_hf/ and model_adapters/")
    ap.add_argument("--new", default=REPO, help="a tree with the newer ones (default: this checkout)")
    ap.add_argument("--model", choices=MODELS, default="bundled")
    ap.add_argument("--pairs", type=int, help="old/new process pairs (default: per model, see DEFAULTS)")
    ap.add_argument("--out", help="directory (gets DATE-DEVICE-MODEL[-FORMAT]-ab-revisions.json) or a .json path")
    ap.add_argument("--budget", type=float, default=0.25, help="gpu_budget, a fraction of the expert bytes")
    ap.add_argument(
        "--quantization",
        help="MiraConfig.quantization of both revisions (default: their own default), e.g. none to leave out the codecs",
    )
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, help="also decode this many sequences (0: batch 1 only; default: per model)")
    ap.add_argument("--repeats", type=int, default=2, help="timed decodes per process (its median is the process's)")
    ap.add_argument("--warmup-tokens", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=225.0, help="no pair starts that would end after this (s)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, a few tokens: checks the script")
    ap.add_argument("--child", metavar="TREE", help=argparse.SUPPRESS)  # one measurement, in this process
    ap.add_argument("--dump", help=argparse.SUPPRESS)  # the child's logits file
    args = ap.parse_args(argv)
    if args.child is None and (args.old is None or args.out is None):
        ap.error("--old and --out are required")
    d = DEFAULTS[args.model]
    if args.smoke:
        args.prompt_len = min(args.prompt_len, SMOKE["prompt_len"])
        args.new_tokens = min(args.new_tokens, SMOKE["new_tokens"])
        args.repeats = min(args.repeats, SMOKE["repeats"])
        d = SMOKE
    args.pairs = d["pairs"] if args.pairs is None else args.pairs
    args.batch = d["batch"] if args.batch is None else args.batch
    args.process_s = d["process_s"]
    for flag in ("pairs", "repeats", "new_tokens", "prompt_len"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give 1 or more")
    if args.new_tokens < 2:
        ap.error(f"--new-tokens {args.new_tokens}: decode speed needs 2 or more (the first token is the prefill's)")
    return args


def check_tree(path: str, flag: str) -> str:
    """The tree's absolute path, or an error naming what is missing and how to make such a tree."""
    path = os.path.abspath(path)
    missing = [d for d in ("mira_hf/__init__.py", "model_adapters/__init__.py") if not os.path.isfile(os.path.join(path, d))]
    if missing:
        raise SystemExit(
            f"{flag} {path}: no {' or '.join(missing)} there. Give a folder holding a revision's mira_hf/ and "
            "model_adapters/, e.g. made with: git archive REV mira_hf model_adapters | (mkdir -p DIR && tar -x -C DIR)"
        )
    return path


# -- one measurement (a child process) -----------------------------------------------------------
def child(args) -> dict:
    """Build, wrap and measure the workload with the revision on sys.path; the result as a JSON-able dict."""
    t0 = time.perf_counter()
    import mira_hf
    from mira_hf import MiraConfig, MiraMoEModel

    tree = os.path.realpath(args.child)
    where = os.path.realpath(mira_hf.__file__)
    if not where.startswith(tree + os.sep):
        raise SystemExit(f"imported mira_hf from {where}, not from {tree}: PYTHONPATH must put the tree first")
    from bench.clock import Deadline
    from bench.measure import Phase, free_device_cache, run_phases
    from bench.workloads import WORKLOADS, Workload, _pad_id

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda":
        torch.cuda.init()
        torch.backends.cuda.enable_cudnn_sdp(False)  # it builds a graph per new sequence length (NOTES.md, "Measuring")
    else:
        torch.set_num_threads(1)
    import_s = time.perf_counter() - t0
    label, shape, smoke_shape = WORKLOADS[args.model]
    wl = Workload(args.model, label, smoke_shape if args.smoke else shape, args.seed)
    t = time.perf_counter()
    model = wl.build(device)
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    q = args.quantization
    extra = {} if q is None else dict(quantization=None if q.lower() == "none" else q)  # every revision takes None
    MiraMoEModel.wrap(model, MiraConfig(gpu_budget=args.budget, device=device, **extra))
    wrap_s = time.perf_counter() - t
    manager = model.mira
    ids = wl.prompts(max(args.batch, 1), args.prompt_len, model.config.vocab_size, device)
    with torch.no_grad():  # as generate: state the first forward creates must stay writable outside inference mode
        logits = model(ids[:1]).logits[0, -1].float().cpu()  # [V] at the prompt's last position
    torch.save(logits, args.dump)
    phases = [Phase("b1", "batch-1 decode", ids[:1], args.new_tokens, tokens=True)]
    if args.batch > 1:
        phases.append(Phase("b8", f"batch-{args.batch} decode", ids, args.new_tokens, tokens=True))
    runs = []
    row: dict = dict(status="ok", notes=[])
    for _ in range(args.repeats):
        results = run_phases(model, phases, args.warmup_tokens, Deadline(1e9), _pad_id(model), row, manager)
        runs.append(results)
    stats = manager.stats()
    out = dict(
        tree=tree,
        mira_hf_file=where,
        device=device,
        import_s=import_s,
        build_s=build_s,
        wrap_s=wrap_s,
        quantization=stats.get("quantization"),
        slots=stats.get("slots"),
        peak_gpu_gb=row["peak_gpu_gb"],
        notes=row["notes"],
        logits_file=args.dump,
    )
    for p in phases:
        done = [r[p.key] for r in runs]
        tok_s = [p.ids.shape[0] * d["tok_s"] for d in done]  # tokens of every sequence of the batch, per second
        out[p.key] = dict(
            tok_s=statistics.median(tok_s),
            tok_s_runs=tok_s,
            hit_rate=statistics.median(d["hit_rate"] for d in done),
            stall_share=statistics.median(d["stall_share"] for d in done),
            tokens=done[0]["tokens"],
            tokens_repeat=all(d["tokens"] == done[0]["tokens"] for d in done),  # the process decoded the same each time
        )
    model = manager = None
    free_device_cache()
    return out


# -- the run -------------------------------------------------------------------------------------
def run_child(tree: str, args, dump: str, env: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", tree, "--dump", dump, "--model", args.model]
    cmd += ["--budget", str(args.budget), "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    cmd += [] if args.quantization is None else ["--quantization", args.quantization]
    cmd += ["--batch", str(args.batch), "--repeats", str(args.repeats), "--warmup-tokens", str(args.warmup_tokens)]
    cmd += ["--seed", str(args.seed)] + (["--smoke"] if args.smoke else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=dict(env, PYTHONPATH=tree), capture_output=True, text=True, timeout=timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-6:]
        raise RuntimeError(f"{tree}: exit {proc.returncode}: " + " | ".join(tail))
    out = json.loads(lines[-1][len(RESULT_TAG) :])
    out["process_s"] = time.perf_counter() - t0
    return out


def agreement(a: dict, b: dict, phases: list[str]) -> dict:
    """Whether two measurements computed the same: greedy tokens per phase, last-position logits."""
    la, lb = torch.load(a["logits_file"]), torch.load(b["logits_file"])
    out = {f"same_tokens_{p}": a[p]["tokens"] == b[p]["tokens"] for p in phases}
    out["same_logits"] = bool(torch.equal(la, lb))
    out["max_abs_logit_diff"] = float((la - lb).abs().max()) if la.shape == lb.shape else None
    return out


def summarize(pairs: list[dict], phases: list[str]) -> dict:
    """Per revision the median over processes; per pair the new/old ratio of tokens/s; agreement in every pair."""
    out: dict = dict(pairs=len(pairs))
    for rev in ("old", "new"):
        out[rev] = {
            p: dict(
                tok_s=statistics.median(x[rev][p]["tok_s"] for x in pairs),
                hit_rate=statistics.median(x[rev][p]["hit_rate"] for x in pairs),
                stall_share=statistics.median(x[rev][p]["stall_share"] for x in pairs),
            )
            for p in phases
        }
        out[rev]["wrap_s"] = statistics.median(x[rev]["wrap_s"] for x in pairs)
    for p in phases:
        ratios = [x["new"][p]["tok_s"] / x["old"][p]["tok_s"] for x in pairs]
        out[f"ratio_{p}"] = dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios), each=ratios)
    keys = [f"same_tokens_{p}" for p in phases] + ["same_logits"]
    out["agree"] = {k: all(x["agreement"][k] for x in pairs) for k in keys}
    diffs = [x["agreement"]["max_abs_logit_diff"] for x in pairs]
    out["agree"]["max_abs_logit_diff"] = None if None in diffs else max(diffs)
    # the same revision in different processes: nondeterminism, if any, shows here rather than as a difference
    out["repeatable"] = {
        rev: all(x[rev][p]["tokens"] == pairs[0][rev][p]["tokens"] and x[rev][p]["tokens_repeat"] for x in pairs for p in phases)
        for rev in ("old", "new")
    }
    return out


def table(summary: dict, phases: list[str]) -> list[dict]:
    rows = []
    for rev in ("old", "new"):
        row = {"revision": rev}
        for p in phases:
            s = summary[rev][p]
            row.update({f"{p} tok/s": s["tok_s"], f"{p} hit": s["hit_rate"], f"{p} stall": s["stall_share"]})
            if rev == "new":
                r = summary[f"ratio_{p}"]
                row[f"{p} new/old"] = f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"
        row["wrap s"] = summary[rev]["wrap_s"]
        rows.append(row)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(RESULT_TAG + json.dumps(child(args)), flush=True)
        return 0
    old, new = check_tree(args.old, "--old"), check_tree(args.new, "--new")
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA GPU visible: run on a GPU machine, or pass --smoke for the CPU check.", flush=True)
        return 2
    start = time.perf_counter()
    phases = ["b1"] + (["b8"] if args.batch > 1 else [])
    estimate = 2 * args.pairs * args.process_s
    print(
        f"{args.model}: {args.pairs} pairs of processes (old/new alternating), about {args.process_s:.0f} s each: "
        f"about {estimate / 60:.1f} min{'' if args.smoke else ' on an H200'}; pairs that would end after "
        f"{args.time_limit:.0f} s are not started",
        flush=True,
    )
    scratch = tempfile.mkdtemp(prefix="mira-ab-revisions-")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error")
    env["MIRA_HF_RECORD_CACHE"] = os.path.join(scratch, "records")  # no revision reads records another wrote
    pairs: list[dict] = []
    notes: list[str] = []
    slowest = args.process_s
    for i in range(args.pairs):
        left = args.time_limit - (time.perf_counter() - start)
        if left < 2 * slowest:
            notes.append(f"pairs {i + 1}-{args.pairs} not started: {left:.0f} s left, a pair takes about {2 * slowest:.0f} s")
            break
        order = ("old", "new") if i % 2 == 0 else ("new", "old")  # who goes first alternates
        pair: dict = {"first": order[0]}
        try:
            for rev in order:
                dump = os.path.join(scratch, f"logits-{i}-{rev}.pt")
                pair[rev] = run_child(old if rev == "old" else new, args, dump, env, timeout=max(left, 60.0))
                slowest = max(slowest, pair[rev]["process_s"])
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            notes.append(f"pair {i + 1}: {exc}"[:2000])
            print(f"pair {i + 1}: FAILED: {exc}", flush=True)
            break
        pair["agreement"] = agreement(pair["old"], pair["new"], phases)
        pairs.append(pair)
        line = ", ".join(f"{rev} {pair[rev]['b1']['tok_s']:.2f}" for rev in order)
        eta = (args.pairs - i - 1) * 2 * slowest
        print(f"pair {i + 1}/{args.pairs} ({order[0]} first): b1 tok/s {line}; about {eta:.0f} s to go", flush=True)
    result = dict(
        env=environment(),
        command=" ".join(["python", "benchmarks/ab_revisions.py", *(argv if argv is not None else sys.argv[1:])]),
        args={k: v for k, v in vars(args).items() if k not in ("child", "dump")},
        trees=dict(old=old, new=new),
        notes=notes,
        runs=pairs,
        summary=summarize(pairs, phases) if pairs else None,
        wall_s=time.perf_counter() - start,
    )
    for pair in result["runs"]:
        for rev in ("old", "new"):
            pair[rev].pop("logits_file")
    slug = device_slug(result["env"], not args.smoke)
    q = args.quantization
    encoding = "" if q is None else ("-uncompressed" if q.lower() == "none" else f"-{q}")  # the records' format, when given
    path = (
        args.out
        if args.out.endswith(".json")
        else os.path.join(args.out, f"{result['env']['date']}-{slug}-{args.model}{encoding}-ab-revisions.json")
    )
    write_json(path, result)
    if pairs:
        rows = table(result["summary"], phases)
        print_table(rows, list(dict.fromkeys(k for row in rows for k in row)))
        s = result["summary"]
        print(
            f"agreement over {len(pairs)} pairs: "
            + ", ".join(f"{k} {v}" for k, v in s["agree"].items())
            + f"; each revision repeatable: {s['repeatable']}"
        )
    for note in notes:
        print("NOTE:", note)
    print(f"wrote {path} ({result['wall_s']:.0f} s)", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0 if pairs and not notes else 1


if __name__ == "__main__":
    sys.exit(main())
