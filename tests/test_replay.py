"""Offline evaluation: routing traces, replay through the real manager, Belady's bound, LRU cross-check."""

import json
import re

import pytest
import torch
from conftest import load_reference

from mira_hf import IncompatibleFileError, MiraConfig, MiraMoEModel
from mira_hf.errors import ConfigError
from mira_hf.predictors import PredictorConfig
from mira_hf.replay import belady, lru_reference, replay
from mira_hf.trace import RoutingTrace, record_topk, record_trace

POLICIES = ("lru", "heat", "priority")


def make_trace(steps: list[list[list[int]]], num_experts: int, record_bytes=1000, hidden_size=None) -> RoutingTrace:
    """steps[t][layer] = experts of that block (one token per step)."""
    experts = torch.tensor(steps, dtype=torch.long)  # [steps, L, K]
    L = experts.shape[1]
    rb = record_bytes if isinstance(record_bytes, list) else [record_bytes] * L
    hidden = None if hidden_size is None else torch.randn(experts.shape[0], L, hidden_size).half()
    return RoutingTrace(experts, hidden, [0], [num_experts] * L, rb)


def random_trace(seed: int, steps=300, layers=3, experts=6, top_k=2, record_bytes=1000) -> RoutingTrace:
    """Skewed routing (a few popular experts per layer) so caches get hits and choices matter."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(layers, experts, generator=g) ** 3 + 0.02  # [L, E]
    picked = torch.stack([torch.multinomial(weights[layer].expand(steps, -1), top_k, generator=g) for layer in range(layers)], 1)
    trace = make_trace(picked.tolist(), experts, record_bytes)
    trace.sequence_starts = [0, steps // 2]
    return trace


# -- hand-computed traces ---------------------------------------------------------------------------
# The textbook paging example (1,2,3,4,1,2,5,1,2,3,4,5 with 3 frames): MIN faults 7 times, LRU 10.
TEXTBOOK = [[[e]] for e in (0, 1, 2, 3, 0, 1, 4, 0, 1, 2, 3, 4)]


def test_belady_and_lru_on_the_textbook_trace():
    trace = make_trace(TEXTBOOK, num_experts=5)  # budget 0.65 of 5 experts -> 3 slots
    assert belady(trace, budget=0.65)["misses"] == 7
    assert lru_reference(trace, 0.65)["misses"] == 10
    r = replay(trace, budget=0.65, policy="lru", predictor=None, stage_fraction=0.0)
    assert (r["misses"], r["loads"], r["hits"]) == (10, 10, 2)
    assert r["config"]["slots"] == 3
    assert r["bytes_moved"] == 10 * 1000 and r["bytes_per_token"] == pytest.approx(10 * 1000 / 12)


def test_a_block_needs_all_its_experts_at_once():
    # 3 slots, top-2 blocks. By hand:
    # MIN: {0,1} 2 misses; {2,3}: 2 free-slot load, then evict 1 (next use later than 0's) for 3;
    #      {0,2} hits; {1,3}: evict 2 (never used again) for 1; {0,1} hits -> 5 misses.
    # LRU: {0,1} 2; {2,3}: evict 0 -> 4; {0,2}: evict 1 -> 5; {1,3}: evict 2 -> 6; {0,1} hits -> 6 misses.
    blocks = [[[0, 1]], [[2, 3]], [[0, 2]], [[1, 3]], [[0, 1]]]
    trace = make_trace(blocks, num_experts=4)
    b = belady(trace, budget=0.75)
    assert (b["misses"], b["hits"], b["uses"]) == (5, 5, 10)
    assert b["bytes_moved"] == 5000
    assert lru_reference(trace, 0.75)["misses"] == 6
    assert replay(trace, budget=0.75, policy="lru", stage_fraction=0.0)["misses"] == 6


def test_slots_come_from_real_record_sizes():
    trace = make_trace(TEXTBOOK, num_experts=5, record_bytes=2**20)  # 1 MiB experts, tiny synthetic records
    r = replay(trace, budget=0.65, policy="lru")
    assert r["config"]["slots"] == 3 and r["config"]["capacity_bytes"] == 3 * 2**20
    assert r["bytes_moved"] == r["loads"] * 2**20


# -- random traces ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("budget", [0.4, 0.6])
@pytest.mark.parametrize("stage_fraction", [0.0, 0.25, 0.5])
def test_manager_lru_equals_the_reference_lru(seed, budget, stage_fraction):
    trace = random_trace(seed, record_bytes=[1000, 1000, 2000])  # two slot pools
    ref = lru_reference(trace, budget)
    got = replay(trace, budget=budget, policy="lru", stage_fraction=stage_fraction)
    assert got["misses"] == ref["misses"] and got["loads"] == ref["misses"]
    assert {layer: s["misses"] for layer, s in got["per_layer"].items()} == {
        layer: s["misses"] for layer, s in ref["per_layer"].items()
    }
    assert got["bytes_moved"] == ref["bytes_moved"]


@pytest.mark.parametrize("seed", [2, 3])
@pytest.mark.parametrize("budget", [0.4, 0.7])
def test_belady_moves_fewest_bytes_of_any_demand_cache(seed, budget):
    trace = random_trace(seed, record_bytes=[1000, 1000, 2000])
    best = belady(trace, budget=budget)
    assert best["bytes_moved"] <= lru_reference(trace, budget)["bytes_moved"]
    for policy in POLICIES:
        for stage_fraction in (0.0, 0.25):
            r = replay(trace, budget=budget, policy=policy, predictor=None, stage_fraction=stage_fraction)
            assert r["prefetches"] == 0
            assert best["bytes_moved"] <= r["bytes_moved"], (policy, stage_fraction)


def test_full_budget_misses_each_expert_once():
    trace = random_trace(4)
    first_uses = len({(layer, e) for row in trace.experts.tolist() for layer, es in enumerate(row) for e in es})
    assert belady(trace, budget=1.0)["misses"] == first_uses
    assert replay(trace, budget=1.0, policy="heat")["misses"] == first_uses


def test_a_predictor_learns_a_deterministic_routing():
    # Layer 1 always routes to (layer 0's expert + 1) mod 8: Markov's layer-to-layer counts find it.
    g = torch.Generator().manual_seed(0)
    first = torch.randint(0, 8, (400,), generator=g).tolist()
    trace = make_trace([[[e], [(e + 1) % 8]] for e in first], num_experts=8)
    # Markov's Laplace prior keeps its probabilities a little under certainty: copy from 0.8 on
    r = replay(trace, budget=0.5, policy="lru", predictor="markov", predictor_config=PredictorConfig(stage_probability=0.8))
    assert r["per_layer"][1]["recall@1"] > 0.9
    assert r["recall@1"] == r["per_layer"][1]["recall@1"]  # only layer 1 has a layer before it
    assert r["prefetches"] > 0 and r["loads"] == r["misses"] + r["prefetches"]


def test_predictors_needing_routers_or_training_say_what_to_pass():
    trace = make_trace(TEXTBOOK, num_experts=5, hidden_size=4)
    with pytest.raises(ValueError, match="router_probs"):
        replay(trace, budget=0.65, policy="lru", predictor="gate")
    with pytest.raises(ValueError, match="predictor_obj"):
        replay(trace, budget=0.65, policy="lru", predictor="learned")


@pytest.mark.parametrize(
    "shape, said", [((3, 5), "cannot be applied to layer 0's hidden states of width 4"), ((4, 6), "guesses {0: 6} experts")]
)
def test_routers_of_another_model_are_refused_before_the_replay(shape, said):
    """Routers that cannot take the trace's hidden states, or guess another number of experts, are another model's:
    refused with what does not fit, where they would otherwise fail inside a matmul or stage experts that do not
    exist."""
    trace = make_trace(TEXTBOOK, num_experts=5, hidden_size=4)
    trace.fingerprint = {"model_type": "mixtral"}

    def routers(weights):
        return lambda layer, hidden: torch.softmax(hidden.float() @ weights, dim=-1)

    with pytest.raises(ConfigError, match=rf"router_probs {re.escape(said)}.*another model's.*\(a mixtral model\)"):
        replay(trace, budget=0.65, policy="lru", predictor="gate", router_probs=routers(torch.randn(*shape)))
    assert replay(trace, budget=0.65, policy="lru", predictor="gate", router_probs=routers(torch.randn(4, 5)))["misses"] > 0


# -- files ------------------------------------------------------------------------------------------
def test_a_trace_file_cut_short_is_refused_with_what_it_lacks(tmp_path):
    make_trace([[[0, 1], [2, 3]]], num_experts=4).save(tmp_path / "t")
    (tmp_path / "t.json").write_text(json.dumps({"format": json.loads((tmp_path / "t.json").read_text())["format"]}))
    with pytest.raises(IncompatibleFileError, match="lacks num_experts, record_bytes: the files were cut short"):
        RoutingTrace.load(tmp_path / "t")


def test_trace_round_trips_and_refuses_another_model(tmp_path):
    trace = make_trace([[[0, 1], [2, 3]], [[1, 2], [3, 0]]], num_experts=4, hidden_size=8)
    trace.sequence_starts = [0, 1]
    trace.fingerprint = {"model_type": "mixtral", "router_sha256": "aaa"}
    trace.save(tmp_path / "t")
    back = RoutingTrace.load(tmp_path / "t.safetensors", fingerprint=trace.fingerprint)
    assert torch.equal(back.experts, trace.experts) and back.experts.dtype == torch.long
    assert torch.equal(back.hidden, trace.hidden)
    assert (back.sequence_starts, back.num_experts, back.record_bytes) == ([0, 1], [4, 4], [1000, 1000])
    assert RoutingTrace.load(tmp_path / "t").fingerprint == trace.fingerprint  # no check asked
    assert torch.equal(RoutingTrace.load(tmp_path / "t.json").experts, trace.experts)  # either file names it
    other = {"model_type": "mixtral", "router_sha256": "bbb"}
    with pytest.raises(IncompatibleFileError, match="aaa") as info:
        RoutingTrace.load(tmp_path / "t", fingerprint=other)
    assert "bbb" in str(info.value)
    with pytest.raises(IncompatibleFileError):
        RoutingTrace.load(tmp_path / "missing")


# -- recording ----------------------------------------------------------------------------------------
def test_record_trace_gives_the_models_own_routing(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    B, S = 2, 6
    ids = torch.randint(3, 128, (B, S), generator=torch.Generator().manual_seed(0))
    ref = load_reference(path)
    with torch.no_grad():
        logits = ref(input_ids=ids, output_router_logits=True).router_logits  # per layer [B*S, E]
    K = ref.config.num_experts_per_tok
    expected = torch.stack([lg.softmax(-1).topk(K, dim=-1).indices for lg in logits], dim=1)  # [B*S, L, K]

    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=1.0, device="cpu"), progress=False)
    trace = record_trace(model, ids, progress=False)
    assert trace.steps == B * S and trace.sequence_starts == [0, S]
    assert trace.experts.shape == (B * S, len(logits), K)
    assert torch.equal(trace.experts.sort(-1).values, expected.sort(-1).values)
    assert trace.hidden.shape == (B * S, len(logits), ref.config.hidden_size) and trace.hidden.dtype == torch.float16
    assert trace.fingerprint == model.mira.fingerprint and model.mira.recorder is None
    assert trace.record_bytes == [model.mira.store.record_bytes(i) for i in range(len(logits))]
    # the recorded hidden states drive the router-based predictors in a replay
    r = replay(trace, budget=0.5, policy="lru", predictor="gate", router_probs=model.mira.router_probs)
    assert r["steps"] == B * S and r["recall@1"] is not None


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])  # softmax top-k; sigmoid scores, group-limited top-k
def test_record_topk_gives_each_tokens_routing_in_one_forward_per_chunk(tiny_checkpoint, family):
    """`mira calibrate`'s recording: the experts each router chose, the same as the decode-like trace's."""
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    model = MiraMoEModel.from_pretrained(tiny_checkpoint(family), MiraConfig(gpu_budget=1.0, device="cpu"), progress=False)
    trace = record_trace(model, ids, progress=False)
    topk = record_topk(model, list(ids), progress=False)  # two chunks of 6 tokens
    assert sorted(topk) == sorted(model.mira.layers) and model.mira.recorder is None
    for layer, chosen in topk.items():
        assert chosen.shape == (12, model.mira.layers[layer].top_k)
        assert torch.equal(chosen.sort(-1).values, trace.experts[:, layer].sort(-1).values)


def _h200_trace() -> RoutingTrace:
    import json
    import os

    with open(os.path.join(os.path.dirname(__file__), "data", "h200_mixtral_random_decode_trace.json")) as f:
        d = json.load(f)
    steps = torch.tensor(d["steps"])  # [63, 8, 2]
    L = steps.shape[1]
    return RoutingTrace(steps, None, [0], [d["num_experts"]] * L, [d["record_bytes"]] * L)


def test_replay_reproduces_the_h200_runtime_counts():
    """The routing of 63 decode steps recorded on the H200 (random Mixtral shape, 16 slots at 25%):
    replayed offline, LRU makes the 736 loads (11.68 per token, 4.12 GB) the GPU runtime counted.
    Belady needs 494 from a cold cache (the benchmark's limit, 2.70 GB per token, starts from the cache
    its prefill left)."""
    trace = _h200_trace()
    lru = replay(trace, budget=0.25, policy="lru")
    assert lru["loads"] == 736 == lru_reference(trace, budget=0.25)["loads"]
    assert lru["bytes_per_token"] == pytest.approx(4.116e9, rel=1e-3)
    assert belady(trace, budget=0.25)["loads"] == 494


def test_a_prompt_is_one_block_per_layer_and_the_counts_are_the_decodings():
    # One layer, 4 experts, 3 slots (budget 0.75), top-1; tokens 0 1 2 | 3 0 1 2 with a 3-token prompt.
    # The prompt's block needs {0, 1, 2} at once: 3 loads, the prompt's own. Decoding then asks 3, 0, 1, 2.
    # MIN: 3 evicts 2 (used last), 0 and 1 hit, 2 misses: 2 misses of 4 uses.
    # LRU (a block's loads count as used in order): 3 evicts 0, 0 evicts 1, 1 evicts 2, 2 evicts 3: 4 misses.
    trace = make_trace([[[e]] for e in (0, 1, 2, 3, 0, 1, 2)], num_experts=4)
    b = belady(trace, budget=0.75, prompt_tokens=3)
    assert (b["misses"], b["hits"], b["uses"], b["steps"]) == (2, 2, 4, 4)
    r = replay(trace, budget=0.75, policy="lru", stage_fraction=0.0, prompt_tokens=3)
    assert (r["misses"], r["loads"], r["hits"], r["uses"], r["steps"], r["prompt_loads"]) == (4, 4, 0, 4, 4, 3)
    assert r["bytes_moved"] == 4000 and r["bytes_per_token"] == 1000
    whole = replay(trace, budget=0.75, policy="lru", stage_fraction=0.0)  # without a prompt: 7 blocks of one expert
    assert (whole["uses"], whole["prompt_loads"]) == (7, 0)


def test_each_sequence_gets_its_prompt_and_keeps_a_token_to_decode():
    trace = random_trace(3, steps=40)  # two sequences of 20 tokens
    r = replay(trace, budget=0.5, policy="heat", prompt_tokens=25)  # longer than a sequence: all but its last token
    assert r["steps"] == 2 and r["uses"] == sum(len(set(row)) for s in (19, 39) for row in trace.experts[s].tolist())
    with pytest.raises(ConfigError, match="do not start their sequences at the same steps"):
        replay(trace, budget=0.5, prompt_tokens=4, concurrency=4)  # streams of 10 steps: the second starts mid-sequence


def test_a_reset_per_sequence_is_refused_where_streams_share_the_predictor():
    trace = random_trace(3, steps=40)
    with pytest.raises(ConfigError, match="reset_predictor_per_sequence with concurrency=2: one predictor serves"):
        replay(trace, budget=0.5, predictor="markov", reset_predictor_per_sequence=True, concurrency=2)


def test_a_batch_of_prompts_is_one_block_per_layer_then_decodes_together():
    # Two streams of one 4-token sequence each, one layer, 4 experts, 3 slots, top-1: A = 0 1 | 2 3, B = 1 2 | 3 0.
    # The prompts' block needs {0, 1, 2}; the decoding then asks {2, 3} and {3, 0}.
    # MIN: 3 evicts 1 (never used again): 1 miss of 4 uses. LRU: 3 evicts 0, then 0 evicts 1: 2 misses.
    trace = make_trace([[[e]] for e in (0, 1, 2, 3, 1, 2, 3, 0)], num_experts=4)
    trace.sequence_starts = [0, 4]
    b = belady(trace, budget=0.75, concurrency=2, prompt_tokens=2)
    assert (b["misses"], b["hits"], b["uses"], b["steps"]) == (1, 3, 4, 2)
    r = replay(trace, budget=0.75, policy="lru", stage_fraction=0.0, concurrency=2, prompt_tokens=2, batch_aware=False)
    assert (r["misses"], r["hits"], r["uses"], r["steps"], r["tokens"], r["prompt_loads"]) == (2, 2, 4, 2, 4, 3)


def test_recording_a_model_whose_experts_route_more_rows_than_new_tokens_is_refused_clearly():
    """A model whose MoE layers compute more rows than a step's new tokens (a diffusion model's canvas; here a hook
    that gives an experts module each row twice) cannot be traced one routing per token: refused, saying so, where
    it had failed in the trace's own indexing."""
    from tiny_models import build, config_or_skip

    from mira_hf.errors import UnsupportedModelError

    model = MiraMoEModel.wrap(build(config_or_skip("mixtral")).eval(), MiraConfig(device="cpu", gpu_budget=0.5))
    experts = model.model.layers[0].mlp.experts
    experts.register_forward_pre_hook(lambda module, args: tuple(torch.cat([a, a]) for a in args))
    ids = torch.randint(3, 100, (1, 4), generator=torch.Generator().manual_seed(0))
    with pytest.raises(UnsupportedModelError, match=r"MoE layer 0 routed 2 rows for the 1 new tokens of a step"):
        record_trace(model, ids, progress=False)


def test_a_looped_decoder_counts_one_step_per_forward_and_recording_it_is_refused_clearly():
    """A decoder that runs some layers several times per token (Inkling 2's loop) calls those MoE layers again within
    one forward: that is still one step (counters, hit-rate history), and a trace or calibration, which records one
    routing per layer and token, refuses the model naming the layer, where it had kept the last pass or said the
    layer routed too few tokens."""
    from tiny_models import build, config_or_skip

    from mira_hf.errors import UnsupportedModelError

    model = MiraMoEModel.wrap(build(config_or_skip("inkling2_loop_text")).eval(), MiraConfig(device="cpu", gpu_budget=0.5))
    ids = torch.randint(3, 100, (1, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
    assert model.mira.stats()["steps"] == 1 and len(model.mira.hit_rate_history()) == 1
    model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    assert model.mira.stats()["steps"] == 4
    with pytest.raises(UnsupportedModelError, match=r"MoE layer \d+ routed twice in one forward step.*looped layers"):
        record_trace(model, ids, progress=False)
    with pytest.raises(UnsupportedModelError, match=r"MoE layer \d+ routed 8 rows for the 4 tokens given.*looped layers"):
        record_topk(model, [ids[0]], progress=False)
