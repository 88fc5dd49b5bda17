"""Host time per expert use and per miss (`mira_hf.host_time`): the fit recovers known costs, folds what the blocks
cannot tell apart, and the serving planner's step cost carries what the running model measured."""

from __future__ import annotations

import pytest
import torch

from mira_hf.host_time import MIN_BLOCKS, BlockClock


def _clock(blocks) -> BlockClock:
    clock = BlockClock()
    for uses, misses, seconds in blocks:
        clock.add(uses, misses, seconds)
    return clock


def test_the_fit_recovers_known_costs_per_block_use_and_miss():
    # 50 µs per block, 20 µs per use, 300 µs per miss, on blocks of varied width and misses
    blocks = [(u, m, 50e-6 + 20e-6 * u + 300e-6 * m) for u in (4, 8, 16, 64) for m in range(0, 4)]
    fit = _clock(blocks).fit()
    assert fit.terms == ("fixed", "use", "miss") and fit.blocks == len(blocks)
    assert (fit.fixed_s, fit.use_s, fit.miss_s) == pytest.approx((50e-6, 20e-6, 300e-6), rel=1e-6)


def test_blocks_of_one_width_fold_the_block_cost_into_the_per_use_one():
    """One token per step: every block uses top-8 experts, so 8 uses cost what 8 uses and a block cost."""
    blocks = [(8, m, 40e-6 + 8 * 10e-6 + 200e-6 * m) for m in (0, 1, 2, 3)] * 5
    fit = _clock(blocks).fit()
    assert fit.terms == ("use", "miss") and fit.fixed_s == 0.0
    assert (fit.use_s, fit.miss_s) == pytest.approx((15e-6, 200e-6), rel=1e-6)  # (40 + 80) / 8 per use


def test_without_misses_only_the_per_use_cost_is_fitted_and_too_few_blocks_give_none():
    fit = _clock([(8, 0, 80e-6)] * MIN_BLOCKS).fit()
    assert fit.terms == ("use",) and fit.use_s == pytest.approx(10e-6) and fit.miss_s == 0.0
    assert _clock([(8, 0, 80e-6)] * (MIN_BLOCKS - 1)).fit() is None


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]


def _wrapped(device: str):
    from transformers import AutoModelForCausalLM

    from mira_hf import MiraConfig, MiraMoEModel
    from mira_hf.testing import make_config

    torch.manual_seed(0)
    config = make_config("qwen3_moe", num_hidden_layers=6)
    return MiraMoEModel.wrap(AutoModelForCausalLM.from_config(config).eval(), MiraConfig(gpu_budget=0.5, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_a_decoding_model_measures_its_host_work_and_the_server_plan_counts_it(device):
    """The clock times every block of a wrapped model; the serving planner's step cost carries the fit, so its
    predicted step time is longer than the link, the tokens and the fixed cost alone."""
    from mira_hf.planner import StepCost
    from mira_hf.serve import planning

    model = _wrapped(device)
    with torch.inference_mode():
        for batch in (1, 4, 8):
            model(input_ids=torch.randint(0, model.config.vocab_size, (batch, 3), device=model.device))
    clock = model.mira.telemetry.blocks
    assert clock.blocks == 18  # every block timed: 3 forwards of 6 MoE layers
    fit = clock.fit() or pytest.fail("no fit after 18 blocks")
    assert fit.use_s > 0 and fit.use_s < 0.1  # seconds per expert use on a host: well below 100 ms
    cost = planning.step_cost(model)
    assert (cost.use_s, cost.miss_s) == (fit.use_s, fit.miss_s)
    assert planning.step_cost(model, StepCost(use_s=1.0)).use_s == 1.0  # a cost that sets them is kept

    from mira_hf.serve import ServeConfig

    config = ServeConfig(device_memory="64MiB", concurrency=4, prompt_tokens=8, default_max_tokens=8, max_batch_tokens=64)
    curve = planning.hit_rate_curve(model, None)
    planned = planning.plan(model, config, curve=curve)
    c, hit = planned.concurrency, planned.expected_hit_rate
    uses, record = curve.uses(c), planning.footprint(model, 64).record_bytes
    with_host = c / cost.step_s(c, uses * (1 - hit) * record, uses, uses * (1 - hit))
    without = c / StepCost().step_s(c, uses * (1 - hit) * record)
    assert planned.expected_tokens_per_s == pytest.approx(with_host) and with_host < without


@pytest.mark.parametrize("device", DEVICES)
def test_the_probe_measures_an_unused_model_and_leaves_no_trace(device):
    from mira_hf.serve import planning

    model = _wrapped(device)
    cost = planning.step_cost(model)  # nothing run yet: a probe of 3 steps × 6 blocks
    assert cost.use_s > 0
    m = model.mira
    assert m.telemetry.blocks.blocks == 0 and m.stats()["hits"] + m.stats()["misses"] == 0
    assert all(not s.any() for s in m.heat.scores.values()) and all(not r.any() for r in m.heat.use_rate.values())
