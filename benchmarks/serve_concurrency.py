"""Concurrent sequences, throughput and time per output token at one fixed device memory, three ways.

For each model shape (benchmarks/common.py SHAPES, random weights with balanced routers of realistic skew:
`common.balance_routers`), with the whole process held to --memory-gib of device memory
(torch.cuda.set_per_process_memory_fraction), transformers' continuous batching decodes requests of
--prompt-tokens random tokens and --new-tokens new tokens (greedy, no EOS), as many at once as the KV cache
holds whole (prompt + completion, in blocks of 256 tokens), in three set-ups:

- resident: every expert on the device; the KV cache gets what is left after the weights and one step's
  activations;
- accelerate: the model dispatched by accelerate (`infer_auto_device_map` + `dispatch_model` with max_memory):
  the layers that do not fit are offloaded to host memory and copied in at each use; it gets the same KV cache
  as mira-hf's last run (mira-more where it ran), the rest of the memory for weights. Its decode is slow, so it
  runs --accelerate-new-tokens new tokens (its time per output token is measured on those);
- mira: mira-hf with the device-memory planner (`mira_hf.serve.planning`): hit rates from a routing trace of
  the model (its routers' top-k on random prompts, replayed at each concurrency), link bandwidth measured here;
  the expert cache and KV cache sized from the plan, batch-aware use estimates on, and the expert records in the
  format `mira serve` loads (--quantization auto: lossless for records of 128 MiB or more, each decoded once per
  copy into a slot of the checkpoint's dtype, and where the expert cache holds every expert only with a few kept
  packed, those few kept packed and decoded at each use: `serving_mira_config`);
- mira-more: mira-hf with the KV part fixed (`ServeConfig.kv_cache_memory`) to hold --more (1.5) times the
  resident set-up's sequences and the expert cache given the rest: what the freed memory buys in sequences,
  and at what speed per sequence. `--compare-placements dequant` runs it again in the same process with every
  record decoded into a slot (none kept packed).

Before the resident run, an unmeasured batch of the same sequences (--warmup-tokens new tokens) builds the kernels
and caches the first batch in a process needs, so the resident figure, which every ratio divides by, does not carry
them; the runs after it find them built.

Reported per run: sequences at once (the KV cache's whole contexts; all submitted together, so none waits for
blocks), whether any request failed (an out-of-memory error fails a request in transformers' batching thread),
output tokens/s over the run, P50/P95 of each request's time per output token (first to last token), the
memory plan and expert-cache counters (for mira-hf also the batch estimate's check: the experts each block was
expected to use against those it used, `BatchUsage.union_check`). CUDA graphs are off for all three (mira-hf's
experts move between steps; the others follow for a like-for-like step), cuDNN attention is off (it has failed on
some shapes).

The 8-layer Mixtral shape holds 22.5 GB of experts and the 12-layer Qwen3-30B-A3B shape 14.5 GB: the default
memory (26 GiB and 18 GiB) lets all experts be resident with ~2 GB for activations and KV cache, which is the
situation of a full model on a GPU that just holds it (e.g. Mixtral 8x7B's 93 GB on a 96 GB card, scaled to
8 of its 32 layers). `--memory-gib shape=GiB` sets another.

    python benchmarks/serve_concurrency.py --out results.json          # H200, < 9 minutes
    python benchmarks/serve_concurrency.py --smoke --out /tmp/s.json   # CPU, tiny shapes, < 1 minute
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHAPES, balance_routers, build_config, environment, h2d_bandwidth, print_table, write_json  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mira_hf import MiraConfig, MiraMoEModel, batching  # noqa: E402
from mira_hf.config import QuantConfig  # noqa: E402
from mira_hf.planner import HitRateCurve, StepCost  # noqa: E402
from mira_hf.serve import (  # noqa: E402
    ServeConfig,
    planning,
    serving_mira_config,
)
from mira_hf.serve import memory as serve_memory  # noqa: E402
from mira_hf.trace import RoutingTrace  # noqa: E402

DEFAULT_MEMORY_GIB = {"mixtral-8x7b-8l": 26.0, "qwen3-30b-a3b-12l": 18.0}
SMOKE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2, vocab_size=512)
PAGE = serve_memory.DEFAULT_PAGE_TOKENS
RUNS = ("mira", "mira-more", "accelerate")
MAX_BATCH_TOKENS = 2048


def build(shape: str, device: str, smoke: bool):
    from transformers import AutoModelForCausalLM

    config = build_config(shape)
    if smoke:
        for k, v in SMOKE.items():
            if hasattr(config, k):
                setattr(config, k, v)
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 16
    torch.manual_seed(0)
    dtype = torch.float32 if smoke else torch.bfloat16
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def routing_trace(model, prompts: torch.Tensor) -> RoutingTrace:
    """The routers' top-k for every token of `prompts` [B, T] (one forward), as a trace of B·T steps."""
    picks: dict[int, list[torch.Tensor]] = {}
    blocks = [layer.mlp for layer in model.model.layers]
    handles = [
        b.gate.register_forward_hook(
            lambda _m, _a, out, i=i: picks.setdefault(i, []).append(out[2].reshape(-1, out[2].shape[-1]))
        )
        for i, b in enumerate(blocks)
    ]
    with torch.inference_mode():
        model(prompts)
    for h in handles:
        h.remove()
    experts = torch.stack([torch.cat(picks[i]) for i in range(len(blocks))], dim=1).cpu()  # [B*T, L, K]
    text = model.config
    E = getattr(text, "num_local_experts", None) or text.num_experts
    inter = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
    record = 3 * text.hidden_size * inter * model.dtype.itemsize
    starts = list(range(0, experts.shape[0], prompts.shape[1]))
    return RoutingTrace(experts, None, starts, [E] * len(blocks), [record] * len(blocks))


def run_batch(model, prompts: list[list[int]], new_tokens: int, kv_bytes: int) -> dict:
    """Decode `prompts` together with continuous batching and a KV cache of `kv_bytes`; timings per request."""
    from transformers import GenerationConfig

    cb = serve_memory.batching_config(model, kv_bytes, MAX_BATCH_TOKENS)
    cb = dataclasses.replace(cb, use_cuda_graph=False)
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generation_config.eos_token_id = None  # every request decodes new_tokens tokens
    t0 = time.perf_counter()
    try:
        outputs = model.generate_batch(
            prompts, generation_config=gen, continuous_batching_config=cb, record_timestamps=True, progress_bar=False
        )
    except torch.OutOfMemoryError as exc:
        return dict(ok=False, sequences=len(prompts), error=f"out of memory: {str(exc).splitlines()[0]}")
    wall = time.perf_counter() - t0
    failed = [o.error for o in outputs.values() if o.error is not None]
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    tpot = sorted(
        (o.timestamps[-1] - o.timestamps[0]) / (len(o.timestamps) - 1)
        for o in outputs.values()
        if o.timestamps and len(o.timestamps) > 1
    )
    pct = lambda q: tpot[min(len(tpot) - 1, int(q * len(tpot)))] if tpot else None  # noqa: E731
    return dict(
        ok=not failed,
        failed_requests=len(failed),
        first_error=failed[0] if failed else None,
        sequences=len(prompts),
        kv_blocks=cb.num_blocks,
        new_tokens=new_tokens,
        output_tokens=tokens,
        wall_s=round(wall, 3),
        tokens_per_s=round(tokens / wall, 2),
        tpot_p50_ms=round(1000 * pct(0.5), 2) if tpot else None,
        tpot_p95_ms=round(1000 * pct(0.95), 2) if tpot else None,
    )


def run_fitting(model, sequences: int, kv_bytes: int, args, vocab: int) -> dict:
    """`run_batch` with `sequences` and `kv_bytes`; after an out-of-memory failure, once more with three quarters of
    both (the KV cache gives back memory to whatever took more than estimated). Both attempts are reported."""
    prompts = prompts_for(sequences, args.prompt_tokens, vocab, 3)
    first = guarded(run_batch, model, prompts, args.new_tokens, kv_bytes)
    text = f"{first.get('error')} {first.get('first_error')}".lower()
    if first.get("ok") or "out of memory" not in text or sequences < 2:
        return first
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    smaller = guarded(run_batch, model, prompts[: sequences * 3 // 4], args.new_tokens, kv_bytes * 3 // 4)
    smaller["first_attempt"] = first
    return smaller


def guarded(fn, *args) -> dict:
    """`fn(*args)`, or what went wrong: one set-up failing does not stop the others."""
    try:
        return fn(*args)
    except Exception as exc:  # recorded in the JSON; the traceback goes to the log
        import traceback

        traceback.print_exc()
        return dict(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def kv_room(model, total: int, top_k: int) -> int:
    """KV bytes (K and V) a model fully on the device can have in `total`: what is left after what it holds now
    and one step's activations, less the cache's per-token buffers."""
    text = model.config
    itemsize = model.dtype.itemsize
    used = (
        torch.cuda.memory_allocated()
        if torch.cuda.is_available()
        else sum(p.numel() * p.element_size() for p in model.parameters())
    )
    room = total - used - planning.step_activation_bytes(text, itemsize, MAX_BATCH_TOKENS, top_k)
    per_token = serve_memory.kv_bytes_per_token(model)
    return max(0, room) * per_token // (per_token + planning.cache_token_overhead(text, itemsize, MAX_BATCH_TOKENS))


def limit_memory(total: int | None) -> None:
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
        phys = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(1.0 if total is None else min(1.0, total / phys))


def bench_shape(shape: str, args, on_gpu: bool, deadline: float) -> dict:
    device = "cuda" if on_gpu else "cpu"
    total = int(args.memory[shape] * 2**30)
    out: dict = dict(shape=shape, memory_bytes=total, runs={})
    model = build(shape, device, args.smoke)
    text = model.config
    top_k = text.num_experts_per_tok
    seq_tokens = args.prompt_tokens + args.new_tokens
    sample = torch.randint(3, text.vocab_size, (8, 128), generator=torch.Generator().manual_seed(1)).to(device)
    out["router_shares"] = balance_routers(model, sample, skew=args.skew)
    tokens = (4, 64) if args.smoke else (16, 128)  # trace steps: replayed at 4 concurrencies x 5 shares on the host
    trace = routing_trace(model, torch.randint(3, text.vocab_size, tokens, generator=torch.Generator().manual_seed(2)).to(device))

    # resident: everything on the device, the rest as KV cache
    limit_memory(total)
    kv = kv_room(model, total, top_k)
    blocks_per_seq = -(-seq_tokens // PAGE)
    n = min(args.max_sequences, kv // (PAGE * serve_memory.kv_bytes_per_token(model) * blocks_per_seq))
    if n < 1:
        out["runs"]["resident"] = dict(ok=False, sequences=0, error="the weights leave no room for one sequence's KV cache")
    else:
        if args.warmup_tokens:  # unmeasured: the first batch in a process builds kernels and caches for its shapes
            guarded(run_batch, model, prompts_for(n, args.prompt_tokens, text.vocab_size, 4), args.warmup_tokens, kv)
        out["runs"]["resident"] = run_fitting(model, n, kv, args, text.vocab_size)
    print(shape, "resident", out["runs"]["resident"], flush=True)
    limit_memory(None)

    # mira: the planner's split
    model.to("cpu")
    limit_memory(None)
    link = h2d_bandwidth(256 * 2**20) * 1e9 if on_gpu else 5e9
    layers = text.num_hidden_layers
    experts = getattr(text, "num_local_experts", None) or text.num_experts
    first = min(1.0, max(0.05, 1.5 * top_k / (layers * experts)))  # a small cache to load with: the plan resizes it
    mira_config = serving_mira_config(  # as `mira serve` loads: compressed records decoded once per copy
        MiraConfig(gpu_budget=first, device=device, quantization=args.quantization, quant=QuantConfig(placement=args.placement))
    )
    wrapped = MiraMoEModel.wrap(model, mira_config)
    out["quantization"] = wrapped.mira.quantization
    t0 = time.perf_counter()
    concurrencies = tuple(c for c in (1, 8, 64, 256) if c <= args.max_sequences)
    curve = HitRateCurve.from_trace(trace, concurrencies=concurrencies, shares=(0.1, 0.25, 0.5, 0.75, 1.0))
    serve_config = ServeConfig(
        device_memory=total,
        concurrency=args.max_sequences,
        prompt_tokens=args.prompt_tokens,
        default_max_tokens=args.new_tokens,
        max_batch_tokens=MAX_BATCH_TOKENS,
    )
    # The step-time model: link bandwidth measured here; per-token time from the resident run's decode steps.
    resident = out["runs"]["resident"]
    token_s = StepCost().token_s
    if resident.get("tpot_p50_ms") and resident.get("sequences"):
        token_s = max(0.0, (resident["tpot_p50_ms"] / 1000 - StepCost().step_overhead_s) / resident["sequences"])
    cost = StepCost(link_bytes_per_s=link, token_s=token_s)
    plan = planning.plan(wrapped, serve_config, cost, curve)
    out["plan"] = {k: v for k, v in plan.as_dict().items() if k != "candidates"}
    out["plan"]["planning_s"] = round(time.perf_counter() - t0, 2)
    out["plan"]["step_cost"] = dataclasses.asdict(cost)
    out["plan"]["curve"] = {str(c): dict(points=curve.points[c], uses_per_step=curve.uses_per_step[c]) for c in curve.points}
    kv_mira = run_mira(out, "mira", wrapped, plan, total, args, deadline) if "mira" in args.runs else None
    # mira-more: the KV part fixed (the split is overridable) to hold --more times the resident set-up's sequences
    more = math.ceil(args.more * resident.get("sequences", 0))
    if more and "mira-more" in args.runs:
        kv_more = more * blocks_per_seq * PAGE * serve_memory.kv_bytes_per_token(model)
        try:
            plan_more = planning.plan(wrapped, dataclasses.replace(serve_config, kv_cache_memory=kv_more), cost, curve)
        except Exception as exc:  # the experts' minimum does not fit beside that much KV cache
            out["runs"]["mira-more"] = dict(ok=False, sequences=more, error=f"{type(exc).__name__}: {exc}"[:300])
        else:
            out["plan_more"] = {k: v for k, v in plan_more.as_dict().items() if k != "candidates"}
            kv_mira = run_mira(out, "mira-more", wrapped, plan_more, total, args, deadline)
            staging = wrapped.mira.staging
            for ahead in args.batch_stage_lookahead:  # the same run, batch copies staged that many blocks ahead
                default = staging.config
                staging.config = dataclasses.replace(default, batch_stage_lookahead=ahead)
                run_mira(out, f"mira-more-ahead-{ahead}", wrapped, plan_more, total, args, deadline)
                staging.config = default
            for placement in args.compare_placements:  # the same split, compressed records held another way
                manager = wrapped.mira
                manager.relocate(
                    manager.store, planning.slot_plan(manager, manager.budget.budget_bytes, placement), manager.device
                )
                run_mira(out, f"mira-more-{placement}", wrapped, plan_more, total, args, deadline)
            plan = plan_more  # accelerate is measured at the most sequences mira-hf served
    model = wrapped.unload()
    model.to("cpu")
    del wrapped
    limit_memory(None)

    # accelerate: layers that do not fit are offloaded; the same KV cache as mira-hf's last run
    if "accelerate" in args.runs and kv_mira is not None:  # after a mira-hf run: it takes that run's KV cache
        if not on_gpu:
            out["runs"]["accelerate"] = dict(ok=False, error="skipped: accelerate offload needs a CUDA device")
        elif time.perf_counter() > deadline:
            out["runs"]["accelerate"] = dict(ok=False, error="skipped: time limit")
        else:
            out["runs"]["accelerate"] = guarded(bench_accelerate, model, text, total, kv_mira, plan.concurrency, top_k, args)
        print(shape, "accelerate", out["runs"]["accelerate"], flush=True)
    del model
    limit_memory(None)
    return out


def run_mira(out: dict, name: str, wrapped, plan, total: int, args, deadline: float) -> int:
    """mira-hf's run at `plan`'s split, recorded as `out["runs"][name]`; returns the plan's KV bytes."""
    limit_memory(total)
    kv = planning.apply(wrapped, plan)
    batching.enable(wrapped.mira)  # batch-aware use estimates, as `mira serve` runs
    wrapped.mira.reset_stats()
    if time.perf_counter() < deadline:
        run = run_fitting(wrapped, plan.concurrency, kv, args, wrapped.config.vocab_size)
        stats = wrapped.mira.stats()
        run.update(
            expert_cache_bytes=wrapped.mira.device_bytes,
            hit_rate=round(stats["hit_rate"], 4),
            h2d_gb=round(stats["bytes_h2d"] / 1e9, 2),
            forwards=stats["steps"],
            loads=stats["loads"],
            loads_ahead=stats["prefetches"],
            ahead_unused=stats["prefetch_wasted"],
            stall_s=round(stats["stall_s"], 2),  # forward time spent waiting for copies
            kept_packed=stats["kept_packed_experts"],  # placement "mixed": experts kept packed beside the slots
            load_latency_p50_ms=stats["load_latency_p50_s"] and round(stats["load_latency_p50_s"] * 1e3, 2),
            union_check=wrapped.mira.batch.union_check(),  # experts a block was expected to use / used, per block
        )
        out["runs"][name] = run
    else:
        out["runs"][name] = dict(ok=False, error="skipped: time limit")
    print(out["shape"], name, out["runs"][name], flush=True)
    limit_memory(None)
    return kv


def bench_accelerate(model, text, total: int, kv_bytes: int, sequences: int, top_k: int, args) -> dict:
    try:
        from accelerate import dispatch_model, infer_auto_device_map
    except ImportError:
        return dict(ok=False, error="skipped: accelerate is not installed (pip install accelerate)")
    activations = planning.step_activation_bytes(text, model.dtype.itemsize, MAX_BATCH_TOKENS, top_k)
    overhead = planning.cache_token_overhead(text, model.dtype.itemsize, MAX_BATCH_TOKENS)
    kv_total = kv_bytes + kv_bytes // serve_memory.kv_bytes_per_token(model) * overhead
    weights = total - activations - kv_total
    layer_class = type(model.model.layers[0]).__name__
    device_map = infer_auto_device_map(model, max_memory={0: weights, "cpu": 10**13}, no_split_module_classes=[layer_class])
    dispatch_model(model, device_map=device_map, main_device=0)
    offloaded = sum(1 for v in device_map.values() if v == "cpu")
    limit_memory(total)
    prompts = prompts_for(sequences, args.prompt_tokens, text.vocab_size, 3)
    run = run_batch(model, prompts, args.accelerate_new_tokens, kv_bytes)
    run.update(weights_budget_bytes=weights, modules_offloaded=offloaded)
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_MEMORY_GIB), choices=list(SHAPES))
    p.add_argument("--memory-gib", nargs="*", default=[], metavar="SHAPE=GIB", help="device memory per shape")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument(
        "--warmup-tokens",
        type=int,
        default=4,
        help="new tokens of an unmeasured batch before the resident run (0: none); the later runs follow warm kernels",
    )
    p.add_argument("--accelerate-new-tokens", type=int, default=8)
    p.add_argument("--max-sequences", type=int, default=256, help="sequences at once at most (the request mix)")
    p.add_argument("--skew", type=float, default=0.5, help="router popularity skew (common.balance_routers)")
    p.add_argument("--time-limit-s", type=float, default=420.0, help="runs not started by then are skipped")
    p.add_argument("--more", type=float, default=1.5, help="mira-more: this many times the resident sequences")
    p.add_argument(
        "--batch-stage-lookahead",
        type=int,
        nargs="*",
        default=[],
        metavar="N",
        help="also run mira-more with PredictorConfig.batch_stage_lookahead=N, for each N (mira-more-ahead-N)",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["none", "auto", "lossless"],
        help="mira-hf's expert transfer format (MiraConfig.quantization; default auto, as `mira serve`); all three are exact",
    )
    p.add_argument(
        "--placement",
        default="auto",
        choices=["auto", "packed", "dequant", "mixed"],
        help="compressed records kept packed in the cache, or decoded once per copy (QuantConfig.placement; default auto: "
        "what `mira serve` loads, serving_mira_config's choice)",
    )
    p.add_argument(
        "--compare-placements",
        nargs="*",
        default=[],
        choices=["dequant", "mixed"],
        help="after mira-more, the same split again with the records held by each of these placements (one process)",
    )
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS, help="set-ups after resident (which always runs)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, short requests (< 1 minute)")
    args = p.parse_args()
    on_gpu = torch.cuda.is_available() and not args.smoke
    args.memory = dict(DEFAULT_MEMORY_GIB)
    if args.smoke:
        args.memory = {s: 0.25 for s in SHAPES}
        args.prompt_tokens, args.new_tokens, args.max_sequences = 32, 8, 8
    for item in args.memory_gib:
        name, _, gib = item.partition("=")
        args.memory[name] = float(gib)
    if on_gpu:
        torch.backends.cuda.enable_cudnn_sdp(False)
    deadline = time.perf_counter() + args.time_limit_s
    results = dict(environment=environment(), smoke=args.smoke, args={k: v for k, v in vars(args).items() if k != "memory"})
    results["memory_gib"] = {s: args.memory[s] for s in args.shapes}
    results["shapes"] = []
    rows = []
    for shape in args.shapes:
        if time.perf_counter() > deadline:
            results["shapes"].append(dict(shape=shape, error="skipped: time limit"))
            continue
        r = bench_shape(shape, args, on_gpu, deadline)
        results["shapes"].append(r)
        write_json(args.out, results)  # what is done so far survives a later failure
        base = r["runs"].get("resident", {})
        for name, run in r["runs"].items():
            row = dict(
                shape=shape,
                setup=name,
                **{k: run.get(k) for k in ("ok", "sequences", "tokens_per_s", "tpot_p50_ms", "tpot_p95_ms")},
            )
            if base.get("ok") and run.get("ok") and base.get("sequences"):  # against all experts resident
                row["x_sequences"] = round(run["sequences"] / base["sequences"], 2)
                row["x_speed_per_sequence"] = round(
                    run["tokens_per_s"] / run["sequences"] / (base["tokens_per_s"] / base["sequences"]), 3
                )
                r["runs"][name].update(x_sequences=row["x_sequences"], x_speed_per_sequence=row["x_speed_per_sequence"])
            rows.append(row)
        write_json(args.out, results)
    columns = ["shape", "setup", "ok", "sequences", "tokens_per_s", "tpot_p50_ms", "tpot_p95_ms", "x_sequences"]
    print_table(rows, columns + ["x_speed_per_sequence"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
