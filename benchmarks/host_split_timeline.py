"""Where a batch-1 decode step's time goes per MoE block, with experts split by neuron (`host_compute="split"`)
and without: host-side timestamps of each block's phases.

For the Mixtral shape at a consumer share (as `host_split.py`), each system decodes at batch 1 after a warm-up,
and every MoE block records when (perf_counter, on the thread that drives the device):

    enter       the experts' forward is called (the router's outputs are launched, not yet computed)
    planned     the manager's `begin` starts (after the block's one host sync: the device has run the layer so far)
    submitted   the host job is handed to the worker (split: the block's host parts), within `begin`
    started     the call that submitted it returns
    begun       `begin` returns (its copies are issued)
    collect     the thread starts waiting for the host job
    collected   the host job's outputs are back (their copy to the device is queued)
    exit        the experts' forward returns

and on the host worker's thread: `called` (the job starts there), `landed` (its rows have reached the host) and
`done` (its outputs are in pinned memory). Each phase's median over the decode's blocks is reported in ms, and
the block's whole time (enter to the next block's enter).

    python benchmarks/host_split_timeline.py --out benchmarks/results/      # GPU: ~1 minute
    python benchmarks/host_split_timeline.py --smoke --out /tmp             # CPU, tiny shapes: checks the script

`--switch-interval S` adds the split once more with Python's thread switch interval set to S seconds (default
5 ms): how long the worker's thread can wait for the interpreter while the driving thread runs Python.
Writes OUT/<date>-<device>-host-split-timeline.json.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import copy  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

from bench.clock import Deadline, log  # noqa: E402

if __name__ == "__main__":
    for _k, _v in (("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_VERBOSITY", "error")):
        os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import transformers  # noqa: E402
from bench.measure import decode_phase, free_device_cache, generator, release_wrapped  # noqa: E402
from bench.workloads import Workload, model_facts  # noqa: E402
from common import device_slug, environment, print_table, sync, write_json  # noqa: E402
from host_compute import WORKLOADS, budget_of, build, spread_routers  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.host_compute import HostJob  # noqa: E402
from mira_hf.proxy import MiraExperts  # noqa: E402

# (phase, from event, to event): each a median over blocks, in ms
PHASES = [
    ("to_sync", "enter", "planned"),
    ("begin", "planned", "begun"),
    ("to_submit", "planned", "submitted"),
    ("begin_after_submit", "started", "begun"),
    ("device_parts", "begun", "collect"),
    ("handoff", "submitted", "called"),
    ("rows_d2h", "called", "landed"),
    ("host_parts", "landed", "done"),
    ("wait_host", "collect", "collected"),
    ("after_done", "done", "collected"),
    ("combine", "collected", "exit"),
    ("block", "enter", "exit"),
    ("between", "exit", "next_enter"),
    ("layer", "enter", "next_enter"),
]


class Timeline:
    """Timestamps per block, from hooks on the experts' proxies and wrappers on one manager's methods (this
    benchmark's instruments: the model's code is unchanged)."""

    def __init__(self, model) -> None:
        self.m = model.mira
        self.blocks: list[dict] = []
        self.on = False
        self.handles = []
        for mod in model.modules():
            if isinstance(mod, MiraExperts):
                self.handles.append(mod.register_forward_pre_hook(lambda *_: self._new()))
                self.handles.append(mod.register_forward_hook(lambda *_: self._mark("exit")))
        self._wrap(self.m, "begin", "planned", "begun")
        collect = self._collect = HostJob.collect
        if not self.m.host.active:
            return
        self._wrap(self.m.host, "start", None, "started")
        # `start` hands the job to the worker right after it asks for the worker, and the worker may begin before
        # `start` returns: the hand-off is timed from there
        self._wrap(self.m.host, "_worker", "submitted", "submitted")
        run = self.m.host._run

        def timed_run(layer, experts, sizes, x, ready, *rest):
            block = self.blocks[-1] if self.blocks else None
            t = time.perf_counter()
            if ready is not None:
                ready.synchronize()
            landed = time.perf_counter()
            y = run(layer, experts, sizes, x, ready, *rest)
            if block is not None and self.on:
                block.update(called=t, landed=landed, done=time.perf_counter())
            return y

        self.m.host._run = timed_run
        timeline = self

        def timed_collect(job):
            timeline._mark("collect")
            out = collect(job)
            timeline._mark("collected")
            return out

        HostJob.collect = timed_collect

    def _wrap(self, obj, name: str, before: str | None, after: str) -> None:
        fn = getattr(obj, name)

        def wrapped(*a, **kw):
            if before:
                self._mark(before)
            out = fn(*a, **kw)
            self._mark(after)
            return out

        setattr(obj, name, wrapped)

    def _new(self) -> None:
        if self.on:
            t = time.perf_counter()
            if self.blocks:
                self.blocks[-1].setdefault("next_enter", t)
            self.blocks.append(dict(enter=t))

    def _mark(self, event: str) -> None:
        if self.on and self.blocks:
            self.blocks[-1].setdefault(event, time.perf_counter())

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        HostJob.collect = self._collect

    def summary(self) -> dict:
        out = {}
        for phase, a, b in PHASES:
            d = [1e3 * (blk[b] - blk[a]) for blk in self.blocks if a in blk and b in blk]
            if d:
                out[phase] = dict(median_ms=statistics.median(d), mean_ms=statistics.fmean(d), n=len(d))
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", default="consumer", help="a fraction of the expert bytes, or 'consumer'")
    ap.add_argument("--share", type=float, default=0.2)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--warmup-tokens", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--switch-interval", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA GPU visible: run on a GPU machine, or pass --smoke for the CPU check.", flush=True)
        return 2
    budget = args.budget if args.budget == "consumer" else float(args.budget)
    if args.smoke:
        args.new_tokens, args.warmup_tokens, args.prompt_len = 4, 1, 8
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=UserWarning)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # it builds a graph per new sequence length (NOTES.md, "Measuring")
    env = environment()
    label, shape, smoke_shape, consumer, full_layers = WORKLOADS["mixtral"]
    wl = Workload("mixtral", label, smoke_shape if args.smoke else shape, args.seed)
    base = build(wl, device, args.smoke)
    wl.facts = model_facts(base)
    if not args.smoke:
        spread_routers(base, args.prompt_len, args.seed)
    gpu_budget, budget_label = budget_of(budget, wl.facts, consumer, full_layers)
    ids = wl.prompts(1, args.prompt_len, wl.facts["vocab_size"], device)
    pad = wl.facts["pad_token_id"]
    deadline = Deadline(540.0)
    split = dict(host_compute="split", host_share=args.share)
    systems = [("default", {}, None), (f"split-{args.share:g}", split, None)]
    if args.switch_interval is not None:
        systems.append((f"split-{args.share:g}-switch-{args.switch_interval:g}", split, args.switch_interval))
    result = dict(env=env, args=vars(args), budget=budget_label, rows=[])
    interval = sys.getswitchinterval()
    for name, kw, switch in systems:
        model = MiraMoEModel.wrap(copy.deepcopy(base), MiraConfig(gpu_budget=gpu_budget, device=device, **kw))
        m = model.mira
        timeline = Timeline(model)
        try:
            if switch is not None:
                sys.setswitchinterval(switch)
            gen = generator(model, pad, deadline)
            decode_phase(gen, ids, args.warmup_tokens + 2, args.warmup_tokens, m)  # warm-up
            timeline.on = True
            d = decode_phase(gen, ids, args.new_tokens, args.warmup_tokens, m)
            timeline.on = False
            row = dict(system=name, tok_s=d["tok_s"], hit_rate=d.get("hit_rate"), stall_share=d.get("stall_share"))
            row.update({f"{k}_ms": v["median_ms"] for k, v in timeline.summary().items()})
            row["phases"] = timeline.summary()
            if m.host.active:
                row["host_lag_s"] = m.host.costs.host_lag_s
            result["rows"].append(row)
            log(f"{name}: {d['tok_s'] or 0:.2f} tok/s")
        finally:
            sys.setswitchinterval(interval)
            timeline.close()
            release_wrapped(m)
            model = m = None
            free_device_cache()
            sync()
    cols = ["system", "tok_s", "hit_rate"] + [f"{p}_ms" for p, _, _ in PHASES]
    print_table(result["rows"], cols)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{env['date']}-{device_slug(env, on_gpu=not args.smoke)}-host-split-timeline")
    write_json(stem + ".json", result)
    log(f"wrote {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
