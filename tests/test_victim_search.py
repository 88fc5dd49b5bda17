"""The victim search on a pool's slot arrays chooses exactly what the plain search over key lists chooses: on a
random trace (blocks, prefetches with guesses, streaming through few slots) every allocation evicts the same
expert under every built-in policy."""

import numpy as np
import pytest
import torch
from test_cache import make_manager, run_block

from mira_hf.cache import HOT, Eviction, ExpertCache


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
