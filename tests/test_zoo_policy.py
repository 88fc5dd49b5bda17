"""The cache's eviction parameters come from the routing it sees, on every routing regime of the model zoo
(scripts/train_zoo.py: DeepSeek-V3 64 experts top-6 + shared, Qwen3 128 top-8, OLMoE 32 top-4, Qwen2-MoE 16
top-4 + shared), not from constants tuned on one model."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from mira_hf import MiraConfig, MiraMoEModel
from mira_hf.config import PredictorConfig
from mira_hf.heat import USE_RATE_DECAYS, HeatConfig, HeatTracker
from mira_hf.predictors import RankCalibration, build_predictor
from mira_hf.replay import replay
from mira_hf.trace import RoutingTrace, record_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import train_zoo  # noqa: E402


def _routing(num_experts: int, top_k: int, steps: int, run_steps: int, seed: int) -> torch.Tensor:
    """[steps, K] expert indices: a random set of top_k experts, kept for `run_steps` steps, then another."""
    g = torch.Generator().manual_seed(seed)
    sets = [torch.randperm(num_experts, generator=g)[:top_k] for _ in range(steps // run_steps + 1)]
    return torch.stack([sets[t // run_steps] for t in range(steps)])


@pytest.fixture(scope="module", params=sorted(train_zoo.ZOO))
def zoo_model(request):
    """Each zoo member's config at its routing shape (small vocabulary), untrained, wrapped."""
    torch.manual_seed(0)
    config = train_zoo.build_config(train_zoo.ZOO[request.param], vocab_size=64)
    model = AutoModelForCausalLM.from_config(config).eval()
    return request.param, MiraMoEModel.wrap(model, MiraConfig(gpu_budget=0.25, device="cpu"))


def test_zoo_configs_build_their_routing_regime(zoo_model):
    name, model = zoo_model
    spec = train_zoo.ZOO[name].fields
    layers = model.mira.layers.values()
    experts = spec.get("n_routed_experts", spec.get("num_experts"))
    assert {(li.num_experts, li.top_k) for li in layers} == {(experts, spec["num_experts_per_tok"])}
    trace = record_trace(model, torch.randint(1, 64, (1, 3)), progress=False)  # the adapters route every layer
    assert trace.experts.shape[1:] == (len(layers), spec["num_experts_per_tok"])


def test_use_rate_memory_follows_how_long_routing_stays_put(zoo_model):
    """Replayed on the model's own layer table, routing that keeps its experts for 40 steps gets a shorter use-rate
    memory (the last steps predict the next) than routing that changes every 2 steps (only the long-run rate
    predicts anything): the same model, other statistics, other parameters."""
    name, model = zoo_model
    infos = sorted(model.mira.layers.values(), key=lambda li: li.ordinal)
    record = model.mira.store.record_bytes
    decays = {}
    for run_steps in (2, 40):
        steps = 120
        experts = torch.stack(
            [_routing(li.num_experts, li.top_k, steps, run_steps, seed=li.ordinal) for li in infos], dim=1
        )  # [steps, L, K]
        trace = RoutingTrace(experts, None, [0], [li.num_experts for li in infos], [record(li.ordinal) for li in infos])
        decays[run_steps] = replay(trace, budget=0.25, policy="heat")["use_rate_decays"]
    for layer in decays[2]:
        assert decays[40][layer] < decays[2][layer], (name, layer, decays)
    assert set(decays[2].values()) | set(decays[40].values()) <= set(USE_RATE_DECAYS)


def test_a_fixed_use_rate_memory_is_kept():
    h = HeatTracker({0: 4}, HeatConfig(use_rate_decay=0.8))
    for t in range(30):
        h.activate(0, [t % 4])
        h.end_step()
    assert h.use_rate_decays() == {0: 0.8}


def test_stationary_routing_gets_the_longest_memory_and_bursts_a_short_one():
    """One tracker, two layers: i.i.d. routing (long memory averages noise away) and routing in 10-step bursts
    (the last steps predict the next)."""
    g = torch.Generator().manual_seed(0)
    h = HeatTracker({0: 16, 1: 16})
    bursts = _routing(16, 2, 400, 10, seed=1)
    for t in range(400):
        h.activate(0, torch.randperm(16, generator=g)[:2].tolist())
        h.activate(1, bursts[t].tolist())
        h.end_step()
    chosen = h.use_rate_decays()
    assert chosen[0] == max(USE_RATE_DECAYS)
    assert chosen[1] <= 0.8


def _gate_after(model, used_ranks: slice, steps: int) -> tuple:
    """A gate predictor of `model` that has seen `steps` decode steps in which the second MoE layer used the experts
    its router ranks `used_ranks` for the first layer's hidden state; returns it, the two layers, and a guess for a
    fresh hidden state with the router's ranking of it."""
    infos = sorted(model.mira.layers.values(), key=lambda li: li.ordinal)
    first, second = infos[0].ordinal, infos[1].ordinal
    gate = build_predictor("gate", infos, model.mira.router_probs, PredictorConfig())
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        h = torch.randn(1, model.config.hidden_size, generator=g)
        gate.predict(first, h)[second]  # read: staging reads every guess it is given
        ranked = model.mira.router_probs(second, h)[0].argsort(descending=True)
        gate.observe(second, h, ranked[used_ranks][None])  # [1, K]
        gate.routed(second)  # the block has synchronised: its routing is scored (as `Staging.block_started` calls it)
    h = torch.randn(1, model.config.hidden_size, generator=g)
    return gate, first, second, gate.predict(first, h)[second], model.mira.router_probs(second, h)[0].argsort(descending=True)


def test_gate_guesses_start_at_chance_whatever_the_router_scoring(zoo_model):
    """Before any decode step is measured, every expert's guess is the layer's chance rate top-k / E, for softmax
    routers over 16 to 128 experts and DeepSeek-V3's sigmoid scores alike (k × a sigmoid score, cut at 1, read
    1.0 for every expert); nothing is staged at stage_probability."""
    name, model = zoo_model
    gate, first, second, guess, _ = _gate_after(model, slice(0, 1), steps=0)
    li = model.mira.layers[second]
    assert torch.allclose(guess, torch.full((li.num_experts,), li.top_k / li.num_experts)), name
    calibration = gate.calibration[(second, 1)]
    assert calibration.ranks == min(li.num_experts, 4 * li.top_k)
    assert (guess < PredictorConfig().stage_probability).all()


def test_gate_guesses_follow_the_measured_use_of_each_router_rank(zoo_model):
    """The same router, other routing statistics, other probabilities: where the layer uses the router's own top-k
    experts, those ranks approach 1 and the rest 0; where it uses the experts the router ranks just below its
    top-k, the top-k ranks approach 0."""
    name, model = zoo_model
    k = model.mira.layers[sorted(model.mira.layers)[1]].top_k
    _, _, _, guess, ranked = _gate_after(model, slice(0, k), steps=40)
    assert guess[ranked[:k]].min() > 0.9 and guess[ranked[k:]].max() < 0.1, (name, guess)
    _, _, _, guess, ranked = _gate_after(model, slice(k, 2 * k), steps=40)
    assert guess[ranked[:k]].max() < 0.1 and guess[ranked[k : 2 * k]].min() > 0.9, (name, guess)


def test_a_block_of_tokens_reads_each_tokens_ranks_and_takes_the_union():
    """Prefill blocks are scored where their scores are (no host sync) and give the union over tokens of what one
    token at a time gives; only one-token blocks are measured."""
    calibration = RankCalibration(32, 4)
    calibration.used[:] = torch.arange(16, -1, -1).double().numpy()  # rank 0 used 16 times in 20, ..., the rest never
    calibration.seen[:] = 20
    scores = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    block = calibration.probabilities(scores)
    singles = torch.stack([calibration.probabilities(scores[i : i + 1]) for i in range(5)])
    assert torch.allclose(block, 1 - torch.prod(1 - singles, dim=0), atol=1e-6)
    seen = calibration.seen.copy()
    calibration.probabilities(scores)  # a block's guess is not scored
    calibration.observe(torch.tensor([[0, 1, 2, 3]]))  # even a one-token block after it
    assert (calibration.seen == seen).all()


def _read_guess(gate, layer: int, target: int, hidden: torch.Tensor) -> None:
    """Read `gate`'s guess from `layer` for `target`, as staging does after the block's sync (here: a sync of its own)."""
    guesses = gate.predict(layer, hidden)
    if hidden.is_cuda:
        torch.cuda.synchronize()
    guesses[target]


def _gate_with_a_pending_guess(model, device: str):
    """A gate predictor over `model`'s first two MoE layers that has guessed the second layer's experts for one token
    (the guess read, as staging reads it), with that token's hidden state and the router's ranking of it."""
    infos = sorted(model.mira.layers.values(), key=lambda li: li.ordinal)
    first, second = infos[0].ordinal, infos[1].ordinal
    gate = build_predictor("gate", infos, model.mira.router_probs, PredictorConfig())
    h = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(device)
    _read_guess(gate, first, second, h)
    ranked = model.mira.router_probs(second, h)[0].argsort(descending=True)
    return gate, second, h, ranked[: infos[1].top_k][None]  # [1, K]: the router's own top-k used


def test_a_decode_blocks_routing_is_scored_once_the_block_has_synchronised(zoo_model):
    """`observe` only keeps a one-token block's routing; `routed` (the block's sync done) scores the guess for it,
    once: observing never reads the routing on the host, so on a GPU it waits for none of the device's work."""
    _, model = zoo_model
    gate, second, h, used = _gate_with_a_pending_guess(model, "cpu")
    calibration = gate.calibration[(second, 1)]
    seen, counted = calibration.seen.copy(), calibration.used.copy()
    gate.observe(second, h, used)
    assert (calibration.seen == seen).all() and (calibration.used == counted).all()
    gate.routed(second)
    assert calibration.seen.sum() == seen.sum() + model.mira.layers[second].num_experts  # every rank guessed once
    assert calibration.used.sum() == counted.sum() + used.shape[1]  # each used expert counted at its rank
    after = calibration.seen.copy()
    gate.routed(second)  # nothing kept any more
    assert (calibration.seen == after).all()


def test_a_kept_routing_that_was_never_scored_is_dropped_at_the_layers_next_block(zoo_model):
    """A block whose `routed` never came (prediction paused at the step boundary in between) leaves its routing
    kept; the layer's next block drops it, so a later `routed` never scores an old block's experts."""
    _, model = zoo_model
    gate, second, h, used = _gate_with_a_pending_guess(model, "cpu")
    calibration = gate.calibration[(second, 1)]
    seen = calibration.seen.copy()
    gate.observe(second, h, used)
    calibration._pending = None  # that guess was dropped meanwhile (a new sequence): nothing left to score
    gate.observe(second, h, used)
    gate.routed(second)
    assert (calibration.seen == seen).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_observing_a_decode_block_on_the_gpu_makes_no_synchronising_call(tiny_checkpoint):
    """The gate predictor keeps a decode block's routing with a non-blocking copy (the block's own sync completes
    it): a synchronising call there would make the host wait for the device's queued work, copies included, and the
    payoff gate would charge that wait to prediction. Scored after the sync, the counts are those of the routing."""
    import copy

    model = MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), MiraConfig(gpu_budget=0.5, device="cuda"), progress=False)
    gate, second, h, used = _gate_with_a_pending_guess(model, "cuda")
    gate.observe(second, h, used)  # the first block makes the layer's pinned buffer
    gate.routed(second)
    _read_guess(gate, min(model.mira.layers), second, h)  # the next step's guess for the second layer
    calibration = gate.calibration[(second, 1)]
    expected = copy.deepcopy(calibration)
    expected.observe(used.cpu())  # scored at once from the host's copy of the routing
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gate.observe(second, h, used)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()  # the block's sync
    gate.routed(second)
    assert (calibration.seen == expected.seen).all() and (calibration.used == expected.used).all()
