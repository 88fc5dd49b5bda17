"""nf4 codec: bitsandbytes' 4-bit NormalFloat with nested (double-quantised) absmax, in the
same packed record as int8/int4.

Sections of a quantised tensor (n_blocks = numel / group_size):

    codes     uint8 [numel / 2]       bitsandbytes' packing (first element in the high nibble)
    absmax    uint8 [n_blocks]        absmax of each block, 8-bit dynamic-map codes
    nested    fp32  [1 + n_nested]    the absmax offset, then one fp32 absmax per 256 absmax codes

Metadata at group 64: (1 + 4/256) B per 32 B of codes = 3.2 %. The two code tables (the 16 nf4
levels and the 256-entry dynamic map) are fixed by bitsandbytes and rebuilt, never stored.

bitsandbytes is imported when a codec is built (`make_codec("nf4")`), not with this module.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch

from ..errors import ConfigError, IncompatibleFileError, MissingDependencyError
from .base import RecordCodec
from .padding import PaddedCodec
from .record import (
    FLAG_DOUBLE_QUANT,
    PackedLayout,
    TensorEntry,
    build_layout,
    check_group_size,
    dense_linear,
    raw_tensor,
    section_view,
)

# bitsandbytes quantises the block absmax values in blocks of 256 when compress_statistics=True.
_NESTED_BLOCK = 256
NF4_MIN_GROUP = 32  # bitsandbytes refuses smaller 4-bit blocks


def _bnb():
    """bitsandbytes.functional, imported when an nf4 codec is built (not with this module)."""
    try:
        import bitsandbytes.functional as bnbf
    except ImportError as exc:  # narrow: only a missing package becomes the install hint
        raise MissingDependencyError(
            'the nf4 codec needs bitsandbytes: pip install "mira-hf[quant]" (or pip install '
            'bitsandbytes); or use make_codec("int4"), which needs nothing extra.'
        ) from exc
    return bnbf


@functools.lru_cache(maxsize=8)
def _code_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(nf4 levels [16], dynamic map [256]) on `device`, built once per device."""
    bnbf = _bnb()
    nf4 = bnbf.get_4bit_type("nf4", device=device)
    dynamic = bnbf.create_dynamic_map(signed=True).to(device)
    return nf4, dynamic


class Nf4Codec(RecordCodec):
    """bitsandbytes nf4 (blocksize = group_size, compress_statistics=True) behind ExpertCodec."""

    name = "nf4"
    supports_calib = False  # bitsandbytes quantises by absmax; there is nothing to refine

    def __init__(self, group_size: int = 64) -> None:
        check_group_size(group_size, "Nf4Codec")
        if group_size < NF4_MIN_GROUP:
            raise ConfigError(
                f"quantization='nf4' with QuantConfig.group_size={group_size}: bitsandbytes' nf4 takes blocks of "
                f"{NF4_MIN_GROUP} weights and up. Use group_size={NF4_MIN_GROUP} or more (64 is the default), or int4."
            )
        super().__init__("torch")  # bitsandbytes' own kernels compute; no Triton here
        self._bnbf = _bnb()
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

    def layout_identity(self) -> dict[str, object]:
        return dict(codec=self.name, group_size=self.group_size)

    def calib_by_name(self, calib, layout: PackedLayout) -> dict[str, torch.Tensor]:
        if calib is not None:
            raise ConfigError(
                "the nf4 codec cannot use calib activations (bitsandbytes quantises by absmax); "
                'drop calib, or use make_codec("int4") whose refinement uses them.'
            )
        return {}

    def encode_entry(self, t: torch.Tensor, entry: TensorEntry, out: torch.Tensor, calib: torch.Tensor | None) -> None:
        """Quantise one weight with bitsandbytes into its sections of `out`."""
        q, state = self._bnbf.quantize_4bit(
            t.detach().to(entry.dtype).contiguous(),
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
        nested = self._bnbf.QuantState(absmax=stats[1:], code=dynamic, blocksize=_NESTED_BLOCK, dtype=torch.float32)
        return self._bnbf.QuantState(
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
        w = self._bnbf.dequantize_4bit(codes, self._state(record, entry, dtype))
        w = w.view(entry.shape)
        return w if dst is None else dst.copy_(w)

    def decode_entry(self, record, entry, dtype, dst, use_triton) -> torch.Tensor:
        if entry.quantized:
            return self._dequantize(record, entry, dtype, dst)
        w = raw_tensor(record, entry, dtype)
        return w if dst is None else dst.copy_(w)

    def matmul(self, x2, record, entry, transposed, use_triton, scratch) -> torch.Tensor:
        """Dequantises the one tensor to a temporary and multiplies (bitsandbytes' fused 4-bit GEMV is
        not used: it covers only the [out, in] layout at one token)."""
        w = self._dequantize(record, entry, x2.dtype) if entry.quantized else raw_tensor(record, entry, x2.dtype)
        return dense_linear(x2, w, transposed)


def for_config(quant) -> PaddedCodec:
    """The codec of a model configured with `quant` (QuantConfig): padded to its group size, so any shape fits."""
    return PaddedCodec(Nf4Codec(quant.group_size), quant.group_size)
