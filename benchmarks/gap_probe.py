"""Why the link idles during a decode: every host→device copy timed with CUDA events, no profiler.

    python benchmarks/gap_probe.py --out DIR     # ~2 minutes on an H200; writes DIR/<date>-<device>-gap-probe.json

torch.profiler slows the default's host path so much that the decode turns host-bound (100 ms per step
instead of 55), so `decode_profile.py`'s gaps are not those of a real run. Here each copy gets three
CUDA events: its issue (an event on an idle stream, so it completes when the host issues the copy), its
start and its end on the copy stream; each MoE block's `begin` (the host has the block's routing) gets
an issue-time event too. From them, per decode token: link busy time, and each idle gap between two
copies split into
- `routing`: from the previous copy's end until the host had the next block's routing (the GPU
  finishing the block and the next attention and router, then the sync);
- `host`: from there until the next copy was issued (the manager's bookkeeping);
- `queue`: from the issue until the copy started (it waited for a slot's last reader);
- `slot_wait`: the next copy was issued before the previous one ended, yet started later: it waited
  for its slot's last reader on the compute stream,
and the kind of copy that ended the gap (demand, stage, speculate, finish). Instrumentation wraps the
loader and manager methods in this script only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import run  # noqa: E402  (workloads, --variant)
from common import device_slug, environment, print_table, random_model_on_device, write_json  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.loader import Loader  # noqa: E402
from mira_hf.manager import ExpertManager  # noqa: E402
from mira_hf.testing import step  # noqa: E402

SYSTEMS = {"lru": dict(policy="lru", predictor=None, quantization=None), "default": {}}


class Probe:
    """Wraps Loader._copy_bytes, ExpertManager._load/_finish/begin for one model's decode."""

    def __init__(self) -> None:
        self.copies: list[tuple[str, object, object, object]] = []  # kind, issued, start, end
        self.begins: list[object] = []
        self.kind = "demand"
        self.on = False
        self._orig = {}

    def event(self, stream) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def install(self) -> None:
        probe = self
        o = self._orig
        o["copy"], o["load"], o["finish"], o["begin"] = (
            Loader._copy_bytes, ExpertManager._load, ExpertManager._finish, ExpertManager.begin,
        )  # fmt: skip

        def copy_bytes(loader, *a):
            if not probe.on:
                return o["copy"](loader, *a)
            issued = probe.event(loader._clock)
            start = probe.event(loader.stream)
            o["copy"](loader, *a)
            probe.copies.append((probe.kind, issued, start, probe.event(loader.stream)))

        def load(manager, key, staged, evict=True, probability=1.0, nbytes=None):
            probe.kind = "speculate" if nbytes is not None else "stage" if staged else "demand"
            try:
                return o["load"](manager, key, staged, evict, probability, nbytes)
            finally:
                probe.kind = "demand"

        def finish(manager, slot):
            probe.kind = "finish"
            try:
                return o["finish"](manager, slot)
            finally:
                probe.kind = "demand"

        def begin(manager, *a, **kw):
            if probe.on:
                probe.begins.append(probe.event(manager.loader._clock))
            return o["begin"](manager, *a, **kw)

        Loader._copy_bytes, ExpertManager._load, ExpertManager._finish, ExpertManager.begin = copy_bytes, load, finish, begin

    def uninstall(self) -> None:
        o = self._orig
        Loader._copy_bytes, ExpertManager._load, ExpertManager._finish, ExpertManager.begin = (
            o["copy"], o["load"], o["finish"], o["begin"],
        )  # fmt: skip

    def analyse(self, base: torch.cuda.Event, tokens: int) -> dict:
        torch.cuda.synchronize()
        t = lambda ev: base.elapsed_time(ev)  # noqa: E731  ms since base
        copies = [(k, t(i), t(s), t(e)) for k, i, s, e in self.copies]
        begins = sorted(t(b) for b in self.begins)
        busy = sum(e - s for _, _, s, e in copies)
        parts = dict(routing=0.0, host=0.0, queue=0.0, slot_wait=0.0)
        by_kind: dict[str, float] = {}
        gaps = []
        for (_, _, _, prev_end), (kind, issued, start, _) in zip(copies, copies[1:], strict=False):
            gap = start - prev_end
            if gap <= 0.005:  # back to back (5 µs)
                continue
            gaps.append(gap)
            by_kind[kind] = by_kind.get(kind, 0.0) + gap
            if issued <= prev_end:  # issued in time: the stream waited for the slot's last reader
                parts["slot_wait"] += gap
                continue
            routed = [b for b in begins if prev_end <= b <= issued]
            r = routed[0] - prev_end if routed else 0.0
            parts["routing"] += r
            parts["host"] += issued - prev_end - r
            parts["queue"] += start - issued
        window = copies[-1][3] - copies[0][2] if copies else 0.0
        per = lambda x: x / tokens  # noqa: E731
        return {
            "tokens": tokens,
            "copies_per_token": len(copies) / tokens,
            "window_ms_per_token": per(window),
            "link_busy_ms_per_token": per(busy),
            "link_idle_ms_per_token": per(window - busy),
            "idle_split_ms_per_token": {k: per(v) for k, v in parts.items()},
            "idle_by_next_copy_ms_per_token": {k: per(v) for k, v in sorted(by_kind.items())},
            "gaps_per_token": len(gaps) / tokens,
            "gap_ms_p50": statistics.median(gaps) if gaps else None,
            "copies_by_kind_per_token": {k: sum(c[0] == k for c in copies) / tokens for k in sorted({c[0] for c in copies})},
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--model", default="mixtral", choices=["mixtral", "qwen3"])
    ap.add_argument("--systems", default="lru,default")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE,...", help="as run.py's")
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gap_probe: needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.enable_cudnn_sdp(False)
    names = [n for n in args.systems.split(",") if n] + [run.add_variant(v) for v in args.variant]
    shape = run.WORKLOADS[args.model][1]
    rows, result = [], {"env": environment(), "command": " ".join(["python"] + sys.argv), "shape": shape, "systems": {}}
    probe = Probe()
    probe.install()
    try:
        for name in names:
            overrides = SYSTEMS.get(name, run.MIRA_OVERRIDES.get(name, {}))
            model = random_model_on_device(shape, device="cuda")
            MiraMoEModel.wrap(model, MiraConfig(gpu_budget=args.budget, device="cuda", **overrides))
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(3, model.config.vocab_size, (1, args.prompt_len), generator=g).cuda()
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
                o, past = step(model, ids)  # the prefill; the decode below is timed
                nxt = o.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                probe.copies.clear()
                probe.begins.clear()
                base = torch.cuda.Event(enable_timing=True)
                base.record()
                probe.on = True
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.tokens):
                    o, past = step(model, nxt, past)
                    nxt = o.logits[:, -1:].argmax(-1)
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                probe.on = False
                torch.cuda.synchronize()
            row = probe.analyse(base, args.tokens)
            row["ms_per_token"] = start.elapsed_time(end) / args.tokens
            result["systems"][name] = row
            rows.append({"system": name, "ms/tok": row["ms_per_token"], "busy": row["link_busy_ms_per_token"],
                         **{k: v for k, v in row["idle_split_ms_per_token"].items()},
                         "copies": row["copies_per_token"], "gaps": row["gaps_per_token"]})  # fmt: skip
            print(name, row, flush=True)
            del model, past, o
            torch.cuda.empty_cache()
    finally:
        probe.uninstall()
    print_table(rows, list(rows[0]))
    path = args.out if args.out.endswith(".json") else os.path.join(
        args.out, f"{result['env']['date']}-{device_slug(result['env'], True)}-gap-probe.json"
    )  # fmt: skip
    write_json(path, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
