#!/usr/bin/env python3
"""Train "mira-tiny", the small Mixtral-style MoE bundled with mira-hf, and measure its routing.

Why: the library offloads experts to host memory, so its tests and benchmarks need a real
*trained* MoE whose routing has the skew and token-to-token reuse of trained routers
(random weights route almost uniformly).  This script trains ~8M parameters (8 experts,
top-2, load-balancing loss on) on the corpus from ``prepare_tiny_data.py`` within a
wall-clock budget, then reports held-out loss and routing statistics.

Reproducibility: fixed seed for init and data order.  The learning-rate schedule follows
``max(step / --steps, elapsed / --minutes)``, so with a time budget the number of steps
depends on the hardware; pass ``--steps N --minutes 1e9`` for a step-exact run.

Output directory (``--out``): config.json, generation_config.json, model.safetensors,
tokenizer files, heldout_tokens.safetensors (key "input_ids", int32 [64, 256]) and
training_report.json.

Smoke test on CPU:  python scripts/train_tiny_moe.py --device cpu --tiny --steps 5 --out /tmp/tt
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from transformers import GenerationConfig, MixtralConfig, MixtralForCausalLM

NUM_EXPERTS = 8
TOP_K = 2
HELDOUT_ROWS, HELDOUT_COLS = 64, 256  # token tensor shipped for the library's benchmarks
# Size limits.  The bundled checkpoint must stay <= 25 MB with the tokenizer, and every file
# must stay <= 16 MiB so that the GPU machine's output folder can hand it back (at most 8
# files of 16 MiB each; the output directory has 7).  Weights are saved in bfloat16 (fp32
# would double them).  Hence intermediate_size 232: 8.20M parameters = 16.39 MB in one
# model.safetensors.  (304 would give ~10.2M = 20.4 MB: fine for 25 MB, not for 16 MiB.)
CHECKPOINT_BUDGET_BYTES = 25_000_000
FILE_LIMIT_BYTES = 16 * 2**20

# Preset used with --tiny: the same architecture family, small enough for a CPU smoke test.
TINY_MODEL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
FULL_MODEL = dict(hidden_size=192, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2, head_dim=32)
TINY_DEFAULTS = dict(intermediate_size=64, batch_size=8, seq_len=64, eval_tokens=4096, warmup_steps=2, log_every=1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("build/tiny_data"), help="prepare_tiny_data.py output")
    parser.add_argument("--out", type=Path, default=Path("build/mira-tiny"), help="model output directory")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny model and batch, for a CPU smoke test")
    parser.add_argument(
        "--intermediate-size", type=int, default=232, help="per-expert FFN width; sets the parameter count (see FILE_LIMIT_BYTES)"
    )
    parser.add_argument("--minutes", type=float, default=4.0, help="wall-clock budget of the training loop")
    parser.add_argument("--steps", type=int, default=None, help="optional cap on optimizer steps")
    parser.add_argument("--batch-size", type=int, default=128, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of --lr")
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=25, help="steps between loss log lines")
    parser.add_argument(
        "--eval-tokens", type=int, default=262_144, help="held-out tokens for the final evaluation (all if fewer available)"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (off by default)")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    if args.tiny:  # the preset only replaces values the user left at their defaults
        for key, value in TINY_DEFAULTS.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    return args


def build_config(vocab_size: int, eos_id: int, intermediate_size: int, tiny: bool) -> MixtralConfig:
    """Mixtral config with only generic fields, so transformers 5.17 and 5.24 both load it."""
    return MixtralConfig(
        vocab_size=vocab_size,
        intermediate_size=intermediate_size,
        **(TINY_MODEL if tiny else FULL_MODEL),
        max_position_embeddings=1024,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        output_router_logits=True,  # training: load-balancing loss on
        router_aux_loss_coef=0.01,
        router_jitter_noise=0.0,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},  # short context: classic base
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def count_params(model: torch.nn.Module, config: MixtralConfig) -> dict[str, int]:
    """Total parameters and the share one token actually uses (top-k of the experts)."""
    total = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * config.num_experts_per_tok // config.num_local_experts
    return {"total": total, "experts": experts, "active_per_token": active}


class TokenSampler:
    """Random training windows.  The whole token stream (~20M uint16) lives on the device,
    so a batch is one gather: no loader workers, no host-to-device copy of the tokens."""

    def __init__(self, path: Path, seq_len: int, batch_size: int, device: torch.device, seed: int) -> None:
        tokens = np.fromfile(path, dtype=np.uint16).astype(np.int32)
        self.tokens = torch.from_numpy(tokens).to(device)
        self.offsets = torch.arange(seq_len + 1, device=device)
        self.batch_size, self.seq_len, self.device = batch_size, seq_len, device
        self.generator = torch.Generator().manual_seed(seed)  # CPU generator: same order on every device

    def __len__(self) -> int:
        return self.tokens.numel()

    def next_batch(self) -> torch.Tensor:
        """[batch, seq_len + 1] int64 windows; inputs are [:, :-1], targets [:, 1:]."""
        starts = torch.randint(0, len(self) - self.seq_len - 1, (self.batch_size, 1), generator=self.generator)
        starts = starts.pin_memory() if self.device.type == "cuda" else starts
        index = starts.to(self.device, non_blocking=True) + self.offsets
        return self.tokens[index].long()


def heldout_windows(path: Path, rows: int, cols: int) -> torch.Tensor:
    """``rows`` windows of ``cols`` tokens spread evenly over the held-out stream."""
    tokens = np.fromfile(path, dtype=np.uint16)
    starts = np.linspace(0, tokens.size - cols, rows).astype(np.int64)
    return torch.from_numpy(np.stack([tokens[s : s + cols] for s in starts]).astype(np.int32))


def lr_factor(step: int, progress: float, warmup_steps: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to ``min_ratio`` over training progress in [0, 1]."""
    warmup = min(1.0, (step + 1) / max(1, warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return warmup * (min_ratio + (1.0 - min_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> torch.optim.AdamW:
    """AdamW; no weight decay on norm gains (1-D tensors)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def autocast(device: torch.device) -> AbstractContextManager:
    """bf16 autocast on CUDA; CPU smoke tests run in plain fp32."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def forward_losses(
    model: torch.nn.Module, batch: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
    """Mean next-token cross-entropy (fp32), the load-balancing aux loss and router logits.

    The loss is computed here rather than via ``labels=`` so that all seq_len positions are
    predicted and the cross-entropy stays separate from the aux term.
    """
    with autocast(device):
        out = model(input_ids=batch[:, :-1], output_router_logits=True, use_cache=False)
    logits = out.logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
    return ce, getattr(out, "aux_loss", None), getattr(out, "router_logits", None) or ()


@dataclass
class TrainResult:
    steps: int
    tokens_seen: int
    train_seconds: float
    log: list[dict[str, float]]


def train(
    model: torch.nn.Module,
    sampler: TokenSampler,
    args: argparse.Namespace,
    device: torch.device,
    after_step: Callable[[tuple[torch.Tensor, ...]], None] | None = None,
) -> TrainResult:
    """Train until the time budget or the step cap is reached; the lr schedule ends with it.

    A family without a load-balancing loss (DeepSeek-V3 balances with a routing bias instead) has no
    `router_aux_loss_coef` and returns no aux loss: only the cross-entropy is minimised, and
    `after_step(router_logits)` may update whatever balances its routing."""
    optimizer = make_optimizer(model, args, device)
    coef = getattr(model.config, "router_aux_loss_coef", 0.0)
    budget = args.minutes * 60.0
    log, step, start = [], 0, time.perf_counter()
    ce_sum = aux_sum = torch.zeros((), device=device)
    window_steps = 0
    model.train()
    while True:
        elapsed = time.perf_counter() - start
        progress = max(elapsed / budget, step / args.steps if args.steps else 0.0)
        if progress >= 1.0:
            break
        lr = args.lr * lr_factor(step, progress, args.warmup_steps, args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ce, aux, router_logits = forward_losses(model, sampler.next_batch(), device)
        aux = torch.zeros((), device=device) if aux is None else aux
        (ce + coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(router_logits)
        step += 1
        ce_sum, aux_sum, window_steps = ce_sum + ce.detach(), aux_sum + aux.detach(), window_steps + 1
        if step % args.log_every == 0:  # the loop's only explicit host sync
            seconds = time.perf_counter() - start
            entry = {
                "step": step,
                "tokens": step * args.batch_size * args.seq_len,
                "loss": round(ce_sum.item() / window_steps, 4),
                "aux_loss": round(aux_sum.item() / window_steps, 4),
                "lr": lr,
                "seconds": round(seconds, 1),
            }
            log.append(entry)
            print(
                f"step {step:6d}  loss {entry['loss']:.4f}  aux {entry['aux_loss']:.4f}  "
                f"lr {lr:.2e}  {entry['tokens'] / seconds:,.0f} tok/s  {seconds:.0f}s",
                flush=True,
            )
            ce_sum = aux_sum = torch.zeros((), device=device)
            window_steps = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return TrainResult(step, step * args.batch_size * args.seq_len, time.perf_counter() - start, log)


class RoutingStats:
    """Accumulates per-layer routing statistics from router logits of shape [B*T, E].

    top-k of the softmax equals top-k of the logits (softmax is monotonic), so logits are used.
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int, seed: int) -> None:
        self.num_experts, self.top_k = num_experts, top_k
        self.load = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.overlap = torch.zeros(num_layers, dtype=torch.float64)  # consecutive tokens
        self.overlap_shuffled = torch.zeros(num_layers, dtype=torch.float64)  # random token pairs
        self.pairs = 0
        self.generator = torch.Generator().manual_seed(seed)

    def update(self, router_logits: tuple[torch.Tensor, ...], batch: int, seq: int) -> None:
        perm = torch.randperm(batch * seq, generator=self.generator)
        for layer, logits in enumerate(router_logits):
            top = logits.float().topk(self.top_k, dim=-1).indices.cpu()
            chosen = torch.zeros(batch * seq, self.num_experts, dtype=torch.bool)
            chosen.scatter_(1, top, True)
            self.load[layer] += chosen.sum(0)
            per_seq = chosen.view(batch, seq, self.num_experts)
            self.overlap[layer] += (per_seq[:, 1:] & per_seq[:, :-1]).sum()
            shuffled = chosen[perm].view(batch, seq, self.num_experts)
            self.overlap_shuffled[layer] += (per_seq[:, 1:] & shuffled[:, 1:]).sum()
        self.pairs += batch * (seq - 1)

    def summary(self) -> dict[str, object]:
        """Skew: assignment share of the top 25% experts (uniform: 0.25).
        Reuse: share of a token's top-k also chosen by the previous token (random: k/E).
        Reuse if tokens were independent but routed with this layer's loads: shuffled pairs."""
        top_quarter = max(1, self.num_experts // 4)
        share = self.load / self.load.sum(-1, keepdim=True)
        skew = share.sort(-1, descending=True).values[:, :top_quarter].sum(-1)
        reuse = self.overlap / (self.pairs * self.top_k)
        reuse_independent = self.overlap_shuffled / (self.pairs * self.top_k)
        return {
            # E|A ∩ B| = k*k/E for independent uniform k-subsets A, B of E experts; divided by k.
            "uniform_skew": top_quarter / self.num_experts,
            "uniform_random_reuse": self.top_k / self.num_experts,
            "skew_top25pct_share": rounded(skew),
            "skew_mean": round(float(skew.mean()), 4),
            "reuse": rounded(reuse),
            "reuse_mean": round(float(reuse.mean()), 4),
            "reuse_independent_tokens": rounded(reuse_independent),
            "reuse_independent_tokens_mean": round(float(reuse_independent.mean()), 4),
            "expert_load": [rounded(row) for row in share],
        }


def rounded(values: torch.Tensor) -> list[float]:
    return [round(float(x), 4) for x in values]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, heldout_path: Path, seq_len: int, max_tokens: int, device: torch.device, seed: int
) -> dict[str, object]:
    """Cross-entropy and routing statistics over non-overlapping held-out windows."""
    model.eval()
    tokens = torch.from_numpy(np.fromfile(heldout_path, dtype=np.uint16).astype(np.int64))
    n_windows = min((tokens.numel() - 1) // seq_len, math.ceil(max_tokens / seq_len))
    windows = tokens[: n_windows * seq_len + 1]
    config = model.config
    stats = RoutingStats(config.num_hidden_layers, config.num_local_experts, config.num_experts_per_tok, seed)
    total_nll, rows_per_batch = 0.0, 64
    for first in range(0, n_windows, rows_per_batch):
        rows = range(first, min(first + rows_per_batch, n_windows))
        batch = torch.stack([windows[r * seq_len : (r + 1) * seq_len + 1] for r in rows]).to(device)
        ce, _, router_logits = forward_losses(model, batch, device)
        total_nll += ce.item() * batch.size(0) * seq_len
        stats.update(router_logits, batch.size(0), seq_len)
    loss = total_nll / (n_windows * seq_len)
    return {
        "tokens": n_windows * seq_len,
        "seq_len": seq_len,
        "loss": round(loss, 4),
        "perplexity": round(math.exp(loss), 3),
        "routing": stats.summary(),
    }


def save_model(model: MixtralForCausalLM, out: Path, data: Path, heldout: torch.Tensor) -> dict[str, int]:
    """Write the loadable model directory; returns file sizes in bytes."""
    out.mkdir(parents=True, exist_ok=True)
    # Inference default: no router logits, so `labels=` losses are pure cross-entropy.
    # Pass output_router_logits=True explicitly to inspect routing.
    model.config.output_router_logits = False
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id
    )
    model.save_pretrained(out)
    for item in (data / "tokenizer").iterdir():
        shutil.copy2(item, out / item.name)
    save_file(
        {"input_ids": heldout.contiguous()},
        str(out / "heldout_tokens.safetensors"),
        metadata={"source": "heldout.bin", "rows": str(heldout.size(0)), "cols": str(heldout.size(1))},
    )
    return {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}


def loss_summary(log: list[dict[str, float]]) -> dict[str, object]:
    if not log:
        return {}
    tail = [e["loss"] for e in log[-5:]]
    return {
        "first": log[0]["loss"],
        "min": min(e["loss"] for e in log),
        "last": log[-1]["loss"],
        "last5_mean": round(sum(tail) / len(tail), 4),
        "curve": log,
    }


def main() -> None:
    args = parse_args()
    wall_start = time.perf_counter()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    torch.set_float32_matmul_precision("high")  # TF32 for any fp32 matmul left outside autocast
    meta = json.loads((args.data / "meta.json").read_text())

    config = build_config(meta["vocab_size"], meta["eos_token_id"], args.intermediate_size, args.tiny)
    model = MixtralForCausalLM(config)  # initialised on CPU: identical init on every device
    params = count_params(model, config)
    save_dtype = torch.bfloat16  # see CHECKPOINT_BUDGET_BYTES / FILE_LIMIT_BYTES
    print(
        f"params: {params['total']:,} total, {params['active_per_token']:,} active/token; "
        f"fp32 {params['total'] * 4 / 1e6:.1f} MB, bf16 {params['total'] * 2 / 1e6:.1f} MB",
        flush=True,
    )
    model.to(device)
    step_model = torch.compile(model) if args.compile else model

    sampler = TokenSampler(args.data / "train.bin", args.seq_len, args.batch_size, device, args.seed)
    result = train(step_model, sampler, args, device)

    model.to(save_dtype)  # evaluate exactly the weights that are shipped
    heldout = evaluate(model, args.data / "heldout.bin", args.seq_len, args.eval_tokens, device, args.seed)
    heldout_rows = heldout_windows(args.data / "heldout.bin", HELDOUT_ROWS, HELDOUT_COLS)
    files = save_model(model, args.out, args.data, heldout_rows)
    checkpoint_bytes = sum(size for name, size in files.items() if name != "training_report.json")
    if checkpoint_bytes > CHECKPOINT_BUDGET_BYTES:
        print(f"WARNING: checkpoint is {checkpoint_bytes:,} bytes, over the {CHECKPOINT_BUDGET_BYTES:,} budget")
    for name, size in files.items():
        if size > FILE_LIMIT_BYTES:
            print(f"WARNING: {name} is {size:,} bytes, over the {FILE_LIMIT_BYTES:,}-byte per-file limit")

    report = {
        "model": "mira-tiny",
        "architecture": "MixtralForCausalLM",
        "config": {
            k: getattr(config, k)
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "num_local_experts",
                "num_experts_per_tok",
                "router_aux_loss_coef",
            )
        },
        "params": params,
        "save_dtype": str(save_dtype).removeprefix("torch."),
        "checkpoint_bytes": checkpoint_bytes,
        "files": files,
        "steps": result.steps,
        "tokens_seen": result.tokens_seen,
        "epochs": round(result.tokens_seen / len(sampler), 3),
        "train_tokens_available": len(sampler),
        "tokens_per_second": round(result.tokens_seen / max(result.train_seconds, 1e-9)),
        "train_loss": loss_summary(result.log),
        "heldout": heldout,
        "train_seconds": round(result.train_seconds, 1),
        "wall_seconds": round(time.perf_counter() - wall_start, 1),
        "experts_implementation": model.config._experts_implementation,
        "attn_implementation": model.config._attn_implementation,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__},
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "data": meta,
    }
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print_summary(report)


def print_summary(report: dict) -> None:
    routing = report["heldout"]["routing"]
    print("\n=== mira-tiny training summary ===")
    print(
        f"params {report['params']['total']:,} ({report['params']['active_per_token']:,} active/token), "
        f"checkpoint {report['checkpoint_bytes'] / 1e6:.2f} MB ({report['save_dtype']})"
    )
    print(
        f"steps {report['steps']}, tokens {report['tokens_seen']:,} ({report['epochs']} epochs), "
        f"{report['tokens_per_second']:,} tok/s, train {report['train_seconds']}s, wall {report['wall_seconds']}s"
    )
    print(
        f"train loss {report['train_loss'].get('last')} (last log window)  held-out loss {report['heldout']['loss']} "
        f"ppl {report['heldout']['perplexity']} over {report['heldout']['tokens']:,} tokens"
    )
    print(
        f"routing skew (top-25% share, uniform {routing['uniform_skew']}): mean {routing['skew_mean']}  "
        f"per layer {routing['skew_top25pct_share']}"
    )
    print(
        f"routing reuse (uniform {routing['uniform_random_reuse']}): mean {routing['reuse_mean']}  "
        f"per layer {routing['reuse']}  (independent tokens: {routing['reuse_independent_tokens_mean']})"
    )
    print(
        f"device {report['device']}, experts impl {report['experts_implementation']}, "
        f"torch {report['versions']['torch']}, transformers {report['versions']['transformers']}"
    )


if __name__ == "__main__":
    main()
