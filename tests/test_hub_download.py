"""Loading a hub id that is not in the local cache: the shards are downloaded (several at once, in the
index's order) from a repository served over HTTP on localhost as the hub serves it, the load is the
same model, revision and offline mode behave as in transformers, and a failed shard is a clear error."""

import json
import os
import threading

import pytest
import torch
from fake_hub import FakeHub
from tiny_models import make_config

from mira_hf import CheckpointError, MiraConfig, MiraMoEModel
from mira_hf.config import LoaderConfig

REPO = "mira/tiny-sharded"
IDS = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny Mixtral saved in several shards, and its logits on IDS."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config("mixtral")).eval()
    path = tmp_path_factory.mktemp("tiny-sharded")
    model.save_pretrained(path, max_shard_size="40KB")
    with torch.no_grad():
        return str(path), model(IDS).logits


@pytest.fixture
def hub(sharded, monkeypatch):
    """The checkpoint served as `REPO` (revisions main and v1), huggingface_hub pointed at it and online."""
    from huggingface_hub import constants

    with FakeHub(REPO, sharded[0], revisions=("main", "v1")) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield hub


def _load(cache_dir, **kw):
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=LoaderConfig(stream_experts=True))
    return MiraMoEModel.from_pretrained(REPO, cfg, progress=False, cache_dir=str(cache_dir), **kw).eval()


def _shards(hub: FakeHub) -> list[str]:
    return [f for f in hub.served if f.endswith(".safetensors")]


def _reloads_offline_from_the_cache(hub, sharded, tmp_path, monkeypatch):
    """Offline, a second load finds everything in the cache, asks the server for nothing and computes the same."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    asked = len(hub.requests)
    again = _load(tmp_path)
    assert len(hub.requests) == asked
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, sharded[1])


def test_hub_id_downloads_its_shards_and_loads_the_same_model(hub, sharded, tmp_path, monkeypatch):

    model = _load(tmp_path)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, sharded[1])
    shards = _shards(hub)
    assert len(shards) > 2 and len(set(shards)) == len(shards)  # every shard once: transformers downloads none again
    assert model.mira_load_report().as_dict()["stages"]["download"]["seconds"] > 0
    _reloads_offline_from_the_cache(hub, sharded, tmp_path, monkeypatch)


def test_experts_are_stored_while_later_shards_download(hub, sharded, tmp_path, monkeypatch):
    """The last shard is held back on the server until the first layer's experts are in the store: the load
    gets there only by storing experts from the shards that have arrived while later ones still download.
    Then the other weights load from the cache (each shard downloaded once), the model computes what the
    original computes, and a second load offline finds every shard in the cache."""

    from mira_hf.store import ExpertStore

    with open(os.path.join(sharded[0], "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    last = max(weight_map.values())
    assert not any(k.startswith("model.layers.0.mlp.experts") for k, shard in weight_map.items() if shard == last)
    stored = threading.Event()
    add_layer_from = ExpertStore.add_layer_from

    def add_layer_and_tell(self, layer, *args, **kwargs):
        add_layer_from(self, layer, *args, **kwargs)
        stored.set()

    monkeypatch.setattr(ExpertStore, "add_layer_from", add_layer_and_tell)
    hub.hold.add(last)
    hub.release, hub.hold_s = stored, 10.0
    model = _load(tmp_path)
    assert hub.released == {last: True}  # held until experts were stored, not until the wait ran out
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, sharded[1])
    shards = _shards(hub)
    assert sorted(shards) == sorted(set(weight_map.values()))  # each shard once
    _reloads_offline_from_the_cache(hub, sharded, tmp_path, monkeypatch)


def test_revision_is_honoured(hub, sharded, tmp_path):
    model = _load(tmp_path, revision="v1")
    resolved = [path.split("/")[4] for method, path in hub.requests if "/resolve/" in path]
    assert "v1" in resolved and set(resolved) <= {"v1", hub.commit}  # the branch, then the commit it points to
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, sharded[1])
    with pytest.raises(CheckpointError, match="revision"):
        _load(tmp_path, revision="no-such-branch")


def test_a_shard_that_fails_to_download_is_a_clear_error(hub, tmp_path):
    hub.fail.add("model-00003-of-00012.safetensors")
    with pytest.raises(CheckpointError, match=r"downloading shard model-00003-of-00012\.safetensors failed"):
        _load(tmp_path)


@pytest.mark.parametrize("stream_experts", [True, None], ids=["streamed", "auto"])
def test_force_download_downloads_each_file_again_once(hub, sharded, tmp_path, stream_experts):
    """`force_download=True`, as in transformers: the files already in the cache (here a damaged shard) are
    downloaded again, each once per load (not again by transformers' part of the load), and the load is the model."""
    _load(tmp_path)
    shard = "model-00003-of-00012.safetensors"
    (blob,) = {os.path.realpath(p) for p in tmp_path.glob(f"models--*/snapshots/*/{shard}")}
    with open(blob, "r+b") as f:
        f.truncate(os.path.getsize(blob) // 2)
    (stale,) = {os.path.realpath(p) for p in tmp_path.glob("models--*/snapshots/*/generation_config.json")}
    with open(stale, "w") as f:  # not the repository's: read by transformers' part of the load
        json.dump({"max_new_tokens": 3}, f)
    hub.served.clear()
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=LoaderConfig(stream_experts=stream_experts))
    model = MiraMoEModel.from_pretrained(REPO, cfg, progress=False, cache_dir=str(tmp_path), force_download=True)
    with open(os.path.join(sharded[0], "model.safetensors.index.json")) as f:
        assert sorted(_shards(hub)) == sorted(set(json.load(f)["weight_map"].values()))
    with torch.no_grad():
        assert torch.equal(model.eval()(IDS).logits, sharded[1])
    with open(os.path.join(sharded[0], "generation_config.json")) as f:
        assert model.generation_config.max_new_tokens == json.load(f).get("max_new_tokens") != 3


def test_local_files_only_with_a_shard_not_in_the_cache_says_it_is_missing(hub, sharded, tmp_path):
    _load(tmp_path)  # everything in the cache
    shard = "model-00003-of-00012.safetensors"
    for link in tmp_path.glob(f"models--*/snapshots/*/{shard}"):
        link.unlink()
    asked = len(hub.requests)
    with pytest.raises(CheckpointError, match=rf"shard {shard} listed in model.safetensors.index.json is missing"):
        _load(tmp_path, local_files_only=True)
    assert len(hub.requests) == asked


def test_a_repository_holding_one_file_and_an_index_streams_the_file_transformers_reads(sharded, tmp_path, monkeypatch):
    """A repository that holds `model.safetensors` beside a sharded index (other weights in each): transformers reads
    the single file, and so does a streamed load of its hub id, experts included; the index is never asked for."""
    import shutil

    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM

    repo = tmp_path / "repo"
    shutil.copytree(sharded[0], repo)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(make_config("mixtral")).save_pretrained(tmp_path / "other")
    shutil.copy(tmp_path / "other" / "model.safetensors", repo / "model.safetensors")
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(tmp_path / "other").eval()(IDS).logits
    with FakeHub(REPO, str(repo)) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        model = _load(tmp_path / "cache")
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, expected)
        assert not any("index" in path for _, path in hub.requests)


def test_a_missing_subfolder_is_named_with_the_folders_that_hold_a_checkpoint(tmp_path, monkeypatch):
    """subfolder= naming a folder that a local checkpoint, or the cached snapshot of a hub id, lacks is a
    CheckpointError naming it and where a config.json is, not a revision missing from the cache (whose download
    would not help) nor transformers' complaint about a config without model_type."""
    import shutil

    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    src = tmp_path / "src"
    AutoModelForCausalLM.from_config(make_config("mixtral")).save_pretrained(src)
    shutil.copytree(src, src / "sub")
    repo = tmp_path / "hub" / "models--org--tiny-moe"
    shutil.copytree(src, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for name, kw in [("org/tiny-moe", dict(cache_dir=str(tmp_path / "hub"))), (str(src), {})]:
        with pytest.raises(CheckpointError) as info:
            MiraMoEModel.from_pretrained(name, MiraConfig(device="cpu"), progress=False, subfolder="nope", **kw)
        message = str(info.value)
        assert "no subfolder 'nope'" in message and "config.json at its top, 'sub'" in message, message
        assert "is not in" not in message and "\n" not in message
    kw = dict(subfolder="sub", cache_dir=str(tmp_path / "hub"))
    assert MiraMoEModel.from_pretrained("org/tiny-moe", MiraConfig(device="cpu"), progress=False, **kw).mira is not None


# A model whose code ships with its checkpoint (its own config and causal-LM classes, Mixtral's underneath).
_REMOTE_CODE = """
from transformers import MixtralConfig, MixtralForCausalLM


class RemoteMoeConfig(MixtralConfig):
    model_type = "remote_moe"


class RemoteMoeForCausalLM(MixtralForCausalLM):
    config_class = RemoteMoeConfig
"""


@pytest.mark.parametrize("stream_experts", [None, False], ids=["auto", "whole"])
def test_force_download_downloads_a_checkpoints_own_code_again(tmp_path, monkeypatch, stream_experts):
    """`force_download=True` with `trust_remote_code=True`: the code files the checkpoint ships (config.json's
    auto_map) are downloaded again too, as transformers' own load downloads them, so a damaged cached copy is
    replaced before the classes are built."""
    from huggingface_hub import constants
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(make_config("mixtral")).eval()
    repo = tmp_path / "repo"
    repo.mkdir()
    save_file(
        {k: v.contiguous() for k, v in original.state_dict().items()}, repo / "model.safetensors", metadata={"format": "pt"}
    )
    (repo / "remote_moe.py").write_text(_REMOTE_CODE)
    cfg = original.config.to_dict()
    cfg.update(model_type="remote_moe", architectures=["RemoteMoeForCausalLM"],
               auto_map={"AutoConfig": "remote_moe.RemoteMoeConfig", "AutoModelForCausalLM": "remote_moe.RemoteMoeForCausalLM"})  # fmt: skip
    (repo / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr("transformers.dynamic_module_utils.HF_MODULES_CACHE", str(tmp_path / "modules"))
    remote = "mira/tiny-remote-code"
    with FakeHub(remote, str(repo)) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        mira = MiraConfig(device="cpu", gpu_budget=0.5, loader=LoaderConfig(stream_experts=stream_experts))
        kw = dict(progress=False, cache_dir=str(tmp_path / "cache"), trust_remote_code=True)
        MiraMoEModel.from_pretrained(remote, mira, **kw)
        (blob,) = {os.path.realpath(p) for p in (tmp_path / "cache").glob("models--*/snapshots/*/remote_moe.py")}
        with open(blob, "w") as f:  # damaged: not the repository's
            f.write("raise ImportError('a damaged copy')\n")
        hub.served.clear()
        model = MiraMoEModel.from_pretrained(remote, mira, force_download=True, **kw)
    assert "remote_moe.py" in hub.served  # (transformers, loading the whole model, downloads it for each class)
    assert type(model).__name__ == "RemoteMoeForCausalLM"
    with torch.no_grad():
        assert torch.equal(model.eval()(IDS).logits, original(IDS).logits)
