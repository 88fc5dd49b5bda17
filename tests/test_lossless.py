"""The lossless transfer format: every bit comes back, fewer bytes cross the link, and a model served
through it computes exactly what it computes without it (both placements, fp32 and bf16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import ALL_TINY, load_reference

from mira_hf import BudgetError, ConfigError, IncompatibleFileError, MiraConfig, MiraMoEModel, bundled_model_path
from mira_hf.config import QuantConfig
from mira_hf.quant import CodecInputError, LosslessCodec, make_codec, pack_expert, tensor_specs
from mira_hf.quant.lossless_bits import decode_words_torch, escape_count

PLACEMENTS = ["dequant", "packed"]
DTYPES = [torch.float32, torch.bfloat16]
WORD = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(WORD[t.dtype])


def weights(*shape: int, dtype=torch.bfloat16, seed: int = 0, std: float = 0.02) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std).to(dtype)


def specials(dtype: torch.dtype) -> torch.Tensor:
    """Values whose exponents fall outside any window, or are all-zero: signed zeros, subnormals,
    inf, NaN (two payloads), the extremes of the range."""
    info = torch.finfo(dtype)
    vals = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), info.max, -info.max, info.tiny, info.tiny / 8, 1e3, -7.0])
    vals = vals.to(dtype)
    nan_bits = torch.tensor([0x7FC1, -1] if dtype == torch.bfloat16 else [0x7FC00001, -1], dtype=WORD[dtype])
    return torch.cat((vals, nan_bits.view(dtype)))


CODES = ["nibble", "classes"]


def round_trip(tensors: dict[str, torch.Tensor], code: str = "nibble") -> tuple[object, list[torch.Tensor]]:
    """Plan over all experts (leading dim), encode each, decode each; returns (layout, records)."""
    codec = LosslessCodec(code=code)
    layout = codec.plan_experts(tensors)
    records = []
    for e in range(next(iter(tensors.values())).shape[0]):
        record = torch.empty(layout.nbytes, dtype=torch.uint8)
        codec.encode({n: t[e] for n, t in tensors.items()}, layout, record)
        dtype = next(iter(tensors.values())).dtype
        out = codec.decode(record, layout, dtype)
        for name, t in tensors.items():
            assert torch.equal(bits(out[name]), bits(t[e])), (name, e)
        records.append(record)
    return layout, records


# ------------------------------------------------------------------------------------------ format


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_bit_comes_back(dtype, code):
    # odd sizes (a half-used code byte), 3-D, special values at both ends, a raw 1-D bias
    w = weights(3, 37, 29, dtype=dtype)
    s = specials(dtype)
    w[0, 0, : s.numel()] = s
    w[2, -1, -s.numel() :] = s
    three_d = weights(3, 4, 5, 6, dtype=dtype, seed=1)
    bias = weights(3, 37, dtype=dtype, seed=2)
    layout, _ = round_trip({"w": w, "t": three_d, "bias": bias}, code)
    assert not layout.entry("bias").quantized  # 1-D: raw


@pytest.mark.parametrize("code", CODES)
def test_every_bf16_bit_pattern_comes_back(code):
    # all 65,536 patterns among ordinary weights: many escapes, still smaller than raw, still exact
    w = weights(1, 1024, 1024)
    where = torch.randperm(2**20, generator=torch.Generator().manual_seed(3))[: 2**16]
    w.view(torch.int16).view(-1)[where] = torch.arange(-(2**15), 2**15, dtype=torch.int16)
    layout, _ = round_trip({"w": w}, code)
    assert layout.entry("w").quantized


@pytest.mark.parametrize(
    "dtype, code, bound",
    [
        (torch.bfloat16, "nibble", 0.752),
        (torch.float32, "nibble", 0.877),
        (torch.bfloat16, "classes", 0.692),
        (torch.float32, "classes", 0.847),
    ],
    ids=["bf16-nibble", "fp32-nibble", "bf16-classes", "fp32-classes"],
)
def test_compresses_normal_weights_to_three_quarters(dtype, code, bound):
    w = {"gate_up_proj": weights(2, 1024, 512, dtype=dtype), "down_proj": weights(2, 512, 512, dtype=dtype, seed=1)}
    layout, _ = round_trip(w, code)
    raw = sum(t[0].numel() * t.element_size() for t in w.values())
    assert layout.nbytes / raw <= bound


def test_spread_exponents_fall_back_to_raw_and_stay_exact():
    # exponents uniform over 2**-60 .. 2**60: most weights escape, so the raw tensor is smaller
    g = torch.Generator().manual_seed(4)
    w = (torch.rand(2, 64, 64, generator=g) * 120 - 60).exp2() * torch.randn(2, 64, 64, generator=g).sign()
    layout, _ = round_trip({"w": w.bfloat16()})
    assert not layout.entry("w").quantized
    assert layout.nbytes <= 64 * 64 * 2 + 256


def test_escape_room_is_the_largest_over_the_experts():
    w = weights(3, 64, 64)
    natural = [escape_count(w[e]) for e in range(3)]  # a few tiny weights below every window
    w[1, 0, :5] = 1e6  # five more in expert 1
    assert escape_count(w[1]) == natural[1] + 5
    layout, records = round_trip({"w": w})
    assert layout.entry("w").section("esc_index").nbytes == 4 * max(natural[0], natural[1] + 5, natural[2])
    # expert 0 filled its unused entries harmlessly (checked by round_trip); a plan without room refuses
    tight = LosslessCodec().plan(tensor_specs({"w": w[1]}))
    with pytest.raises(CodecInputError, match="plan_experts"):
        LosslessCodec().encode({"w": w[1]}, tight, torch.empty(tight.nbytes, dtype=torch.uint8))


def test_unsupported_dtype_is_refused_naming_the_supported_ones():
    with pytest.raises(ConfigError, match="bfloat16 and float32"):
        LosslessCodec().plan_experts({"w": weights(2, 8, 8, dtype=torch.float16)})


def test_records_of_another_format_or_layout_are_refused():
    w = {"w": weights(64, 64)}
    codec = LosslessCodec()
    three, five = codec.plan(tensor_specs(w), {"w": 3}), codec.plan(tensor_specs(w), {"w": 5})
    assert three.nbytes == five.nbytes  # same size, other escape room: the header tells them apart
    record = torch.empty(three.nbytes, dtype=torch.uint8)
    codec.encode(w, three, record)
    with pytest.raises(IncompatibleFileError, match="other tensors"):
        codec.decode(record, five, torch.bfloat16)
    int4_layout, int4_record = pack_expert(make_codec("int4"), w)
    with pytest.raises(IncompatibleFileError, match="planned by codec 'int4'"):
        codec.decode(int4_record, int4_layout, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["[out,in]", "[in,out]"])
def test_linear_is_the_resident_models_matmul(dtype, transposed):
    w = weights(1, 48, 40, dtype=dtype)
    layout, (record,) = round_trip({"w": w})
    codec = LosslessCodec()
    x = weights(5, 48 if transposed else 40, dtype=dtype, seed=9, std=1.0)
    expected = x @ w[0] if transposed else F.linear(x, w[0])
    scratch = torch.empty(codec.scratch_bytes(layout), dtype=torch.uint8)
    for kw in ({}, {"scratch": scratch}):
        assert torch.equal(bits(codec.linear(x, record, layout, "w", transposed, **kw)), bits(expected))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tail", [77, 76], ids=["odd-tail", "tail-of-4s"])  # bf16 with n % 4 == 0: int64 stores
def test_triton_classes_decode_matches_torch_reference(kernel_device, dtype, tail):
    # 24 blocks of 256 and a masked tail: the last program partly empty at every launch shape below
    from mira_hf.quant import triton_kernels
    from mira_hf.quant.lossless_bits import decode_words_classes_torch

    w = weights(2, 1, 24 * 256 + tail, dtype=dtype)
    s = specials(dtype)
    w[0, 0, -s.numel() :] = s
    layout, records = round_trip({"w": w}, "classes")
    codec = LosslessCodec(code="classes")
    for e, record in enumerate(records):
        record = record.to(kernel_device)
        got = codec.decode(record, layout, dtype, backend="triton")
        assert torch.equal(bits(got["w"]).cpu(), bits(w[e]))
        expected = decode_words_classes_torch(record, layout.entry("w")).cpu()
        for blocks, warps in ((0, 0), (4, 2), (32, 8)):  # the default and launch shapes the GPU check sweeps
            bulk = torch.empty(w.shape[1:], dtype=dtype, device=kernel_device)
            triton_kernels.lossless_classes_decode(record, layout.entry("w"), bulk, blocks, warps)  # escapes unpatched
            assert torch.equal(bits(bulk).reshape(-1).cpu(), expected)


@pytest.mark.parametrize("code", ["classes", "nibble"])
def test_a_bound_slot_decodes_each_expert_copied_into_it_exactly(kernel_device, code):
    """A slot is bound once (its sections' views made then) and then holds one expert after another: each
    decodes to its own weights bit for bit, escapes included, through `weight` and `linear`."""
    from mira_hf.quant.record import dense_linear

    w = weights(3, 8, 2 * 256 + 5)
    w[1, 0, : specials(torch.bfloat16).numel()] = specials(torch.bfloat16)  # escapes in the middle expert only
    layout, records = round_trip({"w": w}, code)
    codec = LosslessCodec(code=code, backend="triton")
    slot = torch.zeros(layout.nbytes, dtype=torch.uint8, device=kernel_device)
    bound = codec.bind(slot, layout)
    assert bound.use_triton and set(bound.sections) == {"w"}
    x = weights(2, w.shape[-1], seed=3).to(kernel_device)
    for e in (0, 1, 2, 1):
        slot.copy_(records[e])
        assert torch.equal(bits(bound.weight("w", torch.bfloat16)).cpu(), bits(w[e]))
        expected = dense_linear(x.cpu(), w[e], False)
        assert torch.equal(bits(bound.linear(x, "w", False)).cpu(), bits(expected))


def test_an_unknown_exponent_code_is_refused():
    with pytest.raises(ConfigError, match="Supported: nibble, classes"):
        QuantConfig(lossless_code="huffman")
    with pytest.raises(ConfigError, match="supported are"):
        LosslessCodec(code="huffman")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_decode_matches_torch_reference(kernel_device, dtype):
    # 2 * 4096 + 77 elements: two full programs and a masked tail with an odd element count
    w = weights(2, 1, 2 * 4096 + 77, dtype=dtype)
    s = specials(dtype)
    w[0, 0, -s.numel() :] = s
    layout, records = round_trip({"w": w})
    codec = LosslessCodec()
    for e, record in enumerate(records):
        record = record.to(kernel_device)
        slot = {"w": torch.empty(w.shape[1:], dtype=dtype, device=kernel_device)}
        got = codec.decode(record, layout, dtype, out=slot, backend="triton")
        assert got["w"] is slot["w"]
        assert torch.equal(bits(got["w"]).cpu(), bits(w[e]))
        from mira_hf.quant import triton_kernels

        bulk = torch.empty_like(slot["w"])
        triton_kernels.lossless_decode(record, layout.entry("w"), bulk)  # before the escapes are patched
        assert torch.equal(bits(bulk).reshape(-1).cpu(), decode_words_torch(record, layout.entry("w")).cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_encode_and_decode_are_exact():
    w = {"gate_up_proj": weights(2, 512, 256).cuda(), "down_proj": weights(2, 256, 256, seed=1).cuda()}
    w["down_proj"][1, 0, :4] = specials(torch.bfloat16)[:4].cuda()
    codec = LosslessCodec()
    layout = codec.plan_experts(w)
    for e in range(2):
        record = torch.empty(layout.nbytes, dtype=torch.uint8, device="cuda")
        codec.encode({n: t[e] for n, t in w.items()}, layout, record)  # computed on the GPU
        host = torch.empty(layout.nbytes, dtype=torch.uint8)
        codec.encode({n: t[e].cpu() for n, t in w.items()}, layout, host)
        assert torch.equal(record.cpu(), host)  # same bytes wherever it was encoded
        out = codec.decode(record, layout, torch.bfloat16)
        assert all(torch.equal(bits(out[n]), bits(w[n][e])) for n in w)


# ----------------------------------------------------------------------------------------- runtime


def _wrapped(path: str, quantization, placement="dequant", dtype=torch.float32, budget=0.3, code="nibble", device="cpu"):
    quant = QuantConfig(placement=placement, lossless_code=code)
    cfg = MiraConfig(device=device, gpu_budget=budget, quantization=quantization, quant=quant)
    return MiraMoEModel.from_pretrained(path, cfg, dtype=dtype, progress=False).eval()


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("name", ALL_TINY)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_logits_are_bit_identical_to_the_unwrapped_model(tiny_checkpoint, name, dtype, code):
    """Lossless transfer computes the unwrapped model's logits bit for bit, in both placements, with both
    exponent codes (and so the same as quantization=None)."""
    path = tiny_checkpoint(name)
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = load_reference(path, dtype)(ids).logits  # loaded in dtype, as the wrapped model is
        for placement in PLACEMENTS:
            model = _wrapped(path, "lossless", placement, dtype=dtype, code=code)
            assert torch.equal(model(ids).logits, reference), placement
            s = model.mira.stats()
            assert s["bytes_h2d"] > 0 and model.mira.device_bytes <= s["budget_bytes"]


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bundled_model_logits_and_generation_are_identical(placement, dtype, code):
    """The trained model: bit-identical logits to the unwrapped model, same greedy and beam tokens."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ids = load_file(f"{bundled_model_path()}/heldout_tokens.safetensors")["input_ids"][:2, :24].long()
    ref = AutoModelForCausalLM.from_pretrained(bundled_model_path(), dtype=dtype).eval()
    model = _wrapped(bundled_model_path(), "lossless", placement, dtype=dtype, budget=0.25, code=code)
    plain = _wrapped(bundled_model_path(), None, dtype=dtype, budget=0.25)
    with torch.no_grad():
        got, expected = model(ids).logits, ref(ids).logits
    assert torch.equal(got, plain(ids).logits)
    assert torch.equal(got, expected)
    prompt = ids[:1, :12]
    for kw in (dict(do_sample=False), dict(do_sample=False, num_beams=4)):
        kw.update(max_new_tokens=8, min_new_tokens=8)
        assert torch.equal(model.generate(prompt, **kw), ref.generate(prompt, **kw))
    bound = {"nibble": (0.76, 0.88), "classes": (0.70, 0.85)}[code][dtype == torch.float32]  # measured 0.753, 0.876
    assert model.mira.store.nbytes <= bound * plain.mira.store.nbytes


def test_unload_gives_back_the_exact_weights_without_a_warning():
    import warnings

    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(bundled_model_path(), dtype=torch.bfloat16)
    model = _wrapped(bundled_model_path(), "lossless", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.unload()
    for (name, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(ref.state_dict().items())):
        assert torch.equal(a, b), name


def test_half_precision_is_refused_before_the_model_changes(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("mixtral"), dtype=torch.float16)
    before = dict(model.named_parameters())
    with pytest.raises(ConfigError, match="bfloat16 and float32"):
        MiraMoEModel.wrap(model, MiraConfig(device="cpu", quantization="lossless"))
    assert dict(model.named_parameters()).keys() == before.keys() and not hasattr(model, "mira")


def test_saved_store_round_trips(tmp_path):
    model = _wrapped(bundled_model_path(), "lossless", dtype=torch.bfloat16, code="classes")  # MiraConfig's default code
    model.mira.save_store(tmp_path / "store")
    cfg = MiraConfig(device="cpu", gpu_budget=0.3, quantization="lossless", store_path=str(tmp_path / "store"))
    again = MiraMoEModel.from_pretrained(bundled_model_path(), cfg, dtype=torch.bfloat16, progress=False)
    assert all(torch.equal(again.mira.store.record(layer, 5), model.mira.store.record(layer, 5)) for layer in range(6))
    ids = torch.arange(3, 40).view(1, -1)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    other = MiraConfig(device="cpu", gpu_budget=0.3, quantization="int4", store_path=str(tmp_path / "store"))
    with pytest.raises(IncompatibleFileError, match="made for another format"):
        MiraMoEModel.from_pretrained(bundled_model_path(), other, dtype=torch.bfloat16, progress=False)
    nibble = cfg.replace(quant=QuantConfig(lossless_code="nibble"))  # the other exponent code is another format
    with pytest.raises(IncompatibleFileError, match="made for another format"):
        MiraMoEModel.from_pretrained(bundled_model_path(), nibble, dtype=torch.bfloat16, progress=False)


def test_a_wrap_that_fails_on_a_damaged_saved_store_leaves_the_model_as_it_was(tiny_checkpoint, tmp_path):
    """A saved store is read layer by layer: one damaged past its first layer raises CorruptStoreError, and the model
    keeps its own experts, not the store's records of the layers read before (a store of other expert values is
    accepted as it is, so they need not be the model's)."""
    import json

    from mira_hf.saved_store import CorruptStoreError

    path = tiny_checkpoint("mixtral")
    cfg = MiraConfig(device="cpu", quantization="lossless")
    MiraMoEModel.wrap(load_reference(path), cfg).mira.save_store(tmp_path)
    with open(tmp_path / "mira_store.json") as f:
        header = json.load(f)
    at = header["data_start"] + header["layers"]["1"]["offset"] + 10
    with open(tmp_path / "mira_store.safetensors", "r+b") as f:  # one bit of layer 1's records flipped
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 1]))
    model = load_reference(path)
    with torch.no_grad():  # other expert values than the store's
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(2.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CorruptStoreError):
        MiraMoEModel.wrap(model, cfg.replace(store_path=str(tmp_path)))
    after = model.state_dict()
    assert list(after) == list(before) and not hasattr(model, "mira")
    assert all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_state_dict_and_save_decode_on_the_device_the_checkpoints_bits(tiny_checkpoint, tmp_path):
    """Served on a GPU, lossless records are decoded for state_dict() and save_pretrained on the device that
    encoded them: every expert tensor is the checkpoint's, bit for bit, as transformers' own save writes it (and
    its cast to fp32, through a cast of the wrapped model), and the decode keeps no device memory."""
    from safetensors.torch import load_file

    path = tiny_checkpoint("mixtral")
    ref = load_reference(path, torch.bfloat16)
    model = _wrapped(path, "lossless", dtype=torch.bfloat16, device="cuda")
    store, encoder = model.mira.store, model.mira.store.encoder
    experts = sum(store.num_experts(layer) for layer in store.layers)
    allocated = torch.cuda.memory_allocated()
    state, expected = model.state_dict(), ref.state_dict()
    assert encoder.experts_decoded_on_device == experts
    assert torch.cuda.memory_allocated() == allocated
    keys = [k for k in expected if ".experts." in k]
    assert keys and all(torch.equal(bits(state[k].cpu()), bits(expected[k])) for k in keys)
    model.save_pretrained(tmp_path / "own")
    ref.save_pretrained(tmp_path / "ref")
    assert encoder.experts_decoded_on_device == 2 * experts
    own, written = load_file(tmp_path / "own" / "model.safetensors"), load_file(tmp_path / "ref" / "model.safetensors")
    assert own.keys() == written.keys()
    assert all(torch.equal(bits(own[k]), bits(written[k])) for k in written if own[k].is_floating_point())
    model.float()  # the records stay bf16, decoded through the cast
    state, expected = model.state_dict(), ref.float().state_dict()
    assert encoder.experts_decoded_on_device == 3 * experts
    assert all(state[k].dtype == torch.float32 and torch.equal(bits(state[k].cpu()), bits(expected[k])) for k in keys)


# ------------------------------------------------------------------------------------------ budget


@pytest.mark.parametrize(
    "quantization, placement",
    [(None, "dequant"), ("lossless", "dequant"), ("lossless", "packed"), ("int4", "dequant"), ("int4", "packed")],
)
def test_device_allocations_stay_within_the_budget(tiny_checkpoint, quantization, placement):
    """Slots plus the codec's buffers (staging record, decode scratch) fit in gpu_budget, down to the
    smallest budget accepted; one byte less is refused."""
    path = tiny_checkpoint("mixtral")
    with pytest.raises(BudgetError, match="minimum working set") as err:
        _wrapped(path, quantization, placement, budget=1)
    minimum = int(str(err.value).split("minimum working set of this model: ")[1].split(" bytes")[0].replace(",", ""))
    for budget in (minimum, 2 * minimum, 1.0):
        model = _wrapped(path, quantization, placement, budget=budget)
        mira = model.mira
        assert mira.device_bytes <= mira.stats()["budget_bytes"]
        assert mira.device_bytes == mira.budget.device_bytes
        if quantization is not None and placement == "dequant" or quantization == "lossless":
            assert mira.arena.buffer_bytes > 0  # a staging record, or lossless' decode scratch
        with torch.no_grad():
            model(torch.arange(3, 20).view(1, -1))
    with pytest.raises(BudgetError):
        _wrapped(path, quantization, placement, budget=minimum - 1)


# Budgets (shares of the uncompressed experts' bytes) that hold every expert of the bundled model only with some
# kept packed: its lossless records are 0.70 of bf16's bytes and 0.88 of fp32's.
MIXED_BUDGET = {torch.bfloat16: 0.85, torch.float32: 0.97}


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
        ),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_placement_keeps_a_few_experts_packed_copies_nothing_more_and_computes_the_same_bits(dtype, device):
    """Placement "mixed": where the budget holds every expert only with some kept packed, those few stay packed on
    the device (decoded at each use) and the rest are decoded into slots, so after the first step nothing crosses the
    link again; under every experts implementation the logits and tokens are the unwrapped model's."""
    from safetensors.torch import load_file

    path = bundled_model_path()
    ids = load_file(f"{path}/heldout_tokens.safetensors")["input_ids"][:2, :24].long().to(device)
    ref = load_reference(path, dtype).to(device)
    model = _wrapped(path, "lossless", "mixed", dtype=dtype, budget=MIXED_BUDGET[dtype], code="classes", device=device)
    mira = model.mira
    kept = mira.budget.kept
    n_kept = sum(len(es) for es in kept.values())
    assert 0 < n_kept and sum(mira.budget.n_slots.values()) + n_kept == 6 * 8  # every expert is on the device
    assert max(map(len, kept.values())) - min(len(kept.get(layer, ())) for layer in range(6)) <= 1  # spread evenly
    assert mira.device_bytes == mira.budget.device_bytes <= mira.stats()["budget_bytes"]
    with torch.no_grad():
        for impl in ("grouped_mm", "eager", "batched_mm"):
            ref.set_experts_implementation(impl)
            model.set_experts_implementation(impl)
            assert torch.equal(model(ids).logits, ref(ids).logits), impl
        loads = mira.stats()["loads"]
        assert 0 < loads <= 6 * 8 - n_kept  # each used expert with a slot copied once, the kept ones never
        prompt = ids[:1, :12]
        for kw in (dict(do_sample=False), dict(do_sample=False, num_beams=4)):
            kw.update(max_new_tokens=8, min_new_tokens=8)
            assert torch.equal(model.generate(prompt, **kw), ref.generate(prompt, **kw))
    assert sum(mira.expert_counts()[layer][e] for layer, es in kept.items() for e in es) > 0  # kept ones were used
    s = mira.stats()
    assert s["loads"] == loads and s["evictions"] == 0 and s["kept_packed_experts"] == n_kept
    kept_bytes = sum(len(es) * mira.store.record_bytes(layer) for layer, es in kept.items())
    assert s["kept_packed_bytes"] == kept_bytes  # on the device beside the slots, and counted as resident
    assert s["resident_bytes"] == mira.cache.resident_bytes + kept_bytes <= s["budget_bytes"]
    layer, (expert, *_) = next(iter(kept.items()))
    assert mira.tier_of(layer, expert) == "hot" and not mira.wants((layer, expert))
    assert not any(w for e, w in enumerate(mira.wanted(layer)) if e in kept[layer])


def test_a_mixed_cache_resized_keeps_packed_only_what_the_new_size_needs():
    """The server's plan resizes the expert cache after loading (`resize_expert_cache`): a mixed placement is planned
    again at the new size, kept experts appearing or going, and the logits stay the unwrapped model's."""
    from mira_hf.serve.planning import resize_expert_cache

    path = bundled_model_path()
    ids = torch.arange(3, 40).view(1, -1)
    ref = load_reference(path, torch.bfloat16)
    model = _wrapped(path, "lossless", "mixed", dtype=torch.bfloat16, budget=0.3, code="classes")
    assert model.mira.budget.kept == {}
    all_bytes = sum(model.mira.store.raw_layout(layer).nbytes * 8 for layer in range(6))
    with torch.no_grad():
        expected = ref(ids).logits
        for share, keeps in ((0.85, True), (0.3, False), (1.2, False)):
            resize_expert_cache(model, int(share * all_bytes))
            assert bool(model.mira.budget.kept) == keeps, share
            assert model.mira.budget.placement == "mixed"
            assert torch.equal(model(ids).logits, expected), share
