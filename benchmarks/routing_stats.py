"""Statistics of recorded MoE routing: how skewed each layer's load is, how much a token re-uses the
previous token's experts, and how well one layer's experts predict the next layer's.

Routing is given per MoE layer as expert indices `[N, T, K]` (N sequences of T consecutive tokens, K
experts per token; -1 pads layers that route fewer). Every number is a mean over layers, with the
layer minimum and maximum beside it, and chance (what uniform i.i.d. routing gives) where it applies.
"""

from __future__ import annotations

import math

import torch

TOP_SHARE_FRACTION = 0.2  # "share of the top 20% of experts"


def load_stats(idx: torch.Tensor, num_experts: int) -> dict:
    """One layer's load over all tokens of `idx [N, T, K]`: max/mean expert load, share of routing taken by
    the top 20% of experts (at least one), entropy of the load over ln(E) (1 = perfectly balanced)."""
    picks = idx[idx >= 0].reshape(-1)
    counts = torch.bincount(picks, minlength=num_experts).double()
    total = counts.sum().item()
    if total == 0:
        return dict(max_over_mean=None, top20_share=None, entropy=None)
    p = counts / total
    top = max(1, round(TOP_SHARE_FRACTION * num_experts))
    nz = p[p > 0]
    return dict(
        max_over_mean=(counts.max() / counts.mean()).item(),
        top20_share=p.sort(descending=True).values[:top].sum().item(),
        entropy=(-(nz * nz.log()).sum() / math.log(num_experts)).item() if num_experts > 1 else 1.0,
    )


def reuse(idx: torch.Tensor) -> float | None:
    """Mean share of a token's experts that the previous token of its sequence also used (`idx [N, T, K]`)."""
    N, T, K = idx.shape
    if T < 2:
        return None
    prev, cur = idx[:, :-1], idx[:, 1:]  # [N, T-1, K]
    same = (cur[..., :, None] == prev[..., None, :]) & (cur[..., :, None] >= 0)  # [N, T-1, K, K]
    hits = same.any(dim=-1).sum(dim=-1).double()  # [N, T-1]
    used = (cur >= 0).sum(dim=-1).clamp(min=1).double()
    return (hits / used).mean().item()


def next_layer_recall(a: torch.Tensor, b: torch.Tensor, num_experts_b: int) -> dict:
    """How well layer `a`'s experts predict layer `b`'s for the same token (`a`, `b` [N, T, K]): co-occurrence
    counts from the first half of the tokens rank layer-b experts for each token of the second half (the sum
    of the counts of its layer-a experts); recall = share of its true layer-b experts among the top K.
    `popularity`: the same recall when the K most used layer-b experts of the first half are predicted."""
    K = b.shape[-1]
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, K)  # [M, K]: tokens in order, sequences one after another
    half = a.shape[0] // 2
    if half == 0:
        return dict(cooccurrence=None, popularity=None)
    Ea = max(int(a.max().item()) + 1, 1)
    counts = torch.zeros(Ea, num_experts_b, dtype=torch.float64)
    for i in range(a.shape[1]):
        for j in range(K):
            ok = (a[:half, i] >= 0) & (b[:half, j] >= 0)
            counts.index_put_((a[:half, i][ok], b[:half, j][ok]), torch.ones(int(ok.sum()), dtype=torch.float64), accumulate=True)
    test_a, test_b = a[half:], b[half:]
    score = counts[test_a.clamp(min=0)].masked_fill((test_a < 0)[..., None], 0).sum(dim=1)  # [M2, Eb]
    pred = score.topk(K, dim=-1).indices  # [M2, K]
    popular = counts.sum(dim=0).topk(K).indices  # [K]

    def recall(p: torch.Tensor) -> float:
        hit = (test_b[..., :, None] == p[..., None, :]).any(dim=-1) & (test_b >= 0)
        return (hit.sum(dim=-1).double() / (test_b >= 0).sum(dim=-1).clamp(min=1)).mean().item()

    return dict(cooccurrence=recall(pred), popularity=recall(popular.expand_as(test_b)))


def routing_stats(layers: list[torch.Tensor], num_experts: list[int]) -> dict:
    """All statistics of one recording: `layers[l]` is MoE layer l's routing `[N, T, K]`."""
    loads = [load_stats(idx, e) for idx, e in zip(layers, num_experts)]
    reuses = [reuse(idx) for idx in layers]
    pairs = [next_layer_recall(layers[i], layers[i + 1], num_experts[i + 1]) for i in range(len(layers) - 1)]
    K = layers[0].shape[-1] if layers else 0
    out = dict(
        tokens=int(layers[0].shape[0] * layers[0].shape[1]) if layers else 0,
        sequences=int(layers[0].shape[0]) if layers else 0,
        chance_reuse=K / num_experts[0] if layers else None,
        chance_top20_share=max(1, round(TOP_SHARE_FRACTION * num_experts[0])) / num_experts[0] if layers else None,
    )
    for key in ("max_over_mean", "top20_share", "entropy"):
        out[key] = _summary([s[key] for s in loads])
    out["reuse"] = _summary(reuses)
    out["next_layer_recall"] = _summary([p["cooccurrence"] for p in pairs])
    out["next_layer_recall_popularity"] = _summary([p["popularity"] for p in pairs])
    return out


def _summary(values: list) -> dict | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return dict(mean=sum(vals) / len(vals), min=min(vals), max=max(vals))


def from_records(records: list, batch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Split a generate call's recorder calls `(layer, top_k_index [rows, K])` into the prompt's routing and the
    decode's, each a list over MoE layers of `[batch, T, K]`. The first call of each layer is the prefill
    (`batch * S` rows, sequence-major); every later call is one decode step (`batch` rows)."""
    by_layer: dict[int, list[torch.Tensor]] = {}
    for layer, idx in records:
        by_layer.setdefault(layer, []).append(idx.detach().to("cpu", torch.long))
    prompt, decode = [], []
    for layer in sorted(by_layer):
        calls = by_layer[layer]
        first = calls[0]
        prompt.append(first.reshape(batch, first.shape[0] // batch, -1))
        steps = [c.reshape(batch, 1, -1) for c in calls[1:] if c.shape[0] == batch]
        decode.append(torch.cat(steps, dim=1) if steps else first.new_zeros((batch, 0, first.shape[-1])))
    return prompt, decode
