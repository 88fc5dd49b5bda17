"""Lossless expert records: bf16/fp32 weights split into byte planes and a 4-bit exponent code
(or the denser "classes" exponent code described below the format's constants, MiraConfig's default).

Bit-exact: decoding gives back every bit of every weight (NaN payloads, -0.0 and subnormals
included), so a model served from these records computes exactly what the resident model does,
while ~25 % fewer bytes cross the PCIe link (bf16).

Why it compresses: trained (and randomly initialised) weights use few exponents. In mira-tiny and
in N(0, 0.02) bf16 weights, 14 consecutive exponents hold all but 0.03 % of the weights (the
exponent's entropy is ~2.55 bits of its 8). Sign and mantissa are close to uniform: kept as they are.

Per weight w with 16-bit high word hi (bf16: all of it; fp32: the top half) and exponent
e = (hi >> 7) & 0xFF:

    sm     uint8              (sign << 7) | top 7 mantissa bits          (1 B / weight)
    lo     int16  fp32 only   the low 16 mantissa bits, as they are        (2 B / weight)
    code   4 bits             0: e = 0 (zero, subnormal)
                              1..14: e = base + code
                              15: escape: e lies outside [base + 1, base + 14]; patched
    escape (int32 index, int16 value): the index of hi among the output's 16-bit words (bf16:
                              the element; fp32: 2 * element + 1, little-endian) and the true hi

so bf16 takes 12 bits + escapes (0.75x), fp32 28 bits + escapes (0.875x). `base` is chosen per
tensor and expert: the 14-exponent window (exponent 0 excluded: it has its own code) that holds the
most weights. Exact zeros cost nothing extra, so pruned weights compress as well as dense ones.

Record: the packed record of `mira_hf.quant.packed` (same 64 B header, magic b"MIRQ", format code 4,
every section on ALIGN_BYTES), sections per encoded tensor:

    meta       int32 [2]                  (base, escapes in this expert)
    sm         uint8 [numel]
    lo         int16 [numel]              fp32 only
    codes      uint8 [ceil(numel / 2)]    element 2i in the low nibble of byte i, 2i+1 in the high
    esc_index  int32 [capacity]
    esc_value  int16 [capacity]

Records of one layer share one layout (slots have one size), so `capacity` is the largest escape
count over the layer's experts, measured when the layout is planned from the weights
(`plan_experts`); an expert with fewer escapes fills the rest with a harmless entry (the first
weight's own value), so decoding patches all `capacity` entries without reading the count (no
device->host sync). A tensor whose encoding would not be smaller (1-D biases; weights with very
spread exponents) is stored raw ("raw" section). Decoding: the bulk planes by one Triton kernel on
CUDA (`triton_kernels.lossless_decode`; the torch reference below on CPU), then one `index_put_`
of the escapes.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping

import torch

from ..errors import ConfigError, IncompatibleFileError
from .packed import (
    FORMAT_VERSION,
    HEADER_BYTES,
    CodecInputError,
    PackedLayout,
    Section,
    TensorEntry,
    _align,
    _use_triton,
    check_record,
    decode_outputs,
    dense_linear,
    encode_outputs,
    linear_input,
    section_view,
)

FMT = "lossless"
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
WINDOW = 14  # exponents base+1 .. base+14 get codes 1..14; 0 and 15 are the zero and escape codes
ESCAPE_CODE = 15
ESCAPE_BYTES = 6  # int32 word index + int16 value
_MAX_WORDS = 2**31 - 1  # escape indices are int32 indices of 16-bit words


# The "classes" exponent code (LosslessCodec(code="classes"), MiraConfig's default, ~0.69x bf16 instead of 0.75x). Per tensor
# and expert, the four most frequent exponents t0..t3 and a window of 15 exponents [lo, lo + 14]; a 2-bit
# class per weight says t0 | t1 | t2 or t3 (+1 extra bit) | lo + v (+4 extra bits v; v = 15: an escape,
# patched like the nibble code's escapes). t0..t3 never take class 3, so the window holds the next most
# frequent exponents. Each block of CLASS_BLOCK weights starts its extra bits on a byte (offset per
# block), so a decoder finds every field with one prefix sum over its block, and turns (class, field)
# into an exponent with arithmetic and selects on five numbers (`exps`), no table lookups.
CODES = ("nibble", "classes")
CLASS_BLOCK = 256
CLASS_WINDOW = 15  # class-3 fields 0..14: exponent lo + field; 15: escape
_BITS_OF_CLASS = (0, 0, 1, 4)


def _words_per_element(dtype: torch.dtype) -> int:
    return 2 if dtype == torch.float32 else 1


def _encoded_sections(numel: int, dtype: torch.dtype, capacity: int) -> list[tuple[str, int, bool]]:
    """(name, bytes, is_payload) of one encoded tensor; escapes and metadata are overhead."""
    parts = [("meta", 8, False), ("sm", numel, True)]
    if dtype == torch.float32:
        parts.append(("lo", 2 * numel, True))
    parts += [("codes", (numel + 1) // 2, True), ("esc_index", 4 * capacity, False), ("esc_value", 2 * capacity, False)]
    return parts


def _class_sections(numel: int, dtype: torch.dtype, capacity: int, extra: int) -> list[tuple[str, int, bool]]:
    """Sections of one tensor under the classes code; `extra`: bytes of extra bits reserved (+2: a decoder
    reads a 2-byte window at the last field)."""
    parts = [("meta", 8, False), ("exps", 4 * 8, False), ("sm", numel, True)]  # exps: t0, t1, t2, t3, lo, 0, 0, 0
    if dtype == torch.float32:
        parts.append(("lo", 2 * numel, True))
    parts += [
        ("cls", (numel + 3) // 4, True),
        ("boff", 4 * (-(-numel // CLASS_BLOCK)), False),
        ("extra", extra + 2, True),
        ("esc_index", 4 * capacity, False),
        ("esc_value", 2 * capacity, False),
    ]
    return parts


def _span(parts: list[tuple[str, int, bool]]) -> int:
    return sum(_align(n) for _, n, _ in parts)


def _check_specs(specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    for name, (shape, dtype) in specs.items():
        if len(shape) >= 2 and dtype not in SUPPORTED_DTYPES:
            raise ConfigError(
                f"quantization='lossless' supports bfloat16 and float32 expert weights; {name!r} is {dtype}. "
                "Load the model in one of those (from_pretrained(..., dtype=torch.bfloat16)) or use quantization=None."
            )
        if len(shape) >= 2 and math.prod(shape) * _words_per_element(dtype) > _MAX_WORDS:
            raise ConfigError(
                f"lossless: {name!r} {tuple(shape)} has more than 2**31 16-bit words, beyond the format's int32 "
                "escape indices; use quantization=None for this model."
            )


def build_lossless_layout(
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    capacity: Mapping[str, int],
    extra: Mapping[str, int] | None = None,
) -> PackedLayout:
    """Layout of one expert record: `capacity[name]` escapes reserved per tensor; with `extra` (bytes of
    extra bits per tensor) the tensors use the classes exponent code, else the nibble code."""
    _check_specs(specs)
    cursor, payload, entries = HEADER_BYTES, 0, []
    for name, (shape, dtype) in specs.items():
        shape = tuple(int(d) for d in shape)
        numel = math.prod(shape)
        raw_parts = [("raw", max(1, numel) * dtype.itemsize, True)]
        encoded = len(shape) >= 2
        if encoded:
            cap = int(capacity.get(name, 0))
            parts = _encoded_sections(numel, dtype, cap) if extra is None else _class_sections(numel, dtype, cap, extra[name])
            encoded = _span(parts) < _span(raw_parts)  # escapes so many that raw is smaller: store raw
        sections = []
        for sec_name, nbytes, is_payload in parts if encoded else raw_parts:
            offset = _align(cursor)
            sections.append(Section(sec_name, offset, nbytes))
            cursor = offset + nbytes
            payload += nbytes if is_payload else 0
        entries.append(TensorEntry(name, shape, dtype, encoded, tuple(sections)))
    nbytes = _align(cursor)
    text = repr((FMT, FORMAT_VERSION)) + "".join(repr((e.name, e.shape, str(e.dtype), e.sections)) for e in entries)
    return PackedLayout(
        codec=FMT,
        fmt=FMT,
        flags=0,
        group_size=0,
        superblock_groups=0,
        entries=tuple(entries),
        nbytes=nbytes,
        payload_bytes=payload,
        meta_bytes=nbytes - payload,
        fingerprint=zlib.crc32(text.encode()),
    )


# --------------------------------------------------------------------------------------------
# Encode (plain torch, on the weights' device: CPU at load, or CUDA when the weights are there)
# --------------------------------------------------------------------------------------------


# Elements per step of encode / the torch decode on a CPU: 2**18 int16 words (512 KiB) keep each
# step's temporaries in L2. On a GPU, steps of 2**24 weights: a few launches and syncs per tensor,
# and temporaries bounded (~130 MB of int64 per step) whatever the tensor's size. The step never
# changes the bits (the encoder's blocks and escapes do not depend on it).
_CHUNK = 1 << 18
_DEVICE_CHUNK = 1 << 24


def _chunk(t: torch.Tensor) -> int:
    return _CHUNK if t.device.type == "cpu" else min(_DEVICE_CHUNK, max(t.numel() + t.numel() % 2, 2))


def _high_low(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Flat 16-bit words of a weight: (hi int16 [n], lo int16 [n] or None for bf16)."""
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16), None
    w = t.view(torch.int32)
    return (w >> 16).to(torch.int16), w.to(torch.int16)  # int32 -> int16 keeps the low half


def _sign_mantissa(hi: torch.Tensor) -> torch.Tensor:
    """The `sm` byte of 16-bit high words: sign into bit 7, the top mantissa bits 6..0 (uint8)."""
    return ((hi >> 8) & 0x80).bitwise_or_(hi & 0x7F).to(torch.uint8)


def _words_and_planes(record: torch.Tensor, entry: TensorEntry, out: torch.Tensor | None):
    """What both bulk decoders start from: the output words [numel] (int16 for bf16, int32 for fp32;
    `out` when given), the `sm` plane and the fp32 `lo` plane (None for bf16)."""
    fp32 = entry.dtype == torch.float32
    if out is None:
        out = torch.empty(entry.numel, dtype=torch.int32 if fp32 else torch.int16, device=record.device)
    lo_all = section_view(record, entry.section("lo"), torch.int16) if fp32 else None
    return out, section_view(record, entry.section("sm")), lo_all


def _write_words(out: torch.Tensor, s: int, sm: torch.Tensor, e: torch.Tensor, lo_all: torch.Tensor | None) -> None:
    """Decoded output words from `s` on: the high word from `sm` (int32) and exponent `e`, and for fp32
    (`lo_all` given) the low mantissa word below it. Both decoders end here."""
    hi = ((sm & 0x80) << 8).bitwise_or_(e << 7).bitwise_or_(sm & 0x7F)  # int32, 16 significant bits
    if lo_all is not None:
        out[s : s + sm.numel()] = (hi << 16).bitwise_or_(lo_all[s : s + sm.numel()].to(torch.int32) & 0xFFFF)
    else:
        out[s : s + sm.numel()] = hi  # the int16 cast keeps the low 16 bits


def _exponents(hi: torch.Tensor) -> torch.Tensor:
    return (hi >> 7).to(torch.uint8)  # the cast keeps the low 8 bits: the exponent without the sign


def _histogram(hi: torch.Tensor) -> torch.Tensor:
    """Exponent histogram [256] (int64) of 16-bit high words."""
    hist = torch.zeros(256, dtype=torch.int64, device=hi.device)
    step = _chunk(hi)
    for s in range(0, hi.numel(), step):
        hist += torch.bincount(_exponents(hi[s : s + step]), minlength=256)
    return hist


def _best_base(hist: torch.Tensor) -> tuple[int, int]:
    """(base, escapes) for an exponent histogram [256]: the window [base+1, base+WINDOW] holding
    the most non-zero-exponent weights (the first such window, so encoding is deterministic)."""
    h = hist.clone()
    h[0] = 0  # exponent 0 has its own code
    cs = torch.cat((h.new_zeros(1), h.cumsum(0)))  # cs[k] = sum h[:k]
    win = cs[WINDOW + 1 :] - cs[1:-WINDOW]  # win[b] = sum h[b+1 : b+1+WINDOW], b = 0 .. 255-WINDOW
    base = int(torch.argmax(win))
    return base, int(h.sum() - win[base])


def escape_count(t: torch.Tensor) -> int:
    """Escapes of one tensor under its best base (what its record must have room for)."""
    return _best_base(_histogram(_high_low(t)[0]))[1]


def _class_chunk(t: torch.Tensor) -> int:
    """Elements per step of the classes code: whole blocks (and whole class bytes)."""
    return _CHUNK if t.device.type == "cpu" else min(_DEVICE_CHUNK, max(-(-t.numel() // CLASS_BLOCK) * CLASS_BLOCK, CLASS_BLOCK))


def _class_table(hist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For an exponent histogram [256]: (class of each exponent [256] int64, its extra-bit field [256]
    int64, exps [8] int32 = t0, t1, t2, t3, lo, 0, 0, 0). t0..t3: the four most frequent exponents (ties
    by the lower exponent); lo: the first start of the 15-exponent window holding the most other
    weights. Exponents in neither are escapes: class 3, field 15. Deterministic."""
    dev = hist.device
    top = torch.sort(-hist, stable=True).indices[:4]
    rest = hist.clone()
    rest[top] = 0
    cs = torch.cat((rest.new_zeros(1), rest.cumsum(0)))
    lo = int(torch.argmax(cs[CLASS_WINDOW:] - cs[:-CLASS_WINDOW]))  # window [lo, lo + 14], lo = 0 .. 241
    class_of = torch.full((256,), 3, dtype=torch.int64, device=dev)
    field_of = torch.full((256,), CLASS_WINDOW, dtype=torch.int64, device=dev)
    field_of[lo : lo + CLASS_WINDOW] = torch.arange(CLASS_WINDOW, device=dev)
    class_of[top] = torch.tensor([0, 1, 2, 2], device=dev)
    field_of[top] = torch.tensor([0, 0, 0, 1], device=dev)
    exps = torch.zeros(8, dtype=torch.int32, device=dev)
    exps[:4], exps[4] = top.to(torch.int32), lo
    return class_of, field_of, exps


def _blocks(nb: torch.Tensor) -> torch.Tensor:
    """Each weight's extra-bit count [m] as blocks of CLASS_BLOCK weights [blocks, CLASS_BLOCK], zero-padded."""
    pad = (-nb.numel()) % CLASS_BLOCK
    return (torch.cat((nb, nb.new_zeros(pad))) if pad else nb).view(-1, CLASS_BLOCK)


def _block_bytes(nb: torch.Tensor) -> torch.Tensor:
    """Bytes of extra bits per block of CLASS_BLOCK weights ([blocks]), from each weight's bit count."""
    return (_blocks(nb).sum(1) + 7) // 8


def _field_bits(nb: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Bit offset of each weight's field in the extra-bit stream [m] (int64): its block's first byte
    (`starts` [blocks], int64) and the bits of the fields before it in its block. The encoder and the
    decoders (torch here, Triton's prefix sum) place fields by this rule."""
    nbp = _blocks(nb)
    return ((torch.cumsum(nbp, 1) - nbp) + starts[:, None] * 8).view(-1)[: nb.numel()]


def _class_info(hist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The classes code of one tensor from its exponent histogram [256]: (info [256] int16, exps [8]
    int32, escapes). info[e] packs exponent e's class (bits 0-1), its extra-bit count (2-4), its field
    (5-8) and whether it escapes (bit 9), so the encoder looks each weight up once."""
    class_of, field_of, exps = _class_table(hist)
    bits_of = torch.tensor(_BITS_OF_CLASS, dtype=torch.int64, device=hist.device)[class_of]
    escaped = (class_of == 3) & (field_of == CLASS_WINDOW)
    info = class_of | (bits_of << 2) | (field_of << 5) | (escaped.long() << 9)
    return info.to(torch.int16), exps, int(hist[escaped].sum())


def _lookup(info: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """info[exponent] of each 16-bit high word [m] (int16): one gather with int32 indices."""
    return info.index_select(0, _exponents(hi).to(torch.int32))


def _block_sizes(nb: torch.Tensor) -> torch.Tensor:
    """Bytes of extra bits per block of CLASS_BLOCK weights ([blocks], int64) from each weight's bit count
    (int16; a block's sum is at most 4 * CLASS_BLOCK)."""
    return (_blocks(nb).sum(1, dtype=torch.int32) + 7).div_(8, rounding_mode="floor").to(torch.int64)


def class_code_size(t: torch.Tensor) -> tuple[int, int]:
    """(escapes, bytes of extra bits) of one tensor under the classes code (what its record must hold)."""
    hi, _ = _high_low(t)
    info, _, escapes = _class_info(_histogram(hi))
    nbytes, step = 0, _class_chunk(hi)
    for s in range(0, hi.numel(), step):
        nbytes += int(_block_sizes((_lookup(info, hi[s : s + step]) >> 2) & 7).sum())
    return escapes, nbytes


def _encode_entry_classes(t: torch.Tensor, entry: TensorEntry, out: torch.Tensor) -> int:
    """Write one tensor's sections under the classes code; returns its escape count."""
    hi, lo = _high_low(t)
    info, exps, escapes = _class_info(_histogram(hi))
    dev = hi.device
    here = lambda x: x if x.device == out.device else x.to(out.device)  # noqa: E731
    sm_all, cls_all = section_view(out, entry.section("sm")), section_view(out, entry.section("cls"))
    boff_all = section_view(out, entry.section("boff"), torch.int32)
    extra_all = section_view(out, entry.section("extra"))
    room = extra_all.numel() - 2
    esc, at = [], 0  # at: bytes of extra bits written so far
    step = _class_chunk(hi)
    for s in range(0, hi.numel(), step):  # s: a multiple of CLASS_BLOCK (and of 4)
        x = hi[s : s + step]
        m = x.numel()
        code = _lookup(info, x)  # [m] int16: class | bits << 2 | field << 5 | escaped << 9
        if escapes:  # rare: the histogram says whether any weight of the tensor escapes
            esc.append((code >> 9).nonzero().squeeze(1) + s)
        c = (code & 3).to(torch.uint8)
        c4 = torch.cat((c, c.new_zeros((-m) % 4))).view(-1, 4)
        cls_all[s // 4 : s // 4 + c4.shape[0]].copy_(here(c4[:, 0] | c4[:, 1] << 2 | c4[:, 2] << 4 | c4[:, 3] << 6))
        sm_all[s : s + m].copy_(here(_sign_mantissa(x)))
        nb = (code >> 2) & 7  # [m] int16
        sizes = _block_sizes(nb)  # [blocks]
        starts = torch.cumsum(sizes, 0) - sizes  # first byte of each block, in this chunk
        boff_all[s // CLASS_BLOCK : s // CLASS_BLOCK + sizes.numel()].copy_(here((starts + at).to(torch.int32)))
        total = int(sizes.sum())
        if at + total > room:
            raise CodecInputError(
                f"encode: {entry.name!r} needs more than the {room} bytes of extra bits its layout reserves; plan the "
                "layout from every expert it will hold: codec.plan_experts(fused)."
            )
        if total:
            nbp = _blocks(nb)
            pos = ((torch.cumsum(nbp, 1, dtype=torch.int32) - nbp) + (starts[:, None] * 8).to(torch.int32)).view(-1)[:m]
            pos = pos.to(torch.int64)  # bit of each field in the chunk (its bits were counted above: < 2**31)
            v = ((code >> 5) & 15).to(torch.int64)  # 0 where a weight has no extra bits: adding it changes nothing
            # fields never overlap, so adding them into 64-bit words is OR-ing them; a field crossing a word
            # boundary puts its high bits into the next word. Little-endian words are the bytes, LSB first.
            # (v >> 1) >> (63 - shift) is v >> (64 - shift) without a shift by 64 (0 where nothing crosses).
            words = torch.zeros(-(-total // 8) + 2, dtype=torch.int64, device=dev)
            shift = pos & 63
            index = pos >> 6
            words.scatter_add_(0, index, v << shift)
            words.scatter_add_(0, index.add_(1), (v >> 1).bitwise_right_shift_(63 - shift))
            extra_all[at : at + total].copy_(here(words.view(torch.uint8)[:total]))
        at += total
    section_view(out, entry.section("exps"), torch.int32).copy_(here(exps))
    return _write_escapes(hi, lo, esc, 0, entry, out)


def _encode_entry(t: torch.Tensor, entry: TensorEntry, out: torch.Tensor) -> int:
    """Write one tensor's sections into the record `out`; returns its escape count."""
    hi, lo = _high_low(t)
    base, escapes = _best_base(_histogram(hi))
    n = hi.numel()
    here = lambda x: x if x.device == out.device else x.to(out.device)  # noqa: E731
    sm_all = section_view(out, entry.section("sm"))
    codes_all = section_view(out, entry.section("codes"))
    esc, step = [], _chunk(hi)
    for s in range(0, n, step):  # the step is even: chunks start on a code byte
        x = hi[s : s + step]
        e = _exponents(x)
        code = (e - (base + 1)).clamp_(max=WINDOW)  # uint8 wraps below base+1: in the window iff < WINDOW
        code += 1  # 1..WINDOW in the window, ESCAPE_CODE outside
        code.masked_fill_(e == 0, 0)
        if escapes:  # the histogram says whether any weight of the tensor escapes
            esc.append((code == ESCAPE_CODE).nonzero().squeeze(1) + s)
        if code.numel() % 2:
            code = torch.cat((code, code.new_zeros(1)))
        packed = code[0::2] | (code[1::2] << 4)
        sm_all[s : s + x.numel()].copy_(here(_sign_mantissa(x)))
        codes_all[s // 2 : s // 2 + packed.numel()].copy_(here(packed))
    return _write_escapes(hi, lo, esc, base, entry, out)


def _write_escapes(hi: torch.Tensor, lo: torch.Tensor | None, esc: list, base: int, entry: TensorEntry, out: torch.Tensor) -> int:
    """The sections both exponent codes share: meta (base, escapes), the low plane of fp32, and the
    escapes (`esc`: per chunk, the element indices whose exponent has no code). Returns the escape count."""
    dev = hi.device
    esc = torch.cat(esc) if esc else hi.new_zeros(0, dtype=torch.int64)  # [n_esc] int64, ascending
    capacity = entry.section("esc_index").nbytes // 4
    if esc.numel() > capacity:
        raise CodecInputError(
            f"encode: {entry.name!r} has {esc.numel()} exponents outside its window but the layout reserves "
            f"{capacity}; plan the layout from every expert it will hold: codec.plan_experts(fused)."
        )
    section_view(out, entry.section("meta"), torch.int32).copy_(torch.tensor([base, esc.numel()], dtype=torch.int32))
    if lo is not None:
        section_view(out, entry.section("lo"), torch.int16).copy_(lo)
    if capacity:
        words = _words_per_element(entry.dtype)
        element = torch.zeros(capacity, dtype=torch.int64, device=dev)  # slack entries: the first weight, idempotent
        element[: esc.numel()] = esc
        section_view(out, entry.section("esc_index"), torch.int32).copy_(element * words + (words - 1))
        section_view(out, entry.section("esc_value"), torch.int16).copy_(hi[element])  # each entry's true hi word
    return esc.numel()


# --------------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------------


def decode_words_torch(record: torch.Tensor, entry: TensorEntry, out: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of the bulk decode: the output's bits before escapes are patched, as int16
    (bf16) or int32 (fp32) words [numel], written into `out` when given. Same arithmetic as the
    Triton kernel."""
    n = entry.numel
    out, sm_all, lo_all = _words_and_planes(record, entry, out)
    codes_all = section_view(record, entry.section("codes"))
    base = section_view(record, entry.section("meta"), torch.int32)[:1]  # [1], no host read
    step = _chunk(sm_all)
    for s in range(0, n, step):
        sm = sm_all[s : s + step].to(torch.int32)
        packed = codes_all[s // 2 : s // 2 + (sm.numel() + 1) // 2]
        code = torch.stack((packed & 15, packed >> 4), 1).reshape(-1)[: sm.numel()].to(torch.int32)
        _write_words(out, s, sm, torch.where(code == 0, 0, code + base), lo_all)
    return out


def is_class_coded(entry: TensorEntry) -> bool:
    return any(s.name == "cls" for s in entry.sections)


def decode_words_classes_torch(record: torch.Tensor, entry: TensorEntry, out: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of the classes code's bulk decode (as `decode_words_torch`; the Triton kernel
    does the same arithmetic)."""
    n = entry.numel
    dev = record.device
    out, sm_all, lo_all = _words_and_planes(record, entry, out)
    cls_all = section_view(record, entry.section("cls"))
    boff_all = section_view(record, entry.section("boff"), torch.int32)
    extra_all = section_view(record, entry.section("extra"))
    exps = section_view(record, entry.section("exps"), torch.int32).to(torch.int64)
    bits_of = torch.tensor(_BITS_OF_CLASS, dtype=torch.int64, device=dev)
    step = _class_chunk(sm_all)
    for s in range(0, n, step):
        sm = sm_all[s : s + step].to(torch.int32)
        m = sm.numel()
        cb = cls_all[s // 4 : s // 4 + (m + 3) // 4].to(torch.int64)
        c = torch.stack((cb & 3, (cb >> 2) & 3, (cb >> 4) & 3, cb >> 6), 1).reshape(-1)[:m]
        nb = bits_of[c]
        starts = boff_all[s // CLASS_BLOCK : s // CLASS_BLOCK - (-m // CLASS_BLOCK)].to(torch.int64)
        off = _field_bits(nb, starts)  # bit of each field in `extra`
        byte = off >> 3
        window = extra_all[byte].to(torch.int64) | (extra_all[byte + 1].to(torch.int64) << 8)
        value = (window >> (off & 7)) & ((1 << nb) - 1)
        # t0, t1, t2 + field (t2 or t3), lo + field; an escape (field 15) gives lo + 15 (low 8 bits): patched
        e = ((exps[torch.where(c == 3, 4, c + value)] + torch.where(c == 3, value, 0)) & 0xFF).to(torch.int32)
        _write_words(out, s, sm, e, lo_all)
    return out


def patch_escapes(record: torch.Tensor, entry: TensorEntry, dst: torch.Tensor) -> None:
    """Write the escaped high words into `dst` (contiguous, entry.dtype): one index_put_."""
    index = section_view(record, entry.section("esc_index"), torch.int32)
    if index.numel():
        words = dst.view(-1).view(torch.int16)
        words.index_put_((index,), section_view(record, entry.section("esc_value"), torch.int16))


def decode_entry(record: torch.Tensor, entry: TensorEntry, dst: torch.Tensor, use_triton: bool) -> torch.Tensor:
    """Decode one tensor of the record into `dst` (contiguous, entry.shape, entry.dtype)."""
    if not entry.quantized:
        return dst.copy_(section_view(record, entry.section("raw"), entry.dtype).view(entry.shape))
    classes = is_class_coded(entry)
    if use_triton:
        from . import triton_kernels

        (triton_kernels.lossless_classes_decode if classes else triton_kernels.lossless_decode)(record, entry, dst)
    else:
        words = dst.view(-1).view(torch.int32 if entry.dtype == torch.float32 else torch.int16)
        (decode_words_classes_torch if classes else decode_words_torch)(record, entry, words)
    patch_escapes(record, entry, dst)
    return dst


# --------------------------------------------------------------------------------------------
# Codec
# --------------------------------------------------------------------------------------------


class LosslessCodec:
    """Bit-exact compressed records for bf16 / fp32 experts (see the module doc for the format).

    Its layout depends on the weights (the escape capacity): plan it with `plan_experts(fused)`
    over all experts that will share it; `plan(specs, capacity)` is the shape-level form.
    """

    name = FMT
    supports_calib = False
    lossless = True  # decode(encode(w)) == w bit for bit

    def __init__(self, code: str = "nibble") -> None:
        """code: the exponent code, "nibble" (4 bits, 0.75x bf16; this class's default) or "classes" (a 2-bit
        class plus 0-4 extra bits, ~0.69x bf16; what MiraConfig uses by default, QuantConfig.lossless_code)."""
        if code not in CODES:
            raise ConfigError(f"LosslessCodec(code={code!r}): supported are {list(CODES)}.")
        self.code = code

    def __repr__(self) -> str:
        return f"LosslessCodec(code={self.code!r})"

    def plan(
        self,
        specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        capacity: Mapping[str, int] | None = None,
        extra: Mapping[str, int] | None = None,
    ) -> PackedLayout:
        """Layout for tensors {name: (shape, dtype)} with `capacity[name]` escapes reserved (default
        0: only experts whose exponents all fit their window can be encoded); the classes code also
        reserves `extra[name]` bytes of extra bits (default: the most any tensor of that size can need)."""
        if self.code == "nibble":
            return build_lossless_layout(specs, capacity or {})
        most = {n: -(-math.prod(shape) // CLASS_BLOCK) * CLASS_BLOCK // 2 for n, (shape, _) in specs.items()}
        return build_lossless_layout(specs, capacity or {}, {**most, **(extra or {})})

    def plan_experts(self, fused: Mapping[str, torch.Tensor]) -> PackedLayout:
        """Layout for every expert of one layer, from its fused tensors name -> [E, ...]: each
        tensor's escape capacity is its largest escape count over the E experts."""
        specs = {n: (tuple(t.shape[1:]), t.dtype) for n, t in fused.items()}
        E = next(iter(fused.values())).shape[0]
        return self.plan_experts_from(specs, E, lambda e: {n: t[e] for n, t in fused.items()})

    def plan_experts_from(
        self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], num_experts: int, expert
    ) -> PackedLayout:
        """As `plan_experts`, reading the experts one at a time (`expert(e) -> {name: tensor}`): a
        checkpoint streamed from disk is planned without holding a whole layer."""
        _check_specs(specs)
        return self.plan_from_sizes(specs, [self.expert_sizes(expert(e)) for e in range(num_experts)])

    def expert_sizes(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
        """What one expert's record must hold, per encoded tensor: (escapes, bytes of extra bits; 0 for
        the nibble code). Computed on the tensors' device; `plan_from_sizes` combines the experts'."""
        sizes = {}
        for name, t in tensors.items():
            if t.dim() >= 2 and t.dtype in SUPPORTED_DTYPES:
                sizes[name] = (escape_count(t), 0) if self.code == "nibble" else class_code_size(t)
        return sizes

    def plan_from_sizes(
        self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], sizes: list[Mapping[str, tuple[int, int]]]
    ) -> PackedLayout:
        """The layout for experts whose `expert_sizes` are `sizes`: room for the most any of them needs."""
        _check_specs(specs)
        capacity = {name: 0 for name, (shape, _) in specs.items() if len(shape) >= 2}
        extra = dict.fromkeys(capacity, 0)
        for expert in sizes:
            for name in capacity:
                escapes, nbytes = expert[name]
                capacity[name], extra[name] = max(capacity[name], escapes), max(extra[name], nbytes)
        return build_lossless_layout(specs, capacity, extra if self.code == "classes" else None)

    def plan_args(self, layout: PackedLayout) -> dict:
        """What `plan` needs to rebuild `layout` from its specs (escape capacity and extra bytes per
        tensor), as JSON-able numbers: a saved store keeps them instead of reading the weights again."""
        capacity, extra = {}, {}
        for entry in layout.entries:
            names = {s.name: s for s in entry.sections}
            if entry.quantized:
                capacity[entry.name] = names["esc_index"].nbytes // 4
                if "extra" in names:
                    extra[entry.name] = names["extra"].nbytes - 2
            elif len(entry.shape) >= 2:
                capacity[entry.name] = entry.numel  # an escape per weight: more than raw, so it stays raw
        return {"capacity": capacity, "extra": extra}

    def scratch_bytes(self, layout: PackedLayout) -> int:
        """Device bytes `linear` decodes one weight into (placement "packed"): the largest 2-D one."""
        return max((e.numel * e.dtype.itemsize for e in layout.entries if len(e.shape) == 2), default=0)

    def _check_layout(self, layout: PackedLayout) -> None:
        if layout.codec != FMT:
            raise IncompatibleFileError(
                f"layout was planned by codec {layout.codec!r}; this is {self!r}. Plan and decode with the same codec."
            )

    def encode(
        self,
        tensors: Mapping[str, torch.Tensor],
        layout: PackedLayout,
        out: torch.Tensor,
        *,
        calib: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, int]:
        """Encode one expert into `out` (uint8 [layout.nbytes], e.g. pinned host memory), computing
        on the tensors' device. Returns the escape count per encoded tensor."""
        self._check_layout(layout)
        if calib is not None:
            raise CodecInputError("the lossless codec keeps every bit; it takes no calib activations.")
        encode_outputs(tensors, layout, out)
        escapes = {}
        for entry in layout.entries:
            t = tensors[entry.name]
            if t.dtype != entry.dtype:
                raise CodecInputError(
                    f"encode: {entry.name!r} is {t.dtype}; the layout holds {entry.dtype} (lossless keeps the dtype)."
                )
            if entry.quantized:
                escapes[entry.name] = (_encode_entry_classes if is_class_coded(entry) else _encode_entry)(t, entry, out)
            else:
                raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
                section_view(out, entry.section("raw")).copy_(raw)
        return escapes

    def decode(
        self,
        record: torch.Tensor,
        layout: PackedLayout,
        dtype: torch.dtype,
        out: Mapping[str, torch.Tensor] | None = None,
        *,
        backend: str = "auto",
    ) -> dict[str, torch.Tensor]:
        """Every tensor of the record, bit-exact, on the record's device (converted if `dtype` is
        not the stored one). `out`: preallocated contiguous tensors (a cache slot) written in place.
        backend: "auto" (Triton on CUDA when importable), "torch" or "triton". CPU records have
        their header checked; CUDA records are not (that would sync)."""
        self._check_layout(layout)
        out = decode_outputs(record, layout, dtype, out)
        use_triton = _use_triton(record, backend)
        result = {}
        for entry in layout.entries:
            dst = out.get(entry.name)
            if entry.dtype == dtype:
                if dst is None:
                    dst = torch.empty(entry.shape, dtype=dtype, device=record.device)
                result[entry.name] = decode_entry(record, entry, dst, use_triton)
            else:
                w = decode_entry(record, entry, torch.empty(entry.shape, dtype=entry.dtype, device=record.device), use_triton)
                result[entry.name] = w.to(dtype) if dst is None else dst.copy_(w)
        return result

    def linear(
        self,
        x: torch.Tensor,
        record: torch.Tensor,
        layout: PackedLayout,
        name: str,
        transposed: bool,
        *,
        scratch: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> torch.Tensor:
        """y = x @ W.T (W stored [out, in]) or x @ W (transposed): W decoded into `scratch` (a
        uint8 device buffer of `scratch_bytes(layout)`, reused call after call) and multiplied with
        the same op the resident model uses, so y is bit-identical to it."""
        self._check_layout(layout)
        check_record(record, layout)
        entry = layout.entry(name)
        x2 = linear_input(x, entry, transposed, self.name)  # [T, in]
        n_out = entry.shape[1] if transposed else entry.shape[0]
        nbytes = entry.numel * entry.dtype.itemsize
        if scratch is not None and scratch.numel() >= nbytes and scratch.device == record.device:
            w = scratch[:nbytes].view(entry.dtype).view(entry.shape)
        else:
            w = torch.empty(entry.shape, dtype=entry.dtype, device=record.device)
        w = decode_entry(record, entry, w, _use_triton(record, backend))
        if x.dtype != entry.dtype:
            w = w.to(x.dtype)
        return dense_linear(x2, w, transposed).reshape(*x.shape[:-1], n_out)


__all__ = [
    "ESCAPE_CODE",
    "SUPPORTED_DTYPES",
    "WINDOW",
    "LosslessCodec",
    "build_lossless_layout",
    "decode_entry",
    "decode_words_torch",
    "escape_count",
    "patch_escapes",
]
