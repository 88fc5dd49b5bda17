"""Built-in adapters: one entry per family, keyed by `config.model_type`.

Each was checked against transformers' modeling code (5.17 to 5.25) and a tiny random model in the
tests. Families that share a layout share an entry.
"""

from __future__ import annotations

from .base import ExpertKeys, ExpertModules, MoEAdapter, RoutedBlockExperts, SeparateGluExperts
from .registry import register_adapter

# Checkpoint layouts of the routed experts (what transformers' WeightConverters fuse at load).
# Mixtral-style: `block_sparse_moe.experts.{e}.w1/w3/w2.weight` (w1 = gate, w3 = up).
W1_W3_W2 = ExpertKeys(
    tensors={"gate_up_proj": ("{e}.w1.weight", "{e}.w3.weight"), "down_proj": ("{e}.w2.weight",)},
    path_renames=((".mlp.experts", ".block_sparse_moe.experts"),),
)
# Llama-style per-expert MLPs: `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`.
GATE_UP_DOWN = ExpertKeys(
    tensors={
        "gate_up_proj": ("{e}.gate_proj.weight", "{e}.up_proj.weight"),
        "down_proj": ("{e}.down_proj.weight",),
    }
)
# Granite: stacked `block_sparse_moe.input_linear.weight [E, 2I, H]` and `output_linear.weight [E, H, I]`.
GRANITE_LINEARS = ExpertKeys(
    tensors={"gate_up_proj": ("input_linear.weight",), "down_proj": ("output_linear.weight",)},
    path_renames=((".block_sparse_moe.experts", ".block_sparse_moe"),),
)
# Ergo: the layout its training framework exports, stacked `layers.{i}.feed_forward.up_proj [E, H, I]` and
# `down_proj [E, I, H]` (no `model.` prefix), as transformers' conversion mapping for it reads them.
ERGO_FEED_FORWARD = ExpertKeys(
    tensors={"up_proj": ("up_proj",), "down_proj": ("down_proj",)},
    path_renames=((".model.layers", ".layers"), (".mlp.experts", ".feed_forward")),
)
# gpt-oss checkpoints already hold the fused (transposed, biased) tensors under their in-memory names:
# every family is also tried with that layout, so it needs no table.

MIXTRAL = register_adapter(
    MoEAdapter(
        name="mixtral",
        model_types=("mixtral", "minimax"),
        notes="checkpoint `block_sparse_moe.experts.{j}.w1/w2/w3`, fused at load into `mlp.experts`; "
        "softmax in fp32, top-k renormalised, fp32 routing weights",
        checkpoint_keys=(W1_W3_W2,),
    )
)

QWEN2_MOE = register_adapter(
    MoEAdapter(
        name="qwen2_moe",
        model_types=("qwen2_moe", "qwen3_next", "qwen3_5_moe_text"),
        notes="shared expert × sigmoid(shared_expert_gate) stays in the block; sparse layers chosen by "
        "`decoder_sparse_step` and `mlp_only_layers` (dense layers have no experts to serve)",
        checkpoint_keys=(GATE_UP_DOWN,),
    )
)

QWEN3_MOE = register_adapter(
    MoEAdapter(
        name="qwen3_moe",
        model_types=("qwen3_moe",),
        notes="softmax → top-k → renormalised when `norm_topk_prob`",
        checkpoint_keys=(GATE_UP_DOWN,),
    )
)

OLMOE = register_adapter(
    MoEAdapter(
        name="olmoe",
        model_types=("olmoe", "flex_olmo"),
        notes="`norm_topk_prob` defaults to False",
        checkpoint_keys=(GATE_UP_DOWN,),
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
        checkpoint_keys=(GATE_UP_DOWN,),
    )
)

DEEPSEEK_V2 = register_adapter(
    MoEAdapter(
        name="deepseek_v2",
        model_types=("deepseek_v2",),
        notes="softmax, greedy or group-limited top-k, × `routed_scaling_factor`; shared experts stay in the block",
        checkpoint_keys=(GATE_UP_DOWN,),
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
        checkpoint_keys=(W1_W3_W2,),
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
        checkpoint_keys=(GRANITE_LINEARS,),
    )
)

LLAMA4 = register_adapter(
    MoEAdapter(
        name="llama4",
        model_types=("llama4", "llama4_text"),
        experts_globs=("*.feed_forward.experts",),
        router_attr="router",
        router_scoring="sigmoid",
        notes="MoE layers every `interleave_moe_layer_step`; sigmoid of the top-k logits scales each expert's "
        "*input*, every expert runs on every token (zero rows where not chosen); transposed `gate_up_proj "
        "[E, H, 2I]`, `down_proj [E, I, H]`; shared expert on the block",
        expert_flags={"is_transposed": True, "has_gate": True, "has_bias": False},
        input_scaled=True,
    )
)

STEP3P7 = register_adapter(
    MoEAdapter(
        name="step3p7",
        model_types=("step3p7", "step3p5"),  # step3p5: its text decoder's config (Step3p7TextConfig)
        router_scoring="sigmoid",
        notes="experts built outside transformers' experts interface, in its layout (`gate_up_proj [E, 2I, H]`), "
        "SwiGLU clamped per layer (the module's own `_apply_gate`); sigmoid router with a selection bias; shared "
        "expert and routed scaling on the block; a vision-language model (no causal-LM class)",
        expert_flags={"is_transposed": False, "has_gate": True, "has_bias": False},
    )
)

ERGO = register_adapter(
    MoEAdapter(
        name="ergo",
        model_types=("ergo",),
        router_weight_attr="linear.weight",
        router_scoring="sigmoid",
        notes="first `num_dense_blocks` layers dense; sigmoid router (an fp32 linear) with a selection bias, weights "
        "normalised × `moe_routed_scaling_factor`; transposed `up_proj [E, H, I]`, `down_proj [E, I, H]`, squared "
        "ReLU, no gate; each route's output normalised by its expert's own learned RMSNorm (`post_expert_norm`, "
        "[E, H]) before the weighted sum, which runs in fp32; shared expert on the block",
        checkpoint_keys=(ERGO_FEED_FORWARD,),
        route_norm="post_expert_norm",
    )
)

DBRX = register_adapter(
    MoEAdapter(
        name="dbrx",
        model_types=("dbrx",),
        experts_globs=("*.ffn.experts",),
        router_attr="router",
        router_weight_attr="layer.weight",
        notes="experts outside transformers' experts interface: `ffn.experts.mlp.w1` (gate), `v1` (up) and `w2` "
        "(down, rows times it), each `[E * I, H]` in memory and in checkpoints; the module's own loop adds the "
        "experts in ascending order; softmax in the hidden dtype, top-k weights divided by their p-norm "
        "(`moe_normalize_expert_weights`)",
        experts_layout=SeparateGluExperts(
            gate="mlp.w1", up="mlp.v1", down="mlp.w2", down_transposed=True, activation="mlp.activation_fn", batch_output=True
        ),
    )
)

JETMOE = register_adapter(
    MoEAdapter(
        name="jetmoe",
        model_types=("jetmoe",),
        experts_globs=("*.mlp",),
        router_attr="mlp.router",
        router_weight_attr="layer.weight",
        notes="the sparse block (`mlp`, outside transformers' experts interface) routes and combines in its own forward: "
        "softmax over the top-k logits, tokens sorted by expert, `input_linear.weight [E, 2I, H]` (gate rows then up "
        "rows) and `output_linear.weight [E, H, I]`, the weighted rows added per token, then the block's bias; the "
        "attention's mixture of heads (MoA) stays on the device",
        experts_layout=RoutedBlockExperts(
            up="input_linear.weight", down="output_linear.weight", activation="activation", router="router", bias="bias"
        ),
    )
)

SWITCH_TRANSFORMERS = register_adapter(
    MoEAdapter(
        name="switch_transformers",
        model_types=("switch_transformers",),
        experts_globs=("*.mlp.experts",),  # the encoder's and the decoder's sparse layers
        router_attr="router",
        router_weight_attr="classifier.weight",
        notes="an encoder-decoder (T5) whose sparse feed-forward layers keep each expert as a module of its own "
        "(`mlp.experts.expert_{e}.wi/wo`, an `nn.ModuleDict`, in memory and in checkpoints); top-1 routing with a "
        "softmax in the router's own dtype (float32) and a capacity per expert (tokens over it skip the experts); "
        "the module's own loop adds the experts in ascending order",
        checkpoint_keys=(ExpertKeys(tensors={"wi.weight": ("expert_{e}.wi.weight",), "wo.weight": ("expert_{e}.wo.weight",)}),),
        expert_flags={"has_gate": False, "has_bias": False, "is_transposed": False},
        experts_layout=ExpertModules(up="wi.weight", down="wo.weight", activation="act", dropout="dropout"),
    )
)
