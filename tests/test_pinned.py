"""Pinned expert slabs: page-locked in place at exactly their size (torch's pinned allocator would round
each one up to a power of two), unlocked when the last view is freed, torch's allocator as the fallback.
The CUDA runtime is replaced by a fake that records the calls (the tests run without a GPU;
`benchmarks/pin_probe.py` measures the real one on a GPU)."""

import gc

import pytest
import torch

from mira_hf import pinned
from mira_hf.store import ExpertStore


class FakeCudart:
    def __init__(self, result: int = 0):
        self.result = result
        self.registered: dict[int, int] = {}
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (the CUDA name)
        self.calls.append(("register", ptr, size, flags))
        if self.result == 0:
            self.registered[ptr] = size
        return self.result

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr))
        assert ptr in self.registered, "unregistering memory that was never registered"
        del self.registered[ptr]
        return 0


@pytest.fixture
def fake(monkeypatch):
    rt = FakeCudart()
    fallback = []
    monkeypatch.setattr(pinned, "_cudart", lambda: rt)
    monkeypatch.setattr(pinned, "_torch_pinned", lambda n: fallback.append(n) or torch.empty(n, dtype=torch.uint8))
    rt.fallback = fallback
    return rt


def test_slab_is_registered_at_exactly_its_size_and_page_aligned(fake):
    n = pinned.REGISTER_MIN_BYTES + 12345  # not a power of two, not a multiple of a page
    t = pinned.pinned_empty(n)
    assert t.dtype == torch.uint8 and t.numel() == n and t.is_contiguous()
    assert t.data_ptr() % pinned.PAGE == 0
    assert fake.registered == {t.data_ptr(): n}
    t.fill_(7)  # ordinary writable memory
    assert int(t[-1]) == 7 and not fake.fallback


def test_unregistered_only_when_the_last_view_is_freed(fake):
    E, r = 4, pinned.REGISTER_MIN_BYTES // 2 + 3
    slab = pinned.pinned_empty(E * r).view(E, r)
    record = slab[2]  # the store hands out views like this one
    ptr = slab.data_ptr()
    del slab
    gc.collect()
    assert ptr in fake.registered  # a record view still reads the memory: it stays locked
    record.zero_()
    del record
    gc.collect()
    assert fake.registered == {} and fake.calls[-1] == ("unregister", ptr)


def test_failed_registration_falls_back_to_torch_pinned_memory(fake):
    fake.result = 1  # cudaErrorInvalidValue, say
    t = pinned.pinned_empty(pinned.REGISTER_MIN_BYTES)
    assert t.numel() == pinned.REGISTER_MIN_BYTES
    assert fake.fallback == [pinned.REGISTER_MIN_BYTES] and fake.registered == {}


def test_small_buffers_and_missing_runtime_use_torch_pinned_memory(fake, monkeypatch):
    pinned.pinned_empty(4096)
    monkeypatch.setattr(pinned, "_cudart", lambda: None)
    pinned.pinned_empty(pinned.REGISTER_MIN_BYTES * 2)
    assert fake.fallback == [4096, pinned.REGISTER_MIN_BYTES * 2] and not fake.calls


def test_pinned_store_registers_each_layer_slab_at_its_exact_size(fake):
    E, shape = 4, (96, 8192)  # 1.5 MiB bf16 per tensor; a layer is 12 MiB + 4 KiB of bias
    fused = {
        "gate_up_proj": torch.randn(E, *shape).to(torch.bfloat16),
        "down_proj": torch.randn(E, *shape).to(torch.bfloat16),
        "down_proj_bias": torch.randn(E, 512).to(torch.bfloat16),
    }
    store = ExpertStore(pinned=True)
    store.add_layer(0, fused)
    r = store.record_bytes(0)
    assert store.tier(0) == "pinned" and store.tier_bytes()["pinned"] == E * r
    assert sorted(fake.registered.values()) == [E * r]  # one registration, the layer's exact bytes
    slab = store.slabs()[0]
    lo, hi = slab.data_ptr(), slab.data_ptr() + E * r
    # every host→device copy reads the registered slab: each expert's piece of each tensor lies inside it
    assert all(lo <= p.data_ptr() and p.data_ptr() + p.numel() <= hi for e in range(E) for _, p in store.pieces(0, e))
    del slab
    del store
    gc.collect()
    assert fake.registered == {}
