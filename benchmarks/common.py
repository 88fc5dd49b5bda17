"""Shared pieces of the benchmark scripts: model shapes, timing, environment facts, JSON output."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import time
from contextlib import contextmanager

import torch

# Real model dimensions, random-initialised on the device (no download).
SHAPES = {
    "mixtral-8x7b-8l": dict(
        model="MixtralConfig",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        rope_theta=1e6,
    ),
    "qwen3-30b-a3b-12l": dict(
        model="Qwen3MoeConfig",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=12,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=4096,
    ),
}
# The same models at full depth, and two more at real per-expert dimensions (benchmarks/full_depth.py).
SHAPES["mixtral-8x7b"] = dict(SHAPES["mixtral-8x7b-8l"], num_hidden_layers=32)
SHAPES["qwen3-30b-a3b"] = dict(SHAPES["qwen3-30b-a3b-12l"], num_hidden_layers=48)
SHAPES["gpt-oss-20b"] = dict(
    model="GptOssConfig",
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=128,
)
# DeepSeek-V3's dimensions (hidden 7168, experts of 2048, MLA attention, group-limited top-8), cut to 8 layers
# (the first dense, as V3's first three) of 64 routed experts: 7 x 64 experts of 44 M weights, 19.7 GB in FP8.
SHAPES["deepseek-v3-8l-64e"] = dict(
    model="DeepseekV3Config",
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=8,
    first_k_dense_replace=1,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_shared_experts=1,
    n_routed_experts=64,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    max_position_embeddings=4096,
)


# Tiny stand-ins for --smoke runs (CPU, seconds): shape name -> (a recipe of mira_hf.testing, the tests' tiny models;
# fields changed on top of it).
SMOKE_SHAPES = {
    "mixtral-smoke": ("mixtral", {}),
    "qwen3-smoke": ("qwen3_moe", {}),
    # full_depth.py: more experts and a larger vocabulary, so shaped routing has topics to spread over
    "gpt-oss-smoke": ("gpt_oss", dict(vocab_size=512, num_local_experts=16, num_experts_per_tok=4, max_position_embeddings=1024)),
    "deepseek-v3-smoke": (  # FP8 needs 128-wide blocks: 256 gives each weight a 2 x 2 grid of scales
        "deepseek_v3",
        dict(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=256,
            moe_intermediate_size=256,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=32,
            max_position_embeddings=1024,
        ),
    ),
}


def build_config(shape: str, **overrides):
    """The transformers config of `shape`: a key of `SHAPES` (real dimensions) or of `SMOKE_SHAPES`, with
    `overrides` (config fields, e.g. num_hidden_layers) on top."""
    import transformers

    if shape in SMOKE_SHAPES:
        from mira_hf.testing import make_config  # here: scripts put the repository on sys.path after importing this module

        recipe, fields = SMOKE_SHAPES[shape]
        return make_config(recipe, **fields, **overrides)
    kw = dict(SHAPES[shape], **overrides)
    return getattr(transformers, kw.pop("model"))(**kw)


def random_model_on_device(shape: str, device: str = "cuda", dtype=torch.bfloat16, seed: int = 0):
    """A model of `shape` with random weights, built directly on `device` (init ~N(0, 0.02))."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = build_config(shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def balance_routers(model, sample_ids: torch.Tensor, skew: float = 0.5, seed: int = 0) -> list[dict]:
    """Give each MoE router of a random-initialised model weights that spread tokens over its experts with a
    realistic, stable skew, and return each layer's routing shares on `sample_ids` [B, T].

    Random routers of a random model send nearly every token to the same few experts: the router inputs share a
    large common direction (the residual stream's mean), and each expert's logit is dominated by it. Layer by
    layer (each after the layers before it are balanced), the router inputs x are captured on `sample_ids`; each
    expert gets a random direction orthogonal to their mean μ, scaled so its logit has unit spread over tokens,
    plus an offset b_e·μ/|μ|² (logit ≈ b_e + noise, b_e ~ N(0, skew²)), which makes some experts more popular
    than others, as trained routers are. `skew` 0 routes evenly; 0.5 gives the most popular expert of Mixtral's
    eight ~1.5-2x the mean share. Routers are the blocks' `mlp.gate` (Mixtral, Qwen3-MoE, and others that name
    them so)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks = [layer.mlp for layer in model.model.layers if hasattr(getattr(layer, "mlp", None), "gate")]
    shares = []
    for block in blocks:
        gate = block.gate
        seen: list[torch.Tensor] = []
        handle = gate.register_forward_pre_hook(lambda _m, args, seen=seen: seen.append(args[0].reshape(-1, args[0].shape[-1])))
        with torch.inference_mode():
            model(sample_ids)
        handle.remove()
        x = torch.cat(seen).float()  # [N, H]
        mu = x.mean(0)  # [H]
        unit = mu / mu.norm()
        E, H = gate.weight.shape
        w = torch.randn(E, H, generator=g).to(x.device)
        w -= (w @ unit)[:, None] * unit[None, :]  # orthogonal to the common direction
        w /= ((x - mu) @ w.T).std(0)[:, None]  # unit logit spread over tokens
        offsets = torch.randn(E, generator=g).to(x.device) * skew
        w += offsets[:, None] * (mu / mu.dot(mu))[None, :]
        with torch.no_grad():
            gate.weight.copy_(w.to(gate.weight.dtype))
        k = getattr(gate, "top_k", 1)
        picks = ((x @ w.T).topk(k, dim=1).indices).flatten()
        share = torch.bincount(picks, minlength=E).float() / picks.numel()
        shares.append(dict(max_over_mean=round(float(share.max() * E), 3), min_over_mean=round(float(share.min() * E), 3)))
    return shares


def module_version(module: str) -> str | None:
    """`module.__version__`, or None when it is not installed."""
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextmanager
def timed(out: dict, key: str):
    sync()
    t0 = time.perf_counter()
    yield
    sync()
    out[key] = time.perf_counter() - t0


def environment() -> dict:
    import transformers

    env = {
        "date": _dt.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
    }
    # settings read from the environment that change the host's kernels (oneDNN's instruction set, threads)
    env.update({k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS") if k in os.environ})
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, device_memory_gb=round(p.total_memory / 1e9, 1))
    else:
        env["device"] = "cpu"
    return env


def h2d_bandwidth(nbytes: int = 512 * 2**20, pinned: bool = True, reps: int = 5) -> float:
    """Host→device GB/s for one large copy (median of `reps`)."""
    from mira_hf.pinned import pinned_empty  # here: scripts put the repository on sys.path after importing this module

    src = pinned_empty(nbytes) if pinned else torch.empty(nbytes, dtype=torch.uint8)  # the memory the store copies from
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        sync()
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return nbytes / times[len(times) // 2] / 1e9


def device_bandwidth(nbytes: int = 2 * 2**30, reps: int = 5) -> float:
    """Device-memory GB/s of a large device-to-device copy (bytes read + written)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        b.copy_(a)
        sync()
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return 2 * nbytes / times[len(times) // 2] / 1e9


def device_slug(env: dict, on_gpu: bool = True) -> str:
    """The device part of a result file's name: `env["device"]` as lowercase words joined by '-'
    ("NVIDIA H200" -> "nvidia-h200"), or "cpu" when the run was not on the GPU."""
    if not on_gpu:
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", str(env.get("device", "cpu")).lower()).strip("-")


def budget_arg(text: str) -> str | float:
    """A `--budget` argument as gpu_budget takes it: a fraction ("0.5") as a float, a size ("20GiB") as given."""
    return float(text) if text.replace(".", "", 1).isdigit() and "." in text else text


def status_bytes(field: str) -> int:
    """A memory field of /proc/self/status ("VmRSS", "RssAnon", ...) in bytes; 0 where there is none."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)


def print_table(rows: list[dict], columns: list[str]) -> str:
    widths = {c: max([len(c)] + [len(_fmt(r.get(c))) for r in rows]) for c in columns}
    lines = [" | ".join(c.ljust(widths[c]) for c in columns), "-|-".join("-" * widths[c] for c in columns)]
    lines += [" | ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns) for r in rows]
    text = "\n".join(lines)
    print(text)
    return text


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
