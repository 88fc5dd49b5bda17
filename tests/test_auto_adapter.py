"""Model types without an adapter: served through transformers' experts interface (`AutoAdapter`).

Every MoE family transformers builds with `@use_experts_implementation` has one fused experts module the
proxy can take the place of; only where it sits and how its router scores differ, and an adapter only
records that. So a family without one is found by the module itself, with a warning, and must compute
what the unwrapped model computes. Tiny configs are made by shrinking the family's own defaults; a family
that the installed transformers lacks is skipped (they arrive over 5.17 to 5.25).
"""

import warnings

import composite_models as composites
import pytest
import torch
from composite_models import COMPOSITES, qwen3_omni_thinker_config
from conftest import ALL_TINY, MULTIMODAL, align_experts
from safetensors.torch import load_file
from tiny_models import AUTO_FAMILIES as FAMILIES
from tiny_models import AUTO_SMALL as SMALL
from tiny_models import build, config_or_skip, make_auto_config, make_config
from transformers import AutoModelForCausalLM

from mira_hf import ConfigError, MiraConfig, MiraMoEModel, UnsupportedModelError
from mira_hf.checkpoint import auto_model_class
from mira_hf.config import LoaderConfig
from model_adapters import registered_model_types
from model_adapters.base import is_transformers_experts

IDS = torch.tensor([[5, 9, 17, 33, 42, 7, 64, 100, 3, 11]])


def tiny(model_type: str):
    config = config_or_skip(model_type)
    torch.manual_seed(0)
    return build(config).eval()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_unregistered_family_is_served_exactly_through_the_experts_interface(model_type, tmp_path):
    assert model_type not in registered_model_types(), "has an adapter now: move it to the adapter tests"
    tiny(model_type).save_pretrained(tmp_path)
    ref = auto_model_class(model_type).from_pretrained(tmp_path).eval()
    with pytest.warns(UserWarning, match=f"model_type '{model_type}' has no adapter; serving the \\d+ routed-experts"):
        model = MiraMoEModel.from_pretrained(tmp_path, MiraConfig(device="cpu", gpu_budget=0.5), progress=False)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        # use_cache=False: hybrid families (jamba, kimi_linear, bailing_hybrid) build no cache in a bare forward
        assert (model(IDS, use_cache=False).logits - ref(IDS, use_cache=False).logits).abs().max() <= 1e-5
        assert torch.equal(model.generate(IDS, **kw), ref.generate(IDS, **kw))
    assert model.mira.stats()["loads"] > 0  # the experts really were served from the store


@pytest.mark.filterwarnings("ignore:mira-hf. model_type")
@pytest.mark.parametrize("model_type", ALL_TINY + MULTIMODAL + FAMILIES)
def test_each_layers_top_k_is_the_number_of_experts_its_router_picks_per_token(model_type):
    # The top-k sizes every layer's smallest working set (the budget's slots), its prediction and its staging: it must
    # be what the router gives the experts, whatever the config calls it (Gemma 4's `top_k_experts`).
    model = MiraMoEModel.wrap(tiny(model_type), MiraConfig(device="cpu", gpu_budget=0.5))
    picked = {}
    model.mira.recorder = lambda layer, hidden, top_k_index: picked.setdefault(layer, top_k_index.shape[1])
    with torch.no_grad():
        model(IDS[:, :4])
    assert picked.keys() == model.mira.layers.keys()
    assert {layer: info.top_k for layer, info in model.mira.layers.items()} == picked


def test_unknown_model_type_without_experts_modules_is_refused_and_untouched():
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    model = AutoModelForCausalLM.from_config(cfg)
    model.config.model_type = "my_custom_moe"  # not in transformers: only the modules can tell
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match="'my_custom_moe'\\) has no mira-hf adapter, and none of its modules"):
        MiraMoEModel.wrap(model, MiraConfig(device="cpu"))
    assert not hasattr(model, "mira")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _refused_untouched(model, match: str) -> None:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match=match):
        MiraMoEModel.wrap(model, MiraConfig(device="cpu"))
    assert not hasattr(model, "mira")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_experts_class_whose_forward_computes_more_than_the_interface_is_refused_and_untouched():
    """An experts class built by transformers' decorator whose subclass replaces the interface's forward with one
    that computes more around it (Ergo's per-expert norms): serving its matmuls alone would change the outputs."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    class ScaledExperts(Qwen3MoeExperts):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 2 * super().forward(hidden_states, top_k_index, top_k_weights)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config("qwen3_moe")).eval()
    for layer in model.model.layers:
        scaled = ScaledExperts(model.config)
        scaled.load_state_dict(layer.mlp.experts.state_dict())
        layer.mlp.experts = scaled
    _refused_untouched(model, "ScaledExperts.forward\\) replaces that of transformers' experts interface")


def test_dbrx_experts_called_otherwise_than_transformers_calls_them_are_refused_and_untouched():
    """DBRX's original remote code (`trust_remote_code=True`) builds the same tensors as transformers' DBRX but calls its
    experts with the router's full probabilities as well (`forward(x, weights, top_weights, top_experts)`): the proxy,
    called as transformers calls the experts, would take the wrong arguments."""
    from transformers.models.dbrx.modeling_dbrx import DbrxExperts

    class RemoteExperts(DbrxExperts):
        def forward(self, x, weights, top_weights, top_experts):
            return super().forward(x, top_experts, top_weights)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config("dbrx")).eval()
    for block in model.transformer.blocks:
        block.ffn.experts.__class__ = RemoteExperts
    _refused_untouched(model, "its forward takes \\['x', 'weights', 'top_weights', 'top_experts'\\]")


# Inkling 2 Loop's checkpoints store their experts quantized in a format transformers dequantizes as it loads
# them (its own converter); mira-hf reads experts as stored, stacked, joined or interleaved, nothing else.
NOT_STREAMABLE: set[str] = set()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_unregistered_family_streams_its_experts_from_the_checkpoint(model_type, tmp_path):
    """Loaded expert by expert (the path for checkpoints larger than RAM): the auto adapter finds the
    experts modules both on the meta model and after the skeleton load, where their tensors are left out."""
    tiny(model_type).save_pretrained(tmp_path)
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=LoaderConfig(stream_experts=True))
    if model_type in NOT_STREAMABLE:
        with pytest.raises(UnsupportedModelError, match="cannot be read one at a time"):
            MiraMoEModel.from_pretrained(tmp_path, cfg, progress=False)
        return
    ref = auto_model_class(model_type).from_pretrained(tmp_path).eval()
    with pytest.warns(UserWarning, match="has no adapter"):
        model = MiraMoEModel.from_pretrained(tmp_path, cfg, progress=False)
    with torch.no_grad():
        assert (model(IDS, use_cache=False).logits - ref(IDS, use_cache=False).logits).abs().max() <= 1e-5


# Model types with a config of their own and no modeling code: transformers builds another family's model for them
# (Param2MoE's and Sarvam-MoE's are GLM-4.5's classes, Sarvam-MLA's DeepSeek-V3's).
REUSING = ["param2moe", "sarvam_mla", "sarvam_moe"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("model_type", REUSING)
def test_a_type_that_builds_another_familys_model_is_served_exactly(model_type, stream, tmp_path):
    model = tiny(model_type)
    assert type(model).__name__.lower().replace("forcausallm", "") not in model_type.replace("_", "")
    model.save_pretrained(tmp_path)
    ref = auto_model_class(model_type).from_pretrained(tmp_path).eval()
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=LoaderConfig(stream_experts=stream))
    with pytest.warns(UserWarning, match=f"model_type '{model_type}' has no adapter"):
        model = MiraMoEModel.from_pretrained(tmp_path, cfg, progress=False)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)
        assert torch.equal(model.generate(IDS, **kw), ref.generate(IDS, **kw))
    assert model.mira.stats()["loads"] > 0


def test_vision_language_model_experts_are_served_by_wrap():
    """A VLM (not an AutoModelForCausalLM: the user builds it with its own class) wrapped in place: the
    experts of its text decoder are found through transformers' experts interface and outputs stay exact."""
    import transformers

    if not hasattr(transformers, "Qwen3VLMoeForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no qwen3_vl_moe")
    from transformers import Qwen3VLMoeConfig

    text = {k: v for k, v in SMALL.items() if hasattr(Qwen3VLMoeConfig().text_config, k)}
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    model = transformers.Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        ref = model(input_ids=IDS).logits
        ref_tokens = model.generate(input_ids=IDS, max_new_tokens=4, do_sample=False)
    with pytest.warns(UserWarning, match="'qwen3_vl_moe' has no adapter; serving the 2 routed-experts modules"):
        MiraMoEModel.wrap(model, MiraConfig(device="cpu", gpu_budget=0.5))
    with torch.no_grad():
        assert (model(input_ids=IDS).logits - ref).abs().max() <= 1e-5
        assert torch.equal(model.generate(input_ids=IDS, max_new_tokens=4, do_sample=False), ref_tokens)
    assert model.mira.stats()["loads"] > 0


@pytest.mark.parametrize("stream", [False, True])
def test_vision_language_checkpoint_loads_with_from_pretrained(tmp_path, stream):
    """A VLM checkpoint has no causal-LM class: from_pretrained builds its image-text-to-text model (the
    text decoder holds the experts), whole or with the experts read one at a time from the checkpoint."""
    import transformers

    if not hasattr(transformers, "Qwen3VLMoeForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no qwen3_vl_moe")
    from transformers import AutoModelForImageTextToText, Qwen3VLMoeConfig

    text = {k: v for k, v in SMALL.items() if hasattr(Qwen3VLMoeConfig().text_config, k)}
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    cfg = Qwen3VLMoeConfig(text_config=text, vision_config=vision)
    transformers.Qwen3VLMoeForConditionalGeneration(cfg).save_pretrained(tmp_path)
    ref = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    mira_cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=LoaderConfig(stream_experts=stream))
    with pytest.warns(UserWarning, match="has no adapter"):
        model = MiraMoEModel.from_pretrained(tmp_path, mira_cfg, progress=False)
    assert type(model).__name__ == "Qwen3VLMoeForConditionalGeneration"
    with torch.no_grad():
        assert (model(input_ids=IDS).logits - ref(input_ids=IDS).logits).abs().max() <= 1e-5
    assert model.mira.stats()["loads"] > 0


def test_transposed_vision_language_checkpoint_streams(tmp_path):
    """Qwen3-VL-MoE checkpoints on the hub keep each expert as `[H, 2I]` and `[I, H]`, which transformers
    transposes as it loads them (where the shapes differ from the model's): read one expert at a time and
    transposed the same way, outputs are exact."""
    import transformers
    from safetensors.torch import save_file

    if not hasattr(transformers, "Qwen3VLMoeForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no qwen3_vl_moe")
    from transformers import AutoModelForImageTextToText, Qwen3VLMoeConfig

    text = {k: v for k, v in SMALL.items() if hasattr(Qwen3VLMoeConfig().text_config, k)}
    text["moe_intermediate_size"] = 48  # [2I, H] = [96, 64]: not its own transpose
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    transformers.Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(text_config=text, vision_config=vision)).save_pretrained(
        tmp_path
    )
    state = load_file(tmp_path / "model.safetensors")
    experts = [k for k in state if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
    assert experts
    save_file({k: t.transpose(1, 2).contiguous() if k in experts else t for k, t in state.items()},
              tmp_path / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    ref = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=LoaderConfig(stream_experts=True))
    with pytest.warns(UserWarning, match="has no adapter"):
        model = MiraMoEModel.from_pretrained(tmp_path, cfg, progress=False)
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, ref(input_ids=IDS).logits)
    assert model.mira.stats()["loads"] > 0


@pytest.mark.parametrize("name", sorted(COMPOSITES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_multimodal_checkpoint_streams_through_transformers_renaming(name, dtype, tmp_path):
    """Expert keys are found by renaming the checkpoint's keys as transformers does when it loads them, so
    checkpoints renamed by regular expressions, or whose one list of experts transformers deals out to several
    experts modules, stream too; loaded expert by expert, outputs and every expert tensor are exact, bit for bit
    in fp32 and bf16."""
    import transformers

    try:
        torch.manual_seed(0)
        model = COMPOSITES[name](transformers)
    except AttributeError as exc:
        pytest.skip(f"transformers {transformers.__version__} cannot build it here ({exc})")
    if not any(is_transformers_experts(m) for m in model.modules()):
        pytest.skip(f"transformers {transformers.__version__} builds its experts outside the experts interface")
    model.save_pretrained(tmp_path)
    ref = align_experts(type(model).from_pretrained(tmp_path, dtype=dtype).eval())
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=LoaderConfig(stream_experts=True))
    with pytest.warns(UserWarning, match="has no adapter"):
        streamed = MiraMoEModel.from_pretrained(tmp_path, cfg, progress=False, dtype=dtype)
    assert type(streamed).__name__ == type(model).__name__ and streamed.dtype == dtype
    with torch.no_grad():
        assert torch.equal(streamed(input_ids=IDS).logits, ref(input_ids=IDS).logits)
    assert streamed.mira.stats()["loads"] > 0
    got = streamed.state_dict()
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items() if ".experts." in k)  # text and vision experts


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_model_class_loads_the_whole_vision_language_model_of_a_checkpoint(stream, dtype, tmp_path):
    """A Qwen3.5-MoE checkpoint loads as its text decoder alone by default, as AutoModelForCausalLM loads it; with
    `model_class` (an auto class or the model class) it loads as that class does, the vision tower included, whole
    or expert by expert, with transformers' outputs and state dict, bit for bit."""
    import transformers

    if not hasattr(transformers, "Qwen3_5MoeForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no qwen3_5_moe")
    torch.manual_seed(0)
    composites.qwen3_5_moe(transformers).save_pretrained(tmp_path)
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=LoaderConfig(stream_experts=stream))
    with warnings.catch_warnings():  # (its text decoder has an adapter where the whole model has none)
        warnings.simplefilter("ignore")
        text_only = MiraMoEModel.from_pretrained(tmp_path, cfg, progress=False, dtype=dtype)
    text_ref = align_experts(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval())
    assert type(text_only) is type(text_ref)
    with torch.no_grad():
        assert torch.equal(text_only(input_ids=IDS).logits, text_ref(input_ids=IDS).logits)
    for cls in (transformers.AutoModelForImageTextToText, transformers.Qwen3_5MoeForConditionalGeneration):
        ref = align_experts(cls.from_pretrained(tmp_path, dtype=dtype).eval())
        with pytest.warns(UserWarning, match="has no adapter"):
            model = MiraMoEModel.from_pretrained(tmp_path, cfg, progress=False, dtype=dtype, model_class=cls)
        assert type(model) is transformers.Qwen3_5MoeForConditionalGeneration and model.dtype == dtype
        with torch.no_grad():
            assert torch.equal(model(input_ids=IDS).logits, ref(input_ids=IDS).logits)
        got, want = model.state_dict(), ref.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
        assert model.mira.stats()["loads"] > 0


@pytest.mark.parametrize(
    "model_class, match",
    [
        ("AutoModelForSeq2SeqLM", "AutoModelForSeq2SeqLM has no class for model_type 'qwen3_5_moe'"),
        ("MixtralForCausalLM", "MixtralForCausalLM builds MixtralConfig models; this checkpoint is model_type 'qwen3_5_moe'"),
        ("MixtralConfig", "is neither a transformers model class nor an auto class"),
    ],
)
def test_a_model_class_that_cannot_build_the_checkpoint_is_refused_before_loading(model_class, match, tmp_path):
    import transformers

    if not hasattr(transformers, "Qwen3_5MoeForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no qwen3_5_moe")
    torch.manual_seed(0)
    composites.qwen3_5_moe(transformers).save_pretrained(tmp_path)
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ConfigError, match=match):
        MiraMoEModel.from_pretrained(
            tmp_path, MiraConfig(device="cpu"), progress=False, model_class=getattr(transformers, model_class)
        )
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files


def test_experts_tied_across_two_stacks_are_served_exactly_stored_once_and_never_streamed(tmp_path):
    """Diffusion Gemma's encoder and decoder share their experts' tensors; the checkpoint stores them once, under
    the decoder. Wrapped or loaded whole, outputs are exact and the store holds one stack's experts, which one proxy
    per layer serves in both stacks; `save_pretrained` writes the files the unwrapped model writes, and `unload()`
    gives each stack its own modules back, still tied. The encoder's experts have no keys of their own, so streaming
    them is refused before anything is read when asked for, and loads whole when automatic."""
    import transformers

    if not hasattr(transformers, "DiffusionGemmaConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no diffusion_gemma")
    from transformers import AutoModelForImageTextToText, DiffusionGemmaConfig, Gemma4VisionConfig

    text = make_auto_config("diffusion_gemma_text").to_dict()
    text.update(num_experts=8, top_k_experts=2, moe_intermediate_size=32, enable_moe_block=True)
    vision = Gemma4VisionConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(DiffusionGemmaConfig(text_config=text, vision_config=vision)).save_pretrained(
        tmp_path / "ckpt"
    )
    ref = AutoModelForImageTextToText.from_pretrained(tmp_path / "ckpt").eval()

    def logits(model):  # its forward draws noise: the same draws for both
        torch.manual_seed(1)
        with torch.no_grad():
            return model(input_ids=IDS).logits

    expected = logits(ref)
    offload = tmp_path / "offload"
    streamed = MiraConfig(device="cpu", loader=LoaderConfig(stream_experts=True))
    with pytest.warns(UserWarning, match="has no adapter"), pytest.raises(UnsupportedModelError, match="one at a time"):
        MiraMoEModel.from_pretrained(tmp_path / "ckpt", streamed)
    for cfg in (MiraConfig(device="cpu", gpu_budget=0.5), MiraConfig(device="cpu", host_budget="1GB", offload_dir=str(offload))):
        with pytest.warns(UserWarning) as caught:
            model = MiraMoEModel.from_pretrained(tmp_path / "ckpt", cfg, progress=False)
        assert any("has no adapter" in str(w.message) for w in caught)
        whole = [w for w in caught if "cannot be read one at a time" in str(w.message)]
        assert len(whole) == (cfg.host_budget is not None)  # automatic streaming (a host budget) falls back
        assert torch.equal(logits(model), expected)
        assert model.mira.stats()["loads"] > 0
    decoder = [layer.experts for layer in ref.model.decoder.layers]
    encoder = [layer.experts for layer in ref.model.encoder.language_model.layers]
    assert all(e.down_proj is d.down_proj for e, d in zip(encoder, decoder))  # tied: the same tensors
    one_stack = sum(p.numel() * p.element_size() for m in decoder for p in m.parameters())
    ref.save_pretrained(tmp_path / "unwrapped")
    with pytest.warns(UserWarning, match="has no adapter"):
        MiraMoEModel.wrap(ref, MiraConfig(device="cpu", gpu_budget=0.5))
    assert (len(ref.mira.layers), ref.mira.store.nbytes) == (len(decoder), one_stack)
    assert torch.equal(logits(ref), expected)
    ref.save_pretrained(tmp_path / "wrapped")
    saved, unwrapped = (load_file(tmp_path / d / "model.safetensors") for d in ("wrapped", "unwrapped"))
    assert saved.keys() == unwrapped.keys() and all(torch.equal(saved[k], unwrapped[k]) for k in saved)
    ref.unload()
    assert [layer.experts for layer in ref.model.encoder.language_model.layers] == encoder
    assert all(e.down_proj is d.down_proj and e.gate_up_proj is d.gate_up_proj for e, d in zip(encoder, decoder))
    assert torch.equal(logits(ref), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_family_without_a_language_model_head_loads_as_the_class_its_config_names(stream, dtype, tmp_path):
    """OpenAI's privacy filter is an MoE token classifier: no causal-LM or image-text-to-text class. from_pretrained
    builds the class config.json names in `architectures`, as transformers' pipelines do; outputs are exact in
    every dtype (its own experts loop, which transformers runs it with, computes in fp32 throughout)."""
    import transformers

    config = config_or_skip("openai_privacy_filter")
    torch.manual_seed(0)
    transformers.AutoModelForTokenClassification.from_config(config).save_pretrained(tmp_path)
    ref = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path, dtype=dtype).eval()
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=LoaderConfig(stream_experts=stream))
    with pytest.warns(UserWarning, match="has no adapter"):
        model = MiraMoEModel.from_pretrained(tmp_path, cfg, progress=False, dtype=dtype)
    assert type(model) is type(ref) and model.dtype == dtype
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)
    assert model.mira.stats()["loads"] > 0


def test_a_family_without_a_class_for_its_checkpoint_is_refused_before_loading(tmp_path):
    """A model type transformers knows, with no causal-LM or image-text-to-text class and no `architectures` in
    config.json to build instead: refused before any weight is read, naming what to do."""
    import json

    import transformers

    config = config_or_skip("openai_privacy_filter")
    torch.manual_seed(0)
    transformers.AutoModelForTokenClassification.from_config(config).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("architectures")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    with pytest.raises(UnsupportedModelError, match="no causal-LM or image-text-to-text class.*MiraMoEModel.wrap"):
        MiraMoEModel.from_pretrained(tmp_path, MiraConfig(device="cpu"), progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before


def test_a_composite_model_built_from_another_familys_decoder_is_wrapped_exactly():
    """Kimi K2.5's own modeling code builds no experts module: its text decoder is DeepSeek-V3's. The check made
    before any weight is read looks at the config's parts too (config.json's `text_config`), so it is served, and
    wrapped in place it computes what it computes unwrapped."""
    import copy

    import transformers

    from mira_hf.targets import sub_model_types

    try:
        torch.manual_seed(0)
        ref = COMPOSITES["kimi_k25"](transformers).eval()
    except AttributeError as exc:
        pytest.skip(f"transformers {transformers.__version__} cannot build it here ({exc})")
    assert "deepseek_v3" in sub_model_types(ref.config) and "deepseek_v3" in sub_model_types(ref.config.to_dict())
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match="'kimi_k25' has no adapter"):
        MiraMoEModel.wrap(model, MiraConfig(device="cpu", gpu_budget=0.5))
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, ref(input_ids=IDS).logits)
    assert model.mira.stats()["loads"] > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_qwen3_omni_loads_as_its_own_class_with_the_thinkers_and_the_talkers_experts(stream, tmp_path):
    """A whole Qwen3-Omni checkpoint (thinker and talker, both MoE) has no causal-LM or image-text-to-text class:
    it loads as the class config.json names, and the experts of both its thinker and its talker are served. Text
    generation is token-identical to transformers'."""
    import transformers

    try:
        thinker = qwen3_omni_thinker_config(transformers)
        talker_text = {k: v for k, v in SMALL.items() if hasattr(transformers.Qwen3OmniMoeTalkerTextConfig(), k)}
    except AttributeError as exc:
        pytest.skip(f"transformers {transformers.__version__} cannot build it here ({exc})")
    talker_text.update(shared_expert_intermediate_size=32,
                       rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]))  # fmt: skip
    predictor = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_code_groups=4)  # fmt: skip
    talker = dict(text_config=talker_text, code_predictor_config=predictor, num_code_groups=4, thinker_hidden_size=64,
                  accept_hidden_layer=1, spatial_merge_size=2)  # fmt: skip
    code2wav = dict(codebook_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                    intermediate_size=64, num_quantizers=4, decoder_dim=32)  # fmt: skip
    config = transformers.Qwen3OmniMoeConfig(thinker_config=thinker, talker_config=talker, code2wav_config=code2wav)
    torch.manual_seed(0)
    transformers.Qwen3OmniMoeForConditionalGeneration(config).save_pretrained(tmp_path)
    ref = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(tmp_path).eval()
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=LoaderConfig(stream_experts=stream))
    with pytest.warns(UserWarning, match="has no adapter"):
        model = MiraMoEModel.from_pretrained(tmp_path, cfg, progress=False)
    assert type(model) is type(ref)
    assert {t.name.split(".")[0] for t in model._mira_targets} == {"thinker", "talker"}
    kw = dict(max_new_tokens=6, do_sample=False, return_audio=False)
    with torch.no_grad():
        assert torch.equal(model.generate(input_ids=IDS, **kw), ref.generate(input_ids=IDS, **kw))
    assert model.mira.stats()["loads"] > 0


# Routers whose choice is more than the top-k of one linear map's softmax: group-limited (DeepSeek-V3's and GLM-4.5's
# groups ranked by their two best scores, DeepSeek-V2's group-limited greedy by their best), a selection bias kept on
# the block (MiniMax-M2, AFMoE), a scoring function of the router's own (DeepSeek-V4's sqrt-softplus); and routers
# whose linear map is a module inside them (HunYuan's `gate.wg`, AFMoE's `router.gate`).
ROUTERS = {
    "deepseek_v3": dict(n_group=4, topk_group=2),
    "deepseek_v2": dict(n_group=4, topk_group=2, topk_method="group_limited_greedy"),
    "glm4_moe": dict(n_group=4, topk_group=2),
    "minimax_m2": {},
    "deepseek_v4": dict(mlp_layer_types=["moe", "moe"]),
    "afmoe": {},
    "hunyuan_v1_moe": {},
}


@pytest.mark.filterwarnings("ignore:mira-hf. model_type")
@pytest.mark.parametrize("model_type", sorted(ROUTERS))
def test_the_router_a_predictor_applies_chooses_what_the_model_routes(model_type):
    """Router lookahead applies each layer's router to earlier hidden states. Applied to the layer's own rows, with
    trained-looking selection biases, it must rank first the experts the model's router chooses for each token."""
    config = config_or_skip(model_type, **ROUTERS[model_type])
    torch.manual_seed(0)
    model = build(config).eval()
    with torch.no_grad():
        for name, bias in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                bias.normal_(0.0, 0.05)
    MiraMoEModel.wrap(model, MiraConfig(device="cpu", gpu_budget=0.5))
    routed = []
    model.mira.recorder = lambda layer, hidden, top_k_index: routed.append((layer, hidden.clone(), top_k_index.clone()))
    with torch.no_grad():
        model(torch.randint(3, 120, (1, 24), generator=torch.Generator().manual_seed(1)))
    assert routed
    for layer, hidden, chosen in routed:
        router = model.mira.router_probs.linear(layer)
        assert router is not None, layer
        ranked = router.probs(hidden).topk(chosen.shape[1], dim=-1).indices
        assert [set(r) for r in ranked.tolist()] == [set(c) for c in chosen.tolist()], layer


def test_a_router_that_looks_experts_up_by_token_is_not_used_to_predict():
    """DeepSeek-V4's first layers route by a table of token ids (hash routing): no hidden state predicts them, so the
    predictor applies no router there; served exactly."""
    config = config_or_skip("deepseek_v4", mlp_layer_types=["hash_moe", "moe"])
    torch.manual_seed(0)
    model = build(config).eval()
    with torch.no_grad():
        ref = model(IDS).logits
    with pytest.warns(UserWarning, match="has no adapter"):
        MiraMoEModel.wrap(model, MiraConfig(device="cpu", gpu_budget=0.5))
    assert [model.mira.router_probs.linear(layer) is None for layer in sorted(model.mira.layers)] == [True, False]
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref)


@pytest.mark.filterwarnings("ignore:mira-hf. model_type")
def test_a_family_whose_router_is_no_linear_map_is_predicted_once_calibrated():
    """Gemma 4's router normalises and scales its input before its linear map: the gate has no router to apply on any
    layer. `calibrate` trains the learned predictor on the model's own hidden states, which needs none; the outputs
    stay the unwrapped model's."""
    from mira_hf.calibrate import calibrate
    from mira_hf.learned import LearnedPredictor

    ref = tiny("gemma4_text")
    with torch.no_grad():
        expected = ref(IDS).logits
    model = MiraMoEModel.wrap(ref, MiraConfig(device="cpu", gpu_budget=0.5))
    assert all(model.mira.router_probs.linear(layer) is None for layer in model.mira.layers)
    data = torch.randint(3, 120, (4, 64), generator=torch.Generator().manual_seed(0))
    calibrate(model, data, epochs=2, progress=False)
    assert isinstance(model.mira.predictor, LearnedPredictor)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected)


def test_router_reading_a_wider_state_than_its_experts_is_not_used_to_predict():
    """Muse Spark's router reads the hidden state; its experts take it projected down (moe_hidden_size). The
    predictor must not apply that router to the experts' rows: served exactly, with the default predictor."""
    import transformers

    if not hasattr(transformers, "MuseSparkForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no muse_spark")
    from transformers import MuseSparkConfig

    text = {k: v for k, v in SMALL.items() if k in MuseSparkConfig().text_config.to_dict()}
    config = MuseSparkConfig(
        text_config=dict(text, sliding_window=16, moe_hidden_size=32),
        vision_config=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2),
        audio_config=dict(hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1], out_hidden_size=64),
        image_token_id=120, video_token_id=121, audio_token_id=122, out_hidden_size=64, projector_hidden_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MuseSparkForConditionalGeneration(config).eval()
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref, ref_tokens = model(input_ids=IDS).logits, model.generate(input_ids=IDS, **kw)
    with pytest.warns(UserWarning, match="has no adapter"):
        MiraMoEModel.wrap(model, MiraConfig(device="cpu", gpu_budget=0.5))
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, ref)
        assert torch.equal(model.generate(input_ids=IDS, **kw), ref_tokens)
    assert model.mira.stats()["loads"] > 0


def test_composite_checkpoint_streams_into_its_text_only_causal_lm(tmp_path):
    """A dots.3 note checkpoint (text, vision, audio) loads as `Dots3NoteForCausalLM`, as AutoModelForCausalLM
    builds it: the text decoder of the composite config. Streamed expert by expert, exact."""
    import transformers

    if not hasattr(transformers, "Dots3NoteForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no dots3_note")
    from transformers import Dots3NoteConfig

    text = make_auto_config("dots3_note_text").to_dict()
    config = Dots3NoteConfig(
        text_config=text,
        vision_config=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                           adapter_in_dim=32, adapter_out_dim=64, mlp_layer_types=["dense"]),
        audio_config=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                          adapter_input_size=32, adapter_out_dim=64, downsample_hidden_size=16, feature_size=16),
        image_token_id=120, video_token_id=121, audio_token_id=122,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Dots3NoteForConditionalGeneration(config).save_pretrained(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=LoaderConfig(stream_experts=True))
    with pytest.warns(UserWarning, match="has no adapter"):
        model = MiraMoEModel.from_pretrained(tmp_path, cfg, progress=False)
    assert type(model).__name__ == type(ref).__name__ == "Dots3NoteForCausalLM"
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)
        assert torch.equal(model.generate(IDS, **kw), ref.generate(IDS, **kw))
    assert model.mira.stats()["loads"] > 0
