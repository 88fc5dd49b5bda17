"""How one device's memory is split between the expert cache and the paged KV cache of continuous batching.

mira-hf sizes the expert cache at load (`MiraConfig.gpu_budget`); transformers' continuous batching then sizes
its paged KV cache from what is left, unless it is told a size. `batching_config` turns a KV byte budget into
the `ContinuousBatchingConfig(num_blocks=...)` transformers takes; `memory_split` reports what each part got
once the cache exists. Imports torch and transformers only inside functions (the CLI imports this module).
"""

from __future__ import annotations

import dataclasses
import importlib.util

from ..config import parse_bytes
from ..errors import ConfigError

# On a CPU, transformers would size the KV cache from host RAM (0.9 x what the process does not use): tens of
# GiB of zeros. 64 MiB holds ~21k tokens of the bundled model; pass kv_cache_memory for more.
CPU_DEFAULT_KV_BYTES = 64 * 2**20
# Likewise tokens per forward step: transformers sizes its per-step buffers (attention masks over the whole cache
# among them) for 8192 tokens, or from host RAM in older releases; 1024 covers 32 decoding requests and prompt chunks.
CPU_DEFAULT_BATCH_TOKENS = 1024
DEFAULT_PAGE_TOKENS = 256  # transformers' default page (block) size, tokens per whole-model block


MLA_LATENTS = "transformers.generation.continuous_batching.cache_allocators.compressed_latents"


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package missing (an older transformers)
        return False


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V for one token across all layers, at the model's dtype (what one cached token costs). Where
    transformers' paged cache keeps multi-head latent attention's two latents per token instead (DeepSeek-V2/V3,
    Kimi: its compressed-latents allocator), their bytes."""
    return config_kv_bytes_per_token(model.config, model.dtype.itemsize)


def config_kv_bytes_per_token(config, itemsize: int) -> int:
    """`kv_bytes_per_token` of a model with the transformers `config` at `itemsize` bytes per value: known from the
    checkpoint's config.json alone, before the model loads."""
    text = config.get_text_config()
    if getattr(text, "kv_lora_rank", None) is not None and _has_module(MLA_LATENTS):
        return text.num_hidden_layers * (text.kv_lora_rank + text.qk_rope_head_dim) * itemsize
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * itemsize


def default_page_tokens() -> int:
    """Tokens per KV block of transformers' `ContinuousBatchingConfig` ("page_size" since 5.18, "block_size" before)."""
    from transformers import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    return ContinuousBatchingConfig().page_size if "page_size" in fields else ContinuousBatchingConfig().block_size


def kv_blocks(nbytes: int, bytes_per_token: int, page: int, given: str) -> int:
    """The whole KV blocks of `page` tokens `nbytes` hold; a `ConfigError` if not one, naming `given` (the setting as
    it was given, e.g. "kv_cache_memory=10")."""
    per_block = bytes_per_token * page
    if nbytes < per_block:
        raise ConfigError(
            f"{given} is less than one KV block ({per_block} bytes: {page} tokens of {bytes_per_token} bytes). Give "
            f"at least {per_block} bytes, or leave it unset."
        )
    return nbytes // per_block


def batching_config(model, kv_cache_memory: int | str | None, max_batch_tokens: int | None = None):
    """`ContinuousBatchingConfig` whose paged cache holds `kv_cache_memory` bytes (rounded down to whole blocks).

    `None` leaves the size to transformers (a share of the device memory free after the model and the expert
    cache are loaded) on an accelerator, and uses `CPU_DEFAULT_KV_BYTES` on a CPU. The model's attention
    implementation is kept (no automatic switch to flash attention), so served tokens are the model's own.
    A wrapped model runs without CUDA graphs: its experts move between host and device and its cache changes
    from step to step, which a captured graph would replay frozen (asynchronous batching, which transformers
    turns on only with graphs, stays off with them).
    """
    from transformers import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    kwargs: dict = {}
    if "auto_switch_to_flash" in fields:
        kwargs["auto_switch_to_flash"] = False
    if getattr(model, "mira", None) is not None:
        kwargs["use_cuda_graph"] = False
    if max_batch_tokens is None and model.device.type == "cpu":
        max_batch_tokens = CPU_DEFAULT_BATCH_TOKENS
    if max_batch_tokens is not None:
        kwargs["max_batch_tokens"] = max_batch_tokens
    if kv_cache_memory is None and model.device.type == "cpu":
        kv_cache_memory = CPU_DEFAULT_KV_BYTES
    if kv_cache_memory is not None:
        nbytes = parse_bytes(kv_cache_memory, "kv_cache_memory")
        given = f"kv_cache_memory={kv_cache_memory!r}"
        kwargs["num_blocks"] = kv_blocks(nbytes, kv_bytes_per_token(model), default_page_tokens(), given)
    return ContinuousBatchingConfig(**kwargs)


def page_tokens(cb_manager) -> int:
    """Tokens per whole-model KV block of a running manager ("page_size" since transformers 5.18, "block_size" before)."""
    cfg = cb_manager.continuous_batching_config
    return getattr(cfg, "page_size", None) or getattr(cfg, "block_size", None) or DEFAULT_PAGE_TOKENS


def kv_usage(cb_manager) -> dict | None:
    """`{"blocks_total", "blocks_used", "tokens_per_block", "bytes"}` of the paged cache, or None before it exists."""
    processor = getattr(cb_manager, "batch_processor", None)
    cache = getattr(processor, "cache", None)
    if cache is None:
        return None
    total = int(cache.num_blocks)
    if hasattr(cache, "compute_free_capacity"):  # transformers >= 5.18: free share of the sector pool
        used = total - round(total * cache.compute_free_capacity())
    elif hasattr(cache, "get_num_free_blocks"):
        used = total - int(cache.get_num_free_blocks())
    else:
        used = None
    tensor = getattr(cache, "cache_tensor", None)
    if tensor is not None:
        nbytes = tensor.numel() * tensor.element_size()
    else:  # one tensor per layer for K and V
        tensors = list(getattr(cache, "key_cache", [])) + list(getattr(cache, "value_cache", []))
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return dict(blocks_total=total, blocks_used=used, tokens_per_block=page_tokens(cb_manager), bytes=nbytes)


def queue_depth(cb_manager) -> dict | None:
    """`{"waiting", "active"}` requests of the batching manager, or None before its scheduler exists."""
    processor = getattr(cb_manager, "batch_processor", None)
    scheduler = getattr(processor, "scheduler", None)
    if scheduler is None:
        return None
    queued = cb_manager.input_queue.qsize()  # submitted, not yet taken by the scheduler
    return dict(waiting=queued + len(scheduler.waiting_requests), active=len(scheduler.active_requests))


def device_weight_bytes(model) -> int:
    """Bytes of the weights and buffers on the model's device, not counting routed experts served by mira-hf (they
    live in its host store; the expert cache is counted on its own)."""
    from ..proxy import MiraExperts

    served = {id(p) for m in model.modules() if isinstance(m, MiraExperts) for p in m.parameters(recurse=False)}
    tensors = (*model.parameters(), *model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if t.device == model.device and id(t) not in served)


def memory_split(model, cb_manager) -> dict:
    """Where the model's device memory goes: weights resident there, the expert cache (bytes, and how many experts it
    holds: slots, experts kept packed beside them, experts in all), the KV cache, and (on CUDA) what is still free.
    Bytes; the KV entries are None until the batching manager has built its cache."""
    import torch

    device = model.device
    weights = device_weight_bytes(model)
    manager = getattr(model, "mira", None)
    kv = kv_usage(cb_manager)
    out = dict(
        device=str(device),
        weights_bytes=weights,
        expert_cache_bytes=manager.device_bytes if manager is not None else 0,
        expert_slots=sum(manager.budget.n_slots.values()) if manager is not None else 0,
        experts_kept_packed=len(manager.kept) if manager is not None else 0,
        experts=sum(li.num_experts for li in manager.layers.values()) if manager is not None else 0,
        kv_cache_bytes=kv["bytes"] if kv else None,
        kv_blocks=kv["blocks_total"] if kv else None,
        kv_tokens=kv["blocks_total"] * kv["tokens_per_block"] if kv else None,
        kv_bytes_per_token=kv_bytes_per_token(model),
        free_bytes=None,
    )
    if device.type == "cuda":
        out["free_bytes"] = torch.cuda.mem_get_info(device)[0]
    return out


def format_split(split: dict) -> str:
    """One line per part, for the server's start-up message."""
    from ..report import format_bytes

    def size(n):
        return "not built yet" if n is None else format_bytes(n)

    lines = [
        f"device memory on {split['device']}:",
        f"  weights on the device   {size(split['weights_bytes'])}",
        f"  expert cache            {size(split['expert_cache_bytes'])}" + _expert_count(split),
        f"  KV cache (paged)        {size(split['kv_cache_bytes'])}"
        + (f", {split['kv_blocks']} blocks, {split['kv_tokens']} tokens" if split["kv_blocks"] is not None else ""),
    ]
    if split["free_bytes"] is not None:
        lines.append(f"  still free              {size(split['free_bytes'])}")
    plan = split.get("plan")
    if plan is not None:
        how = "as set" if plan["fixed"] else "planned"
        lines.append(
            f"  ({how} for {format_bytes(plan['total_bytes'])} in all, {format_bytes(plan['activation_bytes'])} kept "
            f"for one step's activations: {plan['concurrency']} sequences at once, expected hit rate "
            f"{plan['expected_hit_rate']:.1%}; hit rates from {plan['curve_source']})"
        )
    return "\n".join(lines)


def _expert_count(split: dict) -> str:
    """ ", 20 slots for 48 experts" or, where every expert is on the device, how (a few kept packed: "mixed")."""
    slots, kept, experts = split.get("expert_slots", 0), split.get("experts_kept_packed", 0), split.get("experts", 0)
    if not experts:
        return ""
    if slots + kept < experts:
        return f", {slots} slots for {experts} experts"
    return f", all {experts} experts" + (f" ({kept} kept packed, decoded at each use)" if kept else "")
