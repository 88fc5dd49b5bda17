"""Where a full-depth model's batch-1 decode step goes, host and device: a fine-grained model's profile.

A real-dimension model (random weights, routers shaped as `full_depth.py` shapes them) is built on the GPU, its
all-resident batch-1 decode timed, then wrapped at a budget and profiled three ways over greedy batch-1 decodes:

    timed       tokens/s of greedy decode steps after a prefill (not counted), loads, misses and hits per step
    parts       the host's exclusive time per step in each part of the runtime (victim search, copies, verbs, ...)
    copies      with --copies-ab N: N rounds of the timed decode in this process, alternating the loader's host→device
                copies through the CUDA runtime (the default) and through torch's `copy_` (who goes first alternates),
                and each way's `parts` profile: the same host, so the ratio is not the spread between processes
    cProfile    the host's functions by their own time, per decode step (Python's profiler adds its own cost)
    torch       torch.profiler with CUDA activities: the device's busy share of the window (kernels and copies),
                its kernel, host-to-device and device-to-device time per step, and the CUDA runtime calls per step

    python benchmarks/depth_profile.py --model qwen3 --budget 8GiB --out DIR     # DIR/DATE-DEVICE-depth-profile-MODEL.json
    python benchmarks/depth_profile.py --model qwen3 --smoke --out /tmp/dp        # CPU, tiny shape: checks the script
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
if __name__ == "__main__":
    for _k, _v in (("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_VERBOSITY", "error")):
        os.environ.setdefault(_k, _v)

import torch  # noqa: E402
from common import device_slug, environment, print_table, random_model_on_device, sync, write_json  # noqa: E402
from full_depth import PLANS  # noqa: E402
from host_overhead import PARTS, PartTimer  # noqa: E402
from topic_routing import RoutingTargets, shape_routing, topic_prompts  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.heat import HeatConfig  # noqa: E402
from mira_hf.testing import step  # noqa: E402

RUNTIME_CALLS = ("cudaLaunchKernel", "cudaMemcpyAsync", "cudaStreamWaitEvent", "cudaEventRecord", "cudaEventQuery")


def prefill(model, ids: torch.Tensor):
    """The prompt's forward step: (its KV cache, the next greedy token [1, 1])."""
    out, cache = step(model, ids)
    return cache, out.logits[:, -1:].argmax(-1)


def decode(model, ids: torch.Tensor, steps: int, profiler=None, after_prefill=None) -> float:
    """Seconds per greedy decode step after `ids`' prefill (not counted), as `generate` runs them on this device: the
    prefill with the model's experts implementation, the steps with batched_mm off the CPU (a prefill under
    batched_mm would gather a copy of the weights for each of its rows: 60 GB for a 256-token Mixtral prompt's down
    projections); `profiler` (a context) covers the steps, `after_prefill()` runs between the prefill and them (e.g.
    to reset counters)."""
    impl = model.get_experts_implementation()
    try:
        with torch.inference_mode():
            past, tok = prefill(model, ids)
            if after_prefill is not None:
                after_prefill()
            if ids.device.type != "cpu":
                model.set_experts_implementation({k: "batched_mm" if v == "grouped_mm" else v for k, v in impl.items()})
            sync()
            t = time.perf_counter()
            with profiler if profiler is not None else contextlib.nullcontext():
                for _ in range(steps):
                    out, past = step(model, tok, past)
                    tok = out.logits[:, -1:].argmax(-1)
                sync()
            return (time.perf_counter() - t) / steps
    finally:
        model.set_experts_implementation(impl)


def host_profile(model, ids: torch.Tensor, steps: int, top: int) -> list[dict]:
    """cProfile of `steps` decode steps: the `top` functions by own time, per step."""
    prof = cProfile.Profile()
    decode(model, ids, steps, prof)
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (path, line, name), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():
        where = path.split("site-packages/")[-1].split("/main/")[-1]
        rows.append(
            dict(
                function=f"{where}:{line}({name})",
                calls=ncalls / steps,
                own_ms=1e3 * tottime / steps,
                cum_ms=1e3 * cumtime / steps,
            )
        )
    rows.sort(key=lambda r: -r["own_ms"])
    return rows[:top]


# exclusive host time by part: host_overhead's parts, and the loader's verbs
LOADER_PARTS = {"copy issue": ("loader", ("copy_split",)), "copy waits": ("loader", ("wait", "mark_free"))}


def parts_profile(model, ids: torch.Tensor, steps: int) -> dict:
    """Each part's exclusive host time per decode step (host_overhead's wrappers: ~1 µs per call), and the calls."""
    timer = PartTimer()
    wrapped = timer.wrap_model(model, {**PARTS, **LOADER_PARTS})
    try:
        total = decode(model, ids, steps, after_prefill=timer.clear) * steps
    finally:
        for obj, name in wrapped:
            obj.__dict__.pop(name, None)
    parts = {k: 1e3 * v / steps for k, v in timer.seconds.items()}
    parts["rest of model"] = 1e3 * total / steps - sum(parts.values())
    key = lambda part: part.replace(" ", "_")  # noqa: E731  (keys a citation can name)
    return dict(
        step_ms=1e3 * total / steps,
        ms_per_step={key(k): v for k, v in parts.items()},
        calls_per_step={key(k): v / steps for k, v in timer.calls.items()},
    )


def union_s(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def device_profile(model, ids: torch.Tensor, steps: int) -> dict:
    """torch.profiler over `steps` decode steps: the device's busy share and time by kind, per step."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    wall = decode(model, ids, steps, prof)
    spans, by_kind, calls = [], Counter(), Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            a, b = ev.time_range.start, ev.time_range.end
            spans.append((a, b))
            name = ev.name
            kind = "h2d" if "HtoD" in name else "d2d" if "DtoD" in name else "d2h" if "DtoH" in name else "kernel"
            by_kind[kind] += (b - a) / 1e3
        elif ev.name in RUNTIME_CALLS:
            calls[ev.name] += 1
    return dict(
        wall_ms_per_step=1e3 * wall,
        device_busy_ms_per_step=union_s(spans) / 1e3 / steps,
        device_ms_per_step={k: v / steps for k, v in by_kind.items()},
        runtime_calls_per_step={k: v / steps for k, v in calls.items()},
    )


def copies_ab(model, ids: torch.Tensor, steps: int, rounds: int) -> dict:
    """Batch-1 decode with the loader's copies issued through the CUDA runtime ("runtime") and through torch's
    `copy_` ("torch"), `rounds` rounds alternating who goes first, then each way's parts profile."""
    loader = model.mira.loader
    ways = {"runtime": loader.memcpy, "torch": None}
    runs = []
    try:
        for r in range(rounds):
            for way in list(ways)[:: 1 if r % 2 == 0 else -1]:
                loader.memcpy = ways[way]
                s = decode(model, ids, steps, after_prefill=model.mira.reset_stats)
                runs.append(dict(round=r, copies=way, tok_s=1.0 / s, loads_per_step=model.mira.stats()["loads"] / steps))
                print(runs[-1])
        parts = {}
        for way, fn in ways.items():
            loader.memcpy = fn
            parts[way] = parts_profile(model, ids, steps)
    finally:
        loader.memcpy = ways["runtime"]
    ratios = []
    for r in range(rounds):
        tok = {run["copies"]: run["tok_s"] for run in runs if run["round"] == r}
        ratios.append(tok["runtime"] / tok["torch"])
    return dict(
        runtime_available=ways["runtime"] is not None,
        runs=runs,
        ratio_runtime_over_torch=dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios)),
        parts=parts,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(k for k, p in PLANS.items() if p.source == "wrap"), default="qwen3")
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=24, help="decode tokens timed")
    ap.add_argument("--profile-tokens", type=int, default=8, help="decode tokens under each profiler")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--no-resident", dest="resident", action="store_false")
    ap.add_argument("--timed-only", action="store_true", help="only the timed decode (for A/B runs of two trees)")
    ap.add_argument("--copies-ab", type=int, default=0, metavar="N", help="N alternating rounds: runtime copies against copy_")
    ap.add_argument("--no-prompt-seed", dest="prompt_seed", action="store_false", help="HeatConfig(seed_from_prompt=False)")
    ap.add_argument("--smoke", action="store_true", help="CPU, the plan's tiny shape, a few tokens")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    plan = PLANS[args.model]
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if args.smoke:
        args.budget, args.prompt_len, args.tokens, args.profile_tokens = "0.25", 16, 3, 2
    budget = float(args.budget) if args.budget.replace(".", "", 1).isdigit() else args.budget
    if device == "cuda":  # cuDNN's attention builds a graph per sequence length: every step would be a first
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(0)
    model = random_model_on_device(plan.smoke_shape if args.smoke else plan.shape, device=device)
    targets = RoutingTargets()
    prompts = topic_prompts(8, args.prompt_len, model.config.vocab_size, targets.topics, targets.p_stay, seed=1).to(device)
    shape_routing(model, prompts, targets, seed=0)
    ids = prompts[:1]
    result = dict(environment=environment(), args=vars(args), label=plan.label, device=device)
    if args.resident:
        decode(model, ids, 4)  # warm-up
        result["resident_tok_s"] = 1.0 / decode(model, ids, args.tokens)
    MiraMoEModel.wrap(model, MiraConfig(gpu_budget=budget, device=device, heat=HeatConfig(seed_from_prompt=args.prompt_seed)))
    manager = model.mira
    result["slots"] = sum(manager.budget.n_slots.values())
    result["moe_layers"] = len(manager.layers)
    result["record_bytes"] = manager.store.record_bytes(0)
    decode(model, ids, 4)  # warm-up at this budget
    s = decode(model, ids, args.tokens, after_prefill=manager.reset_stats)  # counters of the decode steps only
    st = manager.stats()
    result["timed"] = dict(
        tok_s=1.0 / s,
        ms_per_step=1e3 * s,
        loads_per_step=st["loads"] / args.tokens,
        misses_per_step=st["misses"] / args.tokens,
        hits_per_step=st["hits"] / args.tokens,
    )
    if args.copies_ab:
        result["copies_ab"] = copies_ab(model, ids, args.tokens, args.copies_ab)
    if not args.timed_only:
        result["parts"] = parts_profile(model, ids, args.tokens)
        result["host"] = host_profile(model, ids, args.profile_tokens, args.top)
        if device == "cuda":
            result["device"] = device_profile(model, ids, args.profile_tokens)
        print_table(result["host"][:25], ["function", "calls", "own_ms", "cum_ms"])
    print({k: v for k, v in result.items() if k in ("resident_tok_s", "timed", "parts", "device", "slots")})
    if args.out:  # with --timed-only, name it with --label (one file per process of an A/B)
        name = f"{time.strftime('%Y-%m-%d')}-{device_slug(result['environment'], device == 'cuda')}-depth-profile-{args.model}{'-' + args.label if args.label else ''}.json"
        write_json(os.path.join(args.out, name), result)


if __name__ == "__main__":
    main()
