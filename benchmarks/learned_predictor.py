"""Recall and precision of the `learned` predictor against `gate` on the bundled mira-tiny (CPU).

Calibrates on held-out windows [train), then decodes windows [eval) one token per step with teacher
forcing (each step is a decode step: T = 1), and reads recall@d / precision@d per layer from the
manager's telemetry at the confidence cut.

    python benchmarks/learned_predictor.py [--train 0:32] [--eval 32:48] [--tokens 256] [--out DIR]

Writes DIR/learned_predictor.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import environment, print_table, write_json  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.bundled import bundled_model_path  # noqa: E402
from mira_hf.calibrate import calibrate  # noqa: E402
from mira_hf.predictors import PredictorConfig  # noqa: E402


def windows(spec: str) -> slice:
    a, b = spec.split(":")
    return slice(int(a), int(b))


def load(path: str, predictor: str, confidence: float, predictor_path: str | None = None):
    cfg = MiraConfig(
        device="cpu",
        gpu_budget=0.25,
        predictor=predictor,
        predictor_path=predictor_path,
        prediction=PredictorConfig(confidence=confidence),
    )
    return MiraMoEModel.from_pretrained(path, cfg, dtype=torch.float32, progress=False)


def teacher_forced_decode(model, ids: torch.Tensor) -> None:
    """One forward per token, each row on its own (T = 1 per step), through the KV cache."""
    from transformers import DynamicCache

    with torch.no_grad():
        for row in ids:
            cache = DynamicCache()
            for i in range(len(row)):
                model(input_ids=row[None, i : i + 1], cache=cache, use_cache=True)


def per_layer(stats: dict) -> dict[int, dict]:
    keys = ("recall@1", "precision@1", "recall@2", "precision@2", "hit_rate")
    return {L: {k: s.get(k) for k in keys} for L, s in stats["per_layer"].items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", default="0:32", help="held-out windows to calibrate on (a:b)")
    ap.add_argument("--eval", default="32:48", help="held-out windows to decode (a:b), disjoint from --train")
    ap.add_argument("--tokens", type=int, default=256, help="tokens decoded per eval window")
    ap.add_argument("--confidence", type=float, default=0.3, help="PredictorConfig.confidence")
    ap.add_argument("--pos-weight", type=float, default=4.0)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (one-token steps of a tiny model run fastest on one)"
    )
    ap.add_argument("--out", default=None, help="directory for learned_predictor.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)

    from safetensors.torch import load_file

    path = bundled_model_path()
    ids = load_file(os.path.join(path, "heldout_tokens.safetensors"))["input_ids"].long()
    train, evaluate = ids[windows(args.train)], ids[windows(args.eval)][:, : args.tokens]

    results: dict = {"environment": environment(), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        model = load(path, "gate", args.confidence)
        t0 = time.perf_counter()
        predictor = calibrate(model, train, pos_weight=args.pos_weight, epochs=args.epochs, progress=False)
        results["calibrate_s"] = time.perf_counter() - t0
        results["predictor"] = {"repr": repr(predictor), "parameters": predictor.num_parameters(), "training": predictor.summary}
        model.mira.save_predictor(tmp)
        for name in ("gate", "learned"):
            model = load(path, name, args.confidence, tmp if name == "learned" else None)
            t0 = time.perf_counter()
            teacher_forced_decode(model, evaluate)
            results[name] = {"decode_s": time.perf_counter() - t0, "per_layer": per_layer(model.mira.stats())}

    rows = []
    for L in results["gate"]["per_layer"]:
        row = {"layer": L}
        for name in ("gate", "learned"):
            for k, v in results[name]["per_layer"][L].items():
                row[f"{name} {k}"] = v
        rows.append(row)
    mean = {"layer": "mean"}
    for k in rows[0]:
        vals = [r[k] for r in rows if k != "layer" and r[k] is not None]
        if vals:
            mean[k] = sum(vals) / len(vals)
    rows.append(mean)
    results["mean"] = mean
    columns = ["layer"] + [
        f"{n} {k}" for k in ("recall@1", "recall@2", "precision@1", "precision@2", "hit_rate") for n in ("gate", "learned")
    ]
    print(f"{predictor!r}; calibrated in {results['calibrate_s']:.1f} s on {len(train)}×{train.shape[1]} tokens")
    print(f"teacher-forced decode of {len(evaluate)}×{evaluate.shape[1]} tokens, confidence ≥ {args.confidence}, gpu_budget 0.25")
    results["table"] = print_table(rows, columns)
    if args.out:
        write_json(os.path.join(args.out, "learned_predictor.json"), results)


if __name__ == "__main__":
    main()
