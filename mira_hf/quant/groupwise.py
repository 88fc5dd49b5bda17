"""Group-wise quantisation maths of the int8/int4 records: the grid, its fit, and the torch reference.

A 2-D (or N-D) weight is quantised group-wise along its last (contiguous) dim, groups of
`group_size` elements. Each group g holds integer codes q in [0, qmax] and is dequantised as

    w_hat = (q - z_g) * s_g          qmax = 2**bits - 1

* asymmetric (default): z_g is an integer zero point in [0, qmax] chosen per group;
* symmetric: z_g = qmax / 2 for every group (a zero-free grid: all 2**bits levels are used).

With `double_quant` (default) the per-group scales are themselves quantised: each superblock of
`superblock_groups` consecutive groups stores fp32 (a, b) and every group a small code c, with
s_g = exp2(a + c * b), i.e. codes log-spaced between the superblock's smallest and largest scale.
Log spacing keeps relative precision for small scales next to large ones.

Sections of a quantised tensor (n_groups = numel / group_size):

    codes        uint8 [numel * bits / 8]   int4: element 2i in the low nibble, 2i+1 in the high
    stats        double_quant: uint8 per group
                   int4 asym: 1 B = (c << 4) | z     (c: 4-bit scale code, z: 4-bit zero point)
                   int8 asym: 2 B = [z, c]           (8-bit zero point, 8-bit scale code)
                   symmetric: 1 B = c                (8-bit scale code)
    superblocks  double_quant: fp32 [n_superblocks, 2] = (a, b)
    scales       no double_quant: fp16 [n_groups]
    zeros        no double_quant, asymmetric: uint8 [n_groups]

1-D (and 0-D) tensors, e.g. biases, are stored raw in their own dtype in one "raw" section.


Error bound. Codes are always the nearest grid point for the stored (s_g, z_g), so in-range
weights have |w - w_hat| <= s_g / 2. Round-to-nearest (refine_iters=0) takes s from the group's
range [min(w, 0), max(w, 0)] / qmax (symmetric: max|w| / (qmax/2)) and rounds the stored scale
UP (next scale code, or next fp16), so nothing clips and |w - w_hat| <= s_g / 2 <= s * r / 2,
where r = exp2(b) is one scale-code step: <= 2**(4/15) = 1.20 for 4-bit codes, 1.022 for 8-bit
(groups below a superblock's floor of max_scale / 2**code_bits get the floor scale instead).
Refinement trades a little clipping for a smaller step where that lowers the group's error.

Metadata share of the defaults (int4/int8, group 64, asymmetric, double_quant, 64 groups per
superblock), per group of 64 weights:
    int4: payload 32 B; stats 1 B + superblock 8 B / 64 groups = 1.125 B  ->  3.5 %
    int8: payload 64 B; stats 2 B + 0.125 B                      = 2.125 B  ->  3.3 %
(plus a 64 B header and up to 63 B of alignment per section, negligible at real expert sizes;
an fp16 scale + zero per group would be 4 B -> 12.5 % at int4.) Measured on random and
heavy-tailed weights, this asymmetric layout has 13-50 % lower squared error at int4 than the
symmetric one with 8-bit scale codes at the same 1 B/group, so it is the default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .record import (
    FLAG_DOUBLE_QUANT,
    FLAG_SYMMETRIC,
    CodecInputError,
    PackedLayout,
    TensorEntry,
    check_group_size,
    section_view,
)

_BITS = {"int8": 8, "int4": 4}
# Groups quantised per step of `encode`: 2**20 fp32 elements = 4 MiB of temporaries per buffer,
# small enough to stay cache-friendly on the host, large enough to amortise torch op overhead.
_CHUNK_ELEMS = 1 << 20
# Shrink factors of the RTN range tried before least squares: clipping a few outliers in a group
# usually lowers its error (measured: 0.9 gives most of the gain of a finer grid).
_CLIP_FACTORS = (0.9,)
# A superblock's log scale range spans at most a factor 2**code_bits (16x for 4-bit codes: a
# code step of at most 2**(4/15) = 1.2x; 256x for 8-bit codes: 1.022x). Groups below the floor
# get the floor scale, which costs them little in absolute error (asymmetric: zero is on the
# grid), while one near-zero group can no longer make every other group's scale coarse.
# Measured on mixed-magnitude rows: best or within 1 % of best among floors 2**-3 .. 2**-16.


# --------------------------------------------------------------------------------------------
# Spec
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantSpec:
    """How expert weights are quantised by `PackedCodec`.

    fmt: "int8" or "int4" (two codes per byte). nf4 lives in `mira_hf.quant.nf4`.
    group_size: elements per group along the last dim of each weight; a power of two in
        16..1024 that divides that dim (plan raises otherwise; no padding, so a record holds
        exactly the model's tensors).
    symmetric: False (default) stores a zero point per group; True uses the fixed grid
        (q - qmax/2) * s. Asymmetric is more accurate at the same metadata budget (see module doc).
    double_quant: quantise the per-group scales to log-spaced codes within superblocks (default);
        False stores fp16 scales (+ uint8 zeros): 12.5 % metadata at int4.
    refine_iters: rounds of least-squares refinement of each group's scale (and zero) after a
        clipping search, minimising weight error (or activation-weighted error with `calib`);
        0 = plain round-to-nearest from the group's min/max. 2 is where the gain flattens.
    superblock_groups: groups sharing one fp32 (a, b) pair under double_quant.
    """

    fmt: str
    group_size: int = 64
    symmetric: bool = False
    double_quant: bool = True
    refine_iters: int = 2
    superblock_groups: int = 64

    def __post_init__(self) -> None:
        if self.fmt not in _BITS:
            hint = ' (nf4 is its own codec: make_codec("nf4"))' if self.fmt == "nf4" else ""
            raise ConfigError(f"QuantSpec.fmt={self.fmt!r} is not supported{hint}; supported: {sorted(_BITS)}.")
        check_group_size(self.group_size, "QuantSpec")
        for field in ("symmetric", "double_quant"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(f"QuantSpec.{field}={getattr(self, field)!r} must be True or False.")
        if not isinstance(self.refine_iters, int) or not 0 <= self.refine_iters <= 16:
            raise ConfigError(
                f"QuantSpec.refine_iters={self.refine_iters!r} must be an int in 0..16 "
                "(0 = round-to-nearest; 2 is the default, more gains little)."
            )
        if not isinstance(self.superblock_groups, int) or not 1 <= self.superblock_groups <= 65536:
            raise ConfigError(f"QuantSpec.superblock_groups={self.superblock_groups!r} must be an int in 1..65536 (default 64).")

    @property
    def bits(self) -> int:
        return _BITS[self.fmt]

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1

    @property
    def scale_code_bits(self) -> int:
        """Bits of a double-quantised scale code: 4 for int4 asymmetric (shares a byte with
        the 4-bit zero point), else 8."""
        return 4 if (self.fmt == "int4" and not self.symmetric) else 8

    @property
    def stats_bytes_per_group(self) -> int:
        if not self.double_quant:
            return 2  # fp16 scale (zeros, if any, get their own section)
        return 2 if (self.fmt == "int8" and not self.symmetric) else 1

    @property
    def flags(self) -> int:
        return (FLAG_SYMMETRIC if self.symmetric else 0) | (FLAG_DOUBLE_QUANT if self.double_quant else 0)


# --------------------------------------------------------------------------------------------
# Quantisation (CPU at load time; plain torch so it also runs on a GPU if handed one)
# --------------------------------------------------------------------------------------------


def _safe(s: torch.Tensor) -> torch.Tensor:
    # Zero-scale groups are all-zero (or below fp16 range): any divisor gives q = z -> w_hat = 0.
    return torch.where(s > 0, s, torch.ones_like(s))


def _codes(w: torch.Tensor, s: torch.Tensor, z, qmax: int) -> torch.Tensor:
    # w [n, G], s/z [n, 1] -> nearest grid point's code, fp32 [n, G]
    return (w / _safe(s) + z).round_().clamp_(0, qmax)


def _group_error(w, h, s, z, qmax: int) -> torch.Tensor:
    # (weighted) squared error per group [n, 1]
    d = w - (_codes(w, s, z, qmax) - z) * s
    d.square_()
    if h is not None:
        d.mul_(h)
    return d.sum(1, keepdim=True)


def _fit_groups(w: torch.Tensor, h: torch.Tensor | None, spec: QuantSpec):
    """Continuous per-group scale s [n, 1] and offset m [n, 1] (asymmetric: w_hat = q*s + m;
    None when symmetric), before the scale is stored.

    RTN: s from the group's range, m = its min (<= 0). Refinement: try shrunken ranges, then
    alternate codes <-> (weighted) least-squares scale/zero, keeping each group's best.
    """
    qmax = spec.qmax
    if spec.symmetric:
        z = qmax / 2
        s = w.abs().amax(1, keepdim=True) / z
        m = None
    else:
        mn = w.amin(1, keepdim=True).clamp_(max=0)  # keep 0 in range -> zero point in [0, qmax]
        mx = w.amax(1, keepdim=True).clamp_(min=0)
        s = (mx - mn) / qmax
        z = (-mn / _safe(s)).round_().clamp_(0, qmax)
        m = mn
    if spec.refine_iters == 0:
        return s, m
    best_e = _group_error(w, h, s, z, qmax)
    best_s, best_z = s, z
    for factor in _CLIP_FACTORS:  # shrink around the same zero point
        s2 = s * factor
        e = _group_error(w, h, s2, z, qmax)
        better = e < best_e
        best_e = torch.where(better, e, best_e)
        best_s = torch.where(better, s2, best_s)
    s, z = best_s, best_z
    hw = h if h is not None else torch.ones_like(w[:1])  # broadcast weight 1 when unweighted
    sum_h = hw.expand_as(w).sum(1, keepdim=True)
    for _ in range(spec.refine_iters):
        q = _codes(w, s, z, qmax)
        if spec.symmetric:
            u = q - z
            num = (hw * w * u).sum(1, keepdim=True)
            den = (hw * u * u).sum(1, keepdim=True)
            s_new = torch.where(den > 0, num / _safe(den), s).clamp_(min=0)
            z_new = z
        else:
            # weighted least squares fit w ~ s*q + b, then z = round(-b/s)
            hq = hw * q
            sq, sw = hq.sum(1, keepdim=True), (hw * w).sum(1, keepdim=True)
            sqq, sqw = (hq * q).sum(1, keepdim=True), (hq * w).sum(1, keepdim=True)
            det = sum_h * sqq - sq * sq
            s_new = torch.where(det > 0, (sum_h * sqw - sq * sw) / _safe(det), s).clamp_(min=0)
            b = (sw - s_new * sq) / sum_h
            z_new = (-b / _safe(s_new)).round_().clamp_(0, qmax)
        e = _group_error(w, h, s_new, z_new, qmax)
        better = e < best_e
        best_e = torch.where(better, e, best_e)
        best_s = torch.where(better, s_new, best_s)
        if not spec.symmetric:
            best_z = torch.where(better, z_new, best_z)
        s, z = s_new, z_new
    return best_s, (None if spec.symmetric else -best_z * best_s)


def superblock_params(s: torch.Tensor, superblock_groups: int, code_bits: int) -> torch.Tensor:
    """Per-superblock (a, b) so that exp2(a + c*b), c in [0, 2**code_bits - 1], spans
    [smallest, largest] scale of its groups (log-spaced). s: [n] -> fp32 [ceil(n/SB), 2]."""
    n = s.numel()
    n_sb = -(-n // superblock_groups)
    sp = F.pad(s.reshape(-1), (0, n_sb * superblock_groups - n)).view(n_sb, superblock_groups)
    hi = sp.amax(1)
    lo = torch.where(sp > 0, sp, torch.full_like(sp, math.inf)).amin(1)
    lo = torch.maximum(lo, hi * 2.0**-code_bits)
    # all-zero superblock: the smallest scale, so the symmetric grid's +-s/2 levels are ~0 too
    empty = ~(hi > 0)
    hi = torch.where(empty, torch.full_like(hi, torch.finfo(torch.float32).tiny), hi)
    lo = torch.where(empty | torch.isinf(lo), hi, lo)
    a = torch.log2(lo)
    # the tiny widening makes the top code land at or above `hi`, so ceil-rounded codes never
    # clip (the RTN error bound holds exactly)
    b = (torch.log2(hi) - a + 2.0**-18) / ((1 << code_bits) - 1)
    return torch.stack((a, b), 1)


def scale_from_code(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Dequantised scale; the one formula shared by encode, the torch decode and the kernels."""
    return torch.exp2(a + c * b)


def _store_scales(w, h, s, m, spec: QuantSpec, sb_ab: torch.Tensor | None):
    """Choose each group's stored scale (and zero) given its continuous fit.

    Returns (s_hat [n,1], z [n,1] or float, scale code [n] (double_quant) or fp16 scale [n]).
    RTN rounds the scale up (no clipping: |w - w_hat| <= s_hat/2); refinement tries both
    neighbouring codes and keeps the one with lower error.
    """
    qmax = spec.qmax
    sym_z = qmax / 2

    def zero_for(s_hat):
        if spec.symmetric:
            return sym_z
        return (-m / _safe(s_hat)).round_().clamp_(0, qmax)

    if not spec.double_quant:
        s16 = s.to(torch.float16)
        if spec.refine_iters == 0:
            up = torch.nextafter(s16, torch.full_like(s16, math.inf))
            s16 = torch.where(s16.float() < s, up, s16)
        s16 = s16.clamp_(max=torch.finfo(torch.float16).max)
        s_hat = s16.float()
        return s_hat, zero_for(s_hat), s16.reshape(-1)

    cmax = (1 << spec.scale_code_bits) - 1
    sb_index = torch.arange(s.shape[0], device=s.device) // spec.superblock_groups
    a = sb_ab[sb_index, 0:1]  # [n, 1]
    b = sb_ab[sb_index, 1:2]
    t = (torch.log2(s) - a) / b  # position on the code grid; -inf for zero scales
    if spec.refine_iters == 0:
        candidates = [t.ceil().clamp_(0, cmax)]
    else:
        lo_c = t.floor().clamp_(0, cmax)
        candidates = [lo_c, (lo_c + 1).clamp_(max=cmax)]
    best_c = best_s = best_z = best_e = None
    for c in candidates:
        s_hat = scale_from_code(a, b, c)
        z = zero_for(s_hat)
        if best_c is None:
            best_c, best_s, best_z = c, s_hat, z
            if len(candidates) > 1:
                best_e = _group_error(w, h, s_hat, z, qmax)
            continue
        e = _group_error(w, h, s_hat, z, qmax)
        better = e < best_e
        best_e = torch.where(better, e, best_e)
        best_c = torch.where(better, c, best_c)
        best_s = torch.where(better, s_hat, best_s)
        if not spec.symmetric:
            best_z = torch.where(better, z, best_z)
    return best_s, best_z, best_c.reshape(-1)


def importance(calib: torch.Tensor | None, entry: TensorEntry, group_size: int) -> torch.Tensor | None:
    """Per-column weight of the squared error, [cols/G, G], from activations x [N, in].

    Output error sum_t |x_t (w - w_hat)|^2 ~ sum_j E[x_j^2] (w_j - w_hat_j)^2 (diagonal of
    X^T X): weighting by E[x_j^2] steers each group's scale towards the inputs that matter.
    Only the standard layout [out, in] has `in` along the grouped dim; for [in, out] a
    row's weight is constant over each group and cannot change its best scale, so it is skipped.
    """
    if calib is None:
        return None
    if calib.dim() != 2 or calib.shape[1] not in (entry.cols, entry.shape[0]):
        raise CodecInputError(
            f"encode: calib for {entry.name!r} is {tuple(calib.shape)}; expected [N, in] with "
            f"in = {entry.cols} (layout [out, in]) or {entry.shape[0]} (layout [in, out])."
        )
    if calib.shape[1] != entry.cols:  # [in, out] layout (a square weight is read as [out, in])
        return None
    h = calib.float().square().mean(0)
    h = h + 1e-3 * h.mean() + torch.finfo(torch.float32).tiny  # inputs never seen keep some weight
    return h.view(-1, group_size)


def resolve_calib(calib, layout: PackedLayout) -> dict[str, torch.Tensor]:
    if calib is None:
        return {}
    if isinstance(calib, torch.Tensor):
        # one activation matrix: applies to every weight whose input dim matches its width
        matched = {e.name: calib for e in layout.entries if e.quantized and e.cols == calib.shape[-1]}
        if not matched:
            dims = {e.name: e.cols for e in layout.entries if e.quantized}
            raise CodecInputError(
                f"encode: calib {tuple(calib.shape)} matches no weight's input dim {dims}; pass [N, in] activations, "
                "or a mapping name -> activations."
            )
        return matched
    if isinstance(calib, Mapping):
        unknown = set(calib) - set(layout.names)
        if unknown:
            raise CodecInputError(f"encode: calib names {sorted(unknown)} are not in the layout {list(layout.names)}.")
        return dict(calib)
    raise CodecInputError(f"encode: calib is a {type(calib).__name__}; expected a Tensor [N, in] or a mapping name -> Tensor.")


def quantize_entry(t: torch.Tensor, entry: TensorEntry, spec: QuantSpec, record, h) -> None:
    """Quantise one weight into its sections of `record`, chunk by chunk."""
    G, qmax = spec.group_size, spec.qmax
    w_all = t.detach().reshape(-1, G)  # [n_groups, G]: groups are contiguous along the last dim
    n_groups = w_all.shape[0]
    if not torch.isfinite(w_all).all():
        raise CodecInputError(f"encode: weight {entry.name!r} holds inf or NaN; it cannot be quantised.")
    codes = section_view(record, entry.section("codes"))
    code_bytes_per_group = G * spec.bits // 8
    if spec.double_quant:
        stats = section_view(record, entry.section("stats"))
        superblocks = section_view(record, entry.section("superblocks"), torch.float32).view(-1, 2)
    else:
        scales = section_view(record, entry.section("scales"), torch.float16)
        zeros = None if spec.symmetric else section_view(record, entry.section("zeros"))
    gpr = entry.cols // G  # groups per row: group g covers columns (g % gpr)*G ...
    chunk = max(1, _CHUNK_ELEMS // G)
    if spec.double_quant:  # chunks hold whole superblocks
        chunk = max(1, chunk // spec.superblock_groups) * spec.superblock_groups
    for g0 in range(0, n_groups, chunk):
        g1 = min(n_groups, g0 + chunk)
        w = w_all[g0:g1].float()  # [n, G]
        hc = None
        if h is not None:
            hc = h[torch.arange(g0, g1, device=h.device) % gpr].to(w.device)  # [n, G]
        s, m = _fit_groups(w, hc, spec)
        sb_ab = None
        if spec.double_quant:
            sb_ab = superblock_params(s, spec.superblock_groups, spec.scale_code_bits)
        s_hat, z, stored = _store_scales(w, hc, s, m, spec, sb_ab)
        q = _codes(w, s_hat, z, qmax).to(torch.uint8)  # [n, G]
        codes[g0 * code_bytes_per_group : g1 * code_bytes_per_group] = pack_codes(q, spec.bits).to(codes.device)
        if spec.double_quant:
            sb0 = g0 // spec.superblock_groups
            superblocks[sb0 : sb0 + sb_ab.shape[0]] = sb_ab.to(superblocks.device)
            c = stored.to(torch.uint8)  # scale codes [n]
            if spec.symmetric:
                stat_bytes = c
            elif spec.bits == 4:
                stat_bytes = (c << 4) | z.reshape(-1).to(torch.uint8)
            else:
                stat_bytes = torch.stack((z.reshape(-1).to(torch.uint8), c), 1).reshape(-1)
            per = spec.stats_bytes_per_group
            stats[g0 * per : g1 * per] = stat_bytes.to(stats.device)
        else:
            scales[g0:g1] = stored.to(scales.device)
            if zeros is not None:
                zeros[g0:g1] = z.reshape(-1).to(torch.uint8).to(zeros.device)


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes (uint8, values < 2**bits, even element count) -> packed bytes, flat.
    int4: element 2i in the low nibble of byte i, 2i+1 in the high nibble."""
    q = q.reshape(-1)
    if bits == 8:
        return q
    return q[0::2] | (q[1::2] << 4)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_codes: packed bytes -> uint8 codes, flat."""
    if bits == 8:
        return packed
    return torch.stack((packed & 15, packed >> 4), 1).reshape(-1)


def dequantize_torch(record: torch.Tensor, entry: TensorEntry, spec: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    """Torch reference: one quantised tensor of the record -> dense `dtype` tensor (entry.shape)."""
    G = spec.group_size
    n_groups = entry.numel // G
    q = unpack_codes(section_view(record, entry.section("codes")), spec.bits).view(n_groups, G)
    s, z = group_scales_torch(record, entry, spec)
    w = (q.float() - z) * s  # [n_groups, G] fp32
    return w.to(dtype).view(entry.shape)


def group_scales_torch(record: torch.Tensor, entry: TensorEntry, spec: QuantSpec):
    """Per-group (scale [n,1] fp32, zero [n,1] fp32 or float) read from the record."""
    n_groups = entry.numel // spec.group_size
    if spec.double_quant:
        stats = section_view(record, entry.section("stats"))
        ab = section_view(record, entry.section("superblocks"), torch.float32).view(-1, 2)
        sb = torch.arange(n_groups, device=record.device) // spec.superblock_groups
        if spec.symmetric:
            c, z = stats, spec.qmax / 2
        elif spec.bits == 4:
            c, z = stats >> 4, (stats & 15).float().unsqueeze(1)
        else:
            st = stats.view(n_groups, 2)
            c, z = st[:, 1], st[:, 0].float().unsqueeze(1)
        s = scale_from_code(ab[sb, 0], ab[sb, 1], c.float()).unsqueeze(1)
        return s, z
    s = section_view(record, entry.section("scales"), torch.float16).float().unsqueeze(1)
    if spec.symmetric:
        return s, spec.qmax / 2
    return s, section_view(record, entry.section("zeros")).float().unsqueeze(1)
