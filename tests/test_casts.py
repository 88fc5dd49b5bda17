"""Casts and moves of a wrapped model: served exactly as the same cast of the unwrapped model, or refused
before anything changes (the model, its store and its forward stay as they were)."""

import copy
import os

import pytest
import torch
from conftest import load_reference
from transformers import AutoModelForCausalLM

from mira_hf import BudgetError, ConfigError, DeviceError, MiraConfig, MiraMoEModel, UnsupportedOperationError
from mira_hf.proxy import MiraExperts

IDS = torch.tensor([[4, 8, 15, 16, 23, 42, 7], [1, 2, 3, 5, 8, 13, 21]])

# name -> what it does to a module. Every cast changes the dtype the experts compute in.
CASTS = {
    "half": lambda m: m.half(),
    "bfloat16": lambda m: m.bfloat16(),
    "to_bf16": lambda m: m.to(torch.bfloat16),
    "to_fp16": lambda m: m.to(torch.float16),
    "to_cpu_bf16": lambda m: m.to("cpu", torch.bfloat16),
}
# Families whose experts weigh and sum their outputs in different ways (routing weights in fp32 or in the hidden
# dtype, a shared expert beside the routed ones, input-scaled experts): a cast wrapped model equals the cast unwrapped one.
EXACT_FAMILIES = ["mixtral", "deepseek_v3", "llama4", "gpt_oss", "qwen2_moe", "qwen3_moe"]


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _wrapped(path, **kw):
    return MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", **{"gpu_budget": 0.5, **kw}), progress=False).eval()


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a, b):
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", EXACT_FAMILIES)
@pytest.mark.parametrize("cast", sorted(CASTS))
def test_a_cast_gives_what_the_same_cast_of_the_unwrapped_model_gives(tiny_checkpoint, name, cast):
    path = tiny_checkpoint(name)
    ref, model = CASTS[cast](load_reference(path)), _wrapped(path)
    _logits(model)  # the cache holds fp32 experts before the cast
    assert CASTS[cast](model) is model
    assert model.dtype == ref.dtype and {p.dtype for p in model.parameters()} == {ref.dtype}
    assert model.mira.store.dtype(0) == ref.dtype
    assert torch.equal(_logits(model), _logits(ref))
    assert _same(model.state_dict(), ref.state_dict())


def test_float_after_a_bf16_load_serves_fp32_and_rescales_a_fraction_budget(tiny_checkpoint):
    """The notebook habit: load in bf16, then `model.float()`."""
    path = tiny_checkpoint("mixtral")
    model = MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", gpu_budget=0.5), dtype=torch.bfloat16, progress=False)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval().float()
    budget = model.mira.stats()["budget_bytes"]
    _logits(model)
    model.float()
    assert model.dtype == torch.float32 and model.mira.store.dtype(1) == torch.float32
    assert torch.equal(_logits(model), _logits(ref))
    assert model.mira.stats()["budget_bytes"] == 2 * budget  # half of the experts' bytes, now in fp32


def test_a_fraction_budget_of_a_split_model_stays_a_share_of_its_whole_experts_across_casts(tiny_checkpoint):
    """With host_compute="split" the slots hold device parts, and a fractional budget is still a share of the whole
    experts' bytes, in the dtype of the moment: half of them at load, after a cast to bf16 and back."""
    path = tiny_checkpoint("mixtral")
    model = _wrapped(path, host_compute="split", host_share=0.25)
    whole = 2 * 8 * (128 * 64 + 64 * 64) * 4  # two layers of eight fp32 experts
    slots = sorted(model.mira.budget.n_slots.values())
    assert model.mira.stats()["budget_bytes"] == whole // 2
    model.bfloat16()
    assert model.mira.stats()["budget_bytes"] == whole // 4 and sorted(model.mira.budget.n_slots.values()) == slots
    model.float()
    assert model.mira.stats()["budget_bytes"] == whole // 2 and sorted(model.mira.budget.n_slots.values()) == slots


def test_a_cast_to_a_budget_that_no_longer_fits_is_refused_before_anything_changes(tiny_checkpoint):
    """A byte budget of three bf16 experts holds the top-2 of a layer in bf16, not in fp32."""
    path = tiny_checkpoint("mixtral")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    record = 64 * 64 * 2 * 3  # one bf16 expert: gate_up [128, 64] and down [64, 64]
    MiraMoEModel.wrap(model, MiraConfig(device="cpu", gpu_budget=3 * record))
    assert model.mira.store.record_bytes(0) == record
    before, expected = _snapshot(model), _logits(model)
    with pytest.raises(BudgetError, match="below the minimum working set"):
        model.float()
    assert model.dtype == torch.bfloat16 and _same(model.state_dict(), before)
    assert torch.equal(_logits(model), expected)


@pytest.mark.parametrize("cast", ["half", "bfloat16", "double"])
def test_a_cast_of_lossy_experts_is_refused_before_anything_changes(tiny_checkpoint, cast):
    model = _wrapped(tiny_checkpoint("mixtral"), quantization="int8")
    expected, records = _logits(model), model.mira.store._slabs[0].data.clone()
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    with pytest.raises(UnsupportedOperationError, match="int8 \\(lossy\\).*Nothing was changed.*from_pretrained"):
        getattr(model, cast)()
    assert {n: p.dtype for n, p in model.named_parameters()} == dtypes
    assert torch.equal(model.mira.store._slabs[0].data, records)
    assert torch.equal(_logits(model), expected)


@pytest.mark.parametrize("placement", ["packed", "dequant", "mixed"])
def test_lossless_experts_follow_every_cast_exactly_fp16_ones_decoded_then_cast(tiny_checkpoint, placement):
    """Lossless records hold bf16 and fp32. A cast that rounds (fp32 to bf16) encodes them again; one their format
    cannot hold (to fp16) or that rounds nothing (bf16 to fp32) leaves them as they are, and each use decodes them to
    their own dtype and casts that, as the unwrapped model's cast rounds its tensors. Either way the logits, state
    dict and tokens are the unwrapped cast model's. Records cast to fp16 take no other fp16 values (the model's own
    state dict loads back) and are not saved as a store."""
    from mira_hf.config import QuantConfig

    path = tiny_checkpoint("mixtral")
    budget = 1.0 if placement == "mixed" else 0.5  # mixed: every expert fits only with some kept packed
    model = _wrapped(path, quantization="lossless", quant=QuantConfig(placement=placement), gpu_budget=budget)
    ref = load_reference(path)
    store = model.mira.store
    steps = [("half", torch.float16), ("bfloat16", torch.bfloat16), ("half", torch.float16), ("float", torch.float32)]
    for cast, dtype in steps:
        records = store._slabs[0].data.clone()
        getattr(model, cast)()
        getattr(ref, cast)()
        assert model.dtype == dtype and store.dtype(0) == dtype and model.mira.placement == placement
        assert store.quantized and store.codec.name == "lossless"
        assert torch.equal(_logits(model), _logits(ref))
        assert _same(model.state_dict(), ref.state_dict())
        # the records as they were (fp32 ones from the load, then bf16 ones from the cast to bf16), except where rounded
        assert store.cast_in_place == (cast != "bfloat16") and torch.equal(store._slabs[0].data, records) == (cast != "bfloat16")
        if cast == "half":
            assert store.layout(0).chain[-1] == torch.float16
            assert not model.load_state_dict(model.state_dict()).missing_keys
            changed = {k: v * 2 if ".experts." in k else v for k, v in ref.state_dict().items()}
            with pytest.raises(RuntimeError, match="cast to torch.float16 after loading.*model.unload"):
                model.load_state_dict(changed)
            with pytest.raises(ConfigError, match="save_store.*cast after loading"):
                model.mira.save_store(str(tiny_checkpoint("mixtral")) + "-store")
            kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
            assert torch.equal(model.generate(IDS, **kw), ref.generate(IDS, **kw))
    assert store.layout(0).chain == (torch.bfloat16, torch.float16, torch.float32)


def test_assign_of_values_the_records_cannot_hold_is_refused_before_the_layer_is_cast(tiny_checkpoint):
    """`load_state_dict(assign=True)` casts a layer to the given tensors' dtype. Lossless records cast to fp16 stay
    in their own dtype, so fp16 tensors other than the model's own cast are refused before the cast (the experts keep
    their dtype and values); the model's own tensors cast to fp16 are taken, as a cast."""
    path = tiny_checkpoint("mixtral")
    model = _wrapped(path, quantization="lossless")
    experts = {k: v.clone() for k, v in model.state_dict().items() if ".experts." in k}
    changed = {k: v.half() * 1.5 if ".experts." in k else v.half() for k, v in load_reference(path).state_dict().items()}
    with pytest.raises(
        RuntimeError, match=r"assign=True\) gave MoE layer 0's experts torch\.float16 tensors.*Nothing was changed"
    ):
        model.load_state_dict(changed, assign=True)
    state = model.state_dict()
    assert all(state[k].dtype == torch.float32 and torch.equal(state[k], v) for k, v in experts.items())
    assert not model.mira.store.cast_in_place
    own = {k: v.half() for k, v in model.state_dict().items()}
    model.load_state_dict(own, assign=True)
    assert model.mira.store.cast_in_place and all(torch.equal(model.state_dict()[k], own[k]) for k in experts)


@pytest.mark.parametrize("placement", ["packed", "dequant"])
def test_a_bf16_lossless_model_cast_to_fp32_keeps_its_records_and_takes_new_values(tiny_checkpoint, placement):
    """The notebook habit, load in bf16 then `model.float()`, on lossless records: nothing is rounded, so the records
    stay (no encoding, host memory and copies as small as bf16's) and each use decodes them and widens to fp32. New
    fp32 values in `load_state_dict` are encoded as fp32 records, as they would be in a model loaded in fp32."""
    from mira_hf.config import QuantConfig

    path = tiny_checkpoint("mixtral")
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, quantization="lossless", quant=QuantConfig(placement=placement))
    model = MiraMoEModel.from_pretrained(path, cfg, dtype=torch.bfloat16, progress=False).eval()
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    store = model.mira.store
    records, nbytes = store._slabs[1].data.clone(), store.nbytes
    model.float()
    ref.float()
    assert store.dtype(1) == torch.float32 and store.layout(1).chain == (torch.bfloat16, torch.float32)
    assert torch.equal(store._slabs[1].data, records) and store.nbytes == nbytes
    assert torch.equal(_logits(model), _logits(ref)) and _same(model.state_dict(), ref.state_dict())
    changed = {k: v * 1.001 if ".experts." in k else v for k, v in ref.state_dict().items()}  # fp32, not bf16, values
    model.load_state_dict(changed)
    ref.load_state_dict(changed)
    assert not store.cast_in_place and store.dtype(1) == torch.float32
    assert torch.equal(_logits(model), _logits(ref)) and _same(model.state_dict(), ref.state_dict())


@pytest.mark.parametrize("cast", ["half", "bfloat16"])
def test_unload_and_save_pretrained_after_a_cast_give_one_dtype(tiny_checkpoint, tmp_path, cast):
    path = tiny_checkpoint("mixtral")
    model = _wrapped(path)
    getattr(model, cast)()
    ref = getattr(load_reference(path), cast)()
    model.save_pretrained(tmp_path)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto").eval()
    assert {p.dtype for p in saved.parameters()} == {ref.dtype}
    # the same weights (logits differ from a cast model's in any model loaded in a dtype: it keeps rotary buffers in fp32)
    assert _same(saved.state_dict(), ref.state_dict())
    back = model.unload()
    assert {p.dtype for p in back.parameters()} == {ref.dtype}
    assert _same(back.state_dict(), ref.state_dict()) and torch.equal(_logits(back), _logits(ref))


def test_static_cache_generation_after_a_cast(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    model, ref = _wrapped(path).bfloat16(), load_reference(path).bfloat16()
    kw = dict(max_new_tokens=8, do_sample=False, cache_implementation="static", pad_token_id=0)
    assert torch.equal(model.generate(IDS, **kw), ref.generate(IDS, **kw))


def test_moves_to_the_same_device_change_nothing_and_others_are_refused_before_anything_changes(tiny_checkpoint):
    model = _wrapped(tiny_checkpoint("mixtral"))
    expected, before = _logits(model), _snapshot(model)
    arena = model.mira.arena.slabs
    assert model.cpu() is model and model.to("cpu") is model and model.to(model.device) is model
    assert model.mira.arena.slabs is arena  # a move to where it is keeps the cache
    with pytest.raises(DeviceError, match="mira-hf keeps the expert cache on cpu, cuda devices only.*Nothing was changed"):
        model.to("meta")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="Nothing was changed"):
            model.cuda()
    assert model.device == torch.device("cpu") and _same(model.state_dict(), before)
    assert torch.equal(_logits(model), expected)


@pytest.mark.parametrize("part", ["model.layers.0", "model.layers.1.mlp", "model.layers.0.mlp.experts"])
def test_a_cast_of_a_part_holding_some_experts_casts_those_as_the_unwrapped_model_does(tiny_checkpoint, part):
    """As in the unwrapped model, a part cast on its own casts its tensors, its experts included, and no others."""
    path = tiny_checkpoint("mixtral")
    model, ref = _wrapped(path), load_reference(path)
    _logits(model)  # the cache holds fp32 experts
    assert model.get_submodule(part).half() is model.get_submodule(part)
    ref.get_submodule(part).half()
    held = 0 if part.startswith("model.layers.0") else 1
    assert [model.mira.store.dtype(layer) for layer in (0, 1)] == [
        torch.float16 if layer == held else torch.float32 for layer in (0, 1)
    ]
    assert _same(model.state_dict(), ref.state_dict())
    model.half()  # the rest follows: the whole model in one dtype, computing what the unwrapped one does
    ref.half()
    assert torch.equal(_logits(model), _logits(ref)) and _same(model.state_dict(), ref.state_dict())


def test_apply_of_a_cast_to_every_module_casts_the_model_as_the_unwrapped_one(tiny_checkpoint):
    """`model.apply(lambda m: m.to(dtype))` reaches each module in turn, experts modules among them: each cast
    follows, and the model ends in one dtype with the unwrapped model's logits."""
    path = tiny_checkpoint("mixtral")
    model, ref = _wrapped(path), load_reference(path)
    _logits(model)
    model.apply(lambda m: m.to(torch.bfloat16))
    ref.apply(lambda m: m.to(torch.bfloat16))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} == {model.mira.store.dtype(i) for i in (0, 1)}
    assert torch.equal(_logits(model), _logits(ref)) and _same(model.state_dict(), ref.state_dict())


@pytest.mark.parametrize("name", ["mixtral", "dbrx", "jetmoe"])
def test_apply_of_a_cast_to_the_experts_modules_alone_casts_their_experts(tiny_checkpoint, name):
    """`model.apply(fn)` where `fn` casts the modules of the experts class alone (found by `isinstance`): their
    tensors, the experts among them, are cast as in the unwrapped model, and nothing else."""
    path = tiny_checkpoint(name)
    model, ref = _wrapped(path), load_reference(path)
    _logits(model)  # the cache holds fp32 experts
    experts = next(p for p, m in model.named_modules() if isinstance(m, MiraExperts))
    experts_class = type(ref.get_submodule(experts))
    for m in (model, ref):
        m.apply(lambda module: module.half() if isinstance(module, experts_class) else None)
    assert {model.mira.store.dtype(layer) for layer in model.mira.store.layers} == {torch.float16}
    assert _same(model.state_dict(), ref.state_dict())
    try:  # fp32 rows reach fp16 experts: transformers' grouped matmul casts the rows, others may refuse the mix
        expected = _logits(ref)
    except RuntimeError:
        return
    assert torch.equal(_logits(model), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_move_of_a_part_holding_some_experts_is_refused_before_anything_changes(tiny_checkpoint):
    model = _wrapped(tiny_checkpoint("mixtral"))
    expected, before = _logits(model), _snapshot(model)
    with pytest.raises(UnsupportedOperationError, match="Nothing was changed.*on the model itself"):
        model.model.layers[0].cuda()
    assert _same(model.state_dict(), before) and torch.equal(_logits(model), expected)


def test_a_cast_of_a_part_holding_every_expert_is_served(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    model, ref = _wrapped(path), load_reference(path)
    model.model.half()
    ref.model.half()
    assert model.mira.store.dtype(0) == torch.float16 and model.lm_head.weight.dtype == torch.float32
    assert _same(model.state_dict(), ref.state_dict())


def test_calls_of_apply_that_change_neither_dtype_nor_device_leave_the_experts_alone(tiny_checkpoint):
    model = _wrapped(tiny_checkpoint("mixtral"))
    expected = _logits(model)
    model.requires_grad_(False)
    model.share_memory()
    copy.copy(model.config)
    assert torch.equal(_logits(model), expected)


def test_predictors_read_the_routers_of_the_cast_model(tiny_checkpoint):
    """A cast gives the routers' buffers (DeepSeek-V3's selection bias) new tensors: the gate predictor
    reads those, not the ones from before the cast."""
    model = _wrapped(tiny_checkpoint("deepseek_v3"), predictor="gate")
    _logits(model)
    model.bfloat16()
    _logits(model)
    block = model.model.layers[2].mlp
    assert model.mira.router_probs.linear(1).correction is block.gate.e_score_correction_bias
    assert model.mira.predictor._plan(0)[1][0].correction is block.gate.e_score_correction_bias


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_moves_between_cpu_and_cuda_take_the_cache_along_and_serve_exactly(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), _wrapped(path)
    _logits(model)  # experts resident in the CPU cache
    model.cuda()
    assert model.device.type == "cuda" and model.mira.device.type == "cuda"
    assert all(arena.device.type == "cuda" for arena in model.mira.arena.slabs.values())
    assert all(p.device.type == "cpu" for n, p in model.named_parameters() if ".experts." in n)  # the store stays
    with torch.no_grad():
        got, want = model(IDS.cuda()).logits, ref.cuda()(IDS.cuda()).logits
    assert torch.equal(got, want)
    model.bfloat16()
    ref.bfloat16()
    with torch.no_grad():
        assert torch.equal(model(IDS.cuda()).logits, ref(IDS.cuda()).logits)
    model.float().cpu()
    assert model.mira.device.type == "cpu" and torch.equal(_logits(model), _logits(ref.float().cpu()))


def test_a_cast_re_encodes_experts_on_the_disk_tier(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("mixtral")
    model = _wrapped(path, host_budget="1KB", offload_dir=str(tmp_path))
    assert model.mira.store.tier(0) == model.mira.store.tier(1) == "disk"
    files = sorted(os.listdir(tmp_path))
    model.bfloat16()
    ref = load_reference(path).bfloat16()
    assert model.mira.store.tier(0) == "disk" and len(os.listdir(tmp_path)) == len(files)  # new files, the old removed
    assert torch.equal(_logits(model), _logits(ref)) and _same(model.state_dict(), ref.state_dict())
    model.unload()
    assert os.listdir(tmp_path) == []


def test_a_cast_that_offload_dir_has_no_room_for_is_refused_before_anything_changes(tiny_checkpoint, tmp_path, monkeypatch):
    """A cast to fp32 of bf16 experts on the disk tier writes each layer's new file, twice as large, while its old one
    is still there: three bf16 layers' bytes at the most for two layers. Where offload_dir's disk has less free, the
    cast is refused with BudgetError naming the bytes before anything changes (the files, the dtype and the forward
    stay), as a load is refused; writing on would end the process (SIGBUS) once the disk is full. A disk that fills up
    during the cast all the same is a BudgetError too, the layer being written left as it was."""
    import errno
    import shutil

    path = tiny_checkpoint("mixtral")
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, host_budget="1KB", offload_dir=str(tmp_path))  # every layer on disk
    model = MiraMoEModel.from_pretrained(path, cfg, progress=False, dtype=torch.bfloat16).eval()
    store = model.mira.store
    layer = store.num_experts(0) * store.record_bytes(0)
    files, before, expected = sorted(os.listdir(tmp_path)), _snapshot(model), _logits(model)
    free = [3 * layer - 1]
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 0, free[0]))
    with pytest.raises(BudgetError, match=rf"this cast writes {3 * layer:,} bytes of experts to offload_dir=.*Nothing was"):
        model.float()
    real = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, o, n: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    free[0] = 3 * layer
    with pytest.raises(BudgetError, match="MoE layer 0's experts need"):
        model.float()
    assert model.dtype == torch.bfloat16 and store.dtype(0) == store.dtype(1) == torch.bfloat16
    assert sorted(os.listdir(tmp_path)) == files and _same(model.state_dict(), before)
    assert torch.equal(_logits(model), expected)
    monkeypatch.setattr(os, "posix_fallocate", real)
    model.float()  # room for it
    assert store.dtype(0) == torch.float32 and len(os.listdir(tmp_path)) == 2
    assert torch.equal(_logits(model), _logits(load_reference(path, dtype=torch.bfloat16).float()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_model_casts_on_its_device_and_moves_to_the_cpu_and_back(tiny_checkpoint):
    """Wrapped on CUDA (pinned store, gpu_budget=None: sized from free memory at load)."""
    path = tiny_checkpoint("mixtral")
    model = MiraMoEModel.from_pretrained(path, MiraConfig(device="cuda"), progress=False).eval()
    ref = load_reference(path).cuda()
    budget = model.mira.budget.budget_bytes
    model.bfloat16()
    ref.bfloat16()
    with torch.no_grad():
        assert torch.equal(model(IDS.cuda()).logits, ref(IDS.cuda()).logits)
    assert model.mira.budget.budget_bytes == budget and model.mira.store.tier(0) == "pinned"
    model.cpu()
    ref.cpu()
    assert model.mira.device.type == "cpu" and torch.equal(_logits(model), _logits(ref))
    model.cuda()
    ref.cuda()
    with torch.no_grad():
        assert torch.equal(model(IDS.cuda()).logits, ref(IDS.cuda()).logits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("placement", ["packed", "dequant"])
def test_lossless_records_cast_to_fp16_on_cuda_decode_then_cast_exactly(tiny_checkpoint, placement):
    """On CUDA the records cast in place decode on the device (Triton), into a slot through the copy stream
    ("dequant") or into the scratch buffer at each use ("packed"), then cast: the unwrapped fp16 model's bits."""
    from mira_hf.config import QuantConfig

    path = tiny_checkpoint("mixtral")
    cfg = MiraConfig(device="cuda", gpu_budget=0.5, quantization="lossless", quant=QuantConfig(placement=placement))
    model = MiraMoEModel.from_pretrained(path, cfg, dtype=torch.bfloat16, progress=False).eval()
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval().cuda()
    model.half()
    ref.half()
    assert model.mira.store.cast_in_place and model.mira.device.type == "cuda"
    ids = IDS.cuda()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    on_host = lambda sd: {k: v.cpu() for k, v in sd.items()}  # noqa: E731  (the wrapped model's experts are the host store's)
    assert _same(on_host(model.state_dict()), on_host(ref.state_dict()))


def test_a_cast_of_a_mixed_placement_plans_its_kept_experts_again_and_serves_exactly(tiny_checkpoint):
    """Placement "mixed" keeps a few experts packed where every expert fits only so; a cast re-encodes the records
    (fp32 ones compress less than bf16 ones), and the plan made again keeps what the new records need."""
    from mira_hf.config import QuantConfig

    path = tiny_checkpoint("mixtral")
    model = _wrapped(path, quantization="lossless", quant=QuantConfig(placement="mixed"), gpu_budget=1.0)
    assert model.mira.budget.kept  # the codec buffers come out of the budget: every expert fits only with some kept
    ref = load_reference(path)
    assert torch.equal(_logits(model), _logits(ref))
    model.bfloat16()  # smaller records: a different number kept, or none
    assert model.mira.placement == "mixed" and model.mira.store.dtype(0) == torch.bfloat16
    assert sum(map(len, model.mira.budget.kept.values())) + sum(model.mira.budget.n_slots.values()) == 2 * 8
    assert model.mira.device_bytes <= model.mira.stats()["budget_bytes"]
    assert torch.equal(_logits(model), _logits(ref.bfloat16()))
    assert _same(model.state_dict(), ref.state_dict())


def test_a_cast_refused_through_apply_says_the_modules_before_stay_cast(tiny_checkpoint):
    """`model.apply(fn)` casts each module as it reaches it: where the experts refuse the cast (int8 records, whose
    cast would not be the unwrapped model's), the error says the modules it reached before are cast, and what to do."""
    model = _wrapped(tiny_checkpoint("mixtral"), quantization="int8")
    with pytest.raises(UnsupportedOperationError, match=r"came through model\.apply.*those stay changed"):
        model.apply(lambda m: m.to(torch.float16))
    with pytest.raises(UnsupportedOperationError, match="Nothing was changed") as refused:
        model.half()
    assert "model.apply" not in str(refused.value)
