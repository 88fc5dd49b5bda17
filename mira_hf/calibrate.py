"""`calibrate(model, data)`: record a wrapped model's routing and train its `learned` predictor.

1. Record: teacher-forced full-sequence forwards (no grad) with `model.mira.recorder` set, keeping
   for every token the hidden state entering each MoE block and the experts that block chose.
2. Train: for each layer L, a `LayerNet` mapping L's hidden state to the experts of L+1 .. L+lookahead
   (BCE with `pos_weight`: a missed expert stalls the step, an extra one only costs bandwidth) and to
   the experts layer L gives the next token (unweighted BCE: those probabilities rank evictions).
3. Install it as `model.mira.predictor` (used from the next step on) and report recall/precision on a
   held-out split at the manager's confidence cut.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_threads import cpu_threads
from .errors import ConfigError, require_decoder_only
from .learned import LayerNet, LearnedPredictor, choose_sizes, model_parameters
from .trace import require_every_layer_routed

FORWARD_TOKENS = 8192  # tokens per calibration forward (padded batch): bounds activation memory
SPLIT_CHUNK_TOKENS = 64  # validation tokens are held out in runs this long, so neighbours rarely straddle the split


def calibrate(
    model: nn.Module,
    data,
    *,
    lookahead: int | None = None,
    epochs: int = 30,
    batch_size: int = 256,
    lr: float = 3e-3,
    pos_weight: float = 4.0,
    max_tokens: int = 16384,
    validation_fraction: float = 0.1,
    tokenizer=None,
    out_dir: str | os.PathLike | None = None,
    progress: bool = True,
    seed: int = 0,
    host_only_unused: bool = False,
) -> LearnedPredictor:
    """Train a `learned` predictor for the wrapped `model`, install it as `model.mira.predictor`, return it.

    data: token ids (a LongTensor [batch, seq] or [seq]), an iterable of such tensors, or strings (one,
        or a list) tokenised with `tokenizer` (default: `AutoTokenizer.from_pretrained(model.name_or_path)`).
    lookahead: layers ahead each layer predicts (default: the manager's `PredictorConfig.lookahead`).
    epochs, batch_size (tokens per step), lr: Adam training of all layers' networks at once.
    pos_weight: weight of a missed expert relative to a wrongly staged one (3-5 work well).
    max_tokens: tokens recorded at most. Recording keeps every MoE layer's hidden state per token, in the
        model's dtype: tokens × layers × hidden × 2 bytes for bf16 (16384 tokens ≈ 4.3 GB for Mixtral-8x7B).
    validation_fraction: share of tokens held out (in runs of 64) for the reported recall/precision.
    out_dir: also save the predictor there (as `model.mira.save_predictor(out_dir)` would).
    host_only_unused: mark the experts the data never routed to as host-only (`model.mira.set_host_only`):
        they then never hold a GPU slot between uses. The counts are in `predictor.summary["expert_counts"]`.
    """
    manager = getattr(model, "mira", None)
    if manager is None:
        raise ConfigError(
            f"calibrate needs a model wrapped by mira-hf, got a plain {type(model).__name__}. Wrap it first: "
            "MiraMoEModel.wrap(model, MiraConfig(...)) or MiraMoEModel.from_pretrained(...)."
        )
    lookahead = manager.predictor_config.lookahead if lookahead is None else lookahead
    if lookahead < 1 or epochs < 1 or batch_size < 1 or max_tokens < 2 or pos_weight <= 0:
        raise ConfigError(
            f"calibrate: lookahead={lookahead}, epochs={epochs}, batch_size={batch_size} must be ≥ 1, max_tokens={max_tokens} "
            f"≥ 2 and pos_weight={pos_weight} > 0."
        )
    if not 0 <= validation_fraction < 1:
        raise ConfigError(f"calibrate: validation_fraction={validation_fraction} must be in [0, 1).")

    hidden, experts, has_next = _record(model, data, max_tokens=max_tokens, tokenizer=tokenizer, progress=progress)
    layers = manager.layers
    # within-step heads L+1 .. L+lookahead, then the next-step head (target L itself, always last)
    targets = {L: [L + d for d in range(1, lookahead + 1) if L + d in layers] + [L] for L in sorted(layers) if L in hidden}
    out_sizes = {L: [layers[t].num_experts for t in ts] for L, ts in targets.items()}
    H = next(iter(hidden.values())).shape[1]
    rank, width = choose_sizes(H, [sum(o) for o in out_sizes.values()], model_parameters(model))

    with torch.random.fork_rng(devices=[]):  # seeded init and shuffles, without touching the caller's RNG
        torch.manual_seed(seed)
        nets = {L: LayerNet(H, rank, width, out_sizes[L]) for L in targets}
        N = next(iter(experts.values())).shape[0]
        train_idx, val_idx = _split(N, validation_fraction)
        if len(train_idx) < 2:
            raise ConfigError(
                f"calibrate: the data gave {N} token(s), {len(train_idx)} to train on (validation_fraction="
                f"{validation_fraction}); training needs at least 2. Give more data."
            )
        # the next token's experts; a sequence's last token (no next token) is labelled with its own
        following = torch.where(has_next, torch.arange(N) + 1, torch.arange(N))
        labels = {
            L: _multi_hot([experts[t] if t != L else experts[L][following] for t in targets[L]], out_sizes[L]) for L in targets
        }  # [N, O] per layer
        weights = {L: _pos_weights(out_sizes[L], pos_weight) for L in targets}
        final_loss = _train(nets, hidden, labels, train_idx, manager.device, epochs, batch_size, lr, weights, progress)
    cut = manager.predictor_config.confidence
    validation = _evaluate(nets, hidden, labels, targets, val_idx, cut) if len(val_idx) else {}
    E = {L: layers[L].num_experts for L in experts}  # (an expert-parallel sentinel index E is not an expert)
    counts = {L: torch.bincount(experts[L].reshape(-1).long(), minlength=E[L])[: E[L]].tolist() for L in experts}
    if host_only_unused:
        manager.set_host_only({L: [e for e, n in enumerate(c) if n == 0] for L, c in counts.items()})
    summary = {
        "samples": int(len(train_idx)),
        "validation_samples": int(len(val_idx)),
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": lr,
        "pos_weight": pos_weight,
        "final_loss": final_loss,
        "confidence": cut,
        "validation": validation,  # {predicted layer: {"recall@d": ..., "precision@d": ...}}
        "expert_counts": {str(L): c for L, c in counts.items()},  # routings per expert in the data
    }
    predictor = LearnedPredictor(
        {L: net.cpu() for L, net in nets.items()},
        targets,
        hidden_size=H,
        rank=rank,
        width=width,
        lookahead=lookahead,
        config=manager.predictor_config,
        summary=summary,
    ).to(manager.device)
    manager.predictor = predictor
    if progress:
        _print_report(predictor, model_parameters(model))
    if out_dir is not None:
        manager.save_predictor(out_dir)
    return predictor


# -- recording ------------------------------------------------------------------------------------
def _record(
    model: nn.Module, data, *, max_tokens: int, tokenizer, progress: bool
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], torch.Tensor]:
    """Teacher-forced routing of `data` through the wrapped `model`: per MoE layer, the hidden state
    entering the block `[N, H]` (model dtype, CPU) and the experts it chose `[N, K]`, for the same N tokens
    in the same order (each sequence's tokens consecutive); and `has_next [N]`: whether token i+1 is the
    next token of token i's sequence. The manager's recorder and predictor are restored afterwards."""
    require_decoder_only(model, "calibrate")
    manager = model.mira
    hidden: dict[int, list[torch.Tensor]] = {}
    experts: dict[int, list[torch.Tensor]] = {}
    has_next: list[torch.Tensor] = []

    def recorder(layer: int, h: torch.Tensor, top_k_index: torch.Tensor) -> None:
        hidden.setdefault(layer, []).append(h.detach().to("cpu", copy=True))  # [B*S, H]
        experts.setdefault(layer, []).append(top_k_index.detach().to("cpu", copy=True))  # [B*S, K]

    saved = manager.recorder, manager.predictor, model.training
    manager.recorder, manager.predictor = recorder, None  # no staging while recording: nothing would use it
    model.eval()
    bar = _bar(progress, min(max_tokens, data.numel()) if isinstance(data, torch.Tensor) else None, "recording routing", "tok")
    total = 0
    try:
        with torch.no_grad():
            for ids, mask in _batches(_sequences(model, data, tokenizer), max_tokens):
                start = {L: len(v) for L, v in hidden.items()}
                model(
                    input_ids=ids.to(model.device),
                    attention_mask=None if mask is None else mask.to(model.device),
                    use_cache=False,
                )
                if mask is not None:  # drop the padding rows every layer recorded
                    keep = mask.reshape(-1).bool()
                    for store in (hidden, experts):
                        for L, parts in store.items():
                            parts[start.get(L, 0) :] = [p[keep] for p in parts[start.get(L, 0) :]]
                lengths = [ids.shape[1]] * ids.shape[0] if mask is None else mask.sum(1).tolist()
                has_next += [torch.arange(n) < n - 1 for n in lengths if n]
                n = int(ids.numel() if mask is None else mask.sum())
                total += n
                if bar is not None:
                    bar.update(n)
    finally:
        manager.recorder, manager.predictor = saved[0], saved[1]
        model.train(saved[2])
        if bar is not None:
            bar.close()
    if total == 0 or not hidden:
        raise ConfigError("calibrate: the data held no tokens (or the model routed none): give at least one sequence.")
    require_every_layer_routed(manager.layers, {L: sum(len(p) for p in parts) for L, parts in experts.items()}, total)
    return (
        {L: torch.cat(v) for L, v in sorted(hidden.items())},
        {L: torch.cat(v) for L, v in sorted(experts.items())},
        torch.cat(has_next),
    )


def _sequences(model: nn.Module, data, tokenizer) -> Iterator[torch.Tensor]:
    """1-D int64 token sequences from a tensor, an iterable of tensors, or strings."""
    if isinstance(data, str):
        data = [data]
    if isinstance(data, torch.Tensor):
        data = [data]
    if isinstance(data, (list, tuple)) and data and all(isinstance(s, str) for s in data):
        tok = tokenizer or _tokenizer(model)
        limit = getattr(model.config, "max_position_embeddings", None)
        for text in data:
            ids = tok(text, truncation=limit is not None, max_length=limit)["input_ids"]
            yield torch.as_tensor(ids, dtype=torch.long)
        return
    if not isinstance(data, Iterable):
        raise ConfigError(f"calibrate: data of type {type(data).__name__} is not supported. " + _DATA_HELP)
    for item in data:
        t = item if isinstance(item, torch.Tensor) else None
        if t is None or t.is_floating_point() or t.is_complex() or t.dim() not in (1, 2):
            shown = f"a {tuple(t.shape)} {t.dtype} tensor" if t is not None else type(item).__name__
            raise ConfigError(f"calibrate: got {shown} in data. " + _DATA_HELP)
        if t.numel():  # an empty tensor holds no sequence
            yield from t.long().reshape(-1, t.shape[-1]).cpu()


_DATA_HELP = "Pass token ids (a LongTensor [batch, seq] or [seq], or an iterable of them) or a list of strings."


def _tokenizer(model: nn.Module):
    from transformers import AutoTokenizer

    name = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"calibrate was given strings, but no tokenizer could be loaded from the model's path {name!r} ({exc}). "
            "Pass calibrate(..., tokenizer=AutoTokenizer.from_pretrained(...)), or token ids instead of strings."
        ) from exc


def _batches(sequences: Iterator[torch.Tensor], max_tokens: int) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """Right-padded batches `(ids [B, S], mask [B, S] or None when nothing is padded)` of at most
    FORWARD_TOKENS cells, holding the first `max_tokens` tokens of `sequences`."""
    batch: list[torch.Tensor] = []
    left = max_tokens
    for seq in sequences:
        if left <= 0:
            break
        seq = seq[:left]
        if len(seq) == 0:
            continue
        left -= len(seq)
        if batch and (len(batch) + 1) * max(len(seq), max(len(s) for s in batch)) > FORWARD_TOKENS:
            yield _pad(batch)
            batch = []
        batch.append(seq)
    if batch:
        yield _pad(batch)


def _pad(batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    S = max(len(s) for s in batch)
    if all(len(s) == S for s in batch):
        return torch.stack(batch), None
    ids = torch.zeros(len(batch), S, dtype=torch.long)
    mask = torch.zeros(len(batch), S, dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return ids, mask


# -- training -------------------------------------------------------------------------------------
def _split(n: int, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token indices (train, validation): whole runs of SPLIT_CHUNK_TOKENS go to validation."""
    chunks = torch.arange(n).split(SPLIT_CHUNK_TOKENS)
    n_val = min(len(chunks) - 1, math.ceil(fraction * len(chunks))) if fraction > 0 else 0
    order = torch.randperm(len(chunks)).tolist()
    val = sorted(order[:n_val])
    train = sorted(order[n_val:])
    pick = lambda ids: torch.cat([chunks[i] for i in ids]) if ids else torch.empty(0, dtype=torch.long)  # noqa: E731
    return pick(train), pick(val)


def _multi_hot(indices: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """Per target layer `[N, K]` expert indices -> `[N, sum(sizes)]` 0/1 labels, heads side by side."""
    parts = []
    for idx, E in zip(indices, sizes):
        y = torch.zeros(idx.shape[0], E)
        y.scatter_(1, idx.long(), 1.0)
        parts.append(y)
    return torch.cat(parts, dim=1)


def _pos_weights(out_sizes: list[int], pos_weight: float) -> torch.Tensor:
    """Per output: `pos_weight` for the within-step heads (a missed expert stalls, an extra one costs
    bandwidth), 1 for the next-step head (last), whose probabilities must stay calibrated: they rank
    evictions as expected distances."""
    return torch.cat([torch.full((n,), pos_weight) for n in out_sizes[:-1]] + [torch.ones(out_sizes[-1])])


def _train(nets, hidden, labels, train_idx, device, epochs, batch_size, lr, pos_weights, progress) -> float:
    """Adam on every layer's network at once (independent losses, summed). Returns the last epoch's
    mean loss per layer and token."""
    for L, net in nets.items():
        x = hidden[L][train_idx].float()  # [n, H]
        net.shift.copy_(x.mean(0))
        net.scale.copy_(1 / x.std(0).clamp_min(1e-6))
        net.to(device).train()
    opt = torch.optim.Adam([p for net in nets.values() for p in net.parameters()], lr=lr)
    steps = epochs * math.ceil(len(train_idx) / batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    weights = {L: w.to(device) for L, w in pos_weights.items()}
    bar = _bar(progress, epochs, "training predictor", "epoch")
    mean_loss = float("nan")
    with _few_threads(device):
        for _ in range(epochs):
            total = torch.zeros((), device=device)
            for batch in train_idx[torch.randperm(len(train_idx))].split(batch_size):
                loss = sum(
                    F.binary_cross_entropy_with_logits(
                        net(hidden[L][batch].to(device)), labels[L][batch].to(device), pos_weight=weights[L]
                    )
                    for L, net in nets.items()
                )
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                total += loss.detach() * len(batch)
            mean_loss = float(total) / len(train_idx) / len(nets)  # one sync per epoch
            if bar is not None:
                bar.set_postfix(loss=f"{mean_loss:.4f}")
                bar.update(1)
    if bar is not None:
        bar.close()
    for net in nets.values():
        net.eval()
    return mean_loss


def _few_threads(device: torch.device):
    """One CPU thread while training on the CPU: each op takes microseconds, and OpenMP's fork/join costs
    more than a second thread gives (2 cores: 2.7 ms per step on one thread, 10-300 ms on two when the
    cores are shared). Restored afterwards."""
    return cpu_threads(1) if device.type == "cpu" else nullcontext()


@torch.no_grad()
def _evaluate(nets, hidden, labels, targets, idx, cut: float) -> dict[str, dict[str, float | None]]:
    """recall@d and precision@d of `p ≥ cut` per token (a one-token decode step), keyed like the
    manager's telemetry: by the predicted layer, d = how many layers ahead the prediction was made."""
    counts: dict[tuple[int, int], list[int]] = {}
    for L, net in nets.items():
        p = torch.sigmoid(net(hidden[L][idx].to(net.shift.device))).cpu()  # [n, O]
        heads = zip(targets[L], (p >= cut).split(net.out_sizes, 1), labels[L][idx].bool().split(net.out_sizes, 1))
        for target, hit, used in heads:  # [n, E] each
            counts[(target, target - L)] = [int((hit & used).sum()), int((hit & ~used).sum()), int((~hit & used).sum())]
    out: dict[str, dict[str, float | None]] = {}
    for (target, d), (tp, fp, fn) in sorted(counts.items()):
        row = out.setdefault(str(target), {})
        at = d if d > 0 else "next"  # d = 0: the next-step head (the same layer, next token)
        row[f"recall@{at}"] = tp / (tp + fn) if tp + fn else None
        row[f"precision@{at}"] = tp / (tp + fp) if tp + fp else None
    return out


def _bar(enabled: bool, total: int | None, desc: str, unit: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit)


def _print_report(predictor: LearnedPredictor, n_model: int) -> None:
    s = predictor.summary
    n = predictor.num_parameters()
    print(
        f"learned predictor: {len(predictor.nets)} layers, rank {predictor.rank}, width {predictor.width}, "
        f"{n:,} parameters ({100 * n / n_model:.2f}% of the model), {s['samples']:,} tokens × {s['epochs']} epochs, "
        f"final loss {s['final_loss']:.4f}"
    )
    if not s["validation"]:
        return
    print(f"held-out ({s['validation_samples']:,} tokens, confidence ≥ {s['confidence']}):")
    for L, row in s["validation"].items():
        cells = "  ".join(f"{k} {v:.3f}" if v is not None else f"{k} -" for k, v in row.items())
        print(f"  layer {L}: {cells}")
