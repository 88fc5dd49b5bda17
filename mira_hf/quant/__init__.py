"""Expert transfer formats: one record per expert, one registered codec per format.

    codec = make_codec("int4")                     # a registered name; keywords are the codec's options
    layout = codec.plan({"gate_up_proj": ([2 * I, H], torch.bfloat16), ...})
    codec.encode(tensors, layout, pinned_record)    # host, load time
    codec.decode(cuda_record, layout, torch.bfloat16, out=cache_slot)   # placement "dequant"
    codec.bind(cuda_record, layout).linear(x, "down_proj", False)       # placement "packed"

Modules, lowest first: `registry` (the formats; imports nothing), `formats` (the built-in entries),
`record` (the packed record's layout, header and checks), `groupwise` and `lossless_bits` (maths),
`base` (the `ExpertCodec` protocol and the shared codec base), then one module per format: `integer`
(int8, int4), `nf4` (bitsandbytes, imported when a codec is built), `lossless`, `fp8_block` and `mxfp4`
(pre-quantized checkpoints' own bytes, over `native`). `padding` fits group-wise codecs to any shape;
`triton_kernels` is imported only when a CUDA record is computed. Uncompressed records
(`quantization=None`) are `mira_hf.layout.IdentityCodec`'s.

Importing this package imports no torch: the codecs and the names below are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .formats import GROUP_SIZES, LOSSLESS_CODES
from .registry import (
    CodecEntry,
    CodecRegistryError,
    Lazy,
    codec_names,
    find_codec_entry,
    format_codes,
    get_codec_entry,
    is_native,
    register_codec,
    unregister_codec,
)

if TYPE_CHECKING:
    from .base import ExpertCodec

# name -> the module that defines it, imported on first use (torch comes with them)
_LAZY = {
    **dict.fromkeys(("ALIGN_BYTES", "HEADER_BYTES", "CodecInputError", "PackedLayout", "Section", "TensorEntry"), "record"),
    **dict.fromkeys(("tensor_specs", "validate_record"), "record"),
    **dict.fromkeys(("BoundRecord", "ExpertCodec", "RecordCodec", "check_options", "pack_expert", "resolve_backend"), "base"),
    "triton_available": "base",
    "QuantSpec": "groupwise",
    "FUSED_MAX_TOKENS": "integer",
    "PackedCodec": "integer",
    "LosslessCodec": "lossless",
    "Nf4Codec": "nf4",
}

__all__ = [
    "GROUP_SIZES",
    "LOSSLESS_CODES",
    "CodecEntry",
    "CodecRegistryError",
    "Lazy",
    "codec_for_config",
    "codec_names",
    "find_codec_entry",
    "format_codes",
    "get_codec_entry",
    "is_native",
    "make_codec",
    "register_codec",
    "unregister_codec",
    *_LAZY,
]


def make_codec(name: str | None, **options: Any) -> ExpertCodec:
    """The codec registered as `name` ("int8", "int4", "nf4", "lossless", "fp8_block", "mxfp4", or one of
    yours), built with its `options`: int8/int4: QuantSpec's fields (group_size, symmetric, double_quant,
    refine_iters, superblock_groups) and backend; nf4: group_size (needs bitsandbytes: pip install
    "mira-hf[quant]"); lossless: code ("nibble" or "classes") and backend; the native formats: what the
    checkpoint says (`pieces`, fp8_block's `block_size`)."""
    entry = find_codec_entry(name)
    if entry is None:
        hint = " None means no compression, which the runtime's identity codec handles." if name is None else ""
        raise ConfigError(f"codec {name!r} is not a compressed format; supported: {codec_names('encoded')}.{hint}")
    factory = entry.factory.resolve() if isinstance(entry.factory, Lazy) and not entry.factory.args else entry.factory
    if not _takes_any(factory):  # else the factory checks its options itself
        from .base import check_options

        check_options(options, factory, name)
    return entry.factory(**options)


def codec_for_config(quantization: str | None, quant_config: Any) -> Any:
    """The codec a model configured with `MiraConfig(quantization=..., quant=quant_config)` stores its
    experts with: the registered format's, built from the config; None: the checkpoint's bytes."""
    if quantization is None:
        from ..layout import IdentityCodec

        return IdentityCodec()
    return get_codec_entry(quantization).build(quant_config)


def _takes_any(factory: Any) -> bool:
    """Whether `factory` takes arbitrary keywords (it checks its options itself)."""
    import inspect

    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind == p.VAR_KEYWORD for p in params)


def __getattr__(name: str) -> Any:
    # Lists read from the registry each time (formats registered later count): one list per concept.
    if name == "FMT_CODES":
        return format_codes()
    if name == "SUPPORTED_CODECS":  # the formats weights are encoded into
        return tuple(codec_names("encoded"))
    if name == "NATIVE_CODECS":  # pre-quantized checkpoints' own formats, served as stored
        return tuple(codec_names("native"))
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
