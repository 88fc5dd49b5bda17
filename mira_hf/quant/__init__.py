"""Compressed expert transfer format: one packed uint8 record per expert.

The runtime calls an `ExpertCodec`:

    codec = make_codec("int4")                     # or "int8", "nf4", "lossless"; kwargs -> QuantSpec
    layout = codec.plan({"gate_up_proj": ([2 * I, H], torch.bfloat16), ...})
    # lossless: the layout depends on the weights: codec.plan_experts({"gate_up_proj": [E, 2I, H], ...})
    codec.encode(tensors, layout, pinned_record)    # host, load time
    codec.decode(cuda_record, layout, torch.bfloat16, out=cache_slot)   # placement (a)
    codec.linear(x, cuda_record, layout, "down_proj", transposed=False) # placement (b)

Format and its metadata arithmetic: `mira_hf.quant.packed`; the bit-exact format:
`mira_hf.quant.lossless`. Triton kernels
(`mira_hf.quant.triton_kernels`) and bitsandbytes (`mira_hf.quant.nf4`) are imported only when
used.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .lossless import LosslessCodec
from .packed import (
    ALIGN_BYTES,
    FUSED_MAX_TOKENS,
    HEADER_BYTES,
    CodecInputError,
    ExpertCodec,
    PackedCodec,
    PackedLayout,
    QuantSpec,
    Section,
    TensorEntry,
    pack_expert,
    tensor_specs,
    triton_available,
    validate_record,
)

SUPPORTED_CODECS = ("int8", "int4", "nf4", "lossless")
# Formats of pre-quantized checkpoints, served in their own bytes (`mira_hf.quant.native`): never encoded into.
NATIVE_CODECS = ("fp8_block", "mxfp4")

__all__ = [
    "ALIGN_BYTES",
    "FUSED_MAX_TOKENS",
    "HEADER_BYTES",
    "NATIVE_CODECS",
    "SUPPORTED_CODECS",
    "LosslessCodec",
    "CodecInputError",
    "ExpertCodec",
    "Nf4Codec",
    "PackedCodec",
    "PackedLayout",
    "QuantSpec",
    "Section",
    "TensorEntry",
    "make_codec",
    "pack_expert",
    "tensor_specs",
    "triton_available",
    "validate_record",
]


def make_codec(name: str | None, **kw: Any) -> ExpertCodec:
    """The codec called `name` ("int8", "int4", "nf4", "lossless", or one of NATIVE_CODECS); `kw` go to
    QuantSpec (int8/int4: group_size, symmetric, double_quant, refine_iters, superblock_groups) or Nf4Codec
    (group_size); "lossless" takes `code` ("nibble" or "classes"); the native codecs take what the checkpoint
    says (`pieces`, fp8_block's `block_size`). nf4 needs bitsandbytes: pip install "mira-hf[quant]".
    """
    if name in ("int8", "int4"):
        if "fmt" in kw:
            raise ConfigError(f"make_codec({name!r}) takes no fmt= (the name is the format).")
        return PackedCodec(QuantSpec(fmt=name, **_known(kw, QuantSpec, name)))
    if name == "nf4":
        from .nf4 import Nf4Codec

        return Nf4Codec(**_known(kw, Nf4Codec, name))
    if name == "lossless":
        return LosslessCodec(**_known(kw, LosslessCodec, name))
    if name == "fp8_block":  # pieces, block_size: from the checkpoint (mira_hf.checkpoint.plan_native_keys)
        from .fp8_block import Fp8BlockCodec

        return Fp8BlockCodec(**_known(kw, Fp8BlockCodec, name))
    if name == "mxfp4":
        from .mxfp4 import Mxfp4Codec

        return Mxfp4Codec(**_known(kw, Mxfp4Codec, name))
    hint = " None means no compression, which the runtime's identity codec handles." if name is None else ""
    raise ConfigError(f"codec {name!r} is not a compressed format; supported: {list(SUPPORTED_CODECS)}.{hint}")


def _known(kw: dict[str, Any], target: Any, name: str) -> dict[str, Any]:
    import inspect

    accepted = [p for p in inspect.signature(target).parameters if p not in ("self", "fmt")]
    unknown = sorted(set(kw) - set(accepted))
    if unknown:
        raise ConfigError(f"codec {name!r} got unknown options {unknown}; it accepts {accepted}.")
    return kw


def __getattr__(name: str) -> Any:
    if name == "Nf4Codec":  # lazy: importing it needs bitsandbytes
        from .nf4 import Nf4Codec

        return Nf4Codec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
