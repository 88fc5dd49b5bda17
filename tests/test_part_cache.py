"""Device copies of the most used experts' host parts (`MiraConfig(host_compute="split", host_part_cache=...)`): taken
from the budget, filled and replaced by use rate as hand-computed, and outputs within the split's bound."""

from __future__ import annotations

import copy
import weakref

import numpy as np
import pytest
import torch
from test_host_compute import BOUND, costs
from test_host_split import FAMILIES, IDS, _split, _tiny

import mira_hf.manager as manager_module
from mira_hf import ConfigError, MiraConfig, MiraMoEModel
from mira_hf.budget import LayerInfo, least_bytes, plan_records
from mira_hf.layout import IdentityCodec
from mira_hf.neuron_split import HostParts, NeuronSplit
from mira_hf.part_cache import ADMIT_MARGIN, ALIGN, PartCache


def _parts(layers=2, experts=6, hidden=4, neurons=8):
    """Host parts of `layers` layers of `experts` Mixtral-like experts (gate and up in halves, down [H, I]), each
    filled with its (layer, expert) number so an entry's contents tell whose part it holds."""
    split = NeuronSplit("gate_up_proj", "halves", False, 2 * neurons, host=neurons)
    parts = HostParts({layer: split for layer in range(layers)})
    specs = {"gate_up_proj": ((4 * neurons, hidden), torch.float32), "down_proj": ((hidden, 2 * neurons), torch.float32)}
    for layer in range(layers):
        parts.allocate(layer, specs, experts)
        for t in parts.tensors[layer].values():
            for e in range(experts):
                t[e].fill_(100 * layer + e)
    return parts


def _cache(parts, entries, rates):
    """A cache of `entries` entries whose use rates are `rates[layer, expert]` (read at every admission)."""
    entry = sum(-(-t[0].numel() * t.element_size() // ALIGN) * ALIGN for t in parts.tensors[0].values())
    buffer = torch.empty(entries * entry + entry // 2, dtype=torch.uint8)  # a part entry's worth too little
    return PartCache(buffer, parts, parts.tensors, lambda layers, experts: rates[layers, experts])


def _holds(cache, layer, expert):
    return all(bool((t == 100 * layer + expert).all()) for t in cache.views((layer, expert)).values())


def test_entries_fill_free_then_replace_the_least_used_as_hand_computed():
    parts = _parts()
    table = np.array([[0.9, 0.5, 0.2, 0.1, 0.45, 0.05], [0.3, 0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    cache = _cache(parts, 2, table)
    assert len(cache) == 2  # the buffer's half entry is left over
    # Free entries are filled most used first, whichever path the parts had; a third finds no room.
    assert cache.admit(0, copied=[2], host=[0, 1]) == [0, 1]
    for e in (0, 1):
        cache.fill((0, e))
    assert set(cache.index) == {(0, 0), (0, 1)} and _holds(cache, 0, 0) and _holds(cache, 0, 1)
    # A part copied for this use anyway replaces the least used entry's (0.5) when used more; 0.45 is not.
    assert cache.admit(0, copied=[4], host=[]) == []
    # A part the host would compute needs ADMIT_MARGIN times the least used one's rate: 0.3 < 2 x 0.5.
    assert ADMIT_MARGIN == 2.0 and cache.admit(1, copied=[], host=[0]) == []
    table[1, 0] = 1.2  # now 1.2 > 2 x 0.5: it replaces expert 1 of layer 0
    assert cache.admit(1, copied=[], host=[0]) == [0]
    cache.fill((1, 0))
    assert set(cache.index) == {(0, 0), (1, 0)} and _holds(cache, 1, 0) and _holds(cache, 0, 0)
    # Entries the block reads are never replaced by it, nor those it filled: expert 3 of layer 0 finds none.
    table[0, 3] = 5.0
    assert cache.admit(0, copied=[3], host=[], keep=[0]) == [3]  # replaces (1, 0), the least used not read
    assert cache.admit(0, copied=[5], host=[2], keep=[0, 3]) == []  # every entry is read by the block
    assert set(cache.index) == {(0, 0), (0, 3)}


def test_no_buffer_or_a_buffer_smaller_than_one_part_holds_nothing():
    parts = _parts()
    for buffer in (None, torch.empty(ALIGN, dtype=torch.uint8)):
        cache = PartCache(buffer, parts, parts.tensors, lambda layers, experts: np.ones(len(layers), np.float32))
        assert len(cache) == 0 and cache.admit(0, copied=[1], host=[2]) == []


def test_the_budget_gives_the_part_cache_its_share_beyond_the_minimum_working_set():
    layers = [LayerInfo(i, f"l{i}", 8, 2) for i in range(2)]
    raw = {0: 1000, 1: 1000}
    plain = plan_records(layers, 10_000, "raw", IdentityCodec(), {}, raw)
    plan = plan_records(layers, 10_000, "raw", IdentityCodec(), {}, raw, part_cache=0.25)
    assert plan.buffer_bytes == {"host_parts": 2500} and plan.device_bytes <= 10_000
    assert sum(plan.n_slots.values()) == 7 < sum(plain.n_slots.values()) == 10
    # Never below the minimum working set (top-2 of one layer): at 2500 bytes only 500 are left for parts.
    assert least_bytes(layers, plan.pool_of_layer) == 2000
    assert plan_records(layers, 2500, "raw", IdentityCodec(), {}, raw, part_cache=0.5).buffer_bytes == {"host_parts": 500}
    assert plan_records(layers, 2000, "raw", IdentityCodec(), {}, raw, part_cache=0.5).buffer_bytes == {}


def test_the_part_cache_is_validated():
    for share in (-0.1, 1, 1.5, "half", True):
        with pytest.raises(ConfigError, match="host_part_cache="):
            MiraConfig(host_compute="split", host_part_cache=share)
    with pytest.raises(ConfigError, match="host_compute='off': it would change nothing"):
        MiraConfig(host_part_cache=0.25)


@pytest.mark.filterwarnings("ignore:mira-hf. model_type")
@pytest.mark.parametrize("name", FAMILIES)
def test_held_parts_serve_their_uses_within_the_bound_and_the_budget_holds(name):
    """A batch decode with a quarter of the budget holding host parts: the parts used most are held, their later uses
    computed from them on the device, and the logits stay within the bound of the split without them."""
    ref = _tiny(name)
    model = _split(copy.deepcopy(ref), gpu_budget=0.5, host_part_cache=0.25)
    m = model.mira
    assert m.budget.buffer_bytes["host_parts"] == int(0.25 * m.budget.budget_bytes)
    assert m.budget.device_bytes <= m.budget.budget_bytes and len(m.part_cache) >= 2
    ids = torch.randint(3, 128, (4, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for n in range(3, 7):  # growing prefixes: each step's blocks use the parts held by the steps before
            expected, got = ref(ids[:, :n]).logits, model(ids[:, :n]).logits
            assert (got - expected).abs().max() <= BOUND[torch.float32] * expected.abs().max()
    s = m.stats()
    assert s["parts_cached"] > 0 and s["parts_cached"] + s["parts_copied"] <= s["hits"] + s["misses"]
    held = m.part_cache.index
    assert len(held) == len(m.part_cache)  # every entry filled
    for layer, e in held:  # each entry holds its expert's part as stored on the host
        views, host = m.part_cache.views((layer, e)), m.host.parts.weights(layer, e)
        assert all(torch.equal(views[k], host[k]) for k in host)


def test_a_slower_host_sends_held_parts_nowhere_and_copies_only_the_others():
    """Host slower than the link: the parts not held cross the link for their use, those held are computed from their
    entries; no host job at all."""
    ref = _tiny("mixtral")
    model = _split(copy.deepcopy(ref), gpu_budget=0.5, host_part_cache=0.25)
    m = model.mira
    m.host.set_costs(costs(link_bytes_per_s=1e9, host_s={layer: {1: 1.0} for layer in m.layers}))
    started = []
    m.host.start = lambda layer, experts, inputs, f=m.host.start: started.extend(experts) or f(layer, experts, inputs)
    with torch.no_grad():
        for n in range(1, 4):
            expected, got = ref(IDS[:, :n]).logits, model(IDS[:, :n]).logits
            assert (got - expected).abs().max() <= BOUND[torch.float32] * expected.abs().max()
    s = m.stats()
    assert started == [] and s["parts_cached"] > 0
    assert s["parts_cached"] + s["parts_copied"] == s["hits"] + s["misses"]


def test_a_cast_empties_the_part_cache_and_sizes_its_entries_anew(monkeypatch):
    ref = _tiny("mixtral")
    model = _split(copy.deepcopy(ref), gpu_budget=0.5, host_part_cache=0.25)
    with torch.no_grad():
        model(IDS.expand(3, -1))
    assert model.mira.part_cache.index
    old, alive = weakref.ref(model.mira.part_cache.buffer), []
    arena = manager_module.DeviceArena
    monkeypatch.setattr(manager_module, "DeviceArena", lambda *a, **kw: alive.append(old() is not None) or arena(*a, **kw))
    model.to(torch.bfloat16)
    assert alive == [False]  # the old buffer was gone before the new arena allocated its own
    cache = model.mira.part_cache
    assert not cache.index and cache.buffer.numel() == model.mira.budget.buffer_bytes["host_parts"]
    half = ref.to(torch.bfloat16)
    with torch.no_grad():
        expected, got = half(IDS.expand(3, -1)).logits, model(IDS.expand(3, -1)).logits
    assert (got - expected).abs().max() <= BOUND[torch.bfloat16] * expected.abs().max()
    assert model.mira.part_cache.index and all(
        t.dtype in (torch.bfloat16, torch.float32) for t in cache.views(next(iter(cache.index))).values()
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_on_a_gpu_held_parts_are_copied_in_stream_order_and_give_the_logits_of_parts_not_held(name):
    """On a GPU the entries are filled by asynchronous copies from page-locked host memory, replaced while earlier
    blocks may still read them: the logits equal, bit for bit, those of the same split with every part copied for its
    use (the same device math on the same weights), over decode steps that keep replacing entries."""
    ref = _tiny(name, torch.bfloat16).cuda()
    slow_host = costs(link_bytes_per_s=1e12, host_s={layer: {1: 1.0} for layer in range(64)})
    models = []
    for cache in (0.0, 0.05):  # every device part has a slot either way; a few entries, replaced again and again
        cfg = MiraConfig(device="cuda", gpu_budget=0.99, host_compute="split", host_part_cache=cache)
        model = MiraMoEModel.wrap(copy.deepcopy(ref), cfg)
        model.mira.host.set_costs(slow_host)  # every part not held crosses the link: no host rounding
        models.append(model)
    ids = torch.randint(3, 128, (3, 12), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        for n in range(1, 13):
            copied, held = (m(ids[:, :n]).logits for m in models)
            assert torch.equal(copied, held), n
    s = models[1].mira.stats()
    assert s["parts_cached"] > 0 and models[0].mira.stats()["parts_cached"] == 0
    assert len(models[1].mira.part_cache.index) == len(models[1].mira.part_cache) > 1


def test_unload_lets_go_of_the_held_parts():
    model = _split(_tiny("mixtral"), gpu_budget=0.5, host_part_cache=0.25)
    with torch.no_grad():
        model(IDS.expand(3, -1))
    m = model.mira
    buffer = weakref.ref(m.part_cache.buffer)
    model.unload()
    assert buffer() is None and len(m.part_cache) == 0 and not m.part_cache.index
