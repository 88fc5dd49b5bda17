"""Byte layout of one expert record: every tensor of one expert in one contiguous buffer.

One expert = one record = one host→device copy. The runtime moves records; a codec says how the
tensors of an expert are laid out in a record and how to get them back on the device. The identity
codec (the default) keeps the checkpoint's dtype, so decoding is a set of zero-copy views.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

# Offsets inside a record are multiples of this, so every view is aligned for any dtype and for DMA.
ALIGN_BYTES = 256

# The tensors an expert's first matmul reads (transformers' fused experts modules): a record that holds
# them before every other tensor can be copied in two parts, so the first matmul need not wait for the rest.
FIRST_MATMUL_TENSORS = frozenset({"gate_up_proj", "up_proj", "gate_up_proj_bias", "up_proj_bias"})


def align(n: int, to: int = ALIGN_BYTES) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the start of the record

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class RawLayout:
    """Layout of an uncompressed expert record: the tensors back to back, each aligned."""

    tensors: tuple[TensorSpec, ...]
    nbytes: int

    @property
    def payload_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def signature(self) -> tuple:
        return tuple((t.name, t.shape, t.dtype) for t in self.tensors)

    def tensor_ranges(self) -> dict[str, tuple[int, int]]:
        """Byte range [start, end) of each tensor in the record."""
        return {t.name: (t.offset, t.offset + t.nbytes) for t in self.tensors}


def split_point(layout, first: frozenset[str] = FIRST_MATMUL_TENSORS) -> int | None:
    """The byte offset where the tensors named in `first` end, if they all come before every other
    tensor of a record of `layout` (its `tensor_ranges()`); None if the record does not split so."""
    ranges = layout.tensor_ranges()
    head = [end for name, (_, end) in ranges.items() if name in first]
    tail = [start for name, (start, _) in ranges.items() if name not in first]
    if not head or not tail or min(tail) < max(head):
        return None
    return max(head)


def plan_layer(codec, fused: Mapping[str, torch.Tensor]):
    """The record layout of one layer's experts, from its fused tensors `name -> [E, ...]`. A codec
    whose record size depends on the values (lossless: room for the experts' escapes) plans from the
    tensors (`plan_experts`); the others from their shapes and dtypes."""
    plan_experts = getattr(codec, "plan_experts", None)
    if plan_experts is not None:
        return plan_experts(fused)
    return codec.plan({name: (tuple(t.shape[1:]), t.dtype) for name, t in fused.items()})


class IdentityCodec:
    """Records hold the checkpoint's bytes unchanged: exact, and decoding is free (views)."""

    name = "none"
    exact = True
    supports_calib = False

    def record_bytes(self, layout: RawLayout) -> int:
        return layout.nbytes

    def validate(self, record: torch.Tensor, layout: RawLayout) -> None:
        """Nothing to check: records are the checkpoint's bytes, without a header."""

    def plan(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> RawLayout:
        offset, tensors = 0, []
        for name, (shape, dtype) in specs.items():
            spec = TensorSpec(name, tuple(shape), dtype, offset)
            tensors.append(spec)
            offset = align(offset + spec.nbytes)
        return RawLayout(tuple(tensors), max(offset, ALIGN_BYTES))

    def encode(self, tensors: Mapping[str, torch.Tensor], layout: RawLayout, out: torch.Tensor) -> None:
        for spec in layout.tensors:
            self.view(out, spec).copy_(tensors[spec.name])

    def decode(
        self, record: torch.Tensor, layout: RawLayout, dtype: torch.dtype | None = None, out=None
    ) -> dict[str, torch.Tensor]:
        return {spec.name: self.view(record, spec) for spec in layout.tensors}

    @staticmethod
    def view(record: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
        """A typed view of one tensor inside a uint8 record (no copy)."""
        return record[spec.offset : spec.offset + spec.nbytes].view(spec.dtype).view(spec.shape)


def decodes_exactly(codec) -> bool:
    """Whether a record kept packed decodes to the stored weights bit for bit, so the decoded weight through the
    unwrapped model's own op gives its bits; a format computed by transformers' own kernels on the record
    (`native_kernels`: FP8, MXFP4) is computed through the codec's `linear` instead."""
    return codec.exact and not getattr(codec, "native_kernels", False)


class PackedWeights:
    """An expert kept packed in its device slot (placement "packed"): computed from packed weights.

    Built once per slot (the manager keeps it): the codec checks layout and record here (`codec.bind`),
    so the per-token `linear` only computes. `scratch`: a device buffer the codec's `linear` decodes a
    weight into (codecs with a `scratch_bytes`, e.g. lossless), shared by every expert; None otherwise."""

    __slots__ = ("codec", "record", "layout", "dtype", "scratch", "exact", "_bound")

    def __init__(self, codec, record: torch.Tensor, layout, dtype: torch.dtype, scratch: torch.Tensor | None = None) -> None:
        self.codec, self.record, self.layout, self.dtype, self.scratch = codec, record, layout, dtype, scratch
        # `decodes_exactly`, read per expert matmul, so resolved here, once
        self.exact: bool = decodes_exactly(codec)
        self._bound = codec.bind(record, layout, scratch)

    def linear(self, x: torch.Tensor, name: str, transposed: bool) -> torch.Tensor:
        return self._bound.linear(x, name, transposed)

    def weight(self, name: str) -> torch.Tensor:
        """Tensor `name` decoded in the model's dtype (into the shared scratch buffer when it fits)."""
        return self._bound.weight(name, self.dtype)

    def decoded(self, name: str) -> torch.Tensor:
        """Tensor `name` as a slot of placement "dequant" holds it, for any codec (`weight` where the bound form
        has one, else the codec's decode of the record)."""
        t = self.weight(name) if hasattr(self._bound, "weight") else self.codec.decode(self.record, self.layout, self.dtype)[name]
        # A slot holds it contiguous, and a matmul may round by its weight's row stride: a copy only where padding was cut
        return t.contiguous()

    def raw(self, name: str) -> torch.Tensor:
        """A tensor stored unquantised in the record (biases)."""
        return self._bound.raw(name, self.dtype)
