"""Triton kernels over packed records: dequantise a tensor, fused dequant + matmul, and the
lossless codec's bulk decode.

Imported lazily by the codecs (`integer.py`, `lossless.py`; triton is absent on CPU CI); imports
nothing above the record layout and the maths modules. The kernels read
the record's sections in place, with the same arithmetic as the torch references:

    s = exp2(a[g // SB] + c[g] * b[g // SB])      (double_quant)   or fp16 scale[g]
    w = (q - z[g]) * s                           computed in fp32, then cast
    lossless: hi = sign | exponent(code, base) | mantissa bits   (integer ops only: exact)

Under TRITON_INTERPRET=1 they also run on CPU tensors (used by the tests).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .groupwise import QuantSpec
from .lossless_bits import CLASS_BLOCK
from .record import TensorEntry, section_view

# Fused-linear launch configs: (tile along N, tile along K, warps, pipeline stages, programs per SM
# targeted by split-K), picked from CUDA-graph timings on an H200 at Mixtral expert shapes.
GEMV_CONFIG = (128, 128, 4, 2, 8)  # T == 1
DOT_CONFIG = (128, 128, 4, 3, 4)  # 1 < T <= 16 (more tokens also work: one 16-token tile per program row)
DEQUANT_ELEMS = 8192  # elements per dequant program
DEQUANT_WARPS = 4
LOSSLESS_BLOCK = 4096  # elements per lossless-decode program (a 2 KiB code tile, 4 KiB of sign/mantissa bytes)
LOSSLESS_WARPS = 4


# Kernels use only builtins and jit functions of this module (no tl.sum, tl.zeros, tl.zeros_like:
# those are jit functions of triton's standard library, which the CPU interpreter cannot call
# when triton was imported before TRITON_INTERPRET was set, e.g. by bitsandbytes in the tests).


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _group_stats(stats_ptr, sb_ptr, zeros_ptr, g, mask, SB,
                 BITS: tl.constexpr, DQ: tl.constexpr, SYM: tl.constexpr):  # fmt: skip
    """Scale and zero (fp32, shaped like g) of groups g; see groupwise.py for the byte layout."""
    if DQ:
        if SYM:
            c = tl.load(stats_ptr + g, mask=mask, other=0).to(tl.float32)
            z = c * 0.0 + ((1 << BITS) - 1) / 2
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
            z = s * 0.0 + ((1 << BITS) - 1) / 2
        else:
            z = tl.load(zeros_ptr + g, mask=mask, other=0).to(tl.float32)
    return s, z


@triton.jit
def _code_tile(codes_ptr, rows, row_bytes, col0, mask_rows,
               R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr):  # fmt: skip
    """Codes [R, C] of elements (rows, col0 .. col0+C-1) of a row-major code matrix, as fp32.

    Bytes are loaded as a tile whose last dim is contiguous in memory (coalesced, vectorised);
    int4 nibbles are split and re-interleaved in registers (element 2j is byte j's low nibble).
    """
    if BITS == 4:
        j = tl.arange(0, C // 2)
        b = tl.load(codes_ptr + rows[:, None] * row_bytes + col0 // 2 + j[None, :], mask=mask_rows[:, None], other=0)
        b = b.to(tl.int32)  # [R, C/2]
        q = tl.reshape(tl.join(b & 15, b >> 4), (R, C))  # [R, C/2, 2] -> [R, C]
    else:
        j = tl.arange(0, C)
        q = tl.load(codes_ptr + rows[:, None] * row_bytes + col0 + j[None, :], mask=mask_rows[:, None], other=0)
        q = q.to(tl.int32)
    # int -> float without a conversion instruction (the kernels' bottleneck at 1 token): OR the
    # code into the mantissa of 2**23 and subtract 2**23, exact for 0 <= q < 2**23
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _dequant_kernel(codes_ptr, stats_ptr, sb_ptr, zeros_ptr, out_ptr, n_groups, SB,
                    G: tl.constexpr, BITS: tl.constexpr, DQ: tl.constexpr, SYM: tl.constexpr,
                    BLOCK_G: tl.constexpr):  # fmt: skip
    # one program: BLOCK_G groups x G elements (the codes as a [n_groups, G] matrix); stats once per group
    g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BG]
    gmask = g < n_groups
    s, z = _group_stats(stats_ptr, sb_ptr, zeros_ptr, g, gmask, SB, BITS, DQ, SYM)  # [BG]
    q = _code_tile(codes_ptr, g, G * BITS // 8, 0, gmask, BLOCK_G, G, BITS)  # [BG, G]
    w = (q - z[:, None]) * s[:, None]
    e = g[:, None] * G + tl.arange(0, G)[None, :]  # [BG, G] flat element index
    tl.store(out_ptr + e, w.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def _linear_kernel(x_ptr, codes_ptr, stats_ptr, sb_ptr, zeros_ptr, part_ptr,
                   T, N, K, stride_xt, k_per_split, SB,
                   G: tl.constexpr, BITS: tl.constexpr, DQ: tl.constexpr, SYM: tl.constexpr,
                   TRANS: tl.constexpr, FP32: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # T tokens, N outputs, K inputs. part[split, t, n] = sum over this split's k of x[t, k] * W^T[k, n]
    # Stored W is [N, K] (groups along K; BLOCK_K divides G: one group per row n of a tile)
    # or, TRANS, [K, N] (groups along N; BLOCK_N divides G: one group per row k of a tile).
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_t = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    n0 = pid_n * BLOCK_N
    offs_n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BN]
    t_mask = offs_t < T
    n_mask = offs_n < N
    if BLOCK_T == 1:
        # one token (GEMV): multiply-accumulate in the tile's own layout and reduce once at the
        # end; a per-step reduction (or a 16-row tensor-core dot) shuffles every tile
        acc = tl.full((BLOCK_K, BLOCK_N) if TRANS else (BLOCK_N, BLOCK_K), 0.0, tl.float32)
    else:
        acc = tl.full((BLOCK_T, BLOCK_N), 0.0, tl.float32)
    k_begin = pid_s * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)  # [BK]
        k_mask = offs_k < k_end
        # dequantised tile in storage orientation: [BK, BN] if TRANS else [BN, BK]
        if TRANS:
            s, z = _group_stats(stats_ptr, sb_ptr, zeros_ptr, (offs_k * N + n0) // G, k_mask, SB, BITS, DQ, SYM)  # [BK]
            q = _code_tile(codes_ptr, offs_k, N * BITS // 8, n0, k_mask, BLOCK_K, BLOCK_N, BITS)  # [BK, BN]
        else:
            s, z = _group_stats(stats_ptr, sb_ptr, zeros_ptr, (offs_n * K + k0) // G, n_mask, SB, BITS, DQ, SYM)  # [BN]
            q = _code_tile(codes_ptr, offs_n, K * BITS // 8, k0, n_mask, BLOCK_N, BLOCK_K, BITS)  # [BN, BK]
        w = (q - z[:, None]) * s[:, None]
        if BLOCK_T == 1:
            x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)  # [BK]
            if TRANS:
                acc += w * x[:, None]  # [BK, BN]
            else:
                acc += w * x[None, :]  # [BN, BK]
        else:
            x = tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_k[None, :],
                        mask=t_mask[:, None] & k_mask[None, :], other=0.0)  # [BT, BK]  # fmt: skip
            if not TRANS:
                w = tl.trans(w)  # [BK, BN] = W^T tile
            if FP32:
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
    if BLOCK_T == 1:
        y = tl.reduce(acc, 0 if TRANS else 1, _add)  # [BN]
        tl.store(part_ptr + pid_s * N + offs_n, y, mask=n_mask)
    else:
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
    block_g = max(1, DEQUANT_ELEMS // G)
    stats, sb, zeros = _stat_args(record, entry, spec)
    grid = (triton.cdiv(n_groups, block_g),)
    _dequant_kernel[grid](
        section_view(record, entry.section("codes")), stats, sb, zeros, out, n_groups,
        spec.superblock_groups, G=G, BITS=spec.bits, DQ=spec.double_quant, SYM=spec.symmetric,
        BLOCK_G=block_g, num_warps=DEQUANT_WARPS,
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
    if T == 1:
        block_t, tile_n, tile_k, warps, stages, per_sm = 1, *GEMV_CONFIG
    else:
        block_t, tile_n, tile_k, warps, stages, per_sm = 16, *DOT_CONFIG  # 16: tl.dot's smallest M
    # the tile's extent along the grouped dim divides G, so each tile row has one group
    if transposed:
        block_n, block_k = min(G, tile_n), tile_k
    else:
        block_n, block_k = tile_n, min(G, tile_k)
    n_tiles = triton.cdiv(N, block_n)
    t_tiles = triton.cdiv(T, block_t)
    k_steps = triton.cdiv(K, block_k)
    split = max(1, min(k_steps, triton.cdiv(per_sm * _sm_count(record.device), n_tiles * t_tiles)))
    k_per_split = triton.cdiv(k_steps, split) * block_k
    split = triton.cdiv(K, k_per_split)
    part = torch.empty((split, T, N), dtype=torch.float32, device=x2.device)
    stats, sb, zeros = _stat_args(record, entry, spec)
    _linear_kernel[(n_tiles, split, t_tiles)](
        x2, section_view(record, entry.section("codes")), stats, sb, zeros, part,
        T, N, K, x2.stride(0), k_per_split, spec.superblock_groups,
        G=G, BITS=spec.bits, DQ=spec.double_quant, SYM=spec.symmetric, TRANS=transposed,
        FP32=x2.dtype == torch.float32 or _interpreted(), BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    y = part[0] if split == 1 else part.sum(0)
    return y.to(x2.dtype)


@triton.jit
def _lossless_kernel(sm_ptr, codes_ptr, lo_ptr, meta_ptr, out_ptr, n, FP32: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # one program: BLOCK elements. Bits as in lossless.decode_words_torch: the escapes (code 15)
    # come out wrong here and are patched afterwards.
    pid = tl.program_id(0).to(tl.int64)
    j = pid * (BLOCK // 2) + tl.arange(0, BLOCK // 2)  # [B/2] code bytes
    b = tl.load(codes_ptr + j, mask=j < (n + 1) // 2, other=0).to(tl.int32)
    code = tl.reshape(tl.join(b & 15, b >> 4), (BLOCK,))  # [B/2, 2] -> [B]: element 2i is byte i's low nibble
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # [B]
    mask = offs < n
    sm = tl.load(sm_ptr + offs, mask=mask, other=0).to(tl.int32)  # uint8 -> zero-extended
    base = tl.load(meta_ptr)  # int32: read on the device, never by the host
    e = tl.where(code == 0, 0, code + base)
    hi = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)  # the 16-bit high word
    if FP32:
        lo = tl.load(lo_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        tl.store(out_ptr + offs, (hi << 16) | lo, mask=mask)  # int32 words
    else:
        tl.store(out_ptr + offs, hi.to(tl.int16), mask=mask)  # truncation keeps the 16 bits


# classes-decode launch: blocks of 256 weights per program, warps. Window layout, one Mixtral expert (176 M bf16
# weights) on the H200: 1 block × 2 warps 0.51 ms, 4 × 4 0.56-0.61, 16 × 4 0.67-0.70, 1 × 8 1.7
# (benchmarks/lossless_gpu_check.py launch sweep, `...-lossless-window-sweep.json`, benchmarks/NOTES.md, "Transfer formats")
CLASS_BLOCKS_PER_PROGRAM = 1
CLASS_WARPS = 2


@triton.jit
def _add(a, b):
    # the prefix sum's combine (tl.cumsum's own is a jit function of triton.language, which a test's
    # interpreter mode, switched on after triton was imported, could not call)
    return a + b


@triton.jit
def _class_bits(c):
    # extra bits of a class: 0, 0, 1, 4
    return tl.where(c == 3, 4, tl.where(c == 2, 1, 0))


@triton.jit
def _class_exponent(c, w, t0, t1, t2, t3, lo):
    # exponent of one weight from its class and its field (the low bits of w): t0 | t1 | t2 or t3 | lo + field;
    # an escape (field 15) gives lo + 15, low 8 bits, as the torch reference (patched afterwards)
    return tl.where(c == 3, (lo + (w & 15)) & 0xFF, tl.where(c == 2, tl.where((w & 1) != 0, t3, t2), tl.where(c == 1, t1, t0)))


@triton.jit
def _group_fields(extra_ptr, boff_ptr, blk, n_blocks, lb, nbits, gmask):
    # the extra bits of each group of 4 weights, right-aligned: [R, G] int32. A block's extra bits start
    # on byte boff[blk]; a group's at most 16 bits start at bit lb of its block, so at most 3 bytes hold them.
    start = tl.load(boff_ptr + blk, mask=blk < n_blocks, other=0).to(tl.int64)  # [R] first byte of each block
    src = extra_ptr + start[:, None] + (lb >> 3)
    shift = lb & 7
    end = shift + nbits
    w = tl.load(src, mask=gmask & (nbits > 0), other=0).to(tl.int32)
    w = w | (tl.load(src + 1, mask=gmask & (end > 8), other=0).to(tl.int32) << 8)
    return (w | (tl.load(src + 2, mask=gmask & (end > 16), other=0).to(tl.int32) << 16)) >> shift


@triton.jit
def _class_high_word(sm, e):
    return ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)


@triton.jit
def _sign_mantissa(sm_ptr, grp, i, n, j: tl.constexpr, PACK: tl.constexpr):
    # weight 4 * grp + j's sign/mantissa byte; PACK: sm_ptr is the int32 view (four bytes per group)
    if PACK:
        return (tl.load(sm_ptr + grp, mask=i < n, other=0) >> (8 * j)) & 0xFF
    else:
        return tl.load(sm_ptr + i + j, mask=i + j < n, other=0).to(tl.int32)


@triton.jit
def _class_store(out_ptr, lo_ptr, i, n, hi, FP32: tl.constexpr):
    if FP32:
        lo = tl.load(lo_ptr + i, mask=i < n, other=0).to(tl.int32) & 0xFFFF
        tl.store(out_ptr + i, (hi << 16) | lo, mask=i < n)
    else:
        tl.store(out_ptr + i, hi.to(tl.int16), mask=i < n)


@triton.jit
def _lossless_classes_kernel(
    sm_ptr, cls_ptr, boff_ptr, extra_ptr, exps_ptr, lo_ptr, out_ptr, n, n_blocks,
    FP32: tl.constexpr, PACK: tl.constexpr, R: tl.constexpr, BLK: tl.constexpr,
):  # fmt: skip
    # One program: R blocks of BLK weights; one lane per group of 4 weights (one class byte), whose extra
    # bits are contiguous (at most 16), so one window of at most 3 bytes holds all four fields. Bits as in
    # lossless.decode_words_classes_torch (escapes come out wrong and are patched afterwards). PACK: bf16 with n % 4 == 0 and aligned buffers: each group reads its four
    # sign/mantissa bytes as one int32 and writes its four weights as one int64 (sm_ptr and out_ptr are
    # then int32 and int64 views).
    G: tl.constexpr = BLK // 4
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * R + tl.arange(0, R)  # [R] block indices
    grp = (blk * G)[:, None] + tl.arange(0, G)[None, :]  # [R, G] group index = class byte index
    i = grp * 4  # first weight of each group
    gmask = i < n
    cb = tl.load(cls_ptr + grp, mask=gmask, other=0).to(tl.int32)
    c0, c1, c2, c3 = cb & 3, (cb >> 2) & 3, (cb >> 4) & 3, (cb >> 6) & 3
    n0, n1, n2 = _class_bits(c0), _class_bits(c1), _class_bits(c2)
    nbits = n0 + n1 + n2 + _class_bits(c3)
    lb = tl.associative_scan(nbits, 1, _add) - nbits  # [R, G] first extra bit of each group within its block
    w = _group_fields(extra_ptr, boff_ptr, blk, n_blocks, lb, nbits, gmask)
    t0, t1, t2, t3 = tl.load(exps_ptr), tl.load(exps_ptr + 1), tl.load(exps_ptr + 2), tl.load(exps_ptr + 3)
    lo = tl.load(exps_ptr + 4)
    h0 = _class_high_word(_sign_mantissa(sm_ptr, grp, i, n, 0, PACK), _class_exponent(c0, w, t0, t1, t2, t3, lo))
    w = w >> n0
    h1 = _class_high_word(_sign_mantissa(sm_ptr, grp, i, n, 1, PACK), _class_exponent(c1, w, t0, t1, t2, t3, lo))
    w = w >> n1
    h2 = _class_high_word(_sign_mantissa(sm_ptr, grp, i, n, 2, PACK), _class_exponent(c2, w, t0, t1, t2, t3, lo))
    w = w >> n2
    h3 = _class_high_word(_sign_mantissa(sm_ptr, grp, i, n, 3, PACK), _class_exponent(c3, w, t0, t1, t2, t3, lo))
    if PACK:
        word = h0.to(tl.int64) | (h1.to(tl.int64) << 16) | (h2.to(tl.int64) << 32) | (h3.to(tl.int64) << 48)
        tl.store(out_ptr + grp, word, mask=gmask)
    else:
        _class_store(out_ptr, lo_ptr, i, n, h0, FP32)
        _class_store(out_ptr, lo_ptr, i + 1, n, h1, FP32)
        _class_store(out_ptr, lo_ptr, i + 2, n, h2, FP32)
        _class_store(out_ptr, lo_ptr, i + 3, n, h3, FP32)


def classes_sections(record: torch.Tensor, entry: TensorEntry) -> tuple[torch.Tensor, ...]:
    """The views of one classes-coded tensor's sections that its decode reads (no copy): made once per bound slot."""
    fp32 = entry.dtype == torch.float32
    sm = section_view(record, entry.section("sm"))
    lo = section_view(record, entry.section("lo"), torch.int16) if fp32 else sm  # unused alias for bf16
    cls, extra = section_view(record, entry.section("cls")), section_view(record, entry.section("extra"))
    boff, exps = (
        section_view(record, entry.section("boff"), torch.int32),
        section_view(record, entry.section("exps"), torch.int32),
    )
    return sm, lo, cls, boff, extra, exps


def lossless_classes_decode(
    record: torch.Tensor,
    entry: TensorEntry,
    out: torch.Tensor,
    blocks_per_program: int = 0,
    warps: int = 0,
    sections: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """Bulk-decode one tensor of the lossless classes code into `out`: one launch; the caller patches
    the escapes. `blocks_per_program` / `warps`: launch shape (0: the module defaults; the GPU check
    script sweeps them). `sections`: `classes_sections(record, entry)`, where the caller keeps them."""
    n = entry.numel
    fp32 = entry.dtype == torch.float32
    words = out.view(-1).view(torch.int32 if fp32 else torch.int16)
    sm, lo, cls, boff, extra, exps = sections if sections is not None else classes_sections(record, entry)
    r = blocks_per_program or CLASS_BLOCKS_PER_PROGRAM
    n_blocks = triton.cdiv(n, CLASS_BLOCK)
    pack = not fp32 and n % 4 == 0 and words.storage_offset() % 4 == 0 and sm.storage_offset() % 4 == 0
    pack = pack and words.data_ptr() % 8 == 0 and sm.data_ptr() % 4 == 0
    _lossless_classes_kernel[(triton.cdiv(n_blocks, r),)](
        sm.view(torch.int32) if pack else sm, cls, boff, extra, exps, lo, words.view(torch.int64) if pack else words,
        n, n_blocks, FP32=fp32, PACK=pack, R=r, BLK=CLASS_BLOCK, num_warps=warps or CLASS_WARPS,
    )  # fmt: skip
    return out


def lossless_decode(record: torch.Tensor, entry: TensorEntry, out: torch.Tensor) -> torch.Tensor:
    """Bulk-decode one lossless tensor into `out` (contiguous, entry.dtype): one launch. The
    caller patches the escapes (`lossless.patch_escapes`)."""
    n = entry.numel
    fp32 = entry.dtype == torch.float32
    words = out.view(-1).view(torch.int32 if fp32 else torch.int16)
    sm = section_view(record, entry.section("sm"))
    lo = section_view(record, entry.section("lo"), torch.int16) if fp32 else sm  # unused alias for bf16
    grid = (triton.cdiv(n, LOSSLESS_BLOCK),)
    _lossless_kernel[grid](
        sm, section_view(record, entry.section("codes")), lo, section_view(record, entry.section("meta"), torch.int32),
        words, n, FP32=fp32, BLOCK=LOSSLESS_BLOCK, num_warps=LOSSLESS_WARPS,
    )  # fmt: skip
    return out


ESCAPE_BLOCK = 1024  # escapes per patch program


@triton.jit
def _patch_escapes_kernel(words_ptr, index_ptr, value_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    index = tl.load(index_ptr + i, mask=mask, other=0)
    tl.store(words_ptr + index, tl.load(value_ptr + i, mask=mask, other=0), mask=mask)


def patch_escapes(index: torch.Tensor, values: torch.Tensor, words: torch.Tensor) -> None:
    """`words[index] = values` (int32 indices of 16-bit words, int16 values) in one launch: what
    `lossless_bits.patch_escapes` does with `index_put_`, without turning the indices into int64 first. Entries
    that repeat an index carry the same value (the format's filler), so the order of the writes does not matter."""
    n = index.numel()
    if n:
        _patch_escapes_kernel[(triton.cdiv(n, ESCAPE_BLOCK),)](words, index, values, n, BLOCK=ESCAPE_BLOCK, num_warps=4)
