"""FP8 fine-grained checkpoints (`quant_method: "fp8"` with `weight_block_size`): DeepSeek-V3/R1, Qwen3-*-FP8,
GLM-4.5-FP8, MiniMax-M2.

Each expert weight is stored as `float8_e4m3fn [out, in]` with `weight_scale_inv` float32
`[ceil(out / bm), ceil(in / bn)]`; the weight is the stored value times its block's scale. A record
holds one expert's weights (`gate_up_proj`: the checkpoint's `gate_proj` and `up_proj` rows, one after
the other) and scales (`gate_up_proj_scale_inv`, likewise): 1 byte per weight plus 4 per block, about
0.5x of bf16's bytes.

Decoding (placement "dequant", the default) repeats transformers' `Fp8Dequantize` for each checkpoint
tensor: the block size is the tensor's shape over its scale grid, and the weight is
`(fp8.float() * scale.float()).to(dtype)`, one float32 product per element, so the same bits on every
device. That is what transformers computes where it dequantizes at load (a CPU, GPUs below compute
capability 8.9, or `FineGrainedFP8Config(dequantize=True)`); the other weights are loaded that way too.

On a GPU where transformers computes FP8 natively (compute capability ≥ 8.9, its kernels loadable),
`QuantConfig(placement="packed")` keeps records packed in their slots (half of bf16's bytes: twice the
experts per budget) and runs each projection through transformers' own `fp8_linear` (DeepGEMM or the
finegrained-fp8 Triton kernel, the call its FP8 experts make per expert) on the record's weight and
scales; the non-expert weights stay dequantized, so the model is neither transformers' native FP8 load
nor its dequantized one (benchmarks/quant_native_check.py measures both differences on a GPU).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .native import NativeCodec, split_rows
from .record import CodecInputError

SCALE_SUFFIX = "_scale_inv"


class Fp8BlockCodec(NativeCodec):
    """Experts of an FP8 block-scaled checkpoint, in its bytes. `block_size`: the checkpoint's
    `weight_block_size` (what transformers' kernels are given); `pieces`: see `NativeLayout`."""

    name = "fp8_block"
    dequantized_config = "FineGrainedFP8Config(dequantize=True)"
    scale_suffix = SCALE_SUFFIX

    def __init__(self, pieces: Mapping[str, int] | None = None, block_size: list[int] | None = None) -> None:
        super().__init__(pieces)
        self.block_size = list(block_size) if block_size is not None else None

    def __repr__(self) -> str:
        return f"Fp8BlockCodec(pieces={self.pieces}, block_size={self.block_size})"

    def record_specs(self, name, shape, weight, scales, pieces):
        fp8 = getattr(torch, "float8_e4m3fn", None)
        if weight.dtype != fp8:
            raise CodecInputError(f"fp8_block: {name} is {weight.dtype} in the checkpoint, expected float8_e4m3fn.")
        if tuple(weight.shape) != shape:
            raise CodecInputError(f"fp8_block: {name} is {list(weight.shape)} in the checkpoint, the model holds {list(shape)}.")
        if scales.dim() != 2 or not scales.dtype.is_floating_point:
            raise CodecInputError(f"fp8_block: {name}{SCALE_SUFFIX} is {scales.dtype} {list(scales.shape)}, expected 2-D float.")
        rows, cols = shape[0] // pieces, shape[1]
        s_rows = scales.shape[0] // pieces
        if shape[0] % pieces or scales.shape[0] % pieces or rows % s_rows or cols % scales.shape[1]:
            raise CodecInputError(  # transformers refuses these too (Fp8Dequantize)
                f"fp8_block: {name} ({pieces} x [{rows}, {cols}]) is not divisible by its scale grid {list(scales.shape)}: "
                "each block of weights must be the same size, as transformers dequantizes them (it refuses this "
                "checkpoint too). Use a checkpoint whose expert widths are multiples of its weight_block_size, or its "
                "bf16 release."
            )
        return {name: (shape, fp8), name + SCALE_SUFFIX: (tuple(scales.shape), torch.float32)}

    def dequantize(self, views, name, pieces, dtype):
        weights, scales = split_rows(views[name], pieces), split_rows(views[name + SCALE_SUFFIX], pieces)
        parts = [dequantize_fp8(w, s, dtype) for w, s in zip(weights, scales)]  # each as transformers dequantizes it
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    # -- native compute (placement "packed") ----------------------------------------------------
    def computes_natively(self, device: torch.device) -> bool:
        """Where transformers keeps FP8 weights and computes with FP8 kernels: CUDA compute capability ≥ 8.9
        (below it, it dequantizes to bf16), with its kernels loadable (DeepGEMM or finegrained-fp8)."""
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            return False
        return fp8_kernels_available()

    def matmul(self, x2: torch.Tensor, views, name: str, transposed: bool) -> torch.Tensor:
        """x2 [T, in] @ W.T with W the record's FP8 `name` and its block scales, through transformers'
        `fp8_linear` (the call its FP8 experts make per expert): [T, in] -> [T, out]."""
        from transformers.integrations.finegrained_fp8 import fp8_linear

        if transposed:
            raise CodecInputError("fp8_block.linear: FP8 checkpoints hold weights as [out, in]; transposed experts are not FP8.")
        w = views[name]  # [out, in] float8_e4m3fn
        if x2.shape[-1] != w.shape[1]:
            raise CodecInputError(f"fp8_block.linear: x is {tuple(x2.shape)} but {name} {tuple(w.shape)} takes in={w.shape[1]}.")
        return fp8_linear(x2, w, views[name + SCALE_SUFFIX], self.block_size)  # [T, out]


def dequantize_fp8(weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight float8_e4m3fn [rows, cols], scales float32 [sr, sc] -> [rows, cols] in `dtype`, exactly as
    transformers' `Fp8Dequantize._dequantize_one`: blocks of rows/sr x cols/sc, one float32 product each."""
    rows, cols = weight.shape
    sr, sc = scales.shape
    q = weight.to(torch.float32).reshape(-1, sr, rows // sr, sc, cols // sc)  # [1, sr, bm, sc, bn]
    s = scales.to(torch.float32).reshape(-1, sr, sc).unsqueeze(-1).unsqueeze(2)  # [1, sr, 1, sc, 1]
    return (q * s).to(dtype).reshape(rows, cols)


def fp8_kernels_available() -> bool:
    """Whether transformers' FP8 kernels load here (DeepGEMM, else the finegrained-fp8 Triton kernel)."""
    try:
        from transformers.integrations.deepgemm import is_deepgemm_loadable
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel
    except ImportError:
        return False
    try:
        if is_deepgemm_loadable():
            return True
    except Exception:  # a broken DeepGEMM install: transformers falls back to Triton too
        pass
    try:
        load_finegrained_fp8_kernel()
        return True
    except Exception:  # not installed, no build for this torch/CUDA, or the hub unreachable
        return False
