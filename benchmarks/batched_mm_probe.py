"""Does `batched_mm`'s arithmetic need its per-row copy of the weights? A probe on one device.

transformers' `batched_mm` experts implementation (what `generate` decodes with on a GPU) gathers each row's expert
weights (`W[expert_ids]`, one copy per row: 16 × 352 MB for Mixtral at batch 8) and multiplies with one `torch.bmm`.
A wrapped model reproduces those bits. This probe compares, bit for bit, that reference with ways of computing the
same products that copy less:

    chunks_K   the same gather and bmm over K rows at a time (the copy is K rows' weights)
    expanded   per expert, its rows against a stride-0 view of its weights (`W[e].expand(n, ...)`): no copy
    per_row    each row alone: bmm of one batch element, no copy (`W[e].unsqueeze(0)`)
    mira_min   the chunks a wrapped model uses with one row's weights as its bound (`batched_rows`: 4 rows a call for
               blocks of 8, 16, 32 or 64 rows, else one call)

for expert shapes of Mixtral, Qwen3-30B-A3B and gpt-oss, both projections, bf16 and fp32, 1 to 128 rows, with the
weights as most families keep them (`w @ x` per row, `[E, out, in]`) and transposed (`x @ w`, `[E, in, out]`: gpt-oss).

    python benchmarks/batched_mm_probe.py --out DIR     # writes DIR/<date>-<device>-batched-mm-probe.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from common import device_slug, environment, print_table, write_json  # noqa: E402

from mira_hf.experts_impl import BATCHED_CALL_BYTES, batched_linear, batched_rows  # noqa: E402

# (name, out features, in features) of one expert's projection, weights [E, out, in] as transformers keeps them
SHAPES = [
    ("mixtral_gate_up", 2 * 14336, 4096),
    ("mixtral_down", 4096, 14336),
    ("qwen3_gate_up", 2 * 768, 2048),
    ("qwen3_down", 2048, 768),
    ("gpt_oss_gate_up", 2 * 2880, 2880),
]
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 16, 32, 64, 128)
EXPERTS = 8
FORMS = {"w_x": False, "x_w": True}  # weights [E, out, in] (w @ x per row), or transposed [E, in, out] (x @ w)


def product(w: torch.Tensor, x: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Each row of x [n, in] by its weights w [n, out, in] ([n, in, out] transposed), as transformers' batched_mm."""
    return batched_linear(x, w, None, transposed)


def reference(W: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, t: bool) -> torch.Tensor:
    return product(W[ids], x, t)


def chunks(k: int):
    def run(W, x, ids, t):
        return torch.cat([reference(W, x[i : i + k], ids[i : i + k], t) for i in range(0, x.shape[0], k)])

    return run


def expanded(W, x, ids, t):
    out = None
    for e in ids.unique().tolist():
        rows = (ids == e).nonzero().squeeze(1)
        y = product(W[e].expand(rows.numel(), *W.shape[1:]), x[rows], t)
        out = y.new_empty(x.shape[0], y.shape[1]) if out is None else out
        out[rows] = y
    return out


def per_row(W, x, ids, t):
    return torch.cat([product(W[e].unsqueeze(0), x[r : r + 1], t) for r, e in enumerate(ids.tolist())])


def mira_min(W, x, ids, t):
    return torch.cat([reference(W, x[c], ids[c], t) for c in batched_rows(x.shape[0], BATCHED_CALL_BYTES + 1)])


VARIANTS = {
    "chunks_1": chunks(1),
    "chunks_2": chunks(2),
    "chunks_4": chunks(4),
    "chunks_8": chunks(8),
    "chunks_16": chunks(16),
    "expanded": expanded,
    "per_row": per_row,
    "mira_min": mira_min,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = torch.device(args.device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows_out = []
    summary = {form: {v: {"cases": 0, "equal": 0} for v in VARIANTS} for form in FORMS}
    for form, t in FORMS.items():
        for dtype in (torch.bfloat16, torch.float32):
            for name, out_f, in_f in SHAPES:
                shape = (EXPERTS, in_f, out_f) if t else (EXPERTS, out_f, in_f)
                W = (torch.randn(*shape, generator=gen) * 0.02).to(dev, dtype)
                for S in ROWS:
                    x = torch.randn(S, in_f, generator=gen).to(dev, dtype)
                    ids = torch.randint(0, EXPERTS, (S,), generator=gen).to(dev)
                    ref = reference(W, x, ids, t)
                    row = {"form": form, "dtype": str(dtype).removeprefix("torch."), "shape": name, "rows": S}
                    for v, fn in VARIANTS.items():
                        got = fn(W, x, ids, t)
                        eq = bool(torch.equal(got, ref))
                        row[v] = eq
                        row[v + "_max_abs"] = float((got.float() - ref.float()).abs().max())
                        summary[form][v]["cases"] += 1
                        summary[form][v]["equal"] += eq
                    rows_out.append(row)
                del W
    print_table(rows_out, ["form", "dtype", "shape", "rows", *VARIANTS])
    print(summary)
    env = environment()
    path = os.path.join(args.out, f"{env['date']}-{device_slug(env, dev.type == 'cuda')}-batched-mm-probe.json")
    write_json(path, {"env": env, "command": " ".join(["python", *sys.argv]), "summary": summary, "rows": rows_out})
    print("wrote", path)


if __name__ == "__main__":
    main()
