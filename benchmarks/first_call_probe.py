"""Probe for the start-up cost seen in every H200 run (benchmarks/NOTES.md, "Measuring"): the first system
measured on a workload decoded ~55–100 ms per step slower than the same system measured later.
Suspect: cuDNN attention (one of PyTorch's SDPA backends) builds an execution graph for every new
sequence length, so the first decode over lengths never seen in this process pays one build per step.

    python benchmarks/first_call_probe.py --out DIR    # ~30 s on a GPU; writes DIR/<date>-<device>-first-call.json

On the bundled model, all resident (plain transformers): two identical greedy generate calls with the
cuDNN SDPA backend enabled, then two with it disabled at a prompt length not seen before. If the
suspicion holds, only the very first call is slow.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import device_slug, environment, print_table, write_json  # noqa: E402

from mira_hf import bundled_model_path  # noqa: E402


def timed_generate(model, prompt_len: int, new: int) -> float:
    ids = torch.randint(3, 1000, (1, prompt_len), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    model = AutoModelForCausalLM.from_pretrained(bundled_model_path(), dtype=torch.bfloat16).cuda().eval()
    timed_generate(model, 16, 2)  # load kernels
    rows = []
    for cudnn, prompt_len in ((True, 100), (False, 300)):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for call in (1, 2):
            s = timed_generate(model, prompt_len, args.new_tokens)
            rows.append(dict(cudnn_sdp=cudnn, prompt_len=prompt_len, call=call, ms_per_token=1e3 * s / args.new_tokens))
    print_table(rows, list(rows[0]))
    env = environment()
    write_json(
        os.path.join(args.out, f"{env['date']}-{device_slug(env)}-first-call.json"),
        dict(env=env, rows=rows, cudnn_sdp_default=True, command="python benchmarks/first_call_probe.py"),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
