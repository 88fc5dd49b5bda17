"""Pre-quantized checkpoints (FP8 with block scales, MXFP4) are served with their experts in the checkpoint's
own bytes, and compute what transformers' own loading of the same directory computes.

On a CPU transformers dequantizes both formats at load (FP8: "requires a GPU or XPU, we will default to
dequantizing"; MXFP4: dequantized on load), so the reference here is `AutoModelForCausalLM.from_pretrained(dir)`
on that path (`conftest.reference_kwargs`: MXFP4 asked to dequantize, as transformers ≥ 5.25 would fetch hub
kernels for it on a CPU otherwise)."""

import glob
import json
import os
import re

import pytest
import torch
from conftest import reference_kwargs
from quantized_checkpoints import FP8_FAMILIES, write_fp8_checkpoint, write_mxfp4_checkpoint
from safetensors import safe_open

from mira_hf import ConfigError, MiraConfig, MiraMoEModel, UnsupportedModelError, UnsupportedOperationError
from mira_hf.config import LoaderConfig
from mira_hf.quant.fp8_block import dequantize_fp8
from mira_hf.quant.mxfp4 import dequantize_mxfp4

# CI runs one family per format and one without an adapter; the others (several seconds each on a CPU) run with
# -m slow.
FAST = ("qwen3_moe", "gpt_oss", "glm_moe_dsa")
CASES = [
    pytest.param(f, c, marks=() if f in FAST else pytest.mark.slow)
    for f, c in [(f, "fp8_block") for f in FP8_FAMILIES] + [("gpt_oss", "mxfp4")]
]
IDS = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(5))
GREEDY = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
BEAM = dict(max_new_tokens=6, do_sample=False, num_beams=3, pad_token_id=0)


@pytest.fixture(scope="session")
def quantized_checkpoint(tmp_path_factory):
    """family -> directory of a tiny checkpoint in the hub's pre-quantized layout, written once per session."""
    cache = {}

    def get(family: str) -> str:
        if family not in cache:
            path = str(tmp_path_factory.mktemp(f"prequantized-{family}"))
            cache[family] = write_mxfp4_checkpoint(path) if family == "gpt_oss" else write_fp8_checkpoint(family, path)
        return cache[family]

    return get


def _load(path: str, **kw):
    hf = {"dtype": kw.pop("dtype")} if "dtype" in kw else {}
    return MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", **kw), progress=False, **hf).eval()


def _reference(path: str, dtype=None):
    """transformers' own load, with the class mira-hf builds (a vision-language model's image-text-to-text model)."""
    from mira_hf.checkpoint import model_class_of

    with open(os.path.join(path, "config.json")) as f:
        cls = model_class_of(json.load(f))
    return cls.from_pretrained(path, **reference_kwargs(path, dtype)).eval()


def _expert_bytes(path: str, model) -> tuple[int, int]:
    """(bytes of the routed experts' tensors in the checkpoint's shards, bytes of those experts in the model's
    dtype, as transformers holds them after dequantizing)."""
    prefixes = tuple(t.name + "." for t in model._mira_targets)
    prefixes += tuple(p.replace(".mlp.", ".block_sparse_moe.") for p in prefixes)  # MiniMax-M2's checkpoint names
    stored = 0
    for f in glob.glob(f"{path}/*.safetensors"):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                if k.startswith(prefixes):
                    t = h.get_slice(k)
                    n = 1
                    for s in t.get_shape():
                        n *= s
                    stored += n * {"F8_E4M3": 1, "U8": 1, "F32": 4, "BF16": 2}[t.get_dtype()]
    store = model.mira.store
    return stored, sum(store.raw_layout(li).payload_bytes * store.num_experts(li) for li in store.layers)


@pytest.mark.parametrize("family,codec", CASES)
def test_experts_are_stored_as_the_checkpoint_stores_them(quantized_checkpoint, family, codec):
    path = quantized_checkpoint(family)
    model = _load(path)
    store = model.mira.store
    assert model.mira.quantization == codec and store.codec.name == codec and model.mira.placement == "dequant"
    stored, bf16 = _expert_bytes(path, model)
    payload = sum(store.layout(li).payload_bytes * store.num_experts(li) for li in store.layers)
    assert payload == stored  # every expert byte of the checkpoint, nothing else (weights, scales, biases)
    assert store.nbytes <= stored * 1.05  # plus alignment
    assert store.nbytes < (0.51 if codec == "fp8_block" else 0.30) * bf16


@pytest.mark.parametrize("family,codec", CASES)
def test_fp32_logits_and_tokens_equal_transformers(quantized_checkpoint, family, codec):
    """Loaded in fp32, logits torch.equal to transformers' own load, greedy and beam tokens identical."""
    path = quantized_checkpoint(family)
    ref = _reference(path, torch.float32)
    skip_unless_float32_runs(ref)
    ref = experts_in_model_dtype(ref)
    model = _load(path, dtype=torch.float32, gpu_budget=0.5)
    assert model.mira.store.codec.name == codec
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)
    assert torch.equal(model.generate(IDS[:1], **GREEDY), ref.generate(IDS[:1], **GREEDY))
    assert torch.equal(model.generate(IDS[:1], **BEAM), ref.generate(IDS[:1], **BEAM))


@pytest.mark.parametrize("family,codec", CASES)
def test_bf16_weights_are_transformers_bit_for_bit(quantized_checkpoint, family, codec):
    """In the checkpoint's dtype (bf16) every expert decodes to transformers' weights bit for bit, and the
    logits and beams equal transformers' own load's, and those of that load wrapped whole."""
    path = quantized_checkpoint(family)
    ref, model = _reference(path), _load(path)
    whole = _load(path, loader=LoaderConfig(stream_experts=False))  # transformers' dequantized load, wrapped
    assert model.mira.store.dtype(0) == torch.bfloat16 and whole.mira.store.codec.name == "none"
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits) and torch.equal(model(IDS).logits, whole(IDS).logits)
    assert torch.equal(model.generate(IDS[:1], **BEAM), ref.generate(IDS[:1], **BEAM))
    assert torch.equal(model.generate(IDS[:1], **BEAM), whole.generate(IDS[:1], **BEAM))
    exposed = dict(model.named_parameters())
    back = model.unload()  # every expert as this store decodes it, in the parameters the wrapped model exposed
    assert all(p is exposed[n] for n, p in back.named_parameters())
    expected = ref.state_dict()
    assert back.state_dict().keys() == expected.keys()
    assert all(t.dtype == expected[k].dtype and torch.equal(t, expected[k]) for k, t in back.state_dict().items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_cuda_decodes_the_checkpoints_bytes_as_the_host_does(quantized_checkpoint, family, dtype):
    """Served on a GPU, state_dict() and unload() decode the checkpoint's own bytes (FP8 with block scales, MXFP4)
    on the device, into the same tensors bit for bit as the host's decode of the same records gives."""
    path = quantized_checkpoint(family)
    expected = _load(path, gpu_budget=0.5, dtype=dtype).state_dict()  # decoded on the host
    cfg = MiraConfig(device="cuda", gpu_budget=0.5)
    model = MiraMoEModel.from_pretrained(path, cfg, progress=False, dtype=dtype).eval()
    store, state = model.mira.store, model.state_dict()
    assert store.encoder.experts_decoded_on_device == sum(store.num_experts(layer) for layer in store.layers)
    keys = [k for k in expected if ".experts." in k]
    assert keys and all(torch.equal(state[k].cpu(), expected[k]) for k in keys)
    back = model.unload().state_dict()
    assert all(torch.equal(back[k].cpu(), expected[k]) for k in keys)


def test_outputs_do_not_depend_on_the_budget_or_host_tier(quantized_checkpoint, tmp_path):
    path = quantized_checkpoint("qwen3_moe")
    outs = []
    for kw in (dict(gpu_budget=1.0), dict(gpu_budget=0.25, host_budget=1, offload_dir=str(tmp_path))):
        model = _load(path, **kw)
        with torch.no_grad():
            outs.append(model(IDS).logits)
        if "host_budget" in kw:
            assert model.mira.store.tier_bytes()["disk"] == model.mira.store.nbytes
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("quantization", ["int4", "int8", "lossless"])
def test_another_format_for_a_prequantized_checkpoint_is_refused_before_loading(quantized_checkpoint, quantization):
    with pytest.raises(ConfigError, match="pre-quantized.*own bytes"):
        _load(quantized_checkpoint("qwen3_moe"), quantization=quantization)


def test_the_checkpoint_format_can_be_named_but_not_asked_of_other_checkpoints(quantized_checkpoint, tiny_checkpoint):
    assert _load(quantized_checkpoint("gpt_oss"), quantization="mxfp4").mira.quantization == "mxfp4"
    with pytest.raises(ConfigError, match="names the format of pre-quantized checkpoints"):
        _load(tiny_checkpoint("qwen3_moe"), quantization="fp8_block")


def test_packed_placement_is_refused_where_transformers_dequantizes(quantized_checkpoint):
    from mira_hf.config import QuantConfig

    with pytest.raises(ConfigError, match="placement='packed'"):
        _load(quantized_checkpoint("qwen3_moe"), quant=QuantConfig(placement="packed"))


def test_splitting_experts_of_a_prequantized_checkpoint_is_refused(quantized_checkpoint):
    with pytest.raises(ConfigError, match="host_compute='split'.*fp8_block"):
        _load(quantized_checkpoint("qwen3_moe"), host_compute="split")


def test_a_saved_store_neither_applies_to_nor_is_saved_from_the_checkpoints_own_format(quantized_checkpoint, tmp_path):
    """Experts in the checkpoint's own bytes are read from the checkpoint at every load: `store_path` is refused (it
    was ignored), and so is `save_store()`, whose files no load could read."""
    with pytest.raises(ConfigError, match="store_path is set with quantization='fp8_block', a checkpoint's own format"):
        _load(quantized_checkpoint("qwen3_moe"), quantization="fp8_block", store_path=str(tmp_path))
    with pytest.raises(ConfigError, match="serves its checkpoint's own fp8_block bytes"):
        _load(quantized_checkpoint("qwen3_moe")).mira.save_store(str(tmp_path / "store"))
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors", "bitsandbytes"])
def test_other_quantized_formats_are_named_in_the_warning_or_error(tiny_checkpoint, tmp_path, method):
    import json
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("qwen3_moe"), path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=f"quant_method='{method}'"):
        _load(str(path), loader=LoaderConfig(stream_experts=True))
    with pytest.warns(UserWarning, match=f"quant_method='{method}'"):
        try:  # the whole load is transformers' (which may need that format's package)
            _load(str(path))
        except Exception:
            pass


def test_fp8_scales_stored_as_exponent_bytes_are_loaded_as_transformers_loads_them(tmp_path):
    """Block scales stored as E8M0 exponent bytes (uint8, as MXFP8 checkpoints ship them) are a form transformers'
    quantizer reads itself: the checkpoint is loaded whole, saying why, and computes what transformers computes."""
    from safetensors.torch import load_file, save_file

    path = write_fp8_checkpoint("qwen3_moe", str(tmp_path / "ckpt"), shards=1)
    tensors = load_file(f"{path}/model.safetensors")
    as_bytes = lambda s: (torch.log2(s).ceil() + 127).to(torch.uint8)  # noqa: E731  # 2 ** (byte - 127) >= s
    tensors = {k: as_bytes(v) if k.endswith("scale_inv") else v for k, v in tensors.items()}
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    try:
        ref = _reference(path)
    except Exception as exc:  # a transformers that reads no byte scales
        pytest.skip(f"transformers does not load FP8 scales stored as bytes: {exc}")
    with pytest.warns(UserWarning, match=r"weight_scale_inv is stored as torch.uint8, not as floating-point scales"):
        model = _load(path, gpu_budget=0.5)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)


def test_experts_an_fp8_checkpoint_leaves_unconverted_compute_in_their_dtype_as_transformers_does(tmp_path):
    """An FP8 checkpoint whose config leaves one layer's experts unquantized (`modules_to_not_convert`, stored in
    bf16), loaded in fp32: transformers keeps those experts in bf16 and its grouped matmul casts their rows to bf16;
    the wrapped model computes them the same way, not with its weights widened to fp32."""
    from safetensors.torch import load_file, save_file

    path = write_fp8_checkpoint("qwen3_moe", str(tmp_path / "ckpt"), shards=1)
    tensors = load_file(f"{path}/model.safetensors")
    for k in [k for k in tensors if k.startswith("model.layers.0.mlp.experts.") and k.endswith(".weight")]:
        tensors[k] = dequantize_fp8(tensors[k], tensors.pop(k + "_scale_inv"), torch.bfloat16)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head", "model.layers.0.mlp.experts"]
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)
    ref = _reference(path, torch.float32)
    assert ref.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    with pytest.warns(UserWarning, match="cannot be read one at a time"):
        model = _load(path, gpu_budget=0.5, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)


def test_decoding_repeats_transformers_dequantize_bit_for_bit():
    """Grids that are not square, extreme exponents (0, 255), fp32/bf16/fp16 targets."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(384, 256, generator=g) * 60).to(torch.float8_e4m3fn)
    s = torch.rand(3, 2, generator=g) * 1e-2
    blocks = torch.randint(0, 256, (4, 48, 3, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (4, 48, 3), generator=g, dtype=torch.uint8)
    scales[0, 0, :2] = torch.tensor([0, 255], dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(dequantize_fp8(w, s, dtype), Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=dtype))
        ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
        got = torch.stack([dequantize_mxfp4(blocks[e], scales[e], dtype) for e in range(4)])
        assert _bits(got).equal(_bits(ref))  # bit patterns: exponent 255 gives inf * 0 = nan, never torch.equal


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def test_packed_fp8_records_compute_through_transformers_fp8_linear(quantized_checkpoint, monkeypatch):
    """Placement "packed" (a GPU with FP8 kernels) keeps records packed in their slots and calls transformers'
    `fp8_linear` on each record's weight and scales. Here its kernel is stood in for by the dequantized
    weight's matmul, so the wiring (slot views, records copied in two parts, block size) is checked on a CPU:
    the same logits as decoding into slots, with more experts per budget."""
    import torch.nn.functional as F
    import transformers.integrations.finegrained_fp8 as finegrained_fp8

    from mira_hf.config import QuantConfig
    from mira_hf.quant.fp8_block import Fp8BlockCodec

    calls = []

    def kernel_stand_in(x, weight, scale_inv, block_size, *args, **kwargs):
        assert weight.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
        calls.append(block_size)
        return F.linear(x, dequantize_fp8(weight, scale_inv, x.dtype))

    monkeypatch.setattr(finegrained_fp8, "fp8_linear", kernel_stand_in)
    monkeypatch.setattr(Fp8BlockCodec, "computes_natively", lambda self, device: True)
    path = quantized_checkpoint("qwen3_moe")
    skip_unless_float32_runs(_reference(path, torch.float32))
    kw = dict(dtype=torch.float32, gpu_budget=0.25, loader=LoaderConfig(split_min_bytes=0))
    packed = _load(path, quant=QuantConfig(placement="packed"), **kw)
    decoded = _load(path, **kw)
    assert packed.mira.placement == "packed" and decoded.mira.placement == "dequant"
    with torch.no_grad():
        assert torch.equal(packed(IDS).logits, decoded(IDS).logits)
    assert calls and all(b == [128, 128] for b in calls)
    assert packed.mira.stats()["slots"] > decoded.mira.stats()["slots"]


def test_an_expert_stored_in_another_format_than_the_first_is_refused():
    """Records are planned from a layer's first expert; a later one in another dtype (which a copy would
    silently convert) is an error naming both."""
    from mira_hf.quant import CodecInputError, make_codec

    codec = make_codec("fp8_block", pieces={"down_proj": 1}, block_size=[128, 128])
    fp8 = {"down_proj": torch.zeros(128, 256, dtype=torch.float8_e4m3fn), "down_proj_scale_inv": torch.ones(1, 2)}
    layout = codec.plan_experts_from({"down_proj": ((128, 256), torch.bfloat16)}, 2, lambda e: fp8)
    record = torch.empty(layout.nbytes, dtype=torch.uint8)
    codec.encode(fp8, layout, record)
    with pytest.raises(CodecInputError, match="torch.bfloat16.*float8_e4m3fn"):
        codec.encode({**fp8, "down_proj": torch.zeros(128, 256, dtype=torch.bfloat16)}, layout, record)


def _dequantize_by_blocks(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Each element of an FP8 weight times the scale of its 128 x 128 block (the last blocks partial), in float32."""
    full = scales.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return weight.float() * full[: weight.shape[0], : weight.shape[1]]


def test_fp8_weights_whose_shape_is_not_a_multiple_of_the_block_use_the_checkpoint_blocks(tmp_path):
    """DeepSeek-V3 stores `kv_a_proj_with_mqa` as [kv_lora_rank + qk_rope_head_dim, hidden] = [576, 7168] with
    scales [5, 56]: its last row of 128 x 128 blocks is partial. Here [320, 256] with scales [3, 2] (not
    divisible: transformers' dequantize refuses it) loads with its own blocks, each weight its stored value times
    its block's scale; `kv_b_proj` [96, 312] with [1, 3] (divisible) keeps transformers' dequantization (104-wide
    blocks), as transformers' own load of the checkpoint has it; the fp32 logits equal transformers' on a
    checkpoint holding those dequantized weights."""
    import json
    import os

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    # whether transformers' float32 load of this family runs, asked of a checkpoint it loads (it refuses the one below)
    skip_unless_float32_runs(
        _reference(write_fp8_checkpoint("deepseek_v3", str(tmp_path / "divisible"), shards=1), torch.float32)
    )
    path = write_fp8_checkpoint("deepseek_v3", str(tmp_path / "fp8"), shards=1, kv_lora_rank=312)
    stored = load_file(os.path.join(path, "model.safetensors"))
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert stored[kv_a].shape == (320, 256) and stored[kv_a + "_scale_inv"].shape == (3, 2)

    def reference(k: str, t: torch.Tensor) -> torch.Tensor:
        s = stored.get(k + "_scale_inv")
        if s is None:
            return t.float()
        if t.shape[0] % s.shape[0] == 0 and t.shape[1] % s.shape[1] == 0:
            return dequantize_fp8(t, s, torch.float32)  # transformers dequantizes it: its rule is the reference
        return _dequantize_by_blocks(t, s)  # transformers refuses it: the checkpoint's own blocks

    dequantized = {k: reference(k, t) for k, t in stored.items() if not k.endswith("_scale_inv")}
    ref_dir = tmp_path / "dequantized"
    ref_dir.mkdir()
    save_file(dequantized, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    (ref_dir / "config.json").write_text(json.dumps(config))

    model = _load(path, dtype=torch.float32, gpu_budget=0.5)
    ref = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32).eval()
    weights = dict(model.named_parameters())
    for layer in range(3):
        for name in ("kv_a_proj_with_mqa", "kv_b_proj"):
            key = f"model.layers.{layer}.self_attn.{name}.weight"
            assert torch.equal(weights[key], dequantized[key])
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)


def experts_in_model_dtype(model):
    """`model` with its experts' tensors in the model's dtype. transformers 5.17-5.22 keep an MXFP4 checkpoint's
    dequantized experts in bf16 whatever dtype the model is loaded in (5.23 on dequantize into it); mira-hf decodes
    them into the model's dtype on every version (docs/RELIABILITY.md, known limits). Widening them is exact: every
    MXFP4 value is a bf16 value."""
    for name, p in model.named_parameters():
        if ".experts." in name and p.is_floating_point() and p.dtype != model.dtype:
            p.data = p.data.to(model.dtype)
    return model


def float32_runs(ref) -> bool:
    """Whether transformers' own float32 load of a pre-quantized checkpoint (`ref`) has its weights outside the experts
    in float32. transformers 5.22 leaves an FP8 checkpoint's unquantized weights (norms, embeddings, routers) in bf16
    beside float32 linears, and its model then fails in its first matmul; mira-hf loads those weights as transformers
    does, so there is nothing to compare."""
    return all(p.dtype == torch.float32 for n, p in ref.named_parameters() if ".experts." not in n)


def skip_unless_float32_runs(ref) -> None:
    if not float32_runs(ref):
        import transformers

        pytest.skip(f"transformers {transformers.__version__} loads this checkpoint in float32 with bf16 weights beside it")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_config_given_and_config_keywords_apply_as_in_transformers(quantized_checkpoint, family):
    """`config=` (an edited config object) and keywords naming config attributes (`num_experts_per_tok=1`) build
    the model transformers builds from the same arguments, for a checkpoint transformers dequantizes; the config
    object given is left as it was; `torch_dtype`, transformers' older name for `dtype`, sets the dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = quantized_checkpoint(family)
    config = AutoConfig.from_pretrained(path)
    config.num_experts_per_tok = 1
    before = config.to_dict()
    cases = [dict(config=config), dict(num_experts_per_tok=1, output_router_logits=True), dict(torch_dtype=torch.float32)]
    for kw in cases:
        ref = AutoModelForCausalLM.from_pretrained(path, **reference_kwargs(path), **kw).eval()
        if "torch_dtype" in kw and not float32_runs(ref):
            continue  # its float32 load cannot run in transformers itself (`float32_runs`)
        ref = experts_in_model_dtype(ref)
        model = MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", gpu_budget=0.5), progress=False, **kw).eval()
        assert (model.dtype, model.config.num_experts_per_tok) == (ref.dtype, ref.config.num_experts_per_tok)
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, ref(IDS).logits)
    assert config.to_dict() == before


@pytest.mark.parametrize("family,codec", CASES)
def test_a_cast_decodes_the_checkpoints_bytes_then_casts_as_transformers_load_cast_the_same_way(
    quantized_checkpoint, family, codec
):
    """The records hold the checkpoint's bytes, which no other values fill: a cast leaves them as they are, and each
    decode gives the dtype the model was loaded in, then casts through every dtype the model was cast to since. The
    model then holds and computes what transformers' load holds after the same casts, and a cast back to the
    loaded dtype decodes straight to it again."""
    path = quantized_checkpoint(family)
    ref, model = _reference(path), _load(path, gpu_budget=0.5)
    store = model.mira.store
    records, layout = store._slabs[0].data.clone(), store.layout(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float32):
        assert model.to(dtype) is model
        ref.to(dtype)
        assert model.dtype == dtype and store.dtype(0) == dtype and store.codec.name == codec
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, ref(IDS).logits)
        expected = ref.state_dict()
        assert all(t.dtype == expected[k].dtype and torch.equal(t, expected[k]) for k, t in model.state_dict().items())
        assert torch.equal(store._slabs[0].data, records)
        if dtype == torch.bfloat16:  # bf16 -> fp32 -> bf16 rounds nothing: decoded straight to bf16 again
            assert store.layout(0) == layout and not store.cast_in_place
    assert store.layout(0).chain == (torch.bfloat16, torch.float16, torch.float32)
    model.half()
    ref.half()
    assert torch.equal(model.generate(IDS[:1], **GREEDY), ref.generate(IDS[:1], **GREEDY))
    back = model.unload()
    expected = ref.state_dict()
    assert all(t.dtype == expected[k].dtype and torch.equal(t, expected[k]) for k, t in back.state_dict().items())


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_experts_in_the_checkpoints_own_bytes_refuse_other_values_and_say_how_to_change_them(quantized_checkpoint, family):
    """The records hold the checkpoint's quantized bytes and scales, which no other values fill: a
    `load_state_dict` of changed experts is refused before anything changes, naming the dequantized load that can;
    the model's own state dict loads back; an in-place edit names the dequantized load."""
    path = quantized_checkpoint(family)
    model = _load(path, gpu_budget=0.25)
    config = model.mira.store.codec.dequantized_config
    with torch.no_grad():
        expected = model(IDS).logits
    state = model.state_dict()
    assert not model.load_state_dict(state).missing_keys  # the values it holds: accepted, nothing to write
    name = next(k for k in state if k.endswith("experts.down_proj"))
    changed = {**state, name: state[name] * 2}
    with pytest.raises(RuntimeError, match=rf"quantization_config={re.escape(config)}"):
        model.load_state_dict(changed)
    with torch.no_grad():
        assert model.dtype == torch.bfloat16 and torch.equal(model(IDS).logits, expected)
        model.get_parameter(name).mul_(2)
        with pytest.raises(UnsupportedOperationError, match=rf"changed in place.*quantization_config={re.escape(config)}"):
            model(IDS)
