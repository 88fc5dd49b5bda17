"""The packed expert codecs (mira_hf.quant): format, accuracy, errors, kernels.

Tiny experts (H hidden, I intermediate) keep every test fast; the Mixtral-size checks only plan.
Triton tests run on CUDA when present, else in Triton's CPU interpreter, and skip without triton.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys

import pytest
import torch

from mira_hf.errors import ConfigError, IncompatibleFileError, MissingDependencyError
from mira_hf.quant import (
    ALIGN_BYTES,
    HEADER_BYTES,
    CodecInputError,
    ExpertCodec,
    PackedCodec,
    QuantSpec,
    make_codec,
    pack_expert,
    tensor_specs,
    validate_record,
)
from mira_hf.quant import groupwise as packed

H, I = 64, 128  # noqa: E741  (tiny expert: gate_up [2I, H], down [H, I])
MIXTRAL = {"gate_up_proj": ((2 * 14336, 4096), torch.bfloat16), "down_proj": ((4096, 14336), torch.bfloat16)}
SMALL = {"gate_up_proj": ((2 * 384, 192), torch.bfloat16), "down_proj": ((192, 384), torch.bfloat16)}

# every storage variant: defaults, symmetric grid, fp16 scales, other group / partial superblocks
SPECS = [
    dict(fmt="int4"),
    dict(fmt="int8"),
    dict(fmt="int4", symmetric=True),
    dict(fmt="int8", symmetric=True),
    dict(fmt="int4", double_quant=False),
    dict(fmt="int8", double_quant=False, symmetric=True),
    dict(fmt="int4", group_size=32, superblock_groups=7),
]
SPEC_IDS = ["-".join(f"{k}={v}" for k, v in s.items()) for s in SPECS]

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None


def expert(seed: int = 0, dtype=torch.bfloat16, transposed: bool = False, bias: bool = False, heavy: bool = False):
    """A random expert; `heavy` draws Student-t(3) weights (outliers, like real checkpoints)."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        w = torch.randn(*shape, generator=g)
        if heavy:
            w = w / torch.rand(*shape, generator=g).clamp_min(0.05).sqrt()  # scale mixture: heavy tails
        return (0.02 * w).to(dtype)

    t = (
        {"gate_up_proj": draw(H, 2 * I), "down_proj": draw(I, H)}
        if transposed
        else {"gate_up_proj": draw(2 * I, H), "down_proj": draw(H, I)}
    )
    if bias:
        t["gate_up_proj_bias"] = torch.randn(2 * I, generator=g).to(dtype)
    return t


def codec_for(spec_kw: dict, **override) -> PackedCodec:
    return PackedCodec(QuantSpec(**{**spec_kw, **override}))


def rel_mse(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return ((w.double() - w_hat.double()).square().sum() / w.double().square().sum()).item()


# ---------------------------------------------------------------------------------------------- format


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_round_trips_integer_codes_exactly(bits):
    q = torch.randint(0, 1 << bits, (4096,), dtype=torch.uint8)
    packed_q = packed.pack_codes(q, bits)
    assert packed_q.numel() == q.numel() * bits // 8
    assert torch.equal(packed.unpack_codes(packed_q, bits), q)


@pytest.mark.parametrize("spec_kw", SPECS, ids=SPEC_IDS)
def test_record_codes_re_encode_to_the_same_codes(spec_kw):
    """Decoding then quantising the decoded weights with the stored scales gives back the stored codes."""
    codec = codec_for(spec_kw)
    layout, record = pack_expert(codec, expert())
    spec = codec.spec
    for entry in layout.entries:
        codes = packed.unpack_codes(packed.section_view(record, entry.section("codes")), spec.bits)
        s, z = packed.group_scales_torch(record, entry, spec)
        w_hat = packed.dequantize_torch(record, entry, spec, torch.float32).view(-1, spec.group_size)
        again = torch.round(w_hat / torch.where(s > 0, s, 1) + z).clamp(0, spec.qmax).to(torch.uint8)
        assert torch.equal(again.view(-1), codes)


def test_layout_sections_are_aligned_disjoint_and_inside_the_record():
    layout = make_codec("int4").plan(tensor_specs(expert(bias=True)))
    assert layout.nbytes % ALIGN_BYTES == 0
    spans = sorted((s.offset, s.end) for e in layout.entries for s in e.sections)
    assert spans[0][0] >= HEADER_BYTES
    assert all(off % ALIGN_BYTES == 0 for off, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= layout.nbytes
    assert layout.payload_bytes + layout.meta_bytes == layout.nbytes


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("shapes", [MIXTRAL, SMALL], ids=["mixtral", "small"])
def test_default_metadata_share_is_at_most_4_percent(fmt, shapes):
    layout = make_codec(fmt).plan(shapes)  # plan only: nothing is allocated
    assert layout.meta_share <= 0.04
    if shapes is MIXTRAL:
        # per group of 64: int4 32 B codes + 1 B stats, int8 64 B + 2 B; + 8 B per 64-group superblock
        per_group = {"int4": (1 + 8 / 64) / 32, "int8": (2 + 8 / 64) / 64}[fmt]
        assert layout.meta_share == pytest.approx(per_group, abs=1e-4)


def test_fp16_scales_cost_what_the_docs_say():
    layout = make_codec("int4", double_quant=False).plan(MIXTRAL)
    assert layout.meta_share == pytest.approx(3 / 32, abs=1e-4)  # fp16 scale + uint8 zero per 32 B


def test_encode_is_deterministic_and_independent_of_chunking(monkeypatch):
    codec = make_codec("int4", superblock_groups=3)
    t = expert(bias=True)
    _, whole = pack_expert(codec, t)
    monkeypatch.setattr(packed, "_CHUNK_ELEMS", 256)  # 4 groups per chunk -> many chunks
    _, chunked = pack_expert(codec, t)
    assert torch.equal(whole, chunked)


# ---------------------------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("spec_kw", SPECS, ids=SPEC_IDS)
def test_rtn_error_is_within_half_a_stored_step(spec_kw):
    """Round-to-nearest never clips: |w - w_hat| <= s_hat / 2 per group, and the stored scale
    s_hat exceeds the group's exact range / levels by at most one scale-code step (double
    quantisation) or one fp16 ulp."""
    codec = codec_for(spec_kw, refine_iters=0)
    spec = codec.spec
    t = expert(dtype=torch.float32, heavy=True)
    layout, record = pack_expert(codec, t)
    out = codec.decode(record, layout, torch.float32)
    for entry in layout.entries:
        w = t[entry.name].reshape(-1, spec.group_size).double()
        err = (out[entry.name].reshape(-1, spec.group_size).double() - w).abs()
        s_hat, _ = packed.group_scales_torch(record, entry, spec)
        s_hat = s_hat.double()
        assert (err <= s_hat / 2 * (1 + 1e-5)).all()
        if spec.symmetric:
            s_exact = w.abs().amax(1, keepdim=True) / (spec.qmax / 2)
        else:
            s_exact = (w.amax(1, keepdim=True).clamp(min=0) - w.amin(1, keepdim=True).clamp(max=0)) / spec.qmax
        if spec.double_quant:
            ab = packed.section_view(record, entry.section("superblocks"), torch.float32).view(-1, 2).double()
            sb = torch.arange(w.shape[0]) // spec.superblock_groups
            step = torch.exp2(ab[sb, 1]).unsqueeze(1)  # ratio between neighbouring scale codes
            floor = torch.exp2(ab[sb, 0]).unsqueeze(1)  # the superblock's smallest scale
        else:
            step, floor = torch.full_like(s_exact, 1 + 2.0**-10), torch.zeros_like(s_exact)
        assert (s_hat >= s_exact * (1 - 1e-6)).all()
        assert (s_hat <= torch.maximum(s_exact * step, floor) * (1 + 1e-6)).all()


@pytest.mark.parametrize("fmt, max_ratio", [("int4", 0.95), ("int8", 0.98)])
@pytest.mark.parametrize("heavy", [False, True], ids=["gaussian", "heavy-tailed"])
def test_refinement_lowers_weight_error_vs_round_to_nearest(fmt, max_ratio, heavy):
    t = expert(dtype=torch.float32, heavy=heavy)
    errors = {}
    for iters in (0, 2):
        codec = make_codec(fmt, refine_iters=iters)
        layout, record = pack_expert(codec, t)
        out = codec.decode(record, layout, torch.float32)
        errors[iters] = sum(rel_mse(t[k], out[k]) for k in t)
    assert errors[2] <= max_ratio * errors[0]


def test_calibration_lowers_output_error_where_activations_are_large():
    g = torch.Generator().manual_seed(1)
    w = {"down_proj": 0.02 * torch.randn(H, I, generator=g)}
    x = torch.randn(512, I, generator=g)
    x[:, ::16] *= 10  # a few loud input channels, as in real hidden states
    codec = make_codec("int4")
    errors = {}
    for name, calib in (("plain", None), ("calib", x), ("calib-by-name", {"down_proj": x})):
        layout, record = pack_expert(codec, w, calib=calib)
        y = codec.linear(x, record, layout, "down_proj", transposed=False)
        errors[name] = (y - x @ w["down_proj"].T).norm().item()
    assert errors["calib"] <= 0.9 * errors["plain"]
    assert errors["calib-by-name"] == errors["calib"]


def test_zero_tensor_decodes_to_zero():
    t = {"w": torch.zeros(8, 64)}
    for kw in (dict(), dict(symmetric=True), dict(double_quant=False, symmetric=True)):
        codec = make_codec("int4", **kw)
        layout, record = pack_expert(codec, t)
        assert codec.decode(record, layout, torch.float32)["w"].abs().max() < 1e-30


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_biases_are_stored_raw_and_weights_keep_their_shapes(dtype):
    t = expert(dtype=dtype, bias=True)
    codec = make_codec("int8")
    layout, record = pack_expert(codec, t)
    out = codec.decode(record, layout, dtype)
    assert {k: (v.shape, v.dtype) for k, v in out.items()} == {k: (v.shape, dtype) for k, v in t.items()}
    assert torch.equal(out["gate_up_proj_bias"], t["gate_up_proj_bias"])
    assert rel_mse(t["down_proj"].float(), out["down_proj"].float()) < 1e-4


def test_decode_writes_into_preallocated_out():
    codec = make_codec("int4")
    layout, record = pack_expert(codec, expert(bias=True))
    slot = {"gate_up_proj": torch.empty(2 * I, H, dtype=torch.bfloat16), "down_proj": torch.empty(H, I, dtype=torch.bfloat16)}
    got = codec.decode(record, layout, torch.bfloat16, out=slot)
    assert got["gate_up_proj"] is slot["gate_up_proj"] and got["down_proj"] is slot["down_proj"]
    assert torch.equal(got["down_proj"], codec.decode(record, layout, torch.bfloat16)["down_proj"])
    assert "gate_up_proj_bias" in got  # names missing from out are allocated
    with pytest.raises(CodecInputError, match="expected torch.float32"):
        codec.decode(record, layout, torch.float32, out=slot)


@pytest.mark.parametrize("spec_kw", SPECS[:4], ids=SPEC_IDS[:4])
@pytest.mark.parametrize("transposed", [False, True], ids=["[out,in]", "[in,out]"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_matmul_with_decoded_weight(spec_kw, transposed, x_dtype):
    codec = codec_for(spec_kw)
    layout, record = pack_expert(codec, expert(transposed=transposed))
    dense = codec.decode(record, layout, x_dtype)
    for name, k in (("gate_up_proj", H), ("down_proj", I)):
        x = torch.randn(2, 3, k).to(x_dtype)  # [..., in]
        y = codec.linear(x, record, layout, name, transposed)
        w = dense[name]
        ref = x @ w if transposed else x @ w.T
        assert y.shape == ref.shape and y.dtype == x_dtype
        torch.testing.assert_close(y, ref)


def test_linear_rejects_a_mismatched_input_width():
    codec = make_codec("int4")
    layout, record = pack_expert(codec, expert())
    with pytest.raises(CodecInputError, match="check `transposed`"):
        codec.linear(torch.randn(1, H), record, layout, "gate_up_proj", transposed=True)


# ---------------------------------------------------------------------------------------------- headers


def test_header_rejects_records_of_another_format_or_shape():
    t = expert()
    layout4, rec4 = pack_expert(make_codec("int4"), t)
    layout8, rec8 = pack_expert(make_codec("int8"), t)
    layout_sym, rec_sym = pack_expert(make_codec("int4", symmetric=True), t)
    validate_record(rec4, layout4)
    with pytest.raises(IncompatibleFileError, match="packed as int8"):
        validate_record(rec8, layout4)
    with pytest.raises(IncompatibleFileError, match="symmetric"):  # same size, other grid
        make_codec("int4").decode(rec_sym, layout4, torch.float32)
    bad = rec4.clone()
    bad[:4] = 0
    with pytest.raises(IncompatibleFileError, match="not a mira-hf packed expert record"):
        validate_record(bad, layout4)
    # same byte size, other tensor shapes: caught by the layout fingerprint
    swapped = make_codec("int4").plan({"gate_up_proj": ((H, 2 * I), torch.bfloat16), "down_proj": ((I, H), torch.bfloat16)})
    assert swapped.nbytes == layout4.nbytes
    with pytest.raises(IncompatibleFileError, match="other tensors"):
        validate_record(rec4, swapped)
    with pytest.raises(IncompatibleFileError, match="codec 'int4'"):
        make_codec("int8").decode(rec4, layout4, torch.float32)


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(fmt="int3"), r"fmt='int3' is not supported.*'int4'"),
        (dict(fmt="nf4"), r'make_codec\("nf4"\)'),
        (dict(fmt="int4", group_size=48), r"group_size=48 .*\(16, 32, 64"),
        (dict(fmt="int4", refine_iters=-1), r"refine_iters=-1 must be an int in 0\.\.16"),
        (dict(fmt="int4", symmetric="yes"), r"symmetric='yes' must be True or False"),
        (dict(fmt="int4", superblock_groups=0), r"superblock_groups=0"),
    ],
)
def test_bad_specs_raise_clear_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        QuantSpec(**kwargs)


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        QuantSpec("int4").group_size = 32


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("fp8", {}, r"'fp8' is not a compressed format; supported: \['int8', 'int4', 'nf4', 'lossless'\]"),
        (None, {}, "identity codec"),
        ("int4", {"bogus": 1}, r"unknown options \['bogus'\]"),
        ("int4", {"fmt": "int8"}, "takes no fmt"),
    ],
)
def test_make_codec_errors_name_what_is_supported(name, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        make_codec(name, **kwargs)


def test_plan_and_encode_reject_tensors_they_cannot_pack():
    codec = make_codec("int4")
    with pytest.raises(ConfigError, match=r"does not divide the last dim of 'w' \(8, 96\).*\[16, 32\]"):
        codec.plan({"w": ((8, 96), torch.bfloat16)})
    with pytest.raises(CodecInputError, match="dtype torch.int32"):
        codec.plan({"w": ((8, 64), torch.int32)})
    layout = codec.plan({"w": ((8, 64), torch.float32)})
    record = torch.empty(layout.nbytes, dtype=torch.uint8)
    with pytest.raises(CodecInputError, match="layout holds"):
        codec.encode({"v": torch.zeros(8, 64)}, layout, record)
    with pytest.raises(CodecInputError, match="expects"):
        codec.encode({"w": torch.zeros(4, 64)}, layout, record)
    with pytest.raises(CodecInputError, match="inf or NaN"):
        codec.encode({"w": torch.full((8, 64), math.nan)}, layout, record)
    with pytest.raises(CodecInputError, match=r"uint8 \["):
        codec.encode({"w": torch.zeros(8, 64)}, layout, record[:-64])
    with pytest.raises(CodecInputError, match="calib"):
        codec.encode({"w": torch.zeros(8, 64)}, layout, record, calib=torch.zeros(4, 7))


def test_codecs_satisfy_the_runtime_protocol():
    assert isinstance(make_codec("int4"), ExpertCodec)
    assert isinstance(make_codec("int8"), ExpertCodec)


# ---------------------------------------------------------------------------------------------- nf4


def test_nf4_without_bitsandbytes_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import now fails as if absent
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    monkeypatch.delitem(sys.modules, "mira_hf.quant.nf4", raising=False)
    with pytest.raises(MissingDependencyError, match=r'pip install "mira-hf\[quant\]"') as info:
        make_codec("nf4")
    assert isinstance(info.value, ImportError)
    monkeypatch.delitem(sys.modules, "mira_hf.quant.nf4", raising=False)  # the next import is a fresh one


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed")
def test_nf4_matches_bitsandbytes_and_fits_the_record_format():
    import bitsandbytes.functional as bnbf

    t = expert(bias=True)
    codec = make_codec("nf4")
    assert isinstance(codec, ExpertCodec)
    layout, record = pack_expert(codec, t)
    out = codec.decode(record, layout, torch.bfloat16)
    for name in ("gate_up_proj", "down_proj"):
        q, state = bnbf.quantize_4bit(t[name], blocksize=64, compress_statistics=True, quant_type="nf4")
        assert torch.equal(out[name], bnbf.dequantize_4bit(q, state))
    assert torch.equal(out["gate_up_proj_bias"], t["gate_up_proj_bias"])
    x = torch.randn(3, I, dtype=torch.bfloat16)
    torch.testing.assert_close(codec.linear(x, record, layout, "down_proj", False), x @ out["down_proj"].T)
    assert codec.plan(MIXTRAL).meta_share <= 0.04
    with pytest.raises(IncompatibleFileError, match="packed as nf4"):
        validate_record(record, make_codec("int4").plan(tensor_specs(t)))
    with pytest.raises(ConfigError, match="calib"):
        codec.encode(t, layout, record, calib=torch.zeros(1, H))


# ---------------------------------------------------------------------------------------------- Triton


@pytest.mark.parametrize("spec_kw", SPECS, ids=SPEC_IDS)
def test_triton_dequant_matches_torch_reference(kernel_device, spec_kw):
    codec = codec_for(spec_kw)
    layout, record = pack_expert(codec, expert(bias=True))
    record = record.to(kernel_device)
    for dtype in (torch.float32, torch.bfloat16):
        ref = codec.decode(record, layout, dtype, backend="torch")
        slot = {k: torch.empty_like(v) for k, v in ref.items()}
        got = codec.decode(record, layout, dtype, out=slot, backend="triton")
        for name in ref:
            assert got[name] is slot[name]
            # exp2 and the final cast may differ by an ulp between Triton and torch
            tol = 1e-6 if dtype == torch.float32 else 2.0**-7
            torch.testing.assert_close(got[name], ref[name], rtol=tol, atol=1e-6)


@pytest.mark.parametrize("spec_kw", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("transposed", [False, True], ids=["[out,in]", "[in,out]"])
def test_triton_fused_linear_matches_torch_reference(kernel_device, spec_kw, transposed):
    codec = codec_for(spec_kw)
    # 72 rows: not a multiple of the kernel's 64-wide tiles, so edge masks are exercised
    w = {"w": 0.02 * torch.randn(72, 128)}
    layout, record = pack_expert(codec, w)
    record = record.to(kernel_device)
    k = 72 if transposed else 128
    for T, dtype in ((1, torch.bfloat16), (5, torch.float32), (17, torch.bfloat16)):
        x = torch.randn(T, k, dtype=dtype, device=kernel_device)
        from mira_hf.quant import triton_kernels

        # called directly so T=17 (> FUSED_MAX_TOKENS) exercises several token tiles too
        y = triton_kernels.linear(x, record, layout.entry("w"), codec.spec, transposed)
        ref = codec.linear(x, record, layout, "w", transposed, backend="torch")
        assert y.dtype == dtype and y.shape == ref.shape
        scale = ref.float().abs().max()
        assert (y.float() - ref.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 1e-2) * scale
