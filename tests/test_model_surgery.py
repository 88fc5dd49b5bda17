"""What researchers studying routing do to a wrapped model: experts modules moved between layers, shared, wrapped in
a module of their own or replaced, and experts modules called with routing of their own. The wrapped model, its
`save_pretrained` checkpoint and the model `unload()` gives back compute what the unwrapped model changed alike
computes (`torch.equal`); routing that names no expert is refused, saying what was given."""

import gc

import pytest
import torch
from tiny_models import build, config_or_skip
from transformers import AutoModelForCausalLM

from mira_hf import ConfigError, MiraConfig, MiraMoEModel
from mira_hf.proxy import MiraExperts

IDS = torch.tensor([[5, 9, 14, 33, 60, 71, 80], [7, 21, 4, 8, 11, 3, 99]])
FAMILIES = ["mixtral", "deepseek_v3", "gpt_oss"]  # standard experts; a dense first layer; transposed, biased experts


def _copies(name: str):
    """Two copies of one tiny model, unwrapped."""
    config = config_or_skip(name)
    torch.manual_seed(0)
    ref = build(config).eval()
    model = build(config).eval()
    model.load_state_dict(ref.state_dict())
    return ref, model


def _pair(name: str):
    """(unwrapped, wrapped) copies of one tiny model, the second wrapped with room for a third of its experts."""
    ref, model = _copies(name)
    return ref, MiraMoEModel.wrap(model, MiraConfig(gpu_budget=0.3, device="cpu"))


def _blocks(model) -> list:
    """The MoE blocks (the modules holding an `experts` child), in layer order."""
    return [m for m in model.model.layers if hasattr(getattr(m, "mlp", None), "experts")]


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _agree(ref, model, tmp_path, reload: bool = True) -> None:
    """The wrapped model, its saved checkpoint (the tensors `ref` saves, where transformers saves them; reloaded by
    transformers, computing what `ref` computes, where `reload`), and the model `unload()` gives back all compute
    what `ref` computes."""
    from safetensors.torch import load_file

    expected = _logits(ref)
    assert torch.equal(_logits(model), expected)
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    try:
        ref.save_pretrained(tmp_path / "ref")
    except RuntimeError:  # transformers refuses to save tensors two modules share; mira-hf writes each its own copy
        pass
    else:
        ref_saved = load_file(tmp_path / "ref" / "model.safetensors")
        assert saved.keys() == ref_saved.keys() and all(torch.equal(saved[k], ref_saved[k]) for k in saved)
    if reload:
        assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()), expected)
    assert torch.equal(_logits(model.unload()), expected)
    assert not any(isinstance(m, MiraExperts) for m in model.modules())


@pytest.mark.parametrize("how", ["swapped", "shared"])
@pytest.mark.parametrize("name", FAMILIES)
def test_experts_modules_moved_between_layers_stay_where_they_were_moved(name, how, tmp_path):
    """Two layers' experts modules swapped, or the first's put in the second's place too, after wrapping: the
    checkpoint and the unloaded model keep them where they were moved, not where they were at wrapping."""
    ref, model = _pair(name)
    for m in (ref, model):
        a, b = _blocks(m)[:2]
        if how == "swapped":
            a.mlp.experts, b.mlp.experts = b.mlp.experts, a.mlp.experts
        else:
            b.mlp.experts = a.mlp.experts
    _agree(ref, model, tmp_path)


@pytest.mark.parametrize("how", ["recorded", "ablated"])
def test_an_experts_module_wrapped_or_replaced_by_the_user_unloads_as_the_unwrapped_model_would(how, tmp_path):
    """An experts module inside a module of the user's (a recorder of its outputs), or replaced by one (an ablation
    of the routed experts): `unload()` gives back the model with the user's module where they put it, and the
    checkpoint holds the keys the unwrapped model's does."""

    class Recorder(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.seen = inner, []

        def forward(self, hidden, *routing):
            out = self.inner(hidden, *routing)
            self.seen.append(out)
            return out

    class Ablated(torch.nn.Module):
        def forward(self, hidden, *routing):
            return torch.zeros_like(hidden)

    ref, model = _pair("mixtral")
    for m in (ref, model):
        block = _blocks(m)[1]
        block.mlp.experts = Recorder(block.mlp.experts) if how == "recorded" else Ablated()
    assert set(model.state_dict()) == set(ref.state_dict())
    _agree(ref, model, tmp_path, reload=False)  # transformers builds its own experts module where the user's was
    if how == "recorded":
        assert type(_blocks(model)[1].mlp.experts.inner).__name__ == "MixtralExperts"


@pytest.mark.parametrize("name", FAMILIES)
def test_one_experts_module_shared_by_two_blocks_is_served_in_both(name, tmp_path):
    """One experts module in two MoE blocks before wrapping (a layer's experts reused by another): both blocks call
    the proxy, the state dict names it at both paths as the unwrapped model's does, and `unload()` puts the module
    back in both."""
    ref, model = _copies(name)
    for m in (ref, model):
        a, b = _blocks(m)[:2]
        b.mlp.experts = a.mlp.experts
    model = MiraMoEModel.wrap(model, MiraConfig(gpu_budget=0.3, device="cpu"))
    a, b = _blocks(model)[:2]
    assert isinstance(a.mlp.experts, MiraExperts) and b.mlp.experts is a.mlp.experts
    assert set(model.state_dict()) == set(ref.state_dict())
    _agree(ref, model, tmp_path)
    a, b = _blocks(model)[:2]
    assert b.mlp.experts is a.mlp.experts and not isinstance(a.mlp.experts, MiraExperts)


def _tie(model) -> None:
    """The second MoE block's experts take the first's parameters (the same tensors), in a module of their own."""
    a, b = _blocks(model)[:2]
    for name, param in a.mlp.experts.named_parameters(recurse=False):
        setattr(b.mlp.experts, name, param)


@pytest.mark.parametrize("name", FAMILIES)
def test_experts_modules_tied_to_each_other_are_stored_once_and_unloaded_in_their_own_places(name, tmp_path):
    """Two experts modules of their own whose parameters are the same tensors (a layer's experts tied to another's,
    as Diffusion Gemma ties its encoder's to its decoder's): the store holds them once and one proxy serves both
    blocks; the model computes as the unwrapped one does, loading into either name reaches both, saving is refused as
    transformers refuses it for the unwrapped model (the tie is not declared), and `unload()` puts each module back
    in its own place, still tied."""
    ref, model = _copies(name)
    for m in (ref, model):
        _tie(m)
    modules = [block.mlp.experts for block in _blocks(model)]
    distinct = {id(p): p for m in modules for p in m.parameters()}.values()
    model = MiraMoEModel.wrap(model, MiraConfig(gpu_budget=0.3, device="cpu"))
    assert len(model.mira.layers) == len(modules) - 1
    assert model.mira.store.nbytes == sum(p.numel() * p.element_size() for p in distinct)
    a, b = _blocks(model)[:2]
    assert isinstance(a.mlp.experts, MiraExperts) and b.mlp.experts is a.mlp.experts
    assert set(model.state_dict()) == set(ref.state_dict())
    assert torch.equal(_logits(model), _logits(ref))
    paths = {id(m): path for path, m in ref.named_modules()}
    key = f"{paths[id(_blocks(ref)[1].mlp.experts)]}.down_proj"  # the tied module's own name for the tensor
    other = key.replace(paths[id(_blocks(ref)[1].mlp.experts)], paths[id(_blocks(ref)[0].mlp.experts)])
    edited = ref.state_dict()[key] * 1.5
    for m in (ref, model):
        m.load_state_dict({key: edited}, strict=False)
    assert torch.equal(model.state_dict()[other], edited)
    assert torch.equal(_logits(model), _logits(ref))
    with pytest.raises(RuntimeError, match="shared tensors") as refused:
        ref.save_pretrained(tmp_path / "ref")
    with pytest.raises(RuntimeError, match="shared tensors") as also:
        model.save_pretrained(tmp_path / "saved")
    assert str(also.value) == str(refused.value)
    expected = _logits(ref)
    model.unload()
    assert [block.mlp.experts for block in _blocks(model)] == modules
    assert all(p is modules[0]._parameters[n] for n, p in modules[1]._parameters.items())  # still tied
    assert torch.equal(_logits(model), expected)


def test_a_tied_experts_module_with_hooks_of_its_own_keeps_its_own_proxy():
    """An experts module tied to another's but with a forward hook of its own is not served by the other's proxy (its
    hook would not run there): it keeps a layer of its own, and its hook runs at each call as unwrapped."""
    ref, model = _copies("mixtral")
    calls = []
    for m in (ref, model):
        _tie(m)
    _blocks(model)[1].mlp.experts.register_forward_hook(lambda *args: calls.append(1))
    model = MiraMoEModel.wrap(model, MiraConfig(gpu_budget=0.3, device="cpu"))
    assert len(model.mira.layers) == len(_blocks(model))
    assert torch.equal(_logits(model), _logits(ref))
    assert len(calls) == 1


@pytest.mark.parametrize(
    "index",
    [[[-1, 2]], [[-1, 2], [1, 2], [0, 3]], [[11, 1]], [[9, 2], [1, 2], [0, 3]], [[1.0, 2.0], [1.0, 2.0], [0.0, 3.0]]],
    ids=["negative, one token", "negative", "too large, one token", "too large", "floating-point"],
)
def test_routing_that_names_no_expert_is_refused_saying_what_was_given(index):
    """An experts module called with indices outside its experts (8 here; 8 itself marks a slot expert parallelism
    skips) or not integers: a `ConfigError` naming them, and the model serves on as before."""
    ref, model = _pair("mixtral")
    experts = _blocks(model)[1].mlp.experts
    index = torch.tensor(index)
    T, H = index.shape[0], model.config.hidden_size
    with pytest.raises(ConfigError, match=r"was given expert indices.*it has 8 experts, indexed 0 to 7"), torch.no_grad():
        experts(torch.randn(T, H), index, torch.ones(T, 2))
    assert torch.equal(_logits(model), _logits(ref))


def test_an_experts_module_two_models_share_is_refused_to_the_second_until_the_first_unloads():
    """One experts module in two models (assigned from one into the other): wrapping the first takes its experts into
    that model's store, so wrapping the second is refused, saying why and what to do, and works once the first is
    unloaded, computing what the unwrapped model computes."""
    ref, first = _pair("mixtral")
    config = config_or_skip("mixtral")
    torch.manual_seed(1)
    second = build(config).eval()
    second.load_state_dict(ref.state_dict())
    first.unload()
    _blocks(second)[0].mlp.experts = _blocks(first)[0].mlp.experts
    first = MiraMoEModel.wrap(first, MiraConfig(gpu_budget=0.3, device="cpu"))
    with pytest.raises(ConfigError, match=r"model.layers.0.mlp.experts .* another wrapped model serves.*copy.deepcopy"):
        MiraMoEModel.wrap(second, MiraConfig(gpu_budget=0.3, device="cpu"))
    assert not any(isinstance(m, MiraExperts) for m in second.modules())  # refused before anything changed
    first.unload()
    second = MiraMoEModel.wrap(second, MiraConfig(gpu_budget=0.3, device="cpu"))
    assert torch.equal(_logits(second), _logits(ref))


def test_an_experts_module_whose_wrapped_model_was_dropped_without_unload_is_refused_saying_why():
    """A wrapped model takes its experts modules' weights into its store; dropped without `unload()`, the modules a
    user kept are empty. Wrapping a model holding one is refused naming what happened and what to do, not as a
    module of an unknown layout."""
    config = config_or_skip("mixtral")
    first = build(config).eval()
    kept = _blocks(first)[0].mlp.experts  # taken before wrapping
    first = MiraMoEModel.wrap(first, MiraConfig(gpu_budget=0.3, device="cpu"))
    del first
    gc.collect()
    second = build(config).eval()
    _blocks(second)[0].mlp.experts = kept
    with pytest.raises(ConfigError, match=r"model.layers.0.mlp.experts .* holds no expert weights.*without unload\(\)"):
        MiraMoEModel.wrap(second, MiraConfig(gpu_budget=0.3, device="cpu"))
    assert not any(isinstance(m, MiraExperts) for m in second.modules())


def test_a_moe_block_moved_into_another_model_gets_its_experts_module_back_at_unload():
    """A wrapped model's MoE block swapped with an unwrapped model's (a layer transplanted): both models compute
    exactly, and once the wrapped model is unloaded the block, now in the other model, holds its experts module again."""
    ref, model = _pair("mixtral")
    config = config_or_skip("mixtral")
    torch.manual_seed(1)
    other, other_ref = build(config).eval(), build(config).eval()
    other_ref.load_state_dict(other.state_dict())
    for donor, host in ((ref, other_ref), (model, other)):  # swapped: the wrapped block leaves the wrapped model
        _blocks(host)[0].mlp, _blocks(donor)[0].mlp = _blocks(donor)[0].mlp, _blocks(host)[0].mlp
    assert torch.equal(_logits(other), _logits(other_ref)) and torch.equal(_logits(model), _logits(ref))
    model.unload()
    assert not any(isinstance(m, MiraExperts) for m in other.modules())
    assert torch.equal(_logits(other), _logits(other_ref)) and torch.equal(_logits(model), _logits(ref))
