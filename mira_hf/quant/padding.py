"""Zero-padding for weights whose contiguous dimension is not a multiple of the group size.

The packed format needs whole groups. Real checkpoints nearly always have such sizes (Mixtral's
14336, Qwen3's 768, gpt-oss's 2880 are multiples of 64); small or unusual models (the bundled
`mira-tiny` has 232) are served by padding those weights with zero columns at load time. A padded
input column multiplies zeros, a padded output column is dropped: results equal the unpadded ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PaddedLayout:
    inner: object  # the wrapped codec's layout (of the padded tensors)
    shapes: dict  # name -> original shape
    padded: dict  # name -> padded last dim, for the tensors that were padded

    def __getattr__(self, name):  # nbytes, payload_bytes, meta_bytes, meta_share, entries, entry, ...
        return getattr(self.inner, name)


class PaddedCodec:
    """A packed codec that accepts any 2-D shape by zero-padding the contiguous dimension."""

    def __init__(self, inner, group_size: int) -> None:
        self.inner, self.group_size = inner, group_size
        self.name = inner.name
        self.exact, self.supports_calib = inner.exact, inner.supports_calib

    def __repr__(self) -> str:
        return f"PaddedCodec({self.inner!r})"

    def validate(self, record: torch.Tensor, layout: PaddedLayout) -> None:
        self.inner.validate(record, layout.inner)

    def record_bytes(self, layout: PaddedLayout) -> int:
        return layout.nbytes

    def plan(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> PaddedLayout:
        g = self.group_size
        padded, inner_specs = {}, {}
        for name, (shape, dtype) in specs.items():
            shape = tuple(shape)
            if len(shape) == 2 and shape[-1] % g:
                padded[name] = -(-shape[-1] // g) * g
                shape = (shape[0], padded[name])
            inner_specs[name] = (shape, dtype)
        return PaddedLayout(self.inner.plan(inner_specs), {n: tuple(s) for n, (s, _) in specs.items()}, padded)

    def encode(self, tensors: Mapping[str, torch.Tensor], layout: PaddedLayout, out: torch.Tensor, **kw) -> None:
        padded = {n: F.pad(t, (0, layout.padded[n] - t.shape[-1])) if n in layout.padded else t for n, t in tensors.items()}
        self.inner.encode(padded, layout.inner, out, **kw)

    def decode(self, record: torch.Tensor, layout: PaddedLayout, dtype: torch.dtype, out=None) -> dict[str, torch.Tensor]:
        direct = None if out is None else {n: t for n, t in out.items() if n not in layout.padded}
        full = self.inner.decode(record, layout.inner, dtype, out=direct)
        result = {}
        for name, t in full.items():
            if name in layout.padded:
                t = t[..., : layout.shapes[name][-1]]
                if out is not None and name in out:
                    out[name].copy_(t)
                    t = out[name]
            result[name] = t
        return result

    def linear(self, x: torch.Tensor, record: torch.Tensor, layout: PaddedLayout, name: str, transposed: bool) -> torch.Tensor:
        if name not in layout.padded:
            return self.inner.linear(x, record, layout.inner, name, transposed)
        if transposed:  # stored [in, out + pad]: drop the padded outputs
            return self.inner.linear(x, record, layout.inner, name, True)[..., : layout.shapes[name][-1]]
        # stored [out, in + pad]: zero inputs meet the zero columns
        return self.inner.linear(F.pad(x, (0, layout.padded[name] - x.shape[-1])), record, layout.inner, name, False)

    def bind(self, record: torch.Tensor, layout: PaddedLayout, scratch: torch.Tensor | None = None) -> BoundPadded:
        """The inner codec's bound record (checked once), padding and cropping as `linear` does."""
        return BoundPadded(self.inner.bind(record, layout.inner, scratch), layout)


class BoundPadded:
    """A bound record of a `PaddedCodec`: the per-token `linear` of `PaddedCodec.linear`."""

    __slots__ = ("inner", "shapes", "padded")

    def __init__(self, inner, layout: PaddedLayout) -> None:
        self.inner, self.shapes, self.padded = inner, layout.shapes, layout.padded

    def linear(self, x: torch.Tensor, name: str, transposed: bool) -> torch.Tensor:
        pad = self.padded.get(name)
        if pad is None:
            return self.inner.linear(x, name, transposed)
        if transposed:  # stored [in, out + pad]: drop the padded outputs
            return self.inner.linear(x, name, True)[..., : self.shapes[name][-1]]
        return self.inner.linear(F.pad(x, (0, pad - x.shape[-1])), name, False)  # zero inputs meet zero columns

    def weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor `name` decoded in `dtype`, its padding cut off (a view of the padded weight)."""
        t = self.inner.weight(name, dtype)
        return t[..., : self.shapes[name][-1]] if name in self.padded else t

    def raw(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self.inner.raw(name, dtype)
