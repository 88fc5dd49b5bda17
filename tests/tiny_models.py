"""Tiny random MoE models of every adapter family, built from config objects (CPU, no hub access),
and the generate stopping criterion the reliability checks interrupt them with."""

from __future__ import annotations

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
}

# Further model types served by a registered adapter, checked too.
EXTRA_RECIPES = {
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(
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
        ),
    ),
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
}


def make_config(name: str):
    cls_name, kwargs = {**RECIPES, **EXTRA_RECIPES}[name]
    return getattr(transformers, cls_name)(**kwargs)


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
