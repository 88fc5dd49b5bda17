"""FP8 block-scaled weights whose shape is not a multiple of the block: loaded by mira-hf, not by transformers.

An FP8 fine-grained checkpoint scales each `weight_block_size` block (DeepSeek-V3: 128 x 128) of a weight
`[out, in]` by one entry of `weight_scale_inv [ceil(out / bm), ceil(in / bn)]`; where `out` or `in` is not a
multiple of the block, the last row or column of blocks is partial. DeepSeek-V3/R1 ship such a weight in every
layer: `self_attn.kv_a_proj_with_mqa` is `[kv_lora_rank + qk_rope_head_dim, hidden] = [576, 7168]` with scales
`[5, 56]`. transformers' dequantize path (`Fp8Dequantize`, taken on a CPU, on GPUs below compute capability 8.9
and with `dequantize=True`, which the expert-streaming load uses for the non-expert weights) derives the block
from the shape over the scale grid and refuses these weights ("not divisible by scale grid"), failing the load.
Where the grid happens to divide the shape, transformers dequantizes with the block that division gives; a wrapped
model keeps that (its outputs are transformers' for the checkpoint), and only the weights transformers refuses are
loaded here.

So the expert-streaming load removes these weights from the model before transformers reads the checkpoint (as
it removes the experts), and sets them afterwards, dequantized here with the checkpoint's own block size: the
weight is the stored value times its block's scale, one float32 product per element, exactly what
`Fp8Dequantize` computes for the weights whose shape is a multiple of the block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE = "_scale_inv"  # `<name>.weight` -> `<name>.weight_scale_inv`


@dataclass(frozen=True)
class PartialBlockWeight:
    """One model parameter (`module`.`tensor`, also its checkpoint key) whose blocks do not tile its shape."""

    module: str
    tensor: str
    dtype: torch.dtype  # the model's dtype for it
    requires_grad: bool

    @property
    def key(self) -> str:
        return f"{self.module}.{self.tensor}" if self.module else self.tensor


def block_size(quantization: dict | None) -> tuple[int, int] | None:
    """The checkpoint's FP8 block (rows, cols) from config.json's `quantization_config`; None if not block-scaled FP8."""
    if not quantization or quantization.get("quant_method") != "fp8":
        return None
    block = quantization.get("weight_block_size")
    return (int(block[0]), int(block[1])) if block and len(block) == 2 else None


def find_partial_block_weights(model: torch.nn.Module, index, block: tuple[int, int]) -> list[PartialBlockWeight]:
    """The 2-D FP8 weights of `model` (by their checkpoint keys in `index`, a `ShardIndex`) whose shape is not a
    multiple of `block` and whose scales are the ceil-divided grid the block gives."""
    bm, bn = block
    found = []
    for name, p in model.named_parameters():
        w, s = index.entries.get(name), index.entries.get(name + SCALE)
        if w is None or s is None or len(w.shape) != 2 or len(s.shape) != 2 or tuple(p.shape) != w.shape:
            continue
        rows, cols = w.shape
        if rows % bm == 0 and cols % bn == 0:
            continue  # transformers dequantizes it
        if rows % s.shape[0] == 0 and cols % s.shape[1] == 0:
            continue  # transformers dequantizes it too (with the block the grid divides into): its bits are the reference
        if s.shape != (-(-rows // bm), -(-cols // bn)):
            continue  # not this layout: left to transformers, which reports it
        module, _, tensor = name.rpartition(".")
        found.append(PartialBlockWeight(module, tensor, p.dtype, p.requires_grad))
    return found


def dequantize_partial_blocks(
    weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """weight float8 [rows, cols], scales float32 [ceil(rows/bm), ceil(cols/bn)] -> [rows, cols] in `dtype`:
    each element times its block's scale, one float32 product each (the last blocks partial)."""
    bm, bn = block
    rows, cols = weight.shape
    sr, sc = scales.shape
    padded = torch.zeros(sr * bm, sc * bn, dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.to(torch.float32)
    q = padded.view(sr, bm, sc, bn)  # [sr, bm, sc, bn]
    s = scales.to(device=weight.device, dtype=torch.float32)[:, None, :, None]  # [sr, 1, sc, 1]
    return (q * s).to(dtype).view(sr * bm, sc * bn)[:rows, :cols].contiguous()


def set_partial_block_weights(model: torch.nn.Module, weights: list[PartialBlockWeight], index, block) -> None:
    """Read each of `weights` and its scales from the checkpoint and set it on `model`, dequantized, on the device
    of the nearest weights transformers loaded (those of its module, else of the module holding it, and so on)."""
    from safetensors import safe_open

    for w in weights:
        tensors = {}
        for key in (w.key, w.key + SCALE):
            with safe_open(index.entries[key].file, framework="pt") as f:
                tensors[key] = f.get_tensor(key)
        value = dequantize_partial_blocks(tensors[w.key], tensors[w.key + SCALE], block, w.dtype)
        setattr(
            model.get_submodule(w.module),
            w.tensor,
            torch.nn.Parameter(value.to(_device_near(model, w.module)), requires_grad=w.requires_grad),
        )


def _device_near(model: torch.nn.Module, module: str) -> torch.device:
    parts = module.split(".") if module else []
    for depth in range(len(parts), -1, -1):
        for p in model.get_submodule(".".join(parts[:depth])).parameters():
            if p.device.type != "meta":
                return p.device
    return torch.device("cpu")
