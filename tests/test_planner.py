"""The device-memory planner (`mira_hf.planner`): the split between expert cache and KV cache is the one a known
hit-rate curve and cost model give, memory experts cannot use goes to the KV cache, fixed parts are honoured, and
memory that cannot hold the model is refused with the numbers."""

from __future__ import annotations

import pytest
import torch

from mira_hf.errors import BudgetError, ConfigError
from mira_hf.planner import HitRateCurve, ModelFootprint, RequestMix, StepCost, plan_memory
from mira_hf.trace import RoutingTrace

# 100 bytes of weights, 100 of experts (records of 10), 1 byte of K and V per token in blocks of one token;
# a request is 6 + 4 tokens, so one sequence needs 10 bytes of KV cache.
MODEL = ModelFootprint(
    weights_bytes=100, expert_bytes=100, record_bytes=10, min_expert_bytes=10, kv_bytes_per_token=1, page_tokens=1
)
MIX = RequestMix(prompt_tokens=6, new_tokens=4, concurrency=5)
POINTS = ((0.0, 0.0), (0.5, 0.2), (0.8, 0.9), (1.0, 1.0))
CURVE = HitRateCurve({1: POINTS, 5: POINTS}, {1: 10.0, 5: 10.0}, "known")  # 10 expert uses per step at any batch
COST = StepCost(link_bytes_per_s=10.0, step_overhead_s=1.0, token_s=0.0)  # a step: 1 s + 1 s per missed record


def test_the_split_maximises_expected_throughput_on_a_known_curve():
    plan = plan_memory(200, MODEL, MIX, CURVE, COST)
    # c sequences leave 100 - 10c bytes of experts: c=1 0.9 of them (hit 0.95, 1.5 s/step, 0.67 tokens/s),
    # c=2 0.8 (hit 0.9, 2 s, 1.0), c=3 0.7 (hit 0.667, 4.33 s, 0.69), c=4 0.6 (0.433, 6.67 s, 0.6), c=5 0.5 (0.2, 9 s, 0.56)
    assert [round(c["tokens_per_s"], 3) for c in plan.candidates] == [0.667, 1.0, 0.692, 0.6, 0.556]
    assert (plan.expert_cache_bytes, plan.kv_cache_bytes, plan.kv_blocks, plan.concurrency) == (80, 20, 20, 2)
    assert plan.expected_hit_rate == pytest.approx(0.9) and plan.expected_tokens_per_s == pytest.approx(1.0)
    assert plan.fixed == () and plan.curve_source == "known"


def test_memory_the_experts_cannot_use_goes_to_the_kv_cache():
    plan = plan_memory(400, MODEL, MIX, CURVE, COST)  # 300 bytes of room: every expert and more
    assert plan.expert_cache_bytes == 100 and plan.kv_cache_bytes == 200 and plan.concurrency == MIX.concurrency
    assert plan.expected_hit_rate == 1.0


def test_kv_overhead_per_token_is_paid_from_the_kv_part():
    model = ModelFootprint(**{**MODEL.__dict__, "kv_overhead_per_token": 1})  # each cached token costs 2 bytes in all
    plan = plan_memory(400, model, MIX, CURVE, COST)
    assert plan.expert_cache_bytes == 100 and plan.kv_cache_bytes == 100 and plan.kv_blocks == 100


@pytest.mark.parametrize(
    "experts, kv, expected",
    [(50, None, (50, 50, 5)), (None, 30, (70, 30, 3)), (40, 20, (40, 20, 2))],
)
def test_fixed_parts_are_honoured(experts, kv, expected):
    plan = plan_memory(200, MODEL, MIX, CURVE, COST, expert_cache_bytes=experts, kv_cache_bytes=kv)
    assert (plan.expert_cache_bytes, plan.kv_cache_bytes, plan.concurrency) == expected
    assert set(plan.fixed) == {n for n, v in (("expert_cache", experts), ("kv_cache", kv)) if v is not None}
    assert plan.expected_hit_rate == pytest.approx(CURVE.hit_rate(1, expected[0] / 100))


def test_memory_that_cannot_hold_the_model_or_the_fixed_parts_is_refused():
    with pytest.raises(BudgetError, match="at least 120 bytes"):
        plan_memory(119, MODEL, MIX, CURVE, COST)  # weights + smallest expert cache + one sequence = 120
    with pytest.raises(BudgetError, match="119 bytes holds the weights and one step's activations but not also"):
        plan_memory(119, MODEL, MIX, CURVE, COST)
    with pytest.raises(BudgetError, match=r"^device memory of 10 bytes cannot hold what it must: the weights \(100\)"):
        plan_memory(10, MODEL, MIX, CURVE, COST)  # less than the weights alone: says so, not that it holds them
    with pytest.raises(BudgetError, match="parts given do not fit.*expert cache given takes 95, leaving 5 for the KV cache"):
        plan_memory(200, MODEL, MIX, CURVE, COST, expert_cache_bytes=95)  # leaves 5 bytes: not one sequence
    with pytest.raises(BudgetError, match=r"parts given do not fit.*expert cache given takes 60 and the KV cache given"):
        plan_memory(200, MODEL, MIX, CURVE, COST, expert_cache_bytes=60, kv_cache_bytes=60)
    with pytest.raises(
        BudgetError, match=r"the KV cache given takes [\d,]+ with its per-token buffers \(200 of K and V\)\. Give"
    ):
        plan_memory(200, MODEL, MIX, CURVE, COST, kv_cache_bytes=200)  # more than is left: no negative expert cache


def test_request_mix_and_curve_are_validated():
    with pytest.raises(ConfigError, match="concurrency=0"):
        RequestMix(concurrency=0)
    with pytest.raises(ConfigError, match="ascending share"):
        HitRateCurve({1: ((0.5, 0.2), (0.1, 0.1))}, {1: 1.0}, "bad")


def test_the_uniform_estimate_and_interpolation_between_concurrencies():
    curve = HitRateCurve.uniform([8, 8], top_k=2, concurrencies=(1, 4))
    assert curve.uses(1) == pytest.approx(4.0)  # two layers, two experts each
    assert curve.uses(4) == pytest.approx(2 * 8 * (1 - 0.75**4))
    assert curve.uses(2) == pytest.approx((curve.uses(1) + curve.uses(4)) / 2)  # halfway on a log scale
    assert curve.uses(1000) == pytest.approx(16.0)  # every expert at most
    assert curve.hit_rate(2, 0.3) == pytest.approx(0.3)


def test_a_curve_measured_from_a_trace_falls_with_concurrency_and_rises_with_the_cache():
    g = torch.Generator().manual_seed(0)
    p = 1.0 / torch.arange(1, 17).float()
    rows = torch.stack([torch.multinomial(p.expand(512, 16), 2, generator=g) for _ in range(4)], dim=1)  # [512, 4, 2]
    trace = RoutingTrace(rows, None, [0], [16] * 4, [1000] * 4)
    curve = HitRateCurve.from_trace(trace, concurrencies=(1, 8), shares=(0.25, 0.5, 1.0))
    assert curve.uses(1) == pytest.approx(8.0) and 8.0 < curve.uses(8) <= 64.0
    for c in (1, 8):
        hits = [h for _, h in curve.points[c]]
        assert hits == sorted(hits) and hits[-1] > 0.95  # all experts resident: only the first uses miss
    assert curve.hit_rate(8, 0.25) < curve.hit_rate(1, 0.25)


def test_routing_recorded_by_mira_calibrate_gives_the_plan_its_hit_rates(tmp_path):
    from safetensors.torch import load_file, save_file

    from mira_hf import MiraConfig, MiraMoEModel
    from mira_hf.bundled import bundled_model_path
    from mira_hf.cli import main
    from mira_hf.serve.planning import calibration_trace, hit_rate_curve

    data = tmp_path / "code.txt"
    data.write_text("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 8)
    out = tmp_path / "calib"
    args = ["calibrate", str(bundled_model_path()), "--data", str(data), "--out", str(out), "--traces-only", "--device", "cpu"]
    assert main([*args, "--max-tokens", "96", "--chunk-tokens", "48"]) == 0
    model = MiraMoEModel.from_pretrained(bundled_model_path(), MiraConfig(gpu_budget=0.25, device="cpu"), progress=False)
    trace = calibration_trace(model, str(out))
    assert (trace.steps, trace.num_layers, trace.top_k) == (96, 6, 2) and trace.sequence_starts == [0, 48]
    assert trace.record_bytes == [model.mira.store.record_bytes(layer) for layer in range(6)]
    curve = hit_rate_curve(model, str(out))
    assert curve.source.startswith("replay of a 96-step routing trace") and set(curve.points) == {1, 2, 4, 8, 16, 32, 64}
    with pytest.raises(ConfigError, match="without router_topk.safetensors"):
        hit_rate_curve(model, str(tmp_path))
    tensors = load_file(out / "router_topk.safetensors")
    del tensors["chunk_lengths"]  # a file cut short
    save_file(tensors, str(out / "router_topk.safetensors"))
    with pytest.raises(ConfigError, match="no chunk_lengths that add up to its 96 tokens.*Calibrate this model again"):
        calibration_trace(model, str(out))
    tensors["topk.2"] = -tensors["topk.2"] - 1  # expert ids below 0
    save_file(tensors, str(out / "router_topk.safetensors"))
    with pytest.raises(ConfigError, match="routes to experts this model does not have"):
        calibration_trace(model, str(out))
    (out / "router_topk.safetensors").write_bytes(b"garbage")  # damaged
    with pytest.raises(ConfigError, match="router_topk.safetensors is not a readable .safetensors file"):
        calibration_trace(model, str(out))


def test_the_step_time_counts_the_host_work_per_expert_use_and_per_miss():
    """step = overhead + c · token_s + uses · use_s + misses · (miss_s + record / link), each term by hand."""
    cost = StepCost(link_bytes_per_s=10.0, step_overhead_s=1.0, token_s=0.25, use_s=0.1, miss_s=0.5)
    assert cost.step_s(2, 20.0, uses=10, misses=2) == pytest.approx(1.0 + 0.5 + 1.0 + 1.0 + 2.0)
    assert cost.step_s(2, 20.0) == pytest.approx(1.0 + 0.5 + 2.0)  # no uses given: the link and the tokens only
    with pytest.raises(ConfigError, match="times ≥ 0"):
        StepCost(use_s=-1e-6)


def test_the_split_weighs_the_host_work_per_use_and_per_miss():
    """COST plus 0.1 s per expert use and 0.5 s per miss, on the known curve (10 uses per step): c=1 misses 0.5
    (1 + 1 + 0.5 · 1.5 = 2.75 s, 0.364 tokens/s), c=2 1 (3.5 s, 0.571), c=3 3.33 (7 s, 0.429), c=4 5.67 (10.5 s,
    0.381), c=5 8 (14 s, 0.357)."""
    from dataclasses import replace

    from mira_hf.host_time import HostUseCost

    measured = HostUseCost(use_s=0.1, miss_s=0.5, fixed_s=0.2, blocks=32, terms=("fixed", "use", "miss"))
    cost = COST.with_host_time(measured)
    assert cost == replace(COST, use_s=0.1, miss_s=0.5) and COST.with_host_time(None) == COST
    plan = plan_memory(200, MODEL, MIX, CURVE, cost)
    assert [round(c["tokens_per_s"], 3) for c in plan.candidates] == [0.364, 0.571, 0.429, 0.381, 0.357]
    assert [round(c["step_s"], 3) for c in plan.candidates] == [2.75, 3.5, 7.0, 10.5, 14.0]
    assert plan.concurrency == 2 and plan.expected_tokens_per_s == pytest.approx(2 / 3.5)


@pytest.mark.parametrize("sliding", [None, 64])
def test_transformers_attention_masks_are_counted_per_cache_token_and_per_step_token(sliding):
    """Paged attention keeps one mask (two with sliding-window layers) of [M, cache tokens + M] in the model's dtype
    unless flash attention runs: M columns per cache token in the KV overhead, M x M among a step's activations."""
    from mira_hf.serve import planning
    from mira_hf.testing import make_config

    m, itemsize, masks = 512, 2, 2 if sliding else 1
    text, flash = make_config("mixtral", sliding_window=sliding), make_config("mixtral", sliding_window=sliding)
    text._attn_implementation, flash._attn_implementation = "sdpa", "flash_attention_2"
    step = planning.step_activation_bytes(text, itemsize, m, 2) - planning.step_activation_bytes(flash, itemsize, m, 2)
    assert step == masks * m * m * itemsize
    heads, kv_heads, head_dim = text.num_attention_heads, text.num_key_value_heads, text.head_dim
    at_peak = (2 * heads - 2 * kv_heads + kv_heads) * head_dim * itemsize  # sdpa reads K and V back with heads repeated
    per_token = planning.cache_token_overhead(text, itemsize, m) - planning.cache_token_overhead(flash, itemsize, m)
    assert per_token == masks * m * itemsize + at_peak


def test_an_expert_cache_that_holds_every_expert_below_their_bytes_is_planned_as_whole():
    # Placement "mixed": 70 bytes hold every expert (a few kept packed). From 70 on the hit rate is 1, and memory past
    # 70 goes to the KV cache: with 200 bytes, 100 of room, c=3 leaves 70 for experts (1 s/step, 3 tokens/s)
    model = ModelFootprint(**{**MODEL.__dict__, "all_fit_bytes": 70})
    plan = plan_memory(200, model, MIX, CURVE, COST)
    assert [round(c["tokens_per_s"], 3) for c in plan.candidates][:3] == [1.0, 2.0, 3.0]
    assert plan.candidates[2]["expert_cache_bytes"] == 70 and plan.candidates[2]["hit_rate"] == 1.0
    assert (plan.expert_cache_bytes, plan.concurrency, plan.expected_hit_rate) == (70, 3, 1.0)
    roomy = plan_memory(400, model, MIX, CURVE, COST)  # every sequence and every expert: the rest to the KV cache
    assert roomy.expert_cache_bytes == 70 and roomy.kv_cache_bytes == 230 and roomy.expected_hit_rate == 1.0


def test_a_served_mixed_model_reports_the_smallest_cache_that_holds_every_expert():
    from mira_hf import MiraConfig, MiraMoEModel, bundled_model_path
    from mira_hf.config import QuantConfig
    from mira_hf.serve import planning

    cfg = MiraConfig(device="cpu", gpu_budget=0.3, quantization="lossless", quant=QuantConfig(placement="mixed"))
    model = MiraMoEModel.from_pretrained(bundled_model_path(), cfg, dtype=torch.bfloat16, progress=False)
    fp = planning.footprint(model, 1024)
    assert fp.min_expert_bytes < fp.all_fit_bytes < fp.expert_bytes
    on_device = lambda plan: sum(plan.n_slots.values()) + sum(map(len, plan.kept.values()))  # noqa: E731
    assert on_device(planning.slot_plan(model.mira, fp.all_fit_bytes, "mixed")) == 6 * 8
    assert on_device(planning.slot_plan(model.mira, fp.all_fit_bytes - 1, "mixed")) < 6 * 8
    dequant = MiraMoEModel.from_pretrained(
        bundled_model_path(), cfg.replace(quant=QuantConfig(placement="dequant")), progress=False
    )
    assert planning.footprint(dequant, 1024).all_fit_bytes == 0  # every expert decoded: expert_bytes
