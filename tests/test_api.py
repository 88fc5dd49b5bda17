"""The public API: wrap / unload / save round-trips, idempotence, and clear errors before any change."""

import dataclasses
import json
import os
from collections import namedtuple

import numpy as np
import pytest
import torch
from conftest import PEAK_ANON_SOURCE, align_experts, load_reference, run_measuring
from tiny_models import build, make_config
from transformers import AutoModelForCausalLM

from mira_hf import (
    BudgetError,
    CheckpointError,
    ConfigError,
    DeviceError,
    MiraConfig,
    MiraError,
    MiraMoEModel,
    UnsupportedModelError,
    UnsupportedOperationError,
)
from mira_hf.config import LoaderConfig, QuantConfig
from mira_hf.proxy import MiraExperts

IDS = torch.tensor([[4, 8, 15, 16, 23, 42], [1, 2, 3, 5, 8, 13]])
_Usage = namedtuple("_Usage", "free")  # shutil.disk_usage's answer, as offload_files reads it


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def test_wrap_unload_round_trip(tiny_checkpoint):
    model = load_reference(tiny_checkpoint("qwen3_moe"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    expected = _logits(model)
    MiraMoEModel.wrap(model, MiraConfig(gpu_budget=0.5, device="cpu"))
    assert any(isinstance(m, MiraExperts) for m in model.modules())
    assert torch.equal(_logits(model), expected)
    back = model.unload()
    assert back is model and not hasattr(model, "mira")
    assert not any(isinstance(m, MiraExperts) for m in model.modules())
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(_logits(model), expected)


def test_wrap_twice_does_not_double_wrap(tiny_checkpoint):
    model = load_reference(tiny_checkpoint("mixtral"))
    cfg = MiraConfig(gpu_budget=0.5, device="cpu")
    MiraMoEModel.wrap(model, cfg)
    manager = model.mira
    assert MiraMoEModel.wrap(model, cfg) is model
    assert model.mira is manager
    proxies = [m for m in model.modules() if isinstance(m, MiraExperts)]
    assert len(proxies) == 2 and not any(isinstance(p.base, MiraExperts) for p in proxies)
    with pytest.raises(ConfigError, match="already wrapped"):
        MiraMoEModel.wrap(model, MiraConfig(gpu_budget=1.0, device="cpu"))


def test_wrap_again_naming_the_device_it_chose_returns_the_model(tiny_checkpoint):
    """Wrapped without a device (mira-hf chose one), then wrapped again naming that device: the same settings, so the
    model comes back unchanged, as docs/usage.md says."""
    model = load_reference(tiny_checkpoint("mixtral"))
    MiraMoEModel.wrap(model, gpu_budget=0.5)
    manager, device = model.mira, model.mira.device
    assert MiraMoEModel.wrap(model, gpu_budget=0.5, device=str(device)) is model
    assert MiraMoEModel.wrap(model, gpu_budget=0.5, device=device) is model and model.mira is manager
    with pytest.raises(ConfigError, match="already wrapped"):
        MiraMoEModel.wrap(model, gpu_budget=0.25, device=str(device))


def test_save_pretrained_writes_an_ordinary_checkpoint(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("mixtral")
    ref = load_reference(path)
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=0.3, device="cpu"), progress=False)
    model.save_pretrained(tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert torch.equal(_logits(reloaded), _logits(ref))
    assert not any(isinstance(m, MiraExperts) for m in reloaded.modules())


@pytest.mark.parametrize("name", ["mixtral", "jetmoe"])
def test_save_pretrained_writes_a_state_dict_given_as_given(name, tiny_checkpoint, tmp_path):
    """`save_pretrained(d, state_dict=...)`, as accelerate and custom saves call it: the model's own state dict
    writes the checkpoint transformers writes from the unwrapped model's; an edited expert tensor is written as
    edited and a key left out is left out, as transformers writes a given state dict."""
    from safetensors.torch import load_file

    path = tiny_checkpoint(name)
    ref = load_reference(path)
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=0.3, device="cpu"), progress=False)
    model.save_pretrained(tmp_path / "own", state_dict=model.state_dict())
    ref.save_pretrained(tmp_path / "ref")
    own, expected = load_file(tmp_path / "own" / "model.safetensors"), load_file(tmp_path / "ref" / "model.safetensors")
    assert own.keys() == expected.keys() and all(torch.equal(own[k], expected[k]) for k in expected)
    state = model.state_dict()
    expert = next(k for k in state if ".experts." in k and state[k].dim() == 3)  # a fused experts tensor
    state[expert] = state[expert] * 2
    dropped = next(k for k in state if k.endswith("norm.weight"))
    del state[dropped]
    model.save_pretrained(tmp_path / "edited", state_dict=state)
    edited, info = AutoModelForCausalLM.from_pretrained(tmp_path / "edited", output_loading_info=True)
    assert torch.equal(edited.state_dict()[expert], state[expert]) and set(info["missing_keys"]) == {dropped}


_SAVE = (
    PEAK_ANON_SOURCE
    + """
import json, os, torch, mira_hf, mira_hf.unload
from transformers import AutoModelForCausalLM
if WRAP:
    cfg = mira_hf.MiraConfig(device="cpu", gpu_budget=0.3, quantization=QUANT)
    m = mira_hf.MiraMoEModel.from_pretrained(PATH, cfg, progress=False)
    if SPILL:
        mira_hf.unload.available_host_bytes = lambda: 2**20  # the decoded experts cannot stay in host memory
else:
    m = AutoModelForCausalLM.from_pretrained(PATH)
peak = PeakAnon()
m.save_pretrained(OUT)
print(json.dumps(dict(growth=peak.stop(), files=sorted(os.listdir(OUT)))))
"""
)


def test_save_pretrained_takes_no_more_host_memory_than_the_unwrapped_models_save(tmp_path):
    """The peak growth of anonymous host memory while `save_pretrained` writes (each in a process of its own, as in
    test_stream_load.py): an uncompressed store's experts are written from the store itself, as the unwrapped model's
    from its parameters; encoded ones are decoded once, into host memory, or, where host memory cannot hold them,
    into a buffer mapped from an unlinked file. Each writes the unwrapped model's checkpoint, and nothing else."""
    from safetensors.torch import load_file

    config = make_config("mixtral", hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_local_experts=16)
    torch.manual_seed(0)
    src = tmp_path / "src"
    build(config).to(torch.bfloat16).save_pretrained(src)
    experts = sum(t.numel() * t.element_size() for k, t in load_file(src / "model.safetensors").items() if ".experts." in k)
    assert experts > 90 * 2**20  # far above what a process's allocations move by themselves

    def save(name: str, wrap: bool, quant=None, spill=False) -> float:
        code = _SAVE.replace("WRAP", str(wrap)).replace("QUANT", repr(quant)).replace("SPILL", str(spill))
        code = code.replace("PATH", repr(str(src))).replace("OUT", repr(str(tmp_path / name)))
        result = run_measuring(code)
        assert result["files"] == ["config.json", "generation_config.json", "model.safetensors"]
        return result["growth"] / experts

    plain = save("plain", wrap=False)
    assert save("raw", wrap=True) <= plain + 0.25  # the store's own bytes (a copy of each layer: plain + 1.0)
    assert save("lossless", wrap=True, quant="lossless") <= plain + 1.4  # decoded once (twice: plain + 2.4)
    assert save("spilled", wrap=True, quant="lossless", spill=True) <= plain + 0.3
    expected = load_file(tmp_path / "plain" / "model.safetensors")
    for name in ("raw", "lossless", "spilled"):
        written = load_file(tmp_path / name / "model.safetensors")
        assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)


_UNLOAD = (
    PEAK_ANON_SOURCE
    + """
import json, torch, mira_hf
cfg = mira_hf.MiraConfig(device="cpu", gpu_budget=0.3, quantization=None)
m = mira_hf.MiraMoEModel.from_pretrained(PATH, cfg, progress=False)
peak = PeakAnon()
m.unload()
print(json.dumps(dict(growth=peak.stop())))
"""
)


def test_unload_holds_one_layer_twice_at_most(tmp_path):
    """`unload()` gives the model its experts layer by layer and frees each layer's records once the model holds them:
    with uncompressed records in host memory, the process's anonymous memory grows by about one layer of experts at
    most (here one of 4), not by all of them."""
    config = make_config("mixtral", hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_local_experts=16)
    torch.manual_seed(0)
    build(config).to(torch.bfloat16).save_pretrained(tmp_path)
    experts = 4 * 16 * 3 * 256 * 1024 * 2
    code = _UNLOAD.replace("PATH", repr(str(tmp_path)))
    assert run_measuring(code)["growth"] <= 0.5 * experts  # every layer's copy beside the store: 1.0


def test_save_pretrained_refuses_a_buffer_the_disk_has_no_room_for_before_writing(tiny_checkpoint, tmp_path, monkeypatch):
    import mira_hf.offload_files as offload_files
    import mira_hf.unload as unload_module

    path = tiny_checkpoint("mixtral")
    ref = load_reference(path)
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=0.3, device="cpu", quantization="lossless"), progress=False)
    monkeypatch.setattr(unload_module, "available_host_bytes", lambda: 1024)  # the decoded experts cannot stay in memory
    monkeypatch.setattr(offload_files.shutil, "disk_usage", lambda p: _Usage(0))  # a full disk
    out = tmp_path / "out"
    with pytest.raises(
        BudgetError,
        match=r"save_pretrained\(\) decodes the experts into a file in save_directory='.*out' first, as host memory cannot hold "
        r"them beside the store: they take [\d,]+ bytes there, and the checkpoint about [\d,]+ more, but only 0 bytes are "
        r"free\. Nothing was written\. Free space on that disk, free host memory \(the decoded experts take [\d,]+ bytes; "
        r"1,024 are available\), or load the model with offload_dir",
    ):
        model.save_pretrained(out)
    assert not out.exists()
    assert torch.equal(_logits(model), _logits(ref))
    monkeypatch.undo()
    model.save_pretrained(out)
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(out).eval()), _logits(ref))


@pytest.mark.parametrize("quantization", [None, "lossless"], ids=["uncompressed", "lossless"])
def test_save_pretrained_runs_the_models_state_dict_hooks_as_transformers_does(tiny_checkpoint, tmp_path, quantization):
    """A state-dict hook on the model (one that reads every value, as a checksum a framework logs, and changes them)
    sees the experts' values and its changes are written, as in the unwrapped model's save."""
    from safetensors.torch import load_file

    def checksum_and_cast(module, state, prefix, local_metadata):
        module.checksum = sum(float(v.double().sum()) for v in state.values())
        for k in state:
            state[k] = state[k].to(torch.bfloat16)

    path = tiny_checkpoint("mixtral")
    ref = load_reference(path)
    model = MiraMoEModel.from_pretrained(
        path, MiraConfig(gpu_budget=0.3, device="cpu", quantization=quantization), progress=False
    )
    for m, name in ((ref, "ref"), (model, "own")):
        m.register_state_dict_post_hook(checksum_and_cast)
        m.save_pretrained(tmp_path / name)
    assert model.checksum == ref.checksum
    own, expected = load_file(tmp_path / "own" / "model.safetensors"), load_file(tmp_path / "ref" / "model.safetensors")
    assert own.keys() == expected.keys() and all(torch.equal(own[k], expected[k]) for k in expected)
    assert {t.dtype for t in own.values()} == {torch.bfloat16}


def test_from_pretrained_honours_dtype(tiny_checkpoint):
    model = MiraMoEModel.from_pretrained(tiny_checkpoint("olmoe"), MiraConfig(device="cpu"), dtype=torch.bfloat16, progress=False)
    assert model.dtype == torch.bfloat16 and model.mira.store.dtype(0) == torch.bfloat16
    assert model(IDS).logits.dtype == torch.bfloat16


def test_model_behaves_like_automodel(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    model = MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu"), progress=False)
    ref = load_reference(path)
    assert type(model) is type(ref)
    assert model.device == torch.device("cpu")
    assert model.config.model_type == "mixtral" and model.generation_config is not None


def test_router_logits_and_aux_loss_still_work(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    ref = load_reference(path)
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=0.3, device="cpu"), progress=False)
    kw = dict(output_router_logits=True, labels=IDS)
    with torch.no_grad():
        a, b = ref(IDS, **kw), model(IDS, **kw)
    assert len(b.router_logits) == len(a.router_logits) == 2
    assert torch.allclose(a.aux_loss, b.aux_loss, atol=1e-6) and torch.allclose(a.loss, b.loss, atol=1e-5)


def test_stats_have_the_documented_keys(tiny_checkpoint):
    cfg = MiraConfig(gpu_budget=0.3, device="cpu", policy="lru", predictor=None)  # demand loads only
    model = MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), cfg, progress=False)
    _logits(model)
    s = model.mira.stats()
    for key in ("hits", "misses", "hit_rate", "loads", "evictions", "bytes_h2d", "stall_s", "per_layer"):
        assert key in s
    assert set(s["per_layer"]) == {0, 1}
    assert s["loads"] == s["misses"] and s["bytes_h2d"] == s["loads"] * model.mira.store.record_bytes(0)
    json.dumps(s)  # plain data
    model.mira.reset_stats()
    assert model.mira.stats()["loads"] == 0


# -- bad input: an error that says what to do, raised before anything changes -----------------------
def test_unknown_architecture_is_refused_before_loading(tmp_path):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(
        UnsupportedModelError,
        match="'llama' has no mira-hf adapter, and transformers' code for it builds no experts.*mixtral.*expert_layer_path",
    ):
        MiraMoEModel.from_pretrained(tmp_path, MiraConfig(device="cpu"), progress=False)


def test_experts_kept_as_one_module_each_without_an_adapter_are_refused_with_what_to_do(tmp_path):
    """NLLB-MoE builds each expert as a module of its own (an nn.ModuleDict), called in a way no adapter describes:
    a load from a checkpoint and a wrap are refused before anything changes, with the layout named, the adapter
    layout that serves such experts, and transformers' offloading offered instead."""
    import transformers

    cfg = transformers.NllbMoeConfig(
        vocab_size=64, encoder_layers=2, decoder_layers=2, num_experts=4, d_model=32, encoder_ffn_dim=32,
        decoder_ffn_dim=32, encoder_attention_heads=2,
    )  # fmt: skip
    model = transformers.AutoModelForSeq2SeqLM.from_config(cfg)
    model.save_pretrained(tmp_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    match = "'nllb-moe' keeps each expert as a module of its own.*nn.ModuleDict.*ExpertModules.*device_map='auto'"
    with pytest.raises(UnsupportedModelError, match=match):
        MiraMoEModel.from_pretrained(tmp_path, MiraConfig(device="cpu"), progress=False)
    with pytest.raises(UnsupportedModelError, match=match):
        MiraMoEModel.wrap(model, MiraConfig(device="cpu"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files


def test_dense_model_via_generic_path_is_refused(tmp_path):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    model = AutoModelForCausalLM.from_config(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match="no routed-experts module matches"):
        MiraMoEModel.wrap(model, MiraConfig(device="cpu", expert_layer_path="model.layers.*.mlp.experts"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_generic_expert_layer_path_serves_an_unregistered_model(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    ref = load_reference(path)
    cfg = MiraConfig(gpu_budget=0.3, device="cpu", expert_layer_path="model.layers.*.mlp.experts")
    model = MiraMoEModel.from_pretrained(path, cfg, progress=False)
    assert torch.equal(_logits(model), _logits(ref))


def test_budget_below_minimum_is_refused_and_model_untouched(tiny_checkpoint):
    model = load_reference(tiny_checkpoint("mixtral"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(BudgetError, match="below the minimum working set.*at least"):
        MiraMoEModel.wrap(model, MiraConfig(gpu_budget="10KB", device="cpu"))
    assert not hasattr(model, "mira")
    assert before.keys() == model.state_dict().keys()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_budget_above_free_device_memory_is_refused_and_model_untouched(tiny_checkpoint, monkeypatch):
    """On a GPU with less free memory than the arena plus the weights that move there: a BudgetError
    naming both numbers, before anything changes (a CUDA device is simulated, with 1,000 bytes free)."""
    import mira_hf.model as mira_model

    model = load_reference(tiny_checkpoint("mixtral"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(mira_model, "_resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 80 * 10**9))
    with pytest.raises(BudgetError, match=r"need [\d,]+ bytes, but only 1,000 are free.*Lower MiraConfig\(gpu_budget"):
        MiraMoEModel.wrap(model, MiraConfig(gpu_budget=1.0, device="cuda"))
    assert not hasattr(model, "mira")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _store_layer_bytes(path, **cfg):
    probe = MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", **cfg), progress=False)
    store = probe.mira.store
    return [store.record_bytes(layer) * store.num_experts(layer) for layer in store.layers]


def test_store_larger_than_host_memory_is_refused_and_model_untouched(tiny_checkpoint, monkeypatch):
    """Experts in host memory with an exact format move into the store one layer at a time: only one
    layer must be free. A lossy format keeps the originals until the end, and a streamed load or a model
    on the GPU brings all of it: then the whole store must fit. Refused before anything changes."""
    import mira_hf.resources as resources

    path = tiny_checkpoint("mixtral")
    layers = _store_layer_bytes(path)
    int4_total = sum(_store_layer_bytes(path, quantization="int4"))
    model = load_reference(path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(resources, "available_host_bytes", lambda: max(layers) - 1)
    with pytest.raises(BudgetError, match=r"needs [\d,]+ more bytes of host memory.*only [\d,]+ are available.*host_budget"):
        MiraMoEModel.wrap(model, MiraConfig(device="cpu", quantization=None))
    assert not hasattr(model, "mira")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    monkeypatch.setattr(resources, "available_host_bytes", lambda: int4_total - 1)
    with pytest.raises(BudgetError, match=f"needs {int4_total:,} more bytes"):
        MiraMoEModel.wrap(model, MiraConfig(device="cpu", quantization="int4"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(BudgetError, match=f"needs {sum(layers):,} more bytes"):  # streamed: every layer is new memory
        MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", quantization=None, loader=LoaderConfig(stream_experts=True)))
    # streamed, the store is filled before the other weights load: they must fit besides
    monkeypatch.setattr(resources, "available_host_bytes", lambda: sum(layers))
    with pytest.raises(BudgetError, match=r"besides the [\d,]+ bytes of the model's other weights"):
        MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", quantization=None, loader=LoaderConfig(stream_experts=True)))
    # one free layer is enough to move the experts in host memory into an exact store
    monkeypatch.setattr(resources, "available_host_bytes", lambda: max(layers))
    MiraMoEModel.wrap(model, MiraConfig(device="cpu", quantization=None))
    assert model.mira.store.tier_bytes()["pageable"] == sum(layers)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(gpu_budget=1.5), "fraction of all routed-expert bytes"),
        (dict(gpu_budget=0.0), "fraction"),
        (dict(gpu_budget="12 parsecs"), "is not a size"),
        (dict(gpu_budget=-5), "positive"),
        (dict(gpu_budget=[1]), "expected bytes"),
        (dict(gpu_budget="0.25"), r"without a unit counts bytes.*as a float \(gpu_budget=0\.25\)"),
        (dict(gpu_budget="1.5"), r"must be a whole number\. Give a unit \('1\.5GiB'\)"),
        (dict(device="tpu"), "supported are 'cpu', 'cuda'"),
        (dict(policy="fifo"), "policy='fifo' is not supported. Supported: lru, heat"),
        (dict(predictor="oracle"), "predictor='oracle' is not supported"),
        (dict(quantization="int3"), "quantization='int3' is not supported"),
        (dict(host_budget="1GiB"), "offload_dir"),
        (dict(expert_layer_path="experts"), "module glob"),
        (dict(quant={"placement": "packed"}), "quant must be a QuantConfig instance, got dict"),
        (dict(cache={"stage_fraction": 0.5}), "cache must be a CacheConfig instance, got dict"),
    ],
)
def test_bad_config_values_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        MiraConfig(**kwargs)


@pytest.mark.parametrize("value", [-1, 1.5, True, "4MiB"])
def test_bad_split_min_bytes_is_refused(value):
    with pytest.raises(ConfigError, match=f"split_min_bytes={value!r}: must be an int ≥ 0"):
        LoaderConfig(split_min_bytes=value)


@pytest.mark.parametrize("value", [0, -1.0, "60", float("inf"), float("nan"), None])
def test_bad_copy_timeout_is_refused(value):
    with pytest.raises(ConfigError, match=f"copy_timeout_s={value!r}: must be a finite number of seconds > 0"):
        LoaderConfig(copy_timeout_s=value)


def test_numpy_scalars_and_torch_devices_are_taken_as_what_they_stand_for():
    """Values a user computes (a numpy integer or float budget) or has at hand (a torch.device) mean what the plain
    Python values mean."""
    assert MiraConfig(gpu_budget=np.int64(5_000_000)).gpu_budget == 5_000_000
    assert MiraConfig(gpu_budget=np.float32(0.5)).gpu_budget == 0.5
    assert MiraConfig(device=torch.device("cpu")).device == "cpu"
    assert MiraConfig(device=torch.device("cuda", 1)).device == "cuda:1"
    with pytest.raises(ConfigError, match="device='meta': supported are 'cpu', 'cuda' and 'cuda:N'"):
        MiraConfig(device=torch.device("meta"))


def test_config_is_frozen():
    cfg = MiraConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.policy = "lru"  # type: ignore[misc]
    assert cfg.replace(gpu_budget="1GiB").gpu_budget == "1GiB"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_a_gpu_is_refused(tiny_checkpoint):
    with pytest.raises(DeviceError, match="no CUDA GPU.*device='cpu'"):
        MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), MiraConfig(device="cuda"), progress=False)


@pytest.mark.parametrize("device_map", ["auto", "cpu", torch.device("cpu"), {"": "cpu"}, {"model": "cpu", "lm_head": "cpu"}])
def test_a_device_map_onto_one_device_loads_there(tiny_checkpoint, device_map):
    """transformers' habit `device_map=...` names the device mira-hf places the model on: "auto" leaves it to
    mira-hf (here MiraConfig's), a device or a map of every module onto one device names it."""
    path = tiny_checkpoint("mixtral")
    ref = MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", gpu_budget=0.5), progress=False)
    cfg = MiraConfig(device="cpu" if device_map == "auto" else None, gpu_budget=0.5)
    model = MiraMoEModel.from_pretrained(path, cfg, device_map=device_map, progress=False)
    assert model.device.type == "cpu" and model.mira.device.type == "cpu"
    assert model._mira_config.device == "cpu"
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)


@pytest.mark.parametrize("stream_experts", [None, True], ids=["auto", "streamed"])
def test_a_directory_of_weights_alone_loads_with_a_config_object_as_transformers_loads_it(
    tiny_checkpoint, tmp_path, stream_experts
):
    # transformers builds the model from `config=` and never reads config.json; the directory may hold the weights alone
    from transformers import AutoConfig

    source = tiny_checkpoint("mixtral")
    for name in os.listdir(source):
        if name != "config.json":
            os.symlink(os.path.join(source, name), tmp_path / name)
    config = AutoConfig.from_pretrained(source)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, config=config).eval()
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=LoaderConfig(stream_experts=stream_experts))
    model = MiraMoEModel.from_pretrained(tmp_path, cfg, progress=False, config=config)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)


@pytest.mark.parametrize("kwargs", [dict(variant="fp16"), dict(use_safetensors=False)], ids=["variant", "bin"])
def test_arguments_naming_files_the_checkpoint_lacks_are_refused_as_such_not_as_damage(tiny_checkpoint, kwargs):
    # transformers finds no weight file for the arguments; the files are intact, and the arguments are what to change
    with pytest.raises(CheckpointError, match=r"no file named.*No weight file matches the arguments given") as info:
        MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), MiraConfig(device="cpu"), progress=False, **kwargs)
    assert "corrupted" not in str(info.value) and ".." not in str(info.value)


@pytest.mark.parametrize(
    "device_map, says",
    [
        ("balanced", "spreads a model over several devices"),
        ("sequential", "spreads a model over several devices"),
        ({"model": 0, "lm_head": "cpu"}, "puts the model on cpu, cuda:0"),
        ({"model": "cpu", "lm_head": "disk"}, "is not a device or a map onto one device"),
        ([0, 1], "is not a device or a map onto one device"),
    ],
)
def test_a_device_map_over_several_devices_is_refused_before_loading(tmp_path, device_map, says):
    """Refused before the checkpoint is read (the path does not even exist), saying what mira-hf does instead."""
    with pytest.raises(ConfigError, match=says) as err:
        MiraMoEModel.from_pretrained(tmp_path / "absent", device_map=device_map, progress=False)
    assert "device_map='auto', one device" in str(err.value)


@pytest.mark.parametrize(
    "kwargs, says", [({"max_memory": {0: "20GiB", "cpu": "64GiB"}}, "gpu_budget="), ({"offload_folder": "off"}, "offload_dir=")]
)
def test_accelerate_offloading_limits_are_refused_with_what_sets_them(tmp_path, kwargs, says):
    """transformers ignores them without a device_map; mira-hf says which of its settings is the limit meant."""
    with pytest.raises(ConfigError, match=f"accelerate's offloading limit.*{says}"):
        MiraMoEModel.from_pretrained(tmp_path / "absent", device_map="auto", progress=False, **kwargs)


def test_placement_keywords_left_at_transformers_defaults_are_not_given(tiny_checkpoint):
    """Wrappers pass transformers' defaults on (`device_map=None, max_memory=None, offload_folder=None`): as absent."""
    path = tiny_checkpoint("mixtral")
    cfg = MiraConfig(device="cpu", gpu_budget=0.5)
    ref = MiraMoEModel.from_pretrained(path, cfg, progress=False)
    model = MiraMoEModel.from_pretrained(path, cfg, device_map=None, max_memory=None, offload_folder=None, progress=False)
    assert model.device.type == "cpu"
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)


def test_a_device_map_naming_another_device_than_the_config_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"names cuda:0, but MiraConfig\(device='cpu'\)"):
        MiraMoEModel.from_pretrained(tmp_path / "absent", MiraConfig(device="cpu"), device_map=0, progress=False)
    with pytest.raises(ConfigError, match="device='mps': supported are 'cpu', 'cuda' and 'cuda:N'"):
        MiraMoEModel.from_pretrained(tmp_path / "absent", device_map="mps", progress=False)


def test_remote_code_of_a_type_transformers_does_not_know_needs_trust(tiny_checkpoint, tmp_path):
    import shutil

    src = tiny_checkpoint("mixtral")
    dst = tmp_path / "remote"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(model_type="remote_moe", auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="'remote_moe', which transformers has no classes.*trust_remote_code=True"):
        MiraMoEModel.from_pretrained(dst, MiraConfig(device="cpu"), progress=False)


# A checkpoint's own code for a model type transformers has classes for (as DeepSeek-V3's and MiniMax's hub checkpoints
# ship theirs): its experts one module each, which no adapter serves.
_OWN_CODE_OF_A_KNOWN_TYPE = """
from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM


class OwnConfig(MixtralConfig):
    model_type = "{model_type}"


class OwnForCausalLM(MixtralForCausalLM):
    config_class = OwnConfig

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(config.num_local_experts))
"""


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_known_types_checkpoint_with_its_own_code_loads_as_transformers_loads_it(tiny_checkpoint, tmp_path, stream):
    """Without trust_remote_code, transformers builds its own classes for a model type it knows and leaves the
    checkpoint's `auto_map` unused; mira-hf loads it the same way, whole or streamed, exact. With trust, the
    checkpoint's code is built, as transformers builds it; where its experts cannot be served, the error says to load
    without trust, before any weight is read."""
    import shutil

    dst = tmp_path / "own_code"
    shutil.copytree(tiny_checkpoint("mixtral"), dst)
    (dst / "own_code.py").write_text(_OWN_CODE_OF_A_KNOWN_TYPE.format(model_type="mixtral"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "own_code.OwnConfig", "AutoModelForCausalLM": "own_code.OwnForCausalLM"}
    (dst / "config.json").write_text(json.dumps(cfg))
    ref = load_reference(dst)
    assert type(ref).__name__ == "MixtralForCausalLM"
    model = MiraMoEModel.from_pretrained(
        dst, MiraConfig(device="cpu", gpu_budget=0.3, loader=LoaderConfig(stream_experts=stream)), progress=False
    )
    assert type(model) is type(ref)
    assert torch.equal(_logits(model), _logits(ref))
    # trusted, its code is built first on the meta device: refused before any weight is read (these are not readable)
    assert [p.name for p in dst.glob("*.safetensors*")] == ["model.safetensors"]
    (dst / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(UnsupportedModelError, match="OwnForCausalLM is the checkpoint's own code.*without trust_remote_code"):
        MiraMoEModel.from_pretrained(dst, MiraConfig(device="cpu"), progress=False, trust_remote_code=True)


_OWN_SUBCLASSES = """
import transformers


class OwnConfig(transformers.{config}):
    model_type = "{model_type}"


class OwnForCausalLM(transformers.{model}):
    config_class = OwnConfig
"""


@pytest.mark.parametrize("family", ["dbrx", "jetmoe", "gpt_oss"])
def test_trusted_code_subclassing_a_known_family_is_served_as_transformers_builds_it(tmp_path, family):
    """A checkpoint whose own code subclasses a family transformers knows, loaded with trust_remote_code=True: its
    own classes are built, and their experts, in the family's layout (DBRX's separate tensors, JetMoE's routing
    block, gpt-oss's transposed experts), are served as the family's, exact."""
    torch.manual_seed(0)
    original = build(make_config(family)).eval()
    dst = tmp_path / "own"
    original.save_pretrained(dst)
    config = type(original.config).__name__
    (dst / "own_code.py").write_text(_OWN_SUBCLASSES.format(config=config, model_type=family, model=type(original).__name__))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "own_code.OwnConfig", "AutoModelForCausalLM": "own_code.OwnForCausalLM"}
    (dst / "config.json").write_text(json.dumps(cfg))
    ref = load_reference(dst, trust_remote_code=True)
    model = MiraMoEModel.from_pretrained(dst, MiraConfig(device="cpu", gpu_budget=0.3), progress=False, trust_remote_code=True)
    assert type(model).__name__ == type(ref).__name__ == "OwnForCausalLM"
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)
    assert model.mira.stats()["loads"] > 0


def test_trusted_code_of_an_unknown_type_whose_experts_cannot_be_served_is_refused_before_loading(tiny_checkpoint, tmp_path):
    """A checkpoint's own code for a type transformers does not know, keeping its experts one module each in a list
    its block calls (as DeepSeek-MoE's first release does): built on the meta device first, refused before any weight
    is read."""
    import shutil

    dst = tmp_path / "own_code"
    shutil.copytree(tiny_checkpoint("mixtral"), dst)
    (dst / "own_code.py").write_text(_OWN_CODE_OF_A_KNOWN_TYPE.format(model_type="own_moe"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(
        model_type="own_moe", auto_map={"AutoConfig": "own_code.OwnConfig", "AutoModelForCausalLM": "own_code.OwnForCausalLM"}
    )
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(UnsupportedModelError, match="OwnForCausalLM .model_type 'own_moe'. has no mira-hf adapter"):
        MiraMoEModel.from_pretrained(dst, MiraConfig(device="cpu"), progress=False, trust_remote_code=True)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_model_class_given_loads_a_checkpoint_of_a_type_transformers_does_not_know_without_its_code(tmp_path, stream):
    """A model class builds itself whatever config.json names (`SomeModelClass.from_pretrained` reads it with its own
    config class and leaves the `auto_map` unused): with `model_class=` given, a checkpoint of another model type that
    ships its own code loads with that class and no trust, whole or streamed, as that class's from_pretrained loads it
    (as a DeepSeek-V3-shaped checkpoint under a model type of its own loads with DeepseekV3ForCausalLM)."""
    from safetensors.torch import save_file
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    original = build(make_config("mixtral"))
    dst = tmp_path / "renamed"
    dst.mkdir()
    # transformers renames checkpoint keys by model type, and this type has no renamings: the tensors as named in memory
    save_file({k: v.contiguous() for k, v in original.state_dict().items()}, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = original.config.to_dict()
    cfg.update(
        model_type="own_moe", auto_map={"AutoConfig": "own_code.OwnConfig", "AutoModelForCausalLM": "own_code.OwnForCausalLM"}
    )
    (dst / "config.json").write_text(json.dumps(cfg))  # the code it names is not there: it is never read
    ref = align_experts(MixtralForCausalLM.from_pretrained(dst).eval())  # (aligned as mira-hf's copies are: conftest)
    assert torch.equal(_logits(ref), _logits(original.eval()))  # every weight loaded
    loader = LoaderConfig(stream_experts=stream)
    with pytest.warns(UserWarning, match="model_type 'own_moe' has no adapter"):  # its experts found by the interface
        model = MiraMoEModel.from_pretrained(
            dst, MiraConfig(device="cpu", gpu_budget=0.3, loader=loader), model_class=MixtralForCausalLM, progress=False
        )
    assert type(model) is MixtralForCausalLM
    assert torch.equal(_logits(model), _logits(ref))
    assert model.mira.stats()["loads"] > 0


# A model whose code ships with its checkpoint: its own config and causal-LM classes (Mixtral's underneath).
_REMOTE_CODE = """
from transformers import MixtralConfig, MixtralForCausalLM


class RemoteMoeConfig(MixtralConfig):
    model_type = "{model_type}"


class RemoteMoeForCausalLM(MixtralForCausalLM):
    config_class = RemoteMoeConfig
"""


@pytest.mark.parametrize("model_type", ["remote_moe", "blip_text_model"], ids=["unknown_type", "type_with_config_only"])
def test_remote_code_loads_with_trust_and_computes_what_transformers_loads(tmp_path, model_type):
    """With trust_remote_code=True the checkpoint's own classes are built, as AutoModelForCausalLM builds them:
    for a model type transformers does not know, and for one it has a config for but no causal-LM class."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    original = build(make_config("mixtral"))
    dst = tmp_path / "remote"
    dst.mkdir()
    # its own classes map no checkpoint keys (transformers' renamings are per model type): the tensors as named in memory
    save_file({k: v.contiguous() for k, v in original.state_dict().items()}, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "remote_moe.py").write_text(_REMOTE_CODE.format(model_type=model_type))
    cfg = original.config.to_dict()
    cfg.update(model_type=model_type, architectures=["RemoteMoeForCausalLM"],
               auto_map={"AutoConfig": "remote_moe.RemoteMoeConfig", "AutoModelForCausalLM": "remote_moe.RemoteMoeForCausalLM"})  # fmt: skip
    (dst / "config.json").write_text(json.dumps(cfg))
    ref = load_reference(dst, trust_remote_code=True)
    with pytest.warns(UserWarning, match="has no adapter") as record:
        model = MiraMoEModel.from_pretrained(
            dst, MiraConfig(device="cpu", gpu_budget=0.3), progress=False, trust_remote_code=True
        )
    assert sum("has no adapter" in str(w.message) for w in record) == 1  # said once, not by the check before loading
    assert type(model).__name__ == "RemoteMoeForCausalLM"
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)
        assert torch.equal(ref(IDS).logits, original(IDS).logits)  # every weight loaded (none initialised anew)
    assert model.mira.stats()["loads"] > 0


def test_forward_with_autograd_on_works_and_backward_is_a_clear_error(tiny_checkpoint):
    """A forward outside torch.no_grad() (a notebook's `model(ids)`) computes the same numbers; a backward
    through the offloaded experts, whose slots later copies overwrite, stops with a clear error."""
    path = tiny_checkpoint("mixtral")
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=0.3, device="cpu"), progress=False)
    expected = _logits(model)
    gate, graphs = model.mira.predictor, []
    to_host = gate._to_host
    gate._to_host = lambda layer, logits: graphs.append(logits.requires_grad) or to_host(layer, logits)
    out = model(IDS, labels=IDS)
    assert out.logits.requires_grad and torch.equal(out.logits.detach(), expected)
    assert graphs and not any(graphs)  # the gate's guesses build no graph (on CUDA they land in a reused pinned buffer)
    with pytest.raises(UnsupportedOperationError, match="backward through mira-hf's offloaded experts"):
        out.loss.backward()
    assert torch.equal(_logits(model), expected)  # still serves after the refused backward


@pytest.mark.parametrize("trainable", ["experts", "experts and lm_head"])
def test_expert_parameters_asking_for_gradients_make_backward_a_clear_error(tiny_checkpoint, trainable):
    """Expert parameters that ask for gradients (the rest frozen, or only a head beside them) get none from the
    experts' cache slots: the backward raises the same refusal instead of leaving their gradients None (or torch
    finding nothing that requires grad)."""
    path = tiny_checkpoint("mixtral")
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=0.3, device="cpu"), progress=False)
    expected = _logits(model)
    for name, p in model.named_parameters():
        p.requires_grad_(".experts." in name or (name.startswith("lm_head") and "lm_head" in trainable))
    out = model(IDS, labels=IDS)
    assert out.loss.requires_grad and torch.equal(out.logits.detach(), expected)
    with pytest.raises(UnsupportedOperationError, match="backward through mira-hf's offloaded experts"):
        out.loss.backward()
    model.requires_grad_(False)
    assert not model(IDS, labels=IDS).loss.requires_grad  # nothing asks for gradients: no graph to refuse


@pytest.mark.parametrize(
    "settings",
    [
        {},  # grouped resident experts: typed views of the pool
        {"quantization": "lossless", "quant": QuantConfig(placement="dequant")},  # decoded into slots by the copy
        {"quantization": "int8", "quant": QuantConfig(placement="dequant")},
        {"quantization": "lossless", "quant": QuantConfig(placement="mixed")},
    ],
    ids=["raw", "lossless-dequant", "int8-dequant", "lossless-mixed"],
)
def test_a_first_forward_in_inference_mode_leaves_the_model_usable_outside_it(tiny_checkpoint, settings):
    """Serving code often runs under torch.inference_mode(); what the first forward there builds and keeps (views of
    slots, buffers) must be normal tensors, or a later forward with autograd on cannot read them and a later copy
    outside inference mode cannot write them. Every mode after it computes what a model never run in inference mode
    computes."""
    path = tiny_checkpoint("mixtral")
    cfg = MiraConfig(gpu_budget=0.3, device="cpu", **settings)
    expected = _logits(MiraMoEModel.from_pretrained(path, cfg, progress=False))
    model = MiraMoEModel.from_pretrained(path, cfg, progress=False)
    for mode in (torch.inference_mode, torch.enable_grad, torch.no_grad, torch.inference_mode):
        with mode():
            logits = model(IDS).logits
        assert torch.equal(logits.detach(), expected), mode.__name__


def test_a_model_loaded_and_cast_in_inference_mode_serves_outside_it(tiny_checkpoint):
    """Loaded (then cast) inside torch.inference_mode(), as a serving script may do: the store, arena and slots are
    normal tensors, so forwards after it copy experts into them as before. (A cast in inference mode makes the
    model's own weights inference tensors, as it does to the unwrapped model's: autograd is then refused by torch.)"""
    path = tiny_checkpoint("mixtral")
    cfg = MiraConfig(gpu_budget=0.3, device="cpu")
    reference = MiraMoEModel.from_pretrained(path, cfg, progress=False)
    with torch.inference_mode():
        model = MiraMoEModel.from_pretrained(path, cfg, progress=False)
        model(IDS)
    for mode in (torch.no_grad, torch.enable_grad, torch.inference_mode):
        with mode():
            assert torch.equal(model(IDS).logits.detach(), _logits(reference)), mode.__name__
    with torch.inference_mode():
        model.to(torch.bfloat16)  # re-encodes the store and rebuilds the slots
    assert not any(p.is_inference() for n, p in model.named_parameters() if ".experts." in n)  # views of the store
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            assert torch.equal(model(IDS).logits, _logits(reference.to(torch.bfloat16))), mode.__name__


def test_copying_or_pickling_a_wrapped_model_is_a_clear_error(tiny_checkpoint, tmp_path):
    import copy

    path = tiny_checkpoint("mixtral")
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=0.3, device="cpu"), progress=False)
    with pytest.raises(UnsupportedOperationError, match="cannot be deep-copied"):
        copy.deepcopy(model)
    with pytest.raises(UnsupportedOperationError, match=r"copied \(copy.copy\)"):
        copy.copy(model)  # a shallow copy would share the proxies and the manager: unloading one unloaded the other
    with pytest.raises(UnsupportedOperationError, match="save_pretrained"):
        torch.save(model, tmp_path / "model.pt")
    expected = _logits(model)
    model.save_pretrained(tmp_path / "out")  # the supported way, still working after the refusals
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()), _logits(load_reference(path)))
    assert torch.equal(_logits(model), expected)
    assert copy.copy(model.unload()) is not model  # an unloaded model copies as any other


def test_unload_twice_is_a_clear_error(tiny_checkpoint):
    model = MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), MiraConfig(gpu_budget=0.3, device="cpu"), progress=False)
    model.unload()
    with pytest.raises(ConfigError, match="unloaded already"):
        model.unload()
    with pytest.raises(ConfigError, match="has not wrapped: there is nothing to unload"):
        MiraMoEModel.unload(model)


def test_errors_subclass_builtins():
    assert issubclass(BudgetError, ValueError) and issubclass(BudgetError, MiraError)
    assert issubclass(DeviceError, RuntimeError)


@pytest.mark.parametrize("where", ["a missing directory", "a hub id not in the local cache"])
def test_missing_checkpoint_gives_a_clear_error(tmp_path, where):
    from mira_hf import CheckpointError

    name = os.fspath(tmp_path / "nope") if where == "a missing directory" else "mira-tests/no-such-model"
    with pytest.raises(CheckpointError) as err:  # downloads off: the tests never reach the hub
        MiraMoEModel.from_pretrained(name, MiraConfig(device="cpu"), progress=False, local_files_only=True)
    assert isinstance(err.value, OSError)  # what transformers raises for the same mistake
    msg = str(err.value)
    assert msg.startswith(f"{name} does not exist: no such directory")  # what was given
    assert "\n" not in msg  # one line
    if where == "a missing directory":
        assert "Give a local directory holding config.json and the weights" in msg  # what to do
    else:
        assert "local_files_only=True" in msg and f"hf download {name}" in msg  # why, and what to do


@pytest.mark.parametrize(
    "device, dtype, record, budget, want",
    [
        ("cuda", torch.bfloat16, 2**28, 0.25, ("lossless", "packed")),  # Mixtral-sized experts over PCIe
        ("cuda", torch.float32, 2**28, 0.25, ("lossless", "packed")),
        ("cpu", torch.bfloat16, 2**28, 0.25, (None, "dequant")),  # no link to save
        ("cuda", torch.bfloat16, 2**28, 1.0, (None, "dequant")),  # every expert fits: nothing moves
        ("cuda", torch.bfloat16, 2**16, 0.25, (None, "dequant")),  # tiny records: decoding costs more than it saves
        ("cuda", torch.bfloat16, 49_766_400, 0.25, (None, "dequant")),  # gpt-oss-sized: so do its uses' decodes
        ("cuda", torch.float16, 2**28, 0.25, (None, "dequant")),  # lossless handles bf16 and fp32 only
    ],
)
def test_auto_transfer_format_is_exact_and_used_only_where_it_pays(device, dtype, record, budget, want):
    from mira_hf.store_build import resolve_format

    specs = {layer: {"down_proj": ((record // 2, 1), dtype)} for layer in range(4)}
    raw = {layer: record for layer in range(4)}
    all_bytes = 8 * 4 * record
    cfg = resolve_format(MiraConfig(), torch.device(device), specs, raw, all_bytes, int(budget * all_bytes))
    assert (cfg.quantization, cfg.quant.placement) == want
    explicit = MiraConfig(quantization="lossless", quant=QuantConfig(placement="dequant"))
    cfg = resolve_format(explicit, torch.device(device), specs, raw, all_bytes, int(budget * all_bytes))
    assert (cfg.quantization, cfg.quant.placement) == ("lossless", "dequant")  # given values are kept


@pytest.mark.parametrize(
    ("host_compute", "want"), [("off", "lossless"), ("auto", "lossless"), ("split", "lossless"), ("on", None)]
)
def test_host_compute_keeps_the_lossless_format_except_where_every_miss_may_run_on_the_host(host_compute, want):
    """On Mixtral-sized experts the lossless copies beat uncompressed ones with host sends at every width
    (docs/usage.md): `host_compute="auto"` keeps them (and stays off); `"on"` needs uncompressed records."""
    from mira_hf.store_build import resolve_format

    record = 2**28
    specs = {layer: {"down_proj": ((record // 2, 1), torch.bfloat16)} for layer in range(4)}
    raw = {layer: record for layer in range(4)}
    cfg = resolve_format(MiraConfig(host_compute=host_compute), torch.device("cuda"), specs, raw, 32 * record, 8 * record)
    assert cfg.quantization == want


def test_default_config_reports_the_format_it_resolved(tiny_checkpoint):
    model = MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), MiraConfig(device="cpu", gpu_budget=0.5), progress=False)
    assert model._mira_config.quantization == "auto"
    assert model.mira.quantization is None and model.mira.stats()["quantization"] is None  # CPU: nothing to save
    assert MiraMoEModel.wrap(model, MiraConfig(device="cpu", gpu_budget=0.5)) is model  # same config: a no-op


def test_the_predictor_sees_each_block_once_before_its_host_sync(tiny_checkpoint):
    """The proxy asks for predictions before the block's host sync (`predict_ahead`), and `begin`
    uses them: every block is observed and predicted exactly once, and the guesses are scored."""
    model = MiraMoEModel.from_pretrained(
        tiny_checkpoint("mixtral"), MiraConfig(device="cpu", gpu_budget=0.5, predictor="markov"), progress=False
    )
    calls = []
    observe, predict = model.mira.predictor.observe, model.mira.predictor.predict
    model.mira.predictor.observe = lambda layer, *a: calls.append(("observe", layer)) or observe(layer, *a)
    model.mira.predictor.predict = lambda layer, *a: calls.append(("predict", layer)) or predict(layer, *a)
    ids = torch.tensor([[5, 9, 14, 33]])
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    layers = len(model.mira.layers)
    assert calls == [(kind, layer) for _ in range(4) for layer in range(layers) for kind in ("observe", "predict")]
    assert model.mira.stats()["predictor_recall"] is not None


def test_unloading_a_model_mira_hf_has_not_wrapped_says_so():
    model = build(make_config("mixtral")).eval()
    with pytest.raises(ConfigError, match="MixtralForCausalLM that mira-hf has not wrapped: there is nothing to unload"):
        MiraMoEModel.unload(model)


def test_a_model_built_on_the_meta_device_is_refused_saying_how_to_give_it_weights():
    with torch.device("meta"):
        model = build(make_config("mixtral"))
    with pytest.raises(UnsupportedModelError, match="weights are on the meta device.*assign=True.*from_pretrained"):
        MiraMoEModel.wrap(model, MiraConfig(device="cpu"))
