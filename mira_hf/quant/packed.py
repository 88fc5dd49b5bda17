"""The packed expert record: format, pack/unpack and the torch reference.

One expert travels host -> GPU as ONE contiguous uint8 record, so a fetch is one copy:

    [header 64 B][tensor 0 sections][tensor 1 sections]...      every section starts on 64 B

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

Header (little-endian, zero-padded to 64 B): magic b"MIRQ", version u16, format u8 (1 int8,
2 int4, 3 nf4), flags u8 (1 symmetric, 2 double_quant), group_size u32, superblock_groups u32,
n_tensors u32, layout fingerprint u32 (crc32 of names, shapes, dtypes and section offsets),
nbytes u64, payload_bytes u64. `validate_record` compares it with the layout's.

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

import functools
import importlib.util
import math
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from ..errors import ConfigError, IncompatibleFileError, MiraError, MissingDependencyError

MAGIC = b"MIRQ"
FORMAT_VERSION = 1
HEADER_BYTES = 64
# Every section starts on this boundary: 16 B is the widest vector load a kernel issues and DMA
# engines prefer 64 B; the record's total size is a multiple of it too, so records can be
# packed back to back in one pinned host buffer and every record stays aligned.
ALIGN_BYTES = 64
FMT_CODES = {"int8": 1, "int4": 2, "nf4": 3, "lossless": 4}
FLAG_SYMMETRIC = 1
FLAG_DOUBLE_QUANT = 2

_BITS = {"int8": 8, "int4": 4}
_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_GROUP_SIZES = (16, 32, 64, 128, 256, 512, 1024)  # powers of two: Triton tiles need them
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


class CodecInputError(MiraError, ValueError):
    """Tensors, buffers or activations handed to a codec do not match its layout."""


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
        _check_group_size(self.group_size, "QuantSpec")
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


def _check_group_size(group_size: object, owner: str) -> None:
    if not isinstance(group_size, int) or group_size not in _GROUP_SIZES:
        raise ConfigError(f"{owner}.group_size={group_size!r} is not supported; use one of {_GROUP_SIZES} (64 is the default).")


# --------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    """A byte range of the record: `offset` is a multiple of ALIGN_BYTES."""

    name: str
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in the record and what it was before packing."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    quantized: bool  # stored in the codec's encoded form (else raw, in its own dtype: a "raw" section)
    sections: tuple[Section, ...]

    def section(self, name: str) -> Section:
        for sec in self.sections:
            if sec.name == name:
                return sec
        raise KeyError(f"tensor {self.name!r} has no section {name!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def cols(self) -> int:
        """Size of the last (grouped) dim."""
        return self.shape[-1]

    @property
    def rows(self) -> int:
        return self.numel // self.shape[-1] if self.shape else 1


@dataclass(frozen=True)
class PackedLayout:
    """Byte layout of ONE expert record; the same layout serves every expert of a model.

    nbytes = payload_bytes + meta_bytes, a multiple of ALIGN_BYTES. payload: codes and raw
    tensors; meta: header, statistics and alignment padding.
    """

    codec: str
    fmt: str
    flags: int
    group_size: int
    superblock_groups: int
    entries: tuple[TensorEntry, ...]
    nbytes: int
    payload_bytes: int
    meta_bytes: int
    fingerprint: int

    @property
    def meta_share(self) -> float:
        """Metadata bytes as a fraction of payload bytes (0.035 = 3.5 %)."""
        return self.meta_bytes / self.payload_bytes

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    def tensor_ranges(self) -> dict[str, tuple[int, int]]:
        """Byte range [start, end) of each tensor's sections in the record."""
        return {e.name: (e.sections[0].offset, e.sections[-1].end) for e in self.entries}

    def entry(self, name: str) -> TensorEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise CodecInputError(f"tensor {name!r} is not in this {self.codec} layout; it holds {list(self.names)}.")

    @property
    def header(self) -> bytes:
        """The 64 header bytes every record of this layout starts with."""
        head = struct.pack(
            "<4sHBBIIIIQQ",
            MAGIC,
            FORMAT_VERSION,
            FMT_CODES[self.fmt],
            self.flags,
            self.group_size,
            self.superblock_groups,
            len(self.entries),
            self.fingerprint,
            self.nbytes,
            self.payload_bytes,
        )
        return head.ljust(HEADER_BYTES, b"\0")


_HEADER_STRUCT = struct.Struct("<4sHBBIIIIQQ")


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def check_specs(specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], group_size: int, codec: str) -> None:
    """Validate tensor specs for a group-wise codec: shapes, dtypes and group divisibility."""
    if not specs:
        raise CodecInputError(f"{codec}.plan got no tensors; an expert needs at least one.")
    for name, spec in specs.items():
        if not (isinstance(spec, tuple) and len(spec) == 2):
            raise CodecInputError(f"{codec}.plan: spec of {name!r} is {spec!r}; expected (shape, dtype).")
        shape, dtype = spec
        if not all(isinstance(d, int) and d > 0 for d in shape):
            raise CodecInputError(f"{codec}.plan: tensor {name!r} has shape {tuple(shape)}; dims must be positive ints.")
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise CodecInputError(f"{codec}.plan: tensor {name!r} has dtype {dtype}; expected a floating dtype.")
        if len(shape) >= 2:
            if dtype not in _WEIGHT_DTYPES:
                raise CodecInputError(
                    f"{codec}.plan: weight {name!r} has dtype {dtype}; supported: {[str(d) for d in _WEIGHT_DTYPES]}."
                )
            if shape[-1] % group_size:
                fits = [g for g in _GROUP_SIZES if shape[-1] % g == 0]
                raise ConfigError(
                    f"{codec}: group_size={group_size} does not divide the last dim of "
                    f"{name!r} {tuple(shape)}. "
                    + (
                        f"Group sizes that fit it: {fits}."
                        if fits
                        else "No supported group size fits it: serve this model uncompressed."
                    )
                )


def build_layout(
    codec: str,
    fmt: str,
    flags: int,
    group_size: int,
    superblock_groups: int,
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    quant_sections,  # (shape: tuple[int, ...]) -> list[(section name, nbytes, is_payload)]
) -> PackedLayout:
    """Lay out header + sections (each ALIGN_BYTES-aligned); shared by every packed codec."""
    check_specs(specs, group_size, codec)
    cursor = HEADER_BYTES
    payload = 0
    entries = []
    for name, (shape, dtype) in specs.items():
        shape = tuple(int(d) for d in shape)
        quantized = len(shape) >= 2
        if quantized:
            parts = quant_sections(shape)
        else:
            parts = [("raw", max(1, math.prod(shape)) * dtype.itemsize, True)]
        sections = []
        for sec_name, nbytes, is_payload in parts:
            offset = _align(cursor)
            sections.append(Section(sec_name, offset, nbytes))
            cursor = offset + nbytes
            payload += nbytes if is_payload else 0
        entries.append(TensorEntry(name, shape, dtype, quantized, tuple(sections)))
    nbytes = _align(cursor)
    text = repr((codec, fmt, flags, group_size, superblock_groups, FORMAT_VERSION)) + "".join(
        repr((e.name, e.shape, str(e.dtype), e.sections)) for e in entries
    )
    return PackedLayout(
        codec=codec,
        fmt=fmt,
        flags=flags,
        group_size=group_size,
        superblock_groups=superblock_groups,
        entries=tuple(entries),
        nbytes=nbytes,
        payload_bytes=payload,
        meta_bytes=nbytes - payload,
        fingerprint=zlib.crc32(text.encode()),
    )


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The `plan` argument describing these tensors."""
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


# --------------------------------------------------------------------------------------------
# Record checks (cheap, CPU-side: never called on the per-token path)
# --------------------------------------------------------------------------------------------


def check_record(record: torch.Tensor, layout: PackedLayout) -> None:
    """Shape/dtype check of a record buffer; no device read, so no sync."""
    if record.dtype != torch.uint8 or record.dim() != 1 or record.numel() != layout.nbytes:
        raise CodecInputError(
            f"record is {record.dtype} {tuple(record.shape)}; the {layout.codec} layout needs "
            f"uint8 [{layout.nbytes}] (one expert, as written by encode)."
        )
    if not record.is_contiguous():
        raise CodecInputError("record must be contiguous (a 1-D uint8 buffer).")


def _describe(fmt: str, flags: int, group_size: int, superblock_groups: int) -> str:
    if fmt == "lossless":
        return fmt
    kind = "symmetric" if flags & FLAG_SYMMETRIC else "asymmetric"
    dq = f"double_quant, superblock_groups={superblock_groups}" if flags & FLAG_DOUBLE_QUANT else "fp16 scales"
    return f"{fmt} ({kind}, group_size={group_size}, {dq})"


def validate_record(record: torch.Tensor, layout: PackedLayout) -> None:
    """Check the record's header against the layout; raise IncompatibleFileError if it was
    written by another format, spec or set of tensor shapes.

    Reads 64 bytes; on a CUDA record that is a device->host copy (a sync): validate records
    when they enter the host store, not per token.
    """
    if record.dtype != torch.uint8 or record.dim() != 1 or record.numel() < HEADER_BYTES:
        raise CodecInputError(
            f"record is {record.dtype} {tuple(record.shape)}; expected a uint8 [{layout.nbytes}] buffer written by encode."
        )
    got = bytes(record[:HEADER_BYTES].cpu().numpy())
    if got != layout.header:
        magic, version, fmt_code, flags, group, superblock, _, fingerprint, nbytes, _ = _HEADER_STRUCT.unpack_from(got)
        if magic != MAGIC:
            raise IncompatibleFileError(
                f"buffer is not a mira-hf packed expert record (magic {magic!r}, expected {MAGIC!r}); "
                "re-pack the experts with codec.encode."
            )
        if version != FORMAT_VERSION:
            raise IncompatibleFileError(
                f"record has format version {version}; this mira-hf reads version {FORMAT_VERSION}. "
                "Re-pack the experts with this version."
            )
        fmt = {v: k for k, v in FMT_CODES.items()}.get(fmt_code, f"unknown format {fmt_code}")
        given = _describe(fmt, flags, group, superblock)
        expected = _describe(layout.fmt, layout.flags, layout.group_size, layout.superblock_groups)
        if given != expected:
            raise IncompatibleFileError(
                f"record was packed as {given} but the layout is {expected}; decode it with the codec that wrote it, or re-pack."
            )
        raise IncompatibleFileError(
            f"record was packed for other tensors (fingerprint {fingerprint:#010x}, {nbytes} B) than this layout "
            f"({layout.fingerprint:#010x}, {layout.nbytes} B: {list(layout.names)}); plan the layout from the same "
            "tensor shapes and dtypes that were encoded."
        )
    check_record(record, layout)


def _check_tensors(tensors: Mapping[str, torch.Tensor], layout: PackedLayout) -> None:
    if set(tensors) != set(layout.names):
        raise CodecInputError(f"encode got tensors {sorted(tensors)}; the layout holds {sorted(layout.names)}.")
    for e in layout.entries:
        t = tensors[e.name]
        if tuple(t.shape) != e.shape:
            raise CodecInputError(f"encode: {e.name!r} has shape {tuple(t.shape)}; the layout expects {e.shape}.")


def _check_out(out: Mapping[str, torch.Tensor], layout: PackedLayout, dtype: torch.dtype, device: torch.device) -> None:
    extra = set(out) - set(layout.names)
    if extra:
        raise CodecInputError(f"decode: out has tensors {sorted(extra)} not in the layout.")
    for name, t in out.items():
        e = layout.entry(name)
        if tuple(t.shape) != e.shape or t.dtype != dtype or t.device != device:
            raise CodecInputError(
                f"decode: out[{name!r}] is {t.dtype} {tuple(t.shape)} on {t.device}; expected "
                f"{dtype} {e.shape} on {device} (the record's device)."
            )
        if not t.is_contiguous():
            raise CodecInputError(f"decode: out[{name!r}] must be contiguous.")


def encode_outputs(tensors: Mapping[str, torch.Tensor], layout: PackedLayout, out: torch.Tensor) -> None:
    """What every codec's `encode` starts with, once its own inputs are checked: `out` fits the layout
    and the tensors fit its entries, then `out` is zeroed (padding is deterministic: identical experts
    give identical records) and gets the layout's header."""
    check_record(out, layout)
    _check_tensors(tensors, layout)
    out.zero_()
    out[:HEADER_BYTES] = torch.frombuffer(bytearray(layout.header), dtype=torch.uint8)


def decode_outputs(record: torch.Tensor, layout: PackedLayout, dtype: torch.dtype, out) -> dict[str, torch.Tensor]:
    """The checks every codec's `decode` starts with: the record fits the layout (and, on the CPU,
    its header matches; on CUDA that would sync), and the given `out` tensors fit. Returns `out` as a
    dict (names it lacks are allocated by the caller)."""
    check_record(record, layout)
    if not record.is_cuda:
        validate_record(record, layout)
    out = dict(out or {})
    _check_out(out, layout, dtype, record.device)
    return out


def section_view(record: torch.Tensor, sec: Section, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """1-D view of one section (no copy); `dtype` reinterprets the bytes."""
    view = record[sec.offset : sec.end]
    return view if dtype == torch.uint8 else view.view(dtype)


def raw_tensor(record: torch.Tensor, entry: TensorEntry, dtype: torch.dtype) -> torch.Tensor:
    """A raw (1-D/0-D) tensor as a fresh tensor of `dtype`: never a view of the record, since
    the record may be a staging buffer that is reused."""
    data = section_view(record, entry.section("raw"), entry.dtype)
    return data.reshape(entry.shape).to(dtype, copy=True)


@functools.cache
def triton_available() -> bool:
    """Whether triton can be imported (CUDA records then use the Triton kernels)."""
    return importlib.util.find_spec("triton") is not None


def _use_triton(record: torch.Tensor, backend: str) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        if not triton_available():
            raise MissingDependencyError(
                'backend="triton" needs triton: pip install triton (it ships with CUDA builds of torch).'
            )
        return True
    if backend == "auto":
        return record.is_cuda and triton_available()
    raise ConfigError(f'backend={backend!r} is not supported; use "auto", "torch" or "triton".')


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


def _importance(calib: torch.Tensor | None, entry: TensorEntry, group_size: int) -> torch.Tensor | None:
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


def _resolve_calib(calib, layout: PackedLayout) -> dict[str, torch.Tensor]:
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


def _quantize_entry(t: torch.Tensor, entry: TensorEntry, spec: QuantSpec, record, h) -> None:
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


# --------------------------------------------------------------------------------------------
# Codecs
# --------------------------------------------------------------------------------------------


@runtime_checkable
class ExpertCodec(Protocol):
    """What the runtime calls to pack experts on the host and unpack them on the device."""

    name: str
    supports_calib: bool

    def plan(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> PackedLayout: ...

    def encode(
        self,
        tensors: Mapping[str, torch.Tensor],
        layout: PackedLayout,
        out: torch.Tensor,
        *,
        calib: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
    ) -> None: ...

    def decode(
        self,
        record: torch.Tensor,
        layout: PackedLayout,
        dtype: torch.dtype,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]: ...

    def linear(
        self, x: torch.Tensor, record: torch.Tensor, layout: PackedLayout, name: str, transposed: bool
    ) -> torch.Tensor: ...


# Fused dequant-matmul pays off while the weight read dominates: up to this many tokens the
# kernel reads the codes once per 16-token tile; beyond it, one dequant + cuBLAS is faster.
FUSED_MAX_TOKENS = 16


def linear_input(x: torch.Tensor, entry: TensorEntry, transposed: bool, codec: str) -> torch.Tensor:
    """x [..., in] -> [T, in] after checking `in` against the weight's layout."""
    if len(entry.shape) != 2:
        raise CodecInputError(f"{codec}.linear: {entry.name!r} has shape {entry.shape}; linear needs a 2-D weight.")
    k = entry.shape[0] if transposed else entry.shape[1]
    if x.shape[-1] != k:
        layout = "[in, out] (x @ W)" if transposed else "[out, in] (x @ W.T)"
        raise CodecInputError(
            f"{codec}.linear: x is {tuple(x.shape)} but {entry.name!r} {entry.shape} read as "
            f"{layout} takes in={k}; check `transposed`."
        )
    return x.reshape(-1, k)


def dense_linear(x2: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
    # x2 [T, in]; w [out, in] or [in, out] -> [T, out]
    return x2 @ w if transposed else F.linear(x2, w)


class PackedCodec:
    """Group-wise int8/int4 codec over the packed record (see module doc for the format)."""

    supports_calib = True

    def __init__(self, spec: QuantSpec) -> None:
        if not isinstance(spec, QuantSpec):
            raise ConfigError(f"PackedCodec needs a QuantSpec, got {type(spec).__name__}.")
        self.spec = spec
        self.name = spec.fmt

    def __repr__(self) -> str:
        return f"PackedCodec({self.spec})"

    def _sections(self, shape: tuple[int, ...]) -> list[tuple[str, int, bool]]:
        spec = self.spec
        numel = math.prod(shape)
        n_groups = numel // spec.group_size
        parts = [("codes", numel * spec.bits // 8, True)]
        if spec.double_quant:
            n_sb = -(-n_groups // spec.superblock_groups)
            parts.append(("stats", n_groups * spec.stats_bytes_per_group, False))
            parts.append(("superblocks", n_sb * 8, False))
        else:
            parts.append(("scales", n_groups * 2, False))
            if not spec.symmetric:
                parts.append(("zeros", n_groups, False))
        return parts

    def plan(self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> PackedLayout:
        """Layout of one expert record for tensors {name: (shape, dtype)}; allocates nothing."""
        s = self.spec
        return build_layout(self.name, s.fmt, s.flags, s.group_size, s.superblock_groups, specs, self._sections)

    def _check_layout(self, layout: PackedLayout) -> None:
        s = self.spec
        if (layout.codec, layout.fmt, layout.flags, layout.group_size, layout.superblock_groups) != (
            self.name, s.fmt, s.flags, s.group_size, s.superblock_groups,
        ):  # fmt: skip
            raise IncompatibleFileError(
                f"layout was planned by codec {layout.codec!r} (fmt {layout.fmt}, flags "
                f"{layout.flags}, group {layout.group_size}); this is {self!r}. Plan and decode "
                "with the same codec."
            )

    def encode(
        self,
        tensors: Mapping[str, torch.Tensor],
        layout: PackedLayout,
        out: torch.Tensor,
        *,
        calib: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Quantise + pack one expert into `out` (uint8 [layout.nbytes], e.g. pinned host memory).

        calib: optional activations [N, in] feeding the weights (a Tensor applies to every
        weight whose last dim equals its width; a mapping gives them per tensor name). Used to
        weight the refinement's error by E[x^2] per input channel; needs refine_iters > 0.
        """
        self._check_layout(layout)
        calib_by_name = _resolve_calib(calib, layout)
        encode_outputs(tensors, layout, out)
        for entry in layout.entries:
            t = tensors[entry.name]
            if not entry.quantized:
                raw = t.detach().to(entry.dtype).contiguous().reshape(-1).view(torch.uint8)
                section_view(out, entry.section("raw")).copy_(raw)
                continue
            h = _importance(calib_by_name.get(entry.name), entry, self.spec.group_size)
            _quantize_entry(t, entry, self.spec, out, h)

    def decode(
        self,
        record: torch.Tensor,
        layout: PackedLayout,
        dtype: torch.dtype,
        out: Mapping[str, torch.Tensor] | None = None,
        *,
        backend: str = "auto",
    ) -> dict[str, torch.Tensor]:
        """Dequantise every tensor of the record to `dtype` on the record's device.

        out: preallocated contiguous tensors (e.g. a GPU cache slot) written in place and
        returned; names it lacks are allocated. backend: "auto" (Triton on CUDA when importable,
        else torch), "torch" or "triton". CPU records have their header checked; CUDA records
        are not (that would sync): validate them when they enter the store.
        """
        self._check_layout(layout)
        out = decode_outputs(record, layout, dtype, out)
        use_triton = _use_triton(record, backend)
        result = {}
        for entry in layout.entries:
            dst = out.get(entry.name)
            if not entry.quantized:
                w = raw_tensor(record, entry, dtype)
            elif use_triton:
                from . import triton_kernels

                result[entry.name] = triton_kernels.dequantize(record, entry, self.spec, dtype, dst)
                continue
            else:
                w = dequantize_torch(record, entry, self.spec, dtype)
            result[entry.name] = w if dst is None else dst.copy_(w)
        return result

    def linear(
        self,
        x: torch.Tensor,
        record: torch.Tensor,
        layout: PackedLayout,
        name: str,
        transposed: bool,
        *,
        backend: str = "auto",
    ) -> torch.Tensor:
        """y = x @ W.T (W stored [out, in]) or x @ W (transposed: W stored [in, out]) straight
        from the record: x [..., in] -> y [..., out] in x.dtype.

        Up to FUSED_MAX_TOKENS tokens on CUDA a fused Triton dequant-matmul reads the codes
        directly; otherwise the tensor is dequantised to a temporary and multiplied.
        """
        self._check_layout(layout)
        check_record(record, layout)
        entry = layout.entry(name)
        x2 = linear_input(x, entry, transposed, self.name)  # [T, in]
        n_out = entry.shape[1] if transposed else entry.shape[0]
        if entry.quantized and x2.shape[0] <= FUSED_MAX_TOKENS and _use_triton(record, backend):
            from . import triton_kernels

            y = triton_kernels.linear(x2, record, entry, self.spec, transposed)
        else:
            if not entry.quantized:
                w = raw_tensor(record, entry, x.dtype)
            else:
                w = dequantize_torch(record, entry, self.spec, x.dtype)
            y = dense_linear(x2, w, transposed)
        return y.reshape(*x.shape[:-1], n_out)


def pack_expert(
    codec: ExpertCodec,
    tensors: Mapping[str, torch.Tensor],
    *,
    calib: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
    pin_memory: bool = False,
) -> tuple[PackedLayout, torch.Tensor]:
    """Plan + encode one expert into a fresh record (pinned if asked): (layout, record)."""
    layout = codec.plan(tensor_specs(tensors))
    record = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=pin_memory)
    if calib is None:
        codec.encode(tensors, layout, record)
    else:
        codec.encode(tensors, layout, record, calib=calib)
    return layout, record
