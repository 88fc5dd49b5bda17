"""Tiny composite models (vision-language, omni) of families served without an adapter, for the tests and the GPU
exactness run (`benchmarks/gpu_reliability.py`). `COMPOSITES`: name -> a function that builds a random model from the
transformers module (the caller seeds torch first); it raises `AttributeError` where that transformers lacks the
family."""

from tiny_models import AUTO_SMALL as SMALL
from tiny_models import make_auto_config, make_config

from mira_hf.testing import _has


def aria(transformers):
    """Aria: its checkpoints keep the text decoder under `language_model.model.`, which transformers renames
    with a regular expression."""
    return transformers.AriaForConditionalGeneration(
        transformers.AriaConfig(
            text_config=make_auto_config("aria_text").to_dict(),
            vision_config=dict(model_type="idefics3_vision", num_hidden_layers=1, hidden_size=32,
                               intermediate_size=64, num_attention_heads=2),
            image_token_index=120, projector_patch_to_query_dict={49: 8},
        )
    )  # fmt: skip


def qwen3_omni_thinker_config(transformers):
    config = transformers.Qwen3OmniMoeThinkerConfig
    text = {k: v for k, v in SMALL.items() if hasattr(config.sub_configs["text_config"](), k)}
    text["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])
    return config(
        text_config=text,
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           deepstack_visual_indexes=[0], num_position_embeddings=64),
        audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                          output_dim=64, downsample_hidden_size=16, num_mel_bins=16),
        image_token_id=120, video_token_id=121, audio_token_id=122, vision_start_token_id=123, audio_start_token_id=124,
    )  # fmt: skip


def qwen3_omni_thinker(transformers):
    """Qwen3-Omni's thinker: the sparse block's own weight init reaches its experts' tensors."""
    return transformers.Qwen3OmniMoeThinkerForConditionalGeneration(qwen3_omni_thinker_config(transformers))


def ernie_vl(transformers):
    """ERNIE-4.5-VL: each layer's checkpoint keeps one list of experts, the text experts then the vision experts
    (`mlp.experts.{0..2E-1}`), which transformers deals out to two experts modules as it loads them."""
    config = transformers.Ernie4_5_VLMoeConfig
    text = {k: v for k, v in SMALL.items() if hasattr(config.sub_configs["text_config"](), k)}
    text.update(
        moe_intermediate_size=[32, 32],
        head_dim=32,
        rope_parameters=dict(rope_type="default", rope_theta=500000.0, mrope_section=[4, 4, 8]),
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2)
    return transformers.Ernie4_5_VLMoeForConditionalGeneration(config(text_config=text, vision_config=vision))  # fmt: skip


def glm4v_moe(transformers):
    """GLM-4.5V: a vision-language model whose checkpoints keep each expert's projections apart."""
    config = transformers.Glm4vMoeConfig
    text = {k: v for k, v in SMALL.items() if hasattr(config.sub_configs["text_config"](), k)}
    text["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[2, 1, 1])
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    return transformers.Glm4vMoeForConditionalGeneration(config(text_config=text, vision_config=vision))


def mistral_large4(transformers):
    """Mistral Large 4: MLA attention and a Pixtral vision encoder beside its text decoder."""
    text = dict(make_auto_config("mistral_large4_text").to_dict(), num_key_value_heads=4)
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                              head_dim=16)  # fmt: skip
    config = transformers.MistralLarge4Config(text_config=text, vision_config=vision)
    return transformers.MistralLarge4ForConditionalGeneration(config)


def muse_spark(transformers):
    """Muse Spark: vision and audio encoders beside a MoE text decoder, each encoder validated against the decoder's
    width (the audio one stage by stage)."""
    text = make_auto_config("muse_spark_text").to_dict()
    vision = dict(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, layer_types=["full_attention"]
    )
    audio = dict(hidden_sizes=[16] * 4, depths=[1] * 4, out_hidden_size=text["hidden_size"])
    config = transformers.MuseSparkConfig(text_config=text, vision_config=vision, audio_config=audio)
    return transformers.MuseSparkForConditionalGeneration(config)


def kimi_k25(transformers):
    """Kimi K2.5: a vision-language model whose text decoder is DeepSeek-V3's, built from another family's code (its
    own modeling file builds no experts)."""
    vision = dict(num_attention_heads=2, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    config = transformers.Kimi_K25Config(text_config=make_config("deepseek_v3").to_dict(), vision_config=vision)
    return transformers.Kimi_K25ForConditionalGeneration(config)


def llava_mixtral(transformers):
    """A LLaVA model around a Mixtral decoder: a generic vision-language class whose own code builds no experts."""
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32)  # fmt: skip
    config = transformers.LlavaConfig(text_config=make_config("mixtral").to_dict(), vision_config=vision, image_token_id=120)
    return transformers.LlavaForConditionalGeneration(config)


def qwen3_5_moe(transformers):
    """Qwen3.5-MoE: a vision-language checkpoint whose causal-LM class is its text decoder alone (what
    AutoModelForCausalLM loads); its hybrid attention as Qwen3-Next's."""
    config = transformers.Qwen3_5MoeConfig
    text = {k: v for k, v in SMALL.items() if hasattr(config.sub_configs["text_config"](), k)}
    text.update(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4, linear_num_key_heads=2,
                linear_key_head_dim=16, linear_value_head_dim=16,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                     mrope_section=[1, 1, 0]))  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    return transformers.Qwen3_5MoeForConditionalGeneration(config(text_config=text, vision_config=vision))


def deepseek_ocr2(transformers):
    """DeepSeek-OCR-2: a DeepSeek-V2-style MoE text decoder with plain attention (here a dense first layer, then a
    sparse one) behind a SAM encoder and a second vision encoder, nested configs `shrunk` would leave at full size."""
    if "deepseek_ocr2" not in transformers.CONFIG_MAPPING:
        raise AttributeError("no deepseek_ocr2")
    config = transformers.CONFIG_MAPPING["deepseek_ocr2"]
    text = dict(make_auto_config("deepseek_ocr2_text").to_dict(), mlp_layer_types=["dense", "sparse"])
    sam = dict(
        hidden_size=32,
        output_channels=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=64,
        patch_size=16,
        window_size=2,
        global_attn_indexes=[1],
        mlp_dim=64,
        downsample_channels=[16, 32],
    )
    encoder = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=128
    )
    return transformers.AutoModelForImageTextToText.from_config(
        config(text_config=text, vision_config=dict(sam_config=sam, encoder_config=encoder))
    )


# A composite of another family: its text decoder as `make_auto_config` shrinks it, then `text`; every other sub-model
# shrunk to one small layer (`VISION_SMALL`, the keys its config has); then `fix` on the arguments.
VISION_SMALL = dict(depth=1, num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=16, out_hidden_size=64, embed_dim=32)  # fmt: skip


try:  # what a config's validators raise (huggingface_hub's strict dataclasses)
    from huggingface_hub.errors import StrictDataclassError as _ConfigRefused
except ImportError:
    _ConfigRefused = ValueError


def shrunk(model_type: str, text: dict | None = None, fix=None):
    """A builder of a tiny random model of composite `model_type`, as `auto_model_class` loads its checkpoints."""

    def build_it(transformers):
        from mira_hf.checkpoint import auto_model_class

        if model_type not in transformers.CONFIG_MAPPING:
            raise AttributeError(f"no {model_type}")
        cls = transformers.CONFIG_MAPPING[model_type]
        try:
            kwargs = {}
            for name, sub in cls.sub_configs.items():
                if name == "text_config":
                    kwargs[name] = make_auto_config(sub.model_type, **(text or {})).to_dict()
                else:
                    defaults = sub()
                    kwargs[name] = sub(**{k: v for k, v in VISION_SMALL.items() if _has(defaults, k)}).to_dict()
            if fix is not None:
                fix(kwargs)
            config = cls(**kwargs)
        except (ValueError, _ConfigRefused) as exc:  # an older release of the family, whose config takes other options
            raise AttributeError(f"{model_type} with other options ({exc})") from exc
        try:
            return auto_model_class(model_type).from_config(config)
        except ImportError as exc:  # a package the family's own modeling code needs (Inkling's audio: scipy)
            raise AttributeError(f"{model_type} without {exc.name or exc}") from exc

    return build_it


def _text_width_for_vision(kwargs):
    kwargs["vision_config"]["text_hidden_size"] = kwargs["text_config"]["hidden_size"]


def _no_audio(kwargs):
    kwargs["audio_config"] = None


COMPOSITES = {
    "aria": aria,
    "qwen3_omni_thinker": qwen3_omni_thinker,
    "ernie_vl": ernie_vl,
    "glm4v_moe": glm4v_moe,
    "mistral_large4": mistral_large4,
    "kimi_k25": kimi_k25,
    "muse_spark": muse_spark,
    "llava_mixtral": llava_mixtral,
    "deepseek_ocr2": deepseek_ocr2,
    "gemma4": shrunk("gemma4", fix=_no_audio),  # a dense MLP beside the routed experts in every layer
    "qwen3_vl_moe": shrunk("qwen3_vl_moe"),
    "minimax_m3_vl": shrunk("minimax_m3_vl"),
    "qwen4_exp": shrunk("qwen4_exp"),
    "unlimited_ocr": shrunk("unlimited_ocr"),
    "inkling": shrunk("inkling_mm_model"),
    "inkling2": shrunk("inkling2", fix=_text_width_for_vision),
    "hy_v4_vl": shrunk("hy_v4_vl", text=dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1]))),
    # GLM-5-Next: linear attention and indexed (DSA, no rotary part) attention layers
    "glm5_next": shrunk("glm5_next", text=dict(
        num_key_value_heads=4, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16, head_dim=0, qk_head_dim=16,
        layer_types=["linear_attention", "indexed_attention"], mlp_layer_types=["dense", "sparse"],
        indexer_types=["full", "full"], index_topk=8, index_head_dim=16, index_n_heads=2, index_kpool=4,
        linear_head_dim=16,
    )),
}  # fmt: skip
