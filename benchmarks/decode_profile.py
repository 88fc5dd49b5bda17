"""Where a decode step's time goes on the GPU, and how good the gate predictor's guesses are.

The profiler's own host cost turns the default's decode host-bound (100 ms per step instead of 55 on the
Mixtral shape, NOTES.md, "Measuring"), so its link gaps are not a real run's: `gap_probe.py` times the link with CUDA
events alone. The gate scoring below is unaffected.

    python benchmarks/decode_profile.py --out DIR     # ~2-3 minutes on an H200; writes DIR/<date>-<device>-decode-profile.json

For each system (default: `lru` and the mira default) on the Mixtral shape at 25%: a profiled greedy decode
(torch.profiler, CUDA activities). From the trace: the share of the decode window in which the copy engine
moves host→device bytes, and the idle gaps between copies, with the GPU kernels and the host operations that
overlap them (what keeps the link idle). For the default system it also records every MoE block's input and
routing, and scores the gate predictor's guesses against the routing that followed: calibration of its
probabilities (predicted p vs how often the expert was used) and accuracy of its rank-1 / rank-2 guesses at
1 and 2 layers ahead.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import sys
import tempfile
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from common import device_slug, environment, print_table, random_model_on_device, write_json  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.predictors import token_union  # noqa: E402
from mira_hf.proxy import MiraExperts  # noqa: E402

SYSTEMS = {"lru": dict(policy="lru", predictor=None, quantization=None), "default": {}}


def generate(model, ids, new: int):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
    )


def intervals_union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap_by_name(events: list[dict], gaps: list[tuple[float, float]], top: int = 12) -> list[dict]:
    """Total overlap (µs) of `events` with the gaps, by event name, largest first."""
    acc: dict[str, float] = defaultdict(float)
    gaps = sorted(gaps)
    for ev in events:
        a, b = ev["ts"], ev["ts"] + ev.get("dur", 0)
        for g0, g1 in gaps:
            if g0 >= b:
                break
            o = min(b, g1) - max(a, g0)
            if o > 0:
                acc[ev["name"][:90]] += o
    return [dict(name=k, overlap_us=round(v, 1)) for k, v in sorted(acc.items(), key=lambda kv: -kv[1])[:top]]


def analyse_trace(path: str, steps: int) -> dict:
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    h2d = [e for e in gpu if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]]
    kernels = [e for e in gpu if e.get("cat") == "kernel"]
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    if not gpu or not h2d:
        return dict(error="no GPU events or no host→device copies in the trace")
    t0 = min(e["ts"] for e in gpu)
    t1 = max(e["ts"] + e.get("dur", 0) for e in gpu)
    busy = intervals_union([(e["ts"], e["ts"] + e.get("dur", 0)) for e in h2d])
    busy_us = sum(b - a for a, b in busy)
    gaps = [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)]
    gaps = [(a, b) for a, b in gaps if b - a > 5]
    lead = (t0, busy[0][0])
    tail = (busy[-1][1], t1)
    lens = sorted(b - a for a, b in gaps)
    pct = lambda q: lens[min(len(lens) - 1, int(q * len(lens)))] if lens else None  # noqa: E731
    streams = sorted({e.get("tid") for e in h2d})
    return dict(
        window_ms=(t1 - t0) / 1e3,
        steps=steps,
        ms_per_step=(t1 - t0) / 1e3 / steps,
        h2d_busy_ms=busy_us / 1e3,
        link_busy_share=busy_us / (t1 - t0),
        h2d_copies=len(h2d),
        h2d_gb=sum(e.get("args", {}).get("bytes", 0) for e in h2d) / 1e9,
        copy_streams=streams,
        idle_ms=(t1 - t0 - busy_us) / 1e3,
        gaps=len(gaps),
        gap_ms_total=sum(lens) / 1e3,
        gap_us_p10=pct(0.1),
        gap_us_p50=pct(0.5),
        gap_us_p90=pct(0.9),
        gap_us_max=lens[-1] if lens else None,
        lead_tail_ms=((lead[1] - lead[0]) + (tail[1] - tail[0])) / 1e3,
        kernels_in_gaps=overlap_by_name(kernels, gaps),
        host_ops_in_gaps=overlap_by_name(cpu, gaps),
        kernel_ms=sum(e.get("dur", 0) for e in kernels) / 1e3,
        gap_lengths_us=[round(x, 1) for x in lens],
    )


class BlockRecorder:
    """Forward pre-hooks on every proxy: each block's input [T,H] (last token) and routing [T,K]."""

    def __init__(self, model) -> None:
        self.rows: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.handles = [m.register_forward_pre_hook(self._hook) for m in model.modules() if isinstance(m, MiraExperts)]
        self.on = False

    def _hook(self, module, args):
        if self.on:
            hidden, top_k_index = args[0], args[1]
            self.rows.append((module.layer, hidden[-1:].detach().clone(), top_k_index[-1:].detach().clone()))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def score_gate(manager, rows) -> dict:
    """Gate guesses (router of layer L+d on layer L's input) against the routing that followed."""
    steps: list[dict[int, tuple]] = []
    last = None
    for layer, hidden, idx in rows:
        if last is None or layer <= last:
            steps.append({})
        steps[-1][layer] = (hidden, idx)
        last = layer
    bins = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.01]
    calib = {d: [[0, 0] for _ in bins[:-1]] for d in (1, 2)}
    rank = {d: [[0, 0], [0, 0]] for d in (1, 2)}  # [rank][used, guesses]
    per_layer: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for step in steps:
        for layer, (hidden, _) in step.items():
            for d in (1, 2):
                target = layer + d
                if target not in step:
                    continue
                k = manager.layers[target].top_k
                probs = manager.router_probs(target, hidden)
                p = token_union(probs, k).float().cpu()
                used = set(step[target][1].reshape(-1).tolist())
                for e, v in enumerate(p.tolist()):
                    b = next(i for i in range(len(bins) - 1) if bins[i] <= v < bins[i + 1])
                    calib[d][b][0] += e in used
                    calib[d][b][1] += 1
                order = torch.argsort(p, descending=True).tolist()
                for r in (0, 1):
                    rank[d][r][0] += order[r] in used
                    rank[d][r][1] += 1
                if d == 1:
                    per_layer[str(target)][0] += order[0] in used
                    per_layer[str(target)][1] += 1
    return dict(
        steps=len(steps),
        calibration={
            str(d): [
                dict(p_from=bins[i], p_to=min(bins[i + 1], 1.0), guesses=n, used_share=(u / n if n else None))
                for i, (u, n) in enumerate(calib[d])
            ]
            for d in (1, 2)
        },
        rank_accuracy={str(d): [u / n if n else None for u, n in rank[d]] for d in (1, 2)},
        rank1_accuracy_by_layer_d1={k: u / n for k, (u, n) in sorted(per_layer.items())},
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--systems", default="lru,default")
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--profile-tokens", type=int, default=12)
    ap.add_argument("--score-tokens", type=int, default=48)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    torch.backends.cuda.enable_cudnn_sdp(False)  # see first_call_probe.py
    env = environment()
    result = dict(env=env, command="python benchmarks/decode_profile.py", shape="mixtral-8x7b-8l", budget=args.budget, systems={})
    tmp = tempfile.mkdtemp()
    ids = torch.randint(3, 32000, (1, args.prompt_len), generator=torch.Generator().manual_seed(1)).cuda()
    for name in args.systems.split(","):
        model = random_model_on_device("mixtral-8x7b-8l", seed=0)
        MiraMoEModel.wrap(model, MiraConfig(gpu_budget=args.budget, device="cuda", **SYSTEMS[name]))
        generate(model, ids, 8)  # warm-up: kernels, graphs, first loads
        generate(model, ids, 8)
        model.mira.reset_stats()
        path = os.path.join(tmp, f"{name}.json")
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            generate(model, ids, args.profile_tokens + 1)
            torch.cuda.synchronize()
        prof.export_chrome_trace(path)
        s = model.mira.stats()
        info = analyse_trace(path, args.profile_tokens + 1)
        info["stats"] = {
            k: s.get(k) for k in ("hits", "misses", "hit_rate", "loads", "prefetches", "prefetch_wasted", "bytes_h2d", "stall_s")
        }
        info["stats"]["per_layer"] = s.get("per_layer")
        rec = None
        if name != "lru":
            rec = BlockRecorder(model)
            rec.on = True
            generate(model, ids, args.score_tokens)
            rec.close()
            decode_rows = [r for r in rec.rows if r[1].shape[0] == 1]
            info["gate"] = score_gate(model.mira, decode_rows)
        with open(path) as f, gzip.open(os.path.join(args.out, f"trace-{name}.json.gz"), "wt") as g:
            g.write(f.read())
        result["systems"][name] = info
        print(
            name, json.dumps({k: v for k, v in info.items() if k not in ("gap_lengths_us", "stats")}, indent=1)[:3000], flush=True
        )
        model.mira.close()
        del model, rec
        gc.collect()
        torch.cuda.empty_cache()
    rows = [
        dict(
            system=n,
            ms_per_step=i.get("ms_per_step"),
            link_busy=i.get("link_busy_share"),
            gap_ms=i.get("gap_ms_total"),
            gaps=i.get("gaps"),
        )
        for n, i in result["systems"].items()
    ]
    print_table(rows, list(rows[0]))
    write_json(os.path.join(args.out, f"{env['date']}-{device_slug(env)}-decode-profile.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
