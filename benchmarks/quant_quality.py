"""Quality of each expert transfer format on the bundled trained model (CPU): held-out perplexity
against the unquantised model, bytes per expert, metadata share, and per-layer relative output error
of the expert FFN. Prints a table, writes benchmarks/results/<date>-cpu-quant-quality.json.

    python benchmarks/quant_quality.py [--windows 16]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, write_json  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel, bundled_model_path  # noqa: E402
from mira_hf.config import QuantConfig  # noqa: E402
from mira_hf.layout import IdentityCodec  # noqa: E402
from mira_hf.quant import make_codec  # noqa: E402
from mira_hf.quant.padding import PaddedCodec  # noqa: E402

MIXTRAL_EXPERT = {"gate_up_proj": ((2 * 14336, 4096), torch.bfloat16), "down_proj": ((4096, 14336), torch.bfloat16)}


def perplexity(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return math.exp(model(ids, labels=ids).loss.item())


def ffn_error(model_ref, model_q, ids: torch.Tensor) -> list[float]:
    """Per MoE layer: ‖y_q − y‖ / ‖y‖ of the routed-experts output on the same inputs."""
    outs: dict[str, list] = {"ref": [], "q": []}

    def hook(tag):
        return lambda mod, args, out: outs[tag].append(out.detach().float())

    hs = [m.register_forward_hook(hook("ref")) for n, m in model_ref.named_modules() if n.endswith("mlp.experts")]
    hs += [m.register_forward_hook(hook("q")) for n, m in model_q.named_modules() if n.endswith("mlp.experts")]
    with torch.no_grad():
        model_ref(ids)
        model_q(ids)
    for h in hs:
        h.remove()
    return [float((q - r).norm() / r.norm()) for r, q in zip(outs["ref"], outs["q"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--windows", type=int, default=16, help="held-out windows of 256 tokens")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    path = bundled_model_path()
    ids = load_file(os.path.join(path, "heldout_tokens.safetensors"))["input_ids"][: args.windows].long()
    formats = ["int8", "int4"] + (["nf4"] if importlib.util.find_spec("bitsandbytes") else [])

    def load(q):
        cfg = MiraConfig(device="cpu", gpu_budget=1.0, quantization=q, quant=QuantConfig(placement="dequant"))
        return MiraMoEModel.from_pretrained(path, cfg, dtype=torch.float32, progress=False)  # bf16 checkpoint, exact in fp32

    ref = load(None)
    base = perplexity(ref, ids)
    rows = [dict(format="none (checkpoint bf16)", ppl=base, ppl_delta_pct=0.0)]
    for q in formats:
        model = load(q)
        ppl = perplexity(model, ids)
        codec = PaddedCodec(make_codec(q), 64)
        tiny_specs = {s.name: (s.shape, s.dtype) for s in ref.mira.store.raw_layout(0).tensors}
        tiny = codec.plan(tiny_specs)
        mix = codec.plan(MIXTRAL_EXPERT)
        err = ffn_error(ref, model, ids[:4])
        rows.append(
            dict(
                format=q,
                ppl=ppl,
                ppl_delta_pct=100 * (ppl / base - 1),
                bytes_tiny=tiny.nbytes,
                bytes_tiny_bf16=IdentityCodec().plan(tiny_specs).nbytes,
                bytes_mixtral_mb=mix.nbytes / 1e6,
                bytes_mixtral_bf16_mb=IdentityCodec().plan(MIXTRAL_EXPERT).nbytes / 1e6,
                meta_share_mixtral=mix.meta_bytes / mix.payload_bytes,
                ffn_rel_err_mean=sum(err) / len(err),
                ffn_rel_err_per_layer=err,
            )
        )
    cols = ["format", "ppl", "ppl_delta_pct", "bytes_tiny", "bytes_mixtral_mb", "meta_share_mixtral", "ffn_rel_err_mean"]
    text = print_table(rows, cols)
    env = environment()
    write_json(
        os.path.join(args.out, f"{env['date']}-cpu-quant-quality.json"),
        dict(
            env=env,
            windows=args.windows,
            tokens=int(ids.numel()),
            rows=rows,
            table=text,
            command="python benchmarks/quant_quality.py",
        ),
    )


if __name__ == "__main__":
    main()
