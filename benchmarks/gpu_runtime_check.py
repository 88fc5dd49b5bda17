"""GPU check of the runtime (CUDA path): exactness against the all-resident model, then a first
Mixtral-8x7B-shaped decode benchmark at gpu_budget=0.25 beside all experts resident.

    python benchmarks/gpu_runtime_check.py --out DIR [--skip-bench]

Writes DIR/gpu_runtime_check.json and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench.measure import generator, timed_decode  # noqa: E402
from common import environment, print_table, random_model_on_device, write_json  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.testing import make_config  # noqa: E402


def exactness(dtype: torch.dtype) -> dict:
    """Small Mixtral (fp32 or bf16): logits and 64 greedy tokens, mira at 25% vs all resident on CUDA."""
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    # the tiny Mixtral recipe, widened: 512 hidden, 64 per head, 4 layers (no padding row: every token id is random)
    cfg = make_config(
        "mixtral",
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        head_dim=64,
        pad_token_id=None,
    )
    cpu = MixtralForCausalLM(cfg).to(dtype).eval()
    ref = copy.deepcopy(cpu).cuda()
    model = MiraMoEModel.wrap(cpu, MiraConfig(gpu_budget=0.25, device="cuda"))
    ids = torch.randint(3, 1000, (2, 96), device="cuda")
    with torch.no_grad():
        a, b = ref(ids).logits.float(), model(ids).logits.float()
    g_ref = ref.generate(ids[:1, :16], max_new_tokens=64, min_new_tokens=64, do_sample=False)
    g_mira = model.generate(ids[:1, :16], max_new_tokens=64, min_new_tokens=64, do_sample=False)
    beam_ref = ref.generate(ids[:1, :16], max_new_tokens=16, num_beams=4, do_sample=False)
    beam_mira = model.generate(ids[:1, :16], max_new_tokens=16, num_beams=4, do_sample=False)
    s = model.mira.stats()
    out = dict(
        dtype=str(dtype),
        max_abs_diff=(a - b).abs().max().item(),
        rel_err=((a - b).norm() / a.norm()).item(),
        greedy_identical=bool(torch.equal(g_ref, g_mira)),
        beam_identical=bool(torch.equal(beam_ref, beam_mira)),
        hit_rate=s["hit_rate"],
        loads=s["loads"],
        resident_le_budget=s["resident_bytes"] <= s["budget_bytes"],
    )
    del ref, model, cpu
    gc.collect()
    torch.cuda.empty_cache()
    return out


def generation_speed(model, prompt_len: int, new_tokens: int, label: str, mira: bool) -> dict:
    ids = torch.randint(100, 30000, (1, prompt_len), device="cuda")
    gen = generator(model)
    gen(ids[:, :8], 2)  # warm-up
    if mira:
        model.mira.reset_stats()
    torch.cuda.reset_peak_memory_stats()
    ttft = gen(ids, 1)[0]
    if mira:
        model.mira.reset_stats()
    row = dict(
        system=label,
        ttft_s=ttft,
        decode_tok_s=timed_decode(gen, ids, new_tokens)[0],  # from the end of the call's first step
        peak_gb=torch.cuda.max_memory_allocated() / 1e9,
    )
    if mira:
        s = model.mira.stats()
        row.update(hit_rate=s["hit_rate"], stall_s=s["stall_s"], gb_h2d=s["bytes_h2d"] / 1e9, budget_gb=s["budget_bytes"] / 1e9)
    return row


def mixtral_bench(budget: float, new_tokens: int) -> list[dict]:
    model = random_model_on_device("mixtral-8x7b-8l")
    rows = [generation_speed(model, 512, new_tokens, "all resident (transformers)", mira=False)]
    t0 = time.perf_counter()
    MiraMoEModel.wrap(model, MiraConfig(gpu_budget=budget, device="cuda"))
    gc.collect()
    torch.cuda.empty_cache()
    wrap_s = time.perf_counter() - t0
    row = generation_speed(model, 512, new_tokens, f"mira-hf lru, budget {budget:.0%}", mira=True)
    row["wrap_s"] = wrap_s
    rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    result = {"env": environment(), "exactness": [exactness(torch.float32), exactness(torch.bfloat16)]}
    print_table(result["exactness"], list(result["exactness"][0]))
    if not args.skip_bench:
        result["mixtral_8l"] = mixtral_bench(0.25, args.new_tokens)
        print_table(
            result["mixtral_8l"], ["system", "ttft_s", "decode_tok_s", "peak_gb", "hit_rate", "stall_s", "gb_h2d", "budget_gb"]
        )
    write_json(os.path.join(args.out, "gpu_runtime_check.json"), result)


if __name__ == "__main__":
    main()
