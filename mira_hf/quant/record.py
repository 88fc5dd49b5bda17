"""The packed record: its byte layout, its header, and the checks on records and tensors.

One expert travels host -> GPU as ONE contiguous uint8 record, so a fetch is one copy:

    [header 64 B][tensor 0 sections][tensor 1 sections]...      every section starts on 64 B

A codec decides each tensor's sections (`lay_out` places them); 1-D (and 0-D) tensors, e.g.
biases, are stored raw in their own dtype in one "raw" section.

Header (little-endian, zero-padded to 64 B): magic b"MIRQ", version u16, format u8 (the codec's
registered `format_code`: 1 int8, 2 int4, 3 nf4, 4 lossless), flags u8 (1 symmetric, 2
double_quant), group_size u32, superblock_groups u32, n_tensors u32, layout fingerprint u32 (crc32 of
names, shapes, dtypes and section offsets), nbytes u64, payload_bytes u64. `validate_record`
compares it with the layout's; the store validates every record once, when it is stored.

This module knows no codec: the format codes come from the registry.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError, IncompatibleFileError, MiraError
from .formats import GROUP_SIZES
from .registry import format_codes

MAGIC = b"MIRQ"
FORMAT_VERSION = 1
HEADER_BYTES = 64
# Every section starts on this boundary: 16 B is the widest vector load a kernel issues and DMA
# engines prefer 64 B; the record's total size is a multiple of it too, so records can be
# packed back to back in one pinned host buffer and every record stays aligned.
ALIGN_BYTES = 64
FLAG_SYMMETRIC = 1
FLAG_DOUBLE_QUANT = 2

WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class CodecInputError(MiraError, ValueError):
    """Tensors, buffers or activations handed to a codec do not match its layout."""


def check_group_size(group_size: object, owner: str) -> None:
    if not isinstance(group_size, int) or group_size not in GROUP_SIZES:
        raise ConfigError(f"{owner}.group_size={group_size!r} is not supported; use one of {GROUP_SIZES} (64 is the default).")


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
            format_codes()[self.fmt],
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
            if dtype not in WEIGHT_DTYPES:
                raise CodecInputError(
                    f"{codec}.plan: weight {name!r} has dtype {dtype}; supported: {[str(d) for d in WEIGHT_DTYPES]}."
                )
            if shape[-1] % group_size:
                fits = [g for g in GROUP_SIZES if shape[-1] % g == 0]
                raise ConfigError(
                    f"{codec}: group_size={group_size} does not divide the last dim of "
                    f"{name!r} {tuple(shape)}. "
                    + (
                        f"Group sizes that fit it: {fits}."
                        if fits
                        else "No supported group size fits it: serve this model uncompressed."
                    )
                )


# (section name, bytes, whether they count as payload) of one tensor's sections, in record order
Parts = list[tuple[str, int, bool]]


def raw_parts(shape: tuple[int, ...], dtype: torch.dtype) -> Parts:
    """The one section of a tensor stored as it is (1-D tensors, and weights a codec leaves raw)."""
    return [("raw", max(1, math.prod(shape)) * dtype.itemsize, True)]


def lay_out(
    codec: str,
    fmt: str,
    flags: int,
    group_size: int,
    superblock_groups: int,
    tensors: Iterable[tuple[str, tuple[int, ...], torch.dtype, bool, Parts]],
    identity: tuple,
) -> PackedLayout:
    """Place header and sections (each on ALIGN_BYTES) of `tensors`, (name, shape, dtype, encoded, parts)
    in record order; `identity` (what else the records depend on) enters the layout's fingerprint."""
    cursor = HEADER_BYTES
    payload = 0
    entries = []
    for name, shape, dtype, encoded, parts in tensors:
        sections = []
        for sec_name, nbytes, is_payload in parts:
            offset = _align(cursor)
            sections.append(Section(sec_name, offset, nbytes))
            cursor = offset + nbytes
            payload += nbytes if is_payload else 0
        entries.append(TensorEntry(name, shape, dtype, encoded, tuple(sections)))
    nbytes = _align(cursor)
    text = repr(identity) + "".join(repr((e.name, e.shape, str(e.dtype), e.sections)) for e in entries)
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


def build_layout(
    codec: str,
    fmt: str,
    flags: int,
    group_size: int,
    superblock_groups: int,
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    quant_sections,  # (shape: tuple[int, ...]) -> Parts
) -> PackedLayout:
    """The layout of a group-wise codec: every 2-D (or N-D) weight encoded in `quant_sections(shape)`."""
    check_specs(specs, group_size, codec)
    tensors = []
    for name, (shape, dtype) in specs.items():
        shape = tuple(int(d) for d in shape)
        encoded = len(shape) >= 2
        tensors.append((name, shape, dtype, encoded, quant_sections(shape) if encoded else raw_parts(shape, dtype)))
    identity = (codec, fmt, flags, group_size, superblock_groups, FORMAT_VERSION)
    return lay_out(codec, fmt, flags, group_size, superblock_groups, tensors, identity)


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The `plan` argument describing these tensors."""
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


# --------------------------------------------------------------------------------------------
# Record checks (cheap, CPU-side; a record is validated once, when it is stored)
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
    if not group_size:  # a format without groups (lossless): its name says it all
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
        fmt = {v: k for k, v in format_codes().items()}.get(fmt_code, f"unknown format {fmt_code}")
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
