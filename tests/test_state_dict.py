"""A wrapped model's routed experts are its parameters, as in the unwrapped model: the same state dict
(names, shapes, dtypes, values), parameter counts and footprint, and `load_state_dict` writes experts."""

import os

import pytest
import torch
from conftest import ALL_TINY, load_reference
from tiny_models import make_config
from transformers import AutoModelForCausalLM

from mira_hf import MiraConfig, MiraMoEModel

IDS = torch.tensor([[4, 8, 15, 16, 23, 42, 7], [1, 2, 3, 5, 8, 13, 21]])


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _wrapped(path, **kw):
    return MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", **{"gpu_budget": 0.5, **kw}), progress=False).eval()


def _other_weights(name):
    """The state dict of another random model of the same family (other values, same names)."""
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(make_config(name)).eval()


@pytest.mark.parametrize("name", ALL_TINY)
def test_state_dict_and_parameters_equal_the_unwrapped_models(tiny_checkpoint, name):
    path = tiny_checkpoint(name)
    ref, model = load_reference(path), _wrapped(path)
    expected, got = ref.state_dict(), model.state_dict()
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert got[key].shape == value.shape and got[key].dtype == value.dtype, key
        assert torch.equal(got[key], value), key
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert model.num_parameters() == ref.num_parameters()
    assert model.num_parameters(only_trainable=True) == ref.num_parameters(only_trainable=True)
    assert model.get_memory_footprint() == ref.get_memory_footprint()


def test_expert_parameters_are_views_of_the_host_store(tiny_checkpoint):
    """Uncompressed records: each expert parameter views its layer's slab (no copy, never on the device), each on
    a storage of its own, so that tensors of one layer do not look tied to storage-identity checks."""
    model = _wrapped(tiny_checkpoint("mixtral"))
    store = model.mira.store
    for proxy in (m for m in model.modules() if hasattr(m, "manager")):
        slab = store._slabs[proxy.layer].data
        start, end = slab.data_ptr(), slab.data_ptr() + slab.numel()
        storages = set()
        for name, param in proxy.named_parameters(recurse=False):
            storage = param.untyped_storage()
            assert param.device.type == "cpu" and start <= storage.data_ptr() and storage.data_ptr() + storage.nbytes() <= end
            assert param.shape[0] == store.num_experts(proxy.layer), name
            storages.add(storage.data_ptr())
            with torch.no_grad():  # writing through the parameter writes the record
                before = param[-1].flatten()[-1].clone()
                param[-1].flatten()[-1] += 1
                assert torch.equal(store.fused(proxy.layer)[name][-1].flatten()[-1], before + 1)
                param[-1].flatten()[-1] = before
        assert len(storages) == len(dict(proxy.named_parameters(recurse=False)))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama4", "dbrx", "jetmoe"])
def test_state_dict_round_trip_into_a_fresh_unwrapped_model(tiny_checkpoint, tmp_path, name):
    path = tiny_checkpoint(name)
    ref, model = load_reference(path), _wrapped(path)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    fresh = _other_weights(name)
    result = fresh.load_state_dict(torch.load(tmp_path / "sd.pt"), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    expected = _other_weights(name)  # the same weights as built in memory (a CPU kernel may round by address)
    expected.load_state_dict(ref.state_dict())
    assert torch.equal(_logits(fresh), _logits(expected))


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "llama4", "dbrx", "jetmoe"])
@pytest.mark.parametrize("quantization", [None, "lossless"])
def test_load_state_dict_into_a_wrapped_model_serves_the_loaded_weights(tiny_checkpoint, name, quantization):
    """After a forward has filled the cache, loading other weights gives their outputs exactly (no stale
    expert survives in a slot), and the state dict reads them back."""
    path = tiny_checkpoint(name)
    model = _wrapped(path, quantization=quantization)
    _logits(model)  # experts resident in the cache
    other = _other_weights(name)
    result = model.load_state_dict(other.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    expected = load_reference(path)  # loaded as the wrapped model was: its other weights where the file put them
    expected.load_state_dict(other.state_dict())  # (a CPU kernel may round a weight by its address: JetMoE's MoA)
    assert torch.equal(_logits(model), _logits(expected))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in other.state_dict().items())


def test_lossless_experts_are_meta_placeholders_and_state_dict_decodes_them(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), _wrapped(path, quantization="lossless")
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.is_meta and experts.gate_up_proj.shape == ref.model.layers[0].mlp.experts.gate_up_proj.shape
    assert model.num_parameters() == ref.num_parameters()
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())


def test_lossy_state_dict_warns_that_it_gives_dequantized_weights(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), _wrapped(path, quantization="int8")
    with pytest.warns(UserWarning, match="int8: state_dict\\(\\) gives their dequantized values"):
        got = model.state_dict()
    expected = ref.state_dict()
    assert list(got) == list(expected)
    assert all(got[k].shape == v.shape and got[k].dtype == v.dtype for k, v in expected.items())


def test_missing_unexpected_and_mis_shaped_keys_are_reported_as_torch_reports_them(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), _wrapped(path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    key = "model.layers.1.mlp.experts.gate_up_proj"
    partial = {k: v for k, v in _other_weights("mixtral").state_dict().items() if k != key}
    partial["model.layers.1.mlp.experts.w9"] = torch.zeros(3)
    # the same lists as the unwrapped model reports
    expected = load_reference(path).load_state_dict(partial, strict=False)
    got = model.load_state_dict(partial, strict=False)
    assert got.missing_keys == expected.missing_keys == [key]
    assert got.unexpected_keys == expected.unexpected_keys == ["model.layers.1.mlp.experts.w9"]
    assert torch.equal(model.state_dict()[key], before[key])  # what was not given stays
    with pytest.raises(RuntimeError, match=f'(?s)Missing key\\(s\\) in state_dict: "{key}".*Unexpected key'):
        model.load_state_dict(partial, strict=True)
    bad = dict(ref.state_dict())
    bad[key] = torch.zeros(8, 3, 64)
    with pytest.raises(RuntimeError, match=f"size mismatch for {key}: copying a param with shape"):
        load_reference(path).load_state_dict(bad)
    model.load_state_dict(before)
    with pytest.raises(RuntimeError, match=f"size mismatch for {key}: copying a param with shape"):
        model.load_state_dict(bad)
    assert torch.equal(model.state_dict()[key], before[key])  # the mis-shaped tensor changed nothing
    assert torch.equal(_logits(model), _logits(ref))


def test_a_reload_from_a_weightless_checkpoint_misses_every_parameter_of_the_wrapped_model(tiny_checkpoint, tmp_path):
    """transformers' check that no parameter goes unreported: save, replace the weights by a placeholder,
    reload; the missing keys are exactly the wrapped model's parameter and buffer names."""
    from safetensors.torch import save_file

    model = _wrapped(tiny_checkpoint("mixtral"))
    model.save_pretrained(tmp_path)
    for f in os.listdir(tmp_path):
        if f.endswith(".safetensors") or f.endswith(".json") and "index" in f:
            os.remove(tmp_path / f)
    save_file({"tensor": torch.tensor([1, 2])}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    names = {n for n, _ in model.named_parameters()} | set(model.state_dict())
    assert set(info["missing_keys"]) == names


def test_optimizer_device_dtype_and_modes_see_an_ordinary_model(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    model = _wrapped(path)
    expected = _logits(model)
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    torch.optim.AdamW(model.parameters(), lr=1e-3)  # accepts every parameter (experts get no gradient)
    assert model.train() is model and model.training and all(m.training for m in model.modules())
    assert model.eval() is model and not any(m.training for m in model.modules())
    assert torch.equal(_logits(model), expected)


@pytest.mark.parametrize("quantization", [None, "lossless"])
def test_unload_of_a_loaded_model_gives_back_the_parameters_it_exposed(tiny_checkpoint, quantization):
    """Experts read from the checkpoint: the unloaded model's parameters are the objects the wrapped model exposed
    (an optimizer built on it trains the unloaded model), holding the checkpoint's tensors."""
    path = tiny_checkpoint("mixtral")
    model = _wrapped(path, quantization=quantization)
    exposed = dict(model.named_parameters())
    back = dict(model.unload().named_parameters())
    assert back.keys() == exposed.keys() and all(back[n] is exposed[n] for n in back)
    expected = load_reference(path).state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in model.state_dict().items())


def test_load_state_dict_into_a_quantized_model_quantizes_the_loaded_weights(tiny_checkpoint):
    """int8 experts: loading other weights gives what wrapping those weights with int8 gives."""
    model = _wrapped(tiny_checkpoint("mixtral"), quantization="int8")
    _logits(model)
    other = _other_weights("mixtral")
    model.load_state_dict(other.state_dict())
    expected = MiraMoEModel.wrap(other, MiraConfig(device="cpu", gpu_budget=0.5, quantization="int8"))
    assert torch.equal(_logits(model), _logits(expected))


def _experts_of(model, layer: int):
    return model.model.layers[layer].mlp.experts


@pytest.mark.parametrize("budget", [0.3, 1.0])
def test_experts_changed_in_place_are_what_the_model_computes(tiny_checkpoint, budget):
    """Research code edits expert weights in place (ablate an expert, copy one over another) under no_grad, as on
    the unwrapped model; the edits reach the experts already copied to the cache, which then starts empty. Plain
    decoding never empties it."""
    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), _wrapped(path, gpu_budget=budget)
    relocations = []
    relocate = model.mira.relocate
    model.mira.relocate = lambda *args: relocations.append(args) or relocate(*args)
    gen = dict(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        assert torch.equal(model.generate(IDS, **gen), ref.generate(IDS, **gen))  # every used expert copied once
        assert not relocations
        edits = [
            lambda m: _experts_of(m, 0).gate_up_proj[3].mul_(0.5),  # one expert, through an indexed view
            lambda m: _experts_of(m, 1).down_proj[:, 0].zero_(),  # one hidden row of every expert
            lambda m: _experts_of(m, 1).down_proj.copy_(_experts_of(m, 0).down_proj),  # a whole tensor replaced
        ]
        for edit in edits:
            edit(ref)
            edit(model)
            assert torch.equal(_logits(model), _logits(ref))
            assert torch.equal(model.generate(IDS, **gen), ref.generate(IDS, **gen))
    assert len(relocations) == len(edits)
    assert torch.equal(model.state_dict()["model.layers.1.mlp.experts.down_proj"], _experts_of(ref, 1).down_proj)


def test_experts_written_through_data_are_computed_once_the_manager_is_told(tiny_checkpoint):
    """A write through `p.data` (old-style init code, EMA updates) changes the store's bytes without torch counting
    it: `model.mira.experts_changed()` empties the cache, and the model then computes what the unwrapped model edited
    alike computes. An encoded store, which no such write reaches, refuses the call, saying why."""
    from mira_hf import UnsupportedOperationError

    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), _wrapped(path, gpu_budget=1.0)
    with torch.no_grad():
        _logits(model)  # every expert cached
        for m in (ref, model):
            _experts_of(m, 0).gate_up_proj.data[3].mul_(0.5)
            _experts_of(m, 1).down_proj.data.normal_(generator=torch.Generator().manual_seed(1))
        model.mira.experts_changed()
        assert torch.equal(_logits(model), _logits(ref))
    encoded = _wrapped(path, gpu_budget=0.3, quantization="lossless")
    with pytest.raises(UnsupportedOperationError, match=r"experts_changed\(\).*lossless-encoded.*load_state_dict"):
        encoded.mira.experts_changed()


def _an_expert_parameter(model) -> torch.nn.Parameter:
    """The first routed-expert parameter (`[E, ...]`; DBRX's `[E * I, H]`) of any family."""
    return next(p for n, p in model.named_parameters() if ".experts." in n)


def _edit_then_serve_in_inference_mode(model, other: dict) -> None:
    with torch.no_grad():
        _an_expert_parameter(model)[1].mul_(2)  # found by the next forward, which rebuilds the cache
    with torch.inference_mode():
        model(IDS)


def _load_in_inference_mode(model, other: dict) -> None:
    with torch.inference_mode():
        model.load_state_dict(other)


def _written_through_data_then_told_in_inference_mode(model, other: dict) -> None:
    _an_expert_parameter(model).data[1].mul_(2)
    if hasattr(model, "mira"):
        with torch.inference_mode():
            model.mira.experts_changed()


INFERENCE_MODE_CHANGES = {
    "edit, then a forward in inference mode": _edit_then_serve_in_inference_mode,
    "load_state_dict in inference mode": _load_in_inference_mode,
    "experts_changed in inference mode": _written_through_data_then_told_in_inference_mode,
}


@pytest.mark.parametrize("change", list(INFERENCE_MODE_CHANGES))
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss", "dbrx"])
def test_experts_changed_with_inference_mode_on_stay_usable_outside_it(tiny_checkpoint, name, change):
    """Serving code runs under torch.inference_mode(), and an edit, a load or `experts_changed()` may be followed by
    (or run inside) it. What the change rebuilds (the store's records, the slots, the parameters' views) is made of
    normal tensors whatever the mode, as the unwrapped model's parameters stay: every later forward, in any mode,
    computes what the unwrapped model changed alike computes, and a later in-place edit outside inference mode works."""
    path = tiny_checkpoint(name)
    ref, model = load_reference(path), _wrapped(path, gpu_budget=0.3)
    _logits(model)  # experts in the cache
    other = _other_weights(name).state_dict()
    for m in (ref, model):
        INFERENCE_MODE_CHANGES[change](m, other)
    assert not any(p.is_inference() for p in model.parameters())
    for mode in (torch.no_grad, torch.enable_grad, torch.inference_mode, torch.no_grad):
        with mode():
            assert torch.equal(model(IDS).logits.detach(), ref(IDS).logits.detach()), mode.__name__
    with torch.no_grad():
        for m in (ref, model):
            _an_expert_parameter(m)[0].mul_(0.5)
    assert torch.equal(_logits(model), _logits(ref))


def test_encoded_experts_loaded_in_inference_mode_serve_outside_it(tiny_checkpoint):
    """Lossless records written by a load_state_dict inside torch.inference_mode() (a layout of another size: a new
    slab) and the slots rebuilt for them are normal tensors: forwards outside it copy and decode them."""
    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), _wrapped(path, gpu_budget=0.3, quantization="lossless")
    _logits(model)
    other = _other_weights("mixtral").state_dict()
    with torch.inference_mode():
        for m in (ref, model):
            m.load_state_dict(other)
    assert not any(slab.is_inference() for slab in model.mira.store.slabs().values())
    for mode in (torch.no_grad, torch.enable_grad, torch.inference_mode):
        with mode():
            assert torch.equal(model(IDS).logits.detach(), ref(IDS).logits.detach()), mode.__name__
    assert all(torch.equal(model.state_dict()[k], v) for k, v in other.items())


def test_dbrx_experts_edited_in_place_through_their_stacked_rows(tiny_checkpoint):
    """DBRX keeps each expert tensor stacked as `[E * I, H]` on `ffn.experts.mlp`: rows edited in place (one expert's
    gate rows, a column of every expert's down rows) reach what the model computes, as on the unwrapped model."""
    path = tiny_checkpoint("dbrx")
    ref, model = load_reference(path), _wrapped(path, gpu_budget=0.3)
    _logits(model)  # experts in the cache
    rows = ref.config.ffn_config.ffn_hidden_size  # one expert's rows of each tensor
    with torch.no_grad():
        for m in (ref, model):
            m.transformer.blocks[0].ffn.experts.mlp.w1[3 * rows : 4 * rows].mul_(0.5)
            m.transformer.blocks[1].ffn.experts.mlp.w2[:, 0].zero_()
    assert torch.equal(_logits(model), _logits(ref))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.state_dict().items())


@pytest.mark.parametrize(
    "settings, held",
    [({"quantization": "lossless"}, "lossless-encoded"), ({"host_compute": "split"}, "split with the host")],
)
def test_experts_stored_encoded_refuse_an_in_place_change_until_loaded(tiny_checkpoint, settings, held):
    """Encoded experts (lossless; split with the host) are not views the model computes from: an in-place change of
    their parameters cannot reach them, so the next forward raises, saying what to do, and keeps raising until
    load_state_dict writes the experts; then the model computes with the changed experts."""
    from mira_hf import UnsupportedOperationError

    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), _wrapped(path, gpu_budget=0.3, **settings)
    with torch.no_grad():
        expected = _logits(model) if "host_compute" in settings else None
        _experts_of(model, 0).gate_up_proj.mul_(0.5)
        for _ in range(2):
            with pytest.raises(UnsupportedOperationError, match=rf"layer\(s\) \[0\] were changed in place.*{held}"):
                _logits(model)
        if expected is not None:  # host parts round differently: the unchanged experts loaded back, the same numbers
            model.load_state_dict(ref.state_dict())
            assert torch.equal(_logits(model), expected)
        else:
            _experts_of(ref, 0).gate_up_proj.mul_(0.5)
            model.load_state_dict(ref.state_dict())
            assert torch.equal(_logits(model), _logits(ref))


@pytest.mark.parametrize(
    "name, key", [("dbrx", "transformer.blocks.0.ffn.experts.mlp.w9"), ("jetmoe", "model.layers.0.mlp.input_linear.w9")]
)
def test_keys_beside_experts_kept_on_a_child_are_reported_as_the_unwrapped_model_reports_them(tiny_checkpoint, name, key):
    """DBRX and JetMoE keep their experts on a child module (its holder in the wrapped model): a key the child lacks is
    unexpected, and the child's experts and the block's other members load, as in the unwrapped model."""
    path = tiny_checkpoint(name)
    model = _wrapped(path)
    given = dict(_other_weights(name).state_dict())
    given[key] = torch.zeros(3)
    expected = load_reference(path).load_state_dict(given, strict=False)
    got = model.load_state_dict(given, strict=False)
    assert got.unexpected_keys == expected.unexpected_keys == [key]
    assert got.missing_keys == expected.missing_keys == []
    assert all(torch.equal(model.state_dict()[k], v) for k, v in given.items() if k != key)


def test_expert_parameters_given_new_data_are_what_the_model_computes(tiny_checkpoint, tmp_path):
    """`p.data = t` (as `torch.nn.utils.vector_to_parameters` does) moves no version count: the next forward finds
    the parameter on other data and writes it into the store, so the forward, `state_dict()` and `save_pretrained`
    agree, as on the unwrapped model."""
    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), _wrapped(path, gpu_budget=1.0)
    _logits(model)  # every expert in the cache
    for m in (ref, model):
        p = _experts_of(m, 1).down_proj
        p.data = torch.zeros_like(p) + 0.01
        vector = torch.nn.utils.parameters_to_vector(m.model.layers[0].mlp.experts.parameters())
        torch.nn.utils.vector_to_parameters(vector * 2, m.model.layers[0].mlp.experts.parameters())
    assert torch.equal(_logits(model), _logits(ref))
    assert torch.equal(model.state_dict()["model.layers.1.mlp.experts.down_proj"], _experts_of(ref, 1).down_proj)
    model.save_pretrained(tmp_path / "saved")
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()), _logits(ref))


@pytest.mark.parametrize("settings", [{}, {"quantization": "lossless"}], ids=["raw", "lossless"])
def test_expert_parameters_replaced_on_their_module_are_refused_before_anything_is_computed(tiny_checkpoint, settings):
    """An expert parameter replaced by another tensor on its module (an assignment; torch.func.functional_call, which
    puts other tensors there for one call) cannot be told from a lasting change: the forward raises, saying what
    does reach the experts, and once the parameter is back the model computes as before."""
    from mira_hf import UnsupportedOperationError

    path = tiny_checkpoint("mixtral")
    model = _wrapped(path, gpu_budget=0.3, **settings)
    expected = _logits(model)
    experts = _experts_of(model, 1)
    original = experts.down_proj
    experts.down_proj = torch.nn.Parameter(torch.zeros(original.shape))
    with pytest.raises(UnsupportedOperationError, match=r"down_proj of MoE layer 1 were replaced.*load_state_dict"):
        _logits(model)
    experts.down_proj = original
    assert torch.equal(_logits(model), expected)
    others = {k: torch.zeros_like(v) for k, v in model.state_dict().items() if ".experts." in k}
    with pytest.raises(UnsupportedOperationError, match="replaced by other tensors"), torch.no_grad():
        torch.func.functional_call(model, others, (IDS,))
    assert torch.equal(_logits(model), expected)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "block_on_its_own"])
def test_a_parametrization_standing_in_for_experts_during_a_step_is_refused(tiny_checkpoint, compiled):
    """A parametrization registered on an experts module for its own call only, inside a step (peft's LoRA on experts
    does this around each experts call), would change what the unwrapped model computes: the block raises instead of
    computing with the store, saying what to do, and once it is gone the model computes as before."""
    from torch.nn.utils import parametrize

    from mira_hf import UnsupportedOperationError

    class Halved(torch.nn.Module):
        def forward(self, w):
            return w * 0.5

    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), _wrapped(path, gpu_budget=0.3)
    expected = _logits(model)

    def add(block, args):
        parametrize.register_parametrization(block.experts, "down_proj", Halved())

    def remove(block, args, out):
        parametrize.remove_parametrizations(block.experts, "down_proj", leave_parametrized=False)

    hooked = []
    for m in (ref, model):
        block = m.model.layers[1].mlp
        hooked += [block.register_forward_pre_hook(add), block.register_forward_hook(remove)]
    assert not torch.equal(_logits(ref), expected)  # the unwrapped model computes with the halved down projection
    with pytest.raises(UnsupportedOperationError, match=r"layer 1 were replaced.*parametrization.*peft"):
        if compiled:  # the block called on its own, as a compiled graph's blocks are: no step around it
            with torch.no_grad():
                model.model.layers[1].mlp(torch.randn(1, 3, model.config.hidden_size))
        else:
            _logits(model)
    if parametrize.is_parametrized(_experts_of(model, 1)):  # the raise skipped the forward hook that removes it
        parametrize.remove_parametrizations(_experts_of(model, 1), "down_proj", leave_parametrized=False)
    for handle in hooked:
        handle.remove()
    assert torch.equal(_logits(model), expected)


@pytest.mark.parametrize("settings", [{}, {"quantization": "lossless"}], ids=["raw", "lossless"])
def test_an_expert_parameter_apply_puts_in_place_is_written_into_the_store(tiny_checkpoint, settings):
    """`model.apply(fn)` where `fn` gives the experts module (found by `isinstance`) a new expert parameter, as code
    written for the unwrapped model does: its values are written into the store as `load_state_dict` writes them."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), _wrapped(path, gpu_budget=0.3, **settings)
    _logits(model)  # the experts copied to the cache first

    def new_down_proj(m):
        if isinstance(m, MixtralExperts):
            shape = m.down_proj.shape
            m.down_proj = torch.nn.Parameter(torch.linspace(-0.05, 0.05, shape.numel()).view(shape))

    ref.apply(new_down_proj), model.apply(new_down_proj)
    assert torch.equal(_logits(model), _logits(ref))
    assert torch.equal(model.state_dict()["model.layers.1.mlp.experts.down_proj"], _experts_of(ref, 1).down_proj)


@pytest.mark.parametrize("settings", [{}, {"quantization": "lossless"}], ids=["raw", "lossless"])
def test_an_expert_parameter_apply_puts_in_place_that_cannot_be_written_is_refused(tiny_checkpoint, settings):
    """A new expert parameter of another shape, or one computed from a placeholder (an encoded store's parameters
    hold no values), is refused, saying what was given and what to do: never kept silently."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from mira_hf import UnsupportedOperationError

    model = _wrapped(tiny_checkpoint("mixtral"), gpu_budget=0.3, **settings)

    def narrow_down_proj(m):
        if isinstance(m, MixtralExperts):
            m.down_proj = torch.nn.Parameter(m.down_proj.detach()[..., :1] * 0.5)

    refusal = "placeholders, and what is computed from them" if settings else "down_proj of MoE layer 0 was given data"
    with pytest.raises(UnsupportedOperationError, match=refusal):
        model.apply(narrow_down_proj)


def test_ergo_loads_its_own_state_dict_strictly(tiny_checkpoint):
    """Ergo's per-expert norms sit on its experts module beside the experts: the proxy and the original module it
    keeps both hold them, and a strict load of the model's own state dict finds every key, as unwrapped."""
    path = tiny_checkpoint("ergo")
    ref, model = load_reference(path), _wrapped(path, gpu_budget=0.5)
    result = model.load_state_dict(ref.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(_logits(model), _logits(ref))
    partial = {k: v for k, v in ref.state_dict().items() if "post_expert_norm" not in k}
    expected = ref.load_state_dict(partial, strict=False).missing_keys
    assert expected and model.load_state_dict(partial, strict=False).missing_keys == expected  # each once


def test_load_state_dict_with_assign_gives_the_experts_the_given_dtype(tiny_checkpoint):
    """`assign=True` makes the given tensors the parameters, in their dtype: a bf16 state dict loaded so into an
    fp32 model leaves it bf16, experts included, as the unwrapped model is left."""
    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), _wrapped(path, gpu_budget=0.5)
    _logits(model)
    given = {k: v.to(torch.bfloat16) for k, v in _other_weights("mixtral").state_dict().items()}
    ref.load_state_dict(given, assign=True)
    model.load_state_dict(given, assign=True)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.mira.store.dtype(0) == torch.bfloat16
    assert torch.equal(_logits(model), _logits(ref))


@pytest.mark.parametrize("name", ["mixtral", "dbrx"])
def test_load_state_dict_with_assign_refuses_inference_tensors_as_torch_does(tiny_checkpoint, name):
    """`assign=True` with tensors made in inference mode: torch cannot make them parameters that require grad outside
    it, and reports every such key, leaving those parameters as they are; the wrapped model reports its expert keys
    alike (the same message) and keeps those experts. Where the parameters require no grad, torch assigns them, and
    the wrapped model loads their values (its parameters stay normal tensors, views of its store)."""
    path = tiny_checkpoint(name)
    ref, model = load_reference(path), _wrapped(path)
    _logits(model)
    expected = _logits(ref)
    with torch.inference_mode():
        given = {k: v.clone() for k, v in _other_weights(name).state_dict().items()}
    errors = []
    for m in (ref, model):
        with pytest.raises(RuntimeError, match="inference tensor") as raised:
            m.load_state_dict(given, assign=True)
        errors.append(str(raised.value))
    assert errors[1] == errors[0]
    assert torch.equal(_logits(model), expected) and torch.equal(_logits(ref), expected)
    for m in (ref, model):
        m.requires_grad_(False)
        m.load_state_dict(given, assign=True)
    assert torch.equal(_logits(model), _logits(ref))
    experts = [p for n, p in model.named_parameters() if ".experts." in n]  # the others are inference tensors, as torch's
    assert not any(p.is_inference() for p in experts)


def test_expert_modules_replaced_on_a_layout_of_one_module_per_expert_are_refused():
    """Switch Transformers keeps each expert's weights on modules of its own: a module replaced there (a new
    `nn.Linear`, as an adapter library would put in) is refused as a replaced parameter is, naming it."""
    import copy

    from mira_hf import MiraConfig, MiraMoEModel, UnsupportedOperationError
    from mira_hf.testing import build, tiny_config

    torch.manual_seed(0)
    model = MiraMoEModel.wrap(
        copy.deepcopy(build(tiny_config("switch_transformers")).eval()), MiraConfig(device="cpu", gpu_budget=0.5)
    )
    start = torch.zeros(2, 1, dtype=torch.long)
    with torch.no_grad():
        expected = model(IDS, decoder_input_ids=start).logits
        experts = model.encoder.block[1].layer[1].mlp.experts
        original = experts.expert_3.wi
        out_features, in_features = original.weight.shape
        experts.expert_3.wi = torch.nn.Linear(in_features, out_features, bias=False)
        with pytest.raises(UnsupportedOperationError, match=r"expert_3\.wi of MoE layer 0 were replaced"):
            model(IDS, decoder_input_ids=start)
        experts.expert_3.wi = original
        assert torch.equal(model(IDS, decoder_input_ids=start).logits, expected)


@pytest.mark.parametrize("then", ["save_pretrained", "unload", "cast", "partial load"])
def test_data_given_to_expert_parameters_is_kept_by_what_reads_the_store_before_any_forward(tiny_checkpoint, tmp_path, then):
    """`p.data = t` reaches the store at the next step's start, and before it whatever reads the store: saving,
    unloading, a cast, a load that does not give that tensor."""
    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), _wrapped(path, gpu_budget=0.5)
    _logits(model)
    for m in (ref, model):
        p = _experts_of(m, 1).down_proj
        p.data = p.data * -2 + 1
    if then == "save_pretrained":
        model.save_pretrained(tmp_path / "saved")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    elif then == "unload":
        model = model.unload()
    elif then == "cast":
        model, ref = model.to(torch.bfloat16), ref.to(torch.bfloat16)
    else:
        partial = {k: v for k, v in ref.state_dict().items() if k != "model.layers.1.mlp.experts.down_proj"}
        model.load_state_dict(partial, strict=False)
    assert torch.equal(_logits(model), _logits(ref))


def test_an_moe_block_called_on_its_own_computes_with_its_experts_as_edited(tiny_checkpoint):
    """A notebook calls MoE blocks one by one (no forward hook of the model runs): each block checks its own layer's
    expert parameters before computing, so an edit between two block calls reaches the next one."""
    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), _wrapped(path, gpu_budget=1.0)
    x = torch.randn(1, 5, ref.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _logits(model)  # every expert cached
        for layer in (0, 1):
            if layer == 1:
                for m in (ref, model):
                    _experts_of(m, 1).gate_up_proj.mul_(-2)
            assert torch.equal(model.model.layers[layer].mlp(x)[0], ref.model.layers[layer].mlp(x)[0])


@pytest.mark.parametrize("edit", ["drop-middle", "drop-last", "reverse"])
def test_save_pretrained_after_layers_are_removed_or_moved_writes_what_the_unwrapped_model_writes(tmp_path, edit):
    """Layer pruning and reordering after wrapping: each proxy's experts go where the proxy now sits, and a layer no
    longer in the model writes nothing (a checkpoint keyed by the paths at wrapping would hold other layers' experts)."""
    from safetensors.torch import load_file

    from mira_hf.testing import build, tiny_config

    def edited(model):
        layers = list(model.model.layers)
        kept = {"drop-middle": layers[:1] + layers[2:], "drop-last": layers[:-1], "reverse": layers[::-1]}[edit]
        model.model.layers = torch.nn.ModuleList(kept)
        model.config.num_hidden_layers = len(kept)
        return model

    config = tiny_config("mixtral")
    config.num_hidden_layers = 3
    torch.manual_seed(0)
    ref = build(config).eval()
    torch.manual_seed(0)
    model = MiraMoEModel.wrap(build(config).eval(), MiraConfig(gpu_budget=0.5, device="cpu"))
    edited(ref).save_pretrained(tmp_path / "ref")
    edited(model).save_pretrained(tmp_path / "wrapped")
    expected, got = load_file(tmp_path / "ref" / "model.safetensors"), load_file(tmp_path / "wrapped" / "model.safetensors")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
