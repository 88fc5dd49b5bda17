"""What a run reports: headline comparisons (measurements, no verdicts), the tables, the Markdown and the plot derived
from the result JSON, and the summary printed at the end."""

from __future__ import annotations

import contextlib
import io
import os

from common import print_table, write_json

from . import GB
from .clock import log
from .systems import MIRA_SYSTEMS, SYSTEMS

COMPARE_MODEL, COMPARE_BUDGET = "mixtral", 0.25  # where the headline comparisons are read


def comparisons(result: dict) -> list[dict]:
    """Headline ratios on the Mixtral shape at 25% (measurements, no verdicts); a ratio is None when a number
    is missing. A smoke run has none: its tiny shapes on a CPU say nothing about performance."""
    if result["args"].get("smoke"):
        return []
    m = result["models"].get(COMPARE_MODEL, {})
    rows = {
        r["system"]: r for r in m.get("rows", []) if r["budget"] in (None, COMPARE_BUDGET) and r["status"] in ("ok", "partial")
    }

    def val(system, key):
        r = rows.get(system)
        return None if r is None else r.get(key)

    def ratio(a, b):
        return a / b if a is not None and b else None

    out = []

    def add(name, value, unit="×", detail=""):
        out.append(dict(name=name, value=value, unit=unit, detail=detail))

    add(
        "default vs accelerate: decode tok/s (batch 1)",
        ratio(val("default", "decode_tok_s_b1"), val("accelerate", "decode_tok_s_b1")),
    )
    add("default vs accelerate: TTFT", ratio(val("accelerate", "ttft_s"), val("default", "ttft_s")))
    add("default vs accelerate: beam-4 tok/s", ratio(val("default", "beam_tok_s"), val("accelerate", "beam_tok_s")))
    add("int4 vs accelerate: TTFT", ratio(val("accelerate", "ttft_s"), val("int4", "ttft_s")))
    for sname in ("int4", "int4-packed"):
        add(
            f"{sname} vs bf16 transfer: decode tok/s (batch 1)",
            ratio(val(sname, "decode_tok_s_b1"), val("bf16", "decode_tok_s_b1")),
        )
    add("default vs lru: decode tok/s (batch 1)", ratio(val("default", "decode_tok_s_b1"), val("lru", "decode_tok_s_b1")))
    add("default time/token over the limit", val("default", "x_limit"), unit="× limit")
    facts = m.get("facts") or {}
    bound = (facts["non_expert_bytes"] + int(COMPARE_BUDGET * facts["expert_bytes"])) / GB if facts else None
    peaks = {sname: val(sname, "peak_gpu_gb") for sname in MIRA_SYSTEMS if val(sname, "peak_gpu_gb") is not None}
    worst = max(peaks.values()) if peaks and bound else None
    detail = ", ".join(f"{k} {v:.2f} GB" for k, v in peaks.items())
    add("peak GPU memory of mira over non-expert weights + budget", ratio(worst, bound), detail=detail)
    return out


def format_comparison(c: dict) -> str:
    if c["value"] is None:
        return f"{c['name']}: not measured in this run"
    return f"{c['name']}: {c['value']:.3g}{c['unit']}" + (f" [{c['detail']}]" if c["detail"] else "")


# -- output ---------------------------------------------------------------------------------------
TABLE_COLUMNS = [
    "system",
    "budget",
    "status",
    "TTFT s",
    "b1 tok/s",
    "b8 tok/s",
    "beam tok/s",
    "peak GB",
    "MB h2d/tok",
    "H2D GB/s",
    "stall",
    "hit",
    "ms/tok",
    "x limit",
    "x own",
]


def _n(v, fmt="{:.3g}"):
    return "" if v is None else fmt.format(v)


def table_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in _sorted_rows(rows):
        out.append(
            {
                "system": r["system"],
                "budget": "" if r["budget"] is None else f"{r['budget']:.0%}",
                "status": r["status"],
                "TTFT s": _n(r["ttft_s"]),
                "b1 tok/s": _n(r["decode_tok_s_b1"]),
                "b8 tok/s": _n(r["decode_tok_s_b8"]),
                "beam tok/s": _n(r["beam_tok_s"]),
                "peak GB": _n(r["peak_gpu_gb"], "{:.2f}"),
                "MB h2d/tok": _n(None if r["h2d_bytes_per_token"] is None else r["h2d_bytes_per_token"] / 1e6),
                "H2D GB/s": _n(r["h2d_gbps_decode"]),
                "stall": _n(None if r["stall_share"] is None else 100 * r["stall_share"], "{:.0f}%"),
                "hit": _n(None if r["hit_rate"] is None else 100 * r["hit_rate"], "{:.0f}%"),
                "ms/tok": _n(None if r["time_per_token_s"] is None else 1e3 * r["time_per_token_s"]),
                "x limit": _n(r["x_limit"]),
                "x own": _n(r.get("x_own_limit")),  # absent in results older than the column
            }
        )
    return out


COST_COLUMNS = [
    "system",
    "budget",
    "build s",
    "wrap s",
    "save s",
    "load s",
    "setup s",
    "system s",
    "GPU GB set up",
    "peak GB b1/b8/beam",
    "host RSS GB loaded/after",
    "torch pinned GB",
]


def cost_rows(rows: list[dict]) -> list[dict]:
    """Where each system's time and memory went (set-up, totals), for planning the next run."""
    out = []
    for r in _sorted_rows(rows):
        if r["status"] in ("n/a", "skipped"):
            continue
        peaks = r.get("peak_gpu_gb_by_phase") or {}
        out.append(
            {
                "system": r["system"],
                "budget": "" if r["budget"] is None else f"{r['budget']:.0%}",
                "build s": _n(r.get("build_s"), "{:.1f}"),
                "wrap s": _n(r.get("wrap_s"), "{:.1f}"),
                "save s": _n(r.get("save_s"), "{:.1f}"),
                "load s": _n(r.get("load_s"), "{:.1f}"),
                "setup s": _n(r.get("setup_s"), "{:.1f}"),
                "system s": _n(r.get("system_s"), "{:.1f}"),
                "GPU GB set up": _n(r.get("gpu_gb_after_setup"), "{:.2f}"),
                "peak GB b1/b8/beam": "/".join(_n(peaks.get(k), "{:.1f}") for k in ("b1", "b8", "beam")) if peaks else "",
                "host RSS GB loaded/after": "/".join(_n(r.get(k), "{:.1f}") for k in ("host_rss_gb", "host_rss_after_gb")),
                "torch pinned GB": _n(r.get("pinned_host_gb"), "{:.1f}"),
            }
        )
    return out


def _sorted_rows(rows: list[dict]) -> list[dict]:
    order = {s: i for i, s in enumerate(SYSTEMS)}
    return sorted(rows, key=lambda r: (r["budget"] or 0, order.get(r["system"], len(order))))


def render_table(rows: list[dict], cost: bool = False) -> str:
    shown = cost_rows(rows) if cost else table_rows(rows)
    if not shown:
        return "(nothing measured)"
    with contextlib.redirect_stdout(io.StringIO()):
        return print_table(shown, COST_COLUMNS if cost else TABLE_COLUMNS)


def limit_lines(m: dict) -> list[str]:
    lines = []
    resident = next((r for r in m.get("rows", []) if r["system"] == "resident" and r["time_per_token_s"]), None)
    for budget, lim in sorted(m.get("limits", {}).items()):
        text = (
            f"limit at budget {float(budget):.0%}: {1e3 * lim['limit_s']:.3g} ms/token, bound by {lim['bound']} = "
            f"max({lim['touched_bytes_per_token'] / GB:.3g} GB touched / {lim['device_gbps']:.0f} GB/s = {1e3 * lim['compute_s']:.3g} ms"
        )
        if lim["transfer_s"] is not None:
            text += (
                f", Belady {lim['belady_bytes_per_token'] / 1e6:.0f} MB/token ({lim['slots']} slots, {lim['decode_steps']} steps)"
                f" / {lim['h2d_gbps']:.1f} GB/s = {1e3 * lim['transfer_s']:.3g} ms)"
            )
        else:
            text += "; no routing trace, so no transfer term)"
        if resident:
            text += f"; all resident (transformers): {1e3 * resident['time_per_token_s']:.3g} ms/token = {resident['time_per_token_s'] / lim['limit_s']:.3g}× limit"
        lines.append(text)
    return lines


def row_notes(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        budget = "" if r["budget"] is None else f" @ {r['budget']:.0%}"
        if r["error"]:
            out.append(f"{r['system']}{budget}: ERROR {r['error'][:400]}")
        for n in r["notes"]:
            out.append(f"{r['system']}{budget}: {n}")
    return out


def facts_line(m: dict) -> str:
    f = m.get("facts")
    if not f:
        return "(no model built)"
    return (
        f"{f['moe_layers']} MoE layers × {f['num_experts']} experts, top-{f['top_k']}; experts {f['expert_bytes'] / GB:.2f} GB "
        f"({f['raw_record_bytes'] / 1e6:.1f} MB each), non-expert {f['non_expert_bytes'] / GB:.2f} GB"
        + "".join(f"; budget {float(b):.0%} = {v / GB:.2f} GB" for b, v in sorted(m.get("budget_bytes", {}).items()))
    )


def render_markdown(result: dict) -> str:
    env, bw = result["env"], result.get("bandwidth", {})
    out = [
        f"# mira-hf benchmark: {env.get('device')} ({env.get('date')})",
        "",
        f"torch {env.get('torch')}, transformers {env.get('transformers')}, Python {env.get('python')}, {env.get('cpu_count')} CPUs. "
        f"Measured in this run: pinned H2D {bw.get('h2d_gbps', 0):.1f} GB/s, pageable H2D {bw.get('h2d_pageable_gbps') or 0:.1f} GB/s, "
        f"device memory {bw.get('device_gbps', 0):.0f} GB/s ({bw.get('measured_on', '')}).",
        "",
        f"Command: `{result.get('command', '')}`"
        + ("  **(smoke: tiny shapes on CPU, numbers mean nothing)**" if result["args"].get("smoke") else ""),
        "",
        "## How to read this",
        "",
        "Every system runs the same prompts on the same random-initialised weights (the bundled model: trained weights). "
        "`resident` keeps every expert on the GPU: the speed transformers reaches when memory is no object. `accelerate` is "
        'what a user gets from `device_map="auto"` with the same GPU memory (+2 GB): offloaded weights cross the link at '
        "every forward. `lru` is a reactive expert cache (load on router miss, evict least recently used: mixtral-offloading "
        "and MoE-Infinity style); `default` is mira-hf as it ships; `int4*` move 4-bit experts (lossy, opt-in). "
        "Look first at ms/tok and `x limit`: the limit is the time the link must spend on the bytes Belady's optimal "
        "cache of the same size would move for this very routing (or the time to read the touched weights from device "
        "memory, if larger), so 1.0 is the best any exact demand cache can do at this budget, and the "
        "resident row shows how far transformers itself is from it. Random weights route almost uniformly (no reuse to "
        "exploit), so on them the bytes per expert decide; the bundled model shows real routing.",
        "",
        "Columns: TTFT = time to first token, 512-token prompt, batch 1; b1/b8 tok/s = decode tokens/s at batch 1 / 8, "
        "excluding the first token; beam tok/s = new tokens / time with 4 beams; MB h2d/tok, H2D GB/s, stall (share of decode "
        "time waiting for experts) and hit (expert-cache hit rate) are batch-1 decode numbers from mira's counters; "
        "ms/tok = batch-1 time per decode token; x limit = ms/tok over the limit below (uncompressed records); "
        "x own = ms/tok over the same limit computed for the system's own record sizes and slot count (a compressed "
        "format, lossless included, lowers the bytes any cache must move).",
    ]
    for m in result["models"].values():
        out += ["", f"## {m['label']}", "", facts_line(m), ""]
        out += [f"- {line}" for line in ([] if result["args"].get("smoke") else limit_lines(m))]
        out += ["", render_table(m.get("rows", [])), "", "Set-up and memory:", "", render_table(m.get("rows", []), cost=True)]
        notes = row_notes(m.get("rows", [])) + m.get("notes", [])
        if notes:
            out += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    if result.get("comparisons"):
        out += ["", f"## Comparisons (Mixtral-8x7B shape, 8 layers, budget {COMPARE_BUDGET:.0%})", ""]
        out += [f"- {format_comparison(c)}" for c in result["comparisons"]]
    if result.get("skipped"):
        out += ["", "## Skipped", ""] + [f"- {n}" for n in result["skipped"]]
    return "\n".join(out) + "\n"


def render_plot(result: dict, path: str) -> str | None:
    """PNG: per workload, tokens/s per system (batch 1, batch 8, beam) and batch-1 time per token split
    into compute and stall, with the limit. Returns None, or why no plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); rerun with --from-json on this JSON to plot"
    models = [m for m in result["models"].values() if any(r["status"] in ("ok", "partial") for r in m.get("rows", []))]
    if not models:
        return "nothing measured"
    fig, axes = plt.subplots(len(models), 2, figsize=(15, 4.2 * len(models)), squeeze=False)
    order = {s: i for i, s in enumerate(SYSTEMS)}
    for m, (ax_tps, ax_ms) in zip(models, axes):
        rows = sorted(
            (r for r in m["rows"] if r["status"] in ("ok", "partial")),
            key=lambda r: (r["budget"] or 0, order.get(r["system"], len(order))),
        )
        names = [r["system"] + ("" if r["budget"] is None else f"\n{r['budget']:.0%}") for r in rows]
        x = list(range(len(rows)))
        width = 0.27
        for j, (metric, label) in enumerate(
            (("decode_tok_s_b1", "decode, batch 1"), ("decode_tok_s_b8", "decode, batch 8"), ("beam_tok_s", "beam 4"))
        ):
            vals = [r.get(metric) or 0 for r in rows]
            ax_tps.bar([i + (j - 1) * width for i in x], vals, width, label=label)
        ax_tps.set_yscale("log")
        ax_tps.set_xticks(x, names, fontsize=8)
        ax_tps.set_ylabel("tokens / s (log)")
        ax_tps.set_title(f"{m['label']}: throughput", fontsize=10)
        ax_tps.legend(fontsize=8)
        # time per token at batch 1: compute + stall (mira), whole bar for systems without a split
        ms = [1e3 * (r["time_per_token_s"] or 0) for r in rows]
        stall = [1e3 * min(r.get("stall_s_per_token") or 0, r["time_per_token_s"] or 0) for r in rows]
        compute = [t - st for t, st in zip(ms, stall)]
        split = [r["system"] != "accelerate" for r in rows]  # resident: all compute; accelerate: transfers inside
        ax_ms.bar(x, [c if s else 0 for c, s in zip(compute, split)], 0.6, label="compute", color="tab:blue")
        ax_ms.bar(
            x,
            [st if s else 0 for st, s in zip(stall, split)],
            0.6,
            bottom=compute,
            label="stall (waiting for experts)",
            color="tab:red",
        )
        ax_ms.bar(
            x,
            [t if not s else 0 for t, s in zip(ms, split)],
            0.6,
            label="accelerate (offload transfers not split out)",
            color="tab:gray",
        )
        cap = max([t for t, r in zip(ms, rows) if r["system"] != "accelerate"] or [max(ms or [1])]) * 1.6 or 1
        for i, t in enumerate(ms):
            if t > cap:
                ax_ms.text(i, cap * 0.97, f"{t:.0f} ms ↑", ha="center", va="top", fontsize=8)
        for i, r in enumerate(rows):
            lim = m.get("limits", {}).get(str(r["budget"] if r["budget"] is not None else COMPARE_BUDGET))
            if lim is None and m.get("limits"):
                lim = next(iter(m["limits"].values()))
            if lim:
                ax_ms.plot([i - 0.35, i + 0.35], [1e3 * lim["limit_s"]] * 2, "k--", lw=1, label="limit" if i == 0 else None)
        ax_ms.set_ylim(0, cap)
        ax_ms.set_xticks(x, names, fontsize=8)
        ax_ms.set_ylabel("ms per token, batch 1")
        ax_ms.set_title(f"{m['label']}: time per decode token", fontsize=10)
        ax_ms.legend(fontsize=8)
    fig.suptitle(f"mira-hf benchmark, {result['env'].get('device')}, {result['env'].get('date')}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_outputs(result: dict, stem: str, plot: bool = False) -> None:
    """JSON first (the record); the Markdown and the plot are derived from it, and a failure in either
    is noted in the JSON rather than ending the run (--from-json renders them again)."""
    write_json(stem + ".json", result)
    renders = [("md", lambda: _write_text(stem + ".md", render_markdown(result)))]
    if plot:
        renders.append(
            ("plot", lambda: result.__setitem__("plot", render_plot(result, stem + ".png") or os.path.basename(stem + ".png")))
        )
    for name, render in renders:
        try:
            render()
            result.get("output_errors", {}).pop(name, None)
        except Exception as exc:
            result.setdefault("output_errors", {})[name] = f"{type(exc).__name__}: {exc}"
            log(f"could not write the {name}: {exc}")
    write_json(stem + ".json", result)


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def print_summary(result: dict, stem: str) -> None:
    print("\n" + "=" * 100, flush=True)
    bw = result.get("bandwidth", {})
    print(
        f"{result['env'].get('device')}  pinned H2D {bw.get('h2d_gbps', 0):.1f} GB/s, device memory {bw.get('device_gbps', 0):.0f} GB/s, "
        f"run {result.get('elapsed_s', 0):.0f} s",
        flush=True,
    )
    for m in result["models"].values():
        print(f"\n## {m['label']}\n{facts_line(m)}", flush=True)
        for line in [] if result["args"].get("smoke") else limit_lines(m):
            print("  " + line, flush=True)
        if m.get("rows"):
            print(render_table(m["rows"]), flush=True)
            print(render_table(m["rows"], cost=True), flush=True)
        for n in row_notes(m.get("rows", [])) + m.get("notes", []):
            print("  - " + n, flush=True)
    if result.get("skipped"):
        print("\nskipped: " + "; ".join(result["skipped"]), flush=True)
    if result.get("comparisons"):
        print(f"\ncomparisons (Mixtral 8 layers, budget {COMPARE_BUDGET:.0%}):", flush=True)
        for c in result["comparisons"]:
            print("  " + format_comparison(c), flush=True)
    print(
        f"\nwrote {stem}.json, {stem}.md"
        + (f", {stem}.png" if result.get("plot", "").endswith(".png") else f" (no plot: {result.get('plot')})"),
        flush=True,
    )


def one_line(row: dict) -> str:
    parts = [
        ("TTFT", row["ttft_s"], "{:.3g} s"),
        ("b1", row["decode_tok_s_b1"], "{:.3g} tok/s"),
        ("b8", row["decode_tok_s_b8"], "{:.3g} tok/s"),
        ("beam", row["beam_tok_s"], "{:.3g} tok/s"),
        ("peak", row["peak_gpu_gb"], "{:.2f} GB"),
        ("hit", row["hit_rate"], "{:.0%}"),
        ("stall", row["stall_share"], "{:.0%}"),
    ]
    return ", ".join(f"{name} {fmt.format(v)}" for name, v, fmt in parts if v is not None)
