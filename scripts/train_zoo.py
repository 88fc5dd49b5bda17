#!/usr/bin/env python3
"""Train the model zoo: small trained MoE models of four routing regimes, each on its own text domain.

Why: the cache's eviction, admission and staging rules must hold on routing other than mira-tiny's
(8 experts, top-2). Each zoo model is a real transformers family at tiny dimensions, so the
adapters are exercised, trained long enough for its routing to specialise:

| name | family | routed experts | top-k | shared expert | domain |
|---|---|---|---|---|---|
| deepseek-64x6 | deepseek_v3 | 64 (8 groups, 4 chosen) | 6 | 1 | transformers' Python sources |
| qwen3-128x8 | qwen3_moe | 128 | 8 | - | the standard library (tests left out) |
| olmoe-32x4 | olmoe | 32 | 4 | - | torch's Python sources |
| qwen2-16x4 | qwen2_moe | 16 | 4 | 1 | installed packages' docs (.md, .rst, .txt) |

Every model uses the bundled mira-tiny tokenizer (byte-level BPE: any text encodes), so one model's
held-out text can calibrate another's predictor (cross-domain evaluation). The text is what every
Python install has; its exact file list is fingerprinted in each model's training_report.json.
DeepSeek-V3 has no load-balancing loss: as in its paper, each router's score-correction bias moves
by ``--bias-rate`` towards balance after every step.

Reproducible: fixed seeds for init and data order; ``--steps N --minutes 1e9`` gives a step-exact
run (with a time budget the step count depends on the machine). One thread by default
(``--threads``); on a GPU ``--device cuda``.

    python scripts/train_zoo.py [--dir ~/.cache/mira-hf/zoo] [--models qwen2-16x4 ...] [--minutes 4]

Output: DIR/<name>/ with config.json, model.safetensors, tokenizer files,
heldout_tokens.safetensors ("input_ids", int32 [64, 256]) and training_report.json (held-out
loss, routing skew and token-to-token reuse from benchmarks/routing_stats.py).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import prepare_tiny_data as data_prep  # noqa: E402
import train_tiny_moe as trainer  # noqa: E402
from routing_stats import routing_stats  # noqa: E402

from mira_hf.bundled import bundled_model_path  # noqa: E402

HELDOUT_ROWS, HELDOUT_COLS = 64, 256
DOC_SUFFIXES = (".md", ".rst", ".txt")
MIN_DOC_BYTES = 1024  # smaller .txt files are metadata (top_level.txt, entry_points.txt), not prose
COMMON = dict(hidden_size=96, num_attention_heads=4, max_position_embeddings=512, tie_word_embeddings=True)


@dataclass(frozen=True)
class ZooModel:
    """One zoo member: a transformers config class and its fields, and the text it learns."""

    name: str
    config_class: str
    fields: dict
    domain: str


ZOO = {
    m.name: m
    for m in (
        ZooModel(
            "deepseek-64x6",
            "DeepseekV3Config",
            dict(
                num_hidden_layers=5,
                first_k_dense_replace=1,
                num_key_value_heads=4,
                intermediate_size=192,
                moe_intermediate_size=32,
                n_routed_experts=64,
                num_experts_per_tok=6,
                n_shared_experts=1,
                n_group=8,
                topk_group=4,
                kv_lora_rank=32,
                q_lora_rank=48,
                qk_rope_head_dim=8,
                qk_nope_head_dim=16,
                v_head_dim=24,
            ),
            "transformers-sources",
        ),
        ZooModel(
            "qwen3-128x8",
            "Qwen3MoeConfig",
            dict(
                num_hidden_layers=4,
                num_key_value_heads=2,
                head_dim=24,
                intermediate_size=192,
                moe_intermediate_size=32,
                num_experts=128,
                num_experts_per_tok=8,
                norm_topk_prob=True,
                router_aux_loss_coef=0.001,
            ),
            "stdlib",
        ),
        ZooModel(
            "olmoe-32x4",
            "OlmoeConfig",
            dict(
                num_hidden_layers=4,
                num_key_value_heads=4,
                intermediate_size=64,
                num_experts=32,
                num_experts_per_tok=4,
                router_aux_loss_coef=0.01,
            ),
            "torch-sources",
        ),
        ZooModel(
            "qwen2-16x4",
            "Qwen2MoeConfig",
            dict(
                num_hidden_layers=4,
                num_key_value_heads=2,
                intermediate_size=192,
                moe_intermediate_size=64,
                shared_expert_intermediate_size=128,
                num_experts=16,
                num_experts_per_tok=4,
                norm_topk_prob=False,
                router_aux_loss_coef=0.001,
            ),
            "package-docs",
        ),
    )
}


def build_config(model: ZooModel, vocab_size: int, eos_id: int = data_prep.EOS_ID) -> transformers.PretrainedConfig:
    """The zoo member's transformers config (tiny dimensions, real family)."""
    fields = dict(COMMON, **model.fields, vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    if "router_aux_loss_coef" in fields:
        fields["output_router_logits"] = True  # training: the load-balancing loss on
    return getattr(transformers, model.config_class)(**fields)


# -- text domains ---------------------------------------------------------------------------------
def _read_text(path: Path, max_bytes: int, min_bytes: int = 1) -> str | None:
    data = path.read_bytes()
    if len(data) < min_bytes or len(data) > max_bytes or not data.strip():
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def domain_files(domain: str, max_bytes: int) -> list[data_prep.SourceFile]:
    """The documents of one text domain, in sorted order."""
    stdlib, site = Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])
    if domain == "stdlib":  # its test suite left out: some installs do not ship it
        paths = [p for p in data_prep.python_files(stdlib) if p.relative_to(stdlib).parts[0] != "test"]
        root, min_bytes = stdlib, 1
    elif domain in ("torch-sources", "transformers-sources"):  # dependencies: every install has them
        package = Path((torch if domain == "torch-sources" else transformers).__file__).parent
        paths, root, min_bytes = sorted(package.rglob("*.py")), package.parent, 1
    elif domain == "package-docs":
        paths = sorted(p for p in site.rglob("*") if p.suffix in DOC_SUFFIXES and "__pycache__" not in p.parts)
        root, min_bytes = site, MIN_DOC_BYTES
    else:
        raise SystemExit(f"unknown domain {domain!r}")
    files = []
    for path in paths:
        if path.is_file() and (text := _read_text(path, max_bytes, min_bytes)) is not None:
            files.append(data_prep.SourceFile(f"{domain}/{path.relative_to(root).as_posix()}", text))
    return data_prep.deduplicate(files)


def prepare_domain(domain: str, tokenizer: Tokenizer, out: Path, args: argparse.Namespace) -> dict:
    """Tokenize one domain into out/train.bin and out/heldout.bin (uint16, files separated by EOS); a
    directory prepared with the same arguments is reused."""
    key = dict(domain=domain, **{k: getattr(args, k) for k in ("max_file_kb", "heldout_permille", "max_train_tokens", "seed")})
    done = out / "meta.json"
    if done.exists() and json.loads(done.read_text()).get("key") == key:
        return json.loads(done.read_text())
    files = domain_files(domain, args.max_file_kb * 1024)
    heldout = [f for f in files if data_prep.is_heldout(f.name, args.seed, args.heldout_permille)]
    train = [f for f in files if not data_prep.is_heldout(f.name, args.seed, args.heldout_permille)]
    train_ids, n_train = data_prep.tokenize(tokenizer, train, args.max_train_tokens)
    heldout_ids, n_heldout = data_prep.tokenize(tokenizer, heldout, None)
    if heldout_ids.size < HELDOUT_ROWS * HELDOUT_COLS * 2:
        raise SystemExit(f"domain {domain}: only {heldout_ids.size} held-out tokens; raise --heldout-permille")
    out.mkdir(parents=True, exist_ok=True)
    train_ids.tofile(out / "train.bin")
    heldout_ids.tofile(out / "heldout.bin")
    meta = dict(
        key=key,
        domain=domain,
        train_tokens=int(train_ids.size),
        heldout_tokens=int(heldout_ids.size),
        train_files=n_train,
        heldout_files=n_heldout,
        corpus_sha256=data_prep.fingerprint(train[:n_train] + heldout),
    )
    done.write_text(json.dumps(meta, indent=2) + "\n")
    return meta


# -- DeepSeek-V3's balancing: the score-correction bias -------------------------------------------
def bias_balancer(model: torch.nn.Module, rate: float):
    """After each step, move each router's `e_score_correction_bias` by `rate` towards balance: up for
    experts chosen less than the mean, down for those chosen more (DeepSeek-V3's auxiliary-loss-free
    balancing; the group restriction is left out of the load count). The routers' logits of the step's
    forward are taken by a hook on each router (not every transformers version returns them). None if
    the family has no bias."""
    gates = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    if not gates:
        return None
    k = model.config.num_experts_per_tok
    seen: dict[torch.nn.Module, torch.Tensor] = {}

    def keep(gate, args, output) -> None:
        seen[gate] = (output[0] if isinstance(output, tuple) else output).detach()

    for gate in gates:
        gate.register_forward_hook(keep)

    @torch.no_grad()
    def after_step(router_logits: tuple[torch.Tensor, ...]) -> None:
        for gate in gates:  # logits [tokens, E]
            bias = gate.e_score_correction_bias
            top = (seen.pop(gate).float().sigmoid() + bias).topk(k, dim=-1).indices
            load = torch.bincount(top.reshape(-1), minlength=bias.numel()).float()
            bias += rate * torch.sign(load.mean() - load)

    return after_step


# -- routing statistics of the trained model -------------------------------------------------------
@torch.no_grad()
def routing_report(model_dir: Path, heldout: torch.Tensor) -> dict:
    """Skew (share of the top 20% experts) and token-to-token reuse on held-out windows, from the
    routing a wrapped model records (the adapters' own routing hook)."""
    from mira_hf import MiraConfig, MiraMoEModel
    from mira_hf.trace import record_topk

    model = MiraMoEModel.from_pretrained(
        str(model_dir), MiraConfig(gpu_budget=1.0, device="cpu"), dtype=torch.float32, progress=False
    )
    rows = heldout[:16].long()  # [16, 256]
    topk = record_topk(model, list(rows), progress=False)  # {layer: [16*256, K]}
    layers = [topk[layer].reshape(rows.shape[0], rows.shape[1], -1) for layer in sorted(topk)]
    num_experts = [model.mira.layers[layer].num_experts for layer in sorted(topk)]
    return routing_stats(layers, num_experts)


def train_one(spec: ZooModel, args: argparse.Namespace, tokenizer: Tokenizer, tokenizer_dir: Path) -> dict:
    wall = time.perf_counter()
    out = args.dir / spec.name
    data_dir = args.dir / "data" / spec.domain
    meta = prepare_domain(spec.domain, tokenizer, data_dir, args)
    print(f"[{spec.name}] {spec.domain}: {meta['train_tokens']:,} train / {meta['heldout_tokens']:,} held-out tokens", flush=True)

    torch.manual_seed(args.seed)
    config = build_config(spec, tokenizer.get_vocab_size())
    model = transformers.AutoModelForCausalLM.from_config(config)  # initialised on CPU: the same on every device
    device = torch.device(args.device)
    model.to(device)
    sampler = trainer.TokenSampler(data_dir / "train.bin", args.seq_len, args.batch_size, device, args.seed)
    result = trainer.train(model, sampler, args, device, after_step=bias_balancer(model, args.bias_rate))

    model.to(torch.bfloat16)
    heldout_rows = trainer.heldout_windows(data_dir / "heldout.bin", HELDOUT_ROWS, HELDOUT_COLS)
    loss = heldout_loss(model, heldout_rows, device)
    model.config.output_router_logits = False
    model.generation_config = transformers.GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for item in tokenizer_dir.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens")):
            (out / item.name).write_bytes(item.read_bytes())
    from safetensors.torch import save_file

    save_file({"input_ids": heldout_rows.contiguous()}, str(out / "heldout_tokens.safetensors"))
    routing = routing_report(out, heldout_rows)
    params = sum(p.numel() for p in model.parameters())
    report = dict(
        model=spec.name,
        family=config.model_type,
        architecture=type(model).__name__,
        config=spec.fields,
        params=params,
        steps=result.steps,
        tokens_seen=result.tokens_seen,
        train_seconds=round(result.train_seconds, 1),
        wall_seconds=round(time.perf_counter() - wall, 1),
        train_loss=trainer.loss_summary(result.log),
        heldout_loss=round(loss, 4),
        heldout_perplexity=round(math.exp(loss), 2),
        routing=routing,
        data=meta,
        device=str(device),
        threads=torch.get_num_threads(),
        versions=dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__),
        date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    )
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"[{spec.name}] {result.steps} steps, {result.tokens_seen:,} tokens, {result.train_seconds:.0f}s; held-out loss {loss:.3f}; "
        f"top-20% share {routing['top20_share']['mean']:.3f} (uniform {routing['chance_top20_share']:.3f}), "
        f"reuse {routing['reuse']['mean']:.3f} (chance {routing['chance_reuse']:.3f})",
        flush=True,
    )
    return report


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, rows: torch.Tensor, device: torch.device) -> float:
    model.eval()
    total = 0.0
    for batch in rows.long().split(16):
        ce, _, _ = trainer.forward_losses(model, batch.to(device), device)
        total += ce.item() * batch.shape[0]
    return total / rows.shape[0]


def zoo_fingerprint() -> str:
    """A hash of the zoo's definitions: a trained directory from other definitions is stale."""
    return hashlib.sha256(json.dumps({k: vars(v) for k, v in ZOO.items()}, sort_keys=True, default=str).encode()).hexdigest()[:16]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path(os.path.expanduser("~/.cache/mira-hf/zoo")), help="where the models go")
    ap.add_argument("--models", nargs="*", default=list(ZOO), choices=list(ZOO))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for training")
    ap.add_argument("--minutes", type=float, default=4.0, help="wall-clock budget of each model's training loop")
    ap.add_argument("--steps", type=int, default=None, help="optional cap on optimizer steps")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--bias-rate", type=float, default=1e-3, help="DeepSeek-V3 routing-bias update per step")
    ap.add_argument("--max-train-tokens", type=int, default=4_000_000)
    ap.add_argument("--max-file-kb", type=int, default=512)
    ap.add_argument("--heldout-permille", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    tokenizer_dir = Path(bundled_model_path())
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    reports = {name: train_one(ZOO[name], args, tokenizer, tokenizer_dir) for name in args.models}
    index = args.dir / "zoo.json"
    known = json.loads(index.read_text())["models"] if index.exists() else {}
    known.update({name: dict(family=r["family"], domain=r["data"]["domain"]) for name, r in reports.items()})
    index.write_text(json.dumps(dict(fingerprint=zoo_fingerprint(), models=known), indent=2) + "\n")


if __name__ == "__main__":
    main()
