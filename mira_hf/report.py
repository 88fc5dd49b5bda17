"""Views of what the expert cache did: a pandas table, matplotlib figures and plain-text summaries.

`heat_table`, `plot_heatmap` and `plot_hit_rate` back `model.mira.heat_table()` & co. in notebooks;
`stats_table`, `format_run` and `summarize_file` are the text the `mira` CLI prints. pandas and
matplotlib are optional (`pip install "mira-hf[notebook]"`) and imported only when a table or a figure
is asked for; the text functions need nothing beyond the standard library.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from .budget import expert_keys
from .errors import ConfigError, IncompatibleFileError, MissingDependencyError

NOTEBOOK_EXTRA = "notebook"
HEAT_TABLE_COLUMNS = ("layer", "expert", "score", "count", "share", "tier", "is_hot")
STATS_FORMAT = "mira-stats"  # the `format` field of the JSON that `mira generate --stats-out` writes


def optional_import(module: str, extra: str, feature: str):
    """Import an optional dependency, or raise `MissingDependencyError` with the pip command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # only a missing package becomes the install hint; other errors propagate
        package = module.split(".")[0]
        raise MissingDependencyError(
            f'{feature} needs {package}, which is not installed: pip install "mira-hf[{extra}]" (or pip install {package}).'
        ) from exc


# -- notebook views ---------------------------------------------------------------------------------
class NotebookViews:
    """What `model.mira` shows (mixed into `ExpertManager`, whose stages it reads under its lock): the
    counters (`stats`), where an expert is (`tier_of`), counts, scores, history, and the table and
    figures below."""

    def stats(self) -> dict:
        """Counters so far: hits, misses, hit_rate, loads, evictions, bytes_h2d, stall_s, per_layer, ..."""
        with self._lock:
            self._settle()
            stalls = self.loader.stalls()
            for layer, s in stalls.items():
                self.telemetry.layer(layer).stall_s = s
            out = self.telemetry.summary()
            lat = sorted(self.loader.latencies())
            out.update(
                load_latency_p50_s=lat[len(lat) // 2] if lat else None,  # one copy, from issue to ready
                load_latency_p95_s=lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else None,
                budget_bytes=self.budget.budget_bytes,
                capacity_bytes=self.cache.capacity_bytes,
                buffer_bytes=self.arena.buffer_bytes,
                resident_bytes=self.cache.resident_bytes + self.arena.kept_bytes,  # in slots, and kept packed beside them
                slots=sum(p.n_slots for p in self.cache.pools.values()),
                device=str(self.device),
                quantization=self.quantization,
                placement=self.placement,
                host_only_experts=len(self.host_only),
                kept_packed_experts=len(self.kept),  # placement "mixed": held packed beside the slots, decoded at each use
                kept_packed_bytes=self.arena.kept_bytes,
                host_part_bytes=self.host.parts.nbytes() if self.host.parts is not None else 0,  # host_compute="split"
                host_costs=self.host.measured(),  # host compute: what its planner measured (None while inactive)
                prediction_active=self.staging.predicting,  # the predictor runs now (False without one, or paused by the payoff gate)
                prediction_paused_steps=self.staging.gate.paused_steps,
            )
            return out

    def tier_of(self, layer: int, expert: int) -> str | None:
        """ "hot" (on the device and used since its copy), "stage" (on the device or in flight, copied ahead of
        its use and not used yet) or None (not on the device). The same labels as `stats()`' `hot_hits` and
        `stage_hits`; the cache's eviction groups (`ExpertCache`) are its own business. An expert kept packed beside
        the cache (placement "mixed") is "hot" until `unload()`, after which no expert is on the device. An expert
        the model does not have is a `ConfigError`."""
        ((layer, expert),) = expert_keys(self.layers, {layer: [expert]}, "tier_of", "a layer ordinal and an expert index")
        if self.closed:  # unloaded: no slot is left
            return None
        slot = self.cache.lookup((layer, expert))
        if slot is None:
            return "hot" if (layer, expert) in self.kept else None
        return "hot" if slot.used_since_load else "stage"

    def expert_counts(self) -> dict[int, list[int]]:
        """Activations per expert of each MoE layer since load (or `heat.reset()`)."""
        return {layer: c.tolist() for layer, c in self.heat.counts.items()}

    def heat_scores(self) -> dict[int, list[float]]:
        """Current heat score of each expert of each MoE layer, in [0, 1]."""
        return {layer: s.tolist() for layer, s in self.heat.scores.items()}

    def hit_rate_history(self) -> list[float]:
        """Hit rate of each forward step so far (bounded: the latest 4096 steps)."""
        return list(self.telemetry.hit_rate_history)

    def heat_table(self):
        """pandas DataFrame, one row per (layer, expert): heat score, activation count, resident tier."""
        return heat_table(self)

    def plot_heatmap(self, value: str = "score"):
        """matplotlib Figure: layer × expert heat map of `value` ("score" or "count")."""
        return plot_heatmap(self, value=value)

    def plot_hit_rate(self):
        """matplotlib Figure: hit rate per forward step."""
        return plot_hit_rate(self)


def heat_table(manager):
    """pandas DataFrame, one row per (layer, expert), in layer then expert order.

    Columns: `layer` and `expert` (ints), `score` (heat in [0, 1]), `count` (activations since load),
    `share` (count / the layer's total, 0 for a layer never run), `tier` ("hot": on the device and used since
    its copy; "stage": copied ahead of its use, not used yet; "" when not on the device; `tier_of`) and
    `is_hot` (`tier == "hot"`: never true for an expert that is not on the device).
    """
    pd = optional_import("pandas", NOTEBOOK_EXTRA, "heat_table()")
    counts = manager.expert_counts()
    scores = manager.heat_scores()
    rows = []
    for layer in sorted(counts):
        total = sum(counts[layer])
        for expert, (count, score) in enumerate(zip(counts[layer], scores[layer])):
            share = count / total if total else 0.0
            tier = manager.tier_of(layer, expert) or ""
            rows.append((layer, expert, score, count, share, tier, tier == "hot"))
    table = pd.DataFrame(rows, columns=list(HEAT_TABLE_COLUMNS))
    return table.astype(
        {"layer": "int64", "expert": "int64", "score": "float64", "count": "int64", "share": "float64", "is_hot": "bool"}
    )


def plot_heatmap(manager, value: str = "score"):
    """matplotlib Figure: a layer × expert grid of heat `value` ("score" or "count"), resident experts marked."""
    if value not in ("score", "count"):
        raise ConfigError(f'value={value!r}: plot_heatmap shows "score" (heat in [0, 1]) or "count" (activations).')
    Figure = optional_import("matplotlib.figure", NOTEBOOK_EXTRA, "plot_heatmap()").Figure
    import numpy as np  # a dependency of matplotlib

    data = manager.heat_scores() if value == "score" else manager.expert_counts()
    layers = sorted(data)
    width = max(len(data[layer]) for layer in layers)
    grid = np.full((len(layers), width), np.nan)  # layers with fewer experts keep NaN (blank) cells
    for row, layer in enumerate(layers):
        grid[row, : len(data[layer])] = data[layer]

    fig = Figure(
        figsize=(min(max(4.0, 0.35 * width + 2.0), 14.0), min(max(2.6, 0.4 * len(layers) + 1.4), 10.0)), layout="constrained"
    )
    ax = fig.add_subplot()
    limits = dict(vmin=0.0, vmax=1.0) if value == "score" else {}
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma", **limits)
    label = "heat score" if value == "score" else "activations"
    fig.colorbar(image, ax=ax, label=label)
    for tier, marker in (("hot", "o"), ("stage", "s")):  # white with a black edge: visible on dark and light cells
        xs, ys = [], []
        for row, layer in enumerate(layers):
            for expert in range(len(data[layer])):
                if manager.tier_of(layer, expert) == tier:
                    xs.append(expert)
                    ys.append(row)
        if xs:
            ax.scatter(
                xs, ys, s=24, marker=marker, facecolors="white", edgecolors="black", linewidths=0.8, label=f"on device ({tier})"
            )
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(0.0, -0.18), ncols=2, fontsize="small", frameon=False)
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    if width <= 32:
        ax.set_xticks(range(width))
    title = "Expert heat score" if value == "score" else "Expert activations"
    ax.set_title(title)
    return fig


def plot_hit_rate(manager):
    """matplotlib Figure: the cache hit rate of each forward step (prefill is step 0), with a running mean."""
    Figure = optional_import("matplotlib.figure", NOTEBOOK_EXTRA, "plot_hit_rate()").Figure
    history = manager.hit_rate_history()
    overall = manager.stats()["hit_rate"]
    fig = Figure(figsize=(7.0, 3.2), layout="constrained")
    ax = fig.add_subplot()
    if history:
        steps = range(len(history))
        ax.plot(steps, history, lw=1.0, alpha=0.55, label="per step")
        window = min(16, len(history))
        running = [sum(history[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in steps]
        ax.plot(steps, running, lw=2.0, label=f"mean of last {window}")
        ax.axhline(overall, color="grey", ls="--", lw=1.0, label=f"overall {overall:.1%}")
        ax.legend(loc="lower right", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no forward step has finished yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("forward step")
    ax.set_ylabel("hit rate")
    ax.set_title("Expert cache hit rate")
    return fig


# -- text -------------------------------------------------------------------------------------------
def format_bytes(n: float | None) -> str:
    """`1536` -> `1.5 KiB` (binary units, as budgets are usually written)."""
    if n is None:
        return "-"
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def format_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def aligned_rows(pairs: Sequence[tuple[str, str]]) -> list[str]:
    """`[("hit rate", "83.5%"), ...]` -> lines with the labels padded to one width."""
    width = max((len(k) for k, _ in pairs), default=0)
    return [f"{k:<{width}}  {v}" for k, v in pairs]


def _columns(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    return ["  ".join(f"{c:>{w}}" for c, w in zip(line, widths)).rstrip() for line in (header, *rows)]


def _layer_key(layer: Any):
    """Layers are ints in memory and strings once written to JSON: sort both numerically."""
    try:
        return (0, int(layer))
    except (TypeError, ValueError):
        return (1, str(layer))


def stats_table(stats: Mapping[str, Any], extra: Sequence[tuple[str, str]] = ()) -> str:
    """A compact text table of `model.mira.stats()` (or the same dict read back from JSON): totals, then one
    row per MoE layer. `extra` (label, text) rows are printed first. Missing keys print as "-"."""

    def g(key: str, default: Any = "-") -> Any:
        value = stats.get(key)
        return default if value is None else value

    uses = g("hits", 0) + g("misses", 0)
    hit_rate = f"{_pct(stats.get('hit_rate'))}  ({g('hits')} of {uses} expert uses; {g('hot_hits')} reused, {g('stage_hits')} prefetched)"
    copies = f"{g('loads')}  ({g('prefetches', 0)} prefetched: {g('prefetch_used', 0)} used, {g('prefetch_wasted', 0)} wasted)"
    pairs = [
        *extra,
        ("hit rate", hit_rate),
        ("misses", str(g("misses"))),
        ("copies", copies),
        ("evictions", str(g("evictions"))),
        ("bytes moved", f"{format_bytes(stats.get('bytes_h2d'))} host → device"),
        ("stall", format_seconds(stats.get("stall_s"))),
        ("forward steps", str(g("steps"))),
    ]
    if stats.get("predictor_precision") is not None or stats.get("predictor_recall") is not None:
        precision, recall = _pct(stats.get("predictor_precision")), _pct(stats.get("predictor_recall"))
        text = f"precision {precision}, recall {recall}"
        if stats.get("prediction_paused_steps"):  # the payoff gate: prediction cost more host time than it saved
            state = "paused now" if stats.get("prediction_active") is False else "running now"
            text += f"; paused {stats['prediction_paused_steps']} steps (it cost more host time than the stalls it could remove; {state})"
        pairs.append(("predictor", text))
    costs = stats.get("host_costs")
    if costs and costs.get("host_s_one_row") is not None and costs.get("copy_s") is not None:
        pairs.append(("host compute", _host_costs_text(costs)))
    if stats.get("capacity_bytes") is not None:
        cache = f"{format_bytes(stats['capacity_bytes'])} in {g('slots')} slots on {g('device')}"
        pairs.append(("expert cache", f"{cache} (budget {format_bytes(stats.get('budget_bytes'))})"))
    lines = aligned_rows(pairs)
    per_layer = g("per_layer") or {}
    if per_layer:
        header = ("layer", "hit rate", "hits", "misses", "copies", "evictions", "moved", "stall")
        rows = [_layer_row(layer, s) for layer, s in sorted(per_layer.items(), key=lambda kv: _layer_key(kv[0]))]
        lines += ["", *_columns(header, rows)]
    return "\n".join(lines)


def _host_costs_text(costs: Mapping[str, Any]) -> str:
    """One line of what the host-compute planner measured: a unit's time on the host and over the link."""
    host, copy = costs["host_s_one_row"], costs["copy_s"]
    link = costs.get("link_bytes_per_s")
    speed = f" at {link / 1e9:.1f} GB/s" if link else ""
    unit = costs.get("unit", "unit")
    article = "an" if unit[:1] in "aeiou" else "a"
    four = costs.get("host_s_four_rows")
    at_four = f" ({four * 1e3:.3g} at four)" if four is not None else ""
    text = f"{article} {unit} takes {host * 1e3:.3g} ms on the host at one row{at_four}, {copy * 1e3:.3g} ms to copy{speed}"
    return text + ("" if host <= copy else " (the host is the slower path here)")


def _layer_row(layer: Any, s: Mapping[str, Any]) -> tuple[str, ...]:
    counters = (str(s.get(k, "-")) for k in ("hits", "misses", "loads", "evictions"))
    return (str(layer), _pct(s.get("hit_rate")), *counters, format_bytes(s.get("bytes_h2d")), format_seconds(s.get("stall_s")))


def run_record(model_name: str, config: Mapping[str, Any], generation: Mapping[str, Any], manager) -> dict:
    """What `mira generate --stats-out` saves: the settings, the generation's timing and the cache's counters."""
    return {
        "format": STATS_FORMAT,
        "version": 1,
        "model": model_name,
        "config": dict(config),
        "generation": dict(generation),
        "stats": manager.stats(),
        "hit_rate_history": manager.hit_rate_history(),
        "expert_counts": manager.expert_counts(),
    }


def format_run(record: Mapping[str, Any]) -> str:
    """The text `mira generate` prints after a run (and `mira stats` prints for its saved JSON)."""
    gen, cfg, stats = record.get("generation", {}), record.get("config", {}), record.get("stats", {})
    extra = [("model", str(record.get("model", "-")))]
    if cfg:
        extra.append(("settings", ", ".join(f"{k}={v}" for k, v in cfg.items() if v is not None)))
    if gen:
        tps, decode, peak = gen.get("tokens_per_s"), gen.get("decode_tokens_per_s"), gen.get("peak_gpu_bytes")
        tokens = f"{gen.get('new_tokens', '-')} new after {gen.get('prompt_tokens', '-')} prompt tokens"
        if decode is not None:
            rate = f"{decode:.1f} decoding ({tps:.1f} overall; first token after {format_seconds(gen.get('first_token_s'))})"
        else:
            rate = "-" if tps is None else f"{tps:.1f} (prefill included)"
        extra += [
            ("tokens", f"{tokens} in {format_seconds(gen.get('seconds'))}"),
            ("tokens/s", rate),
            ("peak GPU memory", format_bytes(peak) if peak is not None else f"n/a ({stats.get('device', 'cpu')})"),
        ]
    return stats_table(stats, extra)


def summarize_file(path: str | os.PathLike) -> str:
    """Text summary of a stats JSON (from `mira generate --stats-out`, or `json.dump(model.mira.stats())`) or of
    a routing-trace JSON (any object with "layers" and/or "steps" keys). Raises `FileNotFoundError` or
    `IncompatibleFileError` (naming the formats it reads) for anything else."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file (expected a stats or routing-trace JSON file).")
    expected = (
        f'a JSON object: a stats file from `mira generate --stats-out` (format "{STATS_FORMAT}"), a dict saved from '
        'model.mira.stats(), or a routing trace with "layers"/"steps" keys'
    )
    if os.path.isdir(path):
        raise IncompatibleFileError(f"{path} is a directory; expected {expected}.")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IncompatibleFileError(f"{path} is not JSON ({exc}); expected {expected}.") from None
    if isinstance(data, dict):
        if data.get("format") == STATS_FORMAT and not isinstance(data.get("stats"), dict):
            raise IncompatibleFileError(
                f'{path} says format "{STATS_FORMAT}" but holds no "stats" object: it is cut short or edited; write it again with `mira generate --stats-out`.'
            )
        kind = None
        if isinstance(data.get("stats"), dict):
            kind, summary = "a stats file", format_run
        elif "hit_rate" in data and "per_layer" in data:
            kind, summary = "a saved model.mira.stats()", stats_table
        elif "layers" in data or "steps" in data:
            kind, summary = "a routing-trace summary", _trace_summary
        if kind is not None:
            try:
                return summary(data)
            except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:  # a field of another type
                raise IncompatibleFileError(
                    f"{path} reads as {kind}, but a field holds something else ({type(exc).__name__}: {exc}): it is "
                    "cut short or edited. Write it again."
                ) from None
    shape = type(data).__name__ if not isinstance(data, dict) else f"keys {sorted(data)[:8]}"
    raise IncompatibleFileError(f"{path}: unrecognised content ({shape}); expected {expected}.")


def _short(value: Any) -> str | None:
    """A scalar, or a list of scalars (shortened), as text; None for anything nested."""
    if isinstance(value, (str, int, float, bool)):
        return str(value)
    if isinstance(value, list) and all(isinstance(v, (str, int, float, bool)) for v in value):
        shown = ", ".join(str(v) for v in value[:8])
        return f"[{shown}{', ...' if len(value) > 8 else ''}] ({len(value)} values)"
    return None


def _trace_summary(data: Mapping[str, Any]) -> str:
    """Summary of a routing trace, tolerant of the layout: scalars at the top level are shown as they are;
    `steps` may be a count or a list; `layers` a count, a list or a dict of per-layer entries, each either a
    list of per-expert counts or a dict holding one under "counts"/"expert_counts"."""
    pairs = [(k, _short(v)) for k, v in data.items() if k not in ("layers", "steps") and _short(v) is not None][:12]
    steps, layers = data.get("steps"), data.get("layers")
    if steps is not None:
        pairs.append(("steps", str(len(steps)) if isinstance(steps, Sequence) and not isinstance(steps, str) else str(steps)))
    if isinstance(layers, Mapping):
        entries = sorted(layers.items(), key=lambda kv: _layer_key(kv[0]))
    elif isinstance(layers, Sequence) and not isinstance(layers, str):
        entries = list(enumerate(layers))
    else:
        entries = []
        if layers is not None:
            pairs.append(("layers", str(layers)))
    rows = []
    for layer, entry in entries:
        counts = entry.get("counts", entry.get("expert_counts")) if isinstance(entry, Mapping) else entry
        if not (isinstance(counts, Sequence) and counts and all(isinstance(c, (int, float)) for c in counts)):
            continue
        total = sum(counts)
        top = sorted(counts, reverse=True)[: max(1, math.ceil(len(counts) / 4))]
        busiest = sorted(range(len(counts)), key=lambda e: -counts[e])[:3]
        rows.append(
            (
                str(layer),
                f"{total:g}",
                f"{sum(c > 0 for c in counts)}/{len(counts)}",
                _pct(sum(top) / total if total else None),
                ", ".join(str(e) for e in busiest),
            )
        )
    if entries:
        pairs.append(("layers", str(len(entries))))
    lines = aligned_rows(pairs)
    if rows:
        header = ("layer", "uses", "experts used", "top-25% share", "busiest experts")
        lines += ["", *_columns(header, rows)]
    return "\n".join(lines)
