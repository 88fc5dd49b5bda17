"""The loading pipeline's parts: experts read on several threads in order, slabs page-locked ahead."""

import os
import threading
import time

import pytest
import torch

import mira_hf.store as store_module
from mira_hf.encode import RecordEncoder, read_ahead
from mira_hf.layout import IdentityCodec
from mira_hf.quant import make_codec
from mira_hf.store import ExpertStore


def test_read_ahead_gives_every_result_in_order_with_reads_on_several_threads():
    threads, lock, running, most = set(), threading.Lock(), [0], [0]

    def read(e):
        with lock:
            threads.add(threading.get_ident())
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.02 * (e % 3))  # out-of-order completion
        with lock:
            running[0] -= 1
        return e * e

    assert list(read_ahead(12, read, 4)) == [e * e for e in range(12)]
    assert len(threads) > 1 and most[0] <= 4


def test_read_ahead_reads_at_most_readers_plus_one_ahead_of_the_consumer():
    started = []
    ahead = read_ahead(20, lambda e: started.append(e) or e, 3)
    assert next(ahead) == 0
    time.sleep(0.1)
    assert sorted(started) == [0, 1, 2, 3]  # the one consumed and three read ahead, no more
    ahead.close()


def test_read_ahead_raises_the_first_failure_in_order():
    def read(e):
        if e == 2:
            raise OSError("shard gone")
        return e

    got = []
    with pytest.raises(OSError, match="shard gone"):
        for x in read_ahead(6, read, 3):
            got.append(x)
    assert got == [0, 1]


def _fused(E=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "gate_up_proj": (torch.randn(E, 32, 16, generator=g) * 0.02).to(torch.bfloat16),
        "down_proj": (torch.randn(E, 16, 16, generator=g) * 0.02).to(torch.bfloat16),
    }


def _thread_safe(fused):
    def expert(e):
        return {n: t[e].clone() for n, t in fused.items()}

    expert.thread_safe = True
    return expert


@pytest.mark.parametrize("codec_name", [None, "lossless"])
def test_parallel_reads_give_the_records_of_serial_reads(codec_name):
    """Records are byte-identical whether experts are read on one thread or several (in order)."""
    fused = _fused(E=6)
    specs = {n: (tuple(t.shape[1:]), t.dtype) for n, t in fused.items()}
    slabs = []
    for readers in (1, 4):
        codec = IdentityCodec() if codec_name is None else make_codec(codec_name)
        store = ExpertStore(codec, encoder=RecordEncoder("cpu", workers=1, readers=readers))
        layout = store.encoder.plan_layer(codec, specs, 6, _thread_safe(fused)) if codec_name else None
        store.add_layer_from(0, specs, 6, _thread_safe(fused), layout=layout)
        slabs.append(store.slabs()[0].clone())
    assert torch.equal(slabs[0], slabs[1])


def test_reserved_pinned_slabs_are_used_in_order_and_budget_layers_go_to_disk(monkeypatch, tmp_path):
    """Slabs page-locked ahead are the ones the layers get; a layer beyond host_budget is not reserved."""
    made = []

    def fake_pinned(nbytes):  # a CPU stand-in for page-locked memory, recording each allocation
        t = torch.empty(nbytes, dtype=torch.uint8)
        made.append((nbytes, t.data_ptr()))
        return t

    monkeypatch.setattr(store_module, "pinned_empty", fake_pinned)
    fused = [_fused(E=4, seed=s) for s in range(3)]
    specs = {n: (tuple(t.shape[1:]), t.dtype) for n, t in fused[0].items()}
    layer_bytes = IdentityCodec().plan(specs).nbytes * 4
    store = ExpertStore(pinned=True, host_budget_bytes=2 * layer_bytes, offload_dir=str(tmp_path))
    store.reserve({layer: layer_bytes for layer in range(3)})
    for layer in range(3):
        store.add_layer_from(layer, specs, 4, _thread_safe(fused[layer]))
    assert [store.tier(layer) for layer in range(3)] == ["pinned", "pinned", "disk"]
    assert [n for n, _ in made] == [layer_bytes, layer_bytes]  # two reserved, none allocated again
    assert [store.slabs()[layer].data_ptr() for layer in range(2)] == [p for _, p in made]
    for layer in range(3):
        assert all(torch.equal(store.fused(layer)[n], fused[layer][n]) for n in specs)
    stages = store.encoder.report.as_dict()["stages"]
    assert stages["pin"]["bytes"] == 2 * layer_bytes and "pin_wait" in stages
    store.close()


def test_a_layer_that_fails_on_the_disk_tier_leaves_no_file_and_a_rewrite_replaces_its_file(tmp_path):
    """Each disk slab has a file of its own: one whose layer fails while written is removed, and a rewrite into
    another dtype gives the layer a new file and removes the old one."""
    fused = _fused(E=4, seed=0)
    specs = {n: (tuple(t.shape[1:]), t.dtype) for n, t in fused.items()}
    store = ExpertStore(pinned=False, host_budget_bytes=0, offload_dir=str(tmp_path))

    def failing(e):
        if e == 2:
            raise RuntimeError("injected: a read failed")
        return {n: t[e] for n, t in fused.items()}

    with pytest.raises(RuntimeError, match="injected"):
        store.add_layer_from(0, specs, 4, failing)
    assert os.listdir(tmp_path) == []
    store.add_layer_from(0, specs, 4, lambda e: {n: t[e] for n, t in fused.items()})
    (first,) = os.listdir(tmp_path)
    store.rewrite(0, dtype=torch.float32)  # records of another size: a new slab
    (second,) = os.listdir(tmp_path)
    assert second != first and all(torch.equal(store.fused(0)[n], fused[n].float()) for n in specs)
    store.close()
    assert os.listdir(tmp_path) == []


def _hub_cache(tmp_path, source: str) -> str:
    """`source` as the hub's cache holds model mira/tiny-sharded at one commit; returns the cache dir."""
    import shutil

    repo = tmp_path / "hub" / "models--mira--tiny-sharded"
    shutil.copytree(source, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return str(tmp_path / "hub")


def test_every_shard_of_a_hub_checkpoint_is_found_and_a_missing_one_is_named(tmp_path):
    from tiny_models import make_config
    from transformers import AutoModelForCausalLM

    from mira_hf import CheckpointError
    from mira_hf.shards import ShardIndex

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(make_config("mixtral")).save_pretrained(tmp_path / "src", max_shard_size="100KB")
    shards = sorted(p.name for p in (tmp_path / "src").glob("*.safetensors"))
    assert len(shards) > 2
    cache = _hub_cache(tmp_path, str(tmp_path / "src"))
    kw = dict(cache_dir=cache, local_files_only=True)
    index = ShardIndex.find("mira/tiny-sharded", kw)
    assert [os.path.basename(f) for f in index.files] == shards
    os.remove(os.path.join(cache, "models--mira--tiny-sharded", "snapshots", "0" * 40, shards[1]))
    with pytest.raises(CheckpointError, match=f"shard {shards[1]} listed in model.safetensors.index.json is missing"):
        ShardIndex.find("mira/tiny-sharded", kw)
