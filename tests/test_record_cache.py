"""Encoded records at load: encoded on host threads or a device with the same bits, cached on disk so
the next load reads them instead of encoding, never served when stale or damaged; hub ids load from
the Hugging Face cache layout offline, and a missing one fails in one line."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import new_thread_cpu_threads, torch_threads
from tiny_models import make_config

from mira_hf import CheckpointError, MiraConfig, MiraMoEModel
from mira_hf import record_cache as rc
from mira_hf.config import LoaderConfig, QuantConfig
from mira_hf.encode import RecordEncoder
from mira_hf.quant import lossless_bits as lossless
from mira_hf.quant.lossless import LosslessCodec
from mira_hf.saved_store import STORE_WEIGHTS

IDS = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(5))


def _checkpoint(path, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(make_config("mixtral")).save_pretrained(path)
    return str(path)


def _load(path, cache, code: str = "classes", **hf):
    loader = LoaderConfig(record_cache=None if cache is None else str(cache))
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, quantization="lossless", loader=loader, quant=QuantConfig(lossless_code=code))
    model = MiraMoEModel.from_pretrained(path, cfg, progress=False, **hf).eval()
    if model.mira.record_cache is not None:
        model.mira.record_cache.wait()  # the entry is written in the background
    return model


def _encoded(model) -> int:
    return model.mira.store.encoder.experts_encoded


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _entry(cache) -> str:
    (name,) = [n for n in os.listdir(cache) if not n.startswith(".")]
    return os.path.join(cache, name)


@pytest.fixture
def ckpt(tmp_path):
    return _checkpoint(tmp_path / "ckpt")


def test_second_load_reads_the_cached_records_without_encoding(ckpt, tmp_path):
    cache = tmp_path / "records"
    uncached = _load(ckpt, None)
    first = _load(ckpt, cache)
    assert _encoded(first) == _encoded(uncached) > 0
    second = _load(ckpt, cache)
    assert _encoded(second) == 0  # read, not encoded
    assert second.mira.store.nbytes == uncached.mira.store.nbytes
    for layer in uncached.mira.store.layers:
        assert torch.equal(second.mira.store.slabs()[layer], uncached.mira.store.slabs()[layer])
    assert torch.equal(_logits(second), _logits(uncached))
    assert [n for n in os.listdir(cache) if n.startswith(".")] == []  # no temporary left


def test_a_changed_checkpoint_or_format_is_not_served_from_the_cache(ckpt, tmp_path):
    """A checkpoint saved again in place is encoded again, and the entries of its old files, which no load can find
    any more, are removed; another checkpoint's entry stays."""
    cache = tmp_path / "records"
    other = _checkpoint(tmp_path / "other", seed=2)
    _load(other, cache)
    _load(ckpt, cache)
    assert _encoded(_load(ckpt, cache, code="nibble")) > 0  # another format: another entry
    assert len(os.listdir(cache)) == 3
    _checkpoint(ckpt, seed=1)  # the checkpoint rewritten with other weights
    changed = _load(ckpt, cache)
    assert _encoded(changed) > 0
    assert torch.equal(_logits(changed), _logits(_load(ckpt, None)))
    assert len(os.listdir(cache)) == 2  # the rewritten checkpoint's entry and the other checkpoint's
    assert _encoded(_load(other, cache)) == 0


def test_writing_an_entry_removes_nothing_but_entries_no_load_can_find(ckpt, tmp_path):
    """The cache's directory may hold other things (a directory given by hand): they stay, and so does the entry of a
    checkpoint on a disk not mounted now (its mount point left empty)."""
    cache = tmp_path / "records"
    (cache / "my-notes").mkdir(parents=True)
    (cache / "my-notes" / "todo.txt").write_text("keep me")
    (cache / ("a" * 40)).mkdir()  # named as an entry, without a header
    away = _checkpoint(tmp_path / "mnt" / "disk" / "models" / "ckpt", seed=3)
    _load(away, cache)
    shutil.move(str(tmp_path / "mnt" / "disk" / "models"), str(tmp_path / "elsewhere"))  # /mnt/disk left empty
    _load(ckpt, cache)
    assert (cache / "my-notes" / "todo.txt").read_text() == "keep me" and (cache / ("a" * 40)).is_dir()
    assert len([n for n in os.listdir(cache) if len(n) == 40 and n != "a" * 40]) == 2  # both checkpoints' entries


def test_the_entry_of_a_checkpoint_deleted_with_its_directory_is_removed(ckpt, tmp_path):
    """`rm -rf` of a checkpoint beside other files (a models folder, the hub's cache) leaves an entry no load can find
    again: writing the next entry removes it, as it removes an entry whose files alone were deleted."""
    cache = tmp_path / "records"
    models = tmp_path / "models"
    gone = _checkpoint(models / "org" / "ckpt", seed=3)
    (models / "README.txt").write_text("other things stay here")
    _load(gone, cache)
    shutil.rmtree(models / "org")
    _load(ckpt, cache)
    assert len([n for n in os.listdir(cache) if len(n) == 40]) == 1  # the loaded checkpoint's entry only


def test_a_checkpoint_replaced_with_its_modification_time_put_back_is_not_served_from_the_cache(ckpt, tmp_path):
    """Other weights of the same shapes copied over the checkpoint with the old modification times restored (as
    `cp -p`, `rsync -a` or an archive can): same sizes, same mtimes, and still not the cached records."""
    cache = tmp_path / "records"
    _load(ckpt, cache)
    times = {f: os.stat(os.path.join(ckpt, f)) for f in os.listdir(ckpt)}
    other = _checkpoint(tmp_path / "other", seed=1)
    for f in os.listdir(other):
        shutil.copyfile(os.path.join(other, f), os.path.join(ckpt, f))
        os.utime(os.path.join(ckpt, f), ns=(times[f].st_atime_ns, times[f].st_mtime_ns))
    assert all(os.stat(os.path.join(ckpt, f)).st_size == times[f].st_size for f in times)
    changed = _load(ckpt, cache)
    assert _encoded(changed) > 0
    assert torch.equal(_logits(changed), _logits(_load(ckpt, None)))


def test_a_new_record_format_version_is_not_served_old_entries(ckpt, tmp_path, monkeypatch):
    cache = tmp_path / "records"
    _load(ckpt, cache)
    monkeypatch.setattr(rc, "RECORD_FORMAT_VERSION", rc.RECORD_FORMAT_VERSION + 1)
    assert _encoded(_load(ckpt, cache)) > 0


@pytest.mark.parametrize("damage", ["truncate", "flip", "header"])
def test_a_damaged_entry_is_rebuilt_never_served(ckpt, tmp_path, damage):
    cache = tmp_path / "records"
    reference = _logits(_load(ckpt, cache))
    entry = _entry(cache)
    weights = os.path.join(entry, STORE_WEIGHTS)
    if damage == "truncate":
        os.truncate(weights, os.path.getsize(weights) - 1000)
    elif damage == "flip":  # same size, one byte inside the records changed
        with open(weights, "r+b") as f:
            f.seek(os.path.getsize(weights) - 3000)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x40]))
    else:
        with open(os.path.join(entry, "mira_store.json"), "a") as f:
            f.write("garbage")
    with pytest.warns(UserWarning, match="record cache entry"):
        rebuilt = _load(ckpt, cache)
    assert _encoded(rebuilt) > 0
    assert torch.equal(_logits(rebuilt), reference)
    assert _encoded(_load(ckpt, cache)) == 0  # the entry written again is whole


def test_a_file_where_the_entry_goes_is_replaced_by_the_entry(ckpt, tmp_path):
    cache = tmp_path / "records"
    _load(ckpt, cache)
    entry = _entry(cache)
    shutil.rmtree(entry)
    with open(entry, "w") as f:
        f.write("not an entry")
    assert _encoded(_load(ckpt, cache)) > 0
    assert os.path.isdir(entry) and _encoded(_load(ckpt, cache)) == 0


def test_an_interrupted_write_leaves_no_entry(ckpt, tmp_path, monkeypatch):
    cache = tmp_path / "records"

    def fail(directory, *args):
        os.makedirs(directory)
        open(os.path.join(directory, STORE_WEIGHTS), "wb").write(b"half")
        raise KeyboardInterrupt  # the process interrupted mid-write

    monkeypatch.setattr(rc, "write_store", fail)
    with pytest.raises(KeyboardInterrupt):
        model = _load(ckpt, None)
        rc.RecordCache(str(cache), [os.path.join(ckpt, "model.safetensors")], {"x": 1}, {}, {}).write(
            model.mira.store.slabs(), model.mira.store.plans(), background=False
        )
    assert os.listdir(cache) == []


def test_experts_loaded_over_the_records_while_their_entry_is_written_do_not_reach_it(ckpt, tmp_path, monkeypatch):
    """The entry is written in the background from the store's records; a `load_state_dict` of other experts right
    after loading (a fine-tune of the same shapes) rewrites those records only once the entry holds the checkpoint's:
    the next load of the unchanged checkpoint is the checkpoint, not the fine-tune."""
    import threading
    import time

    from mira_hf import saved_store

    cache = tmp_path / "records"
    expected = _logits(_load(ckpt, None))
    writing, slow = threading.Event(), saved_store._write_chunk

    def slow_chunk(*args):  # a slow disk: the load returns while the entry is still being written
        writing.set()
        time.sleep(0.2)
        return slow(*args)

    monkeypatch.setattr(saved_store, "_write_chunk", slow_chunk)
    loader = LoaderConfig(record_cache=str(cache))
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, quantization="lossless", loader=loader)
    model = MiraMoEModel.from_pretrained(ckpt, cfg, progress=False).eval()
    assert writing.wait(10) and model.mira.record_cache.writer.is_alive()
    model.load_state_dict({k: (-v if ".experts." in k else v) for k, v in model.state_dict().items()})
    model.mira.record_cache.wait()
    monkeypatch.setattr(saved_store, "_write_chunk", slow)
    again = _load(ckpt, cache)
    assert _encoded(again) == 0 and torch.equal(_logits(again), expected)


def test_concurrent_writers_leave_one_whole_entry(ckpt, tmp_path):
    """Two loads that both missed write the same entry: the first rename wins, the other drops its copy."""
    cache = tmp_path / "records"
    model = _load(ckpt, None)
    store = model.mira.store
    args = (str(cache), [os.path.join(ckpt, "model.safetensors")], store.codec_spec(), model.mira.fingerprint, {})
    writers = [rc.RecordCache(*args) for _ in range(2)]
    for w in writers:
        w.write(store.slabs(), store.plans())
    for w in writers:
        w.wait()
    assert os.listdir(cache) == [writers[0].key]
    saved = writers[0].open()
    for layer, slab in store.slabs().items():
        rows = torch.empty_like(slab)
        saved.fill(layer)(rows)
        assert torch.equal(rows, slab)


# -- encoding ----------------------------------------------------------------------------------------------
def _fused(dtype):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(4, 96, 70, generator=g) * 0.02).to(dtype)
    w[1, 0, :4] = torch.tensor([3e30, 1e-30, float("nan"), -0.0]).to(dtype)  # escapes, subnormals, NaN, -0
    return {"gate_up_proj": w, "down_proj": (torch.randn(4, 35, 96, generator=g) * 0.5).to(dtype)}


def _records(encoder: RecordEncoder, codec, fused, device_path: bool = False):
    specs = {n: (tuple(t.shape[1:]), t.dtype) for n, t in fused.items()}
    E = next(iter(fused.values())).shape[0]
    expert = lambda e: {n: t[e] for n, t in fused.items()}  # noqa: E731
    layout = encoder.plan_layer(codec, specs, E, expert)
    slab = torch.zeros(E, layout.nbytes, dtype=torch.uint8)
    if device_path:  # what a CUDA encoder runs: a record buffer on its device, copied into the slab
        encoder.encode_layer(codec, layout, E, expert, lambda e, record: slab[e].copy_(record))
    else:
        encoder.encode_into(codec, layout, E, expert, slab)
    return layout, slab


@pytest.mark.parametrize("code", ["classes", "nibble"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_parallel_and_device_path_encoding_give_the_serial_records(code, dtype, monkeypatch):
    codec, fused = LosslessCodec(code), _fused(dtype)
    layout, serial = _records(RecordEncoder("cpu", workers=1), codec, fused)
    for encoder, device_path in ((RecordEncoder("cpu", workers=4), False), (RecordEncoder("cpu", workers=1), True)):
        other_layout, records = _records(encoder, codec, fused, device_path)
        assert other_layout == layout and torch.equal(records, serial)
    # a GPU encodes in steps of 2**24 weights instead of 2**18: the step never changes the bits
    for step in (256, 1 << 24):
        monkeypatch.setattr(lossless, "_CHUNK", step)
        assert torch.equal(_records(RecordEncoder("cpu", workers=1), codec, fused)[1], serial)
    decoded = codec.decode(serial[1], layout, dtype)
    assert all(torch.equal(decoded[n].view(torch.uint8), t[1].view(torch.uint8)) for n, t in fused.items())


def test_parallel_encoding_leaves_the_thread_count_of_threads_started_later_alone():
    """Each encoder thread computes on one CPU thread of its own; threads the user starts afterwards get the process's
    count as before, not the encoders' one."""
    with torch_threads(3):
        _records(RecordEncoder("cpu", workers=4), LosslessCodec("classes"), _fused(torch.bfloat16))
        assert new_thread_cpu_threads() == 3 == torch.get_num_threads()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("code", ["classes", "nibble"])
def test_cuda_encoding_gives_the_cpu_records(code):
    codec, fused = LosslessCodec(code), _fused(torch.bfloat16)
    layout, cpu = _records(RecordEncoder("cpu", workers=1), codec, fused)
    cuda_layout, cuda = _records(RecordEncoder("cuda"), codec, fused, device_path=True)
    assert cuda_layout == layout and torch.equal(cuda, cpu)


# -- hub ids -------------------------------------------------------------------------------------------
def _hub_cache(root, src: str, repo: str = "org/tiny-moe") -> str:
    """`src` laid out as huggingface_hub caches a download: models--org--name/snapshots/<rev>/, refs/main."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    base = os.path.join(root, "models--" + repo.replace("/", "--"))
    shutil.copytree(src, os.path.join(base, "snapshots", rev))
    os.makedirs(os.path.join(base, "refs"))
    with open(os.path.join(base, "refs", "main"), "w") as f:
        f.write(rev)
    return rev


def test_a_hub_id_loads_from_the_cache_layout_offline(ckpt, tmp_path):
    hub = tmp_path / "hub"
    _hub_cache(hub, ckpt)
    by_id = _load("org/tiny-moe", tmp_path / "records", cache_dir=str(hub))
    assert torch.equal(_logits(by_id), _logits(_load(ckpt, None)))
    assert _encoded(_load("org/tiny-moe", tmp_path / "records", cache_dir=str(hub))) == 0


def test_a_missing_hub_id_offline_is_one_line_saying_what_to_do(tmp_path):
    with pytest.raises(CheckpointError) as info:
        _load("org/not-there", None, cache_dir=str(tmp_path))
    message = str(info.value)
    assert "\n" not in message and "org/not-there" in message and "HF_HUB_OFFLINE=1" in message and "hf download" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_a_revision_missing_from_the_cache_offline_is_named_with_how_to_get_it(ckpt, tmp_path):
    hub = tmp_path / "hub"
    _hub_cache(hub, ckpt)  # main is cached, v2 is not
    with pytest.raises(CheckpointError) as info:
        _load("org/tiny-moe", None, cache_dir=str(hub), revision="v2")
    assert "revision 'v2'" in str(info.value) and "hf download org/tiny-moe --revision v2" in str(info.value)


def test_hub_ids_resolve_under_hf_home(ckpt, tmp_path):
    """In a fresh process with HF_HOME and HF_HUB_OFFLINE=1 (as a user sets them): the cached id loads,
    a missing one fails with one line on stderr and no retry noise."""
    _hub_cache(tmp_path / "home" / "hub", ckpt)
    script = textwrap.dedent(
        """
        import sys
        from mira_hf import MiraConfig, MiraMoEModel
        cfg = MiraConfig(device="cpu", gpu_budget=0.5, quantization="lossless")
        model = MiraMoEModel.from_pretrained("org/tiny-moe", cfg, progress=False)
        print("loaded", model.mira.record_cache.directory.startswith(sys.argv[1]))
        MiraMoEModel.from_pretrained("org/not-there", cfg, progress=False)
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MIRA_HF_RECORD_CACHE", "HF_HUB_CACHE", "TRANSFORMERS_CACHE")}
    env.update(HF_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1", PYTHONPATH=os.getcwd())
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "home")], env=env, capture_output=True, text=True)
    assert "loaded True" in run.stdout, run.stderr[-2000:]
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("mira_hf.errors.CheckpointError: org/not-there does not exist: no such directory")
    assert "Retrying" not in run.stderr and "During handling" not in run.stderr
