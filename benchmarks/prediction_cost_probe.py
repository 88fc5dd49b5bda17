"""What the payoff gate charges to prediction, per MoE block of a decode, phase by phase.

    python benchmarks/prediction_cost_probe.py --out DIR   # ~30 s on a GPU; DIR/<date>-<device>-prediction-cost-probe.json
    python benchmarks/prediction_cost_probe.py --predictor markov --out DIR   # another predictor (-markov.json)

The payoff gate (`mira_hf/payoff.py`) pauses prediction while its host time per block exceeds the stalls it
could remove. Here the default system decodes the Mixtral shape at 25% with each phase that staging times for the
gate wrapped in a timer: the predictor's `observe`, `predict` and `routed`, `stage` (the copies of the guesses:
`_copy_likely`, `_speculate`; it also reads the guesses a predictor computes when first read), and the manager's deferred block ends (`_settle`) and loads (`_load`) that staging calls into. A
phase that makes the host wait for the device shows as milliseconds where its own work takes microseconds; the
gate's estimates (`gate`) are printed beside them. Instrumentation wraps the methods in this script only.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import ab  # noqa: E402  (build_system, gate_state)
import run  # noqa: E402  (workloads)
from bench.measure import generator, timed_decode  # noqa: E402
from common import build_config, device_slug, environment, print_table, write_json  # noqa: E402

from mira_hf.predictors import build_predictor  # noqa: E402


def timed(obj, name: str, tag: str, totals: dict, calls: collections.Counter) -> None:
    """Wrap `obj.name` so that each call adds its seconds to `totals[tag]`."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[tag] += time.perf_counter() - t0
            calls[tag] += 1

    setattr(obj, name, wrapper)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory (gets DATE-DEVICE-prediction-cost-probe.json) or a .json path")
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--predictor", help="MiraConfig.predictor in place of the default's (e.g. markov, hybrid, position)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, a few tokens: checks the script")
    args = ap.parse_args()
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if args.smoke:
        args.prompt_len, args.new_tokens = 16, 6
    if device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # its per-length graph builds (NOTES.md, "Measuring")
    label, shape, smoke_shape = run.WORKLOADS["mixtral"]
    wl = run.Workload("mixtral", label, smoke_shape if args.smoke else shape, 0)
    model = ab.build_system("default", wl, args.budget, device, None)
    if args.predictor:
        model.mira.predictor = build_predictor(args.predictor, [model.mira.layers[o] for o in sorted(model.mira.layers)],
                                               model.mira.router_probs, model.mira.predictor_config)  # fmt: skip
    manager, staging = model.mira, model.mira.staging
    totals, calls = collections.defaultdict(float), collections.Counter()
    phases = [
        (staging.predictor, "observe", "observe"),
        (staging.predictor, "predict", "predict"),
        (staging.predictor, "routed", "routed"),  # the routing kept by observe, read after the block's sync
        (staging, "stage", "stage"),
        (staging, "_copy_likely", "stage: copy_likely"),
        (staging, "_speculate", "stage: speculate"),
        (manager, "_settle", "settle"),
        (manager, "_load", "load"),
    ]
    phases = [(obj, name, tag) for obj, name, tag in phases if hasattr(obj, name)]
    for obj, name, tag in phases:
        timed(obj, name, tag, totals, calls)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, build_config(wl.shape).vocab_size, (1, args.prompt_len), generator=g).to(device)
    with torch.no_grad():
        timed_decode(generator(model), prompt, 4)  # warm-up
        totals.clear()
        calls.clear()
        manager.reset_stats()
        rate, got = timed_decode(generator(model), prompt, args.new_tokens)[:2]
    blocks = got * len(manager.layers)
    rows = [{"phase": tag, "ms_per_block": 1e3 * totals[tag] / blocks, "calls": calls[tag]} for _, _, tag in phases]
    print_table(rows, ["phase", "ms_per_block", "calls"])
    stats = manager.stats()
    result = {"env": environment(), "command": " ".join(["python"] + sys.argv), "args": vars(args), "model": label,
              "predictor": type(staging.predictor).__name__,
              "tok_s": rate, "tokens": got, "blocks": blocks, "rows": rows, "gate": ab.gate_state(model),
              "prediction_paused_steps": stats["prediction_paused_steps"], "stall_s": stats["stall_s"]}  # fmt: skip
    print("gate:", result["gate"])
    slug = device_slug(result["env"], device == "cuda")
    out = (
        args.out
        if args.out.endswith(".json")
        else os.path.join(
            args.out, f"{result['env']['date']}-{slug}-prediction-cost-probe{'-' + args.predictor if args.predictor else ''}.json"
        )
    )
    write_json(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
