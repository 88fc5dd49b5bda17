"""Tiny pre-quantized checkpoints in the exact layout the hub ships them (tests and benchmarks).

* FP8 fine-grained (`quant_method: "fp8"`), as DeepSeek-V3/R1, Qwen3-*-FP8, Qwen3-Next-*-FP8, GLM-4.5-FP8 and
  MiniMax-M2 ship: every linear weight of attention and MLPs (routed experts one tensor per expert, shared experts,
  dense MLPs) is `float8_e4m3fn` with a sibling `<name>.weight_scale_inv` float32 `[ceil(out/128), ceil(in/128)]`
  (the weight is the stored value times that scale, block by block); embeddings, norms, routers and `lm_head` stay
  in the model dtype. config.json carries `quantization_config = {"activation_scheme": "dynamic", "fmt": "e4m3",
  "quant_method": "fp8", "weight_block_size": [128, 128]}`.
* MXFP4 (`quant_method: "mxfp4"`), as gpt-oss-20b/120b ship: each layer's routed experts are
  `mlp.experts.gate_up_proj_blocks` uint8 `[E, 2I, H/32, 16]` (two e2m1 codes per byte, low nibble first) with
  `gate_up_proj_scales` uint8 `[E, 2I, H/32]` (e8m0 exponents, bias 127), `down_proj_blocks` `[E, H, I/32, 16]`
  and `down_proj_scales` `[E, H, I/32]`; biases, attention, router, embeddings stay bf16. config.json carries
  `quantization_config = {"modules_to_not_convert": [...], "quant_method": "mxfp4"}`.

`write_fp8_checkpoint(family, path)` and `write_mxfp4_checkpoint(path)` build a seeded tiny bf16 model of that family,
save it the way transformers saves it (per-expert keys where the hub has them) and quantize its tensors in place;
config.json names the modeling code the hub's checkpoints ship (`auto_map`) where they ship some.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file
from tiny_models import AUTO_SMALL, make_auto_config, make_config

FP8_BLOCK = (128, 128)
FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": list(FP8_BLOCK),
}
# gpt-oss-20b's config.json, verbatim.
MXFP4_QUANTIZATION_CONFIG = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    "quant_method": "mxfp4",
}
# Families whose released checkpoints ship FP8 fine-grained experts. Widths are multiples of the 128 block (as in
# every released checkpoint), and large enough that each expert weight has a 2 x 2 grid of scale blocks.
FP8_WIDTHS = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256)
# glm_moe_dsa has no adapter: its expert keys are found through transformers' own key renaming. glm4v_moe (GLM-4.5V)
# is a vision-language model: its language model in FP8, its vision tower kept in bf16 (`modules_to_not_convert`).
FP8_FAMILIES = ("deepseek_v3", "qwen3_moe", "glm4_moe", "qwen3_next", "minimax_m2", "glm_moe_dsa", "glm4v_moe")
# Tensors the FP8 checkpoints leave unquantized (besides 1-D ones): embeddings, the LM head, routers, gates, and a
# vision tower.
_FP8_KEEP = ("embed_tokens", "lm_head", ".mlp.gate.weight", ".block_sparse_moe.gate.weight", "shared_expert_gate", "norm",
             "model.visual.")  # fmt: skip


def _glm4v_moe_config(**widths):
    """GLM-4.5V's tiny config: the widths on its text decoder (rotary sections scaled to its head dim)."""
    import transformers

    config = transformers.Glm4vMoeConfig
    text = {k: v for k, v in AUTO_SMALL.items() if hasattr(config.sub_configs["text_config"](), k)}
    text.update(widths, head_dim=64)
    text["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[8, 4, 4])
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"])
    return config(text_config=text, vision_config=vision)


# Vision-language families: their config, and the modules their FP8 checkpoints leave in the model dtype.
_FP8_COMPOSITES = {"glm4v_moe": (_glm4v_moe_config, ["model.visual", "lm_head"])}
# The modeling code some of these checkpoints ship on the hub (config.json's `auto_map`; the files themselves are not
# written): without trust_remote_code, transformers builds its own classes for them and never reads that code.
HUB_AUTO_MAPS = {
    "deepseek_v3": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "minimax_m2": {
        "AutoConfig": "configuration_minimax_m2.MiniMaxM2Config",
        "AutoModelForCausalLM": "modeling_minimax_m2.MiniMaxM2ForCausalLM",
    },
}
_FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _config(family: str, **overrides):
    if family in _FP8_COMPOSITES:
        return _FP8_COMPOSITES[family][0](**overrides)
    try:
        config = make_config(family)
    except KeyError:
        config = make_auto_config(family)
    for k, v in overrides.items():
        if hasattr(config, k):
            setattr(config, k, v)
    return config


def _save_bf16(config, path: str, seed: int) -> dict[str, torch.Tensor]:
    """Save a seeded random bf16 model of `config` the way transformers saves it; return its tensors."""
    from mira_hf.checkpoint import auto_model_class

    torch.manual_seed(seed)
    model = auto_model_class(config.model_type).from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # larger weights than the init's 0.02 std, so FP8/FP4 rounding is visible in the logits
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    state = {}
    for f in files:
        state.update(load_file(os.path.join(path, f)))
        os.remove(os.path.join(path, f))
    for f in ("model.safetensors.index.json",):
        if os.path.exists(os.path.join(path, f)):
            os.remove(os.path.join(path, f))
    return state


def write_shards(path: str, state: dict[str, torch.Tensor], quantization_config: dict, shards: int, auto_map=None) -> None:
    """Write `state` (CPU tensors) as `shards` safetensors shards with an index, and add `quantization_config` (and
    the hub's `auto_map`, where given) to the config.json already in `path`."""
    keys = sorted(state)
    if shards == 1:
        save_file({k: state[k].contiguous() for k in keys}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map, per = {}, -(-len(keys) // shards)
        for i in range(shards):
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = keys[i * per : (i + 1) * per]
            save_file({k: state[k].contiguous() for k in part}, os.path.join(path, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in part})
        total = sum(t.numel() * t.element_size() for t in state.values())
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    if auto_map:
        config["auto_map"] = auto_map
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8_e4m3fn [out, in], float32 scale_inv [ceil(out/bm), ceil(in/bn)]), block max-abs
    scaling as DeepSeek's and transformers' FP8 quantizers do (the stored value times the scale is the weight)."""
    bm, bn = block
    out, inp = w.shape
    rows, cols = -(-out // bm), -(-inp // bn)
    padded = torch.zeros(rows * bm, cols * bn, dtype=torch.float32, device=w.device)
    padded[:out, :inp] = w.float()
    tiles = padded.view(rows, bm, cols, bn)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [rows, cols]
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (tiles / scale_inv[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(rows * bm, cols * bn)[:out, :inp].contiguous(), scale_inv.float()


def fp8_tensors(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one bf16 tensor `key` of an FP8 fine-grained checkpoint: the weight and its
    `weight_scale_inv` for the linear weights those checkpoints quantize, else the tensor as it is."""
    if key.endswith(".weight") and t.dim() == 2 and not any(k in key for k in _FP8_KEEP):
        q, scale = quantize_fp8_block(t)
        return {key: q, key[: -len("weight")] + "weight_scale_inv": scale}
    return {key: t}


def write_fp8_checkpoint(family: str, path: str, seed: int = 0, shards: int = 2, **overrides) -> str:
    """A tiny FP8 fine-grained checkpoint of `family` in the hub's layout (see the module doc)."""
    os.makedirs(path, exist_ok=True)
    config = _config(family, **{**FP8_WIDTHS, **overrides})
    state = _save_bf16(config, path, seed)
    out = {}
    for key, t in state.items():
        out.update(fp8_tensors(key, t))
    quantization = dict(FP8_QUANTIZATION_CONFIG)
    if family in _FP8_COMPOSITES:
        quantization["modules_to_not_convert"] = _FP8_COMPOSITES[family][1]
    write_shards(path, out, quantization, shards, HUB_AUTO_MAPS.get(family))
    return path


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., rows, cols] (cols a multiple of 32) -> (blocks uint8 [..., rows, cols/32, 16], scales uint8
    [..., rows, cols/32]): per block of 32 along cols, an e8m0 exponent (bias 127) and e2m1 codes, two per byte
    (even element in the low nibble), as OpenAI's gpt-oss checkpoints store them."""
    *lead, rows, cols = w.shape
    x = w.float().reshape(*lead, rows, cols // 32, 32)
    amax = x.abs().amax(dim=-1).clamp(min=2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # x / 2**exp fits in [-6, 6]
    scaled = x / torch.exp2(exp)[..., None]
    codes = (scaled[..., None] - _FP4_VALUES.to(w.device)).abs().argmin(dim=-1).to(torch.uint8)  # nearest e2m1 value
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def mxfp4_tensors(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one bf16 tensor `key` of a gpt-oss MXFP4 checkpoint: `_blocks` and `_scales` for
    the routed experts' weights, else the tensor as it is."""
    if key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        # in memory [E, in, out] (x @ W); stored [E, out, in/32, 16] with blocks along `in`; one expert at a
        # time, which bounds the temporaries at real sizes
        parts = [quantize_mxfp4(w.transpose(0, 1)) for w in t]
        return {key + "_blocks": torch.stack([b for b, _ in parts]), key + "_scales": torch.stack([s for _, s in parts])}
    return {key: t}


def write_mxfp4_checkpoint(path: str, seed: int = 0, shards: int = 2, **overrides) -> str:
    """A tiny gpt-oss MXFP4 checkpoint in the hub's layout (see the module doc)."""
    os.makedirs(path, exist_ok=True)
    config = _config("gpt_oss", **overrides)
    state = _save_bf16(config, path, seed)
    out = {}
    for key, t in state.items():
        out.update(mxfp4_tensors(key, t))
    write_shards(path, out, dict(MXFP4_QUANTIZATION_CONFIG), shards)
    return path
