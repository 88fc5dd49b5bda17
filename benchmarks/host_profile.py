"""Where a launch-bound decode spends its host time: mira-tiny (the bundled model) at a budget, per system.

On the bundled model every expert copy takes microseconds, so decode speed is host time: Python and
CUDA API calls per MoE block (NOTES.md, "Launch-bound decode"). This script decodes with each system twice, once timed
and once under cProfile, and reports per token: the wall time, the number of torch ops dispatched and
CUDA API calls made by the manager (events created, recorded, queried, waited on; copies issued), and
the host time inside the manager's verbs and the predictor (cProfile's cumulative time, which counts
its own overhead too: compare systems with it, not with the timed run).

    python benchmarks/host_profile.py --out benchmarks/results/            # DATE-DEVICE-host-profile.json
    python benchmarks/host_profile.py --device cpu --new-tokens 16 --out /tmp  # CPU, seconds
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run  # noqa: E402  (the bundled workload and run.py's systems)
from ab import EXTRA_SYSTEMS  # noqa: E402
from common import device_slug, environment, print_table, sync, write_json  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402

# Functions whose cumulative host time is reported (file suffix, function name).
WATCHED = [
    ("proxy.py", "forward"),
    ("manager.py", "observe"),
    ("manager.py", "begin"),
    ("manager.py", "acquire"),
    ("manager.py", "acquire_rest"),
    ("manager.py", "release"),
    ("manager.py", "end"),
    ("manager.py", "_load"),
    ("staging.py", "stage"),
    ("manager.py", "prefetch"),
    ("cache.py", "allocate"),
    ("loader.py", "copy_split"),
    ("loader.py", "wait"),
    ("loader.py", "mark_free"),
    ("heat.py", "activate"),
    ("heat.py", "end_step"),
]


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _generate(model, prompt, n):
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    sync()
    t0 = time.perf_counter()
    model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw)
    sync()
    return time.perf_counter() - t0


def profile_system(name: str, wl, budget: float, device: torch.device, prompt, new_tokens: int, repeats: int) -> dict:
    model = wl.build(str(device))
    if name == "resident":
        model.to(device)
    else:
        overrides = dict(EXTRA_SYSTEMS.get(name, run.MIRA_OVERRIDES.get(name, {})))
        MiraMoEModel.wrap(model, MiraConfig(gpu_budget=budget, device=str(device), **overrides))
    model.eval()
    _generate(model, prompt, 16)  # warm-up
    one = min(_generate(model, prompt, 1) for _ in range(3))  # prefill + 1 token, taken off
    times = [_generate(model, prompt, new_tokens + 1) - one for _ in range(repeats)]
    ms = 1e3 * sorted(times)[len(times) // 2] / new_tokens
    with _CountOps() as c1:
        _generate(model, prompt, 1)
    with _CountOps() as c:
        _generate(model, prompt, new_tokens + 1)
    ops = (c.n - c1.n) / new_tokens
    if hasattr(model, "mira"):
        model.mira.reset_stats()
    prof = cProfile.Profile()
    prof.enable()
    _generate(model, prompt, new_tokens + 1)
    prof.disable()
    st = pstats.Stats(prof).stats  # (file, line, func) -> (cc, nc, tt, ct, callers)
    watched = {}
    for (file, _line, func), (_cc, nc, _tt, ct, _callers) in st.items():
        for suffix, fname in WATCHED:
            if func == fname and file.endswith(os.sep + suffix):
                key = f"{suffix[:-3]}.{fname}"
                calls, cum = watched.get(key, (0, 0.0))
                watched[key] = (calls + nc, cum + ct)
    total = sum(tt for (_cc, _nc, tt, _ct, _callers) in st.values())
    top = sorted(
        (
            (f"{os.path.basename(f)}:{fn}", nc / new_tokens, 1e6 * tt / new_tokens)
            for (f, _l, fn), (_cc, nc, tt, _ct, _c) in st.items()
        ),
        key=lambda r: -r[2],
    )[:30]
    stats = model.mira.stats() if hasattr(model, "mira") else {}
    row = {
        "system": name,
        "ms_per_token": ms,
        "ops_per_token": ops,
        "profiled_ms_per_token": 1e3 * total / new_tokens,
        "hit_rate": stats.get("hit_rate"),
        "loads_per_token": stats["loads"] / (new_tokens + 1) if stats else None,  # the prefill's loads included
        "watched_us_per_token": {k: 1e6 * v[1] / new_tokens for k, v in sorted(watched.items())},
        "watched_calls_per_token": {k: v[0] / new_tokens for k, v in sorted(watched.items())},
        "top_tottime_us_per_token": [{"fn": f, "calls": n, "us": us} for f, n, us in top],
    }
    del model
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--systems", default="resident,lru,heat-only,default")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    label, shape, _ = run.WORKLOADS["bundled"]
    wl = run.Workload("bundled", label, shape, 0)
    prompt = wl.prompts(1, 64, 0, str(device))
    rows = [
        profile_system(s.strip(), wl, args.budget, device, prompt, args.new_tokens, args.repeats) for s in args.systems.split(",")
    ]
    print_table(
        [dict(r, **{k: v for k, v in r["watched_us_per_token"].items()}) for r in rows],
        [
            "system",
            "ms_per_token",
            "ops_per_token",
            "loads_per_token",
            "hit_rate",
            "proxy.forward",
            "manager.begin",
            "manager.observe",
            "manager.end",
            "manager._load",
            "manager.acquire",
            "manager.release",
        ],
    )
    env = environment()
    data = {"env": env, "command": "python " + " ".join(sys.argv), "args": vars(args), "rows": rows}
    path = os.path.join(args.out, f"{env['date']}-{device_slug(env, device.type == 'cuda')}-host-profile.json")
    write_json(path, data)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
