"""Tiny random MoE models of every adapter family, built from config objects (CPU, no hub access).

The one table of tiny configs that the tests (`tests/`), the benchmarks' CPU `--smoke` runs and the GPU checks
build from; it ships with the package so a new adapter can be checked the same way:

    from mira_hf.testing import make_config
    model = AutoModelForCausalLM.from_config(make_config("mixtral"))

Also the generate stopping criterion the reliability checks interrupt `generate` with, and a forward step that
carries a KV cache under either of the names transformers 5.x gives it.
"""

from __future__ import annotations

import inspect

import torch
import transformers

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# adapter family name -> (config class name, kwargs). One per registered adapter family.
RECIPES = {
    "mixtral": (
        "MixtralConfig",
        dict(BASE, num_hidden_layers=2, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, head_dim=16),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            BASE,
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=32,
            norm_topk_prob=False,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            BASE,
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            head_dim=16,
            norm_topk_prob=True,
        ),
    ),
    # MLA: key/value heads must equal the heads; do not pass head_dim.
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            BASE,
            num_key_value_heads=4,
            num_hidden_layers=3,
            intermediate_size=64,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        ),
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(
            BASE,
            num_key_value_heads=4,
            num_hidden_layers=3,
            intermediate_size=64,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        dict(
            BASE,
            num_hidden_layers=2,
            intermediate_size=64,
            num_local_experts=8,
            num_experts_per_tok=2,
            head_dim=16,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "olmoe": ("OlmoeConfig", dict(BASE, num_hidden_layers=2, intermediate_size=64, num_experts=8, num_experts_per_tok=2)),
    "phimoe": ("PhimoeConfig", dict(BASE, num_hidden_layers=2, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2)),
    "granitemoe": (
        "GraniteMoeConfig",
        dict(BASE, num_hidden_layers=2, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2),
    ),
    # Llama 4 scales each expert's input by its routing weight and runs every expert on every token.
    "llama4": (
        "Llama4TextConfig",
        dict(
            BASE,
            num_hidden_layers=2,
            intermediate_size=64,
            intermediate_size_mlp=64,
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            interleave_moe_layer_step=1,
        ),
    ),
    # Ergo: a learned RMSNorm per expert on each route's output (MoEAdapter.route_norm); local and global layers
    "ergo": (
        "ErgoConfig",
        dict(
            BASE,
            num_hidden_layers=3,
            first_dense_intermediate_size=64,
            num_dense_blocks=1,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            shared_intermediate_size=32,
            sliding_window=16,
            global_attention_every_n_layers=3,
        ),
    ),
    # DBRX: experts outside transformers' experts interface, `mlp.w1/v1/w2` as [E * I, H] (SeparateGluExperts)
    "dbrx": (
        "DbrxConfig",
        dict(
            vocab_size=128,
            d_model=64,
            n_heads=4,
            n_layers=2,
            max_seq_len=256,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
            ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2),
        ),
    ),
    # JetMoE: a sparse block that routes and combines itself (RoutedBlockExperts); attention heads as experts (MoA)
    "jetmoe": (
        "JetMoeConfig",
        dict(
            BASE,
            num_hidden_layers=2,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            kv_channels=16,
            num_key_value_heads=2,
        ),
    ),
}

# GLM-4.5's and dots.llm1's decoders: DeepSeek-V3's routing (one expert group) and a dense first layer, plain attention.
DENSE_FIRST_GROUPED = dict(
    BASE,
    num_hidden_layers=3,
    intermediate_size=64,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    head_dim=16,
)

# Further model types served by a registered adapter, checked too.
EXTRA_RECIPES = {
    "glm4_moe": ("Glm4MoeConfig", DENSE_FIRST_GROUPED),
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(
            BASE,
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=32,
            head_dim=16,
            layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        ),
    ),
    "dots1": ("Dots1Config", DENSE_FIRST_GROUPED),
    "flex_olmo": ("FlexOlmoConfig", RECIPES["olmoe"][1]),  # OLMoE's decoder (its experts trained apart)
    "granitemoeshared": ("GraniteMoeSharedConfig", dict(RECIPES["granitemoe"][1], shared_intermediate_size=32)),  # + shared
    # Hybrid families: a linear-attention (or Mamba) layer and a full-attention one.
    "minimax": (  # Mixtral's sparse block beside lightning attention
        "MiniMaxConfig",
        dict(RECIPES["mixtral"][1], layer_types=["linear_attention", "full_attention"], block_size=16),
    ),
    "granitemoehybrid": (  # GraniteMoeShared's block beside Mamba layers
        "GraniteMoeHybridConfig",
        dict(
            RECIPES["granitemoe"][1],
            shared_intermediate_size=32,
            layer_types=["mamba", "attention"],
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=16,
        ),
    ),
}


# Vision-language families served by a registered adapter that have no causal-LM class (their image-text-to-text
# model is built, which the causal-LM tests over RECIPES cannot): checked by tests/test_multimodal_families.py.
MULTIMODAL_RECIPES = {
    "step3p7": (
        "Step3p7Config",
        dict(
            text_config=dict(
                BASE, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=32, head_dim=16,
                num_local_experts=8, num_experts_per_tok=2, share_expert_dim=32, num_sliding_attention_heads=4,
                query_pre_attn_scalar=16, sliding_window=16, mlp_layer_types=["dense", "sparse"],
                swiglu_limits=[0.0, 0.05],  # the sparse layer's routed experts clamped (their own gate function)
            ),
            vision_config=dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2),
            image_token_id=120,
        ),
    ),
}  # fmt: skip

# Encoder-decoder families served by a registered adapter (their sequence-to-sequence model is built, which the
# causal-LM tests over RECIPES cannot): checked by tests/test_seq2seq_families.py. Sparse layers in the encoder and
# the decoder; an expert capacity of 3 tokens, so that a prompt's tokens over it skip the experts.
SEQ2SEQ_RECIPES = {
    "switch_transformers": (
        "SwitchTransformersConfig",
        dict(
            vocab_size=128, d_model=64, d_kv=16, d_ff=64, num_heads=4, num_layers=4, num_decoder_layers=4,
            num_experts=8, expert_capacity=3, encoder_sparse_step=2, decoder_sparse_step=2, pad_token_id=0,
            eos_token_id=2, decoder_start_token_id=0,
        ),
    ),
}  # fmt: skip

# Families without an adapter (as of this file) whose shrunken defaults build MoE layers on the CPU; each one's
# causal-LM model type (a multimodal family's text decoder).
AUTO_FAMILIES = [
    "afmoe", "aria_text", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "deepseek_v32", "deepseek_v4",
    "dots3_note_text", "ernie4_5_moe", "exaone_moe", "flint", "gemma4_text", "glm4_moe_lite", "glm_moe_dsa",
    "granitemoe_swa", "hunyuan_v1_moe", "hy_v3", "hy_v4", "inkling2_loop_text", "inkling2_text", "inkling_text",
    "jamba", "kimi_linear", "kolibri1", "kolibri1_1", "laguna", "lara_mini", "lfm2_moe", "longcat_flash", "mellum",
    "mimo_v2_flash", "minicpm5_moe", "minimax_m2", "minimax_m3_vl_text", "mistral4", "nemotron_h", "qwen4_exp_text",
    "solar_open", "zaya",
]  # fmt: skip
# Per-family fixes to the shrunken defaults, passed as given (not only where the defaults have the attribute).
# MLA attention needs as many KV heads as heads; ZAYA routes top-1.
AUTO_OVERRIDES = {t: dict(num_key_value_heads=4) for t in ("axk2", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "mistral4")}
AUTO_OVERRIDES["zaya"] = dict(num_experts_per_tok=1)
# Hybrid families: one full-attention layer, or transformers' generate finds no layer to measure its cache by.
HYBRID = dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["sparse", "sparse"])
INKLING2 = dict(
    unpadded_vocab_size=128, layer_types=["hybrid_sliding", "hybrid"], swa_num_attention_heads=4,
    swa_num_key_value_heads=2, swa_head_dim=16, d_rel=4, rel_extent=8, n_layers_per_attn_res_block=1,
    sliding_window_size=8,
)  # fmt: skip
AUTO_OVERRIDES.update(
    jamba=dict(attn_layer_period=2, attn_layer_offset=1),
    kimi_linear=dict(HYBRID, num_key_value_heads=4),  # its full-attention layers are MLA
    bailing_hybrid=dict(HYBRID, num_key_value_heads=4),
    # Families whose defaults keep every layer of a two-layer model dense: one dense, one sparse.
    beam=dict(mlp_layer_types=["dense", "sparse"]),
    flint=dict(mlp_only_layers=[0]),
    lfm2_moe=dict(num_dense_layers=1, layer_types=["conv", "full_attention"]),
    gemma4_text=dict(
        enable_moe_block=True, top_k_experts=2, vocab_size_per_layer_input=128, hidden_size_per_layer_input=16,
        layer_types=["sliding_attention", "full_attention"], num_global_key_value_heads=2, global_head_dim=16,
    ),
    # Per-layer attention configs: the sliding layers' own (MLA) sizes come as swa_* arguments.
    dots3_note_text=dict(
        mlp_layer_types=["dense", "sparse"], layer_types=["indexed_attention", "sliding_attention"], index_topk=4,
        index_head_dim=16, index_n_heads=2, num_key_value_heads=4, shared_experts_intermediate_size=32,
        swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=16, swa_kv_lora_rank=16,
        swa_head_dim=16, swa_qk_nope_head_dim=8, swa_v_head_dim=16,
    ),
    inkling2_text=INKLING2,
    inkling2_loop_text=dict(
        INKLING2, num_hidden_layers=3, layer_types=["hybrid_sliding", "hybrid", "hybrid"], loop_layer_index_start=1,
        loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=8,
    ),
    axk1=dict(num_key_value_heads=4, head_dim=8),  # MLA; its rotary width is head_dim
    longcat_flash=dict(num_key_value_heads=4, head_dim=8),
    kolibri1_1=dict(
        index_num_heads=1, index_topk=8, index_pool_size=16, index_compression=2, index_num_local_tokens=4,
        index_num_sink_tokens=1, mlp_only_intermediate_size=64, mlp_only_layers=[0],
    ),
    qwen4_exp_text=dict(
        layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, hc_lowrank=8, ple_embed_dim=64, ngram_vocab_size_base=512,
        split_ngram_parts=4, heads_per_ngram=2, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
        indexer_budget=8, indexer_compress_ratio=4,
    ),
)  # fmt: skip
AUTO_SMALL = dict(
    vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, num_local_experts=8,
    num_experts=8, n_routed_experts=8, moe_num_experts=8, num_experts_per_tok=2, moe_k=2, top_k=2,
    shared_expert_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16,
    q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, pad_token_id=0, bos_token_id=1,
    eos_token_id=2,
)  # fmt: skip


def _has(config, key: str) -> bool:
    """Whether `config` has attribute `key`. A per-layer attribute of a heterogeneous config (whose global read
    raises) counts: it exists, and setting it sets every layer's."""
    try:
        return hasattr(config, key)
    except Exception:
        return True


def make_auto_config(model_type: str, **overrides):
    """A tiny config of a family without an adapter: its own defaults shrunk, then `overrides` (None if transformers
    lacks it, or builds its experts outside its experts interface, as LongCat-Flash's before transformers 5.25)."""
    from model_adapters.base import uses_experts_interface

    if model_type not in transformers.CONFIG_MAPPING or uses_experts_interface(model_type) is False:
        return None
    cls = transformers.CONFIG_MAPPING[model_type]
    defaults = cls()
    small = {k: v for k, v in AUTO_SMALL.items() if _has(defaults, k)}
    return cls(**{**small, **AUTO_OVERRIDES.get(model_type, {}), **overrides})


# Every family with an adapter: name -> (config class name, kwargs).
ALL_RECIPES = {**RECIPES, **EXTRA_RECIPES, **MULTIMODAL_RECIPES, **SEQ2SEQ_RECIPES}


def make_config(name: str, **overrides):
    """The tiny config of `name` (a key of `ALL_RECIPES`), with `overrides` on top of its recipe."""
    cls_name, kwargs = ALL_RECIPES[name]
    return getattr(transformers, cls_name)(**{**kwargs, **overrides})


def tiny_config(name: str, **overrides):
    """The tiny config of any served family: its recipe (`make_config`), or for a family without an adapter
    (`AUTO_FAMILIES`) its own defaults shrunk (`make_auto_config`), with `overrides` on top; None if transformers
    lacks the family."""
    if name not in ALL_RECIPES:
        return make_auto_config(name, **overrides)
    return make_config(name, **overrides) if hasattr(transformers, ALL_RECIPES[name][0]) else None


# Per-expert parameters a family initialises to one value for every expert (norm scales), drawn at random by `build`
# so that a test can tell one expert's from another's (a route normalised with the wrong expert's scale).
PER_EXPERT_INIT = {"ergo": ("post_expert_norm.weight",)}


def build(config):
    """A random model of `config`, of the class `MiraMoEModel.from_pretrained` loads its checkpoint as: the
    causal LM, or the image-text-to-text model of a type without a causal-LM entry (Mistral 4), or the
    sequence-to-sequence model of an encoder-decoder (Switch Transformers); per-expert
    parameters of `PER_EXPERT_INIT` drawn around 1 from torch's generator."""
    from .checkpoint import auto_model_class

    model = auto_model_class(config.model_type).from_config(config)
    suffixes = PER_EXPERT_INIT.get(config.model_type, ())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(suffixes):
                p.copy_(1 + 0.5 * torch.randn(p.shape))
    return model


def step(model, ids: torch.Tensor, cache=None, **kwargs):
    """`model(ids, ...)` continuing from the KV cache `cache` (None: a prompt's step): transformers takes it as `cache`
    from 5.25 on and as `past_key_values` before (the old name is deprecated). Returns (output, its KV cache)."""
    if cache is not None:
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        kwargs[name] = cache
    out = model(ids, use_cache=True, **kwargs)
    carried = getattr(out, "cache", None)  # a ModelOutput field from 5.25 on
    return out, carried if carried is not None else out.past_key_values


class InterruptAt(transformers.StoppingCriteria):
    """Raises KeyboardInterrupt at its `at`-th call: a Ctrl-C in the middle of `generate`
    (tests/test_reliability.py on CPU, benchmarks/gpu_reliability.py on CUDA)."""

    def __init__(self, at: int):
        self.at, self.n = at, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.n += 1
        if self.n == self.at:
            raise KeyboardInterrupt
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
