"""Seeding the use rates from a prompt where the generated tokens route unlike the prompt: the full-depth benchmark's
case, on the CPU.

`full_depth.py`'s Qwen3 shape is random weights with routers shaped on topic-walk prompts; its greedy tokens route
elsewhere, and seeding the use rates from the prompt (`HeatConfig.seed_from_prompt`) made it load more per decode
step there. This builds the same kind of model small enough for a CPU (Qwen3-30B-A3B's 128 experts, top-8, in
`--layers` layers of width 256), shapes its routing as `full_depth.py` does, wraps it at Qwen3's 8 GiB share
(8/58 of the experts) and runs `full_depth.py`'s batch-1 phase (a 512-token prompt: 2 tokens of warm-up, 1 timed for
the first token, then 64): decode loads per step with seeding and with the prompt counted as one step. The tokens
must be the same both ways.

    python benchmarks/prompt_seed_synthetic.py --out benchmarks/results/ [--label L]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from common import build_config, environment, print_table, write_json  # noqa: E402
from topic_routing import RoutingTargets, shape_routing, topic_prompts  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.heat import HeatConfig  # noqa: E402

BUDGET = 8 / 58  # Qwen3-30B-A3B's experts are 58 GB; full_depth.py measures it at 8 GiB


def decode_loads(seed: bool, layers: int, prompt_len: int, new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = build_config(
        "qwen3-30b-a3b", hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=4096,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    targets = RoutingTargets()
    prompts = topic_prompts(8, prompt_len, cfg.vocab_size, targets.topics, targets.p_stay, seed=1)
    shape_routing(model, prompts, targets, seed=0)
    MiraMoEModel.wrap(model, MiraConfig(device="cpu", gpu_budget=BUDGET, heat=HeatConfig(seed_from_prompt=seed)))
    x, kw = prompts[:1], dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(x, max_new_tokens=2, **kw)  # full_depth's warm-up and first-token calls
        model.generate(x, max_new_tokens=1, **kw)
        model.mira.reset_stats()
        out = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        total = model.mira.stats()["loads"]
        model.mira.reset_stats()
        model(x)  # the prompt's own loads, as the call above made them from the same state
        prompt = model.mira.stats()["loads"]
    return dict(
        decode_loads_per_step=(total - prompt) / (new_tokens - 1),
        prompt_loads=prompt,
        tokens=out[0, x.shape[1] :].tolist(),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--label", default="")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.prompt_len, args.new_tokens = 2, 32, 4
    on = decode_loads(True, args.layers, args.prompt_len, args.new_tokens)
    off = decode_loads(False, args.layers, args.prompt_len, args.new_tokens)
    if on["tokens"] != off["tokens"]:
        raise SystemExit("the tokens differ with and without seeding: outputs must not change")
    row = dict(
        layers=args.layers,
        loads_seeded=on["decode_loads_per_step"],
        loads_one_step=off["decode_loads_per_step"],
        ratio=on["decode_loads_per_step"] / off["decode_loads_per_step"],
    )
    print_table([row], list(row))
    name = f"{time.strftime('%Y-%m-%d')}-cpu-prompt-seed-synthetic{'-' + args.label if args.label else ''}{'-smoke' if args.smoke else ''}.json"
    write_json(os.path.join(args.out, name), dict(environment=environment(), args=vars(args), row=row, seeded=on, one_step=off))


if __name__ == "__main__":
    main()
