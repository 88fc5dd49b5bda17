"""nf4 codec: bitsandbytes' 4-bit NormalFloat with nested (double-quantised) absmax, in the
same packed record as int8/int4.

Sections of a quantised tensor (n_blocks = numel / group_size):

    codes     uint8 [numel / 2]       bitsandbytes' packing (first element in the high nibble)
    absmax    uint8 [n_blocks]        absmax of each block, 8-bit dynamic-map codes
    nested    fp32  [1 + n_nested]    the absmax offset, then one fp32 absmax per 256 absmax codes

Metadata at group 64: (1 + 4/256) B per 32 B of codes = 3.2 %. The two code tables (the 16 nf4
levels and the 256-entry dynamic map) are fixed by bitsandbytes and rebuilt, never stored.

Import this module only through `make_codec("nf4")`: it needs bitsandbytes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch

from ..errors import ConfigError, MissingDependencyError
from .packed import (
    FLAG_DOUBLE_QUANT,
    CodecInputError,
    IncompatibleFileError,
    PackedLayout,
    TensorEntry,
    _check_group_size,
    build_layout,
    check_record,
    decode_outputs,
    dense_linear,
    encode_outputs,
    linear_input,
    raw_tensor,
    section_view,
)

# bitsandbytes quantises the block absmax values in blocks of 256 when compress_statistics=True.
_NESTED_BLOCK = 256

try:
    import bitsandbytes.functional as bnbf
except ImportError as exc:  # narrow: only a missing package becomes the install hint
    raise MissingDependencyError(
        'the nf4 codec needs bitsandbytes: pip install "mira-hf[quant]" (or pip install '
        'bitsandbytes); or use make_codec("int4"), which needs nothing extra.'
    ) from exc


@functools.lru_cache(maxsize=8)
def _code_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(nf4 levels [16], dynamic map [256]) on `device`, built once per device."""
    nf4 = bnbf.get_4bit_type("nf4", device=device)
    dynamic = bnbf.create_dynamic_map(signed=True).to(device)
    return nf4, dynamic


class Nf4Codec:
    """bitsandbytes nf4 (blocksize = group_size, compress_statistics=True) behind ExpertCodec."""

    name = "nf4"
    supports_calib = False  # bitsandbytes quantises by absmax; there is nothing to refine

    def __init__(self, group_size: int = 64) -> None:
        _check_group_size(group_size, "Nf4Codec")
        self.group_size = group_size

    def __repr__(self) -> str:
        return f"Nf4Codec(group_size={self.group_size})"

    def _sections(self, shape: tuple[int, ...]) -> list[tuple[str, int, bool]]:
        numel = math.prod(shape)
        n_blocks = numel // self.group_size
        n_nested = -(-n_blocks // _NESTED_BLOCK)
        return [("codes", numel // 2, True), ("absmax", n_blocks, False), ("nested", 4 * (1 + n_nested), False)]

    def plan(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> PackedLayout:
        """Layout of one expert record for tensors {name: (shape, dtype)}; allocates nothing."""
        return build_layout(self.name, "nf4", FLAG_DOUBLE_QUANT, self.group_size, _NESTED_BLOCK, specs, self._sections)

    def _check_layout(self, layout: PackedLayout) -> None:
        if (layout.codec, layout.group_size) != (self.name, self.group_size):
            raise IncompatibleFileError(
                f"layout was planned by codec {layout.codec!r} (group {layout.group_size}); this is {self!r}. "
                "Plan and decode with the same codec."
            )

    def encode(
        self,
        tensors: Mapping[str, torch.Tensor],
        layout: PackedLayout,
        out: torch.Tensor,
        *,
        calib: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Quantise + pack one expert into `out` (uint8 [layout.nbytes])."""
        if calib is not None:
            raise ConfigError(
                "the nf4 codec cannot use calib activations (bitsandbytes quantises by absmax); "
                'drop calib, or use make_codec("int4") whose refinement uses them.'
            )
        self._check_layout(layout)
        encode_outputs(tensors, layout, out)
        for entry in layout.entries:
            t = tensors[entry.name].detach()
            if not entry.quantized:
                raw = t.to(entry.dtype).contiguous().reshape(-1).view(torch.uint8)
                section_view(out, entry.section("raw")).copy_(raw)
                continue
            q, state = bnbf.quantize_4bit(
                t.to(entry.dtype).contiguous(),
                blocksize=self.group_size,
                compress_statistics=True,
                quant_type="nf4",
                quant_storage=torch.uint8,
            )
            nested = state.state2
            if nested.blocksize != _NESTED_BLOCK or not torch.equal(nested.code.cpu(), _code_tables(torch.device("cpu"))[1]):
                raise IncompatibleFileError(
                    f"this bitsandbytes nests absmax in blocks of {nested.blocksize} with another code table; "
                    f"the nf4 record format expects blocks of {_NESTED_BLOCK} with the signed dynamic map. "
                    'Install bitsandbytes>=0.45 (pip install "mira-hf[quant]").'
                )
            section_view(out, entry.section("codes")).copy_(q.reshape(-1))
            section_view(out, entry.section("absmax")).copy_(state.absmax.reshape(-1))
            stats = section_view(out, entry.section("nested"), torch.float32)
            stats[:1] = state.offset.reshape(1).float()
            stats[1:] = nested.absmax.reshape(-1).float()

    def _state(self, record: torch.Tensor, entry: TensorEntry, dtype: torch.dtype):
        nf4_code, dynamic = _code_tables(record.device)
        stats = section_view(record, entry.section("nested"), torch.float32)
        nested = bnbf.QuantState(absmax=stats[1:], code=dynamic, blocksize=_NESTED_BLOCK, dtype=torch.float32)
        return bnbf.QuantState(
            absmax=section_view(record, entry.section("absmax")),
            shape=torch.Size(entry.shape),
            code=nf4_code,
            blocksize=self.group_size,
            quant_type="nf4",
            dtype=dtype,  # bitsandbytes dequantises straight into this dtype
            offset=stats[0],
            state2=nested,
        )

    def _dequantize(self, record, entry, dtype, dst=None) -> torch.Tensor:
        codes = section_view(record, entry.section("codes")).view(-1, 1)
        w = bnbf.dequantize_4bit(codes, self._state(record, entry, dtype))
        w = w.view(entry.shape)
        return w if dst is None else dst.copy_(w)

    def decode(
        self,
        record: torch.Tensor,
        layout: PackedLayout,
        dtype: torch.dtype,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Dequantise every tensor of the record to `dtype` on the record's device (bitsandbytes' kernels);
        `out` as in PackedCodec.decode."""
        self._check_layout(layout)
        out = decode_outputs(record, layout, dtype, out)
        result = {}
        for entry in layout.entries:
            dst = out.get(entry.name)
            if entry.quantized:
                result[entry.name] = self._dequantize(record, entry, dtype, dst)
            else:
                w = raw_tensor(record, entry, dtype)
                result[entry.name] = w if dst is None else dst.copy_(w)
        return result

    def linear(self, x: torch.Tensor, record: torch.Tensor, layout: PackedLayout, name: str, transposed: bool) -> torch.Tensor:
        """y = x @ W.T (or x @ W if transposed), x [..., in] -> [..., out] in x.dtype.

        Dequantises the one tensor to a temporary and multiplies (bitsandbytes' fused 4-bit GEMV is
        not used: it covers only the [out, in] layout at one token).
        """
        self._check_layout(layout)
        check_record(record, layout)
        entry = layout.entry(name)
        x2 = linear_input(x, entry, transposed, self.name)
        if entry.quantized:
            w = self._dequantize(record, entry, x.dtype)
        else:
            w = raw_tensor(record, entry, x.dtype)
        y = dense_linear(x2, w, transposed)
        return y.reshape(*x.shape[:-1], y.shape[-1])


__all__ = ["Nf4Codec", "CodecInputError"]
