"""Built-in adapters: one entry per family, keyed by `config.model_type`.

Each was checked against transformers' modeling code (5.17 to 5.24) and a tiny random model in the
tests. Families that share a layout share an entry.
"""

from __future__ import annotations

from .base import MoEAdapter
from .registry import register_adapter

MIXTRAL = register_adapter(
    MoEAdapter(
        name="mixtral",
        model_types=("mixtral", "minimax"),
        notes="checkpoint `block_sparse_moe.experts.{j}.w1/w2/w3`, fused at load into `mlp.experts`; "
        "softmax in fp32, top-k renormalised, fp32 routing weights",
    )
)

QWEN2_MOE = register_adapter(
    MoEAdapter(
        name="qwen2_moe",
        model_types=("qwen2_moe", "qwen3_next", "qwen3_5_moe_text"),
        notes="shared expert × sigmoid(shared_expert_gate) stays in the block; sparse layers chosen by "
        "`decoder_sparse_step` and `mlp_only_layers` (dense layers have no experts to serve)",
    )
)

QWEN3_MOE = register_adapter(
    MoEAdapter(
        name="qwen3_moe",
        model_types=("qwen3_moe",),
        notes="softmax → top-k → renormalised when `norm_topk_prob`",
    )
)

OLMOE = register_adapter(
    MoEAdapter(
        name="olmoe",
        model_types=("olmoe", "flex_olmo"),
        notes="`norm_topk_prob` defaults to False",
    )
)

DEEPSEEK_V3 = register_adapter(
    MoEAdapter(
        name="deepseek_v3",
        model_types=("deepseek_v3", "glm4_moe", "dots1"),
        router_scoring="sigmoid",
        notes="sigmoid scores + `e_score_correction_bias` for selection, group-limited top-k "
        "(`n_group`, `topk_group`), × `routed_scaling_factor`; first `first_k_dense_replace` layers dense; "
        "shared experts stay in the block",
    )
)

DEEPSEEK_V2 = register_adapter(
    MoEAdapter(
        name="deepseek_v2",
        model_types=("deepseek_v2",),
        notes="softmax, greedy or group-limited top-k, × `routed_scaling_factor`; shared experts stay in the block",
    )
)

GPT_OSS = register_adapter(
    MoEAdapter(
        name="gpt_oss",
        model_types=("gpt_oss",),
        router_attr="router",
        notes="transposed expert tensors with biases; interleaved, clamped SwiGLU (the module's own `_apply_gate`); "
        "the block returns `(hidden, router_scores)`, untouched since only experts are replaced",
    )
)

PHIMOE = register_adapter(
    MoEAdapter(
        name="phimoe",
        model_types=("phimoe",),
        router_attr="router",
        notes="sparsemixer routing (two masked-softmax top-1 passes), weights not normalised",
    )
)

GRANITEMOE = register_adapter(
    MoEAdapter(
        name="granitemoe",
        model_types=("granitemoe", "granitemoeshared", "granitemoehybrid"),
        experts_globs=("*.block_sparse_moe.experts",),
        router_attr="router",
        notes="block at `layers[i].block_sparse_moe`; router output order changed between 5.17 and 5.23 "
        "(irrelevant here: only experts are replaced); shared MLP on the layer",
    )
)
