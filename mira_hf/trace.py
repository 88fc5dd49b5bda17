"""Routing traces: which experts a model routed to, token by token, for offline evaluation.

A trace is recorded once from a wrapped model (`record_trace`) and replayed many times through the
cache, policies and predictors (`mira_hf.replay`) without running the model again. Recording is
decode-like: one token per forward per sequence, with the KV cache, so each step is one block call
per MoE layer, exactly what the expert cache sees while generating. `record_topk` records only the
chosen experts of a corpus, one full-sequence forward per chunk (what `mira calibrate` writes).

Files are safetensors (tensors) plus a JSON sidecar (everything else); never pickle.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .errors import ConfigError, IncompatibleFileError, UnsupportedModelError, require_decoder_only

TRACE_FORMAT = "mira-routing-trace/1"


@dataclass
class RoutingTrace:
    """Routed experts of one token per step, for every MoE layer.

    experts: LongTensor [steps, L, K], expert indices of each (step, MoE layer), in router order
        (-1 pads layers that route fewer than K experts).
    hidden: Tensor [steps, L, H] (fp16), the experts' input of each (step, layer), i.e. what the
        router saw; predictors that apply routers (gate, global, learned) need it.
    sequence_starts: step index where each sequence begins (its first token; ascending, starts at 0).
    num_experts: experts per MoE layer.
    record_bytes: bytes of one expert record per MoE layer (what one miss moves at runtime).
    fingerprint: `model.mira.fingerprint` of the recorded model ({} for synthetic traces).
    """

    experts: torch.Tensor
    hidden: torch.Tensor | None
    sequence_starts: list[int]
    num_experts: list[int]
    record_bytes: list[int]
    fingerprint: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.experts.dim() != 3:
            raise ConfigError(f"RoutingTrace.experts must be [steps, L, K], got shape {tuple(self.experts.shape)}.")
        steps, L, _ = self.experts.shape
        if self.hidden is not None and tuple(self.hidden.shape[:2]) != (steps, L):
            raise ConfigError(f"RoutingTrace.hidden must be [steps={steps}, L={L}, H], got {tuple(self.hidden.shape)}.")
        if len(self.num_experts) != L or len(self.record_bytes) != L:
            raise ConfigError(f"RoutingTrace: num_experts and record_bytes need one entry per MoE layer ({L}).")
        starts = list(self.sequence_starts)
        if steps and (not starts or starts[0] != 0 or starts != sorted(set(starts)) or starts[-1] >= steps):
            raise ConfigError(f"RoutingTrace.sequence_starts={starts[:8]}...: must be ascending step indices starting at 0.")

    @property
    def steps(self) -> int:
        return self.experts.shape[0]

    @property
    def num_layers(self) -> int:
        return self.experts.shape[1]

    @property
    def top_k(self) -> int:
        return self.experts.shape[2]

    @property
    def expert_bytes(self) -> int:
        """Bytes of every routed expert of the model (what a budget fraction is a fraction of)."""
        return sum(e * b for e, b in zip(self.num_experts, self.record_bytes))

    def sequences(self) -> list[tuple[int, int]]:
        """(start, end) step ranges of each sequence."""
        ends = [*self.sequence_starts[1:], self.steps]
        return list(zip(self.sequence_starts, ends))

    def save(self, path: str | os.PathLike) -> None:
        """Write `<path>.safetensors` (experts, hidden, sequence_starts) and `<path>.json` (the rest).
        A `path` ending in `.safetensors` is used as is."""
        from safetensors.torch import save_file

        tensors_path, meta_path = trace_files(path)
        tensors = {
            "experts": self.experts.to(torch.int32).contiguous(),  # expert indices fit easily; half the bytes
            "sequence_starts": torch.tensor(self.sequence_starts, dtype=torch.int64),
        }
        if self.hidden is not None:
            tensors["hidden"] = self.hidden.contiguous()
        os.makedirs(os.path.dirname(tensors_path) or ".", exist_ok=True)
        save_file(tensors, tensors_path, metadata={"format": TRACE_FORMAT})
        meta = dict(
            format=TRACE_FORMAT,
            steps=self.steps,
            num_experts=list(self.num_experts),
            record_bytes=list(self.record_bytes),
            fingerprint=self.fingerprint,
        )
        with open(meta_path, "w") as f:
            json.dump(meta, f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike, fingerprint: dict | None = None) -> RoutingTrace:
        """Read a trace written by `save`. With `fingerprint` (e.g. `model.mira.fingerprint`), a trace
        recorded from another model raises `IncompatibleFileError`."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        tensors_path, meta_path = trace_files(path)
        try:
            with open(meta_path) as f:
                meta = json.load(f)
            tensors = load_file(tensors_path)
        except (OSError, json.JSONDecodeError, SafetensorError) as exc:
            raise IncompatibleFileError(f"cannot read a routing trace from {tensors_path} + {meta_path}: {exc}") from exc
        if meta.get("format") != TRACE_FORMAT or "experts" not in tensors:
            raise IncompatibleFileError(
                f"{meta_path} is not a routing trace of format {TRACE_FORMAT!r} (format={meta.get('format')!r})."
            )
        missing = [k for k in ("num_experts", "record_bytes") if k not in meta] + [
            k for k in ("sequence_starts",) if k not in tensors
        ]
        if missing:
            raise IncompatibleFileError(
                f"the routing trace {tensors_path} + {meta_path} lacks {', '.join(missing)}: the files were cut short "
                "or edited. Record it again with mira_hf.trace.record_trace(model, input_ids)."
            )
        if fingerprint is not None and meta.get("fingerprint") != fingerprint:
            raise IncompatibleFileError(
                f"the routing trace {tensors_path} was recorded from another model.\n"
                f"  trace fingerprint: {meta.get('fingerprint')}\n  model fingerprint: {fingerprint}\n"
                "Record a new trace with mira_hf.trace.record_trace(model, input_ids)."
            )
        return cls(
            tensors["experts"].long(),
            tensors.get("hidden"),
            tensors["sequence_starts"].tolist(),
            meta["num_experts"],
            meta["record_bytes"],
            meta.get("fingerprint", {}),
        )


def trace_files(path: str | os.PathLike) -> tuple[str, str]:
    """The two files of the routing trace `path` names (its .safetensors, its .json, or the name without either)."""
    base = os.fspath(path)
    for suffix in (".safetensors", ".json"):  # either of the two files names the trace
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return base + ".safetensors", base + ".json"


def record_trace(model, input_ids: torch.Tensor, progress: bool = True) -> RoutingTrace:
    """Decode `input_ids [B, S]` one token per forward (teacher forcing, with the KV cache) through a
    wrapped model and record every MoE layer's routing. Returns a trace of B·S steps, sequence b's
    steps being `b·S .. b·S+S-1`.

    The B sequences run as one batch (B tokens per forward, one per sequence): each sequence still
    sees one new token per step, and recording takes S forwards instead of B·S. Routing is read from
    the manager's `recorder` hook (the router's own top-k), restored afterwards.
    """
    from transformers import DynamicCache

    manager = getattr(model, "mira", None)
    if manager is None:
        raise ConfigError("record_trace needs a wrapped model (MiraMoEModel.from_pretrained or MiraMoEModel.wrap).")
    require_decoder_only(model, "record_trace")
    if input_ids.dim() != 2:
        raise ConfigError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}.")
    B, S = input_ids.shape
    layers = sorted(manager.layers)
    L = len(layers)
    K = max(li.top_k for li in manager.layers.values())
    experts = torch.full((S, L, B, K), -1, dtype=torch.long)  # filled per step, reordered to [B*S, L, K] at the end
    hidden = None
    step = 0
    seen = set()

    def recorder(layer: int, h: torch.Tensor, top_k_index: torch.Tensor) -> None:
        nonlocal hidden
        # h [B, H], top_k_index [B, K]: one new token per sequence
        if layer in seen:
            raise UnsupportedModelError(looped(layer))
        if top_k_index.shape[0] != B:
            raise UnsupportedModelError(
                f"MoE layer {layer} routed {top_k_index.shape[0]} rows for the {B} new tokens of a step: this model "
                "does not compute one row per new token (a diffusion model's canvas), and a routing trace records one "
                "routing per layer and token, so it cannot record this model. Serving it is unaffected."
            )
        if hidden is None:
            hidden = torch.zeros((S, L, B, h.shape[-1]), dtype=torch.float16)
        experts[step, layer, :, : top_k_index.shape[1]] = top_k_index.detach().cpu()
        hidden[step, layer] = h.detach().to("cpu", torch.float16)
        seen.add(layer)

    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = input_ids.to(model.device, torch.long)
    with _recording(model, recorder):
        cache = DynamicCache(config=model.config)
        steps = range(S)
        if progress:
            from tqdm.auto import tqdm

            steps = tqdm(steps, desc="recording routing", unit="token")
        with torch.inference_mode():
            for step in steps:
                seen.clear()
                model(input_ids=ids[:, step : step + 1], **{cache_kw: cache}, use_cache=True)
                if len(seen) != L:
                    raise UnsupportedModelError(
                        f"step {step}: only MoE layers {sorted(seen)} of {layers} routed the new tokens; a trace needs "
                        "every MoE layer to route every token (top-k routing)."
                    )
    experts = experts.permute(2, 0, 1, 3).reshape(B * S, L, K)  # sequence-major: step b*S + t
    if hidden is not None:
        hidden = hidden.permute(2, 0, 1, 3).reshape(B * S, L, -1)
    return RoutingTrace(
        experts,
        hidden,
        [b * S for b in range(B)],
        [manager.layers[li].num_experts for li in layers],
        [manager.store.record_bytes(li) for li in layers],
        dict(manager.fingerprint),
    )


def record_topk(model, chunks: Sequence[torch.Tensor], progress: bool = True) -> dict[int, torch.Tensor]:
    """Teacher-forced routing of token `chunks` (1-D id tensors) through a wrapped model: per MoE layer, the
    experts its router chose for every token, `[N, K]` on the CPU, N being all chunks' tokens in order.

    Unlike `record_trace`, one full-sequence forward per chunk (no KV cache) and no hidden states: a corpus of
    thousands of tokens routes in a few forwards. The top-k is the router's own, read from the same hook.
    """
    manager = getattr(model, "mira", None)
    if manager is None:
        raise ConfigError("record_topk needs a wrapped model (MiraMoEModel.from_pretrained or MiraMoEModel.wrap).")
    require_decoder_only(model, "record_topk")
    parts: dict[int, list[torch.Tensor]] = {}

    def recorder(layer: int, h: torch.Tensor, top_k_index: torch.Tensor) -> None:
        parts.setdefault(layer, []).append(top_k_index.detach().cpu())  # [T, K]

    total = sum(len(c) for c in chunks)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="routing", unit="tok")
    try:
        with _recording(model, recorder), torch.inference_mode():
            for chunk in chunks:
                model(input_ids=chunk[None].to(model.device, torch.long), use_cache=False)
                if bar is not None:
                    bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    topk = {layer: torch.cat(p) for layer, p in sorted(parts.items())}
    require_every_layer_routed(manager.layers, {layer: t.shape[0] for layer, t in topk.items()}, total)
    return topk


def require_every_layer_routed(layers, routed: dict[int, int], total: int) -> None:
    """`UnsupportedModelError` unless every MoE layer in `layers` routed all `total` tokens (`routed`: layer -> rows it
    routed): a layer that only some tokens reach (a vision-language model's image experts on text) has no routing
    for the others, and a trace or predictor needs every layer's for every token."""
    more = sorted(layer for layer in layers if routed.get(layer, 0) > total)
    if more:
        raise UnsupportedModelError(looped(more[0], f"{routed[more[0]]} rows for the {total} tokens given"))
    short = sorted(layer for layer in layers if routed.get(layer, 0) < total)
    if short:
        raise UnsupportedModelError(
            f"MoE layers {short} of {sorted(layers)} routed fewer than the {total} tokens given; recording "
            "needs every MoE layer to route every token (top-k routing)."
        )


def looped(layer: int, what: str = "twice in one forward step") -> str:
    """The message for a model that runs an MoE layer more than once per token (a looped decoder, or experts modules
    tied to another block's, which one layer serves: `targets._twin_of`)."""
    return (
        f"MoE layer {layer} routed {what}: this model runs some of its layers more than once per token (looped "
        "layers, or experts tied across blocks, which one layer serves), and a routing trace or a calibration records "
        "one routing per layer and token, so it cannot record this model. Serving it is unaffected."
    )


@contextmanager
def _recording(model, recorder: Callable[[int, torch.Tensor, torch.Tensor], None]) -> Iterator[None]:
    """Route through `recorder(layer, hidden [T, H], top_k_index [T, K])` with the model in eval mode (no router
    jitter or dropout: the routing a deployed model does); the manager's recorder and the model's mode come back after."""
    manager = model.mira
    previous, training = manager.recorder, model.training
    manager.recorder = recorder
    model.eval()
    try:
        yield
    finally:
        manager.recorder = previous
        model.train(training)
