"""Long-run check: thousands of decode steps on one wrapped model, watching host RSS, device memory
and every telemetry structure for growth. Prints a table, writes
benchmarks/results/<date>-<device>-soak.json.

    python benchmarks/soak.py [--steps 10000] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_slug, environment, print_table, status_bytes, write_json  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel, bundled_model_path  # noqa: E402


def sizes(m) -> dict:
    """Sizes of every structure that could grow with the number of steps."""
    return dict(
        hit_rate_history=len(m.hit_rate_history()),
        stall_events=len(m.loader._stalls),
        prediction_counters=len(m.telemetry.predictions),
        predicted=len(m.staging.predicted),
        pending_predictions=sum(len(v) for v in m._pending_predictions.values()),
        views=len(m._views),
        resident=len(m.cache.resident()),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--chunk", type=int, default=250, help="new tokens per generate call (context stays short)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    path = bundled_model_path()
    cfg = MiraConfig(device=args.device, gpu_budget=0.25)  # the defaults otherwise
    model = MiraMoEModel.from_pretrained(
        path, cfg, dtype=torch.float32 if args.device == "cpu" else torch.bfloat16, progress=False
    )
    prompts = load_file(os.path.join(path, "heldout_tokens.safetensors"))["input_ids"].long()
    rows, done, t0 = [], 0, time.perf_counter()
    while done < args.steps:
        prompt = prompts[(done // args.chunk) % len(prompts), :32][None].to(model.device)
        model.generate(prompt, max_new_tokens=args.chunk, min_new_tokens=args.chunk, do_sample=True, top_k=40, pad_token_id=0)
        done += args.chunk
        s = model.mira.stats()
        row = dict(
            steps=done,
            rss_mb=status_bytes("VmRSS") / 1e6,
            hit_rate=s["hit_rate"],
            resident_le_budget=s["resident_bytes"] <= s["budget_bytes"],
        )
        if args.device.startswith("cuda"):
            row["gpu_mb"] = torch.cuda.memory_allocated() / 1e6
        row.update(sizes(model.mira))
        rows.append(row)
    elapsed = time.perf_counter() - t0
    first, last = rows[min(1, len(rows) - 1)], rows[-1]  # after the first chunk (warm)
    growth = dict(rss_mb=last["rss_mb"] - first["rss_mb"], **{k: last[k] - first[k] for k in sizes(model.mira)})
    if "gpu_mb" in last:
        growth["gpu_mb"] = last["gpu_mb"] - first["gpu_mb"]
    print_table(rows[:: max(1, len(rows) // 10)] + [rows[-1]], list(rows[0]))
    print("growth after the first chunk:", growth)
    env = environment()
    write_json(
        os.path.join(args.out, f"{env['date']}-{device_slug(env, args.device != 'cpu')}-soak.json"),
        dict(
            env=env,
            steps=done,
            elapsed_s=elapsed,
            config=str(cfg),
            rows=rows,
            growth_after_first_chunk=growth,
            command=" ".join(["python benchmarks/soak.py"] + sys.argv[1:]),
        ),
    )


if __name__ == "__main__":
    main()
