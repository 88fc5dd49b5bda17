"""Loading with the experts streamed from the checkpoint: the same model as the ordinary load, host
memory bounded by the non-expert weights plus host_budget, and clear errors for broken checkpoints."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import ALL_TINY, PEAK_ANON_SOURCE, load_reference, run_measuring
from tiny_models import config_or_skip, make_config

from mira_hf import BudgetError, CheckpointError, ConfigError, MiraConfig, MiraMoEModel, UnsupportedModelError
from mira_hf.config import LoaderConfig
from mira_hf.expert_keys import transformers_keys
from mira_hf.shards import ShardIndex
from model_adapters import ExpertKeys, MoEAdapter, get_adapter, register_adapter

IDS = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(3))
GEN = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
STREAM, WHOLE = LoaderConfig(stream_experts=True), LoaderConfig(stream_experts=False)


def _load(path, loader: LoaderConfig, **kw):
    hf = {"dtype": kw.pop("dtype")} if "dtype" in kw else {}
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=loader, **kw)
    return MiraMoEModel.from_pretrained(path, cfg, progress=False, **hf).eval()


def _record_order(monkeypatch) -> list[str]:
    """What the loads do, in order: "experts" for each layer stored, "model" when transformers loads the rest."""
    import mira_hf.checkpoint as checkpoint
    from mira_hf.store import ExpertStore

    order = []
    add_layer_from, load_without_experts = ExpertStore.add_layer_from, checkpoint.load_without_experts
    monkeypatch.setattr(ExpertStore, "add_layer_from", lambda *a, **k: order.append("experts") or add_layer_from(*a, **k))
    monkeypatch.setattr(
        checkpoint, "load_without_experts", lambda *a, **k: order.append("model") or load_without_experts(*a, **k)
    )
    return order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ALL_TINY)
def test_streamed_load_is_the_same_model(tiny_checkpoint, name, dtype, monkeypatch):
    """Bit-identical logits to the ordinary load (bf16: cast while reading, as transformers casts), and
    the unwrapped model's logits and tokens. Every layer's experts are stored (read from a skeleton's
    plan) before transformers loads the other weights: the order that overlaps a hub id's download."""
    path = tiny_checkpoint(name)
    order = _record_order(monkeypatch)
    streamed = _load(path, STREAM, dtype=dtype)  # stream_experts=True raises if it cannot stream
    assert order == ["experts"] * len(streamed.mira.store.layers) + ["model"]
    whole = _load(path, WHOLE, dtype=dtype)
    assert streamed.mira.store.dtype(0) == dtype
    with torch.no_grad():
        got = streamed(IDS).logits
        assert torch.equal(got, whole(IDS).logits)
    if dtype == torch.float32:
        ref = load_reference(path)
        with torch.no_grad():
            assert torch.equal(got, ref(IDS).logits)
        assert torch.equal(streamed.generate(IDS[:1], **GEN), ref.generate(IDS[:1], **GEN))
    # unload gives back an ordinary model with every expert, as from the ordinary load
    back, ref_back = streamed.unload(), whole.unload()
    assert type(back) is type(ref_back)
    assert all(torch.equal(p, ref_back.get_parameter(n)) for n, p in back.named_parameters())


@pytest.mark.parametrize("name", ALL_TINY)
def test_adapter_tables_agree_with_transformers_key_renaming(tiny_checkpoint, name):
    """The per-family tables find the keys transformers' own loading renames to each fused expert tensor (the
    generic fallback), in a checkpoint as save_pretrained writes it."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_or_skip(name))
    adapter = get_adapter(model.config.model_type)
    found = adapter.find_experts(model)
    targets = {f"{path}.{n}": t for path, module in found for n, t in module.named_parameters(recurse=False)}
    derived = transformers_keys(model, ShardIndex.find(tiny_checkpoint(name), {}), targets)
    assert derived is not None
    for path, module in found:
        for tensor, _ in module.named_parameters(recurse=False):
            tables = [k.keys(path, tensor) for k in adapter.checkpoint_keys] or [(f"{path}.{tensor}",)]
            assert derived(path, tensor) in tables


def test_family_without_table_streams_through_transformers_mapping(tiny_checkpoint):
    path = tiny_checkpoint("phimoe")
    cfg = dict(expert_layer_path="model.layers.*.mlp.experts")  # generic adapter: no checkpoint_keys
    with torch.no_grad():
        assert torch.equal(_load(path, STREAM, **cfg)(IDS).logits, _load(path, WHOLE, **cfg)(IDS).logits)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_a_base_models_checkpoint_streams_into_a_model_with_a_head_and_the_other_way_round(tiny_checkpoint, name, tmp_path):
    """A checkpoint saved from the base model (keys without `model.`) loads into the causal LM, and a causal LM's into
    the base model (`model_class=AutoModel`), as transformers loads them: the experts streamed from the checkpoint's
    own names, the base model's hidden states and every expert tensor equal to transformers' load, and the loading
    info transformers reports (the head a base model's checkpoint lacks is missing; the causal LM's head unexpected)."""
    from transformers import AutoModel, AutoModelForCausalLM

    causal = tiny_checkpoint(name)
    load_reference(causal).model.save_pretrained(tmp_path / "base")
    for path, model_class in ((tmp_path / "base", AutoModelForCausalLM), (causal, AutoModel)):
        torch.manual_seed(0)  # the head a base model's checkpoint lacks is initialised alike in both loads
        ref, expected = model_class.from_pretrained(path, output_loading_info=True)
        torch.manual_seed(0)
        cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=STREAM)
        model, info = MiraMoEModel.from_pretrained(path, cfg, progress=False, model_class=model_class, output_loading_info=True)
        assert type(model) is type(ref) and info == expected and (expected["missing_keys"] or expected["unexpected_keys"])
        with torch.no_grad():
            assert torch.equal(model.base_model(IDS).last_hidden_state, ref.eval().base_model(IDS).last_hidden_state)
        assert model.mira.stats()["loads"] > 0
        got = model.state_dict()
        assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items() if ".experts." in k)


def test_sharded_checkpoint_streams(tmp_path):
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(make_config("qwen3_moe")).save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    with torch.no_grad():
        assert torch.equal(_load(tmp_path, STREAM)(IDS).logits, _load(tmp_path, WHOLE)(IDS).logits)


@pytest.fixture
def wrong_mixtral_table():
    """The mixtral adapter with a table matching no checkpoint (the fused names do not match either)."""
    original = get_adapter("mixtral")
    bad = ExpertKeys(tensors={"gate_up_proj": ("{e}.nope.weight",), "down_proj": ("{e}.nope2.weight",)})
    register_adapter(MoEAdapter(name="mixtral-moved", model_types=("mixtral",), checkpoint_keys=(bad,)), override=True)
    yield
    register_adapter(original, override=True)


def test_unknown_layout_falls_back_to_the_whole_load_with_a_warning(tiny_checkpoint, tmp_path, wrong_mixtral_table):
    path = tiny_checkpoint("mixtral")
    cfg = dict(host_budget="10MB", offload_dir=str(tmp_path / "off"))  # auto: host_budget asks for streaming
    with pytest.warns(UserWarning, match="cannot be read one at a time.*nope.weight"):
        model = _load(path, LoaderConfig(), **cfg)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, load_reference(path)(IDS).logits)
    with pytest.raises(UnsupportedModelError, match="stream_experts=True.*mixtral-moved table"):
        _load(path, STREAM)


def test_experts_beyond_host_budget_stream_to_disk(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("deepseek_v3")
    one_layer = _load(path, WHOLE).mira.store.record_bytes(0) * 8
    offload = tmp_path / "offload"
    model = _load(path, LoaderConfig(), host_budget=one_layer, offload_dir=str(offload))  # auto: streams
    assert model.mira.store.tier_bytes() == {"pinned": 0, "pageable": one_layer, "disk": one_layer}
    ref = load_reference(path)
    assert torch.equal(model.generate(IDS[:1], **GEN), ref.generate(IDS[:1], **GEN))
    model.unload()
    assert os.listdir(offload) == []


def test_offload_dir_without_space_is_refused_before_loading(tiny_checkpoint, tmp_path, monkeypatch):
    import mira_hf.offload_files

    monkeypatch.setattr(mira_hf.offload_files.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**6, 10**6 - 10, 10))
    with pytest.raises(BudgetError, match="only 10 bytes are free"):
        _load(tiny_checkpoint("mixtral"), LoaderConfig(), host_budget=1000, offload_dir=str(tmp_path / "off"))
    assert not (tmp_path / "off").exists()


def test_an_offload_dir_that_cannot_be_written_is_refused_before_loading(tiny_checkpoint, tmp_path, monkeypatch):
    """A read-only disk (or a directory without write permission) is refused before any expert is read, as a full
    one is; an empty offload_dir is refused when the config is built."""
    import os

    import mira_hf.resources

    readonly = tmp_path / "ro"
    readonly.mkdir()
    real = os.access
    monkeypatch.setattr(mira_hf.resources.os, "access", lambda p, mode: False if str(p) == str(readonly) else real(p, mode))
    from mira_hf.store import ExpertStore

    monkeypatch.setattr(ExpertStore, "add_layer_from", lambda *a, **k: pytest.fail("experts were read into the store"))
    with pytest.raises(ConfigError, match=r"cannot be written \(a read-only disk, or no permission\)"):
        _load(tiny_checkpoint("mixtral"), LoaderConfig(), host_budget=1000, offload_dir=str(readonly / "experts"))
    assert list(readonly.iterdir()) == []
    with pytest.raises(ConfigError, match="offload_dir='': give a directory"):
        MiraConfig(host_budget=1000, offload_dir="")


@pytest.mark.parametrize("damage", ["truncated", "corrupted header", "missing shard"])
def test_broken_shard_gives_a_checkpoint_error_before_loading(tmp_path, damage):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ckpt = tmp_path / "ckpt"
    AutoModelForCausalLM.from_config(make_config("mixtral")).save_pretrained(ckpt, max_shard_size="200KB")
    shards = sorted(p for p in ckpt.iterdir() if p.suffix == ".safetensors")
    victim = shards[-1]
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size - 100])
    elif damage == "corrupted header":
        data = victim.read_bytes()
        victim.write_bytes(data[:8] + b"#" * 16 + data[24:])
    else:
        victim.unlink()
    offload = tmp_path / "off"
    with pytest.raises(CheckpointError, match="missing, truncated or corrupted|is missing"):
        _load(ckpt, LoaderConfig(), host_budget="1MB", offload_dir=str(offload))
    assert not offload.exists()


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(host_budget="1MB"), dict(output_router_logits=False)],  # the last: the model built first (no skeleton)
    ids=["stream_experts", "host_budget", "model_first"],
)
def test_an_expert_past_the_configs_count_is_refused_before_loading(tiny_checkpoint, tmp_path, monkeypatch, kw):
    """A per-expert checkpoint holding expert E where its config gives E experts: transformers refuses it (the
    stacked tensor does not fit), and a streamed load too, before any expert is read, naming the layer, the expert
    and the config's count, rather than reading experts 0..E-1 alone."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_checkpoint("mixtral"), tmp_path / "ckpt")
    weights = load_file(tmp_path / "ckpt" / "model.safetensors")
    last = "model.layers.1.block_sparse_moe.experts"
    for w in ("w1", "w2", "w3"):
        weights[f"{last}.8.{w}.weight"] = weights[f"{last}.7.{w}.weight"] * 2
    save_file(weights, tmp_path / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    order = _record_order(monkeypatch)
    host_budget = kw.pop("host_budget", None)
    disk = dict(host_budget=host_budget, offload_dir=str(tmp_path / "off")) if host_budget else {}
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=STREAM, **disk)
    says = r"holds expert 8 of model\.layers\.1\..*config gives that layer 8 experts \(0\.\.7\)"
    with pytest.raises(CheckpointError, match=says):
        MiraMoEModel.from_pretrained(tmp_path / "ckpt", cfg, progress=False, **kw)
    assert "experts" not in order and not (tmp_path / "off").exists()


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(host_budget="1MB"), dict(output_router_logits=False)],  # the last: the model built first (no skeleton)
    ids=["stream_experts", "host_budget", "model_first"],
)
@pytest.mark.parametrize("damage", ["one expert mis-shaped", "config gives more experts"])
def test_experts_that_do_not_fit_the_config_are_a_checkpoint_error_naming_the_tensor(tiny_checkpoint, tmp_path, kw, damage):
    """One expert's tensor of another shape than the others' (a damaged or mis-converted shard), or a config giving a
    layer more experts than the checkpoint holds: a CheckpointError naming the key, its shape against the one expected
    and its file (or the count of experts held), before any expert is read. Not a layout mira-hf does not support
    (registering an adapter would not help), nor a fallback to the whole load, nor a memory problem."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_checkpoint("mixtral"), tmp_path / "ckpt")
    file = tmp_path / "ckpt" / "model.safetensors"
    key = "model.layers.1.block_sparse_moe.experts.3.w1.weight"
    if damage == "one expert mis-shaped":
        weights = load_file(file)
        shape = list(weights[key].shape)
        weights[key] = weights[key].reshape(shape[0] // 2, shape[1] * 2).contiguous()  # a mis-converted tensor
        save_file(weights, file, metadata={"format": "pt"})
        bad = [shape[0] // 2, shape[1] * 2]
        says = rf"{re.escape(key)} in {re.escape(str(file))} has shape {re.escape(str(bad))}, expected {re.escape(str(shape))}"
    else:
        config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
        config["num_local_experts"] = 9
        (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
        says = r"config gives it 9 experts, but the checkpoint holds 8 \(.*no model\.layers\.0\.block_sparse_moe\.experts\.8\.w1"
    host_budget = kw.pop("host_budget", None)
    disk = dict(host_budget=host_budget, offload_dir=str(tmp_path / "off")) if host_budget else {}
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=STREAM if not host_budget else LoaderConfig(), **disk)
    with pytest.raises(CheckpointError, match=says):
        MiraMoEModel.from_pretrained(tmp_path / "ckpt", cfg, progress=False, **kw)
    assert not (tmp_path / "off").exists()


# -- peak host memory ---------------------------------------------------------------------------------------
_MEASURE = (
    PEAK_ANON_SOURCE
    + """
import json
import torch, mira_hf
from transformers.models.mixtral import modeling_mixtral  # imported before the baseline
peak = PeakAnon()
cfg = mira_hf.MiraConfig(device="cpu", gpu_budget=0.05, host_budget=HOST_BUDGET, offload_dir=OFFLOAD,
                         loader=mira_hf.config.LoaderConfig(stream_experts=STREAM))
m = mira_hf.MiraMoEModel.from_pretrained(PATH, cfg, progress=False)
growth = peak.stop()
ids = torch.tensor([[4, 8, 15, 16, 23, 42, 7, 9]])
tokens = m.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
print(json.dumps(dict(growth=growth, arena=m.mira.cache.capacity_bytes, tiers=m.mira.store.tier_bytes(),
                      tokens=tokens.tolist())))
"""
)


def _measure(path, offload, host_budget: int, stream: bool) -> dict:
    code = _MEASURE.replace("HOST_BUDGET", str(host_budget)).replace("OFFLOAD", repr(str(offload)))
    code = code.replace("STREAM", str(stream)).replace("PATH", repr(str(path)))
    return run_measuring(code)


@pytest.mark.slow
def test_peak_host_memory_at_load_is_non_experts_plus_host_budget(tmp_path):
    """A bf16 checkpoint with 201 MB of experts, loaded with a 32 MB host budget: the process's peak
    anonymous memory grows by at most the non-expert weights + host_budget + 32 MiB of slack (the
    expert arena, host memory on CPU by design, counted apart), where loading it whole grows by the
    checkpoint's size. Generation is token-identical to the unwrapped model."""
    script = textwrap.dedent(f"""
        import torch
        from transformers import MixtralConfig, MixtralForCausalLM
        torch.manual_seed(0)
        cfg = MixtralConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                            pad_token_id=0, bos_token_id=1, eos_token_id=2)
        MixtralForCausalLM(cfg).to(torch.bfloat16).save_pretrained({str(tmp_path / "ckpt")!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
    from safetensors import safe_open

    expert_bytes = other_bytes = 0
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            n = f.get_slice(k)
            nbytes = 2 * int(torch.tensor(n.get_shape()).prod())
            expert_bytes, other_bytes = (
                (expert_bytes + nbytes, other_bytes) if ".experts." in k else (expert_bytes, other_bytes + nbytes)
            )
    assert expert_bytes > 200e6
    host_budget = 32 * 10**6
    streamed = _measure(tmp_path / "ckpt", tmp_path / "off", host_budget, stream=True)
    assert streamed["tiers"]["disk"] > 0 and streamed["tiers"]["pageable"] <= host_budget
    assert streamed["growth"] - streamed["arena"] <= other_bytes + host_budget + 32 * 2**20, (streamed, other_bytes)
    whole = _measure(tmp_path / "ckpt", tmp_path / "off2", host_budget, stream=False)
    assert whole["growth"] - whole["arena"] > expert_bytes  # what streaming saves
    ref = load_reference(str(tmp_path / "ckpt"))
    ids = torch.tensor([[4, 8, 15, 16, 23, 42, 7, 9]])
    expected = ref.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert streamed["tokens"] == whole["tokens"] == expected.tolist()
    print(f"experts {expert_bytes:,} B, non-experts {other_bytes:,} B, host_budget {host_budget:,} B")
    print(f"peak growth streamed {streamed['growth'] - streamed['arena']:,} B, whole {whole['growth'] - whole['arena']:,} B")


def test_quantized_records_are_encoded_while_streaming(tiny_checkpoint):
    path = tiny_checkpoint("qwen2_moe")
    with torch.no_grad():
        got = _load(path, STREAM, quantization="int8")(IDS).logits
        assert torch.equal(got, _load(path, WHOLE, quantization="int8")(IDS).logits)


@pytest.mark.parametrize("placement", ["dequant", "packed"])
def test_lossless_records_are_planned_and_encoded_while_streaming(tiny_checkpoint, placement):
    """Lossless records reserve room for escapes, sized from the weights: a streamed load plans them
    from the checkpoint one expert at a time, and computes exactly what the whole load computes."""
    from mira_hf.config import QuantConfig

    path = tiny_checkpoint("mixtral")
    kw = dict(quantization="lossless", quant=QuantConfig(placement=placement))
    with torch.no_grad():
        streamed = _load(path, STREAM, **kw)
        assert torch.equal(streamed(IDS).logits, _load(path, WHOLE, **kw)(IDS).logits)
        assert torch.equal(streamed(IDS).logits, _load(path, WHOLE)(IDS).logits)  # and what quantization=None computes


def test_a_model_unlike_its_skeleton_is_stored_again_from_it(tiny_checkpoint, monkeypatch):
    """Should transformers build experts unlike the skeleton's (modules, shapes, dtypes, keys), the experts
    stored from the skeleton are dropped and stored again from the model it built: the same model."""
    from mira_hf.checkpoint import StreamedExperts

    monkeypatch.setattr(StreamedExperts, "same_as", lambda self, other: False)
    order = _record_order(monkeypatch)
    path = tiny_checkpoint("mixtral")
    model = _load(path, STREAM)
    layers = len(model.mira.store.layers)
    assert order == ["experts"] * layers + ["model"] + ["experts"] * layers
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, load_reference(path)(IDS).logits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quantization", [None, "lossless"])
def test_cuda_streamed_load_stores_experts_before_the_other_weights(tiny_checkpoint, quantization, monkeypatch):
    """On a GPU, with the budget from its free memory (the skeleton's weights count as still to move there),
    the experts are stored (lossless: encoded on the device) before transformers loads the other weights,
    and the model computes what the same model loaded whole computes."""
    path = tiny_checkpoint("mixtral")
    order = _record_order(monkeypatch)
    cfg = dict(device="cuda", gpu_budget=None, quantization=quantization)
    streamed = MiraMoEModel.from_pretrained(path, MiraConfig(loader=STREAM, **cfg), progress=False).eval()
    assert order == ["experts"] * len(streamed.mira.store.layers) + ["model"]
    whole = MiraMoEModel.from_pretrained(path, MiraConfig(loader=WHOLE, **cfg), progress=False).eval()
    with torch.no_grad():
        assert torch.equal(streamed(IDS.cuda()).logits, whole(IDS.cuda()).logits)


def test_checkpoint_larger_than_available_memory_streams_without_host_budget(tiny_checkpoint, monkeypatch):
    import mira_hf.checkpoint as checkpoint

    calls = []
    real = checkpoint.load_without_experts
    monkeypatch.setattr(checkpoint, "load_without_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    path = tiny_checkpoint("olmoe")
    _load(path, LoaderConfig())
    assert calls == []  # fits in memory, no host budget: the ordinary load
    monkeypatch.setattr(checkpoint, "available_host_bytes", lambda: 1000)
    with torch.no_grad():
        assert torch.equal(_load(path, LoaderConfig())(IDS).logits, _load(path, WHOLE)(IDS).logits)
    assert calls == [1]


def test_a_checkpoint_that_fits_only_in_its_own_dtype_streams_when_loaded_in_a_wider_one(tiny_checkpoint, tmp_path, monkeypatch):
    """Whether the checkpoint fits in host memory is judged by the bytes it takes in the dtype it is loaded in, not by
    its files' size: a bf16 checkpoint loaded with dtype=float32 takes twice its files. Where available memory lies
    between the two it streams (as one larger than memory does), instead of being loaded whole and running out."""
    from transformers import AutoModelForCausalLM

    import mira_hf.checkpoint as checkpoint

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(make_config("mixtral")).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    files = sum(f.stat().st_size for f in (tmp_path / "bf16").glob("*.safetensors"))
    order = _record_order(monkeypatch)
    monkeypatch.setattr(checkpoint, "available_host_bytes", lambda: files * 3 // 2)
    _load(tmp_path / "bf16", LoaderConfig(), dtype=torch.bfloat16)
    assert "model" not in order  # fits in its own dtype: the ordinary load (no model loaded without its experts)
    order.clear()
    model = _load(tmp_path / "bf16", LoaderConfig(), dtype=torch.float32)
    assert order == ["experts"] * len(model.mira.store.layers) + ["model"]  # streamed
    assert model.mira.store.dtype(0) == torch.float32
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, _load(tmp_path / "bf16", WHOLE, dtype=torch.float32)(IDS).logits)


def test_a_checkpoint_that_cannot_stream_is_refused_by_its_size_in_the_dtype_it_is_loaded_in(
    tmp_path, monkeypatch, wrong_mixtral_table
):
    """A checkpoint whose experts cannot be read one at a time is loaded whole where it fits in host memory: judged by
    its bytes in the dtype it is loaded in (a bf16 checkpoint in float32: twice its files), else BudgetError."""
    from transformers import AutoModelForCausalLM

    import mira_hf.checkpoint as checkpoint

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(make_config("mixtral")).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    files = sum(f.stat().st_size for f in (tmp_path / "bf16").glob("*.safetensors"))
    monkeypatch.setattr(checkpoint, "available_host_bytes", lambda: files * 3 // 2)
    with pytest.raises(BudgetError, match="loading the whole checkpoint .* in the dtype it is loaded in"):
        _load(tmp_path / "bf16", LoaderConfig(), dtype=torch.float32, host_budget="10MB", offload_dir=str(tmp_path / "off"))
    with pytest.warns(UserWarning, match="cannot be read one at a time"):
        _load(tmp_path / "bf16", LoaderConfig(), dtype=torch.bfloat16, host_budget="10MB", offload_dir=str(tmp_path / "off"))


def test_hub_id_in_the_local_cache_streams(tiny_checkpoint, tmp_path):
    repo = tmp_path / "hub" / "models--mira--tiny-mixtral"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_checkpoint("mixtral"), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=STREAM)
    model = MiraMoEModel.from_pretrained("mira/tiny-mixtral", cfg, progress=False, cache_dir=str(tmp_path / "hub"))
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, _load(tiny_checkpoint("mixtral"), WHOLE)(IDS).logits)


def test_conversions_read_expert_by_expert_and_the_ones_refused():
    """Which of transformers' weight conversions are read one expert at a time: per-expert tensors stacked (and
    joined), stacked tensors joined along each expert's rows (Step 3.7's gate and up), rows interleaved within
    each expert (Inkling); anything else (a conversion joining experts, another operation) gives no keys."""
    from transformers.core_model_loading import Chunk, Concatenate, Interleave, MergeModulelist, WeightConverter

    from mira_hf.expert_keys import Interleaved, _converted

    def conv(sources, *ops):
        return WeightConverter(
            source_patterns=sources, target_patterns="mlp.experts.gate_up_proj", operations=list(ops)
        ).operations

    per_expert = [[f"m.experts.{e}.w1.weight" for e in range(3)], [f"m.experts.{e}.w3.weight" for e in range(3)]]
    stacked = [["m.moe.gate_proj.weight"], ["m.moe.up_proj.weight"]]
    both = ["experts.*.w1.weight", "experts.*.w3.weight"]
    assert _converted(conv(both, MergeModulelist(dim=0), Concatenate(dim=1)), per_expert, None, ()) == (
        "m.experts.{e}.w1.weight",
        "m.experts.{e}.w3.weight",
    )
    assert _converted(conv(["moe.gate_proj.weight", "moe.up_proj.weight"], Concatenate(dim=1)), stacked, None, ()) == (
        "m.moe.gate_proj.weight",
        "m.moe.up_proj.weight",
    )
    interleaved = _converted(conv(["experts.w13_weight"], Interleave(dim=1)), [["m.experts.w13_weight"]], None, ())
    assert isinstance(interleaved, Interleaved) and interleaved.dims == (0,)
    rows = torch.arange(12.0).view(6, 2)  # gate and up rows alternating
    assert torch.equal(interleaved.undo(rows), torch.cat([rows[0::2], rows[1::2]]))
    assert _converted(conv(["experts.w13_weight"], Interleave(dim=0)), [["m.experts.w13_weight"]], None, ()) is None
    assert _converted(conv(["moe.gate_proj.weight", "moe.up_proj.weight"], Concatenate(dim=0)), stacked, None, ()) is None
    assert _converted(conv(["experts.w13_weight"], Chunk(dim=1)), [["m.experts.w13_weight"]], None, ()) is None


def test_one_list_of_experts_dealt_to_two_modules_is_read_from_each_ones_chunk():
    """ERNIE-4.5-VL's checkpoints keep a layer's text experts then its vision experts in one list; transformers
    names every key after the text module and deals the list out in equal chunks as it converts. Each module
    reads its own chunk: the vision module's expert e is the list's expert E + e."""
    from transformers.core_model_loading import ErnieFuseAndSplitTextVisionExperts, WeightConverter

    from mira_hf.expert_keys import Offset, _converted, _split_targets, expert_key

    split = WeightConverter(
        source_patterns=["experts.*.gate_proj.weight", "experts.*.up_proj.weight"],
        target_patterns=["text_moe.experts.gate_up_proj", "vision_moe.experts.gate_up_proj"],
        operations=[ErnieFuseAndSplitTextVisionExperts(stack_dim=0, concat_dim=1)],
    )
    keys = [[f"m.experts.{e}.{p}_proj.weight" for e in range(6)] for p in ("gate", "up")]
    parts = _split_targets(split, "m.text_moe.experts.gate_up_proj", keys)
    assert {name: part.first for name, part in parts.items()} == {
        "m.text_moe.experts.gate_up_proj": 0,
        "m.vision_moe.experts.gate_up_proj": 3,
    }
    vision = parts["m.vision_moe.experts.gate_up_proj"]
    templates = Offset(_converted(vision.ops, vision.keys, None, (), vision.first), vision.first)
    assert [expert_key(t, templates, 1) for t in templates] == ["m.experts.4.gate_proj.weight", "m.experts.4.up_proj.weight"]
    assert templates != tuple(templates)  # the same templates counting from 0 are another module's keys
    # a chunk whose keys are not numbered from where it starts (experts missing from the list) gives no keys
    gaps = [[k for k in ks if ".2." not in k] for ks in keys]
    parts = _split_targets(split, "m.text_moe.experts.gate_up_proj", gaps)
    assert parts and all(_converted(p.ops, p.keys, None, (), p.first) is None for p in parts.values())


def _quantized_like_inkling2_loop(path, generator: torch.Generator) -> None:
    """Rewrite the experts of a saved Inkling 2 Loop checkpoint as its original checkpoints store them, which
    transformers dequantizes while it loads: gate/up in NVFP4 (two E2M1 codes per byte, a float8 scale per 16
    values, a per-expert amax over a denominator), down in MXFP8 (float8 values, a power-of-two scale per 32)."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for key in [k for k in tensors if k.endswith("mlp.experts.w13_weight")]:
        E, rows, cols = tensors[key].shape
        tensors[key] = torch.randint(0, 256, (E, rows, cols // 2), dtype=torch.uint8, generator=generator)
        scale = torch.rand(E, rows, cols // 16, generator=generator) + 0.5
        tensors[key + "_scale"] = scale.to(torch.float8_e4m3fn)
        tensors[key + "_amax"] = torch.rand(E, generator=generator) * 3 + 1  # fp32: transformers rounds it to the dtype
        tensors[key + "_outer_scale_denominator"] = torch.full((E,), 2688.0)
    for key in [k for k in tensors if k.endswith("mlp.experts.w2_weight")]:
        E, rows, cols = tensors[key].shape
        tensors[key] = (torch.randn(E, rows, cols, generator=generator) * 4).to(torch.float8_e4m3fn)
        tensors[key + "_scale"] = torch.randint(120, 127, (E, rows, cols // 32), dtype=torch.uint8, generator=generator)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_in_a_format_transformers_dequantizes_stream_exactly(tmp_path, dtype):
    """Experts stored in a format transformers converts with operations mira-hf does not know (Inkling 2 Loop's
    NVFP4 and MXFP8, dequantized while loading) stream expert by expert through those very operations: the
    model equals transformers' whole load bit for bit (`stream_experts=True` raises where it cannot stream)."""
    from transformers import AutoModelForCausalLM

    from mira_hf.testing import build

    config = config_or_skip("inkling2_loop_text")
    torch.manual_seed(0)
    build(config).to(dtype).save_pretrained(tmp_path)
    _quantized_like_inkling2_loop(tmp_path, torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=LoaderConfig(stream_experts=True))
    with pytest.warns(UserWarning, match="has no adapter"):
        model = MiraMoEModel.from_pretrained(tmp_path, cfg, dtype=dtype, progress=False)
    ids = torch.tensor([[5, 9, 17, 33, 42, 7, 64, 100]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    for name, tensor in ref.state_dict().items():
        if ".experts." in name:
            assert torch.equal(model.state_dict()[name], tensor), name


def test_a_conversion_that_mixes_experts_is_not_read_expert_by_expert(tmp_path):
    """A conversion whose output for one expert depends on the others (here each expert minus the experts'
    mean) cannot be read one expert at a time: the check of a module's whole stacks against its experts one by
    one says so (and `plan_keys` then finds no layout: the load says why, or loads the checkpoint whole)."""
    from transformers.core_model_loading import ConversionOps

    from mira_hf.expert_keys import PerExpert, check_per_expert

    class CentreExperts(ConversionOps):
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            (t,) = next(iter(input_dict.values()))
            return {target_patterns[0]: t - t.mean(dim=0, keepdim=True)}

    class Scale(ConversionOps):  # each expert on its own
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            (t,) = next(iter(input_dict.values()))
            return {target_patterns[0]: t * 2}

    from safetensors.torch import save_file
    from transformers.core_model_loading import WeightConverter

    stack = torch.randn(4, 6, 3)
    save_file({"m.experts.w": stack}, str(tmp_path / "model.safetensors"))
    index = ShardIndex.find(str(tmp_path), {})
    meta = torch.empty(4, 6, 3, device="meta")

    def templates(op):
        conv = WeightConverter(source_patterns=["experts.w"], target_patterns="experts.down_proj", operations=[op])
        return PerExpert(("m.experts.w",), ("experts.w",), conv, "m.experts.down_proj", meta, None, set())

    assert check_per_expert(index, templates(Scale()), meta) is None
    assert torch.equal(templates(Scale()).convert([stack[1:2]])[0], stack[1] * 2)
    problem = check_per_expert(index, templates(CentreExperts()), meta)
    assert "does not treat each expert on its own" in problem and "CentreExperts" in problem


def test_a_directory_with_both_one_file_and_an_index_streams_the_file_transformers_reads(tmp_path):
    """`save_pretrained` sharded into a directory that already held `model.safetensors` leaves both: transformers
    reads the single file, and so does a streamed load (the experts too, not the index's shards)."""
    from mira_hf.testing import build

    torch.manual_seed(0)
    build(make_config("mixtral")).save_pretrained(tmp_path, max_shard_size="100KB")
    torch.manual_seed(1)
    other = tmp_path / "other"
    build(make_config("mixtral")).save_pretrained(other)
    shutil.copy(other / "model.safetensors", tmp_path / "model.safetensors")
    ref = load_reference(str(tmp_path))
    for loader in (LoaderConfig(stream_experts=True), LoaderConfig(stream_experts=False)):
        model = _load(tmp_path, loader)
        assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())


def test_a_tensor_the_index_leaves_out_is_read_from_its_shard_as_transformers_does(tmp_path):
    """transformers loads every tensor of the files an index lists, even one its weight map leaves out: a streamed
    load reads it from its shard too."""
    from mira_hf.testing import build

    torch.manual_seed(0)
    build(make_config("mixtral")).save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    left_out = next(k for k in index["weight_map"] if ".experts." in k)
    del index["weight_map"][left_out]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ref = load_reference(str(tmp_path))
    model = _load(tmp_path, LoaderConfig(stream_experts=True))
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())


def test_a_key_mapping_given_to_from_pretrained_renames_the_expert_keys_too(tmp_path):
    """A checkpoint stored under other names, loaded with transformers' `key_mapping` (regex -> replacement on the
    checkpoint's keys): the experts are streamed under the names the mapping gives, as transformers reads the rest,
    and the model equals transformers' load with the same mapping."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from mira_hf.testing import build

    torch.manual_seed(0)
    build(make_config("mixtral")).save_pretrained(tmp_path / "orig", max_shard_size="100KB")
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    shutil.copy(tmp_path / "orig" / "config.json", renamed)
    index = json.loads((tmp_path / "orig" / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(tmp_path / "orig" / shard)
        save_file({k.replace("model.", "backbone.", 1): v for k, v in tensors.items()}, renamed / shard, {"format": "pt"})
    index["weight_map"] = {k.replace("model.", "backbone.", 1): v for k, v in index["weight_map"].items()}
    (renamed / "model.safetensors.index.json").write_text(json.dumps(index))
    mapping = {r"^backbone\.": "model."}
    ref = AutoModelForCausalLM.from_pretrained(renamed, key_mapping=mapping).eval()
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=LoaderConfig(stream_experts=True))
    model = MiraMoEModel.from_pretrained(renamed, cfg, progress=False, key_mapping=mapping).eval()  # streamed, or raises
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())


def _stale_entries(path, *keys: str) -> None:
    """An index whose weight map puts `keys` in shards that do not hold them (each in another listed shard)."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    for key in keys:
        index["weight_map"][key] = next(s for s in shards if s != index["weight_map"][key])
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_a_stale_index_entry_is_read_from_the_shard_that_holds_it(tmp_path):
    """transformers reads every tensor of every listed file, wherever the weight map puts it: an index that names
    the wrong shard for an expert tensor and for an attention weight loads (streamed and whole) as transformers
    loads it."""
    from mira_hf.testing import build

    torch.manual_seed(0)
    build(make_config("mixtral")).save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    expert = next(k for k in index["weight_map"] if ".experts." in k)
    _stale_entries(tmp_path, expert, "model.layers.0.self_attn.q_proj.weight")
    ref = load_reference(str(tmp_path))
    for loader in (STREAM, WHOLE):
        model = _load(tmp_path, loader)
        assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())


def test_torch_dtype_is_taken_as_dtype(tiny_checkpoint, tmp_path):
    """transformers still takes `torch_dtype`, its older name for `dtype`: streamed loads, loads through a model
    class and loads with a host budget are in that dtype too, equal to transformers' load."""
    from transformers import MixtralForCausalLM

    path = tiny_checkpoint("mixtral")
    ref = load_reference(path, torch.bfloat16)
    loads = [
        dict(mira_config=MiraConfig(device="cpu", gpu_budget=0.5, loader=STREAM)),
        dict(mira_config=MiraConfig(device="cpu", gpu_budget=0.5, host_budget="100KB", offload_dir=str(tmp_path))),
        dict(mira_config=MiraConfig(device="cpu", gpu_budget=0.5), model_class=MixtralForCausalLM),
    ]
    for kw in loads:
        model = MiraMoEModel.from_pretrained(path, progress=False, torch_dtype=torch.bfloat16, **kw).eval()
        assert model.dtype == torch.bfloat16
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, ref(IDS).logits)


def test_a_config_path_is_read_as_the_class_loading_it_reads_it(tiny_checkpoint, tmp_path):
    """`config=<path>`: the auto class ignores it (it reads the checkpoint's config.json), a model class reads its
    config from there; whole, streamed and host-budget loads build the model transformers builds for the same call."""
    from transformers import AutoConfig, AutoModelForCausalLM, MixtralForCausalLM

    path, other = tiny_checkpoint("mixtral"), str(tmp_path / "config")
    config = AutoConfig.from_pretrained(path)
    config.num_experts_per_tok = 1
    config.save_pretrained(other)
    host_budget = dict(host_budget="100KB", offload_dir=str(tmp_path / "offload"))
    for cls in (AutoModelForCausalLM, MixtralForCausalLM):
        ref = cls.from_pretrained(path, config=other).eval()
        for kw in (dict(loader=WHOLE), dict(loader=STREAM), host_budget):
            cfg = MiraConfig(device="cpu", gpu_budget=0.5, **kw)
            model = MiraMoEModel.from_pretrained(path, cfg, model_class=cls, config=other, progress=False).eval()
            assert model.config.num_experts_per_tok == ref.config.num_experts_per_tok
            with torch.no_grad():
                assert torch.equal(model(IDS).logits, ref(IDS).logits)


def test_output_loading_info_gives_the_wrapped_model_and_what_transformers_reports(tiny_checkpoint, tmp_path):
    """`output_loading_info=True`: (the wrapped model, the loading info transformers' own load of the checkpoint
    reports), whole or streamed: a key missing and keys unexpected are reported, those beside the experts' tensors
    under an experts module too (named as transformers names them), the streamed experts are not."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    shutil.copytree(tiny_checkpoint("mixtral"), tmp_path / "ckpt")
    weights = load_file(tmp_path / "ckpt" / "model.safetensors")
    weights["model.extra.weight"] = weights.pop("model.norm.weight")
    weights["model.layers.0.block_sparse_moe.experts.0.w1.stray"] = torch.zeros(3)
    weights["model.layers.1.block_sparse_moe.experts.extra"] = torch.zeros(3)
    save_file(weights, tmp_path / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    _, expected = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", output_loading_info=True)
    stray = {"model.layers.0.mlp.experts.0.w1.stray", "model.layers.1.mlp.experts.extra"}
    assert expected["missing_keys"] == {"model.norm.weight"} and expected["unexpected_keys"] == {"model.extra.weight", *stray}
    host_budget = dict(host_budget="100KB", offload_dir=str(tmp_path / "offload"))
    for kw in (dict(loader=WHOLE), dict(loader=STREAM), host_budget):
        cfg = MiraConfig(device="cpu", gpu_budget=0.5, **kw)
        model, info = MiraMoEModel.from_pretrained(tmp_path / "ckpt", cfg, progress=False, output_loading_info=True)
        assert model.mira.store.num_experts(0) == 8 and info == expected  # wrapped, with every expert
