"""Full-depth benchmark: real-dimension MoE models at every layer, with routing shaped like a trained model's.

One model per invocation, one GPU. Random weights route almost uniformly (or onto a few experts), which
measures no cache; so every model first gets topic-driven routers (`topic_routing.shape_routing`: skewed
but spread load, token-to-token reuse, layer-to-layer predictability), and the statistics its recorded
routing reached are written beside every number.

    --model mixtral    Mixtral-8x7B, 32 layers, bf16 (93 GB): built on the GPU, shaped, wrapped at 20 GiB
    --model qwen3      Qwen3-30B-A3B, 48 layers, 128 experts top-8, bf16 (61 GB): built on the GPU, wrapped at 8 and 16 GiB
    --model gpt-oss    gpt-oss-20b, 24 layers, 32 experts top-4: written as an MXFP4 checkpoint in the hub's layout
                       (~13 GB), loaded with MiraMoEModel.from_pretrained at 4 GiB
    --model deepseek   DeepSeek-V3 dimensions cut to 8 layers of 64 experts: written as an FP8 block-scaled checkpoint
                       in the hub's layout (~26 GB), loaded with from_pretrained at 25% of its expert bytes

Per budget: set-up time (build + shape + wrap, or the checkpoint's first load with its files out of the page
cache and a second, cached load), TTFT of a 512-token prompt, decode tokens/s at batch 1 and 8, beam-4 tokens/s,
peak GPU memory, host RSS, mira's hit rate, stall share and bytes per token, and the PCIe floor: the bytes
Belady's optimal cache with the same slots moves per decode token (replayed over the batch-1 routing) over
the measured pinned H2D bandwidth and over 55 GB/s. Where the model was built whole on the GPU, the same
measurements of the all-resident model come first (`--no-resident` skips them), and each wrapped model's
greedy tokens are compared with the all-resident model's.

    python benchmarks/full_depth.py --model mixtral --out $OUT              # GPU; writes OUT/DATE-DEVICE-full-depth-mixtral.{json,md}
    python benchmarks/full_depth.py --model qwen3 --budget 8GiB --out $OUT  # one budget: ...-full-depth-qwen3-8GiB.{json,md}
    python benchmarks/full_depth.py --model qwen3 --smoke --out /tmp/fd     # CPU, tiny shapes: checks the script
    python benchmarks/full_depth.py --render A.json B.json --md benchmarks/results/DATE-DEVICE-full-depth.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))  # the hub-layout checkpoint writers
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench.clock import START, Deadline, log, log_failure  # noqa: E402  (before torch: the log and time guard count imports too)

if __name__ == "__main__":  # before transformers is imported
    for _k, _v in (("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_VERBOSITY", "error")):
        os.environ.setdefault(_k, _v)

import torch  # noqa: E402
from bench.limits import compute_limit  # noqa: E402
from bench.measure import (  # noqa: E402
    PeakMemory,
    Settings,
    empty_host_cache,
    free_device_cache,
    host_rss_gb,
    measure_bandwidth,
    phase_metrics,
    pinned_host_gb,
    routing_trace,
    run_phases,
    standard_phases,
)  # fmt: skip
from bench.render import _n  # noqa: E402
from bench.systems import _teardown  # noqa: E402
from bench.workloads import _pad_id, model_facts  # noqa: E402
from common import device_slug, environment, print_table, random_model_on_device, write_json  # noqa: E402
from routing_stats import from_records, routing_stats  # noqa: E402
from topic_routing import RoutingTargets, shape_routing, topic_prompts  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.heat import HeatConfig  # noqa: E402

GB = 1e9
PCIE_GBPS = 55.0  # nominal PCIe Gen5 x16 host-to-device rate the floor is also quoted at
SHARD_BYTES = 5 * 10**9


@dataclass(frozen=True)
class Plan:
    """One benchmark model: its shape, how it is made, its budgets and token counts."""

    label: str
    shape: str
    smoke_shape: str
    source: str  # "wrap" (built on the device and wrapped) or a checkpoint format: "mxfp4", "fp8"
    budgets: tuple  # MiraConfig.gpu_budget values
    new_tokens: int = 64  # decode tokens at batch 1 and 8
    beam_tokens: int = 32


PLANS = {
    "mixtral": Plan(
        "Mixtral-8x7B, 32 layers (bf16, random, shaped routing)", "mixtral-8x7b", "mixtral-smoke", "wrap", ("20GiB",), 32, 16
    ),
    "qwen3": Plan(
        "Qwen3-30B-A3B, 48 layers (bf16, random, shaped routing)", "qwen3-30b-a3b", "qwen3-smoke", "wrap", ("8GiB", "16GiB")
    ),
    "gpt-oss": Plan(
        "gpt-oss-20b, 24 layers (MXFP4 checkpoint, random, shaped routing)", "gpt-oss-20b", "gpt-oss-smoke", "mxfp4", ("4GiB",)
    ),
    "deepseek": Plan(
        "DeepSeek-V3 dimensions, 8 layers x 64 experts (FP8 checkpoint, random, shaped routing)",
        "deepseek-v3-8l-64e",
        "deepseek-v3-smoke",
        "fp8",
        (0.25,),
    ),
}
SMOKE = dict(prompt_len=32, new_tokens=4, beam_tokens=3, budgets=(0.25,))


# -- checkpoints in the hub's layout -------------------------------------------------------------
def on_disk_tensors(model_type: str, key: str, t: torch.Tensor):
    """(key, tensor) pairs of one in-memory tensor as the family's checkpoints store it: gpt-oss keeps its fused
    experts; the others store one tensor per expert (transformers' qwen2_moe conversion, reversed)."""
    if model_type == "gpt_oss" or not key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        yield key, t
        return
    base = key.rsplit(".", 1)[0]
    if key.endswith("gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
        inter = t.shape[1] // 2
        for e, w in enumerate(t):
            yield f"{base}.{e}.gate_proj.weight", w[:inter]
            yield f"{base}.{e}.up_proj.weight", w[inter:]
    else:  # [E, H, I]
        for e, w in enumerate(t):
            yield f"{base}.{e}.down_proj.weight", w


def write_prequantized(model, path: str, fmt: str) -> dict:
    """Write `model` (bf16, any device) as a pre-quantized checkpoint in the hub's layout: "fp8" (block-scaled
    FP8 of every linear weight, as DeepSeek-V3 ships) or "mxfp4" (gpt-oss's MXFP4 experts). Quantizes on the
    model's device; returns bytes and seconds."""
    from quantized_checkpoints import (
        FP8_QUANTIZATION_CONFIG,
        MXFP4_QUANTIZATION_CONFIG,
        fp8_tensors,
        mxfp4_tensors,
        write_shards,
    )

    t0 = time.perf_counter()
    quantize, qconfig = (fp8_tensors, FP8_QUANTIZATION_CONFIG) if fmt == "fp8" else (mxfp4_tensors, MXFP4_QUANTIZATION_CONFIG)
    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    state = {}
    with torch.no_grad():
        for key, t in model.state_dict().items():
            for k, w in on_disk_tensors(model.config.model_type, key, t):
                for k2, q in quantize(k, w).items():
                    state[k2] = q.to("cpu").contiguous()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    quantized_s = time.perf_counter() - t0
    write_shards(path, state, dict(qconfig), max(1, math.ceil(nbytes / SHARD_BYTES)))
    del state
    return dict(checkpoint_bytes=nbytes, quantize_s=quantized_s, write_s=time.perf_counter() - t0 - quantized_s)


def drop_from_page_cache(path: str) -> bool:
    """Flush the checkpoint's files and ask the kernel to drop them from the page cache, so the next load reads
    the disk. False where the platform has no posix_fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


# -- one model -----------------------------------------------------------------------------------
def settings(args, plan: Plan) -> Settings:
    return Settings(
        args.device,
        args.prompt_len,
        args.new_tokens or plan.new_tokens,
        args.batch,
        args.beams,
        args.beam_tokens or plan.beam_tokens,
        0,
        args.warmup_tokens,
        args.seed,
    )


def measure(model, prompts: torch.Tensor, s: Settings, deadline: Deadline, row: dict, manager=None) -> tuple[list, list]:
    """Fill `row` with bench's phases (TTFT, decode tok/s at batch 1 and `s.batch`, beam tok/s, peak GPU memory per
    phase; for a mira model its decode-phase counters): each phase's result under its key ("b1", "b8", "beam") and
    the flat fields the table reads. Returns the routing recorded in the batch-1 and batch-`s.batch` decodes."""
    rec1: list = []
    rec8: list = []
    phases = standard_phases(prompts, s, s.new_tokens, s.beam_tokens, {"b1": rec1, "b8": rec8})
    results = run_phases(model, phases, s.warmup_tokens, deadline, _pad_id(model), row, manager)
    row.update(results)
    row.update(phase_metrics(results, s.batch))
    return rec1, rec8


def routing_summary(rec1: list, rec8: list, batch: int, num_experts: list[int]) -> dict:
    """Statistics of the recorded routing: the batch-`batch` prompts (teacher-forced topic walks), their greedy
    decode, and the batch-1 decode (the one the PCIe floor replays)."""
    out = {}
    if rec8:
        prompt, decode = from_records(rec8, batch)
        out["prompt"] = routing_stats(prompt, num_experts)
        if decode[0].shape[1] > 1:
            out["decode"] = routing_stats(decode, num_experts)
    if rec1:
        _, decode1 = from_records(rec1, 1)
        if decode1[0].shape[1] > 1:
            out["decode_b1"] = routing_stats(decode1, num_experts)
    return out


def pcie_floor(facts: dict, manager, rec1: list, bw: dict) -> dict:
    """Belady's bytes per decode token for this cache's slots, over the batch-1 routing, and the time they take
    over the measured H2D bandwidth and over PCIE_GBPS."""
    lim = compute_limit(facts, routing_trace(rec1, manager), bw)
    per_token = lim["belady_bytes_per_token"]
    lim["transfer_s_at_55"] = None if per_token is None else per_token / (PCIE_GBPS * GB)
    return lim


def greedy_tokens(model, prompt: torch.Tensor, s: Settings) -> torch.Tensor:
    """`s.new_tokens` greedy tokens after `prompt` [1, S], on the CPU."""
    kw = dict(max_new_tokens=s.new_tokens, min_new_tokens=s.new_tokens, do_sample=False, pad_token_id=_pad_id(model))
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), **kw).cpu()


def run_budget(
    plan: Plan, key: str, budget, args, s: Settings, deadline: Deadline, bw: dict, result: dict, reference: dict
) -> dict:
    """Make the model (build + shape + wrap, or write + load a checkpoint), measure it, tear it down. `reference`
    keeps the all-resident model's greedy tokens (measured with the first budget) for the later ones."""
    row: dict = dict(model=key, budget=budget, status="ok", notes=[])
    shape = plan.smoke_shape if args.smoke else plan.shape
    targets = RoutingTargets()
    model = manager = None
    scratch = None
    t_all = time.perf_counter()
    try:
        t = time.perf_counter()
        model = random_model_on_device(shape, device=s.device, seed=s.seed)
        row["build_s"] = time.perf_counter() - t
        facts = model_facts(model)
        result["facts"] = facts
        vocab = model.config.vocab_size
        prompts = topic_prompts(s.batch, s.prompt_len, vocab, targets.topics, targets.p_stay, seed=s.seed + 1).to(s.device)
        t = time.perf_counter()
        result["routing_construction"] = shape_routing(model, prompts, targets, seed=s.seed)
        row["shape_s"] = time.perf_counter() - t
        log(f"{key}: built {row['build_s']:.1f} s, routing shaped {row['shape_s']:.1f} s")
        num_experts = [facts["num_experts"]] * facts["moe_layers"]
        if plan.source == "wrap":
            if args.resident and "resident" not in result:
                log(f"{key}: all resident")
                res: dict = dict(status="ok", notes=[])
                measure(model, prompts, s, deadline, res)
                result["resident"] = res
                reference["tokens"] = greedy_tokens(model, prompts[:1], s)
            free_device_cache()
            t = time.perf_counter()
            MiraMoEModel.wrap(
                model, MiraConfig(gpu_budget=budget, device=s.device, heat=HeatConfig(seed_from_prompt=args.prompt_seed))
            )
            row["wrap_s"] = time.perf_counter() - t
            row["setup_s"] = row["build_s"] + row["shape_s"] + row["wrap_s"]
        else:
            scratch = tempfile.mkdtemp(prefix=f"mira-full-depth-{key}-", dir=args.tmp_dir)
            path = os.path.join(scratch, "checkpoint")
            row.update(write_prequantized(model, path, plan.source))
            log(
                f"{key}: wrote {row['checkpoint_bytes'] / GB:.1f} GB ({plan.source}) in {row['quantize_s'] + row['write_s']:.1f} s"
            )
            del model
            model = None
            free_device_cache()
            row["page_cache_dropped"] = drop_from_page_cache(path)
            cfg = MiraConfig(gpu_budget=budget, device=s.device, heat=HeatConfig(seed_from_prompt=args.prompt_seed))
            peak = PeakMemory(s.device.startswith("cuda"))
            peak.start()
            for name in ("load_first_s", "load_cached_s"):
                if model is not None:
                    _teardown(model)
                    model = None
                    free_device_cache()
                t = time.perf_counter()
                model = MiraMoEModel.from_pretrained(path, cfg, progress=False, dtype=torch.bfloat16).eval()
                row[name] = time.perf_counter() - t
                log(f"{key}: {name} {row[name]:.1f} s")
            peak.stop("load")
            row["peak_gpu_gb_load"] = peak.overall
            row["setup_s"] = row["load_cached_s"]
        manager = model.mira
        row["cache"] = dict(
            slots=sum(manager.budget.n_slots.values()),
            record_bytes=manager.store.record_bytes(0),
            budget_bytes=manager.budget.budget_bytes,
            store_bytes=manager.store.nbytes,
            expert_bytes_bf16=facts["expert_bytes"],
            quantization=manager.quantization,
            placement=manager.placement,
        )
        row["gpu_gb_after_setup"] = torch.cuda.memory_allocated() / GB if torch.cuda.is_available() else None
        log(f"{key} @ {budget}: measuring ({row['cache']['slots']} slots of {row['cache']['record_bytes'] / 1e6:.1f} MB)")
        rec1, rec8 = measure(model, prompts, s, deadline, row, manager)
        row["routing"] = routing_summary(rec1, rec8, s.batch, num_experts)
        if "tokens" in reference and deadline.remaining() > 0:  # exactness at full depth: the same greedy tokens
            row["same_tokens_as_resident"] = bool(torch.equal(greedy_tokens(model, prompts[:1], s), reference["tokens"]))
        if rec1:
            row["floor"] = pcie_floor(facts, manager, rec1, bw)
            if row.get("decode_tok_s_b1") and row["floor"]["transfer_s"]:
                row["x_floor"] = (1.0 / row["decode_tok_s_b1"]) / row["floor"]["limit_s"]
    except Exception as exc:  # a failure is a row of the result, not the end of the run
        log_failure(row, exc, f"{key} @ {budget}")
    finally:
        row["host_rss_gb"] = host_rss_gb()  # with the model loaded (the expert store included)
        row["pinned_host_gb"] = pinned_host_gb()
        _teardown(model)
        model = manager = None
        free_device_cache()
        empty_host_cache()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        row["system_s"] = time.perf_counter() - t_all
    return row


# -- output ---------------------------------------------------------------------------------------
COLUMNS = [
    "model",
    "budget",
    "format",
    "set-up s",
    "TTFT s",
    "b1 tok/s",
    "b8 tok/s",
    "beam tok/s",
    "peak GB",
    "host RSS GB",
    "hit",
    "floor ms/tok",
    "x floor",
    "top-20% share",
    "reuse",
    "next-layer recall",
    "same tokens",
]


def _stat(row: dict, key: str) -> str:
    """prompt / decode mean of one routing statistic."""
    r = row.get("routing") or {}
    vals = [((r.get(part) or {}).get(key) or {}).get("mean") for part in ("prompt", "decode")]
    return "/".join(_n(v, "{:.2f}") for v in vals)


def table_rows(result: dict) -> list[dict]:
    rows = []
    label = result["plan"]["shape"]
    res = result.get("resident")
    if res:
        rows.append(
            {
                "model": label,
                "budget": "all resident",
                "format": "bf16",
                "TTFT s": _n(res.get("ttft_s")),
                "b1 tok/s": _n(res.get("decode_tok_s_b1")),
                "b8 tok/s": _n(res.get("decode_tok_s_b8")),
                "beam tok/s": _n(res.get("beam_tok_s")),
                "peak GB": _n(res.get("peak_gpu_gb"), "{:.1f}"),
            }
        )
    for r in result["rows"]:
        cache = r.get("cache") or {}
        floor = r.get("floor") or {}
        setup = r.get("setup_s")
        if r.get("load_first_s") is not None:
            setup = f"{r['load_first_s']:.1f} / {r['load_cached_s']:.1f}"
        rows.append(
            {
                "model": label,
                "budget": str(r["budget"]) + ("" if r["status"] == "ok" else f" ({r['status']})"),
                "format": cache.get("quantization") or "bf16",
                "set-up s": setup if isinstance(setup, str) else _n(setup, "{:.0f}"),
                "TTFT s": _n(r.get("ttft_s")),
                "b1 tok/s": _n(r.get("decode_tok_s_b1")),
                "b8 tok/s": _n(r.get("decode_tok_s_b8")),
                "beam tok/s": _n(r.get("beam_tok_s")),
                "peak GB": _n(r.get("peak_gpu_gb"), "{:.1f}"),
                "host RSS GB": _n(r.get("host_rss_gb"), "{:.0f}"),
                "hit": _n(None if r.get("hit_rate") is None else 100 * r["hit_rate"], "{:.0f}%"),
                "floor ms/tok": _n(None if floor.get("transfer_s") is None else 1e3 * floor["limit_s"]),
                "x floor": _n(r.get("x_floor")),
                "top-20% share": _stat(r, "top20_share"),
                "reuse": _stat(r, "reuse"),
                "next-layer recall": _stat(r, "next_layer_recall"),
                "same tokens": {True: "yes", False: "NO", None: ""}[r.get("same_tokens_as_resident")],
            }
        )
    return rows


def render_markdown(results: list[dict]) -> str:
    """The README table of one or more results (one per model), with how they were measured."""
    env = results[0]["env"] if results else {}
    rows = [row for result in results for row in table_rows(result)]
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS)
    body = "\n".join("| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |" for r in rows)
    smoke = any(r.get("args", {}).get("smoke") for r in results)
    lines = [
        f"# Full-depth benchmark: {env.get('device')} ({env.get('date')})",
        "",
        f"torch {env.get('torch')}, transformers {env.get('transformers')}."
        + ("  **(smoke: tiny shapes on CPU, numbers mean nothing)**" if smoke else ""),
        "",
        head,
        body,
        "",
        "Set-up: build + routing shaping + wrap for models built on the GPU; first (files out of the page cache) / "
        "second load for checkpoints. Floor: the larger of Belady's bytes per batch-1 decode token (the optimal cache "
        "with the same slots, replayed over the recorded routing) over the measured pinned H2D bandwidth and the bytes "
        "a token reads over device-memory bandwidth; x floor = measured batch-1 time per token over it. Routing columns: "
        "prompt / greedy-decode means over MoE layers (top-20% share: of routing taken by the top 20% of experts; "
        "reuse: share of a token's experts the previous token used; next-layer recall: share of a token's experts "
        "predicted from its previous layer's experts by co-occurrence counts). Same tokens: the wrapped model's greedy "
        "tokens equal the all-resident model's.",
    ]
    for result in results:
        chance = ((result["rows"] or [{}])[0].get("routing") or {}).get("prompt") or {}
        lines.append(
            f"\n- {result['plan']['label']}: chance reuse {_n(chance.get('chance_reuse'), '{:.3f}')}, "
            f"chance top-20% share {_n(chance.get('chance_top20_share'), '{:.3f}')}; "
            f"measured pinned H2D {result['bandwidth'].get('h2d_gbps', 0):.1f} GB/s."
        )
        for r in result["rows"]:
            for note in r.get("notes", []) + ([r["error"]] if r.get("error") else []):
                lines.append(f"  - {r['budget']}: {note}")
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, stem: str) -> None:
    write_json(stem + ".json", result)
    with open(stem + ".md", "w") as f:
        f.write(render_markdown([result]))


# -- main -----------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(PLANS))
    ap.add_argument("--budget", action="append", help="gpu_budget ('8GiB', or a fraction such as 0.25); default: the model's")
    ap.add_argument("--out", help="directory for DATE-DEVICE-full-depth-MODEL.json and .md")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, help="decode tokens at batch 1 and 8 (default: the model's)")
    ap.add_argument("--beam-tokens", type=int, help="beam-search tokens (default: the model's)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--warmup-tokens", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-prompt-seed", dest="prompt_seed", action="store_false", help="HeatConfig(seed_from_prompt=False)")
    ap.add_argument("--no-resident", dest="resident", action="store_false", help="skip the all-resident measurements")
    ap.add_argument("--time-budget-s", type=float, default=510.0, help="generations stop when this is spent (from start)")
    ap.add_argument("--tmp-dir", default=os.environ.get("TMPDIR") or "/tmp", help="where checkpoints are written (removed after)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, a few tokens: checks the script")
    ap.add_argument("--render", nargs="+", metavar="JSON", help="only render these results into one table (--md)")
    ap.add_argument("--md", help="with --render: the Markdown file to write (default: print)")
    args = ap.parse_args(argv)
    if args.render is None and (args.model is None or args.out is None):
        ap.error("--model and --out are required (or --render)")
    return args


def _budget(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        results = []
        for path in args.render:
            with open(path) as f:
                results.append(json.load(f))
        text = render_markdown(results)
        if args.md:
            with open(args.md, "w") as f:
                f.write(text)
            print(f"wrote {args.md}")
        else:
            print(text)
        return 0
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA GPU visible: run on a GPU machine, or pass --smoke for the CPU check.", flush=True)
        return 2
    import transformers

    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=UserWarning)
    plan = PLANS[args.model]
    args.device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.prompt_len = min(args.prompt_len, SMOKE["prompt_len"])
        args.new_tokens = min(args.new_tokens or plan.new_tokens, SMOKE["new_tokens"])
        args.beam_tokens = min(args.beam_tokens or plan.beam_tokens, SMOKE["beam_tokens"])
        torch.set_num_threads(1)
    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(False)  # it builds a graph per new sequence length (NOTES.md, "Measuring")
    budgets = [_budget(b) for b in args.budget] if args.budget else list(SMOKE["budgets"] if args.smoke else plan.budgets)
    s = settings(args, plan)
    deadline = Deadline(args.time_budget_s)
    env = environment()
    name = args.model + "".join(f"-{b}" for b in args.budget or []) + ("" if args.prompt_seed else "-no-prompt-seed")
    stem = os.path.join(args.out, f"{env['date']}-{device_slug(env, not args.smoke)}-full-depth-{name}")
    os.makedirs(args.out, exist_ok=True)
    result = dict(
        env=env,
        args=vars(args),
        command=" ".join(["benchmarks/full_depth.py", *(argv if argv is not None else sys.argv[1:])]),
        plan=dict(asdict(plan), shape=plan.smoke_shape if args.smoke else plan.shape),
        settings=asdict(s),
        rows=[],
    )
    log(f"{env.get('device')}: torch {env['torch']}, transformers {env['transformers']}; writing {stem}.*")
    result["bandwidth"] = measure_bandwidth(args.smoke)
    reference: dict = {}
    for budget in budgets:
        if result["rows"] and deadline.remaining() < result["rows"][-1]["system_s"]:  # would not finish in time
            result["rows"].append(dict(model=args.model, budget=budget, status="skipped", notes=["time budget"]))
            continue
        row = run_budget(plan, args.model, budget, args, s, deadline, result["bandwidth"], result, reference)
        result["rows"].append(row)
        result["elapsed_s"] = time.perf_counter() - START
        write_outputs(result, stem)
        log(f"{args.model} @ {budget}: {row['status']} in {row['system_s']:.1f} s")
    print_table(table_rows(result), COLUMNS)
    print(f"wrote {stem}.json, {stem}.md", flush=True)
    return 0 if all(r["status"] in ("ok", "partial", "skipped") for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
