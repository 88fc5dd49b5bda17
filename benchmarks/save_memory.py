"""Host memory and time of `save_pretrained` on a Mixtral-shape bf16 checkpoint: the unwrapped model's save against
the wrapped model's with uncompressed records, with lossless records decoded into host memory, with lossless
records decoded into the file-backed buffer (forced here by telling the save that host memory is short), and with
lossless records decoded by the host's cores where the model serves on a GPU (as for a model whose device had no
room to encode at load; otherwise the device decodes them).

    python benchmarks/save_memory.py --dir /data/mixtral-3l --layers 3     # GPU: real dims, ~9 GB, a few minutes
    python benchmarks/save_memory.py --dir /tmp/tiny --smoke               # CPU, tiny dims, seconds

The checkpoint (random weights) is written once into --dir and reused; each save runs in a fresh process, writes into
--dir + ".out" and is removed after it. Memory is the peak growth of the process's anonymous memory (RssAnon, sampled
every 0.5 ms by a thread: safetensors' serialization holds the interpreter's lock, so a peak inside it can be missed,
in every run alike) over the save. Prints a table and writes benchmarks/results/<date>-<device>-save-memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
from common import budget_arg, device_slug, environment, print_table, status_bytes, write_json  # noqa: E402
from load_time import _dir_bytes, write_checkpoint  # noqa: E402

RUNS = ("unwrapped", "uncompressed", "lossless", "lossless-buffer", "lossless-host-decode")


class PeakAnon:
    def __init__(self, period_s: float = 0.0005) -> None:
        self.base = self.peak = status_bytes("RssAnon")
        self._done = False

        def poll() -> None:
            while not self._done:
                self.peak = max(self.peak, status_bytes("RssAnon"))
                time.sleep(period_s)

        self._thread = threading.Thread(target=poll)
        self._thread.start()

    def stop(self) -> int:
        self._done = True
        self._thread.join()
        return self.peak - self.base


def child(args) -> None:
    """One save in this process; prints one JSON line."""
    from transformers import AutoModelForCausalLM

    import mira_hf.unload
    from mira_hf import MiraConfig, MiraMoEModel
    from mira_hf.encode import RecordEncoder

    if args.child == "unwrapped":
        model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16)
    else:
        quantization = None if args.child == "uncompressed" else "lossless"
        model = MiraMoEModel.from_pretrained(
            args.dir, MiraConfig(gpu_budget=args.budget, quantization=quantization), progress=False
        )
        if args.child == "lossless-buffer":
            mira_hf.unload.available_host_bytes = lambda: 2**20  # host memory short: decoded into the buffer
        if args.child == "lossless-host-decode":
            model.mira.store.encoder = RecordEncoder("cpu")
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    out = args.dir.rstrip("/") + ".out"
    shutil.rmtree(out, ignore_errors=True)
    peak = PeakAnon()
    t0 = time.perf_counter()
    model.save_pretrained(out)
    save_s = time.perf_counter() - t0
    growth = peak.stop()
    written = _dir_bytes(out)
    shutil.rmtree(out, ignore_errors=True)
    store = getattr(getattr(model, "mira", None), "store", None)  # None: the unwrapped model
    on_device = store.encoder.experts_decoded_on_device if store is not None else 0
    result = dict(
        save_s=save_s,
        anon_growth_gb=growth / 1e9,
        experts_gb=experts / 1e9,
        growth_per_expert_byte=growth / experts,
        experts_decoded_on_device=on_device,
    )
    print("RESULT " + json.dumps(dict(result, written_gb=written / 1e9)), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where the checkpoint is written (and reused)")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--budget", default=None, help="gpu_budget (default: 4GiB on a GPU, 0.5 with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="tiny dims on the CPU")
    ap.add_argument("--time-limit", type=float, default=500.0, help="seconds for the whole run")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.budget is None:
        args.budget = "0.5" if args.smoke else "4GiB"
    if args.child:
        args.budget = budget_arg(args.budget)
        child(args)
        return 0

    deadline = time.perf_counter() + args.time_limit
    checkpoint = write_checkpoint(args.dir, args.layers, args.smoke)
    print(f"checkpoint: {args.dir} ({checkpoint['bytes'] / 1e9:.2f} GB)", flush=True)
    rows, failed = [], []
    for label in RUNS:
        left = deadline - time.perf_counter()
        if left < 10:
            failed.append(f"{label}: not run (time limit)")
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--child", label, "--dir", args.dir, "--budget", str(args.budget)]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            failed.append(f"{label}: over the time limit ({left:.0f} s)")
            continue
        line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
        if run.returncode != 0 or not line:
            failed.append(f"{label}: exit {run.returncode}: {run.stderr.strip().splitlines()[-1:] or run.stdout[-500:]}")
            continue
        rows.append(dict(run=label, **json.loads(line[0][len("RESULT ") :])))
        print(f"{label}: {rows[-1]['save_s']:.2f} s, {rows[-1]['anon_growth_gb']:.2f} GB", flush=True)
    if rows:
        columns = ["run", "save_s", "anon_growth_gb", "growth_per_expert_byte", "experts_gb", "written_gb"]
        print_table(rows, columns + ["experts_decoded_on_device"])
    for f in failed:
        print("FAILED", f)
    env = environment()
    result = dict(environment=env, checkpoint=checkpoint, layers=args.layers, smoke=args.smoke, rows=rows, failed=failed)
    path = os.path.join(
        args.out, f"{env['date']}-{device_slug(env, torch.cuda.is_available() and not args.smoke)}-save-memory.json"
    )
    write_json(path, result)
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
