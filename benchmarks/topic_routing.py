"""Random-weight MoE models whose routing looks like a trained model's: skewed but spread load, tokens that
re-use the previous token's experts, and layers whose experts predict the next layer's.

A model with random weights routes each token almost independently and almost uniformly (or, for some
shapes, onto a handful of experts): a cache measured on it measures nothing. `shape_routing` sets a few of
the model's own weights (no module is replaced or patched; transformers' routing code runs unchanged):

* **Topics in the residual stream.** The vocabulary is split into `topics` classes (token id modulo
  `topics`); each class gets a unit direction `v_c` of the hidden space. Every embedding row becomes
  `sigma_tok * n_j + beta * v_c(j)` with `n_j` a fresh N(0, 1) row. `sigma_tok` is the per-component
  size of what the layers add to the residual stream (measured), so token identity stays visible at
  every depth; `beta = topic_share * sigma_tok * sqrt(H)` makes the topic a small part of each hidden
  state (`topic_share`^2 of its variance at the first layer) but one that stands far above the noise
  along `v_c` at every layer (the signal-to-noise ratio is measured and reported per layer).
* **Routers that read the topic.** In one calibration forward of topic-walk prompts, a pre-hook on each
  router sets its `[E, H]` weight from the hidden states it is about to route (so each layer is fitted
  to the states the layers before it produce with their new routers):
  `W = (sigma_pop * b + R) V / m + sigma_tok_noise * G / s`, where `V [topics, H]` are the topic
  directions, `m` the mean projection of a token on its own topic's direction, `b [E]` a per-layer
  expert popularity, `R [E, topics]` per-layer topic preferences (both N(0, 1)), and `G [E, H]` random
  directions orthogonal to `V` scaled by the measured spread `s` of their projections. A token's logits
  are then `sigma_pop * b_e + R[e, c] + sigma_tok_noise * xi_e` (plus a little noise from the other topics'
  projections): skew from `b`, reuse from consecutive tokens sharing a topic, next-layer predictability
  from every layer reading the same topic, and token-to-token variation from `xi`.
  `sigma_pop` and `sigma_tok_noise` are solved on that idealised logit model for the targets
  (`solve_logit_model`), then corrected from the routing the calibration forward produced. Each layer's
  `b`, `R` and `G` are the previous layer's, experts relabelled by a random permutation, mixed with fresh
  draws at `layer_correlation`: experts of consecutive layers have affinities, as in trained models.
* **Topics that persist while decoding.** The LM head gets `gamma * v_c(j)` added to each token's row, so
  greedy decoding stays on the current token's topic with the probability the prompts were written with
  (`gamma` solved on the calibration forward's final hidden states).

Prompts are topic walks (`topic_prompts`): a Markov chain that stays on its topic with `p_stay` per token,
each token drawn uniformly from its topic's ids. Everything is seeded; the same call gives the same model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from routing_stats import load_stats, reuse

from model_adapters import get_adapter
from model_adapters.base import auto_adapter


@dataclass(frozen=True)
class RoutingTargets:
    """What the routing should look like (per MoE layer, over a topic-walk prompt)."""

    top20_share: float = 0.40  # share of routing taken by the top 20% of experts
    reuse: float = 0.40  # share of a token's experts the previous token used too
    topics: int = 16  # token classes; each layer's routers prefer a different expert set per class
    p_stay: float = 0.85  # chance that the next token keeps its topic (prompts and greedy decoding)
    layer_correlation: float = 0.6  # of a layer's router parameters with the previous layer's (experts relabelled)
    topic_share: float = 0.25  # topic direction's size relative to a token's embedding, at the first layer
    correction_rounds: int = 2  # calibration forwards after the first, each correcting toward the targets


def topic_of(ids: torch.Tensor, topics: int) -> torch.Tensor:
    return ids % topics


def topic_prompts(batch: int, length: int, vocab: int, topics: int, p_stay: float, seed: int) -> torch.Tensor:
    """[batch, length] token ids in [3, vocab) (0..2 are special ids): a topic walk per row."""
    g = torch.Generator().manual_seed(seed)
    topic = torch.randint(0, topics, (batch,), generator=g)
    rows = []
    for _ in range(length):
        switch = torch.rand(batch, generator=g) >= p_stay
        topic = torch.where(switch, torch.randint(0, topics, (batch,), generator=g), topic)
        rows.append(topic.clone())
    topic = torch.stack(rows, dim=1)  # [B, S]
    first = 3 + (topic - 3) % topics  # smallest id >= 3 of each topic
    span = (vocab - first - 1) // topics + 1  # ids of that topic below vocab
    j = (torch.rand(batch, length, generator=g) * span).long()
    return first + topics * j


# -- the idealised logit model -------------------------------------------------------------------
def _simulate(E: int, K: int, t: RoutingTargets, sigma_pop: float, sigma_noise: float, walk: torch.Tensor) -> tuple[float, float]:
    """(top-20% share, reuse) of logits sigma_pop*b + R[:, c] + sigma_noise*xi over the topic walk `walk [T]`,
    averaged over 4 independent layers (fixed seed: every grid point sees the same draws)."""
    g = torch.Generator().manual_seed(0)
    layers, T = 4, walk.shape[0]
    shares, reuses = [], []
    for _ in range(layers):
        b = torch.randn(E, generator=g)
        R = torch.randn(E, t.topics, generator=g)
        z = sigma_pop * b + R[:, walk].T + sigma_noise * torch.randn(T, E, generator=g)  # [T, E]
        idx = z.topk(K, dim=-1).indices[None]  # [1, T, K]
        shares.append(load_stats(idx, E)["top20_share"])
        reuses.append(reuse(idx))
    return sum(shares) / layers, sum(reuses) / layers


def solve_logit_model(E: int, K: int, t: RoutingTargets, aim: tuple[float, float] | None = None) -> dict:
    """sigma_pop and sigma_noise of the idealised logits closest to `aim` (default: the targets' top-20%
    share and reuse), on a 6 x 6 grid (about a second)."""
    share_aim, reuse_aim = aim or (t.top20_share, t.reuse)
    walk = topic_of(topic_prompts(1, 512, 3 + 64 * t.topics, t.topics, t.p_stay, seed=0)[0], t.topics)
    best = None
    for sp in (0.0, 0.2, 0.4, 0.6, 0.9, 1.3):
        for sn in (0.25, 0.5, 0.75, 1.0, 1.5, 2.5):
            share, re = _simulate(E, K, t, sp, sn, walk)
            err = ((share - share_aim) / 0.05) ** 2 + ((re - reuse_aim) / 0.05) ** 2
            if best is None or err < best[0]:
                best = (err, dict(sigma_pop=sp, sigma_noise=sn, ideal_top20_share=share, ideal_reuse=re))
    return best[1]


# -- shaping a model -----------------------------------------------------------------------------
@dataclass
class _Router:
    layer: int
    weight: torch.Tensor  # [E, H], the router's own parameter
    bias: torch.Tensor | None
    experts: torch.nn.Module
    router: torch.nn.Module


def _routers(model) -> list[_Router]:
    adapter = get_adapter(model.config.model_type) or auto_adapter(model.config.model_type)
    out = []
    for i, (name, experts) in enumerate(adapter.find_experts(model)):
        block = model.get_submodule(name.rsplit(".", 1)[0])
        router = adapter.router(block)
        weight = router
        for part in adapter.router_weight_attr.split("."):
            weight = getattr(weight, part)
        out.append(_Router(i, weight, getattr(router, "bias", None), experts, router))
    return out


def _topic_basis(H: int, topics: int, device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(H, topics, generator=g))  # [H, topics], orthonormal columns
    return q.T.contiguous().to(device)  # [topics, H]


@torch.no_grad()
def shape_routing(model, prompts: torch.Tensor, targets: RoutingTargets = RoutingTargets(), seed: int = 0) -> dict:
    """Set `model`'s embeddings, routers and LM head as the module doc describes, fitted on `prompts`
    ([B, S] topic-walk ids from `topic_prompts` with the same `targets`). Returns what was set and the
    routing statistics of the last calibration forward."""
    cfg = model.config
    emb = model.get_input_embeddings().weight  # [V, H]
    head = model.get_output_embeddings()
    V, H = emb.shape
    dev = emb.device
    routers = _routers(model)
    E, K = routers[0].weight.shape[0], _top_k(cfg)
    basis = _topic_basis(H, targets.topics, dev, seed)  # [topics, H]
    ids = prompts.to(dev)
    topic = topic_of(ids, targets.topics).reshape(-1)  # [B*S]

    # 1. The residual's size beyond the embedding, as the layers build it (before any change).
    hs = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    added = (hs[-2].float() - hs[0].float()).pow(2).mean().sqrt().item()  # per component, at the last layer's input
    del hs
    sigma_tok = max(added, emb.float().std().item())
    beta = targets.topic_share * sigma_tok * math.sqrt(H)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)  # small draws: the same on every device
    gd = torch.Generator(device=dev).manual_seed(seed + 2)  # large ones, drawn where they are used
    rows = torch.randn(V, H, generator=gd, device=dev) * sigma_tok
    rows += beta * basis[topic_of(torch.arange(V, device=dev), targets.topics)]
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    emb.copy_(rows.to(emb.dtype))
    del rows

    # 2. Routers, fitted layer by layer in calibration forwards; then corrected toward the targets.
    per_layer = _layer_draws(len(routers), E, H, targets, g, gd, dev)
    solved = solve_logit_model(E, K, targets)
    history = []
    aim = (targets.top20_share, targets.reuse)
    for round_ in range(1 + targets.correction_rounds):
        fitted, routed, final = _calibrate(model, ids, topic, basis, routers, per_layer, solved, head)
        history.append(dict(round=round_, **solved, **_reached(routed, E, targets)))
        if round_ == targets.correction_rounds:
            break
        # aim the idealised model past the target by what the real model lost or gained
        aim = (aim[0] + targets.top20_share - history[-1]["top20_share"], aim[1] + targets.reuse - history[-1]["reuse"])
        aim = (min(max(aim[0], 0.05), 0.95), min(max(aim[1], 0.02), 0.98))
        solved = solve_logit_model(E, K, targets, aim)
    best = min(history, key=lambda h: h["error"])
    if best is not history[-1]:  # fit again with the closest round's parameters (the routers hold the last round's)
        solved = {k: best[k] for k in solved}
        fitted, routed, final = _calibrate(model, ids, topic, basis, routers, per_layer, solved, head)
        history.append(dict(round="best", **solved, **_reached(routed, E, targets)))

    # 3. The LM head: stay on the current token's topic with p_stay when decoding greedily.
    gamma, stay = (None, None) if tied or head is None else _fit_head(head, final, topic, basis, targets)
    return dict(
        targets=asdict(targets),
        seed=seed,
        hidden_size=H,
        num_experts=E,
        top_k=K,
        sigma_tok=sigma_tok,
        residual_added_rms=added,
        beta=beta,
        tied_embeddings=tied,
        head_gamma=gamma,
        head_stay_fraction=stay,
        rounds=history,
        topic_snr_by_layer=[f["snr"] for f in fitted],
    )


def _layer_draws(L: int, E: int, H: int, targets: RoutingTargets, g, gd, dev) -> list[dict]:
    """Each layer's popularity [E], topic preferences [E, topics] and token directions [E, H]: the previous
    layer's, with experts relabelled by a random permutation, mixed with fresh draws at `layer_correlation`
    (experts of consecutive layers have affinities, under arbitrary expert numbering, as in trained models)."""
    rho = targets.layer_correlation
    out: list[dict] = []
    for _ in range(L):
        fresh = dict(
            popularity=torch.randn(E, generator=g).to(dev),
            preference=torch.randn(E, targets.topics, generator=g).to(dev),
            directions=torch.randn(E, H, generator=gd, device=dev),
        )
        if out:
            perm = torch.randperm(E, generator=g).to(dev)
            fresh = {k: rho * out[-1][k][perm] + math.sqrt(1 - rho**2) * v for k, v in fresh.items()}
        out.append(fresh)
    return out


def _reached(routed: list[torch.Tensor], E: int, targets: RoutingTargets) -> dict:
    """Mean top-20% share and reuse over layers of the calibration routing, and their distance to the targets."""
    share = sum(load_stats(idx, E)["top20_share"] for idx in routed) / len(routed)
    re = sum(reuse(idx) for idx in routed) / len(routed)
    return dict(top20_share=share, reuse=re, error=abs(share - targets.top20_share) + abs(re - targets.reuse))


def _top_k(cfg) -> int:
    for attr in ("num_experts_per_tok", "top_k", "moe_top_k", "num_experts_per_token"):
        k = getattr(cfg, attr, None)
        if isinstance(k, int) and k > 0:
            return k
    raise ValueError(f"{type(cfg).__name__} names no experts-per-token count")


def _calibrate(model, ids, topic, basis, routers, per_layer, solved, head):
    """One forward of `ids` in which each router's pre-hook fits its weight to the hidden states it receives;
    returns per-layer fit facts, each layer's routing [B, S, K] and the LM head's inputs [B*S, H]."""
    fitted: list[dict] = [{} for _ in routers]
    routed: list[torch.Tensor | None] = [None] * len(routers)
    final: list[torch.Tensor] = []
    B, S = ids.shape

    def fit(r: _Router):
        def hook(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()  # [T, H]
            p = per_layer[r.layer]
            proj = x @ basis.T  # [T, topics]
            own = proj.gather(1, topic[:, None]).squeeze(1)  # [T]
            mask = torch.ones_like(proj, dtype=torch.bool).scatter_(1, topic[:, None], False)
            m, noise = own.mean(), proj[mask].std()
            d = p["directions"] - (p["directions"] @ basis.T) @ basis  # [E, H], orthogonal to the topics
            s = (x @ d.T).std()
            w = (solved["sigma_pop"] * p["popularity"][:, None] + p["preference"]) @ basis / m  # [E, H]
            w += solved["sigma_noise"] * d / s
            r.weight.copy_(w.to(r.weight.dtype))
            if r.bias is not None:
                r.bias.zero_()
            fitted[r.layer] = dict(snr=(m / noise).item())

        return hook

    def record(r: _Router):
        def hook(module, args, kwargs):
            # (hidden, top_k_index, top_k_weights); gpt-oss passes router_indices= by keyword
            idx = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
            routed[r.layer] = idx.reshape(B, S, -1).detach().to("cpu", torch.long)

        return hook

    handles = [r.router.register_forward_pre_hook(fit(r)) for r in routers]
    handles += [r.experts.register_forward_pre_hook(record(r), with_kwargs=True) for r in routers]
    if head is not None:
        handles.append(head.register_forward_pre_hook(lambda m, a: final.append(a[0].reshape(-1, a[0].shape[-1]).float())))
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return fitted, routed, final[0] if final else None


def _fit_head(head, final: torch.Tensor, topic: torch.Tensor, basis: torch.Tensor, targets: RoutingTargets):
    """gamma such that the argmax next token keeps the current token's topic on a share p_stay of positions."""
    rows = final[:: max(1, final.shape[0] // 1024)]  # [T', H], at most ~1024 positions
    cur = topic[:: max(1, final.shape[0] // 1024)]
    base = rows @ head.weight.float().T  # [T', V]
    Vsz = base.shape[1]
    vocab_topic = topic_of(torch.arange(Vsz, device=base.device), basis.shape[0])
    bonus = (rows @ basis.T)[:, vocab_topic]  # [T', V]: each token's score along its topic direction

    def stay(gamma: float) -> float:
        nxt = (base + gamma * bonus).argmax(dim=-1)
        return (vocab_topic[nxt] == cur).float().mean().item()

    scale = base.std().item() / max(bonus.std().item(), 1e-12)
    lo, hi = 0.0, scale
    while stay(hi) < targets.p_stay and hi < scale * 1e4:
        hi *= 2
    for _ in range(20):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if stay(mid) < targets.p_stay else (lo, mid)
    gamma = hi
    head.weight.add_((gamma * basis[vocab_topic]).to(head.weight.dtype))
    return gamma, stay(gamma)
