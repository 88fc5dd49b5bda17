"""The lossless format's bit maths: exponent codes, encoding one tensor, and the torch decoders.

`mira_hf.quant.lossless` describes the format and holds the codec; this module turns one weight into
its sections and back (the Triton kernels in `triton_kernels` do the bulk decode on CUDA with the same
arithmetic). Everything here is integer arithmetic on the weights' bits: exact on every device.
"""

from __future__ import annotations

import torch

from .record import CodecInputError, TensorEntry, section_view

WINDOW = 14  # exponents base+1 .. base+14 get codes 1..14; 0 and 15 are the zero and escape codes
ESCAPE_CODE = 15

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


def encode_entry_classes(t: torch.Tensor, entry: TensorEntry, out: torch.Tensor) -> int:
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


def encode_entry_nibble(t: torch.Tensor, entry: TensorEntry, out: torch.Tensor) -> int:
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
