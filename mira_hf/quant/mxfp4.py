"""MXFP4 checkpoints (`quant_method: "mxfp4"`): gpt-oss-20b and gpt-oss-120b.

A layer's experts are stored as `<tensor>_blocks` uint8 `[E, out, in/32, 16]` (two e2m1 codes per
byte, the even element in the low nibble) and `<tensor>_scales` uint8 `[E, out, in/32]` (an e8m0
exponent per block of 32, bias 127), for `gate_up_proj` and `down_proj`; biases stay bf16. A record
holds one expert's blocks, scales and biases: 17 bytes per 32 weights plus the biases, about 0.27x
of bf16's bytes.

Decoding repeats transformers' `convert_moe_packed_tensors` (its `Mxfp4Config(dequantize=True)` path,
which it takes on a CPU, without Triton or the `kernels` package, or on GPUs below compute capability
7.5): a lookup of each code in the e2m1 table held in the model dtype, then `torch.ldexp` by the block
exponent into that dtype, then the transpose to transformers' `[E, in, out]` layout. Element-wise, so
one expert at a time gives the same bits as transformers' whole-layer pass. Where transformers runs
its Triton MXFP4 kernels instead (`Mxfp4GptOssExperts`, from the hub's gpt-oss-triton-kernels), records
are still decoded this way: those kernels need the weights swizzled per GPU and routed for all experts
of a layer at once, which does not fit one record per expert.
"""

from __future__ import annotations

import torch

from .native import NativeCodec
from .record import CodecInputError

SCALE_SUFFIX = "_scales"
# transformers.integrations.mxfp4.FP4_VALUES: the e2m1 values by code.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class Mxfp4Codec(NativeCodec):
    """Experts of an MXFP4 checkpoint, in its bytes."""

    name = "mxfp4"
    dequantized_config = "Mxfp4Config(dequantize=True)"
    scale_suffix = SCALE_SUFFIX

    def __init__(self, pieces=None) -> None:
        super().__init__(pieces)
        self._luts: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def record_specs(self, name, shape, weight, scales, pieces):
        if pieces != 1:
            raise CodecInputError(f"mxfp4: {name} is stored as {pieces} tensors; MXFP4 checkpoints store one per weight.")
        if weight.dtype != torch.uint8 or weight.dim() != 3 or weight.shape[-1] != 16:
            raise CodecInputError(
                f"mxfp4: {name}_blocks is {weight.dtype} {list(weight.shape)}, expected uint8 [out, in/32, 16]."
            )
        if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(weight.shape[:2]):
            raise CodecInputError(
                f"mxfp4: {name}{SCALE_SUFFIX} is {scales.dtype} {list(scales.shape)}, expected uint8 {list(weight.shape[:2])}."
            )
        out, groups = weight.shape[:2]
        if tuple(shape) != (groups * 32, out):  # transformers dequantizes to [in, out] (x @ W)
            raise CodecInputError(f"mxfp4: {name} dequantizes to [{groups * 32}, {out}], the model holds {list(shape)}.")
        return {name: (tuple(weight.shape), torch.uint8), name + SCALE_SUFFIX: (tuple(scales.shape), torch.uint8)}

    def dequantize(self, views, name, pieces, dtype):
        return dequantize_mxfp4(views[name], views[name + SCALE_SUFFIX], dtype, self._lut(dtype, views[name].device))

    def _lut(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (dtype, device)
        if key not in self._luts:  # made once per device: no host copy at each decode
            self._luts[key] = torch.tensor(FP4_VALUES, dtype=dtype, device=device)
        return self._luts[key]


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, lut: torch.Tensor | None = None
) -> torch.Tensor:
    """blocks uint8 [out, G, 16], scales uint8 [out, G] -> [G*32, out] in `dtype`, with the ops of
    transformers' `_convert_moe_packed_tensors` (one expert: the [E, ...] pass is element-wise)."""
    if lut is None:
        lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    out_rows, groups, b = blocks.shape
    exp = (scales.to(torch.int32) - 127).reshape(out_rows * groups, 1)  # [rows, 1]
    blk = blocks.reshape(out_rows * groups, b)  # [rows, 16]
    sub = torch.empty(out_rows * groups, b * 2, dtype=dtype, device=blocks.device)  # [rows, 32]
    sub[:, 0::2] = lut[(blk & 0x0F).to(torch.int)]
    sub[:, 1::2] = lut[(blk >> 4).to(torch.int)]
    torch.ldexp(sub, exp, out=sub)
    return sub.view(out_rows, groups * b * 2).t()  # [in, out]
