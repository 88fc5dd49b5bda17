"""Host memory of one `batched_mm` block at real dimensions, on the CPU: the unwrapped model against the wrapped one.

One Mixtral-8x7B MoE layer (8 experts of 4096 x 14336, bf16, 352 MB each) and a forward of 8 tokens (16 rows, as a
batch-8 decode step), both models under `batched_mm` (what `generate` decodes with on a GPU). The unwrapped model
gathers every row's expert weights before its one `bmm`; the wrapped one (every expert resident in its pool) computes
such a block a few rows at a time (`experts_impl.batched_rows`). Measured: the process's peak resident memory during
the forward above what it held before (Linux's VmHWM, reset before each forward), and whether the logits are equal.
A CPU stands in for the device's memory here: the copies are the same tensors on either.

    python benchmarks/batched_mm_memory.py --out DIR    # writes DIR/<date>-cpu-batched-mm-memory.json (~2 minutes)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from common import environment, print_table, write_json  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.experts_impl import batched_rows  # noqa: E402


def resident_mb() -> tuple[int, int]:
    """(current, peak) resident memory of this process in MiB."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["VmRSS"].split()[0]) // 1024, int(fields["VmHWM"].split()[0]) // 1024


def peak_above(fn) -> tuple[object, int]:
    """fn()'s result and the peak resident memory it added, in MiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    before, _ = resident_mb()
    out = fn()
    return out, resident_mb()[1] - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(0)
    cfg = MixtralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
        num_local_experts=8, num_experts_per_tok=2, vocab_size=256, max_position_embeddings=64,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(d)
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
        model = MiraMoEModel.from_pretrained(d, MiraConfig(gpu_budget=1.0, device="cpu"), progress=False).eval()
    ids = torch.randint(3, 256, (args.tokens, 1), generator=torch.Generator().manual_seed(1))
    rows = []
    with torch.no_grad():
        for m in (ref, model):
            m.set_experts_implementation("batched_mm")
        model(ids)  # every expert the block uses resident from here on
        for name, m in (("unwrapped", ref), ("wrapped", model)):
            logits, added = peak_above(lambda m=m: m(ids).logits)
            rows.append({"model": name, "peak_added_mb": added, "logits": logits})
    expert_mb = 3 * cfg.hidden_size * cfg.intermediate_size * 2 / 2**20  # gate, up and down in bf16
    S = cfg.num_experts_per_tok * args.tokens
    chunks = batched_rows(S, int(expert_mb * 2**20))
    equal = torch.equal(rows[0].pop("logits"), rows[1].pop("logits"))
    for r in rows:
        r["rows"] = S
        r["rows_per_call"] = S if r["model"] == "unwrapped" else chunks[0].stop - chunks[0].start
        r["copies_mb"] = round(r["rows_per_call"] * expert_mb)
    print_table(rows, ["model", "rows", "rows_per_call", "copies_mb", "peak_added_mb"])
    print("logits equal:", equal)
    env = environment()
    path = os.path.join(args.out, f"{env['date']}-cpu-batched-mm-memory.json")
    write_json(path, {"env": env, "command": " ".join(["python", *sys.argv]), "logits_equal": equal, "rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
