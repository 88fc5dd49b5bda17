"""The built-in formats, registered when `mira_hf.quant` is imported: one entry each, pointing at the
module that implements it (imported when its first codec is built, so `MiraConfig` and `mira --help`
never import torch). A format of your own registers the same way (`docs/ARCHITECTURE.md`, "How do I
add a codec").
"""

from __future__ import annotations

from .registry import CodecEntry, Lazy, register_codec

# The lossless format's exponent codes (`mira_hf.quant.lossless`; QuantConfig.lossless_code).
LOSSLESS_CODES = ("nibble", "classes")
GROUP_SIZES = (16, 32, 64, 128, 256, 512, 1024)  # weights per scale of the record formats: powers of two, as Triton tiles need
NF4_INSTALL_HINT = "pip install \"mira-hf[quant]\", or use quantization='int4' (mira-hf's own format, no dependency)"

_Q = "mira_hf.quant."

# Format codes are the header byte of the records on disk: never change or reuse one.
BUILTIN = (
    CodecEntry("int8", Lazy(_Q + "integer:PackedCodec.for_format", "int8"), Lazy(_Q + "integer:for_config", "int8"), 1),
    CodecEntry("int4", Lazy(_Q + "integer:PackedCodec.for_format", "int4"), Lazy(_Q + "integer:for_config", "int4"), 2),
    CodecEntry("nf4", Lazy(_Q + "nf4:Nf4Codec"), Lazy(_Q + "nf4:for_config"), 3, requires=("bitsandbytes", NF4_INSTALL_HINT)),
    # "packed" by default: more experts per budget, measured faster (benchmarks/NOTES.md, "Transfer formats")
    CodecEntry(
        "lossless",
        Lazy(_Q + "lossless:LosslessCodec"),
        Lazy(_Q + "lossless:for_config"),
        4,
        exact=True,
        default_placement="packed",
    ),
    # pre-quantized checkpoints' own bytes, decoded as transformers dequantizes them
    CodecEntry("fp8_block", Lazy(_Q + "fp8_block:Fp8BlockCodec"), exact=True, role="native"),
    CodecEntry("mxfp4", Lazy(_Q + "mxfp4:Mxfp4Codec"), exact=True, role="native"),
)

for _entry in BUILTIN:
    register_codec(_entry)
