"""End-to-end benchmark: mira-hf vs all-resident transformers vs accelerate offload, with the limit.

One process, one GPU. For each workload (Mixtral-8x7B shape with 8 layers, Qwen3-30B-A3B shape with
12 layers, both random-initialised in bf16 at real dimensions; the bundled trained `mira-tiny` with
real routing) and each expert budget, it measures the same prompts under each system:

    resident    all experts on the GPU (plain transformers)
    accelerate  transformers + accelerate offload: save_pretrained, then from_pretrained(device_map="auto",
                max_memory={0: non-expert + budget + 2 GB, "cpu": "100GiB"}), as a user would set it up
    lru         reactive expert cache: MiraConfig(gpu_budget=B, policy="lru", predictor=None)
    default     MiraConfig(gpu_budget=B): whatever the library's defaults are
    int4        MiraConfig(gpu_budget=B, quantization="int4"), when the library supports it

Metrics: TTFT (512-token prompt, batch 1), decode tokens/s at batch 1 and 8 (64 new tokens), beam-4
tokens/s (32 new tokens), peak GPU memory, and for mira: host→device bytes per token, achieved H2D
bandwidth, share of decode time stalled, hit rate. The limit per decode token is
max(bytes a token touches / device-memory bandwidth, Belady's bytes per token / pinned H2D bandwidth),
with Belady's optimal cache (same slot count) replayed over the routing trace recorded here.

    python benchmarks/run.py                          # H200 defaults: finishes inside 9 minutes
    python benchmarks/run.py --smoke --out /tmp/bench # CPU, tiny shapes, seconds
    python benchmarks/run.py --from-json FILE.json    # re-render FILE.md / FILE.png from a result

Writes OUT/<date>-<device>.json (after every system, so an interrupted run keeps what it measured),
OUT/<date>-<device>.md and OUT/<date>-<device>.png, and prints the tables and the headline ratios
(a --smoke run prints what it ran and no ratios: its tiny shapes on a CPU measure nothing).
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import json  # noqa: E402
import warnings  # noqa: E402

from bench.clock import START  # noqa: E402, F401  (before torch: the time guard counts from here, imports included)

if __name__ == "__main__":  # before transformers is imported; not when a test imports this file
    # Quiet, offline Hugging Face: no progress bars, no hub calls (the GPU machine has no internet).
    for _k, _v in (
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_VERBOSITY", "error"),
        ("TOKENIZERS_PARALLELISM", "false"),
    ):
        os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import transformers  # noqa: E402

# Also read from this script: GB, METRIC_KEYS, belady_bytes, trace_steps, format_comparison (tests/test_bench_smoke.py);
# WORKLOADS, Workload, MIRA_OVERRIDES, add_variant, bundled_dir (ab.py, compile_decode.py, gap_probe.py, host_profile.py).
from bench import GB  # noqa: E402, F401
from bench.clock import Deadline, log  # noqa: E402
from bench.limits import belady_bytes, finish_model  # noqa: E402, F401
from bench.measure import Settings, empty_host_cache, measure_bandwidth, trace_steps  # noqa: E402, F401
from bench.render import comparisons, format_comparison, one_line, print_summary, write_outputs  # noqa: E402, F401
from bench.systems import METRIC_KEYS, MIRA_OVERRIDES, SYSTEMS, add_variant, int4_supported, run_system  # noqa: E402, F401
from bench.workloads import WORKLOADS, Workload, bundled_dir  # noqa: E402, F401
from common import device_slug, environment  # noqa: E402

# --smoke caps these options (tiny shapes on a CPU: enough tokens to exercise every code path)
SMOKE_LIMITS = dict(prompt_len=16, new_tokens=4, beam_tokens=3, accelerate_tokens=3, time_budget_s=300.0)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mixtral,bundled,qwen3", help="workloads, in run order: mixtral, qwen3, bundled")
    ap.add_argument("--budgets", default="0.25", help="expert budgets as fractions of all expert bytes, e.g. 0.10,0.25,0.50")
    ap.add_argument(
        "--systems", default="resident,lru,default,int4,accelerate", help="systems, in run order: " + ",".join(SYSTEMS)
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:FIELD=VALUE,...",
        help="an extra mira system (run after --systems), e.g. heat-only:predictor=none or x:cache.stage_fraction=0.5",
    )
    ap.add_argument("--accelerate-models", default="mixtral", help="workloads that also run the (slow) accelerate system")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64, help="decode tokens at batch 1 and at --batch")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--beam-tokens", type=int, default=32)
    ap.add_argument(
        "--accelerate-tokens", type=int, default=4, help="decode and beam tokens for accelerate (about 3 s per token)"
    )
    ap.add_argument("--warmup-tokens", type=int, default=2)
    ap.add_argument(
        "--time-budget-s", type=float, default=500.0, help="skip systems that would not finish within this (from start)"
    )
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    ap.add_argument(
        "--tmp-dir", default=os.environ.get("TMPDIR") or "/tmp", help="where accelerate's saved checkpoint goes (removed after)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cudnn-sdpa",
        choices=("on", "off"),
        default="off",
        help="PyTorch's cuDNN attention backend. off (default): it is suspected of building a graph per new sequence "
        "length, which made the first system measured on a workload slower than the rest (NOTES.md, 'Measuring'); "
        "benchmarks/first_call_probe.py checks that",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, a few tokens: checks the script in seconds")
    ap.add_argument("--from-json", metavar="FILE", help="only re-render FILE's .md and .png from a result JSON")
    args = ap.parse_args(argv)
    args.models = _split(args.models, WORKLOADS, "--models")
    args.systems = _split(args.systems, SYSTEMS, "--systems") + [add_variant(v) for v in args.variant]
    args.accelerate_models = _split(args.accelerate_models, WORKLOADS, "--accelerate-models")
    args.budgets = [float(b.rstrip("%")) / (100 if b.endswith("%") else 1) for b in args.budgets.split(",") if b.strip()]
    if not args.budgets or any(not 0 < b <= 1 for b in args.budgets):
        ap.error(f"--budgets: fractions in (0, 1], got {args.budgets}")
    if args.smoke:
        for name, value in SMOKE_LIMITS.items():
            setattr(args, name, min(getattr(args, name), value))
    return args


def _split(text: str, allowed, flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad:
        raise SystemExit(f"{flag}: unknown {bad}; choose from {', '.join(allowed)}")
    return items


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
        stem = os.path.splitext(args.from_json)[0]
        write_outputs(result, stem, plot=True)
        print_summary(result, stem)
        return 0
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA GPU visible: run on a GPU machine, or pass --smoke for the CPU check.", flush=True)
        return 2
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning)  # generate's flag warnings; errors still raise
    device = "cpu" if args.smoke else "cuda"
    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(args.cudnn_sdpa == "on")  # the same for every system of the run
    if args.smoke:
        torch.set_num_threads(1)  # tiny matmuls: extra threads only add overhead (and noise on a busy machine)
    s = Settings(
        device,
        args.prompt_len,
        args.new_tokens,
        args.batch,
        args.beams,
        args.beam_tokens,
        args.accelerate_tokens,
        args.warmup_tokens,
        args.seed,
    )
    deadline = Deadline(args.time_budget_s)
    env = environment()
    slug = device_slug(env) + ("-smoke" if args.smoke else "")
    stem = os.path.join(args.out, f"{env['date']}-{slug}")
    os.makedirs(args.out, exist_ok=True)
    result = dict(
        env=env,
        args={k: v for k, v in vars(args).items()},
        command=" ".join([os.path.relpath(sys.argv[0], REPO) if sys.argv[0] else "run.py", *sys.argv[1:]]),
        int4_supported=int4_supported(),
        models={},
        skipped=[],
    )
    log(f"{env.get('device')}: torch {env['torch']}, transformers {env['transformers']}; writing {stem}.*")
    try:
        result["bandwidth"] = measure_bandwidth(args.smoke)
        bw = result["bandwidth"]
        log(f"bandwidth: pinned H2D {bw['h2d_gbps']:.1f} GB/s, device memory {bw['device_gbps']:.0f} GB/s")
        for key in args.models:
            label, shape, smoke_shape = WORKLOADS[key]
            if args.smoke:  # say what ran: a tiny stand-in, not the real shape
                label = f"{smoke_shape or 'mira-tiny'} (smoke: tiny stand-in on the CPU)"
            wl = Workload(key, label, smoke_shape if args.smoke else shape, args.seed)
            m = result["models"][key] = dict(label=label, shape=wl.shape, rows=[], limits={}, budget_bytes={}, notes=[])
            traces: dict = {}
            try:
                plan = [(sname, None) for sname in args.systems if sname == "resident"]
                plan += [(sname, b) for b in args.budgets for sname in args.systems if sname != "resident"]
                for sname, budget in plan:
                    row = run_system(sname, wl, budget, s, deadline, args, m["rows"], traces)
                    m["rows"].append(row)
                    m["facts"] = wl.facts
                    for b in args.budgets:
                        if wl.facts:
                            m["budget_bytes"][str(b)] = int(b * wl.facts["expert_bytes"])
                    if row["status"] == "skipped" and "time budget" in " ".join(row["notes"]):
                        result["skipped"].append(f"{key}/{sname}" + ("" if budget is None else f"@{budget:.0%}"))
                    try:
                        finish_model(m, wl, traces, bw, args)
                    except Exception as exc:  # a bug in the bookkeeping must not cost the measurements
                        m["notes"].append(f"limit not computed: {type(exc).__name__}: {exc}")
                    result["elapsed_s"] = deadline.elapsed()
                    write_outputs(result, stem)
                    log(f"{key} / {sname}: {row['status']} in {row['system_s']:.1f} s. {one_line(row)}")
            finally:
                wl.cleanup()
                empty_host_cache()
    finally:
        try:
            result["comparisons"] = comparisons(result)
        except Exception as exc:
            result["comparisons"] = []
            result.setdefault("output_errors", {})["comparisons"] = f"{type(exc).__name__}: {exc}"
        result["elapsed_s"] = deadline.elapsed()
        write_outputs(result, stem, plot=True)
        print_summary(result, stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
