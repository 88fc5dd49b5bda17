"""The predictors that learn from routing online (`markov`, `position`, `global`, `hybrid`) read each block's routing on
the host only once the block has synchronised (`routed`), or when their guess is read: what they count is the
routing, in the order the blocks ran, and on a GPU observing and predicting make no synchronising call."""

from __future__ import annotations

import pytest
import torch

from mira_hf.config import PredictorConfig
from mira_hf.predictors import GlobalPredictor, HybridPredictor, MarkovPredictor, PositionPredictor

E, K = 4, 2
LAYERS = [0, 1]
# (layer, routing [T, K]) in the order the blocks run: a prefill of two tokens, then two decode steps
TRACE = [
    (0, [[0, 1], [1, 3]]),
    (1, [[2, 3], [0, 3]]),
    (0, [[0, 2]]),
    (1, [[2, 1]]),
    (0, [[3, 0]]),
    (1, [[2, 3]]),
]


def _router(device: str):
    weights = {layer: torch.randn(8, E, generator=torch.Generator().manual_seed(layer)).to(device) for layer in LAYERS}
    return lambda layer, hidden: torch.softmax(hidden.float() @ weights[layer], dim=-1)


def _build(name: str, device: str = "cpu"):
    config = PredictorConfig(markov_warmup_tokens=1_000)
    experts, top_k = dict.fromkeys(LAYERS, E), dict.fromkeys(LAYERS, K)
    markov = lambda: MarkovPredictor(LAYERS, experts, top_k, config)  # noqa: E731
    position = lambda: PositionPredictor(LAYERS, experts, top_k, config)  # noqa: E731
    return {
        "markov": markov,
        "position": position,
        "global": lambda: GlobalPredictor(LAYERS, experts, top_k, _router(device), config),
        "hybrid": lambda: HybridPredictor(markov(), position(), switch_tokens=3),
    }[name]()


def _hidden(step: int, rows: int, device: str) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(100 + step)).to(device)


def _run(predictor, device: str, routed: bool) -> list[dict]:
    """Each block of `TRACE`: observe, predict, then (`routed`) staging's call after the block's sync; the guesses
    read last, as staging reads them. Returns each block's guesses on the host."""
    out = []
    for step, (layer, routing) in enumerate(TRACE):
        index = torch.tensor(routing).to(device)
        predictor.observe(layer, _hidden(step, index.shape[0], device), index)
        guesses = predictor.predict(layer, _hidden(step, index.shape[0], device))
        if device == "cuda":
            torch.cuda.synchronize()  # the block's sync
        if routed:
            predictor.routed(layer)
        out.append({t: p.cpu() for t, p in guesses.items()})
    return out


def test_markov_counts_each_transition_once_its_block_has_synchronised():
    """Counted by hand from `TRACE`: layer 0 → 1 within a token (the last token's experts at 0 to its experts at 1),
    and within a layer from token to token (a prefill's own consecutive tokens, then the previous block's last token
    to this block's last). Observing counts nothing; `routed` counts the block."""
    markov = _build("markov")
    for layer, routing in TRACE:
        before = markov.temporal[layer].clone()
        markov.observe(layer, _hidden(0, len(routing), "cpu"), torch.tensor(routing))
        assert torch.equal(markov.temporal[layer], before)
        markov.routed(layer)
        assert not torch.equal(markov.temporal[layer], before)
    cross = [[0, 1, 2, 1], [1, 0, 0, 1], [0, 1, 1, 0], [1, 0, 1, 2]]
    temporal = {
        0: [[1, 1, 0, 2], [1, 1, 1, 1], [1, 0, 0, 1], [1, 0, 1, 0]],
        1: [[0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 1, 2], [1, 1, 1, 1]],
    }
    assert torch.equal(markov.cross[0], 1 + torch.tensor(cross, dtype=torch.float))  # 1: the Laplace prior
    assert all(torch.equal(markov.temporal[layer], 1 + torch.tensor(temporal[layer], dtype=torch.float)) for layer in LAYERS)


def test_position_counts_the_recent_rows_of_each_layer():
    """Layer 1's window holds its four rows (2 + 1 + 1 tokens): expert 3 in three of them, 2 in three, 0 and 1 in one
    each; a guess from layer 0 for layer 1 reads those shares."""
    position = _build("position")
    guesses = _run(position, "cpu", routed=True)
    # the last layer-0 block's guess for layer 1 is read after layer 0's block, before layer 1's last one
    assert torch.allclose(guesses[4][1], torch.tensor([1, 1, 2, 2]) / 3)
    assert torch.equal(position._freq[1], torch.tensor([1.0, 1, 3, 3]))


@pytest.mark.parametrize("name", ["markov", "position", "global", "hybrid"])
def test_guesses_do_not_depend_on_when_the_routing_is_read(name):
    """Read in staging's order (`routed` after the block's sync, then the guesses) or with no `routed` at all (the
    guess's read settles what was kept), a predictor guesses the same at every block: deferring the host's read
    of the routing changes no count and no order."""
    assert all(
        a.keys() == b.keys() and all(torch.equal(a[t], b[t]) for t in a)
        for a, b in zip(_run(_build(name), "cpu", routed=True), _run(_build(name), "cpu", routed=False))
    )


def test_a_layer_kept_again_before_it_was_read_keeps_both_blocks():
    """Two blocks of one layer observed with no `routed` and no read between them (their buffer is reused on a GPU):
    both are counted, in order, at the next read."""
    position = _build("position")
    position.observe(1, _hidden(0, 1, "cpu"), torch.tensor([[0, 1]]))
    position.observe(1, _hidden(1, 1, "cpu"), torch.tensor([[0, 2]]))
    dict(position.predict(0, _hidden(2, 1, "cpu")))
    assert torch.equal(position._freq[1], torch.tensor([2.0, 1, 1, 0])) and len(position._window[1]) == 2


def test_reset_forgets_routing_not_yet_read():
    markov = _build("markov")
    markov.observe(0, _hidden(0, 1, "cpu"), torch.tensor([[0, 1]]))
    markov.reset()
    markov.routed(0)
    assert torch.equal(markov.temporal[0], torch.ones(E, E)) and dict(markov.predict(0, _hidden(0, 1, "cpu"))) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["markov", "position", "global", "hybrid"])
def test_on_the_gpu_observing_and_predicting_make_no_synchronising_call(name):
    """On CUDA a block's routing reaches the host by a non-blocking copy that the block's sync completes: `observe` and
    `predict` make no synchronising call (one would make the host wait for the device's queued work, copies
    included, and the payoff gate would charge that wait to prediction), and every guess equals the CPU's on the
    same routing, blocks after the first included (each layer's pinned buffer is rewritten by its next block)."""
    predictor = _build(name, "cuda")
    index, hidden = torch.tensor(TRACE[0][1], device="cuda"), _hidden(0, 2, "cuda")
    predictor.observe(0, hidden, index)  # the first block makes the layer's buffer and event
    predictor.predict(0, hidden)
    predictor.reset()
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    guesses = []
    for step, (layer, routing) in enumerate(TRACE):
        index, hidden = torch.tensor(routing, device="cuda"), _hidden(step, len(routing), "cuda")
        torch.cuda.set_sync_debug_mode("error")
        try:
            predictor.observe(layer, hidden, index)
            made = predictor.predict(layer, hidden)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()  # the block's sync
        predictor.routed(layer)
        guesses.append({t: p.cpu() for t, p in made.items()})
    expected = _run(_build(name, "cpu"), "cpu", routed=True)
    assert all(a.keys() == b.keys() and all(torch.allclose(a[t], b[t], atol=1e-6) for t in a) for a, b in zip(guesses, expected))
