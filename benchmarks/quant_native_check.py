"""GPU check of pre-quantized checkpoints served in their own bytes (FP8 block-scaled, MXFP4).

For tiny checkpoints written in the hub's exact layout (tests/quantized_checkpoints.py: FP8 for
deepseek_v3, qwen3_moe, glm4_moe, qwen3_next, minimax_m2; MXFP4 for gpt_oss), on the GPU:

    transformers' own load of the directory (device_map="cuda"): which path it took on this GPU
        (native FP8 experts / Triton MXFP4 experts, or dequantized), or the error it raised;
    transformers' dequantize path (FineGrainedFP8Config / Mxfp4Config(dequantize=True)), with its default
        experts implementation and with experts_implementation="eager";
    MiraMoEModel.from_pretrained (25 % budget), placement "dequant" (the default), and for FP8
        placement "packed" (transformers' fp8_linear on packed records) where this GPU computes FP8;
    for each pair: logits torch.equal and max |diff|, greedy and beam tokens identical;
    store bytes, the checkpoint's expert bytes and the bf16 bytes of the same experts.

On the CPU mira's default path equals the dequantize path bit for bit in fp32 (in bf16 the proxy sums its K
rows in fp32 where transformers sums in bf16, as for any bf16 checkpoint, so bf16 is compared with the whole
load too). On a GPU the fp32 question is whether transformers' kernels round as the proxy's F.linear does
(the eager row), and the native-kernel path differs by FP8/FP4 activation rounding. Prints a table, writes JSON.

    python benchmarks/quant_native_check.py --out benchmarks/results/quant_native_check.json
    python benchmarks/quant_native_check.py --device cpu --families qwen3_moe gpt_oss --out /tmp/q.json  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from common import module_version  # noqa: E402
from quantized_checkpoints import FP8_FAMILIES, write_fp8_checkpoint, write_mxfp4_checkpoint  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.config import LoaderConfig, QuantConfig  # noqa: E402

IDS = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(5))
GREEDY = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
BEAM = dict(max_new_tokens=6, do_sample=False, num_beams=3, pad_token_id=0)


def _transformers(path: str, device: str, dtype, dequantize: bool, experts_implementation: str | None = None):
    from transformers import FineGrainedFP8Config, Mxfp4Config

    from mira_hf.checkpoint import model_class_of

    kw = {"dtype": dtype, "device_map": device}
    if experts_implementation is not None:
        kw["experts_implementation"] = experts_implementation
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if dequantize:
        method = config["quantization_config"]["quant_method"]
        kw["quantization_config"] = FineGrainedFP8Config(dequantize=True) if method == "fp8" else Mxfp4Config(dequantize=True)
    model = model_class_of(config).from_pretrained(path, **kw).eval()  # a vision-language model's own class
    experts = {type(m).__name__ for n, m in model.named_modules() if n.endswith(".experts")}
    return model, sorted(experts)


def _mira(path: str, device: str, dtype, **kw):
    cfg = MiraConfig(device=device, gpu_budget=0.25, **kw)
    return MiraMoEModel.from_pretrained(path, cfg, progress=False, dtype=dtype).eval()


def _outputs(model, device: str) -> dict:
    ids = IDS.to(device)
    with torch.no_grad():
        logits = model(ids).logits.float().cpu()
    return {
        "logits": logits,
        "greedy": model.generate(ids[:1], **GREEDY).cpu(),
        "beam": model.generate(ids[:1], **BEAM).cpu(),
    }


def _compare(a: dict, b: dict) -> dict:
    return {
        "logits_equal": bool(torch.equal(a["logits"], b["logits"])),
        "max_abs_diff": float((a["logits"] - b["logits"]).abs().max()),
        "greedy_equal": bool(torch.equal(a["greedy"], b["greedy"])),
        "beam_equal": bool(torch.equal(a["beam"], b["beam"])),
    }


def _expert_bytes(path: str, model) -> int:
    from safetensors import safe_open

    names = [t.name for t in model._mira_targets]
    prefixes = tuple(n + "." for n in names) + tuple(n.replace(".mlp.", ".block_sparse_moe.") + "." for n in names)
    total = 0
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as h:
                for k in h.keys():
                    if k.startswith(prefixes):
                        total += h.get_tensor(k).nbytes
    return total


def check(family: str, path: str, device: str, dtype) -> dict:
    row: dict = {"family": family, "dtype": str(dtype).removeprefix("torch.")}
    refs = {}
    # its default experts kernels (grouped_mm; native FP8/MXFP4 ones where it keeps those formats), and the
    # per-expert eager loop of its dequantized model (the F.linear per expert that mira's proxy runs)
    for label, dequantize, impl in (
        ("transformers", False, None),
        ("transformers_dequantize", True, None),
        ("transformers_dequantize_eager", True, "eager"),
    ):
        try:
            model, experts = _transformers(path, device, dtype, dequantize, impl)
            refs[label] = _outputs(model, device)
            row[f"{label}_experts"] = experts
            del model
        except Exception as exc:  # e.g. the FP8/MXFP4 kernels are not installed or not reachable offline
            row[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:400]
    placements = ["dequant"]
    mira = _mira(path, device, dtype)
    codec = mira.mira.store.codec
    store = mira.mira.store
    row.update(
        codec=codec.name,
        store_bytes=store.nbytes,
        checkpoint_expert_bytes=_expert_bytes(path, mira),
        model_dtype_expert_bytes=sum(store.raw_layout(li).payload_bytes * store.num_experts(li) for li in store.layers),
    )
    if device.startswith("cuda") and codec.computes_natively(torch.device(device)):
        placements.append("packed")
    for placement in placements:
        t0 = time.perf_counter()
        try:
            model = mira if placement == "dequant" else _mira(path, device, dtype, quant=QuantConfig(placement=placement))
            out = _outputs(model, device)
            row[f"mira_{placement}_s"] = round(time.perf_counter() - t0, 3)
            for label, ref in refs.items():
                row[f"mira_{placement}_vs_{label}"] = _compare(out, ref)
            if placement == "dequant":
                whole = _mira(path, device, dtype, loader=LoaderConfig(stream_experts=False))
                row["mira_dequant_vs_whole_load"] = _compare(out, _outputs(whole, device))
                del whole
            del model
        except Exception as exc:
            row[f"mira_{placement}_error"] = f"{type(exc).__name__}: {exc}"[:400]
            traceback.print_exc()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--families", nargs="+", default=[*FP8_FAMILIES, "gpt_oss"])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            path = os.path.join(tmp, family)
            write_mxfp4_checkpoint(path) if family == "gpt_oss" else write_fp8_checkpoint(family, path)
            for dtype in args.dtypes:
                rows.append(check(family, path, args.device, getattr(torch, dtype)))
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
    env = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        "capability": list(torch.cuda.get_device_capability()) if args.device.startswith("cuda") else None,
        "torch": torch.__version__,
        "transformers": module_version("transformers"),
        "kernels": module_version("kernels"),
        "triton": module_version("triton"),
    }
    with open(args.out, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print(json.dumps(env))
    head = f"{'family':<12}{'dtype':<10}{'codec':<10}{'store/ckpt':>11}{'store/dense':>12}  {'comparison':<44}{'logits':>7}{'max|d|':>10}{'greedy':>7}{'beam':>6}"
    print(head)
    for r in rows:
        ratio = f"{r['store_bytes'] / r['checkpoint_expert_bytes']:.3f}"
        dense = f"{r['store_bytes'] / r['model_dtype_expert_bytes']:.3f}"
        first = True
        for key, v in r.items():
            if isinstance(v, dict):
                lead = f"{r['family']:<12}{r['dtype']:<10}{r['codec']:<10}{ratio:>11}{dense:>12}" if first else " " * 55
                print(
                    f"{lead}  {key:<44}{v['logits_equal']!s:>7}{v['max_abs_diff']:>10.2e}{v['greedy_equal']!s:>7}{v['beam_equal']!s:>6}"
                )
                first = False
        for key, v in r.items():
            if key.endswith(("_error", "_experts")):
                print(f"{'':<12}{key}: {v}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
