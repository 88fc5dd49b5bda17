"""Decode speed of the bundled model on its held-out text: reactive LRU vs the default, interleaved.

mira-tiny is launch-bound on a GPU (its 0.27 MB experts copy in microseconds), and its decode speed
varies by ±30% between processes, so one row per system in separate runs cannot order them. This
script loads every system once in one process and alternates them round by round on the same
held-out prompts (windows the learned predictor was not calibrated on), reporting medians and the
per-round ratios. Systems: `lru` (reactive baseline), `default` (heat + gate, as it ships),
`default+learned` (the default after `mira_hf.calibrate` on other held-out windows) and `heat-only`
(the default's policy without prediction: what prediction costs or saves here).

    python benchmarks/bundled_ab.py --out benchmarks/results/        # GPU
    python benchmarks/bundled_ab.py --device cpu --rounds 2 --out /tmp   # checks the script
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import environment, print_table, write_json  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel, bundled_model_path, calibrate  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode(model, prompt: torch.Tensor, new_tokens: int, device: torch.device, **gen) -> dict:
    """Decode tokens/s (all sequences of the batch) after the first token (the prefill's time, measured
    by a 1-token call, is taken off), with mira's stall time and hit rate for the whole call."""
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt), **gen)
    sync(device)
    t0 = time.perf_counter()
    model.generate(prompt, max_new_tokens=1, **kw)
    sync(device)
    first = time.perf_counter() - t0
    model.mira.reset_stats()
    t0 = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    sync(device)
    total = time.perf_counter() - t0
    s = model.mira.stats()
    steps = (out.shape[1] - prompt.shape[1]) - 1
    return {
        "tok_s": steps * prompt.shape[0] / max(total - first, 1e-9),
        "stall_ms_per_token": 1e3 * s["stall_s"] / max(steps + 1, 1),
        "hit_rate": s["hit_rate"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory (gets DATE-DEVICE-bundled-ab.json) or a .json path")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--calib-windows", type=int, default=32)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bundled_ab: no CUDA device; --device cpu checks the script", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    if device.type == "cuda":  # its per-sequence-length graph builds would land on whichever system runs first (NOTES §10)
        torch.backends.cuda.enable_cudnn_sdp(False)
    from safetensors.torch import load_file

    path = bundled_model_path()
    heldout = load_file(os.path.join(path, "heldout_tokens.safetensors"))["input_ids"].long()  # [64, 256]
    calib = heldout[: args.calib_windows]
    prompts = heldout[args.calib_windows :, : args.prompt_len]  # never seen by calibration
    systems = {}
    variants = (
        ("lru", "lru", None),
        ("default", "heat", "auto"),
        ("default+learned", "heat", "auto"),
        ("heat-only", "heat", None),
    )
    for name, policy, predictor in variants:
        cfg = MiraConfig(gpu_budget=args.budget, device=str(device), policy=policy, predictor=predictor)
        model = MiraMoEModel.from_pretrained(path, cfg, progress=False).eval()
        if name == "default+learned":
            calibrate(model, calib.to(device), progress=False)
        systems[name] = model
    names = list(systems)
    rows = {n: {"b1": [], "b8": []} for n in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]  # alternate who goes first
        p1 = prompts[r % prompts.shape[0]][None].to(device)
        p8 = prompts[(r * args.batch) % (prompts.shape[0] - args.batch + 1) :][: args.batch].to(device)
        for n in order:
            with torch.no_grad():
                if r == 0:  # warm-up: kernels, allocator, the heat tables
                    decode(systems[n], p1, 4, device)
                rows[n]["b1"].append(decode(systems[n], p1, args.new_tokens, device))
                rows[n]["b8"].append(decode(systems[n], p8, args.new_tokens, device))
    table = []
    for n in names:
        row = {"system": n}
        for b in ("b1", "b8"):
            row[f"{b}_tok_s"] = statistics.median(x["tok_s"] for x in rows[n][b])
            row[f"{b}_stall_ms"] = statistics.median(x["stall_ms_per_token"] for x in rows[n][b])
            row[f"{b}_hit"] = statistics.median(x["hit_rate"] for x in rows[n][b])
        for b in ("b1", "b8"):  # per-round speed over LRU's in the same round
            ratios = [x["tok_s"] / y["tok_s"] for x, y in zip(rows[n][b], rows["lru"][b], strict=True)]
            row[f"{b}_vs_lru_median"] = statistics.median(ratios)
            row[f"{b}_vs_lru_min"], row[f"{b}_vs_lru_max"] = min(ratios), max(ratios)
        table.append(row)
    cols = ["system", "b1_tok_s", "b1_vs_lru_median", "b1_vs_lru_min", "b1_vs_lru_max", "b1_stall_ms", "b1_hit"]
    cols += ["b8_tok_s", "b8_vs_lru_median", "b8_hit"]
    print_table(table, cols)
    result = {"env": environment(), "command": " ".join(["python"] + sys.argv), "args": vars(args), "table": table,
              "rounds": rows, "wall_s": time.perf_counter() - t_start}  # fmt: skip
    tag = (
        torch.cuda.get_device_name(device).lower().replace("nvidia ", "nvidia-").replace(" ", "-")
        if device.type == "cuda"
        else "cpu"
    )
    out = args.out if args.out.endswith(".json") else os.path.join(args.out, f"{time.strftime('%Y-%m-%d')}-{tag}-bundled-ab.json")
    write_json(out, result)
    print(f"wrote {out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
