"""Triton kernels over packed records: dequantise a tensor, and fused dequant + matmul.

Imported lazily by `packed.py` (triton is absent on CPU CI). Both kernels read the record's
sections in place, with the same arithmetic as the torch reference:

    s = exp2(a[g // SB] + c[g] * b[g // SB])      (double_quant)   or fp16 scale[g]
    w = (q - z[g]) * s                           computed in fp32, then cast

Under TRITON_INTERPRET=1 they also run on CPU tensors (used by the tests).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .packed import QuantSpec, TensorEntry, section_view


@triton.jit
def _group_stats(stats_ptr, sb_ptr, zeros_ptr, g, mask, SB,
                 BITS: tl.constexpr, DQ: tl.constexpr, SYM: tl.constexpr):  # fmt: skip
    """Scale and zero (fp32, shaped like g) of groups g; see packed.py for the byte layout."""
    if DQ:
        if SYM:
            c = tl.load(stats_ptr + g, mask=mask, other=0).to(tl.float32)
            z = tl.zeros_like(c) + ((1 << BITS) - 1) / 2
        elif BITS == 4:
            st = tl.load(stats_ptr + g, mask=mask, other=0).to(tl.int32)
            c = (st >> 4).to(tl.float32)
            z = (st & 15).to(tl.float32)
        else:
            z = tl.load(stats_ptr + 2 * g, mask=mask, other=0).to(tl.float32)
            c = tl.load(stats_ptr + 2 * g + 1, mask=mask, other=0).to(tl.float32)
        sb = g // SB
        a = tl.load(sb_ptr + 2 * sb, mask=mask, other=0.0)
        b = tl.load(sb_ptr + 2 * sb + 1, mask=mask, other=0.0)
        s = tl.exp2(a + c * b)
    else:
        s = tl.load(stats_ptr + g, mask=mask, other=0.0).to(tl.float32)
        if SYM:
            z = tl.zeros_like(s) + ((1 << BITS) - 1) / 2
        else:
            z = tl.load(zeros_ptr + g, mask=mask, other=0).to(tl.float32)
    return s, z


@triton.jit
def _codes_at(codes_ptr, e, mask, BITS: tl.constexpr):
    """Integer codes (int32) of flat element indices e."""
    if BITS == 4:
        byte = tl.load(codes_ptr + e // 2, mask=mask, other=0).to(tl.int32)
        return (byte >> ((e & 1) * 4)) & 15  # even element in the low nibble
    return tl.load(codes_ptr + e, mask=mask, other=0).to(tl.int32)


@triton.jit
def _dequant_kernel(codes_ptr, stats_ptr, sb_ptr, zeros_ptr, out_ptr, n_groups, SB,
                    G: tl.constexpr, BITS: tl.constexpr, DQ: tl.constexpr, SYM: tl.constexpr,
                    BLOCK_G: tl.constexpr):  # fmt: skip
    # one program: BLOCK_G groups x G elements; stats read once per group
    g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BG]
    gmask = g < n_groups
    s, z = _group_stats(stats_ptr, sb_ptr, zeros_ptr, g, gmask, SB, BITS, DQ, SYM)  # [BG]
    e = g[:, None] * G + tl.arange(0, G)[None, :]  # [BG, G] flat element index
    q = _codes_at(codes_ptr, e, gmask[:, None], BITS)  # [BG, G]
    w = (q.to(tl.float32) - z[:, None]) * s[:, None]
    tl.store(out_ptr + e, w.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def _linear_kernel(x_ptr, codes_ptr, stats_ptr, sb_ptr, zeros_ptr, part_ptr,
                   T, N, K, stride_xt, k_per_split, SB,
                   G: tl.constexpr, BITS: tl.constexpr, DQ: tl.constexpr, SYM: tl.constexpr,
                   TRANS: tl.constexpr, FP32: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # T tokens, N outputs, K inputs. part[split, t, n] = sum over this split's k of x[t, k] * W^T[k, n]
    # Stored W is [N, K] (groups along K; BLOCK_K == G: one group per column n of a tile)
    # or, TRANS, [K, N] (groups along N; BLOCK_N == G: one group per row k of a tile).
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_t = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BN]
    t_mask = offs_t < T
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    k_begin = pid_s * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)  # [BK]
        k_mask = offs_k < k_end
        x = tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_k[None, :],
                    mask=t_mask[:, None] & k_mask[None, :], other=0.0)  # [BT, BK]  # fmt: skip
        tile_mask = k_mask[:, None] & n_mask[None, :]
        if TRANS:
            e = offs_k[:, None] * N + offs_n[None, :]  # [BK, BN]
            s, z = _group_stats(stats_ptr, sb_ptr, zeros_ptr, (offs_k * N + pid_n * BLOCK_N) // G,
                                k_mask, SB, BITS, DQ, SYM)  # [BK]  # fmt: skip
            s = s[:, None]
            z = z[:, None]
        else:
            e = offs_n[None, :] * K + offs_k[:, None]  # [BK, BN]
            s, z = _group_stats(stats_ptr, sb_ptr, zeros_ptr, (offs_n * K + k0) // G,
                                n_mask, SB, BITS, DQ, SYM)  # [BN]  # fmt: skip
            s = s[None, :]
            z = z[None, :]
        q = _codes_at(codes_ptr, e, tile_mask, BITS)  # [BK, BN]
        w = (q.to(tl.float32) - z) * s  # [BK, BN]
        if FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    out = part_ptr + pid_s * T * N + offs_t[:, None] * N + offs_n[None, :]
    tl.store(out, acc, mask=t_mask[:, None] & n_mask[None, :])


def _stat_args(record: torch.Tensor, entry: TensorEntry, spec: QuantSpec):
    """(stats, superblocks, zeros) views for the kernels; unused ones alias `stats`."""
    if spec.double_quant:
        stats = section_view(record, entry.section("stats"))
        sb = section_view(record, entry.section("superblocks"), torch.float32)
        return stats, sb, stats
    scales = section_view(record, entry.section("scales"), torch.float16)
    zeros = scales if spec.symmetric else section_view(record, entry.section("zeros"))
    return scales, scales, zeros


def dequantize(
    record: torch.Tensor,
    entry: TensorEntry,
    spec: QuantSpec,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantise one tensor of the record into `out` (or a new tensor): one launch."""
    if out is None:
        out = torch.empty(entry.shape, dtype=dtype, device=record.device)
    G = spec.group_size
    n_groups = entry.numel // G
    block_g = max(1, 4096 // G)  # 4096 elements per program
    stats, sb, zeros = _stat_args(record, entry, spec)
    grid = (triton.cdiv(n_groups, block_g),)
    _dequant_kernel[grid](
        section_view(record, entry.section("codes")), stats, sb, zeros, out, n_groups,
        spec.superblock_groups, G=G, BITS=spec.bits, DQ=spec.double_quant, SYM=spec.symmetric,
        BLOCK_G=block_g,
    )  # fmt: skip
    return out


def _interpreted() -> bool:
    # Triton's CPU interpreter computes bf16 x bf16 dots wrongly (triton 3.9): dot in fp32 there.
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # interpreter: still exercise split-K
    return torch.cuda.get_device_properties(device).multi_processor_count


def linear(x2: torch.Tensor, record: torch.Tensor, entry: TensorEntry, spec: QuantSpec, transposed: bool) -> torch.Tensor:
    """Fused dequant-matmul: x2 [T, K] -> [T, N] in x2.dtype, W read from its codes.

    Split-K keeps every SM busy when N alone gives few tiles (e.g. down_proj at decode); the
    per-split fp32 partials are summed afterwards (deterministic, unlike atomics).
    """
    x2 = x2.contiguous()
    T, K = x2.shape
    N = entry.shape[1] if transposed else entry.shape[0]
    G = spec.group_size
    block_t = 16  # tl.dot's smallest M; T <= 16 at decode
    if transposed:
        block_n, block_k = G, 64
    else:
        block_n, block_k = 64, G
    n_tiles = triton.cdiv(N, block_n)
    t_tiles = triton.cdiv(T, block_t)
    k_steps = triton.cdiv(K, block_k)
    split = max(1, min(k_steps, triton.cdiv(2 * _sm_count(record.device), n_tiles * t_tiles)))
    k_per_split = triton.cdiv(k_steps, split) * block_k
    split = triton.cdiv(K, k_per_split)
    part = torch.empty((split, T, N), dtype=torch.float32, device=x2.device)
    stats, sb, zeros = _stat_args(record, entry, spec)
    _linear_kernel[(n_tiles, split, t_tiles)](
        x2, section_view(record, entry.section("codes")), stats, sb, zeros, part,
        T, N, K, x2.stride(0), k_per_split, spec.superblock_groups,
        G=G, BITS=spec.bits, DQ=spec.double_quant, SYM=spec.symmetric, TRANS=transposed,
        FP32=x2.dtype == torch.float32 or _interpreted(), BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    y = part[0] if split == 1 else part.sum(0)
    return y.to(x2.dtype)
