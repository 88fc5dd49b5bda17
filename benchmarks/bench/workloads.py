"""What the benchmark runs: each workload's model (a real shape with random weights, or the bundled trained model),
its prompts, a saved copy for accelerate, and the byte counts the limit and the tables use."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import torch
from common import random_model_on_device
from transformers import AutoModelForCausalLM

from . import GB

# workload key -> (label, shape on the GPU, shape in --smoke: common.SMOKE_SHAPES); shape None = the bundled trained model
WORKLOADS = {
    "mixtral": ("Mixtral-8x7B shape, 8 layers (random bf16)", "mixtral-8x7b-8l", "mixtral-smoke"),
    "qwen3": ("Qwen3-30B-A3B shape, 12 layers (random bf16)", "qwen3-30b-a3b-12l", "qwen3-smoke"),
    "bundled": ("mira-tiny, bundled trained model (real routing)", None, None),
}


@dataclass
class Workload:
    key: str
    label: str
    shape: str | None  # a SHAPES key; None = the bundled model
    seed: int
    facts: dict = field(default_factory=dict)  # filled from the first model built
    checkpoint: str | None = None  # saved copy for accelerate (random shapes only)
    checkpoint_save_s: float | None = None
    _scratch: str | None = None  # a temporary folder of this workload (checkpoint, accelerate's offload)

    def build(self, device: str):
        """A fresh model: random shapes are built directly on `device` (same seed, so the same weights
        every time); the bundled model is loaded on the CPU (mira wraps it from there)."""
        if self.shape is not None:
            return random_model_on_device(self.shape, device=device, seed=self.seed)
        return AutoModelForCausalLM.from_pretrained(bundled_dir(), dtype=torch.bfloat16).eval()

    def prompts(self, batch: int, length: int, vocab: int, device: str) -> torch.Tensor:
        """[batch, length] token ids: held-out text for the bundled model, else seeded random ids."""
        if self.shape is None:
            from safetensors.torch import load_file

            flat = load_file(os.path.join(bundled_dir(), "heldout_tokens.safetensors"))["input_ids"].reshape(-1)
            if flat.numel() < batch * length:
                raise ValueError(f"held-out tokens hold {flat.numel()} ids, fewer than {batch} prompts of {length}.")
            ids = flat[: batch * length].view(batch, length)  # 512-token prompts = two consecutive 256-token rows
        else:
            g = torch.Generator().manual_seed(self.seed + 1)
            ids = torch.randint(3, vocab, (batch, length), generator=g)  # 0..2 are special ids
        return ids.long().to(device)

    def scratch(self, tmp_root: str, name: str) -> str:
        """A fresh folder `name` in this workload's temporary folder (removed by `cleanup`)."""
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix=f"mira-bench-{self.key}-", dir=tmp_root)
        path = os.path.join(self._scratch, name)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return path

    def save_checkpoint(self, model, tmp_root: str) -> str:
        """Save `model` once as a local transformers checkpoint (bf16, large shards) for accelerate."""
        if self.checkpoint is None:
            need = int(self.facts["total_bytes"] * 1.05) + 2 * 10**9
            free = shutil.disk_usage(tmp_root).free
            if free < need:
                raise RuntimeError(
                    f"not enough disk in {tmp_root} to save the model: {free / GB:.1f} GB free, {need / GB:.1f} GB needed. "
                    "Point --tmp-dir at a disk with room."
                )
            path = self.scratch(tmp_root, "checkpoint")
            t0 = time.perf_counter()
            model.save_pretrained(path, max_shard_size="5GB")
            self.checkpoint_save_s = time.perf_counter() - t0
            self.checkpoint = path
        return self.checkpoint

    def cleanup(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        self._scratch = self.checkpoint = None


def bundled_dir() -> str:
    try:
        from mira_hf.bundled import bundled_model_path

        return bundled_model_path()
    except ImportError:
        return os.path.join(_REPO, "mira_hf", "bundled", "mira-tiny")


def model_facts(model) -> dict:
    """Byte counts of a freshly built (unwrapped) model; the routed experts found by its adapter."""
    from model_adapters import get_adapter  # here: the tree under test is on sys.path by now (ab_revisions.py)

    adapter = get_adapter(model.config.model_type)
    experts = adapter.find_experts(model) if adapter else []
    expert_bytes = sum(p.numel() * p.element_size() for _, m in experts for p in m.parameters(recurse=False))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == emb.data_ptr()
    non_expert = total - expert_bytes
    E = experts[0][1].num_experts if experts else 0
    cfg = model.config
    top_k = getattr(cfg, "num_experts_per_tok", None) or 1
    return dict(
        model_type=cfg.model_type,
        moe_layers=len(experts),
        num_experts=E,
        top_k=top_k,
        vocab_size=cfg.vocab_size,
        total_bytes=total,
        expert_bytes=expert_bytes,
        non_expert_bytes=non_expert,
        # A token reads one row of the input embedding table, so the table is left out of "touched".
        non_expert_touched_bytes=non_expert - (0 if tied else emb.numel() * emb.element_size()),
        raw_record_bytes=expert_bytes // max(len(experts) * E, 1),
        pad_token_id=_pad_id(model),
        max_positions=getattr(cfg, "max_position_embeddings", None),
    )


def _pad_id(model) -> int:
    gen = getattr(model, "generation_config", None)
    for v in (
        getattr(gen, "pad_token_id", None),
        getattr(model.config, "pad_token_id", None),
        getattr(gen, "eos_token_id", None),
    ):
        if isinstance(v, list):
            v = v[0] if v else None
        if isinstance(v, int):
            return v
    return 0


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
