"""Each expert split by its intermediate neurons: a device part the cache holds and the link moves, and a host
part the host computes at every use (`MiraConfig(host_compute="split")`).

A routed expert is a sum over its intermediate neurons: `down @ act(gate_up @ x)` is `down[:, n] · act(...)[n]`
summed over n, and each neuron reads only its own rows (columns, transposed) of the up projection. So the first
`device_neurons` of every expert form an expert of their own (the same gate function, smaller), computed on the
device from its slot, and the rest form the host part: the host computes it on the token's hidden rows while the
device computes the device parts, and the two outputs add. The link carries only the device parts (a share
`1 - host_share` of every record: fewer bytes per miss, more experts per byte of budget), and the host's cores,
a resource apart from the link, carry the rest at every use. Where the experts compute in 16 bits, each part's down
projection keeps its product in fp32 and the two are added before one rounding, as the whole expert's one matmul
(accumulating in fp32) rounds once (`wide_linear`; the host part's down projection is stored widened to fp32, as
torch's CPU matmul gives no fp32 product of 16-bit operands): the sum then differs from the whole expert's only in
the order of its fp32 additions, seldom by a rounding step. Not bit-exact, like every host compute mode.

How a gate function pairs its up projection's columns with neurons is read from the function itself
(`pairing_of`): gate columns then up columns ("halves": Mixtral, Qwen, DeepSeek, Llama 4), gate and up
alternating ("interleaved": gpt-oss), or one column per neuron (no gate). Biases of the up projection split with
their neurons; the down projection's bias belongs to the device part (added once, to the two parts' sum).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from .errors import ConfigError
from .pinned import pinned_empty

NARROW = (torch.bfloat16, torch.float16)  # dtypes whose split products are kept in fp32 until the parts are summed
WIDE = torch.float32
# torch's CUDA mm and bmm give an fp32 product of 16-bit operands (`out_dtype`) from torch 2.8; before, the operands
# are widened and multiplied in fp32 (TF32, where the user allows it for fp32 matmuls, then rounds them).
OUT_DTYPE = torch.torch_version.TorchVersion(torch.__version__) >= "2.8"
DEVICE = 0  # part index: the device's neurons
HOST = 1  # the host's
# The host part's neurons, where an expert has enough, are a multiple of this (row-aligned slices).
NEURON_MULTIPLE = 16

Tensors = Mapping[str, torch.Tensor]
Specs = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def pairing_of(activate: Callable[[torch.Tensor], torch.Tensor], has_gate: bool) -> str:
    """How `activate` ([n, 2I] -> [n, I] with a gate, else [n, I] -> [n, I]) pairs columns with neurons: found by
    applying it to the columns each pairing gives two neurons and comparing with the full call."""
    if not has_gate:
        return "single"
    neurons = 4
    h = torch.randn(3, 2 * neurons, generator=torch.Generator().manual_seed(0))  # [3, 2I], fp32
    with torch.no_grad():
        full = activate(h)  # [3, I]
        for pairing in ("halves", "interleaved"):
            cols = _up_columns(pairing, neurons, range(2))
            if torch.allclose(activate(h[:, cols]), full[:, :2], rtol=0, atol=1e-6):
                return pairing
    raise ConfigError(
        "host_compute='split' splits each expert by its intermediate neurons, but this experts module's gate "
        "function pairs its up projection's columns with neurons in a way mira-hf does not recognise (neither gate "
        "columns then up columns, nor the two alternating). Use host_compute='auto', 'on' or 'off'."
    )


def _up_columns(pairing: str, intermediate: int, neurons) -> list[int]:
    """The up projection's columns of `neurons` (ascending), in the order a smaller expert of them holds them."""
    neurons = list(neurons)
    if pairing == "halves":
        return neurons + [intermediate + n for n in neurons]
    if pairing == "interleaved":
        return [c for n in neurons for c in (2 * n, 2 * n + 1)]
    return neurons


def wide_linear(x: torch.Tensor, weight, transposed: bool, counts: list[int] | None = None) -> torch.Tensor:
    """x [n, in] times a split expert's down projection, the product in fp32 (WIDE), not rounded to the rows' 16
    bits: `weight` [out, in] ([in, out] when `transposed`), or, with `counts` (rows per group), the next
    `counts[g]` rows through `weight[g]` (a sequence of such weights), one matmul per group (torch's grouped kernel
    gives no fp32 output of 16-bit operands). On CUDA torch's `mm` gives it from the 16-bit operands (`out_dtype`; a
    wider weight, a host part stored widened, is narrowed first: exactly, as it was widened); elsewhere (and before
    torch 2.8) the operands are widened (exactly) and multiplied in fp32. Returns [n, out] in fp32."""
    if counts is not None:
        parts, row = [], 0
        for w, n in zip(weight, counts):
            parts.append(wide_linear(x[row : row + n], w, transposed))
            row += n
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    w = weight if transposed else weight.t()  # [in, out]
    if x.device.type == "cuda" and OUT_DTYPE:
        return torch.mm(x, w if w.dtype == x.dtype else w.to(x.dtype), out_dtype=WIDE)
    return x.to(WIDE) @ w.to(WIDE)


def wide_batched_linear(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """`wide_linear` for every row x [S, in] by its own weights [S, out, in] ([S, in, out] if `transposed`), as
    batched_mm multiplies them. Returns [S, out] in fp32."""
    a, b = (x.unsqueeze(1), weight) if transposed else (weight, x.unsqueeze(-1))
    if x.device.type == "cuda" and OUT_DTYPE:
        out = torch.bmm(a, b, out_dtype=WIDE)
    else:
        out = torch.bmm(a.to(WIDE), b.to(WIDE))
    return out.squeeze(1) if transposed else out.squeeze(-1)


def host_neurons(intermediate: int, share: float) -> int:
    """How many of an expert's `intermediate` neurons the host computes for `share`. Both parts are whole multiples
    of a step (NEURON_MULTIPLE neurons where the expert has four times that, else the largest of 8, 4, 2 that divides
    it), so the device part's rows are 16-byte aligned wherever the whole expert's are, as torch's grouped matmul
    needs. `ConfigError` where an expert has too few neurons for two such parts."""
    step = NEURON_MULTIPLE if intermediate >= 4 * NEURON_MULTIPLE else math.gcd(intermediate, 8)
    if intermediate < 2 * step:
        raise ConfigError(
            f"host_compute='split' splits each expert's intermediate neurons between the host and the device in "
            f"multiples of {step} (so the device's rows stay aligned); these experts have {intermediate}, too few for "
            "two parts. Use host_compute='auto', 'on' or 'off'."
        )
    n = round(intermediate * share / step) * step
    return min(max(n, step), intermediate - step)


@dataclass(frozen=True)
class NeuronSplit:
    """How one layer's experts split: `up` is the name of the up projection ("gate_up_proj" or "up_proj"),
    `transposed` the layout flag (weights [in, out]), `intermediate` the neurons of an expert, the last
    `host` of them on the host. Works on one expert's tensors or on fused ones (leading expert dimension)."""

    up: str
    pairing: str
    transposed: bool
    intermediate: int
    host: int
    # For experts over separate tensors (`model_adapters.SeparateGluExperts`): each tensor's neuron axis from the end,
    # one row (or column) per neuron. Empty: transformers' fused tensors, split as `up`, `pairing` and `transposed` say.
    neuron_axes: Mapping[str, int] = field(default_factory=dict, hash=False)
    down: str = "down_proj"  # the down projection's name

    @property
    def device_neurons(self) -> int:
        return self.intermediate - self.host

    def _ranges(self, name: str, part: int) -> tuple[int, list[tuple[int, int]]] | None:
        """(axis from the end, the (start, length) column ranges of `part`, in the order a smaller expert holds
        them) of tensor `name`; None where the whole tensor belongs to the device part (the down bias)."""
        d, h = self.device_neurons, self.host
        first, count = (0, d) if part == DEVICE else (d, h)
        if name in self.neuron_axes:
            return self.neuron_axes[name], [(first, count)]
        if name in (self.up, self.up + "_bias"):
            axis = -1 if self.transposed or name.endswith("_bias") else -2  # [.., 2I, H], [.., H, 2I] or [.., 2I]
            if self.pairing == "halves":  # gate columns, then up columns
                return axis, [(first, count), (self.intermediate + first, count)]
            if self.pairing == "interleaved":  # (gate, up) per neuron
                return axis, [(2 * first, 2 * count)]
            return axis, [(first, count)]
        if name == self.down:
            return (-2 if self.transposed else -1), [(first, count)]  # [.., I, H] or [.., H, I]
        if name == self.down + "_bias":
            return None
        raise ConfigError(
            f"host_compute='split' splits expert tensors by neuron, but this layer has a tensor {name!r} it does not "
            f"know how to split (known: {self.up}, {self.down} and their biases). Use host_compute='auto', 'on' or 'off'."
        )

    def split(self, tensors: Tensors) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(device part, host part) of `tensors` (name -> one expert's tensor, or fused [E, ...]); contiguous copies."""
        parts: tuple[dict, dict] = ({}, {})
        for name, t in tensors.items():
            if self._ranges(name, DEVICE) is None:
                parts[DEVICE][name] = t.contiguous()
                continue
            for part in (DEVICE, HOST):
                axis, ranges = self._ranges(name, part)
                pieces = [t.narrow(t.dim() + axis, a, n) for a, n in ranges]
                parts[part][name] = torch.cat(pieces, dim=t.dim() + axis) if len(pieces) > 1 else pieces[0].contiguous()
        return parts

    def specs(self, specs: Specs) -> tuple[dict, dict]:
        """(device part, host part) of one expert's `specs` (name -> (shape, dtype))."""
        meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in specs.items()}
        return tuple({n: (tuple(t.shape), t.dtype) for n, t in part.items()} for part in self.split(meta))

    def combine(
        self, device: Tensors, host: Tensors, alloc: Callable[..., torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The whole tensors from their two parts (the inverse of `split`); each written into `alloc(shape, dtype=...)`'s
        tensor where given."""
        out = {}
        for name, d in device.items():
            if self._ranges(name, DEVICE) is None:
                out[name] = d if alloc is None else alloc(d.shape, dtype=d.dtype).copy_(d)
                continue
            axis = d.dim() + self._ranges(name, DEVICE)[0]
            pieces = []  # (first column in the whole tensor, the columns)
            for part, t in ((DEVICE, d), (HOST, host[name])):
                at = 0
                for a, n in self._ranges(name, part)[1]:
                    pieces.append((a, t.narrow(axis, at, n)))
                    at += n
            pieces = [p for _, p in sorted(pieces, key=lambda item: item[0])]
            if alloc is None:
                out[name] = torch.cat(pieces, dim=axis)
                continue
            shape = list(d.shape)
            shape[axis] = sum(p.shape[axis] for p in pieces)
            out[name] = torch.cat(pieces, dim=axis, out=alloc(shape, dtype=torch.result_type(d, host[name])))
        return out


class HostParts:
    """The host parts of every layer's experts: name -> [E, ...] tensors in host memory, filled expert by
    expert as the device parts are stored. A 16-bit down projection is stored widened to fp32 (`wide_linear`: the
    host's product of it stays in fp32); `tensors_as_given` gives it back in its own dtype."""

    def __init__(self, splits: Mapping[int, NeuronSplit], pinned: bool = False) -> None:
        self.splits = dict(splits)
        self.pinned = pinned  # page-locked: a part copied to the device (`HostCosts.balance`) crosses at link speed
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        self.dtypes: dict[int, torch.dtype] = {}  # each layer's down projection's dtype, as the experts hold it

    def stored_bytes(self, layer: int, specs: Specs) -> int:
        """Bytes one expert's host part in `layer` takes as stored (a 16-bit down projection widened); `specs`: one
        whole expert's (name -> (shape, dtype))."""
        _, host = self.splits[layer].specs(specs)
        return sum(math.prod(shape) * self._stored(layer, name, dtype).itemsize for name, (shape, dtype) in host.items())

    def allocate(self, layer: int, specs: Specs, num_experts: int) -> None:
        """Room for `layer`'s host parts; `specs`: one whole expert's (name -> (shape, dtype))."""
        _, host = self.splits[layer].specs(specs)
        self.dtypes[layer] = host[self.splits[layer].down][1]
        self.tensors[layer] = {
            name: self._empty((num_experts, *shape), self._stored(layer, name, dtype)) for name, (shape, dtype) in host.items()
        }

    def _stored(self, layer: int, name: str, dtype: torch.dtype) -> torch.dtype:
        return WIDE if name == self.splits[layer].down and dtype in NARROW else dtype

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if not self.pinned:
            return torch.empty(shape, dtype=dtype)
        n = math.prod(shape) * dtype.itemsize
        return pinned_empty(n).view(dtype).view(shape)  # exactly its size, as the store's slabs

    def splitter(self, layer: int, expert: Callable[[int], Tensors]) -> Callable[[int], dict[str, torch.Tensor]]:
        """`expert(e) -> whole tensors` as `e -> device part`, writing the host part here on the way."""
        split, parts = self.splits[layer], self.tensors[layer]

        def device_part(e: int) -> dict[str, torch.Tensor]:
            device, host = split.split(expert(e))
            for name, t in host.items():
                parts[name][e].copy_(t)  # a widened down projection: exactly
            return device

        return device_part

    def weights(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Expert `expert`'s host part, as stored (the down projection widened): name -> view."""
        return {name: t[expert] for name, t in self.tensors[layer].items()}

    def tensors_as_given(self, layer: int) -> dict[str, torch.Tensor]:
        """`layer`'s host parts [E, ...] in the experts' own dtypes (a widened down projection narrowed: a copy, exact)."""
        down, dtype = self.splits[layer].down, self.dtypes[layer]
        return {name: t.to(dtype) if name == down else t for name, t in self.tensors[layer].items()}

    def expert_specs(self, layer: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """One expert's host part in `layer`, as `tensors_as_given` gives it: name -> (shape, dtype)."""
        down, dtype = self.splits[layer].down, self.dtypes[layer]
        return {name: (tuple(t.shape[1:]), dtype if name == down else t.dtype) for name, t in self.tensors[layer].items()}

    def expert_bytes(self, layer: int) -> int:
        """Bytes of one expert's host part in `layer`, as stored (what a copy of it moves)."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors[layer].values())

    def cast(self, layer: int, dtype: torch.dtype) -> None:
        """`layer`'s host parts as casting their tensors to `dtype` would give them (a down projection stored widened
        holds its values rounded to `dtype`)."""
        if self.dtypes[layer] == dtype:
            return
        self.dtypes[layer] = dtype
        tensors = self.tensors[layer]
        for name, t in tensors.items():
            to = self._stored(layer, name, dtype)
            if t.dtype != to:
                tensors[name] = self._empty(t.shape, to).copy_(t.to(dtype))  # rounded to `dtype` first, then widened
            elif to != dtype:  # widened: in place, its values rounded to `dtype`
                t.copy_(t.to(dtype))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for parts in self.tensors.values() for t in parts.values())


class SplitWeights:
    """The experts as whole tensors over a store of device parts and their `HostParts`: what the wrapped model's
    parameters, `state_dict()`, `load_state_dict()`, casts and `unload()` read and write (`mira_hf.state`).
    Parameters are placeholders (the whole tensors exist nowhere); `fused` gives copies."""

    quantized = True  # parameters are not views of one slab: state_dict() assembles copies

    def __init__(self, store, parts: HostParts) -> None:
        self.device_store, self.parts = store, parts

    def __getattr__(self, name: str):  # layers, num_experts, dtype, layout, raw_layout, codec, exact, ...
        return getattr(self.device_store, name)

    def expert_views(self, layer: int) -> None:
        return None

    def expert_specs(self, layer: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        device = {n: torch.empty(s, dtype=d, device="meta") for n, (s, d) in self.device_store.expert_specs(layer).items()}
        host = {n: torch.empty(s, dtype=d, device="meta") for n, (s, d) in self.parts.expert_specs(layer).items()}
        return {n: (tuple(t.shape), t.dtype) for n, t in self.parts.splits[layer].combine(device, host).items()}

    def fused(self, layer: int, alloc: Callable[..., torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        return self.parts.splits[layer].combine(self.device_store.fused(layer), self.parts.tensors_as_given(layer), alloc)

    def drop(self, layer: int) -> None:
        self.device_store.drop(layer)
        self.parts.tensors.pop(layer, None)

    def plan_rewrite(self, layer: int, fused: Tensors | None = None, dtype: torch.dtype | None = None):
        device = None if fused is None else self.parts.splits[layer].split(fused)[DEVICE]
        return self.device_store.plan_rewrite(layer, device, dtype)

    def rewrite(self, layer: int, fused: Tensors | None = None, dtype: torch.dtype | None = None, layout=None) -> None:
        if fused is None:
            self.device_store.rewrite(layer, dtype=dtype, layout=layout)
            self.parts.cast(layer, dtype)
            return
        device, host = self.parts.splits[layer].split(fused)
        self.device_store.rewrite(layer, device, dtype, layout=layout)
        for name, t in host.items():
            self.parts.tensors[layer][name].copy_(t)
