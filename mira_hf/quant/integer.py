"""The int8 and int4 codecs: mira-hf's group-wise format (`mira_hf.quant.groupwise` has the maths).

Fused dequant-matmul kernels (`mira_hf.quant.triton_kernels`) serve few-token matmuls on CUDA; the
torch reference serves the rest and every CPU record.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ConfigError
from .base import RecordCodec, check_options
from .groupwise import QuantSpec, dequantize_torch, importance, quantize_entry, resolve_calib
from .padding import PaddedCodec
from .record import PackedLayout, TensorEntry, build_layout, dense_linear, raw_tensor

# Fused dequant-matmul pays off while the weight read dominates: up to this many tokens the
# kernel reads the codes once per 16-token tile; beyond it, one dequant + cuBLAS is faster.
FUSED_MAX_TOKENS = 16


class PackedCodec(RecordCodec):
    """Group-wise int8/int4 codec over the packed record (see `mira_hf.quant.groupwise` for the format).
    backend: "auto" (Triton kernels for CUDA records when triton is importable), "torch" or "triton"."""

    supports_calib = True

    def __init__(self, spec: QuantSpec, backend: str = "auto") -> None:
        if not isinstance(spec, QuantSpec):
            raise ConfigError(f"PackedCodec needs a QuantSpec, got {type(spec).__name__}.")
        super().__init__(backend)
        self.spec = spec
        self.name = spec.fmt

    @classmethod
    def for_format(cls, fmt: str, /, **options: Any) -> PackedCodec:
        """The codec of `fmt` ("int8", "int4"); `options`: QuantSpec's fields and `backend`."""
        if "fmt" in options:
            raise ConfigError(f"make_codec({fmt!r}) takes no fmt= (the name is the format).")
        options = check_options(options, QuantSpec, fmt, extra=("backend",))
        backend = options.pop("backend", "auto")
        return cls(QuantSpec(fmt=fmt, **options), backend=backend)

    def __repr__(self) -> str:
        return f"PackedCodec({self.spec})"

    def _sections(self, shape: tuple[int, ...]) -> list[tuple[str, int, bool]]:
        spec = self.spec
        numel = math.prod(shape)
        n_groups = numel // spec.group_size
        parts = [("codes", numel * spec.bits // 8, True)]
        if spec.double_quant:
            n_sb = -(-n_groups // spec.superblock_groups)
            parts.append(("stats", n_groups * spec.stats_bytes_per_group, False))
            parts.append(("superblocks", n_sb * 8, False))
        else:
            parts.append(("scales", n_groups * 2, False))
            if not spec.symmetric:
                parts.append(("zeros", n_groups, False))
        return parts

    def plan(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> PackedLayout:
        """Layout of one expert record for tensors {name: (shape, dtype)}; allocates nothing."""
        s = self.spec
        return build_layout(self.name, s.fmt, s.flags, s.group_size, s.superblock_groups, specs, self._sections)

    def layout_identity(self) -> dict[str, object]:
        s = self.spec
        return dict(codec=self.name, fmt=s.fmt, flags=s.flags, group_size=s.group_size, superblock_groups=s.superblock_groups)

    def calib_by_name(self, calib, layout: PackedLayout) -> dict[str, torch.Tensor]:
        """calib: optional activations [N, in] feeding the weights (a Tensor applies to every weight whose
        last dim equals its width; a mapping gives them per tensor name). Used to weight the refinement's
        error by E[x^2] per input channel; needs refine_iters > 0."""
        return resolve_calib(calib, layout)

    def encode_entry(self, t: torch.Tensor, entry: TensorEntry, out: torch.Tensor, calib: torch.Tensor | None) -> None:
        quantize_entry(t, entry, self.spec, out, importance(calib, entry, self.spec.group_size))

    def decode_entry(self, record, entry, dtype, dst, use_triton) -> torch.Tensor:
        if not entry.quantized:
            w = raw_tensor(record, entry, dtype)
        elif use_triton:
            from . import triton_kernels

            return triton_kernels.dequantize(record, entry, self.spec, dtype, dst)
        else:
            w = dequantize_torch(record, entry, self.spec, dtype)
        return w if dst is None else dst.copy_(w)

    def matmul(self, x2, record, entry, transposed, use_triton, scratch) -> torch.Tensor:
        """Up to FUSED_MAX_TOKENS tokens on CUDA a fused Triton dequant-matmul reads the codes directly;
        otherwise the tensor is dequantised to a temporary and multiplied."""
        if entry.quantized and x2.shape[0] <= FUSED_MAX_TOKENS and use_triton:
            from . import triton_kernels

            return triton_kernels.linear(x2, record, entry, self.spec, transposed)
        if not entry.quantized:
            w = raw_tensor(record, entry, x2.dtype)
        else:
            w = dequantize_torch(record, entry, self.spec, x2.dtype)
        return dense_linear(x2, w, transposed)


def for_config(fmt: str, quant) -> PaddedCodec:
    """The codec of a model configured with `quant` (QuantConfig): padded to its group size, so any shape fits."""
    return PaddedCodec(PackedCodec(QuantSpec(fmt=fmt, group_size=quant.group_size)), quant.group_size)
