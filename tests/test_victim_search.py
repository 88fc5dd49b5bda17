"""The victim search on a pool's slot arrays chooses exactly what the plain search over key lists chooses: on a
random trace (blocks, prefetches with guesses, streaming through few slots) every allocation evicts the same
expert under every built-in policy and under policies the cache asks by key lists. Hand-made cases: a group the
policy declines, pinned slots never taken, free slots in the arrays."""

import numpy as np
import pytest
import torch
from test_cache import make_manager, run_block

from mira_hf.cache import HOT, STAGE, Eviction, ExpertCache, Slot, SlotPool, SlotTable, _Mirrored
from mira_hf.policies import HeatPolicy, LRUPolicy
from mira_hf.registry import POLICIES, register_policy


class ReferenceCache(ExpertCache):
    """The straightforward search: one pass over the slots listing the candidates' keys per group, the policy's
    `victim` on those lists, a prefetch's admission asked key by key."""

    def allocate(self, key, staged, evict=True, prefetch_may_evict=None):
        pool = self.pool(key[0])
        if pool._free or not evict:
            return super().allocate(key, staged, evict=evict, prefetch_may_evict=prefetch_may_evict)
        awaiting, idle_stage, hot = [], [], []
        for s in pool.slots:
            if s.pins:
                continue
            if s.awaiting:
                awaiting.append(s.key)
            if s.tier == HOT:
                hot.append(s.key)
            elif not s.awaiting:
                idle_stage.append(s.key)
        groups = [idle_stage + hot] if pool.policy.one_ranking else [idle_stage, hot]
        if staged:
            admit = prefetch_may_evict or (lambda layers, experts: np.ones(1, bool))
            groups = [[k for k in groups[0] if admit(np.array([k[0]]), np.array([k[1]]))[0]]]
        else:
            groups = [*groups, awaiting]
        victim = None
        for group in groups:
            victim = pool.policy.victim(group)
            if victim is not None:
                break
        if victim is None:
            return None, None
        # evict `victim` through the cache's own bookkeeping: take it out, then allocate the freed slot
        slot = pool.where[victim]
        evicted_wasted = slot.prefetched and not slot.used_since_load
        self.remove(victim)
        slot, _ = super().allocate(key, staged, evict=False)
        return slot, Eviction(victim, evicted_wasted)


def _logged(cache):
    log = []
    allocate = cache.allocate

    def logging_allocate(key, staged, evict=True, prefetch_may_evict=None):
        slot, evicted = allocate(key, staged, evict=evict, prefetch_may_evict=prefetch_may_evict)
        log.append((key, staged, None if slot is None else slot.index, evicted))
        return slot, evicted

    cache.allocate = logging_allocate
    return log


def _drive(m, seed, steps=40, layers=4, experts=32, k=4):
    """A random trace: skewed routing (a few experts of each layer are popular), guesses for the next layer
    (they rank evictions) and prefetches of the likeliest ones."""
    g = torch.Generator().manual_seed(seed)
    popularity = torch.rand(layers, experts, generator=g) ** 4  # [L, E]
    for _ in range(steps):
        m.enter_forward()
        for layer in range(layers):
            picks = torch.multinomial(popularity[layer], k, generator=g).tolist()
            run_block(m, layer, sorted(picks))
            if layer + 1 < layers and torch.rand(1, generator=g).item() < 0.7:
                probs = torch.rand(experts, generator=g) ** 3  # [E]
                m.staging.layer_probs[layer + 1] = probs.tolist()
                top = probs.topk(3).indices.tolist()
                m.prefetch(layer + 1, top, [probs[e].item() for e in top])
        m.exit_forward()


@pytest.mark.parametrize("policy", ["heat", "lru", "priority"])
@pytest.mark.parametrize("slots", [10, 60])
def test_a_random_trace_evicts_what_the_plain_search_evicts(policy, slots):
    fast = make_manager(layers=4, experts=32, slots=slots, policy=policy)
    plain = make_manager(layers=4, experts=32, slots=slots, policy=policy)
    plain.cache.__class__ = ReferenceCache
    fast_log, plain_log = _logged(fast.cache), _logged(plain.cache)
    _drive(fast, seed=slots)
    _drive(plain, seed=slots)
    evictions = [e for *_, e in fast_log if e is not None]
    assert len(evictions) > 100 and any(staged and e is not None for _, staged, _, e in fast_log)  # guesses evict too
    assert fast_log == plain_log
    assert fast.cache.resident() == plain.cache.resident()
    assert [p.ranks_slots for p in fast.cache.pools.values()] == [policy != "priority"]  # priority: ranked by keys


def test_the_slot_arrays_mirror_the_slots():
    m = make_manager(layers=4, experts=32, slots=20, policy="heat")
    _drive(m, seed=3, steps=10)
    for pool in m.cache.pools.values():
        t = pool.table
        keys = [s.key or (-1, -1) for s in pool.slots]
        assert t.layer.tolist() == [k[0] for k in keys] and t.expert.tolist() == [k[1] for k in keys]
        assert t.pins.tolist() == [s.pins for s in pool.slots]
        assert t.awaiting.tolist() == [s.awaiting for s in pool.slots]
        assert t.hot.tolist() == [s.tier == HOT for s in pool.slots]
        by_recency = [k for k in pool.policy._order]  # the policy's own LRU order, oldest first
        assert sorted(pool.where, key=lambda k: t.stamp[pool.where[k].index]) == by_recency


def test_expected_distances_equal_the_one_key_values_bit_for_bit():
    m = make_manager(layers=3, experts=32, slots=48, stage_fraction=0.0, policy="heat")
    _drive(m, seed=5, steps=6, layers=3)
    g = torch.Generator().manual_seed(1)
    layers, experts = np.repeat(np.arange(3), 32), np.tile(np.arange(32), 3)
    for last, guesses in ((-1, {}), (0, {1: torch.rand(32, generator=g).tolist()}), (2, {0: [0.5] * 32, 2: [1.0] * 32})):
        m._last_layer, m.staging.layer_probs = last, guesses
        one_by_one = [m.valuation.expected_distance((int(a), int(b))) for a, b in zip(layers, experts)]
        assert m.valuation.expected_distances(layers, experts).tolist() == one_by_one


class LowestKey:
    """An eviction policy written to the protocol alone (no `victim_slots`, not derived from a built-in): the
    smallest key goes first; every use joins HOT."""

    name = "lowest-key"
    one_ranking = False

    def inserted(self, key, staged):
        pass

    def used(self, key):
        pass

    def removed(self, key):
        pass

    def admit_hot(self, key):
        return True

    def victim(self, candidates):
        return min(candidates, default=None)

    def demote(self, candidates):
        return min(candidates, default=None)


@pytest.fixture
def policies_by_keys():
    """Two policies the cache asks by key lists: heat given `keep_values` alone, and `LowestKey`."""
    register_policy("heat-by-keys", lambda context, settings: HeatPolicy(context.heat, context.valuation.keep_values))
    register_policy("lowest-key", lambda context, settings: LowestKey())
    yield
    POLICIES.unregister("heat-by-keys")
    POLICIES.unregister("lowest-key")


@pytest.mark.parametrize("policy", ["heat-by-keys", "lowest-key"])
def test_a_policy_without_slot_ranking_is_asked_by_keys_and_evicts_what_the_plain_search_evicts(policies_by_keys, policy):
    fast = make_manager(layers=4, experts=32, slots=10, policy=policy)
    plain = make_manager(layers=4, experts=32, slots=10, policy=policy)
    plain.cache.__class__ = ReferenceCache
    fast_log, plain_log = _logged(fast.cache), _logged(plain.cache)
    _drive(fast, seed=10)
    _drive(plain, seed=10)
    assert [p.ranks_slots for p in fast.cache.pools.values()] == [False]
    assert len([e for *_, e in fast_log if e is not None]) > 100
    assert fast_log == plain_log
    if policy == "heat-by-keys":  # the heat ranking by keys and by slots: the same victims
        by_slots = make_manager(layers=4, experts=32, slots=10, policy="heat")
        slots_log = _logged(by_slots.cache)
        _drive(by_slots, seed=10)
        assert slots_log == fast_log


class SparesLayerZero(LRUPolicy):
    """LRU that never evicts an expert of layer 0: it declines a victim group holding only those."""

    def victim(self, candidates):
        return super().victim([k for k in candidates if k[0] != 0])

    def victim_slots(self, table, slots):
        slots = slots[table.layer[slots] != 0]
        return super().victim_slots(table, slots) if len(slots) else None


@pytest.mark.parametrize("cache_class", [ExpertCache, ReferenceCache])
def test_a_group_the_policy_declines_passes_the_search_to_the_next(cache_class):
    cache = cache_class({0: SlotPool(1, 3, 1, SparesLayerZero())}, {0: 0, 1: 0})  # 2 HOT + 1 STAGE
    assert cache.pools[0].ranks_slots  # the reference asks `victim` by keys all the same
    for key in ((0, 0), (0, 1), (1, 0)):
        cache.allocate(key, staged=False)
    cache.use(cache.lookup((1, 0)))  # (1, 0) joins HOT; idle STAGE holds layer 0 only
    slot, evicted = cache.allocate((1, 1), staged=False)
    assert evicted == Eviction((1, 0), False) and slot.key == (1, 1)
    # every unpinned candidate is of layer 0 now: declined in every group, the load gets no slot
    cache.lookup((1, 1)).pins += 1
    assert cache.allocate((1, 2), staged=False) == (None, None)
    assert cache.resident() == [(0, 0), (0, 1), (1, 1)]


@pytest.mark.parametrize("cache_class", [ExpertCache, ReferenceCache])
@pytest.mark.parametrize("policy", [LRUPolicy, LowestKey])
def test_a_demand_load_takes_a_prefetch_awaiting_use_and_never_a_pinned_slot(cache_class, policy):
    cache = cache_class({0: SlotPool(1, 4, 1, policy())}, {0: 0, 1: 0})
    a, _ = cache.allocate((0, 0), staged=False)
    b, _ = cache.allocate((0, 1), staged=True)
    a.pins += 1  # in use by the block being computed: the oldest and the lowest keys, one still awaiting use
    b.pins += 1
    cache.allocate((1, 1), staged=True)
    cache.allocate((1, 2), staged=True)  # both await their use: a prefetch may not take either
    assert cache.allocate((1, 3), staged=True) == (None, None)
    slot, evicted = cache.allocate((1, 3), staged=False)
    assert evicted == Eviction((1, 1), True) and slot.key == (1, 3)
    assert (cache.lookup((0, 0)), cache.lookup((0, 1))) == (a, b) and a.pins == b.pins == 1


def test_free_slots_read_as_free_in_the_slots_and_the_arrays():
    cache = ExpertCache({0: SlotPool(1, 5, 2, LRUPolicy())}, {0: 0, 1: 0})  # 3 HOT + 2 STAGE
    pool, t = cache.pools[0], cache.pools[0].table
    a, _ = cache.allocate((1, 3), staged=False)  # slot 0
    b, _ = cache.allocate((0, 2), staged=True)  # slot 1
    c, _ = cache.allocate((1, 7), staged=True)  # slot 2
    a.pins += 2
    cache.use(c)
    cache.remove((0, 2))  # slot 1 is free again; slots 3 and 4 were never taken
    assert [s.index for s in (a, b, c)] == [0, 1, 2]
    assert t.layer.tolist() == [1, -1, 1, -1, -1] and t.expert.tolist() == [3, -1, 7, -1, -1]
    assert t.pins.tolist() == [2, 0, 0, 0, 0]
    assert t.awaiting.tolist() == [False] * 5 and t.hot.tolist() == [False, False, True, False, False]
    assert [s.key for s in pool.slots] == [(1, 3), None, (1, 7), None, None]
    assert [s.tier for s in pool.slots] == [STAGE, STAGE, HOT, STAGE, STAGE]
    assert [s.pins for s in pool.slots] == [2, 0, 0, 0, 0]
    assert [s.awaiting for s in pool.slots] == [False] * 5
    d, _ = cache.allocate((0, 9), staged=True)  # the slot freed last is taken first
    assert d is b and t.layer[1] == 0 and t.expert[1] == 9 and t.awaiting.tolist() == [False, True, False, False, False]


def test_a_mirrored_attribute_is_kept_in_its_owner_and_the_table_column_of_its_name():
    class Row:  # an owner of its own: `_Mirrored` binds its names when a class is made
        __slots__ = ("index", "_table", "_pins")
        pins = _Mirrored()

    table = SlotTable(3)
    row = Row()
    row.index, row._table = 1, table
    row.pins = 4
    assert row.pins == 4 and row._pins == 4 and table.pins.tolist() == [0, 4, 0]
    assert Slot.pins is vars(Slot)["pins"] and Slot.awaiting is vars(Slot)["awaiting"]  # on the class: the descriptor


def _cache_state(m):
    """Everything a use writes: per pool the slot arrays, the HOT order, the policy's own order and last uses,
    and each slot's flags."""
    state = []
    for pool in m.cache.pools.values():
        t = pool.table
        arrays = [a.tolist() for a in (t.layer, t.expert, t.pins, t.awaiting, t.hot, t.stamp)] + [t.clock]
        slots = [(s.key, s.tier, s.pins, s.awaiting, s.used_since_load, s.prefetched) for s in pool.slots]
        policy = [list(getattr(pool.policy, "_order", ())), dict(getattr(pool.policy, "_last_use", {}))]
        state.append((arrays, list(pool.hot), slots, policy))
    return state


@pytest.mark.parametrize("policy", ["heat", "lru", "priority"])
def test_using_a_group_of_slots_at_once_leaves_the_state_of_using_them_one_by_one(policy):
    """`ExpertCache.use_many` (a block's resident experts, computed in one grouped matmul) against `use` per slot:
    the same HOT admissions and demotions, recency stamps, flags and policy order, on random uses of one layer."""
    one, many = (make_manager(layers=4, experts=32, slots=60, policy=policy) for _ in range(2))
    _drive(one, seed=11, steps=8)
    _drive(many, seed=11, steps=8)
    assert _cache_state(one) == _cache_state(many)
    g = torch.Generator().manual_seed(2)
    for _ in range(30):
        layer = int(torch.randint(4, (1,), generator=g))
        resident = [k[1] for k in one.cache.resident(layer)]
        picks = [resident[i] for i in torch.randperm(len(resident), generator=g)[: max(2, len(resident) // 2)].tolist()]
        for e in picks:
            one.cache.use(one.cache.lookup((layer, e)))
        many.cache.use_many([many.cache.lookup((layer, e)) for e in picks])
        assert _cache_state(one) == _cache_state(many)
    assert any(pool.hot for pool in one.cache.pools.values())


def run_block_grouped(m, layer, experts):
    """`run_block` as a device block runs it: the experts landed at `begin` acquired, computed and released as
    one group, the others one by one."""
    plan = m.begin(layer, experts)
    ready = plan.order[: plan.ready]
    m.acquire_group(plan, ready)
    m.release_group(plan, ready)
    for e in plan.order[plan.ready :]:
        m.acquire(plan, e)
        m.release(plan, e)
    m.end(plan)


def _run_blocks(block, policy, slots, watch=None, before_exit=None, after_exit=None):
    """25 forward steps of 4 MoE layers, each block 6 experts drawn from a skewed popularity and run by
    `block(m, layer, experts)`; `watch(m)` once the manager is made, `before_exit(m, block)` and
    `after_exit(m, block)` around each step's end. Returns the cache's allocation log, its state and the counters
    (hits, misses, loads, evictions)."""
    m = make_manager(layers=4, experts=32, slots=slots, policy=policy)
    log = _logged(m.cache)
    if watch is not None:
        watch(m)
    g = torch.Generator().manual_seed(4)
    popularity = torch.rand(4, 32, generator=g) ** 4
    for _ in range(25):
        m.enter_forward()
        for layer in range(4):
            block(m, layer, sorted(torch.multinomial(popularity[layer], 6, generator=g).tolist()))
        if before_exit is not None:
            before_exit(m, block)
        m.exit_forward()
        if after_exit is not None:
            after_exit(m, block)
    s = m.stats()
    return log, _cache_state(m), (s["hits"], s["misses"], s["loads"], s["evictions"])


@pytest.mark.parametrize("policy", ["heat", "lru", "priority"])
def test_a_block_of_grouped_resident_experts_books_what_one_by_one_books(policy):
    """With every miss issued at `begin` (room for all of a block's copies), acquiring and releasing the resident
    experts as a group changes nothing: the same allocations and evictions, counters and cache state."""
    runs = [_run_blocks(block, policy, slots=40) for block in (run_block, run_block_grouped)]
    assert runs[0][2][3] > 50  # it evicts
    assert runs[0] == runs[1]


def run_block_deferred(m, layer, experts):
    """`run_block_grouped` as a proxy runs it within a forward step: a block whose experts had all landed books
    them with its `end`, and every block's `end` waits for the manager's next verb."""
    plan = m.begin(layer, experts)
    ready = plan.order[: plan.ready]
    if len(ready) == len(plan.order):
        m.end(plan, ready, later=True)
        return
    m.acquire_group(plan, ready)
    m.release_group(plan, ready)
    for e in plan.order[plan.ready :]:
        m.acquire(plan, e)
        m.release(plan, e)
    m.end(plan, later=True)


def _count_deferred_ends(m, out: list) -> None:
    """Append to `out`, at each `_settle` that finds a block's end waiting, how many experts it books."""
    settle = m._settle

    def counted():
        if m._tail is not None:
            out.append(len(m._tail[1]))
        settle()

    m._settle = counted


@pytest.mark.parametrize("policy", ["heat", "lru", "priority"])
def test_a_blocks_end_deferred_to_the_next_verb_decides_what_an_immediate_end_decides(policy):
    """Ends run at the next block's `begin` or the step's end: the same allocations and evictions, counters and
    cache state as ends run at once, with some blocks wholly resident (booked at their end) and some not."""
    deferred = []

    def before_exit(m, block):
        assert (m._tail is not None) == (block is run_block_deferred)  # the last block's end waits for the step's

    def after_exit(m, block):
        assert m._tail is None and all(s.pins == 0 for p in m.cache.pools.values() for s in p.slots)

    runs = [
        _run_blocks(block, policy, 64, lambda m: _count_deferred_ends(m, deferred), before_exit, after_exit)
        for block in (run_block_grouped, run_block_deferred)
    ]
    assert runs[0][2][3] > 20  # it evicts
    assert runs[0] == runs[1]
    assert len(deferred) == 100  # every block's end ran at a later verb
    assert sum(n > 0 for n in deferred) >= 10  # wholly resident blocks booked their uses there


def test_outside_a_forward_step_a_blocks_end_runs_at_once():
    """A block called on its own (no forward step entered, e.g. a test calling a proxy) leaves nothing pending."""
    m = make_manager(layers=2, experts=8, slots=8, policy="heat")
    plan = m.begin(0, [1, 2])
    m.end(plan, later=True)
    assert m._tail is None and m.stats()["misses"] == 2
    assert all(s.pins == 0 for p in m.cache.pools.values() for s in p.slots)


def test_hot_demotion_taken_without_asking_is_the_policys_own_choice():
    """Where the policy's `demote` is LRU's (`lru_demote`), the cache takes HOT's least recently used itself; a
    subclass that overrides `demote` is asked. Both give the same HOT order and tiers on random uses."""
    from mira_hf.cache import demotes_lru

    class AskedLRU(LRUPolicy):
        def demote(self, candidates):
            return next(iter(candidates), None)

    assert demotes_lru(LRUPolicy()) and not demotes_lru(AskedLRU())
    states = []
    for policy in (LRUPolicy(), AskedLRU()):
        pool = SlotPool(1, 24, 8, policy)
        cache = ExpertCache({0: pool}, {0: 0, 1: 0})
        g = torch.Generator().manual_seed(7)
        for _ in range(400):
            key = (int(torch.randint(2, (1,), generator=g)), int(torch.randint(20, (1,), generator=g)))
            slot = cache.lookup(key)
            if slot is None:
                slot, _ = cache.allocate(key, staged=False)
            cache.use(slot)
        states.append((list(pool.hot), [(s.key, s.tier) for s in pool.slots], pool.table.hot.tolist()))
    assert len(states[0][0]) == 16  # HOT full: admissions demoted others
    assert states[0] == states[1]


def test_a_layers_wanted_experts_read_from_the_pool_are_each_experts_wants():
    """`wanted(layer)` (one array read, for a large batch's guess lists) says for every expert what `wants` says:
    after loads, evictions, speculative copies cut short and host-only marks."""
    m = make_manager(layers=4, experts=32, slots=40, policy="heat")
    _drive(m, seed=5, steps=6)
    m.set_host_only({1: [3, 4], 2: [0]})
    key = next((3, e) for e in range(32) if m.wants((3, e)))
    assert m.prefetch_part(key, 0.9, 1) is not None  # a speculative copy cut short: resident, so not wanted
    assert not m.wants(key)
    for layer in range(4):
        assert m.wanted(layer) == [m.wants((layer, e)) for e in range(32)]
    assert sum(m.wanted(0)) < 32 and not m.wanted(1)[3] and not m.wanted(2)[0]


@pytest.mark.parametrize("slots", [10, 60])
def test_a_blocks_misses_ranked_once_evict_what_ranking_at_every_search_evicts(monkeypatch, slots):
    """Within one block's burst of allocations the ranking's inputs do not change (`ExpertCache.ranking_once`):
    each slot is valued once, and the victims are those of valuing every slot again at every search."""
    import contextlib

    once = make_manager(layers=4, experts=32, slots=slots, policy="heat")
    every = make_manager(layers=4, experts=32, slots=slots, policy="heat")
    monkeypatch.setattr(every.cache, "ranking_once", contextlib.nullcontext)
    valued = {}
    for name, m in (("once", once), ("every", every)):
        valued[name] = []
        for policy in {id(p.policy): p.policy for p in m.cache.pools.values()}.values():
            f = policy.keep_values_at
            policy.keep_values_at = lambda layers, experts, n=valued[name], f=f: n.append(len(layers)) or f(layers, experts)
    once_log, every_log = _logged(once.cache), _logged(every.cache)
    _drive(once, seed=slots + 1)
    _drive(every, seed=slots + 1)
    assert sum(e is not None for *_, e in once_log) > 100
    assert once_log == every_log
    assert once.cache.resident() == every.cache.resident()
    assert sum(valued["once"]) < sum(valued["every"])  # slots valued fewer times: the bursts shared one ranking
    assert all(pool.table.ranked is None for pool in once.cache.pools.values())  # only inside a burst
