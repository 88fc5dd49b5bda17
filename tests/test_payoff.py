"""The payoff gate: prediction pauses while it costs the host more per block than the stalls it could remove."""

import pytest
import torch
from conftest import load_reference

from mira_hf import MiraConfig, MiraMoEModel
from mira_hf.errors import ConfigError
from mira_hf.payoff import PayoffGate
from mira_hf.predictors import PredictorConfig


def _window(gate, steps, blocks, cost, stage_hits, misses, stall_per_step, stall_total):
    """`steps` forward steps of `blocks` blocks each; returns the loader's stall total after them."""
    for _ in range(steps):
        for b in range(blocks):
            if gate.active:
                gate.charge(cost)
            gate.count_block(stage_hits if (gate.active and b == 0) else 0, misses if b == 0 else 0)
        stall_total += stall_per_step
        gate.end_step(stall_total)
    return stall_total


def test_the_gate_arithmetic_on_a_hand_computed_sequence():
    gate = PayoffGate(window_steps=4, probe_every=3)
    assert gate.active and gate.pays()  # nothing measured: predict
    # window 1, predicting: 2 blocks per step at 100 µs each; per step 1 stage hit and 2 misses that stall 10 µs in all
    total = _window(gate, 4, 2, 100e-6, 1, 2, 10e-6, 0.0)
    # stall per miss 40 µs / 8 = 5 µs; uses at risk per block (4 hits + 8 misses) / 8 = 1.5; 7.5 µs < cost 100 µs: pause
    assert gate.stall_per_miss == pytest.approx(5e-6) and gate.at_risk_per_block == 1.5
    assert gate.cost_per_block == pytest.approx(100e-6) and not gate.active and gate.paused_steps == 0
    # window 2, paused: the misses now stall 1 ms each (a busy link): 1 at risk per block × 1 ms ≥ 100 µs: predict again
    total = _window(gate, 4, 2, 100e-6, 0, 2, 2e-3, total)
    assert gate.paused_steps == 4 and gate.stall_per_miss == pytest.approx(1e-3) and gate.active
    # window 3, predicting, stalls gone: pause (one window in 3 predicts from now on: windows 4, 5 paused, 6 probes)
    total = _window(gate, 4, 2, 100e-6, 1, 2, 0.0, total)
    assert not gate.active and gate.stall_per_miss == 0.0
    total = _window(gate, 4, 2, 100e-6, 0, 2, 0.0, total)
    assert not gate.active and gate.paused_steps == 8
    total = _window(gate, 4, 2, 100e-6, 0, 2, 0.0, total)
    assert gate.active and gate.paused_steps == 12  # the probe: window 6 predicts to measure its cost again
    _window(gate, 4, 2, 100e-6, 1, 2, 0.0, total)
    assert not gate.active and gate.paused_steps == 12  # still does not pay
    gate.reset_stats()
    assert gate.paused_steps == 0


def test_misses_that_stall_keep_prediction_on_even_when_it_staged_nothing():
    """A link-bound window in which no prefetch was used (staging paused by the precision gate, or wrong
    guesses): prediction could still remove a 1 ms stall per block for 100 µs, so it stays on."""
    gate = PayoffGate(window_steps=4)
    _window(gate, 4, 2, 100e-6, 0, 1, 1e-3, 0.0)
    assert gate.active and gate.at_risk_per_block == 0.5 and gate.stall_per_miss == pytest.approx(1e-3)


def test_a_window_without_misses_keeps_the_last_stall_estimate():
    gate = PayoffGate(window_steps=2)
    total = _window(gate, 2, 1, 1e-6, 1, 1, 1e-3, 0.0)  # 1 ms per miss: pays
    assert gate.active and gate.stall_per_miss == pytest.approx(1e-3)
    _window(gate, 2, 1, 1e-6, 1, 0, 0.0, total)  # no misses: nothing new about stalls
    assert gate.active and gate.stall_per_miss == pytest.approx(1e-3)


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(pause_unprofitable="yes"), "pause_unprofitable"), (dict(payoff_window_steps=0), "payoff_window_steps")],
)
def test_bad_gate_settings_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        PredictorConfig(**kwargs)


def test_prediction_pauses_where_copies_cost_nothing_and_outputs_stay_identical(tiny_checkpoint):
    """On CPU with `pause_unprofitable=True`, misses whose copies stall nothing (as on a GPU where records land
    before they are needed; here every stall is recorded as 0, so the test does not depend on the host's
    timing): prediction pauses at the first review. The default on CPU never pauses. Tokens equal the
    unwrapped model's either way."""
    path = tiny_checkpoint("mixtral")
    ref = load_reference(path)
    ids = torch.tensor([[5, 9, 14, 33, 7, 21, 2, 8]])
    gen = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    expected = ref.generate(ids, **gen)
    for pause, paused in ((True, True), (None, False)):
        cfg = MiraConfig(
            gpu_budget=0.3, device="cpu", prediction=PredictorConfig(pause_unprofitable=pause, payoff_window_steps=4)
        )
        model = MiraMoEModel.from_pretrained(path, cfg, progress=False).eval()
        loader = model.mira.loader
        loader.add_stall = lambda layer, seconds, loader=loader: loader._stall_by_layer.setdefault(layer, 0.0)
        assert torch.equal(model.generate(ids, **gen), expected)
        s = model.mira.stats()
        assert (s["prediction_paused_steps"] > 0) == paused and s["prediction_active"] == (not paused)
        gate = model.mira.staging.gate
        if paused:
            assert gate.stall_per_miss == 0.0 and gate.cost_per_block > 0
            assert s["prediction_paused_steps"] == 24 - 4  # 24 forward steps (the prefill gives the first token); paused after 4


def test_the_manager_feeds_the_gate_what_it_measured(tiny_checkpoint):
    """Every demand miss made to stall 1 s (as a saturated link would; far above any host time, so the
    outcome does not depend on this machine's speed): the gate sees 1 s per miss and the
    predictor's host time per block, and predicts whenever a window had uses at risk (a window in which
    every expert was resident pauses it until misses come back)."""
    path = tiny_checkpoint("mixtral")
    pc = PredictorConfig(pause_unprofitable=True, payoff_window_steps=4, stage_probability=0.3)
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=0.75, device="cpu", prediction=pc), progress=False).eval()
    loader, gate = model.mira.loader, model.mira.staging.gate
    loader.add_stall = lambda layer, seconds: loader._stall_by_layer.update({layer: loader._stall_by_layer.get(layer, 0.0) + 1.0})
    reviews = []
    end_step = gate.end_step
    gate.end_step = lambda total: (reviews.append(gate._steps + 1 == gate.window_steps), end_step(total))
    ids = torch.tensor([[5, 9, 14, 33, 7, 21, 2, 8]])
    model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    assert sum(reviews) == 24 // 4  # 24 forward steps (the prefill gives the first token), a review every 4
    assert gate.stall_per_miss == pytest.approx(1.0) and 0 < gate.cost_per_block < 1.0 and gate.at_risk_per_block > 0
    s = model.mira.stats()
    assert s["prediction_active"] and s["prediction_paused_steps"] <= 4 and s["prefetch_used"] > 0
