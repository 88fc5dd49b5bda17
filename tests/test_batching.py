"""Batch-aware use estimates (`mira_hf.batching`): per-token routing shares from each block's counts, projected to
the next step's tokens, rank evictions at batch; one token per step leaves the heat policy exactly as it was; and
batch generation stays bit-identical to the unwrapped model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import load_reference
from tiny_models import make_config
from transformers import AutoModelForCausalLM

from mira_hf import MiraConfig, MiraMoEModel
from mira_hf.batching import SHARE_DECAY, BatchUsage, enable
from mira_hf.config import PredictorConfig
from mira_hf.errors import ConfigError
from mira_hf.heat import HeatConfig, HeatTracker
from mira_hf.manager import ExpertManager
from mira_hf.replay import belady, replay
from mira_hf.trace import RoutingTrace


def test_shares_and_union_probabilities_follow_the_blocks_counts():
    usage = BatchUsage({0: 4})
    rates = {0: np.zeros(4, np.float32)}
    # 4 tokens, top-2: expert 0 has 4 rows, 1 has 2, 2 and 3 one each
    usage.observe(0, [0, 1, 2, 3], torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]]))
    usage.end_step(rates)
    share = np.array([4, 2, 1, 1], np.float32) / 4 * np.float32(0.1)
    np.testing.assert_allclose(usage.share[0], share, rtol=1e-6)
    assert usage.batch_tokens == 4
    np.testing.assert_allclose(rates[0], 1 - (1 - share) ** 4, rtol=1e-5)  # written into the heat tracker's rates
    np.testing.assert_allclose(usage.expected_uses(0), share * 4, rtol=1e-6)


def test_padding_and_the_expert_parallel_sentinel_are_not_counted():
    usage = BatchUsage({0: 3})
    usage.observe(0, [0, 2], torch.tensor([[0, -1], [2, 3], [0, 3]]))  # -1 pads, 3 = E is the EP sentinel
    usage.end_step({0: np.zeros(3, np.float32)})
    np.testing.assert_allclose(usage.share[0], np.array([2, 0, 1], np.float32) / 3 * np.float32(0.1), rtol=1e-6)


def test_one_token_steps_leave_the_heat_use_rates_as_they_were():
    fixed = HeatConfig(use_rate_decay=SHARE_DECAY)  # the batch shares' memory: at one token the same estimate
    heat, plain = HeatTracker({0: 4, 1: 4}, fixed), HeatTracker({0: 4, 1: 4}, fixed)
    usage = BatchUsage({0: 4, 1: 4})
    for step in range(30):
        for layer in (0, 1):
            picks = [(step + layer) % 4, (step * 3 + 1) % 4] if step % 3 else [layer]
            picks = sorted(set(picks))
            for h in (heat, plain):
                h.activate(layer, picks)
            usage.observe(layer, picks, torch.tensor([picks]))
        heat.end_step()
        plain.end_step()
        usage.end_step(heat.use_rate)
    for layer in (0, 1):
        assert np.array_equal(heat.use_rate[layer], plain.use_rate[layer])
        np.testing.assert_allclose(usage.share[layer], plain.use_rate[layer], rtol=1e-6)  # the same estimate


def test_the_next_steps_tokens_are_the_median_of_the_latest_steps():
    usage = BatchUsage({0: 2})
    rates = {0: np.zeros(2, np.float32)}
    for tokens in (32, 32, 4096, 32, 1):  # decode steps of 32 sequences, one prompt chunk, one lone token
        usage.observe(0, [0, 1], torch.zeros((tokens, 1), dtype=torch.long))
        usage.end_step(rates)
    assert usage.batch_tokens == 32


def zipf_trace(steps=1024, layers=4, experts=16, k=2, seed=0) -> RoutingTrace:
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, experts + 1).float()
    rows = torch.empty(steps, layers, k, dtype=torch.long)
    for layer in range(layers):
        p = weights[torch.randperm(experts, generator=g)]
        rows[:, layer] = torch.multinomial(p.expand(steps, experts), k, replacement=False, generator=g)
    return RoutingTrace(rows, None, [0], [experts] * layers, [1000] * layers)


def test_batch_replay_counts_union_uses_and_batch_aware_ranking_hits_more():
    trace = zipf_trace()
    one = replay(trace, budget=0.5, policy="heat")
    assert (
        one["uses"] == sum(len(set(r)) for r in trace.experts.reshape(-1, 2).tolist()) and one["config"]["batch_aware"] is False
    )
    binary = replay(trace, budget=0.5, policy="heat", concurrency=8, batch_aware=False)
    aware = replay(trace, budget=0.5, policy="heat", concurrency=8)
    assert aware["config"]["batch_aware"] is True and binary["uses"] == aware["uses"]
    unions = sum(
        len({e for s in range(step, trace.steps, trace.steps // 8) for e in trace.experts[s, layer].tolist()})
        for step in range(trace.steps // 8)
        for layer in range(trace.num_layers)
    )
    assert aware["uses"] == unions and aware["steps"] == trace.steps // 8 and aware["tokens"] == trace.steps
    assert aware["hits"] > binary["hits"]  # same trace, same slots: the shares rank better than "used last step"
    bound = belady(trace, budget=0.5, concurrency=8)
    assert bound["uses"] == unions and bound["hits"] >= aware["hits"]
    lru = replay(trace, budget=0.5, policy="lru", concurrency=8)
    assert lru["hit_rate"] < aware["hit_rate"]  # layers cycled in order: recency evicts what comes next


def test_replay_refuses_a_concurrency_beyond_the_trace():
    with pytest.raises(ConfigError, match="concurrency=0"):
        replay(zipf_trace(steps=8), budget=0.5, concurrency=0)


def test_batch_generation_with_batch_aware_ranking_is_bit_identical():
    torch.manual_seed(0)
    config = make_config("mixtral")
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, config.vocab_size, (8, 12))
    with torch.inference_mode():
        reference = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        logits = model(ids).logits
    wrapped = MiraMoEModel.wrap(model, MiraConfig(gpu_budget=0.3, device="cpu", predictor=None))
    usage = enable(wrapped.mira)
    with torch.inference_mode():
        assert torch.equal(wrapped(ids).logits, logits)
        assert torch.equal(wrapped.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0), reference)
    assert usage.batch_tokens == 8 and usage.share[0].sum() > 0  # the decode steps carried 8 tokens
    assert wrapped.mira.stats()["misses"] > 0  # experts did move: the ranking was exercised
    assert usage.union_check()["blocks"] > 0
    wrapped.mira.reset_stats()  # counters only: the estimate stays
    assert usage.union_check()["blocks"] == 0 and usage.batch_tokens == 8


def test_without_a_predictor_batch_union_guesses_stage_the_next_layer_ahead_of_its_router(monkeypatch):
    trace = zipf_trace()
    staged = replay(trace, budget=0.5, policy="heat", concurrency=32)
    # experts the next block is all but sure to use: almost every copy ahead is used
    assert staged["prefetches"] > 0 and staged["prefetch_wasted"] <= 0.05 * staged["prefetches"]
    monkeypatch.setattr(BatchUsage, "guess", lambda self, layer: None)
    plain = replay(trace, budget=0.5, policy="heat", concurrency=32)
    # about the same copies, made earlier (two blocks ahead a copy's victim is chosen a block sooner: a few more)
    assert plain["prefetches"] == 0 and staged["loads"] <= 1.02 * plain["loads"]
    assert staged["misses"] < plain["misses"] - 0.5 * staged["prefetch_used"]  # most copies ahead are stalls avoided


def test_steps_of_many_tokens_stage_the_first_layer_at_the_end_of_a_step(monkeypatch):
    """No guess made within a step reaches the first layer: at steps of many tokens its next block is guessed from
    the batch's use rates once the last layer has run, so its misses are copied ahead instead of stalling."""
    trace = zipf_trace()
    staged = replay(trace, budget=0.5, policy="heat", concurrency=32)
    first = staged["per_layer"][0]
    next_layer_only = BatchUsage.guess
    monkeypatch.setattr(BatchUsage, "guess", lambda self, layer: None if layer == 0 else next_layer_only(self, layer))
    plain = replay(trace, budget=0.5, policy="heat", concurrency=32)
    assert plain["per_layer"][0]["prefetches"] == 0 < first["prefetches"]
    assert first["prefetch_wasted"] <= 0.05 * first["prefetches"] and first["misses"] < plain["per_layer"][0]["misses"]


def test_the_staging_cap_counts_copies_not_guesses_already_resident():
    """At a large batch every expert of a layer is used at each step and the resident ones, the most used, rank first
    among the guesses: the cap on copies ahead per layer (2 x top-k) must not be spent on them, or the missing
    experts are never copied ahead and every load stalls."""
    g = torch.Generator().manual_seed(0)
    steps, layers, experts, batch = 20, 4, 8, 64
    shares = torch.softmax(torch.randn(layers, experts, generator=g) * 0.5, -1)
    routed = torch.stack([torch.multinomial(shares[i].expand(batch * steps, experts), 2, generator=g) for i in range(layers)], 1)
    trace = RoutingTrace(routed, None, [0], [experts] * layers, [2**20] * layers)
    r = replay(trace, budget=0.8, policy="heat", concurrency=batch)
    assert r["uses"] == steps * layers * experts  # every expert at every step
    assert r["misses"] < 0.4 * r["loads"] and r["prefetch_wasted"] <= 0.05 * r["prefetches"]  # most copies made ahead


def test_batch_guesses_go_to_the_next_blocks_in_layer_order_and_on_into_the_next_step():
    usage = BatchUsage({0: 4, 2: 4, 5: 4})  # MoE layers need not be consecutive
    for layer in (0, 2, 5):
        usage.observe(layer, [0, 1, 2, 3], torch.tensor([[0, 1], [2, 3], [0, 2]]))
    usage.end_step({layer: np.zeros(4, np.float32) for layer in (0, 2, 5)})
    assert [g[0] for g in usage.guesses_after(0, 2)] == [2, 5]
    assert [g[0] for g in usage.guesses_after(2, 2)] == [5, 0]
    assert [g[0] for g in usage.guesses_after(5, 1)] == [0]
    assert [g[0] for g in usage.guesses_after(5, 7)] == [0, 2, 5]  # at most one step's blocks
    target, order, values = usage.guesses_after(0, 1)[0]
    assert order == [0, 2, 1, 3] and values == pytest.approx(usage.union_probability(2).tolist())  # most likely first


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_at_steps_of_many_tokens_copies_go_to_the_next_blocks_and_never_evict_them(monkeypatch, ahead):
    """Every expert of a layer is used at each step of a large batch, so a copy's victim is an expert of the block
    that has just been queued: copies for the very next block would wait for that block's compute. They go
    `batch_stage_lookahead` blocks ahead instead, and no copy takes the slot of an expert of a block before its own."""
    copies = []  # (the copy's layer, its victim's layer or None), each in blocks after the one just queued
    original_load = ExpertManager._load

    def load(self, key, staged, **kw):
        before = {k for pool in self.cache.pools.values() for k in pool.where}
        slot = original_load(self, key, staged, **kw)
        if staged and slot is not None:
            (victim,) = before - {k for pool in self.cache.pools.values() for k in pool.where} or [None]
            copies.append(((key[0] - self._last_layer) % 8, victim and (victim[0] - self._last_layer) % 8))
        return slot

    monkeypatch.setattr(ExpertManager, "_load", load)
    g = torch.Generator().manual_seed(0)
    shares = torch.softmax(torch.randn(8, 8, generator=g) * 0.5, -1)
    routed = torch.stack([torch.multinomial(shares[i].expand(64 * 12, 8), 2, generator=g) for i in range(8)], 1)
    trace = RoutingTrace(routed, None, [0], [8] * 8, [2**20] * 8)
    r = replay(trace, budget=0.85, policy="heat", concurrency=64, predictor_config=PredictorConfig(batch_stage_lookahead=ahead))
    assert r["prefetches"] > 0 and r["prefetch_wasted"] == 0
    distances = {d for d, _ in copies}
    assert distances <= set(range(1, ahead + 1)) and ahead in distances
    # a victim is never of a block that runs before the copy's own (0: the block just queued, needed a step later)
    assert all(v is None or v == 0 or v > d for d, v in copies)


def test_the_union_check_compares_each_blocks_expected_experts_with_those_it_used():
    usage = BatchUsage({0: 4, 1: 4})
    rates = {0: np.zeros(4, np.float32), 1: np.zeros(4, np.float32)}
    usage.observe(0, [0, 1, 2, 3], torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]]))
    usage.end_step(rates)  # no estimate was made for this step: steps carried one token until now
    assert usage.union_check() == dict(blocks=0, expected=None, observed=None)
    expected = float(usage.union_probability(0).sum())  # what the estimate expects of the next step's block
    usage.observe(0, [0, 1], torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0]]))
    usage.end_step(rates)
    check = usage.union_check()
    assert check["blocks"] == 1 and check["observed"] == 2 and check["expected"] == pytest.approx(expected)
    usage.reset_check()
    assert usage.union_check()["blocks"] == 0 and usage.batch_tokens == 4  # the estimate itself stays


def test_one_token_steps_stage_nothing():
    usage = BatchUsage({0: 4, 1: 4})
    usage.observe(0, [0, 1], torch.tensor([[0, 1]]))
    usage.end_step({0: np.zeros(4, np.float32), 1: np.zeros(4, np.float32)})
    assert usage.guesses_after(0, 2) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_forwards_in_and_out_of_inference_mode_share_the_predictors_host_buffers(tiny_checkpoint):
    """Continuous batching runs in inference mode; the predictor's pinned buffers, made there, are written again by
    forwards outside it (a planning probe, generate) and must stay normal tensors."""
    path = tiny_checkpoint("qwen3_moe")
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=0.5, device="cuda", predictor="gate"), progress=False)
    ref = load_reference(path).cuda()
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.inference_mode():
        first = model(ids).logits
    with torch.no_grad():
        again = model(ids).logits
        assert torch.equal(again, ref(ids).logits) and torch.equal(first, again)
