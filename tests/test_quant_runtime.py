"""Compressed transfer in the runtime: every format runs through generate, stays within its quality
target on the bundled trained model, and the packed placement holds more experts per budget."""

import copy
import importlib.util
import math

import pytest
import torch
from safetensors.torch import load_file

from mira_hf import MiraConfig, MiraMoEModel, MissingDependencyError, bundled_model_path
from mira_hf.config import QuantConfig

HAVE_BNB = importlib.util.find_spec("bitsandbytes") is not None
TARGETS = {"int8": 0.005, "int4": 0.05}  # allowed relative perplexity increase (issue targets)


def _model(quantization=None, placement="dequant", budget=0.25, dtype=torch.float32):
    cfg = MiraConfig(gpu_budget=budget, device="cpu", quantization=quantization, quant=QuantConfig(placement=placement))
    return MiraMoEModel.from_pretrained(bundled_model_path(), cfg, dtype=dtype, progress=False)


@pytest.fixture(scope="module")
def heldout():
    return load_file(f"{bundled_model_path()}/heldout_tokens.safetensors")["input_ids"][:6].long()


def _ppl(model, ids) -> float:
    with torch.no_grad():
        return math.exp(model(ids, labels=ids).loss.item())


@pytest.fixture(scope="module")
def baseline_ppl(heldout):
    return _ppl(_model(), heldout)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("placement", ["dequant", "packed"])
def test_quantized_perplexity_within_target(fmt, placement, heldout, baseline_ppl):
    ppl = _ppl(_model(fmt, placement), heldout)
    assert ppl <= baseline_ppl * (1 + TARGETS[fmt]), (fmt, placement, ppl, baseline_ppl)


@pytest.mark.parametrize(
    "fmt", ["int8", "int4", pytest.param("nf4", marks=pytest.mark.skipif(not HAVE_BNB, reason="bitsandbytes not installed"))]
)
@pytest.mark.parametrize("placement", ["dequant", "packed"])
def test_every_format_generates_what_the_model_with_its_decoded_weights_generates(fmt, placement, heldout):
    """A quantized model computes with the decoded weights: after `unload()` (which puts the decoded experts
    back into an ordinary transformers model) that model gives the same greedy and beam tokens, and logits
    equal up to the order of the top-k sum (≤ 1e-4; measured ≤ 1.4e-5)."""
    import warnings

    model = _model(fmt, placement)
    prompt = heldout[:1, :12]
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    greedy, beam = model.generate(prompt, **kw), model.generate(prompt, num_beams=4, **kw)
    with torch.no_grad():
        logits = model(heldout[:2]).logits
    s = model.mira.stats()
    assert s["bytes_h2d"] > 0 and s["resident_bytes"] <= s["budget_bytes"] and s["quantization"] == fmt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unload warns that the experts are dequantized values: that is the point
        decoded = model.unload()
    assert not hasattr(decoded, "mira")
    assert torch.equal(decoded.generate(prompt, **kw), greedy) and greedy.shape == (1, 20)
    assert torch.equal(decoded.generate(prompt, num_beams=4, **kw), beam)
    with torch.no_grad():
        assert (decoded(heldout[:2]).logits - logits).abs().max() <= 1e-4


def test_both_placements_compute_the_same_function(heldout):
    with torch.no_grad():
        a = _model("int4", "dequant")(heldout[:2]).logits
        b = _model("int4", "packed")(heldout[:2]).logits
    assert (a - b).abs().max() <= 1e-3


def test_packed_placement_holds_more_experts_and_moves_fewer_bytes(heldout):
    raw, packed = _model(None, dtype=torch.bfloat16), _model("int4", "packed", dtype=torch.bfloat16)
    assert sum(packed.mira.budget.n_slots.values()) >= 3 * sum(raw.mira.budget.n_slots.values()) or all(
        n == 48 for n in packed.mira.budget.n_slots.values()
    )
    assert packed.mira.store.record_bytes(0) * 3.5 <= raw.mira.store.record_bytes(0)


def test_nf4_without_bitsandbytes_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(MissingDependencyError, match=r"mira-hf\[quant\]"):
        MiraConfig(quantization="nf4")


def test_bad_quant_settings_are_refused():
    from mira_hf import ConfigError

    with pytest.raises(ConfigError, match="placement"):
        QuantConfig(placement="cpu")
    for size in (48, 2048, 64.0):  # each size the record layouts take is accepted here, and no other
        with pytest.raises(ConfigError, match=rf"group_size={size}: must be one of 16, 32, .*1024"):
            QuantConfig(group_size=size)
    from mira_hf.quant.nf4 import Nf4Codec

    with pytest.raises(ConfigError, match="nf4 takes blocks of 32 weights and up"):  # before bitsandbytes is needed
        Nf4Codec(16)
    from mira_hf import MiraConfig

    with pytest.raises(ConfigError, match=r"Supported: auto, none, lossless, int8, int4, nf4 \(any case\)"):
        MiraConfig(quantization="int3")  # pre-quantized checkpoints' formats are not offered


@pytest.mark.parametrize(
    "quantization, stored, saved, loaded, refusal",
    [
        # a bf16 checkpoint's routers hash the same in any dtype: records of the same sizes, packed from other tensors
        (
            q,
            torch.bfloat16,
            torch.bfloat16,
            torch.float32,
            r"holds records packed from other tensors than these experts' "
            r"\(gate_up_proj float32, down_proj float32\)",
        )
        for q in ("int8", "int4")
    ]
    # a float32 checkpoint's routers round to bfloat16: its bf16 load fingerprints as other router weights
    + [
        (
            "int8",
            torch.float32,
            torch.float32,
            torch.bfloat16,
            r"was made from other router weights .*loaded in another "
            r"dtype than the store was saved from",
        )
    ],
)
def test_a_saved_store_of_another_dtype_is_refused_saying_what_to_do(tmp_path, quantization, stored, saved, loaded, refusal):
    """A store saved from one dtype's load of a checkpoint, loaded in another: refused naming the store, why and what
    to do; the dtype it was saved from still takes it."""
    from mira_hf import IncompatibleFileError
    from mira_hf.config import LoaderConfig
    from mira_hf.testing import build, make_config

    torch.manual_seed(0)
    build(make_config("mixtral")).to(stored).save_pretrained(tmp_path / "ckpt")
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, quantization=quantization, loader=LoaderConfig(record_cache=None))
    load = lambda dtype, cfg: MiraMoEModel.from_pretrained(str(tmp_path / "ckpt"), cfg, dtype=dtype, progress=False)  # noqa: E731
    load(saved, cfg).mira.save_store(tmp_path / "store")
    with pytest.raises(
        IncompatibleFileError, match=rf"store in .* {refusal}.*Load the model in the dtype the store was saved from"
    ):
        load(loaded, cfg.replace(store_path=str(tmp_path / "store")))
    assert load(saved, cfg.replace(store_path=str(tmp_path / "store"))).mira.store.record(0, 1).numel() > 0


def test_a_store_that_cannot_be_written_is_refused_and_leaves_the_one_there(tmp_path, heldout, monkeypatch):
    """`save_store` into a path that is a file, or onto a disk that fills up midway: a `ConfigError` naming the
    directory and the room needed; a store saved there before is left whole and still loads."""
    from mira_hf import ConfigError, saved_store

    model = _model("int4")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"cannot write the expert store in .*file .*with room for [\d,]+ bytes"):
        model.mira.save_store(tmp_path / "file")
    model.mira.save_store(tmp_path / "store")

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(saved_store, "_write_chunk", full)
    with pytest.raises(ConfigError, match="No space left on device.*a store already there is left as it was"):
        model.mira.save_store(tmp_path / "store")
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["mira_store.json", "mira_store.safetensors"]
    cfg = MiraConfig(device="cpu", gpu_budget=0.25, quantization="int4", store_path=str(tmp_path / "store"))
    again = MiraMoEModel.from_pretrained(bundled_model_path(), cfg, dtype=torch.float32, progress=False)
    with torch.no_grad():
        assert torch.equal(again(heldout[:1]).logits, model(heldout[:1]).logits)


def test_save_store_of_uncompressed_experts_says_which_formats_it_saves(tmp_path):
    from mira_hf import ConfigError

    with pytest.raises(ConfigError, match=r"uncompressed \(quantization=None\).*nothing to save.*'lossless', 'int8', 'int4'"):
        _model(None).mira.save_store(tmp_path / "store")
    with pytest.raises(ConfigError, match="host_compute='split' the store holds each expert's device part only"):
        model = _model(None)  # held: a method of a wrapped model does not keep it alive (`del model` frees it)
        MiraMoEModel.wrap(model.unload(), MiraConfig(device="cpu", host_compute="split")).mira.save_store(tmp_path)
    assert not (tmp_path / "store").exists()


def test_unload_of_a_quantized_model_warns_that_experts_are_dequantized():
    model = _model("int8")
    with pytest.warns(UserWarning, match="dequantized values"):
        model.unload()


def test_saved_store_is_reused_and_a_foreign_one_refused(tmp_path, heldout):
    model = _model("int4")
    model.mira.save_store(tmp_path / "store")
    cfg = MiraConfig(device="cpu", gpu_budget=0.25, quantization="int4", store_path=str(tmp_path / "store"))
    again = MiraMoEModel.from_pretrained(bundled_model_path(), cfg, dtype=torch.float32, progress=False)
    assert all(torch.equal(again.mira.store.record(layer, 3), model.mira.store.record(layer, 3)) for layer in range(6))
    with torch.no_grad():
        assert torch.equal(again(heldout[:1]).logits, model(heldout[:1]).logits)

    from mira_hf import IncompatibleFileError

    other = MiraConfig(device="cpu", gpu_budget=0.25, quantization="int8", store_path=str(tmp_path / "store"))
    with pytest.raises(IncompatibleFileError, match="made for another format"):
        MiraMoEModel.from_pretrained(bundled_model_path(), other, dtype=torch.float32, progress=False)
    with pytest.raises(IncompatibleFileError, match="holds no saved expert store"):
        MiraMoEModel.from_pretrained(
            bundled_model_path(), MiraConfig(device="cpu", quantization="int4", store_path=str(tmp_path)), progress=False
        )


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "jetmoe"])
def test_experts_kept_packed_compute_the_bits_of_their_decoded_slots(family, fmt):
    """Placement "mixed" with a lossy format, on experts narrower than the format's groups (these tiny models' down
    projections take 32 inputs: zero-padded to a group of 64): an expert kept packed is decoded at each use and
    computed as its decoded slot would be, so any budget gives the bits of the same format with every expert in a
    decoded slot (the codec's own matmul multiplies the padded weight: other bits)."""
    from tiny_models import make_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(make_config(family)).eval()
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(3))

    def wrapped(budget) -> MiraMoEModel:
        cfg = MiraConfig(device="cpu", gpu_budget=budget, quantization=fmt, quant=QuantConfig(placement="mixed"))
        return MiraMoEModel.wrap(copy.deepcopy(ref), cfg)

    mira = wrapped(1.0).mira  # 1.0 of the experts' bytes, less the staging record: an expert kept packed
    plan = mira.budget
    every = sum(li.num_experts * plan.pool_of_layer[li.ordinal] for li in mira.layers.values())  # decoded slots
    decoded = wrapped(every + sum(plan.buffer_bytes.values()))
    assert decoded.mira.stats()["kept_packed_experts"] == 0 and decoded.mira.store.layout(0).padded
    impls = ("grouped_mm", "eager", "batched_mm") if family != "jetmoe" else (None,)  # JetMoE's block has one forward
    for budget in (1.0, 0.8, 0.6):
        mixed = wrapped(budget)
        assert mixed.mira.stats()["kept_packed_experts"] > 0
        for impl in impls:
            if impl is not None:
                decoded.set_experts_implementation(impl)
                mixed.set_experts_implementation(impl)
            with torch.no_grad():
                assert torch.equal(mixed(ids).logits, decoded(ids).logits), (budget, impl)
        kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(mixed.generate(ids, **kw), decoded.generate(ids, **kw))
