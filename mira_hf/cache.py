"""`ExpertCache`: which expert sits in which device slot, in which tier, and who goes next.

It knows nothing about models or devices: keys are `(layer, expert)`, slots are indices into a
pool's arena (allocated by the manager), and a policy picks victims. Two tiers share a pool:
- HOT: experts that were used and earned their place (at most `n_hot` slots);
- STAGE: experts in flight, prefetched and not yet used, or demoted from HOT; evicted first.
A prefetch may only take a free or STAGE slot: a guess never pushes out a HOT expert. A policy that
ranks every resident expert by its expected next use (`one_ranking = True`, the heat policy) uses
the tiers for nothing: its victim is the least valuable unpinned expert of either tier, and a
prefetch is limited by the caller's admission rule instead. These tiers are eviction groups; what a
user sees (`ExpertManager.tier_of`, `stats()`) labels an expert by whether it was used since its copy.
Pinned slots (in use by the block being computed) are never evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

HOT, STAGE = "hot", "stage"
Key = tuple[int, int]  # (MoE layer ordinal, expert index)


class CachePolicy(Protocol):
    """Ranks resident experts for eviction. One instance per slot pool."""

    name: str
    one_ranking: bool  # rank HOT and idle STAGE together (the tiers then only label experts)

    def inserted(self, key: Key, staged: bool) -> None: ...
    def used(self, key: Key) -> None: ...
    def removed(self, key: Key) -> None: ...
    def admit_hot(self, key: Key) -> bool: ...
    def victim(self, candidates: Iterable[Key]) -> Key | None: ...
    # Optional: `victim_slots(table: SlotTable, slots: [n] slot indices) -> slot index | None`, the same choice as
    # `victim` read from the pool's arrays (no keys listed): a pool of fine-grained experts holds ~1000 slots.
    def demote(self, candidates: AbstractSet[Key]) -> Key | None: ...  # HOT experts, least recently used first


@dataclass(frozen=True)
class Eviction:
    key: Key
    wasted_prefetch: bool  # it was prefetched and never used


class SlotTable:
    """A pool's slots as arrays, one entry per slot: what a victim search reads, kept up to date by the slots'
    setters, so a search over hundreds of slots is a few NumPy operations with no per-call conversion."""

    def __init__(self, n_slots: int) -> None:
        self.layer = np.full(n_slots, -1, np.intp)  # [S] the key's layer; -1: free
        self.expert = np.full(n_slots, -1, np.intp)  # [S] the key's expert
        self.pins = np.zeros(n_slots, np.intp)  # [S]
        self.awaiting = np.zeros(n_slots, bool)  # [S]
        self.hot = np.zeros(n_slots, bool)  # [S] tier == HOT
        self.stamp = np.zeros(n_slots, np.int64)  # [S] when the slot was last allocated or used: LRU order
        self.clock = 0
        # [S] inside `ExpertCache.ranking_once`: each slot's value for the policy's ranking, once computed (NaN: not
        # yet, or the slot's key changed since); None outside
        self.ranked: np.ndarray | None = None


class _Mirrored:
    """A `Slot` attribute kept in the slot (`_name`) and in its pool's `SlotTable` column `name`."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.private = name, "_" + name

    def __get__(self, slot, owner=None):
        return self if slot is None else getattr(slot, self.private)

    def __set__(self, slot, value) -> None:
        setattr(slot, self.private, value)
        getattr(slot._table, self.name)[slot.index] = value


class Slot:
    """One device slot. `key`, `tier`, `pins` and `awaiting` are mirrored in the pool's `SlotTable`."""

    __slots__ = ("index", "_table", "_key", "_tier", "_pins", "_awaiting", "used_since_load", "prefetched")
    __slots__ += ("ready", "first_ready", "partial", "free")

    def __init__(self, index: int, table: SlotTable) -> None:
        self.index = index
        self._table = table
        self._key: Key | None = None
        self._tier = STAGE
        self._pins = 0
        self._awaiting = False  # prefetched for a block that has not run yet: protected from other prefetches
        self.used_since_load = False
        self.prefetched = False
        self.ready: object = None  # device event: the copy into this slot is done (None on CPU / when done)
        self.first_ready: object = None  # device event: the tensors of the first matmul are in (a copy in two parts)
        self.partial = 0  # bytes of the record copied so far by a speculative copy cut short (0: whole record)
        self.free: object = None  # device event: the last compute that read this slot is done

    @property
    def key(self) -> Key | None:
        return self._key

    @key.setter
    def key(self, key: Key | None) -> None:
        self._key = key
        t = self._table
        t.layer[self.index], t.expert[self.index] = (-1, -1) if key is None else key
        if t.ranked is not None:
            t.ranked[self.index] = np.nan

    @property
    def tier(self) -> str:
        return self._tier

    @tier.setter
    def tier(self, tier: str) -> None:
        self._tier = tier
        self._table.hot[self.index] = tier == HOT

    pins = _Mirrored()  # int: computations reading the slot now
    awaiting = _Mirrored()  # bool: prefetched for a block that has not run yet

    def touch(self) -> None:
        """Allocated or used now (the recency the LRU order and ties of the victim search read)."""
        t = self._table
        t.clock += 1
        t.stamp[self.index] = t.clock

    def __repr__(self) -> str:
        return f"Slot(index={self.index}, key={self._key}, tier={self._tier!r}, pins={self._pins})"


@dataclass
class SlotPool:
    """Slots of one byte size (one per distinct expert-record geometry)."""

    slot_bytes: int
    n_slots: int
    n_stage: int
    policy: CachePolicy
    slots: list[Slot] = field(default_factory=list)
    where: dict[Key, Slot] = field(default_factory=dict)
    hot: OrderedDict[Key, None] = field(default_factory=OrderedDict)  # the HOT experts, least recently used first
    table: SlotTable = field(init=False, repr=False)  # the slots as arrays, for victim searches
    ranks_slots: bool = field(init=False, repr=False)  # the policy chooses victims from `table` (`ranks_slots`)
    demotes_lru: bool = field(init=False, repr=False)  # the policy demotes HOT's least recently used (`demotes_lru`)

    def __post_init__(self) -> None:
        self.table = SlotTable(self.n_slots)
        self.ranks_slots = ranks_slots(self.policy)
        self.demotes_lru = demotes_lru(self.policy)
        self.slots = [Slot(i, self.table) for i in range(self.n_slots)]
        self._free = list(range(self.n_slots - 1, -1, -1))

    @property
    def hot_count(self) -> int:
        return len(self.hot)

    @property
    def n_hot(self) -> int:
        return self.n_slots - self.n_stage

    @property
    def resident_bytes(self) -> int:
        return len(self.where) * self.slot_bytes


class ExpertCache:
    """Maps keys to slots across pools; the single source of truth of residency."""

    def __init__(self, pools: dict[Hashable, SlotPool], pool_of_layer: dict[int, Hashable]) -> None:
        self.pools = pools
        self.pool_of_layer = pool_of_layer

    def pool(self, layer: int) -> SlotPool:
        return self.pools[self.pool_of_layer[layer]]

    def lookup(self, key: Key) -> Slot | None:
        return self.pool(key[0]).where.get(key)

    def allocate(
        self, key: Key, staged: bool, evict: bool = True, prefetch_may_evict=None
    ) -> tuple[Slot | None, Eviction | None]:
        """Give `key` a slot: a free one, else the policy's victim. Returns (slot, what was evicted).

        See `_victim_groups` for who may be evicted. `evict=False` takes only a free slot;
        `prefetch_may_evict(layers, experts)` ([n] arrays -> [n] bool) further restricts a prefetch's
        victims (e.g. to cold experts). Returns (None, None) when nothing can be taken.
        """
        pool = self.pool(key[0])
        assert key not in pool.where, key
        evicted = None
        if pool._free:
            slot = pool.slots[pool._free.pop()]
        elif not evict:
            return None, None
        else:
            victim = None
            for group in self._victim_groups(pool, staged, prefetch_may_evict):
                victim = _choose(pool, group)
                if victim is not None:
                    break
            if victim is None:
                return None, None
            slot = pool.where.pop(victim)
            pool.policy.removed(victim)
            if slot.tier == HOT:
                del pool.hot[victim]
            evicted = Eviction(victim, slot.prefetched and not slot.used_since_load)
        slot.key, slot.tier, slot.pins, slot.partial = key, STAGE, 0, 0
        slot.used_since_load, slot.prefetched, slot.awaiting = False, staged, staged
        slot.touch()
        pool.where[key] = slot
        pool.policy.inserted(key, staged)
        return slot, evicted

    @staticmethod
    def _victim_groups(pool: SlotPool, staged: bool, prefetch_may_evict=None) -> Iterator[np.ndarray]:
        """Where victims are sought, in order, as arrays of slot indices (each made when the one before
        gave none). STAGE experts that are not awaiting use go first. A prefetch stops there: it never
        evicts HOT, nor another prefetch still awaiting its use. A demand load then takes from HOT, and
        only last from prefetches awaiting use. With a `one_ranking` policy, HOT and idle STAGE form one
        group (for a prefetch too); listed in slot order within each tier, unless the policy ranks slots."""
        t = pool.table  # every slot holds a key here: a victim is sought only when none is free
        unpinned = t.pins == 0  # [S]
        if pool.policy.one_ranking and pool.ranks_slots:  # order does not matter: one mask
            groups = [np.flatnonzero(unpinned & (t.hot | ~t.awaiting))]
        else:
            hot = np.flatnonzero(unpinned & t.hot)
            idle_stage = np.flatnonzero(unpinned & ~t.hot & ~t.awaiting)
            groups = [np.concatenate((idle_stage, hot))] if pool.policy.one_ranking else [idle_stage, hot]
        if staged:
            first = groups[0]
            if prefetch_may_evict is not None and len(first):
                first = first[prefetch_may_evict(t.layer[first], t.expert[first])]
            yield first
            return
        yield from groups
        yield np.flatnonzero(unpinned & t.awaiting)

    @contextmanager
    def ranking_once(self) -> Iterator[None]:
        """Victim searches inside rank each slot once (`SlotTable.ranked`): for a burst of allocations between which
        nothing the ranking reads changes (one block's misses: the use rates, the guesses and the layer clock move
        only between blocks) but the slots' keys, whose values are dropped as they change. The same victims as
        ranking again at every search; re-entering is a no-op."""
        tables = [pool.table for pool in self.pools.values() if pool.table.ranked is None]
        for t in tables:
            t.ranked = np.full(len(t.layer), np.nan)
        try:
            yield
        finally:
            for t in tables:
                t.ranked = None

    def use(self, slot: Slot) -> None:
        """Record a use: the expert joins HOT if the policy admits it, demoting HOT's victim to
        STAGE if HOT is full."""
        pool = self.pool(slot.key[0])
        pool.policy.used(slot.key)
        slot.touch()
        slot.used_since_load, slot.awaiting = True, False
        if slot.tier == HOT:
            pool.hot.move_to_end(slot.key)
            return
        if pool.policy.admit_hot(slot.key):
            self._join_hot(pool, slot)

    def use_many(self, slots: Sequence[Slot]) -> None:
        """`use` for each of `slots` (one layer's: one pool), in order; the recency stamps and awaiting flags are
        written to the pool's arrays at once. The same state as `use` slot by slot."""
        if not slots:
            return
        pool = self.pool(slots[0].key[0])
        t = pool.table
        at = np.fromiter((slot.index for slot in slots), np.int64, len(slots))
        t.stamp[at] = np.arange(t.clock + 1, t.clock + 1 + len(slots))  # as `touch` in turn: nothing reads them between
        t.clock += len(slots)
        t.awaiting[at] = False
        used, admit_hot, hot = pool.policy.used, pool.policy.admit_hot, pool.hot
        for slot in slots:
            key = slot._key
            used(key)
            slot.used_since_load, slot._awaiting = True, False
            if slot._tier == HOT:
                hot.move_to_end(key)
            elif admit_hot(key):
                self._join_hot(pool, slot)

    def _join_hot(self, pool: SlotPool, slot: Slot) -> None:
        slot.tier = HOT
        hot, key = pool.hot, slot._key
        hot[key] = None
        if len(hot) > pool.n_hot:
            if pool.demotes_lru:  # the first HOT key but the one just admitted (last): no candidate set made
                first = iter(hot)
                victim = next(first)
                victim = next(first, None) if victim == key else victim
            else:
                victim = pool.policy.demote(_HotKeys(hot, key))
            if victim is not None:
                pool.where[victim].tier = STAGE
                del hot[victim]

    def pin(self, slots: Sequence[Slot], by: int = 1) -> None:
        """Add `by` pins to each of `slots` (one pool's, distinct): `slot.pins += by` for each, with the pool's
        array written once."""
        if len(slots) == 1:  # one slot (a single release): no array built
            slots[0].pins += by
            return
        if not slots:
            return
        for slot in slots:
            slot._pins += by
        t = slots[0]._table
        t.pins[np.fromiter((slot.index for slot in slots), np.intp, len(slots))] += by

    def unpin_all(self) -> None:
        """Drop every pin: the computations that held them are gone (a forked child's copies of its parent's)."""
        for pool in self.pools.values():
            for slot in pool.slots:
                slot.pins = 0

    def remove(self, key: Key) -> None:
        """Forget `key` (its copy failed or was abandoned); its slot becomes free."""
        pool = self.pool(key[0])
        slot = pool.where.pop(key, None)
        if slot is None:
            return
        pool.policy.removed(key)
        if slot.tier == HOT:
            del pool.hot[key]
        slot.key, slot.tier, slot.pins, slot.ready, slot.awaiting, slot.partial = None, STAGE, 0, None, False, 0
        slot.first_ready = None
        pool._free.append(slot.index)

    def resident(self, layer: int | None = None) -> list[Key]:
        keys = [k for p in self.pools.values() for k in p.where]
        return sorted(k for k in keys if layer is None or k[0] == layer)

    @property
    def resident_bytes(self) -> int:
        return sum(p.resident_bytes for p in self.pools.values())

    @property
    def capacity_bytes(self) -> int:
        return sum(p.n_slots * p.slot_bytes for p in self.pools.values())


def _choose(pool: SlotPool, group: np.ndarray) -> Key | None:
    """The policy's victim among the slots `group` (indices, in the groups' order): by `victim_slots` on the
    pool's arrays where the policy's class offers it for its own `victim`, else by `victim` on the keys."""
    if not len(group):
        return None
    policy = pool.policy
    if pool.ranks_slots:
        i = policy.victim_slots(pool.table, group)
        return None if i is None else pool.slots[i].key
    t = pool.table
    return policy.victim(list(zip(t.layer[group].tolist(), t.expert[group].tolist())))


def demotes_lru(policy: CachePolicy) -> bool:
    """Whether `policy.demote` takes the least recently used HOT expert (the first it is offered): the policy's
    class says so by naming its `demote` also `lru_demote`; a subclass that overrides `demote` is asked."""
    lru = getattr(type(policy), "lru_demote", None)
    return lru is not None and getattr(type(policy), "demote", None) is lru


def ranks_slots(policy: CachePolicy) -> bool:
    """Whether `policy.victim_slots` makes `policy.victim`'s choice: defined by the class that defines `victim`
    or by a subclass of it (a subclass that overrides `victim` alone is asked by keys)."""
    if getattr(policy, "victim_slots", None) is None:
        return False
    owner = lambda name: next(c for c in type(policy).__mro__ if name in c.__dict__)  # noqa: E731
    return issubclass(owner("victim_slots"), owner("victim"))


class _HotKeys(AbstractSet):
    """The HOT experts of a pool but one (the expert just admitted), least recently used first: what
    `demote` chooses from. A set view, not a list: with fine-grained experts a pool holds over a
    thousand slots and nearly every use of a STAGE expert demotes one, so listing them per use cost
    more than the expert's matmuls; LRU takes the first, one lookup."""

    def __init__(self, hot: OrderedDict[Key, None], but: Key) -> None:
        self.hot, self.but = hot, but

    def __contains__(self, key: object) -> bool:
        return key != self.but and key in self.hot

    def __iter__(self) -> Iterator[Key]:
        return (k for k in self.hot if k != self.but)

    def __len__(self) -> int:
        return len(self.hot) - (self.but in self.hot)
