"""Checkpoint-native expert records: pre-quantized experts kept in the bytes their checkpoint stores.

A pre-quantized checkpoint (FP8 with block scales, MXFP4) already holds each expert in a compact
form. Its records are those tensors, as read from the safetensors shards, back to back: the
quantized weights, their scales and any unquantized biases of one expert (`NativeLayout`). Nothing
is encoded at load, so nothing is lost.

Each use decodes a record on the device into the weights transformers' own loading of that
checkpoint produces, bit for bit (the subclasses repeat transformers' dequantize arithmetic), and the
proxy runs the expert as transformers does. Records are planned from the checkpoint's tensors
(`plan_experts_from`), never from weights in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..layout import IdentityCodec, RawLayout
from .record import CodecInputError


@dataclass(frozen=True)
class NativeLayout:
    """One expert's record: the checkpoint's tensors of each fused weight (`record_names`), back to back.

    `pieces`: per quantized fused tensor, how many checkpoint tensors were concatenated along dim 0 to
    make it (2 for a `gate_up_proj` stored as `gate_proj` and `up_proj`), each dequantized on its own
    as transformers does before it concatenates them."""

    raw: RawLayout
    fused: tuple[tuple[str, tuple[str, ...]], ...]  # (fused tensor name, its record tensors), in record order
    pieces: tuple[tuple[str, int], ...]

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    @property
    def payload_bytes(self) -> int:
        return self.raw.payload_bytes

    @property
    def signature(self) -> tuple:
        return (self.raw.signature, self.pieces)

    def tensor_ranges(self) -> dict[str, tuple[int, int]]:
        """Byte range [start, end) of each fused tensor's record tensors (weights with their scales), so a
        record split after the first matmul's tensors brings that matmul's scales too."""
        spans = self.raw.tensor_ranges()
        return {name: (min(spans[n][0] for n in parts), max(spans[n][1] for n in parts)) for name, parts in self.fused}


class NativeCodec:
    """Base of the checkpoint-native codecs. Subclasses give `name`, `scale_suffix`, `record_specs` (the
    record tensors of one quantized fused tensor, checked against the checkpoint's) and `dequantize`."""

    name = "native"
    scale_suffix = "_scales"
    supports_calib = False
    # Decoding gives back exactly the weights transformers' own loading of the checkpoint makes (what
    # unload() and save_pretrained() return), and the records are the checkpoint's bytes.
    exact = True
    # Records are made from the checkpoint's quantized tensors and scales only: other values (a cast, a
    # `load_state_dict`) cannot be encoded into them. `dequantized_config`: the `quantization_config` that
    # loads such a checkpoint dequantized instead (plain weights, which can be changed).
    encodes_values = False
    dequantized_config = ""
    # Kept packed (placement "packed"), a record is computed by transformers' own kernels (`linear`), as the
    # unwrapped model computes the format, never through a decoded weight.
    native_kernels = True

    def __init__(self, pieces: Mapping[str, int] | None = None) -> None:
        self.pieces = dict(pieces or {})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pieces={self.pieces})"

    # -- planning ------------------------------------------------------------------------------
    def plan(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> NativeLayout:
        raise CodecInputError(
            f"the {self.name} codec holds experts as a pre-quantized checkpoint stores them: its records are planned "
            "from the checkpoint's tensors (plan_experts_from), which MiraMoEModel.from_pretrained reads."
        )

    def plan_experts_from(
        self,
        specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        num_experts: int,
        expert: Callable[[int], Mapping[str, torch.Tensor]],
    ) -> NativeLayout:
        """The record layout of a layer whose experts are read one at a time (`expert(e)` gives the
        checkpoint's tensors of expert e). `specs`: each fused tensor's shape and dtype in the model."""
        tensors = expert(0)
        record: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        fused = []
        for name, (shape, dtype) in specs.items():
            if name.endswith("_bias"):  # stored as the model holds it
                record[name] = (tuple(shape), dtype)
                fused.append((name, (name,)))
                continue
            scales = name + self.scale_suffix
            if name not in tensors or scales not in tensors:
                raise CodecInputError(f"{self.name}: the checkpoint gives no {name!r} with {scales!r} (got {sorted(tensors)}).")
            parts = self.record_specs(name, tuple(shape), tensors[name], tensors[scales], self.pieces.get(name, 1))
            record.update(parts)
            fused.append((name, tuple(parts)))
        raw = IdentityCodec().plan(record)
        return NativeLayout(raw, tuple(fused), tuple(sorted(self.pieces.items())))

    def record_specs(
        self, name: str, shape: tuple[int, ...], weight: torch.Tensor, scales: torch.Tensor, pieces: int
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    # -- records -------------------------------------------------------------------------------
    def encode(self, tensors: Mapping[str, torch.Tensor], layout: NativeLayout, out: torch.Tensor, **_) -> None:
        """Copy the checkpoint's tensors of one expert into its record (scales take the record's dtype)."""
        for spec in layout.raw.tensors:
            t = tensors[spec.name]
            widened = spec.dtype == torch.float32 and t.dtype in (torch.float32, torch.bfloat16, torch.float16)  # scales
            if tuple(t.shape) != spec.shape or not (t.dtype == spec.dtype or widened):
                raise CodecInputError(
                    f"{self.name}: {spec.name} is {t.dtype} {list(t.shape)} in the checkpoint, but the layer's records "
                    f"hold {spec.dtype} {list(spec.shape)} (planned from its first expert): the experts differ in format."
                )
            IdentityCodec.view(out, spec).copy_(t)

    def views(self, record: torch.Tensor, layout: NativeLayout) -> dict[str, torch.Tensor]:
        """Typed views of one record's tensors (no copy)."""
        return IdentityCodec().decode(record, layout.raw)

    def decode(
        self,
        record: torch.Tensor,
        layout: NativeLayout,
        dtype: torch.dtype,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The expert's weights as transformers loads them (`dtype`: the model's), on the record's device;
        written into `out` (a slot's views) when given."""
        views = self.views(record, layout)
        result = {}
        for name, _ in layout.fused:
            if name.endswith("_bias"):
                w = views[name]
            else:
                w = self.dequantize(views, name, self.pieces.get(name, 1), dtype)
            if out is not None:
                out[name].copy_(w)
                result[name] = out[name]
            else:
                result[name] = w.to(dtype).clone() if name.endswith("_bias") else w
        return result

    def dequantize(self, views: Mapping[str, torch.Tensor], name: str, pieces: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def validate(self, record: torch.Tensor, layout: NativeLayout) -> None:
        """Nothing to check: records are the checkpoint's bytes, without a header."""

    def record_bytes(self, layout: NativeLayout) -> int:
        return layout.nbytes

    def linear(self, x: torch.Tensor, record: torch.Tensor, layout: NativeLayout, name: str, transposed: bool) -> torch.Tensor:
        """x [..., in] -> [..., out] with the record's `name` computed in its stored format (`computes_natively`)."""
        return self.bind(record, layout).linear(x, name, transposed)

    def bind(self, record: torch.Tensor, layout: NativeLayout, scratch: torch.Tensor | None = None) -> BoundNative:
        """`record` (a device slot) for the per-token path: its typed views made once."""
        if record.dtype != torch.uint8 or record.dim() != 1 or record.numel() < layout.nbytes:
            raise CodecInputError(
                f"{self.name}: record is {record.dtype} {tuple(record.shape)}; expected uint8 [{layout.nbytes}]."
            )
        return BoundNative(self, self.views(record, layout))

    def matmul(self, x2: torch.Tensor, views: Mapping[str, torch.Tensor], name: str, transposed: bool) -> torch.Tensor:
        """x2 [T, in] -> [T, out] from the record's typed views, in the stored format (native compute)."""
        raise CodecInputError(f"{self.name}: mira-hf computes these experts from decoded weights only (placement 'dequant').")

    def computes_natively(self, device: torch.device) -> bool:
        """Whether transformers computes this format with its own kernels on `device` (instead of
        dequantizing at load), and this codec can run those kernels on a record (`linear`)."""
        return False


class BoundNative:
    """A native record slot bound to its codec (`NativeCodec.bind`): its typed views, made once."""

    __slots__ = ("codec", "views")

    def __init__(self, codec: NativeCodec, views: Mapping[str, torch.Tensor]) -> None:
        self.codec, self.views = codec, views

    def linear(self, x: torch.Tensor, name: str, transposed: bool) -> torch.Tensor:
        # x [..., in] -> [..., out]
        y = self.codec.matmul(x.reshape(-1, x.shape[-1]), self.views, name, transposed)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def raw(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A tensor stored as the model holds it (a bias), as a fresh tensor of `dtype`."""
        return self.views[name].to(dtype, copy=True)


def split_rows(t: torch.Tensor, pieces: int) -> tuple[torch.Tensor, ...]:
    """`pieces` equal row blocks of t (the checkpoint tensors a fused tensor was concatenated from)."""
    if t.shape[0] % pieces:
        raise CodecInputError(f"{tuple(t.shape)} does not split into {pieces} equal row blocks.")
    return t.chunk(pieces, dim=0)
