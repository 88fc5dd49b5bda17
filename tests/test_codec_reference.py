"""The codecs' torch reference paths against the formats' definitions, value by value.

Each record format is decoded here a second time, independently, from what its documentation says the
bytes mean (`mira_hf.quant.packed`'s, `lossless`'s, `fp8_block`'s and `mxfp4`'s module docs), and the
codec's decode must give the same bits; encoders are checked on inputs whose records can be written
out by hand. Small tensors only: every test runs in well under a second.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from mira_hf.quant import LosslessCodec, PackedCodec, QuantSpec, make_codec, pack_expert, tensor_specs
from mira_hf.quant.fp8_block import Fp8BlockCodec, dequantize_fp8
from mira_hf.quant.lossless_bits import decode_words_classes_torch, decode_words_torch
from mira_hf.quant.mxfp4 import Mxfp4Codec, dequantize_mxfp4

# every storage variant of int8/int4, with superblocks small enough that a tensor has several
VARIANTS = [
    dict(fmt=fmt, symmetric=sym, double_quant=dq, group_size=g, superblock_groups=sb, refine_iters=r)
    for fmt in ("int4", "int8")
    for sym in (False, True)
    for dq in (True, False)
    for g, sb, r in ((16, 3, 0), (32, 64, 2))
]
VARIANT_IDS = [
    f"{v['fmt']}-{'sym' if v['symmetric'] else 'asym'}-{'dq' if v['double_quant'] else 'fp16'}-g{v['group_size']}-r{v['refine_iters']}"
    for v in VARIANTS
]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, dtype and shape (`torch.equal` alone compares values across dtypes)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def section(record: torch.Tensor, layout, name: str, sec: str) -> bytes:
    entry = next(e for e in layout.entries if e.name == name)
    s = next(s for s in entry.sections if s.name == sec)
    return bytes(record[s.offset : s.offset + s.nbytes].numpy())


def has_section(layout, name: str, sec: str) -> bool:
    return any(s.name == sec for e in layout.entries if e.name == name for s in e.sections)


# ---------------------------------------------------------------------------------------- int8 / int4
def decode_by_definition(record: torch.Tensor, layout, name: str, spec: QuantSpec) -> torch.Tensor:
    """One weight of a packed int8/int4 record, float32, read byte by byte as the format says:
    w = (q - z) * s per group; int4 codes: element 2i in the low nibble; double_quant stats per group
    (int4 asym: (c << 4) | z, int8 asym: [z, c], symmetric: c), s = exp2(a + c * b) with the
    superblock's fp32 (a, b); otherwise fp16 scales and uint8 zeros; symmetric z = qmax / 2."""
    entry = next(e for e in layout.entries if e.name == name)
    G, bits, qmax = spec.group_size, spec.bits, 2**spec.bits - 1
    n_groups = entry.numel // G
    raw = section(record, layout, name, "codes")
    q = [b for byte in raw for b in ((byte & 15, byte >> 4) if bits == 4 else (byte,))]
    scales, zeros, a_b_c = [], [], []
    if spec.double_quant:
        stats = section(record, layout, name, "stats")
        ab = struct.unpack(
            f"<{len(section(record, layout, name, 'superblocks')) // 4}f", section(record, layout, name, "superblocks")
        )
        for g in range(n_groups):
            if spec.symmetric:
                c, z = stats[g], qmax / 2
            elif bits == 4:
                c, z = stats[g] >> 4, stats[g] & 15
            else:
                z, c = stats[2 * g], stats[2 * g + 1]
            sb = g // spec.superblock_groups
            a_b_c.append((ab[2 * sb], ab[2 * sb + 1], c))
            zeros.append(z)
        a, b, c = torch.tensor(a_b_c, dtype=torch.float32).unbind(1)
        scales = torch.exp2(a + c * b).tolist()  # fp32 arithmetic, as the format defines it
    else:
        scales = list(struct.unpack(f"<{n_groups}e", section(record, layout, name, "scales")))
        zeros = [qmax / 2] * n_groups if spec.symmetric else list(section(record, layout, name, "zeros"))
    q = torch.tensor(q[: entry.numel], dtype=torch.float32).view(n_groups, G)
    s = torch.tensor(scales, dtype=torch.float32).view(-1, 1)
    z = torch.tensor(zeros, dtype=torch.float32).view(-1, 1)
    return ((q - z) * s).view(entry.shape)


def expert(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(24, 96, generator=g) * 0.02
    w[3] *= 40  # rows of other magnitudes: scales spread within a superblock
    w[5] = 0.0  # all-zero groups
    w[7, :48] = w[7, :48].abs() + 0.01  # groups without a negative weight
    w[9, 32:] = -w[9, 32:].abs() - 0.01  # and without a positive one
    return {"w": w.to(dtype), "bias": torch.randn(24, generator=g).to(dtype)}


@pytest.mark.parametrize("kw", VARIANTS, ids=VARIANT_IDS)
def test_decode_equals_the_format_read_by_hand(kw):
    spec = QuantSpec(**kw)
    codec = PackedCodec(spec)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tensors = expert(dtype)
        layout, record = pack_expert(codec, tensors)
        w = decode_by_definition(record, layout, "w", spec)
        out = codec.decode(record, layout, dtype, backend="torch")
        assert same(out["w"], w.to(dtype)), dtype
        assert same(out["bias"], tensors["bias"])  # 1-D tensors travel raw
        assert out["w"].shape == (24, 96) and out["w"].dtype == dtype
        as_fp32 = codec.decode(record, layout, torch.float32, backend="torch")
        assert same(as_fp32["w"], w) and as_fp32["bias"].dtype == torch.float32
        x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
        y = codec.linear(x, record, layout, "w", False, backend="torch")
        assert same(y, torch.nn.functional.linear(x, w.to(dtype)))
        y = codec.linear(x[:, :24], record, layout, "w", True, backend="torch")  # [in, out] read of the same record
        assert same(y, x[:, :24] @ w.to(dtype))


def grid_weight(spec: QuantSpec, rows: int = 8, cols: int = 64, seed: int = 0) -> torch.Tensor:
    """Weights exactly on a grid the format can store: per group, codes 0 and qmax both present, a
    power-of-two scale shared by each superblock (different between superblocks), an integer zero point
    (asymmetric) or qmax / 2 (symmetric). Encoding must give them back exactly."""
    G, qmax = spec.group_size, spec.qmax
    g = torch.Generator().manual_seed(seed)
    n_groups = rows * cols // G
    q = torch.randint(0, qmax + 1, (n_groups, G), generator=g).float()
    q[:, 0], q[:, -1] = 0, qmax  # the group's full range: min and max on the grid's ends
    sb = torch.arange(n_groups) // (spec.superblock_groups if spec.double_quant else 1)
    s = 2.0 ** -(6 + (sb % 4).float()).view(-1, 1)
    z = qmax / 2 if spec.symmetric else torch.randint(0, qmax + 1, (n_groups, 1), generator=g).float()
    return ((q - z) * s).view(rows, cols)


@pytest.mark.parametrize("kw", VARIANTS, ids=VARIANT_IDS)
def test_weights_on_the_grid_come_back_exactly(kw):
    spec = QuantSpec(**kw)
    codec = PackedCodec(spec)
    w = grid_weight(spec)
    layout, record = pack_expert(codec, {"w": w})
    assert same(codec.decode(record, layout, torch.float32, backend="torch")["w"], w)


def test_an_int4_record_is_the_bytes_written_out_by_hand():
    """One group of 16 weights -0.5, -0.25, ..., 3.25 (int4, asymmetric, fp16 scales, round to nearest):
    scale (3.25 + 0.5) / 15 = 0.25, zero point 2, codes 0..15, two per byte, the even one low."""
    codec = PackedCodec(QuantSpec(fmt="int4", group_size=16, double_quant=False, refine_iters=0))
    w = torch.arange(16, dtype=torch.float32).sub(2).mul(0.25).view(1, 16)
    layout, record = pack_expert(codec, {"w": w})
    assert section(record, layout, "w", "codes") == bytes(2 * i | (2 * i + 1) << 4 for i in range(8))
    assert section(record, layout, "w", "scales") == struct.pack("<e", 0.25)
    assert section(record, layout, "w", "zeros") == bytes([2])
    magic, version, fmt, flags, group = struct.unpack_from("<4sHBBI", bytes(record[:12].numpy()))
    assert (magic, version, fmt, flags, group) == (b"MIRQ", 1, 2, 0, 16)


def test_an_int8_double_quant_record_is_the_bytes_written_out_by_hand():
    """Two groups of 16 (int8, asymmetric, double_quant, one superblock): group 0 spans [-1, 254] * 2**-8,
    group 1 twice that. Scales 2**-8 and 2**-7: a = -8, the top code 255 reaches b*255 = 1 (+ the format's
    2**-18 widening), and group 1's code is ceil((-7 - a) / b) = 255. Zero points 1; stats bytes [z, c]."""
    codec = PackedCodec(QuantSpec(fmt="int8", group_size=16, refine_iters=0))
    q = torch.tensor([0, 255] + list(range(1, 15)), dtype=torch.float32)
    w = torch.stack(((q - 1) * 2.0**-8, (q - 1) * 2.0**-7))
    layout, record = pack_expert(codec, {"w": w})
    a, b = struct.unpack("<2f", section(record, layout, "w", "superblocks"))
    assert a == -8.0 and b == torch.tensor((1 + 2.0**-18) / 255).item()
    assert section(record, layout, "w", "stats") == bytes([1, 0, 1, 255])
    assert section(record, layout, "w", "codes") == bytes(q.to(torch.uint8).tolist() * 2)


def test_groups_below_a_superblocks_floor_get_the_floor_scale():
    """int4 asymmetric, double_quant, round to nearest, one superblock of two groups of 16: group 0 spans
    [-1, 14] (scale 1), group 1 [-1, 14] * 2**-6, below the floor max_scale / 2**4 = 2**-4 (4-bit scale
    codes). So a = log2(2**-4) = -4, b = (0 - a + 2**-18) / 15; group 0's code is the top one (15), group 1's
    code 0 (the floor, 2**-4), its zero point round(2**-6 / 2**-4) = 0 and its codes round(w / 2**-4)."""
    codec = PackedCodec(QuantSpec(fmt="int4", group_size=16, refine_iters=0))
    q = torch.tensor([0, 15] + list(range(1, 15)), dtype=torch.float32)
    w = torch.stack((q - 1, (q - 1) * 2.0**-6))
    layout, record = pack_expert(codec, {"w": w})
    a, b = struct.unpack("<2f", section(record, layout, "w", "superblocks"))
    assert a == -4.0 and b == torch.tensor((4 + 2.0**-18) / 15).item()
    small = torch.round(w[1] / 2.0**-4).clamp(0, 15).to(torch.uint8).tolist()
    assert section(record, layout, "w", "stats") == bytes([15 << 4 | 1, 0 << 4 | 0])
    codes = q.to(torch.uint8).tolist() + small
    assert section(record, layout, "w", "codes") == bytes(codes[2 * i] | codes[2 * i + 1] << 4 for i in range(16))


def test_symmetric_and_fp16_scales_are_the_bytes_written_out_by_hand():
    """int4 symmetric, fp16 scales: weights (q - 7.5) * 0.5, max |w| = 3.75, scale 3.75 / 7.5 = 0.5, codes q.
    An fp16 scale the range does not hit exactly is rounded up to the next fp16 (no weight clips): a range
    of 1.5 over 15 steps is 0.1, stored as the smallest fp16 above 0.1."""
    codec = PackedCodec(QuantSpec(fmt="int4", group_size=16, symmetric=True, double_quant=False, refine_iters=0))
    q = torch.tensor([0, 15, 3, 7, 8, 12, 1, 14, 2, 13, 4, 11, 5, 10, 6, 9], dtype=torch.float32)
    layout, record = pack_expert(codec, {"w": ((q - 7.5) * 0.5).view(1, 16)})
    assert section(record, layout, "w", "scales") == struct.pack("<e", 0.5)
    assert section(record, layout, "w", "codes") == bytes(int(q[2 * i]) | int(q[2 * i + 1]) << 4 for i in range(8))
    assert not has_section(layout, "w", "zeros")
    asym = PackedCodec(QuantSpec(fmt="int4", group_size=16, double_quant=False, refine_iters=0))
    w = torch.linspace(-0.5, 1.0, 16).view(1, 16)
    layout, record = pack_expert(asym, {"w": w})
    (stored,) = struct.unpack("<e", section(record, layout, "w", "scales"))
    below = torch.tensor(0.1).half()
    above = below if below.item() >= torch.tensor(1.5 / 15).item() else torch.nextafter(below, torch.tensor(1.0).half())
    assert stored == above.item() > torch.tensor(1.5 / 15).item()
    assert section(record, layout, "w", "zeros") == bytes([round(0.5 / above.item())])


@pytest.mark.parametrize("kw", [dict(fmt="int4"), dict(fmt="int8", symmetric=True), dict(fmt="int4", double_quant=False)])
def test_round_to_nearest_never_clips_and_stays_within_half_a_step(kw):
    """Codes are the nearest grid point for the stored scale, which rounding rounds up: |w - w_hat| <= s / 2
    with s the stored scale, and every group's largest weight is representable (no clipping)."""
    spec = QuantSpec(**kw, group_size=16, superblock_groups=3, refine_iters=0)
    codec = PackedCodec(spec)
    w = expert()["w"]
    layout, record = pack_expert(codec, {"w": w})
    w_hat = codec.decode(record, layout, torch.float32, backend="torch")["w"].view(-1, 16)
    per_group = decode_by_definition(record, layout, "w", spec).view(-1, 16)
    assert same(w_hat, per_group)
    # the stored scale of each group, from the decoded grid: neighbouring levels differ by s
    levels = [sorted(set(r.tolist())) for r in w_hat]
    err = (w.view(-1, 16) - w_hat).abs().amax(1)
    for group, (e, lv) in enumerate(zip(err.tolist(), levels)):
        if len(lv) > 1:
            step = min(b - a for a, b in zip(lv, lv[1:]))
            assert e <= step / 2 * (1 + 1e-6), group


# --------------------------------------------------------------------------------------------- lossless
def bf16_words(values: list[float]) -> list[int]:
    return torch.tensor(values, dtype=torch.float32).bfloat16().view(torch.int16).tolist()


def test_a_lossless_nibble_record_is_the_bytes_written_out_by_hand():
    """bf16 weights with exponents 126 (0.5), 127 (1.0), 128 (-2.0, 3.0), zero, and one 2**100 (exponent
    227). The first 14-exponent window holding the most is base + 1 .. base + 14 with base = 114
    (126..128 inside; 2**100 outside: an escape). Codes: 0 for exponent 0, e - base, 15 for the escape."""
    values = [0.5, 1.0, -2.0, 3.0, 0.0, 2.0**100, 1.5, -0.75] + [1.0] * 1016  # large enough to encode (not raw)
    w = torch.tensor(values).bfloat16().view(8, 128)
    codec = LosslessCodec()
    layout = codec.plan_experts({"w": w.unsqueeze(0)})
    record = torch.empty(layout.nbytes, dtype=torch.uint8)
    assert codec.encode({"w": w}, layout, record) == {"w": 1}
    words = [x & 0xFFFF for x in bf16_words(values)]
    exps = [(x >> 7) & 0xFF for x in words]
    assert exps[:8] == [126, 127, 128, 128, 0, 227, 127, 126]
    codes = [0 if e == 0 else (e - 114 if 115 <= e <= 128 else 15) for e in exps]
    assert section(record, layout, "w", "meta") == struct.pack("<2i", 114, 1)
    assert section(record, layout, "w", "sm") == bytes(((x >> 8) & 0x80) | (x & 0x7F) for x in words)
    assert section(record, layout, "w", "codes") == bytes(codes[2 * i] | codes[2 * i + 1] << 4 for i in range(512))
    assert section(record, layout, "w", "esc_index") == struct.pack("<i", 5)
    assert section(record, layout, "w", "esc_value") == struct.pack("<H", words[5])
    decoded = codec.decode(record, layout, torch.bfloat16, backend="torch")["w"]
    assert same(decoded.view(torch.int16), w.view(torch.int16))
    for dtype in (torch.float32, torch.float16):  # another dtype: decoded in bf16, then converted
        assert same(codec.decode(record, layout, dtype, backend="torch")["w"], w.to(dtype))
        slot = {"w": torch.full(w.shape, math.nan, dtype=dtype)}
        assert same(codec.decode(record, layout, dtype, out=slot, backend="torch")["w"], w.to(dtype))
        assert same(slot["w"], w.to(dtype))
    # the bulk decode alone (what the Triton kernel repeats): the escape's code 15 reads as exponent base + 15
    bulk = decode_words_torch(record, layout.entry("w"))
    assert bulk.dtype == torch.int16 and bulk.shape == (1024,)
    assert [x & 0xFFFF for x in bulk.tolist()] == words[:5] + [(words[5] & 0x807F) | (114 + 15) << 7] + words[6:]


def test_fp32_lossless_records_keep_the_low_half_and_patch_the_high_word():
    """fp32: the escape index counts 16-bit words, 2 * element + 1 (the high half, little-endian)."""
    w = torch.tensor([[1.0 + 2.0**-20, -3.0, 2.0**-100, 0.0] + [0.5] * 1020])
    codec = LosslessCodec()
    layout = codec.plan_experts({"w": w.unsqueeze(0)})
    record = torch.empty(layout.nbytes, dtype=torch.uint8)
    assert codec.encode({"w": w}, layout, record) == {"w": 1}
    ints = [x & 0xFFFFFFFF for x in w.view(torch.int32).view(-1).tolist()]
    assert section(record, layout, "w", "lo") == struct.pack("<1024H", *[x & 0xFFFF for x in ints])
    assert section(record, layout, "w", "esc_index") == struct.pack("<i", 2 * 2 + 1)
    assert section(record, layout, "w", "esc_value") == struct.pack("<H", ints[2] >> 16)
    (base,) = struct.unpack_from("<i", section(record, layout, "w", "meta"))
    bulk = decode_words_torch(record, layout.entry("w"))  # int32 words, the escape's high half unpatched
    escaped = (ints[2] & 0x807FFFFF) | (base + 15) << 23
    assert bulk.dtype == torch.int32 and [x & 0xFFFFFFFF for x in bulk.tolist()] == ints[:2] + [escaped] + ints[3:]
    assert same(codec.decode(record, layout, torch.float32, backend="torch")["w"].view(torch.int32), w.view(torch.int32))
    as_bf16 = codec.decode(record, layout, torch.bfloat16, backend="torch")["w"]
    assert same(as_bf16, w.bfloat16())


def test_lossless_slack_escape_entries_are_harmless():
    """A layer planned for 3 escapes; an expert with one fills the rest with its first weight's own word."""
    a = torch.tensor([[1.0, 2.0**100, 2.0**-100, 2.0**120] + [1.0] * 1020]).bfloat16()
    b = torch.tensor([[0.25, 1.0, 2.0**100, 0.5] + [1.0] * 1020]).bfloat16()
    codec = LosslessCodec()
    layout = codec.plan_experts({"w": torch.stack((a, b))})
    record = torch.empty(layout.nbytes, dtype=torch.uint8)
    assert codec.encode({"w": b}, layout, record) == {"w": 1}
    assert section(record, layout, "w", "esc_index") == struct.pack("<3i", 2, 0, 0)
    word0 = b.view(torch.int16).view(-1).tolist()
    assert section(record, layout, "w", "esc_value") == struct.pack("<3h", word0[2], word0[0], word0[0])
    assert same(codec.decode(record, layout, torch.bfloat16, backend="torch")["w"].view(torch.int16), b.view(torch.int16))


def classes_by_definition(record: torch.Tensor, layout, name: str) -> list[int]:
    """The 16-bit high words of a classes-coded bf16 tensor before escapes are patched, read as the format
    says: a 2-bit class per weight (four per byte, LSB first); class 0, 1: exponent t0, t1; class 2: one
    extra bit v, exponent t2 or t3; class 3: four extra bits v, exponent lo + v. Extra bits: a stream, LSB
    first, each block of 256 weights starting on its byte `boff`."""
    entry = next(e for e in layout.entries if e.name == name)
    sm, cls, extra = (section(record, layout, name, s) for s in ("sm", "cls", "extra"))
    boff = struct.unpack(f"<{len(section(record, layout, name, 'boff')) // 4}i", section(record, layout, name, "boff"))
    t0, t1, t2, t3, lo = struct.unpack("<8i", section(record, layout, name, "exps"))[:5]
    words, bit = [], 0
    for i in range(entry.numel):
        if i % 256 == 0:
            bit = boff[i // 256] * 8
        c = (cls[i // 4] >> (2 * (i % 4))) & 3
        n = (0, 0, 1, 4)[c]
        v = sum(((extra[(bit + j) // 8] >> ((bit + j) % 8)) & 1) << j for j in range(n))
        bit += n
        e = (t0, t1, (t2, t3)[v & 1], (lo + v) & 0xFF)[c]
        words.append(((sm[i] & 0x80) << 8) | (e << 7) | (sm[i] & 0x7F))
    return words


def test_a_lossless_classes_record_decodes_as_the_format_reads():
    """Exponents of known frequencies: 126 (most), 127, 125, 128 the four most frequent (t0..t3), a window
    [lo, lo + 14] for the next ones, an escape far outside; more than one block of 256 weights."""
    g = torch.Generator().manual_seed(0)
    pool = [0.75] * 300 + [1.5] * 200 + [0.375] * 120 + [3.0] * 60 + [2.0**-6] * 20 + [2.0**-9] * 10 + [0.0] * 8
    pool += [2.0**-20, -(2.0**-4), 2.0**90]
    vals = torch.tensor(pool)[torch.randperm(len(pool), generator=g)]
    signs = torch.where(torch.rand(len(pool), generator=g) < 0.5, -1.0, 1.0)
    w = (vals * signs).bfloat16().view(1, -1)
    codec = LosslessCodec(code="classes")
    layout = codec.plan_experts({"w": w.unsqueeze(0)})
    record = torch.empty(layout.nbytes, dtype=torch.uint8)
    escapes = codec.encode({"w": w}, layout, record)["w"]
    t = struct.unpack("<8i", section(record, layout, "w", "exps"))
    assert t[:4] == (126, 127, 125, 128)  # by frequency
    # the other exponents: 121 (20 weights), 118 (10), 0 (8 zeros), 107, 123, 217 (one each); the first window
    # of 15 holding the most is 107..121 (31 weights; 109..123 holds as many, but starts later)
    assert t[4] == 107 and escapes == 8 + 1 + 1
    words = [x & 0xFFFF for x in w.view(torch.int16).view(-1).tolist()]
    got = classes_by_definition(record, layout, "w")
    differ = [i for i, (a, b) in enumerate(zip(got, words)) if a != b]
    lo = t[4]
    outside = [i for i, x in enumerate(words) if (x >> 7) & 0xFF not in t[:4] and not lo <= (x >> 7) & 0xFF <= lo + 14]
    assert differ == outside and escapes == len(outside) > 0  # only the escapes are patched afterwards
    bulk = decode_words_classes_torch(record, layout.entry("w"))
    assert bulk.dtype == torch.int16 and [x & 0xFFFF for x in bulk.tolist()] == got
    decoded = codec.decode(record, layout, torch.bfloat16, backend="torch")["w"]
    assert same(decoded.view(torch.int16), w.view(torch.int16))


# ------------------------------------------------------------------------------------ FP8 and MXFP4
def e4m3(code: int) -> float:
    """float8_e4m3fn from its bits: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
    subnormal; S.1111.111 is NaN (no infinities)."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return math.nan
    return sign * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def e2m1(code: int) -> float:
    """MXFP4 element from its 4 bits: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 subnormal."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m / 2 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


def test_fp8_values_are_the_format_times_the_block_scale():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[codes & 0x7F != 0x7F]  # not NaN
    weight = codes[:252].view(6, 42)[:, :40].contiguous().view(torch.float8_e4m3fn)  # [6, 40], every finite code
    scales = torch.tensor([[0.5, 3.0, 2.0**-9, 7.25], [1.0, -2.0, 1e-3, 2.0**20], [0.1, 1.0, 1.0, 1.0]])  # blocks 2 x 10
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = dequantize_fp8(weight, scales, dtype)
        expected = torch.tensor(
            [[e4m3(int(weight.view(torch.uint8)[r, c])) * scales[r // 2, c // 10].item() for c in range(40)] for r in range(6)],
            dtype=torch.float64,
        )
        assert got.dtype == dtype and same(got, expected.float().to(dtype)), dtype  # one fp32 product each


def test_fp8_records_decode_each_checkpoint_piece_with_its_own_scales():
    """A gate_up_proj stored as gate_proj [4, 8] and up_proj [4, 8] with 2 x 1 block grids each (pieces=2):
    each piece's rows take its own scales."""
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(8, 8, generator=g) * 8).to(torch.float8_e4m3fn)
    scales = torch.tensor([[2.0], [0.5], [4.0], [0.125]])  # gate's two row blocks, then up's
    codec = Fp8BlockCodec(pieces={"gate_up_proj": 2}, block_size=[2, 8])
    down = (torch.randn(8, 4, generator=g) * 8).to(torch.float8_e4m3fn)  # not in `pieces`: one tensor
    down_scales = torch.tensor([[3.0]])
    tensors = {"gate_up_proj": gate_up, "gate_up_proj_scale_inv": scales, "gate_up_proj_bias": torch.arange(8.0)}
    tensors |= {"down_proj": down, "down_proj_scale_inv": down_scales}
    specs = {"gate_up_proj": ((8, 8), torch.bfloat16), "gate_up_proj_bias": ((8,), torch.float32)}
    specs["down_proj"] = ((8, 4), torch.bfloat16)
    layout = codec.plan_experts_from(specs, 1, lambda e: tensors)
    record = torch.empty(layout.nbytes, dtype=torch.uint8)
    codec.encode(tensors, layout, record)
    out = codec.decode(record, layout, torch.bfloat16)
    expected = torch.cat([gate_up[2 * i : 2 * i + 2].float() * scales[i] for i in range(4)]).bfloat16()
    assert same(out["gate_up_proj"], expected)
    assert same(out["down_proj"], (down.float() * 3.0).bfloat16())
    assert out["gate_up_proj_bias"].dtype == torch.bfloat16 and same(out["gate_up_proj_bias"], torch.arange(8.0).bfloat16())
    slot = {"gate_up_proj": torch.empty(8, 8, dtype=torch.bfloat16), "gate_up_proj_bias": torch.empty(8, dtype=torch.bfloat16)}
    slot["down_proj"] = torch.empty(8, 4, dtype=torch.bfloat16)
    into = codec.decode(record, layout, torch.bfloat16, out=slot)
    assert into["gate_up_proj"] is slot["gate_up_proj"] and same(slot["gate_up_proj"], expected)
    assert same(slot["gate_up_proj_bias"], torch.arange(8.0).bfloat16())


def test_mxfp4_values_are_the_format_times_the_block_exponent():
    """blocks [out=3, G=2, 16]: byte j of a block holds elements 2j (low nibble) and 2j + 1 (high); the
    block's value is e2m1 * 2**(scale - 127); the result is [in, out] (transposed)."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 2, 16), generator=g, dtype=torch.uint8)
    blocks[0, 0, :8] = torch.arange(0, 256, 34, dtype=torch.uint8)[:8]
    scales = torch.tensor([[127, 120], [130, 1], [254, 127]], dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        got = dequantize_mxfp4(blocks, scales, dtype)
        assert got.shape == (64, 3) and got.dtype == dtype
        for o in range(3):
            for i in range(64):
                byte = int(blocks[o, i // 32, (i % 32) // 2])
                code = byte & 15 if i % 2 == 0 else byte >> 4
                value = e2m1(code) * 2.0 ** (int(scales[o, i // 32]) - 127)  # inf where it overflows the dtype
                assert got[i, o].item() == torch.tensor(value, dtype=torch.float64).to(dtype).item(), (o, i)
        codec = Mxfp4Codec()
        tensors = {"down_proj": blocks, "down_proj_scales": scales}
        layout = codec.plan_experts_from({"down_proj": ((64, 3), dtype)}, 1, lambda e, t=tensors: t)
        record = torch.empty(layout.nbytes, dtype=torch.uint8)
        codec.encode(tensors, layout, record)
        assert same(codec.decode(record, layout, dtype)["down_proj"], got)
        assert same(codec.decode(record, layout, dtype)["down_proj"], got)  # the cached table, reused


# ---------------------------------------------------------------------------------------------------- nf4
def test_nf4_decode_is_the_nested_absmax_times_the_level():
    """nf4: codes two per byte, the first element in the high nibble; each block's absmax is
    dynamic_map[absmax code] * its group of 256's fp32 absmax + the stored offset; w = level * absmax."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as bnbf

    codec = make_codec("nf4", group_size=64)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 128, generator=g) * torch.tensor([[0.01], [1.0], [0.1], [3.0]])
    layout, record = pack_expert(codec, {"w": w, "b": torch.arange(4.0)})
    levels = bnbf.get_4bit_type("nf4", device="cpu").tolist()
    dynamic = bnbf.create_dynamic_map(signed=True).tolist()
    nested = struct.unpack(f"<{len(section(record, layout, 'w', 'nested')) // 4}f", section(record, layout, "w", "nested"))
    absmax_codes = section(record, layout, "w", "absmax")
    codes = [c for byte in section(record, layout, "w", "codes") for c in (byte >> 4, byte & 15)]
    absmax = torch.tensor([dynamic[c] for c in absmax_codes]) * torch.tensor(nested[1]) + torch.tensor(nested[0])
    expected = (torch.tensor([levels[c] for c in codes]).view(-1, 64) * absmax.view(-1, 1)).view(4, 128)
    got = codec.decode(record, layout, torch.float32)
    assert torch.allclose(got["w"], expected, rtol=1e-6, atol=0) and same(got["b"], torch.arange(4.0))
    assert (got["w"] - w).abs().max() <= 0.2 * absmax.max()  # nf4's coarsest step is below 0.33 of absmax
    slot = {"w": torch.full((4, 128), math.nan), "b": torch.full((4,), math.nan)}  # a slot holding other weights
    into = codec.decode(record, layout, torch.float32, out=slot)
    assert into["w"] is slot["w"] and same(slot["w"], got["w"]) and same(slot["b"], got["b"])
    assert same(codec.linear(w[:2, :128], record, layout, "w", False), torch.nn.functional.linear(w[:2], got["w"]))
    assert tensor_specs(got)["w"] == ((4, 128), torch.float32)


@pytest.mark.parametrize("code", ["nibble", "classes"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_lossless_records_do_not_depend_on_the_step_size(monkeypatch, code, dtype):
    """Encoding and the torch decode work in steps of `_CHUNK` weights on a CPU; the record and the decoded
    bits are the same whatever the step (here 256 and 512 weights, an odd tensor size, escapes in every step)."""
    from mira_hf.quant import lossless_bits as lossless

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 1001, generator=g) * 0.02
    w.view(-1)[::97] = 2.0**90  # an escape every 97 weights
    w.view(-1)[::89] = 0.0
    w = w.to(dtype)
    codec = LosslessCodec(code=code)
    layout = codec.plan_experts({"w": w.unsqueeze(0)})
    records = []
    for step in (1 << 18, 512, 256):
        monkeypatch.setattr(lossless, "_CHUNK", step)
        record = torch.empty(layout.nbytes, dtype=torch.uint8)
        codec.encode({"w": w}, layout, record)
        records.append(record)
        decoded = codec.decode(record, layout, dtype, backend="torch")["w"]
        assert same(decoded.view(-1).view(torch.int16), w.view(-1).view(torch.int16)), step
        slot = {"w": torch.full(w.shape, math.nan, dtype=dtype)}  # a cache slot still holding other weights
        into = codec.decode(record, layout, dtype, out=slot, backend="torch")["w"]
        assert into is slot["w"] and same(into.view(-1).view(torch.int16), w.view(-1).view(torch.int16)), step
    assert all(same(records[0], r) for r in records[1:])


def test_native_records_take_the_checkpoints_tensors_and_refuse_others_by_name():
    """An FP8 record holds the checkpoint's weight as it is and its scales as float32 (bf16/fp16 scales are
    widened exactly); a weight in another dtype or shape than the layer's first expert is refused, naming both."""
    from mira_hf.quant import CodecInputError

    codec = Fp8BlockCodec(pieces={"down_proj": 1}, block_size=[2, 4])
    weight = (torch.arange(32.0).view(4, 8) / 4).to(torch.float8_e4m3fn)
    first = {"down_proj": weight, "down_proj_scale_inv": torch.tensor([[1.0, 2.0], [4.0, 8.0]])}
    layout = codec.plan_experts_from({"down_proj": ((4, 8), torch.bfloat16)}, 2, lambda e: first)
    record = torch.empty(layout.nbytes, dtype=torch.uint8)
    codec.encode({**first, "down_proj_scale_inv": first["down_proj_scale_inv"].bfloat16()}, layout, record)
    assert same(codec.views(record, layout)["down_proj_scale_inv"], first["down_proj_scale_inv"])
    assert same(codec.views(record, layout)["down_proj"].view(torch.uint8), weight.view(torch.uint8))
    bad = {
        "a bf16 weight": {**first, "down_proj": weight.to(torch.bfloat16)},
        "another shape": {**first, "down_proj": weight[:2].repeat(2, 1)[:, :4].repeat(1, 2)[:3]},
    }
    out = codec.decode(record, layout, torch.float16)
    assert same(
        out["down_proj"],
        (weight.float() * torch.tensor([[1.0, 2.0], [4.0, 8.0]]).repeat_interleave(2, 0).repeat_interleave(4, 1)).half(),
    )
    from mira_hf.quant.native import split_rows

    with pytest.raises(CodecInputError, match=r"\(3, 8\) does not split into 2 equal row blocks"):
        split_rows(torch.zeros(3, 8), 2)
    for tensors in bad.values():
        with pytest.raises(CodecInputError, match=r"fp8_block: down_proj is torch\.\w+ \[\d+, 8\] in the checkpoint.*hold"):
            codec.encode(tensors, layout, record)


def test_each_tensor_is_decoded_on_the_records_device():
    """Decoding makes nothing on the host: every output and temporary lives on the record's device.
    Checked on the meta device, which holds no data, so any host tensor mixed into the decode raises."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 1024, generator=g) * 0.02
    w[0, 0] = 2.0**100  # an escape for the lossless codes
    for code in ("nibble", "classes"):
        codec = LosslessCodec(code=code)
        for dtype in (torch.bfloat16, torch.float32):
            t = w.to(dtype)
            layout = codec.plan_experts({"w": t.unsqueeze(0)})
            record = torch.empty(layout.nbytes, dtype=torch.uint8)
            codec.encode({"w": t}, layout, record)
            meta, entry = record.to("meta"), layout.entry("w")
            for out_dtype in (dtype, torch.float16):  # the stored dtype, and a conversion
                got = codec.decode_entry(meta, entry, out_dtype, None, False)
                assert (got.device.type, got.dtype, got.shape) == ("meta", out_dtype, t.shape), (code, dtype)
            bulk = (decode_words_classes_torch if code == "classes" else decode_words_torch)(meta, entry)
            assert bulk.device.type == "meta" and bulk.dtype == (torch.int32 if dtype == torch.float32 else torch.int16)
    for kw in VARIANTS[::2]:
        codec = PackedCodec(QuantSpec(**kw))
        layout, record = pack_expert(codec, {"w": w, "b": w[:, 0]})
        for name in ("w", "b"):
            got = codec.decode_entry(record.to("meta"), layout.entry(name), torch.bfloat16, None, False)
            assert got.device.type == "meta" and got.dtype == torch.bfloat16, kw
    blocks = torch.zeros(3, 2, 16, dtype=torch.uint8, device="meta")
    scales = torch.zeros(3, 2, dtype=torch.uint8, device="meta")
    for lut in (None, torch.tensor([0.0] * 16, device="meta")):
        got = dequantize_mxfp4(blocks, scales, torch.bfloat16, lut)
        assert (got.device.type, got.dtype, got.shape) == ("meta", torch.bfloat16, (64, 3))


def test_decoded_tensors_are_fresh_and_outlive_their_record():
    """A record lives in a staging buffer or cache slot that the next copy overwrites: decoded tensors,
    the raw ones (biases) included, are never views of it."""
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(8, 64, generator=g), "bias": torch.randn(8, generator=g)}
    for codec in (PackedCodec(QuantSpec(fmt="int4", group_size=16)), LosslessCodec(), make_codec("int8", group_size=16)):
        layout, record = pack_expert(codec, tensors)
        for dtype in (torch.float32, torch.bfloat16):
            out = codec.decode(record, layout, dtype, backend="torch")
            kept = {k: v.clone() for k, v in out.items()}
            overwritten = record.clone()
            record.fill_(0x55)  # the slot takes the next expert's bytes
            assert all(same(out[k], kept[k]) for k in out), (codec, dtype)
            record.copy_(overwritten)
        assert same(out["bias"], tensors["bias"].bfloat16())


def test_a_calls_backend_overrides_the_codecs():
    """`decode(..., backend="torch")` decodes with the torch reference even where the codec was built for the
    Triton kernels (which a CPU record cannot run)."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(8, 64, generator=g), "bias": torch.randn(8, generator=g)}
    for codec in (PackedCodec(QuantSpec(fmt="int4", group_size=16), backend="triton"), LosslessCodec(backend="triton")):
        layout, record = pack_expert(codec, tensors)
        expected = PackedCodec(codec.spec).decode(record, layout, torch.float32) if hasattr(codec, "spec") else tensors
        got = codec.decode(record, layout, torch.float32, backend="torch")
        assert all(same(got[k], expected[k]) for k in tensors), codec


def test_fp8_weights_whose_blocks_are_not_all_one_size_are_refused_saying_what_fits():
    """An expert width the scale grid does not divide (5 rows in blocks over 2 scale rows): transformers refuses it
    too; the error names the shapes and what checkpoint would load."""
    from mira_hf.quant import CodecInputError

    codec = Fp8BlockCodec(pieces={"down_proj": 1}, block_size=[4, 8])
    weight = torch.zeros(5, 8).to(torch.float8_e4m3fn)
    with pytest.raises(CodecInputError, match=r"\[5, 8\]\) is not divisible by its scale grid \[2, 1\].*weight_block_size"):
        codec.record_specs("down_proj", (5, 8), weight, torch.ones(2, 1), 1)
