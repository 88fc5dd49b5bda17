"""Run transformers' own model and generation tests on MoE families, unwrapped and wrapped by mira-hf.

For each family, `tests/models/<family>/test_modeling_<family>.py` of a transformers source tree (its
`ModelTesterMixin` / `GenerationTesterMixin` suites) runs twice, one family and one mode at a time:

* unwrapped: as transformers runs it;
* wrapped: with `-p mira_wrap_plugin` (scripts/mira_wrap_plugin.py), which wraps every model a test builds with
  `MiraMoEModel.wrap(model, MiraConfig(gpu_budget=0.25, device="cpu"))` right after construction.

The result (per family: tests run, passed, failed, skipped in each mode; the tests that do not fail unwrapped and fail
wrapped, with the first line of each error) is written as JSON, by default to
`benchmarks/results/<date>-cpu-transformers-tests.json`; running some families updates their entries in an
existing file.

    python scripts/run_transformers_tests.py --tests-root /path/to/transformers-source [--families mixtral olmoe]

The tests are not in transformers' wheel: `--tests-root` is a source tree (its `tests/`, `utils/test_module`,
`conftest.py`, and `src/transformers`, which may be a link to the installed package) of the installed version.
Running it needs `parameterized` and `pytest-xdist` (transformers' conftest registers an xdist hook).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "deepseek_v3", "gpt_oss", "dbrx")

# Tests left out because each takes tens of seconds to minutes on a CPU and checks nothing mira-hf changes
# (each name is matched as a substring by pytest's -k).
SLOW_TESTS = {
    "test_eager_matches_sdpa_inference": "24 dtype x padding variants of eager vs sdpa attention, 10-15 s each; "
    "attention is untouched by mira-hf (the fp32 eager/sdpa equivalence is in tests/test_transformers_habits.py)",
    "test_eager_matches_batched_and_grouped_inference": "15-30 s each; compares transformers' experts "
    "implementations, which a wrapped model replaces by its proxy",
    "test_bc_torch_dtype": "~30 s; loads the model once per dtype spelling",
    "test_can_init_all_missing_weights": "~15 s; weight initialisation of a model built from scratch",
    "compil": "torch.compile tests (test_*compile*, test_generate_compilation_all_outputs): minutes each on a CPU",
    "test_training_overfit": "~270 s: trains the model for many steps (a wrapped model refuses backward at once)",
    "test_torch_export": "torch.export tests: minutes each",
    "test_flash_attn": "flash attention: needs a CUDA GPU",
}


def _k_expression(skip: dict[str, str]) -> str:
    return " and ".join(f"not {name}" for name in skip)


def _parse_junit(path: str) -> dict[str, dict]:
    """test id -> {"outcome": pass | fail | skip, "error": first line of the failure}."""
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, error = "pass", None
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "fail"
                text = (child.get("message") or child.text or "").strip()
                error = text.splitlines()[0][:300] if text else child.tag
                break
            if child.tag == "skipped":
                outcome = "skip"
        if test in results and results[test]["outcome"] == "fail":
            continue  # a teardown error reported beside a pass keeps the failure
        results[test] = {"outcome": outcome, "error": error, "time_s": float(case.get("time") or 0)}
    return results


def _test_file(family: str) -> str:
    return f"tests/models/{family}/test_modeling_{family}.py"


def run_family(tests_root: str, family: str, wrapped: bool, timeout_s: int, k_expr: str, fallback: float | None = None) -> dict:
    test_file = _test_file(family)
    with tempfile.TemporaryDirectory() as tmp:
        junit = os.path.join(tmp, "junit.xml")
        stats = os.path.join(tmp, "wrap-stats.json")
        cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               "-W", "ignore", f"--junitxml={junit}", "-k", k_expr]  # fmt: skip
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
        if wrapped:
            cmd[4:4] = ["-p", "mira_wrap_plugin"]
            env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "scripts"), env.get("PYTHONPATH", "")])
            env["MIRA_WRAP_STATS"] = stats
            if fallback is not None:
                env["MIRA_WRAP_FALLBACK_BUDGET"] = str(fallback)
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=tests_root, env=env, capture_output=True, text=True, timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            proc, timed_out = None, True
        wall_s = round(time.monotonic() - start, 1)
        if timed_out or not os.path.exists(junit):
            tail = "" if proc is None else (proc.stdout + proc.stderr)[-2000:]
            return {"timed_out": timed_out, "wall_s": wall_s, "error": tail, "tests": {}}
        tests = _parse_junit(junit)
        out = {"wall_s": wall_s, "tests": tests}
        if wrapped and os.path.exists(stats):
            with open(stats) as f:
                out["models"] = json.load(f)
        return out


def summarize(run: dict) -> dict:
    tests = run["tests"]
    counts = {k: sum(1 for t in tests.values() if t["outcome"] == k) for k in ("pass", "fail", "skip")}
    slowest = sorted(tests, key=lambda t: -tests[t]["time_s"])[:5]
    summary = {
        "run": len(tests),
        **counts,
        "wall_s": run["wall_s"],
        "slowest_s": {t: round(tests[t]["time_s"], 1) for t in slowest},
    }
    for key in ("timed_out", "models"):
        if key in run:
            summary[key] = run[key]
    return summary


def compare(unwrapped: dict, wrapped: dict) -> dict:
    u, w = unwrapped["tests"], wrapped["tests"]
    both = sorted(set(u) & set(w))
    return {
        # (a test may skip itself after building its model, which a wrapped model can refuse first)
        "wrapped_only_failures": [
            {"test": t, "error": w[t]["error"]} for t in both if u[t]["outcome"] != "fail" and w[t]["outcome"] == "fail"
        ],
        "unwrapped_only_failures": [t for t in both if u[t]["outcome"] == "fail" and w[t]["outcome"] == "pass"],
        "skipped_only_wrapped": [t for t in both if w[t]["outcome"] == "skip" != u[t]["outcome"]],
        "failing_in_both": [{"test": t, "error": u[t]["error"]} for t in both if u[t]["outcome"] == w[t]["outcome"] == "fail"],
    }


# Why a test that does not fail unwrapped fails wrapped, by what its error says (first match wins).
CATEGORIES = (
    ("a", "backward/training: refused by design", ("backward through mira-hf",)),
    (
        "b",
        "state_dict/parameters/casts/moves: experts live in the store, outside the modules' parameters",
        ("to have the same dtype", "Items in the first set", "TP-plan", "state_dict", "num_parameters", "parameters"),
    ),
    (
        "e",
        "a transfer format the experts' dtype does not take (lossless records of fp16 experts): refused by design",
        ("supports bfloat16 and float32 expert weights",),
    ),
    ("c", "compile/bf16 arithmetic/experts_implementation", ("compile", "bfloat16", "experts_implementation", "grouped_mm")),
    ("d", "budget below the minimum working set: refused by design", ("below the minimum working set",)),
)


def triage(test: str, error: str | None) -> str:
    """The category of a wrapped-only failure, by what its error says (or, for a bare assertion, its test)."""
    for category, _, needles in CATEGORIES:
        if any(n in (error or "") or n in test for n in needles):
            return category
    return "other"


def finish(result: dict) -> None:
    """Totals over the families, and each wrapped-only failure's category."""
    families = result["families"]
    for entry in families.values():
        for f in entry["wrapped_only_failures"] + entry.get("with_fallback_budget", {}).get("wrapped_only_failures", []):
            f["category"] = triage(f["test"], f["error"])
    totals = {mode: {k: sum(f[mode][k] for f in families.values()) for k in ("run", "pass", "fail", "skip")}
              for mode in ("unwrapped", "wrapped")}  # fmt: skip
    totals["wrapped_only_failures"] = sum(len(f["wrapped_only_failures"]) for f in families.values())
    by_category = {c: 0 for c, _, _ in CATEGORIES} | {"other": 0}
    for entry in families.values():
        for f in entry["wrapped_only_failures"]:
            by_category[f["category"]] += 1
    totals["wrapped_only_by_category"] = by_category
    result["totals"] = totals
    result["categories"] = {c: what for c, what, _ in CATEGORIES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests-root", required=True, help="transformers source tree of the installed version")
    parser.add_argument(
        "--families", nargs="*", default=list(FAMILIES), help="model types with a test file in the tree; none: only recount"
    )
    parser.add_argument("--timeout-s", type=int, default=1800, help="wall-clock limit of one pytest run")
    parser.add_argument(
        "--fallback-budget",
        type=float,
        default=None,
        help="also wrap models whose minimum working set is above 0.25 with this budget; the result goes to each "
        "family's 'with_fallback_budget' entry",
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        help="the wrapped models' transfer format (MiraConfig.quantization; 'lossless' serves every expert from encoded records)",
    )
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<date>-cpu-transformers-tests.json)")
    parser.add_argument(
        "--modes",
        nargs="*",
        default=["unwrapped", "wrapped"],
        choices=["unwrapped", "wrapped"],
        help="run only these modes (none: only compare kept runs); a mode left out is read from --runs-dir (a run "
        "kept by an earlier call), and a family whose other mode has not been kept gets no entry yet",
    )
    parser.add_argument(
        "--runs-dir",
        default=None,
        help="keep each run's per-test outcomes here as <family>-<mode>.json, and read a mode left out of --modes from it",
    )
    args = parser.parse_args()
    missing = [f for f in args.families if not os.path.exists(os.path.join(args.tests_root, _test_file(f)))]
    if missing:
        parser.error(f"no test file for {missing} under {args.tests_root} (looked for {_test_file(missing[0])})")

    import torch
    import transformers

    os.environ["MIRA_WRAP_QUANTIZATION"] = args.quantization  # read by the plugin in each wrapped run

    date = datetime.date.today().isoformat()
    out = args.out or os.path.join(REPO, "benchmarks", "results", f"{date}-cpu-transformers-tests.json")
    result = {}
    if os.path.exists(out):
        with open(out) as f:
            result = json.load(f)
    k_expr = _k_expression(SLOW_TESTS)
    result.update(
        {
            "what": "transformers' own model and generation tests, unwrapped and with every model wrapped by "
            f'MiraMoEModel.wrap(model, MiraConfig(gpu_budget=0.25, device="cpu", quantization={args.quantization!r}))',
            "command": "python scripts/run_transformers_tests.py --tests-root <transformers source tree>",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "deselected": SLOW_TESTS,
        }
    )
    families = result.setdefault("families", {})
    for family in args.families:  # one family and one mode at a time: the machine is shared
        runs = {}
        for mode in ("unwrapped", "wrapped"):
            kept = os.path.join(args.runs_dir, f"{family}-{mode}.json") if args.runs_dir else None
            if mode not in args.modes:
                if kept is not None and os.path.exists(kept):
                    with open(kept) as f:
                        runs[mode] = json.load(f)
                continue
            runs[mode] = run_family(args.tests_root, family, mode == "wrapped", args.timeout_s, k_expr, args.fallback_budget)
            if kept is not None:
                os.makedirs(args.runs_dir, exist_ok=True)
                with open(kept, "w") as f:
                    json.dump(runs[mode], f)
            s = summarize(runs[mode])
            print(f"{family:12s} {mode:9s} run={s['run']:4d} pass={s['pass']:4d} fail={s['fail']:3d} skip={s['skip']:3d} "
                  f"({s['wall_s']:.0f} s)", flush=True)  # fmt: skip
        if len(runs) < 2:
            print(f"{family}: {', '.join(runs)} kept in {args.runs_dir}; the other mode has not run yet", flush=True)
            continue
        entry = {
            "date": date,
            "deselected": sorted(SLOW_TESTS),
            "unwrapped": summarize(runs["unwrapped"]),
            "wrapped": summarize(runs["wrapped"]),
            **compare(runs["unwrapped"], runs["wrapped"]),
        }
        if args.fallback_budget is None:
            families[family] = entry
        else:
            families.setdefault(family, {})["with_fallback_budget"] = dict(entry, fallback_budget=args.fallback_budget)
        for f in entry["wrapped_only_failures"]:
            print(f"  wrapped only: {f['test']}: {f['error']}", flush=True)
        with open(out, "w") as fh:  # written after each family: a later interruption keeps what ran
            json.dump(result, fh, indent=1)
    finish(result)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
