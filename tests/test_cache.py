"""Cache and manager behaviour on known traces, independent of any model."""

import pytest
import torch

from mira_hf.budget import LayerInfo, plan_budget
from mira_hf.cache import Eviction, ExpertCache, SlotPool
from mira_hf.heat import HeatConfig
from mira_hf.manager import ExpertManager
from mira_hf.policies import LRUPolicy
from mira_hf.predictors import PredictorConfig
from mira_hf.store import ExpertStore


def make_manager(
    layers=2,
    experts=4,
    slots=3,
    stage_fraction=0.25,
    policy="lru",
    inflight_bytes=64 * 2**20,
    predictor_config=None,
    heat=None,
):
    store = ExpertStore()
    for layer in range(layers):
        # expert e of layer l holds the value 10*l + e, so a wrong slot shows up as a wrong number
        w = torch.stack([torch.full((4, 2), float(10 * layer + e)) for e in range(experts)])
        store.add_layer(layer, {"gate_up_proj": w, "down_proj": w.transpose(1, 2).contiguous()})
    infos = [LayerInfo(i, f"layers.{i}.mlp.experts", experts, 2) for i in range(layers)]
    record = store.record_bytes(0)
    budget = plan_budget(infos, {i: record for i in range(layers)}, slots * record)
    return ExpertManager(
        store,
        infos,
        budget,
        torch.device("cpu"),
        policy=policy,
        stage_fraction=stage_fraction,
        demand_inflight_bytes=inflight_bytes,
        predictor_config=predictor_config,
        heat=heat,
    )


def _holds(manager, slot, key) -> bool:
    """Whether `slot` holds every byte of `key`'s tensors where its record layout puts them."""
    row = manager.arena.slabs[manager.cache.pool_of_layer[key[0]]][slot.index]
    return all(torch.equal(row[offset : offset + piece.numel()], piece) for offset, piece in manager.store.pieces(*key))


def run_block(manager, layer, experts):
    plan = manager.begin(layer, experts)
    seen = {}
    for e in plan.order:
        w = manager.acquire(plan, e)
        seen[e] = w["gate_up_proj"][0, 0].item()
        manager.release(plan, e)
    manager.end(plan)
    return seen


def test_lru_counts_match_a_hand_computed_trace():
    m = make_manager(slots=3, stage_fraction=0.0)
    trace = [(0, [0, 1]), (1, [0]), (0, [0, 2]), (1, [1, 2]), (0, [1])]
    for layer, experts in trace:
        seen = run_block(m, layer, experts)
        assert seen == {e: float(10 * layer + e) for e in experts}  # the right weights, always
    s = m.stats()
    # By hand (3 slots, global LRU, a load counts as a use):
    # [00 01] -> [00 01 10] -> hit 00, 02 evicts 01 -> 11 evicts 10, 12 evicts 00 -> 01 evicts 02
    assert (s["hits"], s["misses"], s["loads"], s["evictions"]) == (1, 7, 7, 4)
    assert s["per_layer"][0]["hits"] == 1 and s["per_layer"][0]["misses"] == 4
    assert s["per_layer"][1]["misses"] == 3 and s["per_layer"][1]["evictions"] == 1
    assert m.cache.resident() == [(0, 1), (1, 1), (1, 2)]
    assert s["bytes_h2d"] == 7 * m.store.record_bytes(0)


def test_stage_tier_keeps_lru_order():
    """With a STAGE tier, used experts join HOT, HOT's least recently used drops to STAGE, and STAGE is
    evicted first: still global LRU. The trace re-uses the oldest experts, so FIFO would evict others."""
    for stage_fraction in (0.0, 0.5):  # 4 slots: 4 HOT / 2 HOT + 2 STAGE
        m = make_manager(slots=4, stage_fraction=stage_fraction)
        run_block(m, 0, [0, 1])
        run_block(m, 1, [0, 1])  # full; with a STAGE group (0, 0) and (0, 1) were demoted to it
        # every resident expert has been used since its copy: "hot" to users, whatever its eviction group
        assert [m.tier_of(*k) for k in m.cache.resident()] == ["hot"] * 4
        run_block(m, 0, [0, 1])  # two hits: (0, 0), (0, 1) become the most recently used
        run_block(m, 1, [2, 3])  # LRU order 10 11 00 01: evicts (1, 0), (1, 1); FIFO would evict (0, 0), (0, 1)
        assert m.cache.resident() == [(0, 0), (0, 1), (1, 2), (1, 3)]
        s = m.stats()
        assert (s["hot_hits"], s["stage_hits"], s["misses"], s["evictions"]) == (2, 0, 6, 2)  # nothing was prefetched
        assert s["per_layer"][1]["evictions"] == 2 and s["per_layer"][0]["evictions"] == 0


def _touch(cache, key):
    """One use of `key` as a block makes it: a hit uses its slot, a miss takes a slot first. Returns the eviction."""
    slot = cache.lookup(key)
    evicted = None
    if slot is None:
        slot, evicted = cache.allocate(key, staged=False)
    cache.use(slot)
    return None if evicted is None else evicted.key


def _lru_cache(n_slots):
    return ExpertCache({0: SlotPool(1, n_slots, 0, LRUPolicy())}, {0: 0})


def test_lru_evicts_the_least_recently_used_not_the_first_loaded_nor_the_least_used():
    a, b, c, d, e = ((0, i) for i in range(5))
    cache = _lru_cache(3)
    evictions = [_touch(cache, k) for k in (a, b, c, a, a, b, d, e)]
    # By hand, 3 slots: a b c | a a b hit (order c a b) | d evicts c (a b d) | e evicts a (b d e).
    # FIFO would evict a then b; LFU (a 3, b 2, c 1, d 1 uses) c then d.
    assert [k for k in evictions if k is not None] == [c, a]
    assert cache.resident() == [b, d, e]
    # the eviction order is the order of last use; a removal forgets the key
    cache.remove(d)
    assert _touch(cache, a) is None and _touch(cache, c) == b


def test_a_demand_load_takes_idle_stage_before_hot_and_awaited_prefetches_last():
    """Victim groups: idle STAGE, then HOT, then prefetches still awaiting their block (never pinned slots)."""
    cache = ExpertCache({0: SlotPool(1, 3, 1, LRUPolicy())}, {0: 0})  # 2 HOT + 1 STAGE
    hot = [(0, 0), (0, 1)]
    for k in hot:
        _touch(cache, k)
    guess, _ = cache.allocate((0, 2), staged=True)  # awaiting its block
    assert cache.allocate((0, 3), staged=True) == (None, None)  # a guess never evicts HOT nor another guess
    slot, evicted = cache.allocate((0, 3), staged=False)
    assert evicted.key == (0, 0) and not evicted.wasted_prefetch  # HOT before an awaited guess
    cache.lookup((0, 1)).pins = 1
    cache.lookup((0, 3)).pins = 1
    slot, evicted = cache.allocate((0, 4), staged=False)
    assert evicted == Eviction((0, 2), wasted_prefetch=True)  # last: the awaited guess, evicted unused
    slot.pins = 1
    assert cache.allocate((0, 5), staged=False) == (None, None)  # everything pinned
    assert cache.allocate((0, 5), staged=False, evict=False) == (None, None)


def _five_steps_of_history(policy):
    """Two MoE layers, 5 slots, no eviction in 10 forward steps; then layer 0 needs a new expert. The use rates
    keep one fixed memory (0.9 per step), so they can be computed by hand."""
    m = make_manager(layers=2, experts=8, slots=5, stage_fraction=0.0, policy=policy, heat=HeatConfig(use_rate_decay=0.9))
    for step in range(1, 11):
        m.enter_forward()
        run_block(m, 0, [0, 1] if step in (2, 4, 6, 8) else [0])
        run_block(m, 1, [0] + ([1] if step <= 7 else []) + ([2] if step >= 8 else []))
        m.exit_forward()
    return m


@pytest.mark.parametrize("policy, victim", [("lru", (1, 1)), ("heat", (0, 1)), ("priority", (1, 1))])
def test_each_policy_evicts_its_own_victim_on_a_hand_computed_trace(policy, victim):
    """The unpinned candidates when step 11's layer 0 needs expert 2 (expert (0, 0) is pinned):

    | expert | loaded | uses (steps)  | last use    | use rate after step 10         | keep value (L=2)    |
    | (0, 1) | step 2 | 4 (2, 4, 6, 8) | step 8, L0  | 0.1·(.9^8+.9^6+.9^4+.9^2)=.2428 | p/2 = .1214         |
    | (1, 0) | step 1 | 10 (1..10)    | step 10, L1 | 1 − .9^10 = .6513              | p/(2 − p) = .4829   |
    | (1, 1) | step 1 | 7 (1..7)      | step 7, L1  | (1 − .9^7)·.9^3 = .3803        | .2348               |
    | (1, 2) | step 8 | 3 (8..10)     | step 10, L1 | 1 − .9^3 = .271                | .1567               |

    (keep value = 1 / expected layers to the next use = p / (d·p + L·(1 − p)); d = 2 for layer 0, which
    just ran, and 1 for layer 1, which runs next). LRU evicts (1, 1), the oldest last use; FIFO would
    evict (1, 0), the first loaded; LFU (1, 2), the fewest uses; heat evicts (0, 1), the lowest keep
    value. Priority (0.6·predicted + 0.3·recency + 0.1·cost, nothing predicted, equal costs) ranks by
    recency like LRU."""
    m = _five_steps_of_history(policy)
    assert m.cache.resident() == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)] and m.stats()["evictions"] == 0
    rates = [m.heat.use_rate[layer][e] for layer, e in ((0, 1), (1, 0), (1, 1), (1, 2))]
    by_hand = [0.1 * (0.9**8 + 0.9**6 + 0.9**4 + 0.9**2), 1 - 0.9**10, (1 - 0.9**7) * 0.9**3, 1 - 0.9**3]
    assert rates == pytest.approx(by_hand, rel=1e-6)
    m.enter_forward()
    assert run_block(m, 0, [0, 2]) == {0: 0.0, 2: 2.0}
    m.exit_forward()
    assert m.cache.resident() == sorted({(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)} - {victim})
    s = m.stats()
    # 34 uses in steps 1..10 (layer 0: 4 × 2 + 6 × 1; layer 1: 7 × 2 + 3 × 2), 5 of them first loads; step 11: a hit, a miss
    assert (s["evictions"], s["per_layer"][victim[0]]["evictions"], s["hits"], s["misses"]) == (1, 1, 29 + 1, 5 + 1)


def test_heat_keep_values_follow_the_expected_distance_by_hand():
    m = _five_steps_of_history("heat")
    m._last_layer = 0  # inside step 11, layer 0 running
    keys = [(0, 1), (1, 0), (1, 1), (1, 2)]
    p = [0.1 * (0.9**8 + 0.9**6 + 0.9**4 + 0.9**2), 1 - 0.9**10, (1 - 0.9**7) * 0.9**3, 1 - 0.9**3]
    assert m.valuation.keep_values(keys) == pytest.approx([p[0] / 2] + [q / (2 - q) for q in p[1:]], rel=1e-6)
    assert [m.valuation.layers_until(0), m.valuation.layers_until(1)] == [2, 1]
    assert m.valuation.expected_distance((1, 2)) == pytest.approx(1 + 2 * (1 - p[3]) / p[3], rel=1e-6)
    assert m.valuation.expected_distance((1, 2), probability=1.0) == pytest.approx(1.0)  # certain: its layer runs next
    assert m.valuation.expected_distance((0, 7)) == pytest.approx(2 + 2 * (1 - 1e-3) / 1e-3)  # never used: the 1e-3 floor


def test_block_needing_more_experts_than_slots_streams_through():
    m = make_manager(layers=1, experts=4, slots=2)
    seen = run_block(m, 0, [0, 1, 2, 3])
    assert seen == {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0}
    assert m.stats()["loads"] == 4 and len(m.cache.resident()) == 2


def test_a_block_streams_its_misses_through_two_slots_and_keeps_other_layers_experts():
    """A prefill-like step needs every expert of every layer. With two demand copies in flight, each
    layer's experts stream through two slots and the experts of the layers still to run stay resident;
    with no limit, each block evicts them and every layer reloads everything."""

    def prefill_loads(inflight_bytes):
        m = make_manager(layers=4, experts=4, slots=6, stage_fraction=0.0, policy="heat", inflight_bytes=inflight_bytes)
        for layer in range(4):  # one decode step: expert 0 of every layer is resident
            run_block(m, layer, [0])
        m.reset_stats()
        for layer in range(4):  # prefill: all experts of every layer, in layer order
            seen = run_block(m, layer, [0, 1, 2, 3])
            assert seen == {e: float(10 * layer + e) for e in range(4)}
        return m.stats()["loads"]

    record = make_manager().store.record_bytes(0)
    # Depth 2 (by hand): layer 0 hits expert 0, its misses 1 and 2 take the two free slots, 3 takes the
    # slot of an expert of layer 0 already computed (needed again furthest in the future); likewise for
    # each layer: every expert 0 is a hit.
    assert prefill_loads(record) == 16 - 4
    # Unlimited: layer 0 pins its 3 misses at once, evicting one of the other layers' experts, and so on.
    assert prefill_loads(64 * 2**20) > 12


def test_prefetch_never_evicts_hot_experts():
    m = make_manager(layers=1, experts=4, slots=2, stage_fraction=0.0)
    run_block(m, 0, [0, 1])  # both HOT, no STAGE slot
    assert m.prefetch(0, [2, 3]) == 0
    assert m.cache.resident() == [(0, 0), (0, 1)]


def test_prefetched_expert_counts_as_stage_hit_and_waste_is_counted():
    m = make_manager(layers=1, experts=6, slots=4, stage_fraction=0.5)  # 2 HOT + 2 STAGE
    assert m.prefetch(0, [2, 3]) == 2
    run_block(m, 0, [2])  # a stage hit: the prefetch was used
    s = m.stats()
    assert (s["stage_hits"], s["prefetches"], s["prefetch_used"], s["prefetch_wasted"]) == (1, 2, 1, 0)
    run_block(m, 0, [0, 1])  # the two free slots; HOT is over its size: (0, 2) drops to the STAGE group
    assert [m.tier_of(0, e) for e in range(4)] == ["hot", "hot", "hot", "stage"]  # (0, 3): copied ahead, unused
    run_block(m, 0, [4])  # evicts STAGE's least recently used: (0, 3), prefetched and never used
    assert m.cache.lookup((0, 3)) is None
    s = m.stats()
    record = m.store.record_bytes(0)
    assert (s["prefetch_wasted"], s["evictions"], s["prefetches"], s["loads"]) == (1, 1, 2, 5)
    assert (s["stage_hits"], s["hot_hits"], s["hits"], s["misses"], s["hit_rate"]) == (1, 0, 1, 3, 0.25)
    assert s["bytes_h2d"] == 5 * record and s["per_layer"][0]["prefetch_wasted"] == 1
    # heat: (0, 2) +0.1 (used) +0.03 (a used prefetch), then two idle steps ×0.95 (a one-layer model's block is a
    # step, which its last layer's block ends); (0, 3) −0.05 (wasted), kept at 0
    assert m.heat.score(0, 2) == pytest.approx(0.13 * 0.95**2) and m.heat.score(0, 3) == 0.0
    run_block(m, 0, [5])  # the next victim, (0, 2), was a prefetch but was used: not wasted
    assert m.stats()["prefetch_wasted"] == 1 and m.stats()["evictions"] == 2


def test_every_counter_of_stats_on_a_hand_computed_trace():
    """Each counter of `stats()` made non-zero by a trace whose value is known."""
    m = make_manager(layers=2, experts=4, slots=3, stage_fraction=0.0)
    record = m.store.record_bytes(0)
    m.enter_forward()
    run_block(m, 0, [0, 1])
    # guesses for layer 1: 0 and 1 (confidence 0.3), not copied (< 0.95)
    m.staging.stage(0, {1: torch.tensor([0.9, 0.4, 0.1, 0.0])})
    run_block(m, 1, [0, 2])  # tp 1 (0), fp 1 (1), fn 1 (2); (1, 2) evicts the least recently used, (0, 0)
    m.exit_forward()
    m.enter_forward()
    run_block(m, 0, [1])  # a hit
    m.exit_forward()
    s = m.stats()
    assert (s["steps"], s["hits"], s["hot_hits"], s["misses"], s["loads"], s["evictions"]) == (2, 1, 1, 4, 4, 1)
    assert s["hit_rate"] == 0.2 and m.hit_rate_history() == [0.0, 1.0]
    assert s["bytes_h2d"] == 4 * record
    assert s["predictor_precision"] == 0.5 and s["predictor_recall"] == 0.5
    assert s["per_layer"][1]["precision@1"] == 0.5 and s["per_layer"][1]["recall@1"] == 0.5
    assert "recall@1" not in s["per_layer"][0]  # nothing was predicted for layer 0
    assert s["stall_s"] == pytest.approx(sum(m.loader.stalls().values())) and s["stall_s"] > 0  # CPU: the copies
    assert s["per_layer"][0]["stall_s"] + s["per_layer"][1]["stall_s"] == pytest.approx(s["stall_s"])
    assert (s["budget_bytes"], s["capacity_bytes"], s["resident_bytes"], s["buffer_bytes"], s["slots"]) == (
        3 * record,
        3 * record,
        3 * record,
        0,
        3,
    )
    assert (s["device"], s["quantization"], s["placement"], s["host_only_experts"]) == ("cpu", None, "raw", 0)
    assert (s["prediction_active"], s["prediction_paused_steps"]) == (False, 0)  # no predictor
    m.loader.latencies = lambda: [0.5, 0.1, 0.4, 0.2, 0.3]
    assert (m.stats()["load_latency_p50_s"], m.stats()["load_latency_p95_s"]) == (0.3, 0.5)
    m.reset_stats()
    s = m.stats()
    assert (s["steps"], s["hits"], s["misses"], s["loads"], s["bytes_h2d"], s["stall_s"]) == (0, 0, 0, 0, 0, 0.0)
    assert s["predictor_precision"] is None and s["hit_rate"] == 0.0 and m.hit_rate_history() == []
    assert s["resident_bytes"] == 3 * record  # the cache keeps its experts


# Where each counter of `stats()` is made non-zero and checked against a known value. A new counter
# needs a test and an entry here.
STATS_CHECKED_BY = {
    **dict.fromkeys(
        ("hot_hits", "misses", "loads", "evictions", "bytes_h2d", "hits", "hit_rate", "steps", "stall_s"),
        "test_every_counter_of_stats_on_a_hand_computed_trace",
    ),
    **dict.fromkeys(("predictor_precision", "predictor_recall", "load_latency_p50_s", "load_latency_p95_s"), "the same"),
    **dict.fromkeys(("budget_bytes", "capacity_bytes", "resident_bytes", "slots", "device", "placement"), "the same"),
    **dict.fromkeys(
        ("stage_hits", "prefetches", "prefetch_used", "prefetch_wasted"), "test_prefetched_expert_counts_as_stage_hit..."
    ),
    **dict.fromkeys(("speculated", "speculated_used"), "test_a_speculative_copy_is_finished_when_its_expert_is_used"),
    "host_only_experts": "test_host_only_experts_are_computed_but_never_keep_a_slot",
    **dict.fromkeys(
        ("kept_packed_experts", "kept_packed_bytes"),
        "test_lossless.py::test_mixed_placement_keeps_a_few_experts_packed_copies_nothing_more_and_...",
    ),
    "host_part_bytes": "test_host_split.py::test_the_store_holds_device_parts_so_the_same_budget_holds_more_experts",
    "host_costs": "test_host_split.py::test_stats_give_what_the_planner_measured_per_host_part_and_the_report_prints_it",
    "parts_copied": "test_host_split.py::test_the_manager_places_each_host_part_as_the_costs_say",
    "host_computed": "test_host_compute.py::test_the_manager_splits_a_blocks_misses_as_the_costs_say",
    "buffer_bytes": "test_budget.py::test_codec_buffers_are_planned_out_of_the_budget",
    "quantization": "test_api.py::test_default_config_reports_the_format_it_resolved (None), test_codec_buffers_...",
    **dict.fromkeys(
        ("prediction_active", "prediction_paused_steps"),
        "test_payoff.py::test_prediction_pauses_where_copies_cost_nothing_and_outputs_stay_identical",
    ),
    "per_layer": "test_lru_counts_match_a_hand_computed_trace",
}


def test_every_counter_of_stats_is_checked_somewhere():
    assert set(make_manager().stats()) == set(STATS_CHECKED_BY)


def test_resident_bytes_never_exceed_budget():
    m = make_manager(layers=2, experts=4, slots=3)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        layer = int(torch.randint(0, 2, (1,), generator=g))
        experts = sorted(set(torch.randint(0, 4, (3,), generator=g).tolist()))
        run_block(m, layer, experts)
        assert m.cache.resident_bytes <= m.budget.budget_bytes


def test_exception_mid_block_leaves_cache_consistent():
    m = make_manager(layers=1, experts=4, slots=2)
    plan = m.begin(0, [0, 1])
    m.acquire(plan, plan.order[0])
    m.end(plan)  # as the proxy's `finally` does on an exception
    assert all(s.pins == 0 for pool in m.cache.pools.values() for s in pool.slots)
    assert run_block(m, 0, [2, 3]) == {2: 2.0, 3: 3.0}


@pytest.mark.parametrize("slots", [2, 3, 8])
def test_budget_plan_slots(slots):
    m = make_manager(slots=slots)
    assert sum(m.budget.n_slots.values()) == min(slots, 8)
    assert m.cache.capacity_bytes <= m.budget.budget_bytes


def steps(manager, per_layer, n):
    """`n` forward steps, each running `per_layer[layer]` for every layer in order."""
    for _ in range(n):
        manager.enter_forward()
        for layer, experts in enumerate(per_layer):
            run_block(manager, layer, experts)
        manager.exit_forward()


def test_heat_guess_never_evicts_an_expert_needed_sooner():
    """Under the heat policy a prefetch may take a HOT slot, but only from an expert whose expected
    next use is later than the guess's: experts used every step stay."""
    m = make_manager(layers=2, experts=4, slots=4, stage_fraction=0.0, policy="heat")
    steps(m, [[0, 1], [0, 1]], 10)
    m.enter_forward()
    run_block(m, 0, [0, 1])
    assert m.prefetch(1, [3], [0.95]) == 0
    assert m.cache.resident() == [(0, 0), (0, 1), (1, 0), (1, 1)]
    m.exit_forward()


def test_heat_guess_evicts_a_stale_expert():
    m = make_manager(layers=2, experts=4, slots=3, stage_fraction=0.0, policy="heat")
    steps(m, [[0, 1], [2]], 1)
    steps(m, [[0, 1], []], 40)  # (1, 2) stays resident, unused for 40 steps
    m.enter_forward()
    run_block(m, 0, [0, 1])
    assert m.prefetch(1, [3], [0.95]) == 1
    assert m.cache.resident() == [(0, 0), (0, 1), (1, 3)]
    m.exit_forward()


def test_predicted_probability_ranks_evictions():
    """A layer's latest guesses replace its use rate in the expected distance to the next use."""
    m = make_manager(layers=2, experts=4, slots=4, policy="heat")
    steps(m, [[0, 1], [0, 1]], 5)
    m.enter_forward()
    run_block(m, 0, [0, 1])
    before = m.valuation.expected_distance((1, 0))
    m.staging.stage(0, {1: torch.tensor([0.0, 1.0, 0.0, 0.0])})
    assert m.valuation.expected_distance((1, 1)) == 1.0  # certain, next layer
    assert m.valuation.expected_distance((1, 0)) > before  # predicted unused: its next chance is a step later
    run_block(m, 1, [1])
    assert m.staging.layer_probs == {}  # spent once the layer ran
    m.exit_forward()


def test_only_likely_guesses_of_the_next_layer_are_copied():
    m = make_manager(layers=3, experts=4, slots=6, policy="heat")
    m.enter_forward()
    run_block(m, 0, [0, 1])
    m.staging.stage(0, {1: torch.tensor([0.97, 0.5, 0.0, 0.0]), 2: torch.tensor([0.99, 0.0, 0.0, 0.0])})
    assert m.cache.resident() == [(0, 0), (0, 1), (1, 0)]  # not (1, 1): p < 0.95; not layer 2: two layers ahead
    m.exit_forward()


def test_records_of_nearly_equal_size_share_one_pool():
    """Lossless records differ by a few escape entries per layer. Sizes within 1/16 share the larger
    size's pool, so the budget is split once into whole slots (a pool per layer would round each layer's
    share down: 8 layers × 2 slots instead of 20 for a Mixtral-shaped model at 25%)."""
    layers = [LayerInfo(i, f"layers.{i}", 8, 2) for i in range(8)]
    sizes = {i: 264_564_608 - 4096 * i for i in range(8)}  # as measured on the H200, give or take the escapes
    plan = plan_budget(layers, sizes, 5_637_144_576, buffers={"scratch": 234_881_024})
    assert set(plan.pool_of_layer.values()) == {264_564_608}
    assert plan.n_slots == {264_564_608: (5_637_144_576 - 234_881_024) // 264_564_608} == {264_564_608: 20}
    far = plan_budget(layers[:2], {0: 1000, 1: 500}, 10_000)
    assert far.pool_of_layer == {0: 1000, 1: 500}  # unequal records keep their own pools


def _speculating_manager(fraction_of_record: float):
    record = make_manager().store.record_bytes(0)
    cfg = PredictorConfig(speculate_bytes=int(record * fraction_of_record))
    return make_manager(layers=3, experts=4, slots=6, policy="heat", predictor_config=cfg), record


def test_a_speculative_copy_is_finished_when_its_expert_is_used():
    m, record = _speculating_manager(0.5)
    m.enter_forward()
    run_block(m, 0, [0, 1])
    before = m.stats()["bytes_h2d"]
    # p(1, 0) = 0.5 and p(1, 1) = 0.4: below the copy threshold (0.95), so speculated on: only the
    # likeliest guess starts, and only its first speculate_bytes (half a record)
    m.staging.stage(0, {1: torch.tensor([0.5, 0.4, 0.0, 0.0])})
    slot = m.cache.lookup((1, 0))
    assert slot is not None and slot.partial == record // 2 and m.cache.lookup((1, 1)) is None
    assert m.stats()["bytes_h2d"] - before == record // 2
    assert run_block(m, 1, [0, 2]) == {0: 10.0, 2: 12.0}  # the right weights: the copy was finished
    assert slot.partial == 0
    assert _holds(m, slot, (1, 0))  # every byte of the record
    s = m.stats()
    assert (s["speculated"], s["speculated_used"], s["prefetch_wasted"]) == (1, 1, 0)
    assert s["per_layer"][1]["misses"] == 2  # the rest of a speculative copy is a demand load
    assert s["bytes_h2d"] - before == 2 * record  # (1, 0) once, in two parts, and (1, 2)
    m.exit_forward()


def test_records_no_larger_than_the_speculation_are_not_speculated_on():
    m, record = _speculating_manager(1.0)  # a whole record: a wrong guess would stay, so none is made
    m.enter_forward()
    run_block(m, 0, [0, 1])
    m.staging.stage(0, {1: torch.tensor([0.0, 0.0, 0.6, 0.5])})
    assert m.cache.resident() == [(0, 0), (0, 1)]
    m.exit_forward()


def test_a_step_ending_drops_what_its_blocks_did_not_finish():
    m, record = _speculating_manager(0.5)
    m.enter_forward()
    run_block(m, 0, [0, 1])
    m.staging.stage(0, {1: torch.tensor([0.0, 0.0, 0.6, 0.0])})
    assert m.cache.lookup((1, 2)).partial
    m.exit_forward()  # layer 1 never ran (an exception, or a model that stops early)
    assert m.cache.lookup((1, 2)) is None and m.stats()["prefetch_wasted"] == 1


def test_a_cut_short_guess_is_dropped_when_its_layer_runs_without_it():
    m, record = _speculating_manager(0.25)
    m.enter_forward()
    run_block(m, 0, [0, 1])
    m.staging.stage(0, {1: torch.tensor([0.0, 0.0, 0.0, 0.7])})
    assert m.cache.lookup((1, 3)).partial == record // 4
    free_before = len(m.cache.pool(1)._free)
    run_block(m, 1, [0])  # (1, 0) takes a free slot; (1, 3) is dropped, which frees one
    assert m.cache.lookup((1, 3)) is None
    assert len(m.cache.pool(1)._free) == free_before
    s = m.stats()
    assert (s["speculated"], s["speculated_used"], s["prefetch_wasted"]) == (1, 0, 1)
    m.exit_forward()


def test_speculate_bytes_is_validated():
    from mira_hf import ConfigError

    for bad in (-1, 1.5, True, "64MiB"):
        with pytest.raises(ConfigError, match="speculate_bytes"):
            PredictorConfig(speculate_bytes=bad)
    assert make_manager().staging.speculate_bytes == 0  # CPU: off by default


def test_a_next_step_guess_ranks_evictions_until_its_layer_runs_again():
    """A guess for a layer that already ran this step (the learned predictor's next-step head) is
    about the next step: it survives the step boundary, orders evictions, and is spent when the layer runs."""
    m = make_manager(layers=2, experts=4, slots=4, policy="heat")
    steps(m, [[0, 1], [0, 1]], 5)
    m.enter_forward()
    run_block(m, 0, [0, 1])
    run_block(m, 1, [0, 1])
    m.staging.stage(1, {1: torch.tensor([1.0, 0.0, 0.0, 0.0])})  # next step, layer 1 uses expert 0, not 1
    m.exit_forward()
    m.enter_forward()  # a new step of the same sequence: the guess is kept
    # equal use rates: only the guess differs
    assert m.valuation.expected_distance((1, 0)) < m.valuation.expected_distance((1, 1))
    assert m.cache.allocate((0, 3), staged=False)[1].key == (1, 1)  # the victim: predicted unused next step
    m.cache.remove((0, 3))
    run_block(m, 1, [0])
    assert 1 not in m.staging.layer_probs  # spent once the layer ran
    m.exit_forward()


def test_the_first_layers_next_step_guess_is_staged_after_the_last_layer():
    """No guess made within a step reaches the first layer; its next-step guess (if likely enough) is
    copied once the last layer's block has run, and the next step finds it there."""
    m = make_manager(layers=2, experts=4, slots=5, policy="heat")  # one slot free after the warm-up
    steps(m, [[0, 1], [0, 1]], 5)
    m.enter_forward()
    run_block(m, 0, [0, 1])
    m.staging.stage(0, {0: torch.tensor([0.0, 0.0, 0.99, 0.9])})  # next step: layer 0 likely uses expert 2; 3 below 0.95
    assert m.cache.lookup((0, 2)) is None  # not copied yet: the rest of this step may need the slot
    before = m.stats()["prefetches"]
    run_block(m, 1, [0, 1])  # the last layer
    assert m.cache.lookup((0, 2)) is not None and m.cache.lookup((0, 3)) is None
    assert m.stats()["prefetches"] == before + 1
    m.exit_forward()
    m.enter_forward()
    hits = m.stats()["stage_hits"]
    run_block(m, 0, [2])
    assert m.stats()["stage_hits"] == hits + 1
    m.exit_forward()


def test_a_new_sequence_forgets_next_step_guesses():
    m = make_manager(layers=2, experts=4, slots=4, policy="heat")
    m.enter_forward()
    run_block(m, 0, [0, 1])
    m.staging.stage(0, {0: torch.tensor([0.0, 1.0, 0.0, 0.0])})
    m.exit_forward()
    m.enter_forward(new_sequence=True)  # made from the last token of another prompt
    assert m.staging.layer_probs == {} and m.staging.next_step == set()
    m.exit_forward()


def test_load_latency_percentiles_are_reported_and_reset():
    m = make_manager(slots=3, stage_fraction=0.0)
    assert m.stats()["load_latency_p50_s"] is None  # no copy yet
    for layer, experts in [(0, [0, 1]), (1, [0]), (0, [2, 3]), (1, [1, 2])]:
        run_block(m, layer, experts)
    s = m.stats()
    assert len(m.loader.latencies()) == s["loads"]  # one sample per copy
    assert 0 < s["load_latency_p50_s"] <= s["load_latency_p95_s"]
    m.reset_stats()
    assert m.stats()["load_latency_p50_s"] is None


def test_host_only_experts_are_computed_but_never_keep_a_slot():
    from mira_hf import ConfigError

    m = make_manager(layers=2, experts=4, slots=3, stage_fraction=0.0, policy="heat")
    with pytest.raises(ConfigError, match="do not exist"):
        m.set_host_only({0: [4]})  # layer 0 has experts 0..3
    assert m.host_only == frozenset()  # refused before anything changed
    for layer, expert in ((2, 0), (0, 4)):
        with pytest.raises(ConfigError, match="tier_of: layer .* do not exist.*Give a layer ordinal and an expert index"):
            m.tier_of(layer, expert)
    run_block(m, 0, [3])
    m.set_host_only({0: [3]})
    assert m.cache.lookup((0, 3)) is None  # resident and unpinned: given back at once
    assert run_block(m, 0, [3, 1]) == {3: 3.0, 1: 1.0}  # still computed with the right weights
    assert m.cache.lookup((0, 3)) is None and m.cache.lookup((0, 1)) is not None
    assert m.prefetch(0, [3], [1.0]) == 0  # never staged
    assert m.stats()["host_only_experts"] == 1
    m.set_host_only({})
    assert m.host_only == frozenset()


# -- records copied in two parts (LoaderConfig.split_copies) ------------------------------------------


def test_a_record_splits_after_the_tensors_of_the_first_matmul():
    from mira_hf.layout import IdentityCodec, split_point
    from mira_hf.quant import LosslessCodec

    up, down = torch.randn(3, 16, 8, dtype=torch.bfloat16), torch.randn(3, 8, 8, dtype=torch.bfloat16)
    raw = IdentityCodec().plan({"gate_up_proj": ((16, 8), torch.bfloat16), "down_proj": ((8, 8), torch.bfloat16)})
    assert split_point(raw) == raw.tensor_ranges()["gate_up_proj"][1] == raw.tensor_ranges()["down_proj"][0]
    packed = LosslessCodec().plan_experts({"gate_up_proj": up, "down_proj": down})
    assert split_point(packed) == packed.tensor_ranges()["gate_up_proj"][1] <= packed.tensor_ranges()["down_proj"][0]
    with_bias = IdentityCodec().plan(
        {"up_proj": ((16, 8), torch.float32), "up_proj_bias": ((16,), torch.float32), "down_proj": ((8, 16), torch.float32)}
    )
    assert split_point(with_bias) == with_bias.tensor_ranges()["up_proj_bias"][1]
    down_first = IdentityCodec().plan({"down_proj": ((8, 8), torch.bfloat16), "gate_up_proj": ((16, 8), torch.bfloat16)})
    assert split_point(down_first) is None  # the first matmul's tensors do not come first: one copy
    assert split_point(IdentityCodec().plan({"w1": ((8, 8), torch.float32), "w2": ((8, 8), torch.float32)})) is None


class _Event:
    """A stand-in for a CUDA event, named after what it marks."""

    def __init__(self, name):
        self.name = name

    def query(self):
        return False


def _recording_manager(**kw):
    """A CPU manager whose loader hands out named events and records what the compute stream waits on."""
    m = make_manager(**kw)
    waits, real, copies = [], m.loader.copy_split, iter(range(10**6))

    def copy_split(dst, src, pinned, split, after=None, then=None):
        real(dst, src, pinned, split, after, then)
        n = next(copies)
        return (_Event(f"first{n}") if split else None), _Event(f"done{n}")

    m.loader.copy_split = copy_split
    m.loader.wait = lambda event, layer: waits.append(getattr(event, "name", None))
    return m, waits


def test_a_split_copy_lets_the_first_matmul_start_before_the_rest_has_landed():
    m, waits = _recording_manager()
    m.enter_forward()
    plan = m.begin(0, [1])
    w = m.acquire(plan, 1, first_part=True)
    assert waits == ["first0"]  # the compute stream waits for the gate_up tensor only
    m.acquire_rest(plan, 1)
    m.acquire_rest(plan, 1)  # once is enough
    assert waits == ["first0", "done0"]
    assert w["gate_up_proj"][0, 0].item() == 1.0 and w["down_proj"][0, 0].item() == 1.0
    m.release(plan, 1)
    m.end(plan)
    plan = m.begin(0, [1])  # resident: a reader that asks for the whole record waits for all of it
    m.acquire(plan, 1)
    assert waits[-1] == "done0"
    m.release(plan, 1)
    m.end(plan)
    m.exit_forward()


def test_without_split_copies_a_record_is_one_copy():
    store = make_manager().store
    infos = [LayerInfo(i, f"layers.{i}.mlp.experts", 4, 2) for i in range(2)]
    budget = plan_budget(infos, {i: store.record_bytes(0) for i in range(2)}, 3 * store.record_bytes(0))
    m = ExpertManager(store, infos, budget, torch.device("cpu"), split_copies=False)
    splits = []
    real = m.loader.copy_split
    m.loader.copy_split = lambda dst, src, pinned, split, *a: splits.append(split) or real(dst, src, pinned, split, *a)
    m.enter_forward()
    assert run_block(m, 0, [2]) == {2: 2.0}
    m.exit_forward()
    assert splits == [0]


@pytest.mark.parametrize("before", [True, False])  # the speculative copy ends before / after the split point
def test_the_rest_of_a_speculative_copy_is_split_where_the_first_part_is_missing(before):
    probe = make_manager()
    record, split = probe.store.record_bytes(0), probe.arena.split[0]
    assert 0 < split < record
    m, waits = _recording_manager(
        layers=3,
        experts=4,
        slots=6,
        policy="heat",
        predictor_config=PredictorConfig(speculate_bytes=split // 2 if before else (split + record) // 2),
    )
    m.enter_forward()
    run_block(m, 0, [0, 1])  # copies 0 and 1
    m.staging.stage(0, {1: torch.tensor([0.7, 0.0, 0.0, 0.0])})  # copy 2, cut short
    slot = m.cache.lookup((1, 0))
    assert 0 < slot.partial < record and (slot.partial < split) == before
    waits.clear()
    plan = m.begin(1, [0])
    m.acquire(plan, 0, first_part=True)
    m.acquire_rest(plan, 0)
    m.release(plan, 0)
    m.end(plan)
    # before the split point: the rest comes in two parts; after it: the speculative copy brought the first part
    assert waits == (["first3", "done3"] if before else ["done2", "done3"])
    assert _holds(m, slot, (1, 0))
    m.exit_forward()


def test_records_below_split_min_bytes_are_copied_in_one_piece(tiny_checkpoint):
    """`LoaderConfig.split_min_bytes`: a record smaller than it is one copy (a second copy call would
    cost the host more than its last part takes to cross); at 0 every record that can split does."""
    from mira_hf import MiraConfig, MiraMoEModel
    from mira_hf.config import LoaderConfig

    path = tiny_checkpoint("mixtral")
    record = None
    for split_min, splits in ((None, False), (0, True)):
        loader = LoaderConfig() if split_min is None else LoaderConfig(split_min_bytes=split_min)
        model = MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", quantization=None, loader=loader), progress=False)
        record = model.mira.store.record_bytes(0)
        assert record < LoaderConfig().split_min_bytes
        assert all((s is not None) == splits for s in model.mira.arena.split.values())


def test_keep_values_in_numpy_equal_the_loop_bit_for_bit():
    """From 32 keys on, `keep_values` ranks in NumPy; the values must be exactly the loop's (the same
    victims, so the same counts), with and without guesses, wherever the step stands."""
    import numpy as np

    m = make_manager(layers=3, experts=32, slots=48, stage_fraction=0.0, policy="heat")
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        m.enter_forward()
        for layer in range(3):
            run_block(m, layer, sorted(set(torch.randint(0, 32, (4,), generator=g).tolist())))
        m.exit_forward()
    keys = [(layer, e) for layer in range(3) for e in range(32)]
    for last, guesses in ((-1, {}), (0, {1: torch.rand(32, generator=g).tolist()}), (2, {0: [0.5] * 32, 2: [1.0] * 32})):
        m._last_layer, m.staging.layer_probs = last, guesses
        batched = m.valuation.keep_values(keys)
        looped = [v for i in range(0, len(keys), 16) for v in m.valuation.keep_values(keys[i : i + 16])]
        assert isinstance(batched, np.ndarray) and batched.tolist() == looped


# -- policies on their own ---------------------------------------------------------------------------


def test_priority_scores_and_victims_by_hand():
    """score = 0.6 · predicted + 0.3 · 1 / (1 + steps since last use) + 0.1 · cost; the lowest goes."""
    from mira_hf.policies import PriorityConfig, PriorityPolicy

    clock, predicted, cost = [0], {"a": 0.5}, {"a": 0.1, "b": 0.2, "c": 0.3, "d": 0.2, "e": 0.2, "z": 0.2}
    policy = PriorityPolicy(lambda k: predicted.get(k, 0.0), lambda: clock[0], cost.__getitem__)
    for key in "abc":  # a at step 0, b at 1, c at 2
        policy.inserted(key, staged=False)
        clock[0] += 1
    clock[0] = 4
    assert [policy.score(k) for k in "abc"] == pytest.approx(
        [0.6 * 0.5 + 0.3 / 5 + 0.1 * 0.1, 0.3 / 4 + 0.1 * 0.2, 0.3 / 3 + 0.1 * 0.3]  # 0.37, 0.095, 0.13
    )
    assert policy.victim("abc") == "b" and policy.victim("ac") == "c" and policy.victim([]) is None
    policy.used("b")  # used now: recency 1
    assert policy.score("b") == pytest.approx(0.3 + 0.02) and policy.victim("abc") == "c"
    policy.removed("c")
    assert policy.score("c") == pytest.approx(0.3 + 0.03)  # forgotten: scored as if just used
    policy.inserted("d", staged=True)
    policy.inserted("e", staged=True)
    assert policy.score("d") == policy.score("e") and policy.victim("ed") == "d"  # a tie: the least recently used
    policy.used("d")
    assert policy.victim("de") == "e"
    only_predicted = PriorityPolicy(
        lambda k: predicted.get(k, 0.0), lambda: clock[0], cost.__getitem__, PriorityConfig(1.0, 0.0, 0.0)
    )
    for key in "ab":
        only_predicted.inserted(key, staged=False)
    assert [only_predicted.score(k) for k in "ab"] == [0.5, 0.0] and only_predicted.victim("ab") == "b"
    policy.removed("a")
    policy.removed("z")  # never inserted: a no-op
    assert "a" not in policy._order and policy.score("z") == policy.score("e")
    assert (
        policy.score("b") == policy.score("z") and policy.victim(["b", "z"]) == "z"
    )  # a tie with a key it holds no record of: that key goes first


@pytest.mark.parametrize("field", ["predicted_weight", "recency_weight", "cost_weight"])
def test_priority_weights_must_not_be_negative(field):
    from mira_hf import ConfigError
    from mira_hf.policies import PriorityConfig

    for bad in (-0.01, float("nan"), float("inf"), "0.5"):
        with pytest.raises(ConfigError, match=rf"^PriorityConfig\.{field}=.*: must be a finite number ≥ 0\.$"):
            PriorityConfig(**{field: bad})
    assert getattr(PriorityConfig(**{field: 0.0}), field) == 0.0  # zero switches a term off


def test_heat_policy_breaks_ties_by_recency_and_demotes_the_least_recently_used():
    from mira_hf.heat import HeatTracker
    from mira_hf.policies import HeatPolicy

    values = {(0, 0): 0.5, (0, 1): 0.2, (0, 2): 0.2, (0, 3): 0.9}
    policy = HeatPolicy(HeatTracker({0: 4}), lambda keys: [values[k] for k in keys])
    for e in (2, 1, 0, 3):
        policy.inserted((0, e), staged=False)
    keys = [(0, e) for e in range(4)]
    assert policy.victim(keys) == (0, 2)  # 1 and 2 tie at 0.2: (0, 2) was used longer ago
    policy.used((0, 2))
    assert policy.victim(keys) == (0, 1) and policy.victim([(0, 0), (0, 3)]) == (0, 0) and policy.victim([]) is None
    assert policy.victim([(0, 3), (0, 3)]) == (0, 3)  # repeated candidates count once
    untracked = HeatPolicy(HeatTracker({0: 8}), lambda keys: [0.0] * len(keys))
    assert untracked.victim([(0, 6), (0, 5), (0, 7)]) == (0, 6)  # a tie among keys it never saw: the first given
    untracked.removed((0, 6))  # forgetting a key it does not hold is a no-op
    heat = HeatTracker({0: 2})
    by_score = HeatPolicy(heat, lambda keys: [heat.score(*k) for k in keys])  # ranked by the heat score
    heat.activate(0, [1])
    by_score.inserted((0, 1), staged=False)
    by_score.inserted((0, 0), staged=False)
    assert by_score.victim([(0, 1), (0, 0)]) == (0, 0) and not by_score.admit_hot((0, 1))  # 0.1 < 0.3
    heat.activate(0, [1, 1])
    assert by_score.admit_hot((0, 1))  # 0.3: the threshold admits


def test_a_full_hot_tier_demotes_its_least_recently_used_expert_under_heat_as_under_lru():
    from mira_hf.heat import HeatTracker
    from mira_hf.policies import HeatPolicy

    heat = HeatTracker({0: 4})
    for _ in range(3):
        heat.activate(0, [0, 1, 2, 3])  # every expert at the HOT threshold: admission is not what decides
    for policy in (LRUPolicy(), HeatPolicy(heat, lambda keys: [0.0] * len(keys))):
        cache = ExpertCache({0: SlotPool(1, 4, 2, policy)}, {0: 0})  # 2 HOT + 2 STAGE
        slots = {e: cache.allocate((0, e), staged=False)[0] for e in (3, 2, 1, 0)}  # loaded in reverse order
        for e in (0, 1, 0):
            cache.use(slots[e])  # 1 is now the least recently used HOT expert, though loaded after 0
        cache.use(slots[2])  # HOT is full: 1 drops to STAGE
        assert [slots[e].tier for e in range(4)] == ["hot", "stage", "hot", "stage"], policy.name
        cache.use(slots[1])  # and 0, now the least recently used, drops for it
        assert [slots[e].tier for e in range(4)] == ["stage", "hot", "hot", "stage"], policy.name
        assert list(cache.pools[0].hot) == [(0, 2), (0, 1)] and cache.pools[0].hot_count == 2


def test_hot_count_tiers_and_slot_state_stay_consistent_through_uses_evictions_and_removals():
    from mira_hf.heat import HeatTracker
    from mira_hf.policies import HeatPolicy

    policy = LRUPolicy()
    cache = ExpertCache({0: SlotPool(1, 3, 1, policy)}, {0: 0, 1: 0})  # 2 HOT + 1 STAGE, layers 0 and 1 share it
    pool = cache.pools[0]

    def check():
        assert pool.hot_count == sum(s.tier == "hot" for s in pool.slots if s.key is not None) <= pool.n_hot
        assert sorted(policy._order) == cache.resident()  # the policy tracks exactly the resident experts

    a, b, c, d, e = (0, 0), (0, 1), (1, 0), (1, 1), (0, 2)
    slot, _ = cache.allocate(a, staged=False)
    assert (slot.pins, slot.partial, slot.prefetched, slot.awaiting, slot.used_since_load) == (0, 0, False, False, False)
    cache.use(slot)
    cache.use(slot)  # a second use of a HOT expert changes nothing
    check()
    for k in (b, c):
        _touch(cache, k)
        check()
    assert [cache.lookup(k).tier for k in (a, b, c)] == ["stage", "hot", "hot"]  # a, least recently used, demoted
    assert cache.resident(0) == [a, b] and cache.resident(1) == [c]
    cache.remove(b)  # HOT
    check()
    freed = pool.slots[pool._free[-1]]
    assert (freed.key, freed.pins, freed.ready, freed.first_ready, freed.awaiting, freed.partial) == (
        None,
        0,
        None,
        None,
        False,
        0,
    )
    cache.remove(b)  # not resident: nothing to do
    cache.remove(a)  # STAGE
    check()
    # d, e join HOT (c drops to STAGE); a evicts STAGE's c and joins HOT (d drops); b evicts d
    assert [_touch(cache, k) for k in (d, e, a, b)] == [None, None, c, d]
    check()
    guess, _ = cache.allocate((1, 3), staged=True)
    assert (guess.prefetched, guess.awaiting) == (True, True)

    all_hot = _lru_cache(3)
    assert [_touch(all_hot, (0, e)) for e in range(4)] == [None, None, None, (0, 0)]  # a HOT expert evicted
    assert all_hot.pools[0].hot_count == 3
    all_hot.remove((0, 1))
    assert all_hot.pools[0].hot_count == 2

    heat = HeatTracker({0: 2})
    cold = ExpertCache({0: SlotPool(1, 2, 0, HeatPolicy(heat, lambda keys: [0.0] * len(keys)))}, {0: 0})
    slot, _ = cold.allocate((0, 0), staged=False)
    cold.use(slot)
    assert slot.tier == "stage" and cold.pools[0].hot_count == 0  # below the heat threshold: not admitted to HOT


def test_hot_overflow_demotes_a_hot_expert_even_when_a_stage_one_is_older():
    """2 HOT + 2 STAGE: a, b join HOT; c overflows HOT and demotes a; d overflows it again and demotes b, the
    least recently used HOT expert, although STAGE's a is older still (demoting a STAGE expert changes nothing)."""
    cache = ExpertCache({0: SlotPool(1, 4, 2, LRUPolicy())}, {0: 0})
    keys = [(0, e) for e in range(4)]
    assert [_touch(cache, k) for k in keys] == [None] * 4
    assert [cache.lookup(k).tier for k in keys] == ["stage", "stage", "hot", "hot"]
    assert cache.pools[0].hot_count == 2


class _RecordingPolicy(LRUPolicy):
    """LRU that records what the cache tells it, as a registered policy would see it."""

    def __init__(self, probe):
        super().__init__()
        self.probe, self.calls = probe, []

    def inserted(self, key, staged):
        self.calls.append(("inserted", key, staged))
        super().inserted(key, staged)

    def demote(self, candidates):
        self.calls.append(("demote", list(candidates), len(candidates), [k in candidates for k in self.probe]))
        return super().demote(candidates)


def test_a_policy_is_told_what_was_staged_and_demotes_among_the_other_hot_experts():
    """The policy protocol: `inserted(key, staged)` says whether the copy is a prefetch; `demote` gets a set of
    the HOT experts but the one just admitted, least recently used first, that answers `in` and `len`."""
    a, b, c, other = (0, 0), (0, 1), (0, 2), (0, 3)
    policy = _RecordingPolicy(probe=[a, b, c, other])
    cache = ExpertCache({0: SlotPool(1, 3, 1, policy)}, {0: 0})  # 2 HOT + 1 STAGE
    slot_a, _ = cache.allocate(a, staged=False)
    slot_b, _ = cache.allocate(b, staged=True)  # a prefetch
    cache.use(slot_a)
    cache.use(slot_b)
    slot_c, _ = cache.allocate(c, staged=False)
    cache.use(slot_c)  # HOT holds a, b, c: one over its 2
    assert policy.calls == [
        ("inserted", a, False),
        ("inserted", b, True),
        ("inserted", c, False),
        ("demote", [a, b], 2, [True, True, False, False]),  # c, just admitted, is no candidate
    ]
    assert [slot_a.tier, slot_b.tier, slot_c.tier] == ["stage", "hot", "hot"]


def test_priority_demotes_the_lowest_scored_other_hot_expert_never_the_one_just_admitted():
    """2 HOT + 1 STAGE, score = 0.6 · predicted + 0.3 / (1 + steps since use) + 0.1 · cost (0 here). At step 2,
    c (predicted 0) joins HOT: 0.3, the lowest score, but it was just admitted; of the others a scores
    0.6 + 0.3 / 3 = 0.7 and b 0.3 + 0.3 / 2 = 0.45, so b drops to STAGE although a was used longer ago."""
    from mira_hf.policies import PriorityPolicy

    a, b, c = (0, 0), (0, 1), (0, 2)
    clock, predicted = [0], {a: 1.0, b: 0.5, c: 0.0}
    cache = ExpertCache({0: SlotPool(1, 3, 1, PriorityPolicy(predicted.__getitem__, lambda: clock[0], lambda k: 0.0))}, {0: 0})
    for key in (a, b, c):
        _touch(cache, key)
        clock[0] += 1
    assert [cache.lookup(k).tier for k in (a, b, c)] == ["hot", "stage", "hot"]
    assert list(cache.pools[0].hot) == [a, c]


def test_with_nothing_to_choose_from_every_policy_answers_none():
    from mira_hf.heat import HeatTracker
    from mira_hf.policies import HeatPolicy, PriorityPolicy

    priority = PriorityPolicy(lambda k: 0.0, lambda: 0, lambda k: 0.0)
    heat = HeatPolicy(HeatTracker({0: 2}), lambda keys: [0.0] * len(keys))
    for policy in (LRUPolicy(), priority, heat):
        policy.inserted((0, 0), staged=False)
        assert policy.demote(set()) is None and policy.victim([]) is None, policy.name


def test_the_heat_policy_takes_its_candidates_as_any_iterable():
    """The protocol's `victim(candidates: Iterable)`: a set, or a generator, ranks as the same list does."""
    from mira_hf.heat import HeatTracker
    from mira_hf.policies import HeatPolicy

    values = {(0, 0): 0.5, (0, 1): 0.2, (0, 2): 0.9}
    policy = HeatPolicy(HeatTracker({0: 3}), lambda keys: [values[k] for k in keys])
    for e in range(3):
        policy.inserted((0, e), staged=False)
    assert policy.victim(set(values)) == (0, 1)
    assert policy.victim(k for k in values) == (0, 1)
    assert policy.victim(k for k in ()) is None
