"""How much of the neuron split's difference from one whole expert is the rounding of its two partial outputs.

One expert at Mixtral-8x7B's dimensions (hidden 4096, intermediate 14336, SwiGLU) with random bf16 weights, computed
on the CPU for a few rows: once whole (the unwrapped model's one down projection, rounded to bf16 once), and split
by neuron at each share as `host_compute="split"` splits it, its two parts' outputs either rounded to bf16 each and
then added (what the split computes), or kept in fp32, added, and rounded once, or one part kept in fp32 and the
other rounded (what an fp32 output on one side alone would give: the host's, or the device's). Reports, for each, the
share of output elements that differ from the whole expert's and the largest difference relative to its largest
value.

    python benchmarks/split_rounding_probe.py --out benchmarks/results/     # CPU, ~1 minute

Writes OUT/<date>-<device>-split-rounding.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import device_slug, environment, print_table, write_json  # noqa: E402


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x @ gate.T) * (x @ up.T)


def differences(y: torch.Tensor, whole: torch.Tensor) -> dict:
    return dict(
        differing_share=(y != whole).float().mean().item(),
        max_rel_diff=((y.float() - whole.float()).abs().max() / whole.float().abs().max()).item(),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--shares", default="0.2,0.25,0.3", help="host shares (the host part's neurons come last)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    H, I = args.hidden, args.intermediate  # noqa: E741
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.rows, H, generator=g).bfloat16()
    gate, up = ((torch.randn(I, H, generator=g) / H**0.5).bfloat16() for _ in range(2))
    down = (torch.randn(H, I, generator=g) / I**0.5).bfloat16()
    whole = swiglu(x, gate, up) @ down.T  # bf16: one down projection, rounded once
    rows = []
    for share in (float(s) for s in args.shares.split(",") if s.strip()):
        k = I - round(I * share / 16) * 16  # the device part's neurons, in steps of 16 as the split aligns them
        h_device, h_host = swiglu(x, gate[:k], up[:k]), swiglu(x, gate[k:], up[k:])
        device_bf16, host_bf16 = h_device @ down[:, :k].T, h_host @ down[:, k:].T  # each part rounded to bf16
        device_fp32, host_fp32 = h_device.float() @ down[:, :k].T.float(), h_host.float() @ down[:, k:].T.float()
        for name, y in (
            ("parts rounded, then added", device_bf16 + host_bf16),
            ("parts in fp32, rounded once", (device_fp32 + host_fp32).bfloat16()),
            ("host part in fp32, device part rounded", (device_bf16.float() + host_fp32).bfloat16()),
            ("device part in fp32, host part rounded", (device_fp32 + host_bf16.float()).bfloat16()),
        ):
            rows.append(dict(share=share, sum=name, **differences(y, whole)))
    print_table(rows, ["share", "sum", "differing_share", "max_rel_diff"])
    env = environment()
    path = os.path.join(args.out, f"{env['date']}-{device_slug(env, on_gpu=False)}-split-rounding.json")
    write_json(path, dict(env=env, args=vars(args), rows=rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
