"""Host time per decode step and per expert use, with real pool sizes and tiny matmuls.

A fine-grained model (Qwen3-30B-A3B's routing: 128 experts, top-8) with a hidden size of 32 and an expert width
of 16: its matmuls take microseconds, so what is measured is the runtime's own host work at the pool sizes a real
model has (a budget giving ~900 slots, as Qwen3-30B-A3B's one pool at 8 GiB). Three workloads:

    batch 1,  48 MoE layers   decode, one token per step (each missed expert costs a victim search)
    batch 64, 12 MoE layers   64 tokens per step (~128 expert uses per layer), most of them misses
    serve 65, 12 MoE layers   a server's step: every expert resident (budget 1.0), batch-aware estimates on as
                              `mira serve` runs; ~120 experts per block computed in one grouped matmul on CUDA

Each workload decodes `--steps` tokens twice: once plainly timed (the step time), once with each part's
exclusive time recorded by wrapping the instance's methods (the split; the wrappers add ~1 µs per call, so the
split sums to more than the plain time). Parts:

    victim search   ExpertCache.allocate: the free-slot or victim search and the slot's bookkeeping
    use bookkeeping cache.use(_many) / heat.activate / heat.feedback: per-use accounting
    manager verbs   begin / acquire(_group) / release(_group) / end beyond the two above (plans, pins, events,
                    telemetry)
    copy            ExpertManager._load beyond allocate: the record's copy and its counters
    compute         the proxy's per-expert matmuls (MiraExperts._expert)
    proxy loop      MiraExperts.serve beyond all of the above: routing sync, grouping, the loop, the combine
    rest of model   the forward step beyond the MoE blocks: attention, norms, routers, sampling

    python benchmarks/host_overhead.py --out benchmarks/results/                  # DATE-cpu-host-overhead.json
    python benchmarks/host_overhead.py --device cuda --out benchmarks/results/    # DATE-DEVICE-host-overhead.json

On CUDA the matmuls and copies are queued, so every part but "rest of model" is the host's own time (the proxy's
routing sync waits for the device and is counted in "proxy loop").
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import device_slug, environment, print_table, sync, write_json  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel, batching  # noqa: E402
from mira_hf.testing import step  # noqa: E402

HIDDEN, EXPERT_WIDTH, EXPERTS, TOP_K = 32, 16, 128, 8
TARGET_SLOTS = 910  # Qwen3-30B-A3B's pool at 8 GiB on the H200
# (label, batch, MoE layers, every expert resident): the third is a server's step (`mira serve`: batch-aware estimates
# on), where nearly every expert of a layer is used and resident, so what is left is the host's own work per block
WORKLOADS = (("batch 1", 1, 48, False), ("batch 64", 64, 12, False), ("serve 65, resident", 65, 12, True))

# part -> (owner, method names); owners: "cache", "heat", "manager", "proxy"
PARTS = {
    "victim search": ("cache", ("allocate",)),
    "use bookkeeping": ("cache", ("use", "use_many", "use_block")),
    "heat": ("heat", ("activate", "feedback")),
    "manager verbs": (
        "manager",
        ("begin", "acquire", "acquire_rest", "acquire_group", "release", "release_group", "end", "use_block"),
    ),
    "copy": ("manager", ("_load",)),
    "compute": ("proxy", ("_expert", "_batched", "_on_slots")),
    "proxy loop": ("proxy", ("serve",)),
}


def build(
    batch: int, layers: int, device: str = "cpu", seed: int = 0, dtype: torch.dtype = torch.float32, resident: bool = False
):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=HIDDEN,
        intermediate_size=64,
        moe_intermediate_size=EXPERT_WIDTH,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=4096,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(dtype).eval()
    record = 3 * HIDDEN * EXPERT_WIDTH * dtype.itemsize  # gate_up [2I, H] and down [H, I]
    if not resident:
        return MiraMoEModel.wrap(model, MiraConfig(gpu_budget=TARGET_SLOTS * record, device=device))
    wrapped = MiraMoEModel.wrap(model, MiraConfig(gpu_budget=1.0, device=device))
    batching.enable(wrapped.mira)  # as `mira serve` does
    return wrapped


class PartTimer:
    """Exclusive time per part: each wrapped call's time minus that of wrapped calls inside it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._stack: list[float] = []  # time spent in wrapped children of each open call

    def clear(self) -> None:
        for part in self.seconds:
            self.seconds[part], self.calls[part] = 0.0, 0

    def wrap(self, obj, name: str, part: str) -> None:
        fn = getattr(obj, name, None)
        if fn is None:
            return
        clock, stack, seconds, calls = time.perf_counter, self._stack, self.seconds, self.calls
        seconds.setdefault(part, 0.0)
        calls.setdefault(part, 0)

        def timed(*args, **kwargs):
            stack.append(0.0)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t0
                inner = stack.pop()
                seconds[part] += dt - inner
                calls[part] += 1
                if stack:
                    stack[-1] += dt

        setattr(obj, name, timed)

    def wrap_model(self, model, parts: dict) -> list[tuple[object, str]]:
        """Wrap the methods `parts` names (part -> (owner, method names); owners "cache", "heat", "manager",
        "loader" of `model.mira`, or "proxy": every experts proxy) on their instances; returns the (object, name)
        pairs wrapped, each undone by `obj.__dict__.pop(name)`."""
        m = model.mira
        owners = {"cache": m.cache, "heat": m.heat, "manager": m, "loader": m.loader}
        proxies = [mod for mod in model.modules() if type(mod).__name__ in ("MiraExperts", "MiraScaledExperts")]
        wrapped = []
        for part, (owner, names) in parts.items():
            for name in names:
                for obj in proxies if owner == "proxy" else [owners[owner]]:
                    if getattr(obj, name, None) is not None:
                        self.wrap(obj, name, part)
                        wrapped.append((obj, name))
        return wrapped


def decode(model, batch: int, steps: int, seed: int = 1, timer: PartTimer | None = None) -> tuple[float, int]:
    """Decode `steps` tokens for `batch` sequences (greedy, KV cache) after a 4-token prompt; returns (seconds,
    expert uses) of the decode steps (`timer` is cleared after the prompt)."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, 4), generator=g).to(model.device)
    cache = DynamicCache(config=model.config)
    uses = 0
    with torch.inference_mode():
        out, _ = step(model, ids, cache)
        telemetry = model.mira.telemetry
        t_uses = sum(s.hot_hits + s.stage_hits + s.misses + s.host_computed for s in telemetry.layers.values())
        sync()
        if timer is not None:
            timer.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
            out, _ = step(model, nxt, cache)
        sync()
        seconds = time.perf_counter() - t0
        uses = sum(s.hot_hits + s.stage_hits + s.misses + s.host_computed for s in telemetry.layers.values()) - t_uses
    return seconds, uses


def _counters(m) -> tuple[int, int]:
    layers = m.telemetry.layers.values()
    return sum(s.misses for s in layers), sum(s.evictions for s in layers)


def measure(
    label: str, batch: int, layers: int, resident: bool, steps: int, warmup: int, device: str, dtype: torch.dtype
) -> dict:
    model = build(batch, layers, device, dtype=dtype, resident=resident)
    m = model.mira
    n_slots = sum(p.n_slots for p in m.cache.pools.values())
    decode(model, batch, warmup, seed=1)  # fills the cache: the measured steps evict
    m.reset_stats()
    plain_s, uses = decode(model, batch, steps, seed=2)  # each run decodes other sequences: misses as in use
    misses, evictions = _counters(m)
    clock = getattr(m.telemetry, "blocks", None)  # mira_hf.host_time: what the serving planner's step cost adds
    fit = clock.fit() if clock is not None else None

    timer = PartTimer()
    timer.wrap_model(model, PARTS)
    m.reset_stats()
    profiled_s, profiled_uses = decode(model, batch, steps, seed=3, timer=timer)
    profiled_misses, _ = _counters(m)
    parts_s = dict(timer.seconds)
    parts_s["rest of model"] = profiled_s - sum(parts_s.values())
    allocs = timer.calls.get("victim search", 0)
    return dict(
        workload=label,
        batch=batch,
        moe_layers=layers,
        slots=n_slots,
        pools=len(m.cache.pools),
        steps=steps,
        uses_per_step=uses / steps,
        misses_per_step=misses / steps,
        evictions_per_step=evictions / steps,
        step_ms=1e3 * plain_s / steps,
        host_us_per_use=1e6 * plain_s / max(uses, 1),
        profiled_step_ms=1e3 * profiled_s / steps,
        profiled_uses_per_step=profiled_uses / steps,
        profiled_misses_per_step=profiled_misses / steps,
        parts_ms_per_step={k: 1e3 * v / steps for k, v in parts_s.items()},
        parts_us_per_use={k: 1e6 * v / max(profiled_uses, 1) for k, v in parts_s.items()},
        calls_per_step={k: v / steps for k, v in timer.calls.items()},
        host_fit=None if fit is None else dict(fit.__dict__, terms=list(fit.terms)),
        host_fit_step_ms=None if fit is None else 1e3 * (fit.use_s * uses + fit.miss_s * misses) / steps,
        victim_search_us_per_allocate=1e6 * timer.seconds.get("victim search", 0.0) / max(allocs, 1),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: host work is serial anyway)")
    ap.add_argument("--label", default="", help="suffix of the result file's name (what the run measures)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument(
        "--dtype",
        default=None,
        help="the model's dtype (default: bfloat16 on cuda, as real checkpoints; float32 on cpu). On CUDA, torch's grouped "
        "matmul, which the proxy uses as the unwrapped model does, runs a host-synchronising fallback for float32",
    )
    ap.add_argument("--out", default=None, help="directory for DATE-DEVICE-host-overhead[-LABEL].json")
    args = ap.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    rows = [measure(label, b, n, r, args.steps, args.warmup, args.device, dtype) for label, b, n, r in WORKLOADS]
    table = []
    for r in rows:
        row = {k: r[k] for k in ("workload", "slots", "uses_per_step", "misses_per_step", "step_ms", "host_us_per_use")}
        row.update({f"{k} ms": v for k, v in r["parts_ms_per_step"].items()})
        row["victim µs/alloc"] = r["victim_search_us_per_allocate"]
        table.append(row)
    columns = list(table[0])
    print_table(table, columns)
    if args.out:
        env = environment()
        slug = device_slug(env, on_gpu=args.device != "cpu")
        name = f"{datetime.date.today()}-{slug}-host-overhead{'-' + args.label if args.label else ''}.json"
        path = os.path.join(args.out, name) if os.path.isdir(args.out) or args.out.endswith("/") else args.out
        code = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        write_json(path, dict(benchmark="host_overhead", code=code, environment=env, args=vars(args), results=rows))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
