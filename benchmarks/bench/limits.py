"""The limit: seconds per decode token no system can beat, max(bytes a token touches / device-memory bandwidth,
Belady's bytes per token / pinned host-to-device bandwidth), with Belady's optimal cache (same slot count) replayed
over the routing recorded in the run."""

from __future__ import annotations

from mira_hf.replay import belady_misses

from . import GB
from .workloads import Workload


def belady_bytes(
    steps: list[dict[int, list[int]]], pool_of_layer: dict, n_slots: dict, record_bytes: dict, count_from: int = 1
) -> int:
    """Bytes Belady's optimal cache must load over steps[count_from:], with `n_slots[pool]` slots per
    pool (pools are independent). Earlier steps (the prefill) only warm the cache."""
    blocks = [(i, layer, experts) for i, step in enumerate(steps) for layer, experts in sorted(step.items())]
    misses = belady_misses(blocks, pool_of_layer, n_slots, count_from)
    return sum(n * record_bytes[layer] for layer, n in misses.items())


def compute_limit(facts: dict, trace: dict | None, bw: dict) -> dict:
    """Seconds per decode token no system can beat, and its two parts."""
    record = trace["record_bytes"][min(trace["record_bytes"])] if trace else facts["raw_record_bytes"]
    touched = facts["non_expert_touched_bytes"] + facts["top_k"] * facts["moe_layers"] * record
    out = dict(
        touched_bytes_per_token=touched,
        record_bytes=record,
        device_gbps=bw["device_gbps"],
        h2d_gbps=bw["h2d_gbps"],
        compute_s=touched / (bw["device_gbps"] * GB),
        belady_bytes_per_token=None,
        transfer_s=None,
        slots=None,
        decode_steps=None,
    )
    if trace and len(trace["steps"]) > 1:
        steps = trace["steps"]
        if "belady_bytes" not in trace:  # once per trace: the JSON is rewritten after every system
            trace["belady_bytes"] = belady_bytes(steps, trace["pool_of_layer"], trace["n_slots"], trace["record_bytes"])
        per_token = trace["belady_bytes"] / (len(steps) - 1)
        out.update(
            belady_bytes_per_token=per_token,
            transfer_s=per_token / (bw["h2d_gbps"] * GB),
            slots=sum(trace["n_slots"].values()),
            decode_steps=len(steps) - 1,
        )
    out["limit_s"] = max(out["compute_s"], out["transfer_s"] or 0.0)
    out["bound"] = "transfer (Belady / H2D)" if (out["transfer_s"] or 0.0) > out["compute_s"] else "device memory (bytes touched)"
    return out


def finish_model(m: dict, wl: Workload, traces: dict, bw: dict, args) -> None:
    """Limits per budget (from the LRU trace, else another exact mira system's), and each row's
    time per token as a multiple of its budget's limit (resident and accelerate: the first budget's)."""
    if not wl.facts:
        return
    for b in args.budgets:
        trace = next((traces[(sname, b)] for sname in ("lru", "default", "int4") if (sname, b) in traces), None)
        lim = compute_limit(wl.facts, trace, bw)
        if trace is not None:
            lim["trace_from"] = next(sname for sname in ("lru", "default", "int4") if (sname, b) in traces)
            lim["routing_trace_decode"] = [
                [step.get(layer, []) for layer in sorted(trace["record_bytes"])] for step in trace["steps"][1:]
            ]
        m["limits"][str(b)] = lim
    for r in m["rows"]:
        lim = m["limits"].get(str(r["budget"] if r["budget"] is not None else args.budgets[0]))
        if lim and r["time_per_token_s"]:
            r["x_limit"] = r["time_per_token_s"] / lim["limit_s"]
        own = traces.get((r["system"], r["budget"]))
        if own is not None and r["time_per_token_s"]:
            # the same floor for this system's own format and slot count: Belady over its own routing
            # trace with its own record sizes (a compressed format lowers the bytes any cache must move)
            own_lim = compute_limit(wl.facts, own, bw)
            r["own_limit_s"] = own_lim["limit_s"]
            r["own_belady_bytes_per_token"] = own_lim["belady_bytes_per_token"]
            r["x_own_limit"] = r["time_per_token_s"] / own_lim["limit_s"]
    for b in args.budgets:
        if ("lru", b) in traces and ("default", b) in traces:  # both bit-exact: the same tokens, the same routing
            m.setdefault("routing_identical_lru_default", {})[str(b)] = (
                traces[("lru", b)]["steps"] == traces[("default", b)]["steps"]
            )
