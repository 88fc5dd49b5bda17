"""The host side: experts stored tensor by tensor, the disk tier beyond host_budget, and peak host memory
while loading."""

import errno
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import PEAK_ANON_SOURCE, load_reference, torch_threads

from mira_hf import BudgetError, ConfigError, MiraConfig, MiraMoEModel

IDS = torch.tensor([[4, 8, 15, 16, 23, 42, 7, 9]])


def test_each_fused_tensor_is_contiguous_and_each_expert_a_slice_of_it(tiny_checkpoint):
    """Uncompressed experts are stored tensor by tensor: each fused parameter (`gate_up_proj [E, 2I, H]`, ...)
    is one contiguous tensor over the layer's slab, and an expert's record is copied from its slice of each."""
    model = MiraMoEModel.from_pretrained(tiny_checkpoint("gpt_oss"), MiraConfig(device="cpu"), progress=False)
    store = model.mira.store
    layout, views = store.layout(0), store.expert_views(0)
    assert set(views) == {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}
    assert all(v.is_contiguous() and v.shape[0] == store.num_experts(0) for v in views.values())
    for e in (0, 3):
        pieces = store.pieces(0, e)
        assert [offset for offset, _ in pieces] == [t.offset for t in layout.tensors]  # one piece per tensor
        for (_, piece), t in zip(pieces, layout.tensors):
            assert piece.is_contiguous() and piece.numel() == t.nbytes
            assert piece.data_ptr() == views[t.name][e].data_ptr()  # expert e's slice of the fused tensor
    rec = store.record(0, 3)
    assert rec.dtype == torch.uint8 and rec.numel() == store.record_bytes(0)
    for t in layout.tensors:  # the record puts each tensor where its layout says
        assert torch.equal(rec[t.offset : t.offset + t.nbytes].view(t.dtype).view(t.shape), views[t.name][3])


def test_experts_beyond_host_budget_are_served_from_disk(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("mixtral")
    ref = load_reference(path)
    offload = tmp_path / "offload"
    one_layer = None
    probe = MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu"), progress=False)
    one_layer = probe.mira.store.record_bytes(0) * 8
    cfg = MiraConfig(device="cpu", gpu_budget=0.3, host_budget=one_layer, offload_dir=str(offload))
    model = MiraMoEModel.from_pretrained(path, cfg, progress=False)
    assert model.mira.store.tier_bytes() == {"pinned": 0, "pageable": one_layer, "disk": one_layer}
    assert len(os.listdir(offload)) == 1
    with torch.no_grad():
        assert (model(IDS).logits - ref(IDS).logits).abs().max() <= 1e-5
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(IDS, **kw), ref.generate(IDS, **kw))
    other = MiraMoEModel.from_pretrained(path, cfg, progress=False)  # a second model offloading to the same directory
    assert len(os.listdir(offload)) == 2
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, other(IDS).logits)  # neither overwrote the other's experts
    other.unload()
    model.unload()
    assert os.listdir(offload) == []  # each store removes the files it wrote
    dropped = MiraMoEModel.from_pretrained(path, cfg, progress=False)
    assert len(os.listdir(offload)) == 1
    del dropped  # let go of without unload(): its store's files go with it, not left to pile up
    gc.collect()
    assert os.listdir(offload) == []
    with open(offload / "a-file", "w"):
        pass
    with pytest.raises(ConfigError, match="offload_dir=.*a-file.*is a file"):  # before anything is read
        MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", host_budget=one_layer, offload_dir=str(offload / "a-file")))


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_disk_that_fills_up_while_loading_is_a_budget_error_that_leaves_no_file(
    tiny_checkpoint, tmp_path, monkeypatch, quantization
):
    """offload_dir's disk fills up after the load checked it (another program or another load writes there): the
    load raises BudgetError naming offload_dir, the bytes and what to do, and leaves no file there. The blocks of each
    file are reserved before it is written, so a full disk is never a write into a memory mapping past the disk's
    blocks, which ends the process (SIGBUS), nor a bare OSError halfway through the encoded records."""
    real, reserved = os.posix_fallocate, []

    def fallocate(fd, offset, length):  # the first layer's file fits; then the disk is full
        reserved.append(length)
        if len(reserved) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    offload = tmp_path / "offload"
    cfg = MiraConfig(device="cpu", quantization=quantization, host_budget=1000, offload_dir=str(offload))
    with pytest.raises(BudgetError, match=r"MoE layer 1's experts need .* in offload_dir=.* Free space") as info:
        MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), cfg, progress=False)
    assert len(reserved) == 2 and f"need {reserved[1]:,} bytes in offload_dir={str(offload)!r}" in str(info.value)
    assert os.listdir(offload) == []  # the first layer's file too


def test_the_files_of_a_killed_load_are_removed_by_the_next_load(tiny_checkpoint, tmp_path, monkeypatch):
    """A process killed while it holds a disk tier (kill -9, the OOM killer) cannot remove its files: the next load
    offloading to the directory removes them (named after the pid of a process no longer running) before it counts
    the free space, so it is not refused for the room they took. Files of a running load, and files that are no
    disk tier's, stay."""
    import mira_hf.offload_files

    path, offload = tiny_checkpoint("mixtral"), tmp_path / "offload"
    cfg = MiraConfig(device="cpu", host_budget=1000, offload_dir=str(offload))  # every layer on disk
    script = textwrap.dedent(f"""
        import os, signal
        from mira_hf import MiraConfig, MiraMoEModel
        model = MiraMoEModel.from_pretrained({str(path)!r}, MiraConfig(device="cpu", host_budget=1000, offload_dir={str(offload)!r}), progress=False)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert subprocess.run([sys.executable, "-c", script], capture_output=True).returncode == -signal.SIGKILL
    killed = sorted(os.listdir(offload))
    assert len(killed) == 2  # one file per layer, left behind
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        alive = re.sub(r"-\d+_layer", f"-{running.pid}_layer", killed[0])  # as the running process would name it
        others = [alive, "mira_experts_layer0000_abcd1234.bin", "notes.bin"]
        for name in others:
            (offload / name).write_bytes(b"\0" * 1000)
        # a disk with room for one load beside the files the user keeps: not beside the killed load's files too
        need = sum(os.path.getsize(offload / name) for name in killed)
        disk = lambda p: shutil._ntuple_diskusage(10**9, 0, need + 3000 - sum(f.stat().st_size for f in offload.iterdir()))  # noqa: E731
        monkeypatch.setattr(mira_hf.offload_files.shutil, "disk_usage", disk)
        model = MiraMoEModel.from_pretrained(path, cfg, progress=False)
        assert model.mira.store.tier_bytes()["disk"] == need
        assert set(others) <= set(os.listdir(offload)) and not set(killed) & set(os.listdir(offload))
        model.unload()
        assert sorted(os.listdir(offload)) == sorted(others)
    finally:
        running.kill()
        running.wait()


def test_a_relative_offload_dir_is_the_directory_it_named_when_the_model_was_loaded(tiny_checkpoint, tmp_path, monkeypatch):
    """offload_dir="offload" names a directory of the working directory at load: a cast after an os.chdir (a
    notebook, a server changing directory) writes its new files there too, and unload() removes them from there."""
    path, first, later = tiny_checkpoint("mixtral"), tmp_path / "first", tmp_path / "later"
    first.mkdir()
    later.mkdir()
    monkeypatch.chdir(first)
    model = MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", host_budget=1000, offload_dir="offload"), progress=False)
    assert len(os.listdir(first / "offload")) == 2
    monkeypatch.chdir(later)
    model.bfloat16()  # every layer written again, in a file of its own
    assert len(os.listdir(first / "offload")) == 2 and not (later / "offload").exists()
    model.unload()
    assert os.listdir(first / "offload") == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")
@pytest.mark.parametrize("child", ["drops the model", "closes its store"])
def test_a_forked_child_leaves_its_parents_offloaded_experts_alone(tiny_checkpoint, tmp_path, child):
    """A child forked after the load (a DataLoader worker, multiprocessing's fork start method) that lets its copy of
    the model go (as it does when it exits), or closes its store (as `unload()` does), leaves the parent's files in
    `offload_dir`: only the process that wrote them removes them, and the parent keeps serving its experts from them."""
    path = tiny_checkpoint("mixtral")
    ref = load_reference(path)
    offload = tmp_path / "offload"
    probe = MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu"), progress=False)
    one_layer = probe.mira.store.record_bytes(0) * 8
    cfg = MiraConfig(device="cpu", gpu_budget=0.3, host_budget=one_layer, offload_dir=str(offload))
    model = MiraMoEModel.from_pretrained(path, cfg, progress=False)
    files = sorted(os.listdir(offload))
    assert len(files) == 1
    with torch_threads(1):  # torch's CPU thread pool does not survive a fork; one thread uses none
        pid = os.fork()
    if pid == 0:  # the child
        try:
            signal.alarm(60)  # a child that hangs is ended (SIGALRM), not the test run
            if child == "closes its store":
                model.mira.store.close()
            del model
            gc.collect()
        finally:
            os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert sorted(os.listdir(offload)) == files
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(IDS, **kw), ref.generate(IDS, **kw))
    model.unload()
    assert os.listdir(offload) == []  # the parent's own unload still removes them


def _anonymous_bytes_of_mappings(path: str) -> list[int]:
    """The 'Anonymous:' bytes of each of this process's mappings of the file `path` (/proc/self/smaps): pages of the
    file copied into RAM, as a write into a private mapping makes them."""
    out = []
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header: range perms offset dev inode path
                inside = len(fields) >= 6 and fields[5] == path
                out += [0] if inside else []
            elif inside and fields[0] == "Anonymous:":
                out[-1] += int(fields[1]) * 1024
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
@pytest.mark.parametrize("quantization, change", [(None, "load_state_dict"), ("int8", "load_state_dict"), (None, "in place")])
def test_experts_written_over_on_the_disk_tier_stay_in_their_file(tiny_checkpoint, tmp_path, quantization, change):
    """A disk-tier layer whose records are written over in place (`load_state_dict`, an edit of the expert parameters)
    keeps them in its file: the file holds the records served, and no page of it is copied into RAM beyond
    host_budget."""
    path = tiny_checkpoint("mixtral")
    probe = MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", quantization=quantization), progress=False)
    one_layer = probe.mira.store.record_bytes(0) * probe.mira.store.num_experts(0)
    probe.unload()
    cfg = dict(device="cpu", gpu_budget=0.5, quantization=quantization)
    model = MiraMoEModel.from_pretrained(
        path, MiraConfig(**cfg, host_budget=one_layer, offload_dir=str(tmp_path)), progress=False
    ).eval()
    store = model.mira.store
    (layer,) = [li for li in store.layers if store.tier(li) == "disk"]
    (file,) = [str(tmp_path / f) for f in os.listdir(tmp_path)]
    expected = load_reference(path)
    with torch.no_grad():
        model(IDS)  # experts in the cache
        if change == "load_state_dict":
            new = {k: v * 0.5 if ".experts." in k else v for k, v in model.state_dict().items()}
            model.load_state_dict(new)
            expected.load_state_dict(new)
        else:
            for m in (model, expected):
                m.model.layers[layer].mlp.experts.down_proj[:, 0].mul_(0.5)
        got = model(IDS).logits
        if quantization is None:
            assert torch.equal(got, expected(IDS).logits)
        want = MiraMoEModel.wrap(expected, MiraConfig(**cfg))  # the new weights stored in host memory
        assert torch.equal(got, want(IDS).logits)
    assert store.tier_bytes()["disk"] == one_layer and os.listdir(tmp_path) == [os.path.basename(file)]
    with open(file, "rb") as f:
        assert torch.equal(torch.frombuffer(bytearray(f.read()), dtype=torch.uint8), want.mira.store.slabs()[layer].view(-1))
    mappings = _anonymous_bytes_of_mappings(file)
    assert mappings and sum(mappings) == 0, mappings


def test_peak_host_memory_while_loading_is_bounded(tmp_path):
    """Loading keeps the process's peak anonymous memory ≤ 1.3 × the checkpoint size above its baseline
    (the expert arena, which on CPU is host memory by design, is counted apart). Measured in a fresh
    process by polling RssAnon: file pages of the memory-mapped checkpoint are cache, not memory held.
    Each layer's fused expert tensors are 32-64 MiB, as a real checkpoint's are (hundreds of MiB): above
    glibc's largest mmap threshold (32 MiB), so freeing them returns their pages at once. Tensors of a few
    MiB come from malloc's heap, which keeps freed chunks depending on its threads' timing, and the peak
    would measure the allocator rather than the load."""
    script = textwrap.dedent(f"""
        import torch
        from transformers import MixtralConfig, MixtralForCausalLM
        cfg = MixtralConfig(vocab_size=256, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
        MixtralForCausalLM(cfg).to(torch.bfloat16).save_pretrained({str(tmp_path)!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
    size = sum(os.path.getsize(tmp_path / f) for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    measure = PEAK_ANON_SOURCE + textwrap.dedent(f"""
        import json
        import mira_hf
        from transformers.models.mixtral import modeling_mixtral  # imported before the baseline
        peak = PeakAnon()
        m = mira_hf.MiraMoEModel.from_pretrained({str(tmp_path)!r}, mira_hf.MiraConfig(device="cpu", gpu_budget=0.25), progress=False)
        growth = peak.stop()
        print(json.dumps(dict(growth=growth, arena=m.mira.cache.capacity_bytes)))
    """)
    out = subprocess.run([sys.executable, "-c", measure], check=True, capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["growth"] - r["arena"] <= 1.3 * size, (r, size)


@pytest.mark.parametrize("codec", ["identity", "lossless"])
def test_a_layer_decoded_by_the_encoder_is_its_experts_in_tensors_of_their_own(codec):
    """`RecordEncoder.decode_layer` on the host: every expert's tensors, bit for bit, in new tensors from the given
    allocator, whether the codec writes into given tensors (lossless) or gives views of the record (none)."""
    from mira_hf.encode import RecordEncoder
    from mira_hf.layout import IdentityCodec
    from mira_hf.quant import LosslessCodec

    g = torch.Generator().manual_seed(0)
    fused = {"up": torch.randn(3, 8, 16, generator=g).bfloat16(), "down": torch.randn(3, 16, 4, generator=g).bfloat16()}
    c = IdentityCodec() if codec == "identity" else LosslessCodec()
    layout = (
        c.plan({n: (tuple(t.shape[1:]), t.dtype) for n, t in fused.items()}) if codec == "identity" else c.plan_experts(fused)
    )
    records = torch.empty(3, layout.nbytes, dtype=torch.uint8)
    for e in range(3):
        c.encode({n: t[e] for n, t in fused.items()}, layout, records[e])
    made = []
    out = RecordEncoder("cpu").decode_layer(
        c, records, layout, torch.bfloat16, lambda *a, **k: made.append(1) or torch.empty(*a, **k)
    )
    assert out.keys() == fused.keys() and len(made) == 2
    assert all(torch.equal(out[n].view(torch.int16), t.view(torch.int16)) for n, t in fused.items())
    records.zero_()  # tensors of their own: the records can go
    assert all(torch.equal(out[n], t) for n, t in fused.items())
