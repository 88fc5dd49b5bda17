"""Encoded records cast after loading without being encoded again.

A cast of the unwrapped model (`model.half()`, `.to(torch.float32)`) rounds each expert tensor to the new dtype.
Records are encoded again as the cast tensors (`ExpertStore.rewrite`) where that is possible and worth it. It is not
possible where the format cannot hold the dtype (a checkpoint's own FP8 or MXFP4 bytes hold only its values; lossless
records hold bfloat16 and float32), and not worth it where the cast rounds nothing (bf16 lossless records widened
to fp32 would only grow). Those records stay as they are, and each decode of them casts what they hold through every
dtype the model was cast to since, in order: the tensors the unwrapped model holds after the same casts, bit for bit.

    layout = CastLayout(inner_layout, (torch.bfloat16, torch.float16))   # records decode to bf16, then .half()
    codec = CastCodec(store_codec)   # every other layout passes through to the codec as it is
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .record import CodecInputError, dense_linear

# (from, to): every value of `from` is a value of `to`, so a cast through `to` rounds nothing
_WIDENINGS = frozenset(
    {
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float64),
        (torch.float16, torch.float64),
        (torch.float32, torch.float64),
    }
)


def simplify(chain: tuple[torch.dtype, ...]) -> tuple[torch.dtype, ...]:
    """`chain` (the records' dtype, then each dtype cast to since) without the steps that change no value: a
    repeated dtype, and a dtype between two others that holds every value of the one before it (bf16 -> fp32 ->
    fp16 rounds as bf16 -> fp16 does)."""
    out: list[torch.dtype] = []
    for dtype in chain:
        while len(out) >= 2 and widens(out[-2], out[-1]):
            out.pop()
        if not out or out[-1] != dtype:
            out.append(dtype)
    return tuple(out)


@dataclass(frozen=True)
class CastLayout:
    """The layout of records that decode to `chain[0]` and are then cast through `chain[1:]` (≥ 2 dtypes)."""

    inner: object  # the records' own layout, as their codec planned it
    chain: tuple[torch.dtype, ...]

    def __getattr__(self, name: str):  # nbytes, entries, tensor_ranges, ...: the records' own
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def widens(old: torch.dtype, new: torch.dtype) -> bool:
    """Whether every value of `old` is a value of `new` (a cast from one to the other rounds nothing)."""
    return (old, new) in _WIDENINGS


def scratch_bytes(codec_scratch, layout) -> int:
    """Device bytes a slot of `layout` decodes a weight into to compute from packed records (placement "packed"):
    `codec_scratch(layout)`, the codec's own; for records cast in place, that for the records' layout and, beside it,
    the largest 2-D weight in the model's dtype, which the decode is cast into (`BoundCast`)."""
    if not isinstance(layout, CastLayout):
        return codec_scratch(layout)
    return _aligned(codec_scratch(layout.inner)) + _cast_bytes(layout)


def _cast_bytes(layout: CastLayout) -> int:
    entries = getattr(layout.inner, "entries", ())
    return _aligned(max((e.numel * layout.chain[-1].itemsize for e in entries if len(e.shape) == 2), default=0))


def _aligned(n: int) -> int:
    return -(-n // 256) * 256


def records_layout(layout):
    """The layout the records themselves have (`CastLayout.inner`, or `layout`)."""
    return layout.inner if isinstance(layout, CastLayout) else layout


def _cast(t: torch.Tensor, chain: tuple[torch.dtype, ...]) -> torch.Tensor:
    for dtype in chain[1:]:
        t = t.to(dtype)
    return t


# the codec methods whose argument after the record (or first) is a layout, and which a layout of cast records
# passes to the records' own codec with their own layout
_LAYOUT_FIRST = frozenset({"record_bytes", "scratch_bytes", "plan_args"})


class CastCodec:
    """A store's codec once some of its layers were cast in place: `CastLayout`s decode through their chain of
    dtypes; every other layout, and everything else, is the wrapped codec's."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name, self.exact, self.supports_calib = inner.name, inner.exact, inner.supports_calib

    def __repr__(self) -> str:
        return f"CastCodec({self.inner!r})"

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(self.inner, name)
        if name in _LAYOUT_FIRST:
            return lambda layout, *a, **kw: attr(records_layout(layout), *a, **kw)
        return attr

    def validate(self, record: torch.Tensor, layout) -> None:
        validate = getattr(self.inner, "validate", None)
        if validate is not None:
            validate(record, records_layout(layout))

    def encode(self, tensors: Mapping[str, torch.Tensor], layout, out: torch.Tensor, **kw) -> object:
        if isinstance(layout, CastLayout):
            raise CodecInputError(
                f"{self.name}: records cast in place hold {layout.chain[0]} values and take no new ones; encode with "
                "the records' own layout."
            )
        return self.inner.encode(tensors, layout, out, **kw)

    def decode(self, record: torch.Tensor, layout, dtype: torch.dtype, out: Mapping[str, torch.Tensor] | None = None):
        if not isinstance(layout, CastLayout):
            return self.inner.decode(record, layout, dtype, out=out)
        decoded = self.inner.decode(record, layout.inner, layout.chain[0])
        result = {}
        for name, t in decoded.items():
            t = _cast(t, layout.chain[:-1])
            if out is not None and name in out and dtype == layout.chain[-1]:
                t = out[name].copy_(t)  # the last cast, as `.to` rounds, with no tensor of its own
            else:
                t = t.to(layout.chain[-1]).to(dtype)
                if out is not None and name in out:
                    t = out[name].copy_(t)
            result[name] = t
        return result

    def linear(self, x: torch.Tensor, record: torch.Tensor, layout, name: str, transposed: bool) -> torch.Tensor:
        if not isinstance(layout, CastLayout):
            return self.inner.linear(x, record, layout, name, transposed)
        return self.bind(record, layout).linear(x, name, transposed)

    def bind(self, record: torch.Tensor, layout, scratch: torch.Tensor | None = None):
        if not isinstance(layout, CastLayout):
            return self.inner.bind(record, layout, scratch)
        return BoundCast(self.inner, record, layout, scratch)


class BoundCast:
    """A slot of cast records bound for the per-token path: each weight decoded in the records' dtype (into the
    codec's scratch where it has one), cast through the chain, and multiplied as the unwrapped model multiplies
    its cast weights."""

    __slots__ = ("inner", "bound", "record", "layout", "chain", "out")

    def __init__(self, codec, record: torch.Tensor, layout: CastLayout, scratch: torch.Tensor | None) -> None:
        self.inner, self.record, self.layout, self.chain = codec, record, layout.inner, layout.chain
        # the scratch (`device_buffers`): the records' codec decodes into its head, the cast weight lands in the rest
        inner_bytes = _aligned(getattr(codec, "scratch_bytes", lambda _: 0)(layout.inner))
        cast_bytes = _cast_bytes(layout)
        fits = scratch is not None and scratch.numel() >= inner_bytes + cast_bytes
        self.out = scratch[inner_bytes : inner_bytes + cast_bytes] if fits else None
        self.bound = codec.bind(record, layout.inner, scratch[:inner_bytes] if fits else scratch)

    def weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor `name` as the cast model holds it (then in `dtype`, where another is asked for), in the scratch where
        it has room (valid until the next call that decodes into it: use it at once, on the same stream)."""
        if hasattr(self.bound, "weight"):
            t = self.bound.weight(name, self.chain[0])
        else:
            t = self.inner.decode(self.record, self.layout, self.chain[0])[name]
        t = _cast(t, self.chain[:-1])
        nbytes = t.numel() * self.chain[-1].itemsize
        if self.out is None or dtype != self.chain[-1] or self.out.numel() < nbytes or self.out.device != t.device:
            return t.to(self.chain[-1]).to(dtype)
        out = self.out[:nbytes].view(dtype).view(t.shape)
        return out.copy_(t)  # the last cast, as `.to` rounds

    def linear(self, x: torch.Tensor, name: str, transposed: bool) -> torch.Tensor:
        # x [..., in] -> [..., out]
        x2 = x.reshape(-1, x.shape[-1])  # [T, in]
        y = dense_linear(x2, self.weight(name, x.dtype), transposed)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def raw(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A tensor stored as the model holds it (a bias), as a fresh tensor of `dtype`."""
        return _cast(self.bound.raw(name, self.chain[0]), self.chain).to(dtype)
