"""The `learned` predictor: one small network per MoE layer, trained on the model's own routing.

Layer L's network reads the hidden state entering L's MoE block and predicts, for each lookahead
distance d = 1..lookahead, which experts layer L+d will route that token to, and (the next-step head,
target L itself) which experts layer L will route the *next* token to. The within-step heads stage
copies; the next-step head ranks evictions across the step boundary (and the first layer's is copied
once a step's last layer has run: nothing within a step predicts it), which is where Belady's optimal
cache gets its advantage (benchmarks/NOTES.md, "Prediction"):

    hidden [T, H] -> standardise -> low-rank projection [T, r] -> Linear [T, w] -> GELU -> Linear [T, ΣE]

The last linear holds one head per distance (its outputs are the heads' logits side by side). Sizes
are chosen so that all networks together hold at most 1% of the model's parameters (`choose_sizes`).
`mira_hf.calibrate(model, data)` trains them; `save` writes safetensors + JSON (never pickle) and
`load` refuses a file made for another model before anything changes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .config import PredictorConfig
from .errors import ConfigError, IncompatibleFileError
from .predictors import token_union
from .registry import register_predictor

FORMAT = "mira-hf-learned-predictor"
VERSION = 1
WEIGHTS_FILE = "predictor.safetensors"
META_FILE = "predictor.json"

PARAMETER_SHARE = 0.01  # all predictor networks together ≤ 1% of the model's parameters
MAX_RANK = 64  # rank = min(64, what fits in the share)
MIN_RANK = 8  # floor for toy models, whose 1% would allow a rank of 1-2; there the floor wins over the share
WIDTH_PER_RANK = 2  # MLP width = 2 × rank


class LayerNet(nn.Module):
    """One MoE layer's predictor: hidden [T, H] -> logits [T, sum(out_sizes)], one head per distance."""

    def __init__(self, hidden_size: int, rank: int, width: int, out_sizes: Sequence[int]) -> None:
        super().__init__()
        self.out_sizes = list(out_sizes)
        # Standardisation measured on the calibration data: router inputs are RMS-normed and scaled per
        # channel, so a few channels would otherwise dominate the projection's gradients.
        self.register_buffer("shift", torch.zeros(hidden_size))
        self.register_buffer("scale", torch.ones(hidden_size))
        self.proj = nn.Linear(hidden_size, rank, bias=False)
        self.hidden = nn.Linear(rank, width)
        self.act = nn.GELU()
        self.out = nn.Linear(width, sum(self.out_sizes))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # T tokens, H hidden, r rank, w width, O = sum of the heads' experts
        x = (hidden.to(self.shift.dtype) - self.shift) * self.scale  # [T, H]
        return self.out(self.act(self.hidden(self.proj(x))))  # [T, r] -> [T, w] -> [T, O]


def net_parameters(hidden_size: int, rank: int, width: int, out_size: int) -> int:
    """Parameters (and standardisation buffers) of one `LayerNet`."""
    return 2 * hidden_size + hidden_size * rank + (rank + 1) * width + (width + 1) * out_size


def choose_sizes(hidden_size: int, out_sizes: Sequence[int], n_model: int | None) -> tuple[int, int]:
    """(rank, width) for networks with outputs `out_sizes` (one entry per source layer): the largest
    rank ≤ MAX_RANK whose networks fit in PARAMETER_SHARE of the model's `n_model` parameters, never
    below MIN_RANK. Unknown model size: MAX_RANK. (mira-tiny, 8.2M: rank 49, width 98, 0.98%.)"""
    if n_model is None:
        return MAX_RANK, WIDTH_PER_RANK * MAX_RANK
    budget = PARAMETER_SHARE * n_model
    rank = MAX_RANK
    while rank > MIN_RANK and sum(net_parameters(hidden_size, rank, WIDTH_PER_RANK * rank, o) for o in out_sizes) > budget:
        rank -= 1
    return rank, WIDTH_PER_RANK * rank


def model_parameters(model: nn.Module) -> int:
    """Parameters of a transformers model. A wrapped model's routed experts are among its parameters
    (views of the store, or placeholders for encoded records), so they are counted once, as unwrapped."""
    return sum(p.numel() for p in model.parameters())


class LearnedPredictor:
    """Predictor interface (`observe`, `predict`, `reset`) over trained `LayerNet`s.

    `nets[L]` reads layer L's block input; `targets[L]` lists the layers its heads predict (L+1, L+2, ...
    while they exist). Build one with `mira_hf.calibrate` or `LearnedPredictor.load`."""

    name = "learned"

    def __init__(
        self,
        nets: Mapping[int, LayerNet],
        targets: Mapping[int, Sequence[int]],
        *,
        hidden_size: int,
        rank: int,
        width: int,
        lookahead: int,
        config: PredictorConfig | None = None,
        summary: dict | None = None,
    ) -> None:
        self.nets = {int(L): net.eval() for L, net in nets.items()}
        self.targets = {int(L): list(t) for L, t in targets.items()}
        self.hidden_size, self.rank, self.width, self.lookahead = hidden_size, rank, width, lookahead
        self.config = config or PredictorConfig()
        self.summary = dict(summary or {})  # how it was trained: samples, epochs, loss, validation recall/precision
        # Heads returned per layer: within-step ones up to the configured lookahead, and the next-step head
        # (target L itself) when the file has one. The others are computed (one matmul) but not returned.
        self._heads = {
            L: [(i, t) for i, t in enumerate(ts) if t == L or 0 < t - L <= self.config.lookahead]
            for L, ts in self.targets.items()
        }
        self._device = torch.device("cpu")

    def __repr__(self) -> str:
        return (
            f"LearnedPredictor(layers={len(self.nets)}, lookahead={self.lookahead}, rank={self.rank}, "
            f"width={self.width}, parameters={self.num_parameters():,})"
        )

    def num_parameters(self) -> int:
        """Parameters of all networks, standardisation buffers included."""
        return sum(sum(t.numel() for t in net.state_dict().values()) for net in self.nets.values())

    def to(self, device: torch.device | str) -> LearnedPredictor:
        self._device = torch.device(device)
        for net in self.nets.values():
            net.to(self._device)
        return self

    # -- the Predictor interface ---------------------------------------------------------------
    def observe(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor) -> None:
        pass  # the networks read only the hidden state

    def predict(self, layer: int, hidden: torch.Tensor) -> dict[int, torch.Tensor]:
        """`{layer + d: [E] probability that some token of `hidden` [T, H] uses the expert}` (CPU), and
        with a next-step head `{layer: [E] probability that some next token uses it}`."""
        net = self.nets.get(layer)
        if net is None or not self._heads[layer]:
            return {}
        if hidden.device != self._device:
            self.to(hidden.device)  # once: the networks follow the model's device
        with torch.no_grad():
            per_token = torch.sigmoid(net(hidden))  # [T, O]
            # [O]: some token uses the expert. For the next-step head that is right for a batch of decoding
            # sequences (each row's next token) and pessimistic for a prompt (only its last row's next token
            # comes next): the rows of a block do not say which of the two they are.
            union = token_union(per_token, 1).to("cpu", non_blocking=True)  # one copy for every head (see gate)
        heads = union.split(net.out_sizes)
        return {target: heads[i] for i, target in self._heads[layer]}

    def reset(self) -> None:
        pass  # stateless between steps

    # -- files ----------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike, fingerprint: dict) -> None:
        """Write `predictor.safetensors` (weights) and `predictor.json` (format, the model's
        fingerprint, sizes and the training summary) into `directory`."""
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        tensors = {f"{L}.{k}": v.detach().cpu().contiguous() for L, net in self.nets.items() for k, v in net.state_dict().items()}
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "fingerprint": fingerprint,
            "hidden_size": self.hidden_size,
            "rank": self.rank,
            "width": self.width,
            "lookahead": self.lookahead,
            "parameters": self.num_parameters(),
            "layers": {str(L): {"targets": self.targets[L], "out_sizes": net.out_sizes} for L, net in self.nets.items()},
            "training": self.summary,
        }
        save_file(tensors, os.path.join(directory, WEIGHTS_FILE), metadata={"format": FORMAT, "version": str(VERSION)})
        with open(os.path.join(directory, META_FILE), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        model: nn.Module | None = None,
        layers: Sequence | None = None,
        config: PredictorConfig | None = None,
        fingerprint: dict | None = None,
    ) -> LearnedPredictor:
        """Read a directory written by `save`. The file is refused (`IncompatibleFileError`) unless it
        was made for this model: `fingerprint` if given (the wrapper passes it while wrapping), else
        `model.mira.fingerprint` for a wrapped model, else what `model.config` and `layers` tell
        (shapes only). `layers`: the manager's `LayerInfo`s, checked against the file's heads."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        directory = os.fspath(path) if path is not None else None
        meta_path = os.path.join(directory or "", META_FILE)
        weights_path = os.path.join(directory or "", WEIGHTS_FILE)
        if directory is None or not (os.path.isfile(meta_path) and os.path.isfile(weights_path)):
            raise ConfigError(
                f"predictor_path={directory!r} holds no calibrated predictor (expected {META_FILE} and {WEIGHTS_FILE}). "
                "Write one with mira_hf.calibrate(model, data) then model.mira.save_predictor(dir)."
            )
        try:
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError) as exc:
            raise IncompatibleFileError(f"{meta_path} is not readable JSON ({exc}). Calibrate again to rewrite it.") from exc
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
            got = (meta.get("format"), meta.get("version")) if isinstance(meta, dict) else type(meta).__name__
            raise IncompatibleFileError(
                f"{meta_path} is {got}, not a {FORMAT} version {VERSION} file. Calibrate again with this mira-hf version."
            )

        actual = fingerprint if fingerprint is not None else _fingerprint_of(model, layers)
        _check_fingerprint(meta.get("fingerprint") or {}, actual, directory)
        try:
            sizes = {int(L): (list(v["targets"]), list(v["out_sizes"])) for L, v in meta["layers"].items()}
            H, rank, width, lookahead = (int(meta[k]) for k in ("hidden_size", "rank", "width", "lookahead"))
        except (KeyError, TypeError, ValueError) as exc:
            raise IncompatibleFileError(f"{meta_path} lacks a field or has a malformed one ({exc!r}). Calibrate again.") from exc
        if layers is not None:
            _check_layers(sizes, layers, directory)

        try:
            state = load_file(weights_path)
        except (OSError, SafetensorError) as exc:
            raise IncompatibleFileError(f"{weights_path} is not a readable safetensors file ({exc}). Calibrate again.") from exc
        nets = {}
        for L, (_, out_sizes) in sizes.items():
            net = LayerNet(H, rank, width, out_sizes)
            prefix = f"{L}."
            try:
                net.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}, strict=True)
            except RuntimeError as exc:
                raise IncompatibleFileError(
                    f"{weights_path}: the weights of layer {L} do not match {META_FILE} ({str(exc).splitlines()[0]}). "
                    "The directory mixes files of two calibrations, or is corrupt: calibrate again."
                ) from exc
            nets[L] = net
        targets = {L: t for L, (t, _) in sizes.items()}
        return cls(
            nets,
            targets,
            hidden_size=H,
            rank=rank,
            width=width,
            lookahead=lookahead,
            config=config,
            summary=meta.get("training") or {},
        )


# -- checks ---------------------------------------------------------------------------------------
def _fingerprint_of(model: nn.Module | None, layers: Sequence | None) -> dict | None:
    """The model's full fingerprint when it is wrapped; else the shape fields its config and `layers` give."""
    if model is None:
        return None
    manager = getattr(model, "mira", None)
    fingerprint = getattr(manager, "fingerprint", None) if manager is not None else None  # hashes the routers: once
    if fingerprint:
        return fingerprint
    config = getattr(model, "config", None)
    partial = {"model_type": getattr(config, "model_type", None), "hidden_size": getattr(config, "hidden_size", None)}
    if layers is not None:
        partial.update(moe_layers=len(layers), num_experts=[li.num_experts for li in layers])
    return partial


def _describe(fp: dict) -> str:
    experts = fp.get("num_experts")
    if isinstance(experts, list) and experts and len(set(experts)) == 1:
        experts = experts[0]
    text = f"{fp.get('model_type')}, {fp.get('moe_layers')} MoE layers × {experts} experts, hidden {fp.get('hidden_size')}"
    sha = fp.get("router_sha256")
    return text + (f", routers sha256 {sha[:12]}…" if isinstance(sha, str) else "")


def _check_fingerprint(saved: dict, actual: dict | None, directory: str) -> None:
    """Every field of `actual` must equal the file's (a partial `actual` checks fewer fields)."""
    if actual is None:
        return
    differ = [k for k in actual if saved.get(k) != actual[k]]
    if differ:
        raise IncompatibleFileError(
            f"the predictor in {directory} was made for another model ({', '.join(differ)} differ): it was made for "
            f"{_describe(saved)}; this model is {_describe(actual)}. Calibrate one for this model: "
            "mira_hf.calibrate(model, data), then model.mira.save_predictor(dir)."
        )


def _check_layers(sizes: dict[int, tuple[list[int], list[int]]], layers: Sequence, directory: str) -> None:
    experts = {li.ordinal: li.num_experts for li in layers}
    for L, (targets, out_sizes) in sizes.items():
        if L not in experts or any(experts.get(t) != e for t, e in zip(targets, out_sizes)) or len(targets) != len(out_sizes):
            raise IncompatibleFileError(
                f"the predictor in {directory} has heads for layer {L} -> {dict(zip(targets, out_sizes))} (layer: experts), "
                f"but this model's MoE layers are {experts}. Calibrate one for this model: mira_hf.calibrate(model, data)."
            )


register_predictor(
    "learned",
    lambda s: LearnedPredictor.load(s.path, model=s.model, layers=s.layers, config=s.config, fingerprint=s.fingerprint),
    uses_hidden=True,
    needs_path=True,
)
