"""Encoder-decoder families served by a registered adapter (`SEQ2SEQ_RECIPES`: Switch Transformers, whose experts are
one module each, `model_adapters.ExpertModules`): wrapped or loaded, the model is the unwrapped one in every habit
(logits, router logits, generation, parameters, state dicts, casts, unload, save and reload), bit for bit on the CPU.
"""

import pytest
import torch
import transformers
from conftest import halved_through_apply, reinitialised, scaled_and_redrawn, shared_storages
from test_host_compute import BOUND, costs
from tiny_models import SEQ2SEQ_RECIPES, build, config_or_skip

from mira_hf import MiraConfig, MiraMoEModel
from mira_hf.adapters import get_adapter
from mira_hf.config import LoaderConfig
from mira_hf.errors import UnsupportedOperationError

NAMES = sorted(SEQ2SEQ_RECIPES)
WRAP = MiraConfig(gpu_budget=0.25, device="cpu")
HOST_BOUND = BOUND[torch.float32]  # host compute rounds otherwise (docs/usage.md)
# 14 prompt tokens over 8 experts of capacity 3: some tokens exceed an expert's capacity and skip the experts
PROMPT = torch.tensor([[5, 9, 14, 33, 60, 71, 80, 5, 9, 14, 33, 60, 71, 80], [7, 21, 4, 8, 11, 3, 99, 7, 21, 4, 8, 11, 3, 0]])
MASK = (PROMPT != 0).long()
DECODER = torch.tensor([[0, 12, 40, 7], [0, 3, 3, 90]])


def _pair(name: str, dtype=torch.float32, **overrides):
    """(unwrapped, wrapped): two models with the same weights, the second wrapped right after construction."""
    config = config_or_skip(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    ref = build(config).to(dtype).eval()
    model = build(config).to(dtype).eval()
    model.load_state_dict(ref.state_dict())
    return ref, MiraMoEModel.wrap(model, WRAP)


def _forward(model, **kw):
    return model(input_ids=PROMPT, attention_mask=MASK, decoder_input_ids=DECODER, **kw)


def _capacity_binds(model) -> bool:
    """Whether the model's routers drop tokens over an expert's capacity (transformers 5.17's count each token's
    place per expert along a dimension of one, so they never do)."""
    router = next(m for n, m in model.named_modules() if n.endswith("mlp.router"))
    rows = torch.zeros(1, router.expert_capacity + 1, router.classifier.in_features)  # all for one expert
    with torch.no_grad():
        dispatch = next(o for o in router(rows) if not o.is_floating_point())
    return bool((dispatch.sum(dim=-1) == 0).any())


def _with_router_logits(ref, model, call):
    """(call(ref, output_router_logits=True), the same of `model`); where transformers' own model cannot return its
    router logits (5.17's Switch Transformers concatenates an empty list), the wrapped one fails the same way, and
    both are called without them."""
    try:
        expected = call(ref, output_router_logits=True)
    except ValueError as exc:
        with pytest.raises(type(exc)):
            call(model, output_router_logits=True)
        return call(ref), call(model)
    return expected, call(model, output_router_logits=True)


def _router_logits(out) -> list:
    return [*(out.encoder_router_logits or ()), *(out.decoder_router_logits or ())]


def _dropped(model) -> int:
    """Tokens of `PROMPT` that some sparse layer's router sent to no expert (over capacity), in `model`'s forward."""
    dropped = []

    def count(module, args, out):
        dispatch = next(o for o in out if not o.is_floating_point())  # the one-hot mask (its place varies by version)
        dropped.append(int((dispatch.sum(dim=-1) == 0).sum()))  # dispatch rows without an expert

    hooks = [m.register_forward_hook(count) for n, m in model.named_modules() if n.endswith("mlp.router")]
    try:
        with torch.no_grad():
            _forward(model)
    finally:
        for h in hooks:
            h.remove()
    return sum(dropped)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_router_logits_and_generation_are_the_unwrapped_models(name, dtype):
    ref, model = _pair(name, dtype, expert_capacity=1)  # 14 tokens a sequence for 8 experts: some are dropped
    assert _dropped(ref) > 0 or not _capacity_binds(ref)  # the prompt exercises tokens over an expert's capacity
    with torch.no_grad():
        expected, got = _with_router_logits(ref, model, _forward)
    assert torch.equal(got.logits, expected.logits)
    assert torch.equal(got.encoder_last_hidden_state, expected.encoder_last_hidden_state)
    assert len(_router_logits(got)) == len(_router_logits(expected))
    assert all(torch.equal(a, b) for a, b in zip(_router_logits(expected), _router_logits(got)))
    for kw in (dict(do_sample=False), dict(do_sample=False, num_beams=3, num_return_sequences=2)):
        kw = dict(kw, max_new_tokens=6, min_new_tokens=6)
        assert torch.equal(model.generate(PROMPT, attention_mask=MASK, **kw), ref.generate(PROMPT, attention_mask=MASK, **kw))
    stats = model.mira.telemetry.summary()
    assert stats["misses"] + stats["hot_hits"] + stats["stage_hits"] > 0  # the experts were served


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("predictor", ["global", "markov", "position", "hybrid"])
def test_every_predictor_learns_from_routing_that_drops_tokens(name, predictor):
    """Tokens over an expert's capacity go to no expert (the sentinel E in the routing the predictors learn from): each
    predictor counts the others, and the model computes the unwrapped model's logits and tokens."""
    ref, model = _pair(name, expert_capacity=1)
    model = MiraMoEModel.wrap(model.unload(), MiraConfig(gpu_budget=0.25, device="cpu", predictor=predictor))
    assert _dropped(ref) > 0 or not _capacity_binds(ref)
    with torch.no_grad():
        assert torch.equal(_forward(model).logits, _forward(ref).logits)
    kw = dict(attention_mask=MASK, do_sample=False, max_new_tokens=4, min_new_tokens=4)
    assert torch.equal(model.generate(PROMPT, **kw), ref.generate(PROMPT, **kw))


@pytest.mark.parametrize("name", NAMES)
def test_parameters_and_state_dict_are_the_unwrapped_models(name):
    ref, model = _pair(name)
    assert [(n, p.shape) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in ref.named_parameters()]
    expected, got = ref.state_dict(), model.state_dict()
    assert list(got) == list(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert model.num_parameters() == ref.num_parameters()
    assert shared_storages(model) == shared_storages(ref)  # each expert's tensors on storages of their own
    layer = next(k for k in expected if k.endswith("experts.expert_0.wi.weight")).split("expert_0")[0]
    with torch.no_grad():  # in-place edits of experts' parameters reach what the model computes
        before = _forward(ref).logits
        for key in [k for k in expected if k.startswith(layer) and k.endswith("wi.weight")]:  # the first layer's experts
            ref.get_parameter(key).mul_(-3)
            model.get_parameter(key).mul_(-3)
        after = _forward(model).logits
        assert torch.equal(after, _forward(ref).logits) and not torch.equal(after, before)


@pytest.mark.parametrize("name", NAMES)
def test_load_state_dict_writes_the_experts_whole_or_expert_by_expert(name):
    """A state dict of other weights loads into the experts (strict), and one that lacks an expert's tensor loads
    the rest (strict=False), reporting the same missing key as the unwrapped model does."""
    ref, model = _pair(name)
    torch.manual_seed(1)
    other = build(ref.config).eval().state_dict()
    ref.load_state_dict(other)
    model.load_state_dict(other)
    with torch.no_grad():
        assert torch.equal(_forward(model).logits, _forward(ref).logits)
    key = next(k for k in other if k.endswith("experts.expert_1.wo.weight"))
    partial = {k: v * 2 if "experts" in k else v for k, v in other.items() if k != key}
    assert ref.load_state_dict(partial, strict=False).missing_keys == [key]
    assert model.load_state_dict(partial, strict=False).missing_keys == [key]
    with torch.no_grad():
        assert torch.equal(_forward(model).logits, _forward(ref).logits)
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("stream", [False, True])
def test_from_pretrained_loads_the_checkpoint_as_transformers_does(tmp_path, name, stream):
    torch.manual_seed(0)
    build(config_or_skip(name)).save_pretrained(tmp_path)
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    ref = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    cfg = MiraConfig(gpu_budget=0.25, device="cpu", loader=LoaderConfig(stream_experts=stream))  # True: raises if it cannot
    model = MiraMoEModel.from_pretrained(tmp_path, cfg, progress=False)
    assert type(model) is type(ref)
    with torch.no_grad():
        assert torch.equal(_forward(model.eval()).logits, _forward(ref).logits)
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())
    kw = dict(do_sample=False, max_new_tokens=5)
    assert torch.equal(model.generate(PROMPT, attention_mask=MASK, **kw), ref.generate(PROMPT, attention_mask=MASK, **kw))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files


@pytest.mark.parametrize("name", NAMES)
def test_save_pretrained_and_unload_give_back_the_unwrapped_model(tmp_path, name):
    ref, model = _pair(name)
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in reloaded.state_dict().items())
    plain = model.unload()
    experts = next(m for n, m in plain.named_modules() if n.endswith("mlp.experts"))
    assert type(experts) is type(next(m for n, m in ref.named_modules() if n.endswith("mlp.experts")))
    assert all(type(m.wi) is torch.nn.Linear for m in experts.values())
    assert list(plain.state_dict()) == list(ref.state_dict())
    with torch.no_grad():
        assert torch.equal(_forward(plain).logits, _forward(ref).logits)


@pytest.mark.parametrize("name", NAMES)
def test_the_experts_module_is_indexed_and_reinitialised_as_the_unwrapped_one(name):
    """Code around the experts module indexes it as the container it replaces (transformers' `_init_weights` reads
    `experts[f"expert_{e}"]`); `model.apply(model._init_weights)` draws the same weights, the experts included, in
    the same order, and the next forward computes with them."""
    ref, model = _pair(name)
    a, b = (next(m for n, m in x.named_modules() if n.endswith("mlp.experts")) for x in (ref, model))
    assert list(b.keys()) == list(a.keys()) and list(b) == list(a) and len(b) == len(a) and "expert_1" in b
    assert [n for n, _ in b["expert_1"].named_parameters()] == [n for n, _ in a["expert_1"].named_parameters()]
    got, expected = reinitialised(ref, model, _forward)
    assert torch.equal(got.logits, expected.logits)
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", NAMES)
def test_apply_meets_each_module_and_parameter_once_as_on_the_unwrapped_model(name):
    """`model.apply(fn)` calls `fn` once on each module, which holds its own parameters there (each expert's linear
    layers theirs): an `fn` that scales them, draws new values into them, or counts them, does to a wrapped model what
    it does to the unwrapped one."""
    ref, model = _pair(name)
    met_ref, met_model = scaled_and_redrawn(ref, model, _forward)
    assert met_model == met_ref
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(_forward(model).logits, _forward(ref).logits)


@pytest.mark.parametrize("name", NAMES)
def test_parameters_apply_puts_in_place_of_the_experts_are_what_the_model_computes(name):
    """`model.apply(fn)` where `fn` gives the modules of the experts' classes (found by `isinstance`: each expert's
    linear layers among them) new parameters in place of theirs: the model computes with the new values and its state
    dict holds them, as the unwrapped model's does."""
    ref, model = _pair(name)
    experts = next(n for n, _ in ref.named_modules() if n.endswith("mlp.experts"))
    kinds = tuple({type(m) for m in ref.get_submodule(experts).modules()})
    before, expected, got = halved_through_apply(ref, model, kinds, _forward)
    assert not torch.equal(expected, before) and torch.equal(got, expected)
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())


ACTIVATIONS = ("transformers.activations", "torch.nn.modules.activation")  # the modules of activation classes


def _replace_activations(model, which: str) -> None:
    """Activation modules of `model` replaced by `Tanh`: every one (`set_submodule` at the paths `named_modules()`
    lists, or `model.apply(fn)` replacing those among each module's children), or expert 1's alone."""
    if which == "every_through_apply":

        def fn(m):
            for name, child in list(m.named_children()):
                if type(child).__module__ in ACTIVATIONS:
                    setattr(m, name, torch.nn.Tanh())

        model.apply(fn)
        return
    paths = [n for n, m in model.named_modules() if type(m).__module__ in ACTIVATIONS]
    for path in paths if which == "every" else [n for n in paths if n.endswith(".expert_1.act")]:
        model.set_submodule(path, torch.nn.Tanh())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("which", ["every", "every_through_apply", "one_expert"])
def test_activations_replaced_after_wrapping_are_what_the_model_computes(name, which):
    """An ablation replaces activation modules after wrapping: every one, or one expert's alone (each expert computes
    with its own). The model computes with the new ones, as the unwrapped model with the same change does, and
    `unload()` gives back a model that holds them."""
    ref, model = _pair(name)
    with torch.no_grad():
        before = _forward(ref).logits
        _replace_activations(ref, which), _replace_activations(model, which)
        expected = _forward(ref).logits
        assert not torch.equal(expected, before)
        assert torch.equal(_forward(model).logits, expected)
        kinds = [[type(m) for m in x.modules() if type(m).__module__ in ACTIVATIONS] for x in (ref, model)]
        assert kinds[0] == kinds[1]
        model.unload()
        assert torch.equal(_forward(model).logits, expected)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["on", "split"])
def test_experts_computed_on_the_host_use_their_own_activation(name, mode):
    """With host compute on, an expert the host computes (whole, or its share of neurons) uses its own activation too:
    one expert's replaced alone is followed there, within host compute's bound."""
    ref, model = _pair(name)
    model = MiraMoEModel.wrap(model.unload(), MiraConfig(gpu_budget=0.25, device="cpu", host_compute=mode))
    if mode == "on":  # every miss to the host: a link of 1 byte/s, a host that takes a microsecond
        model.mira.host.set_costs(costs(link_bytes_per_s=1.0, host_s={layer: {1: 1e-6} for layer in model.mira.layers}))
    with torch.no_grad():
        _replace_activations(ref, "one_expert"), _replace_activations(model, "one_expert")
        expected, got = _forward(ref).logits, _forward(model).logits
    assert (got - expected).abs().max() <= HOST_BOUND * expected.abs().max()
    assert mode == "split" or model.mira.stats()["host_computed"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_experts_are_read_from_their_own_tensors_not_copies(name):
    """Each expert's tensors are stored from its own module's tensors (no stacked copy of every layer at once, which
    would double the host memory of a model wrapped in memory), and the weights a move to a GPU would still copy,
    which the default budget leaves room for, are the non-expert ones alone."""
    from mira_hf.resources import bytes_to_move
    from mira_hf.targets import find_targets

    config = config_or_skip(name)
    torch.manual_seed(0)
    model = build(config).eval()
    adapter = get_adapter(config.model_type)
    targets = find_targets(model, adapter)
    assert targets and all(x.is_meta for t in targets for x in t.tensors.values())
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    every_byte = sum(x.numel() * x.element_size() for x in (*model.parameters(), *model.buffers()))
    assert 0 < bytes_to_move(model, targets, torch.device("cuda")) == every_byte - expert_bytes


@pytest.mark.parametrize("name", NAMES)
def test_a_cast_wrapped_model_computes_what_the_cast_unwrapped_model_computes(name):
    ref, model = _pair(name)
    ref.to(torch.bfloat16)
    model.to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(_forward(model).logits, _forward(ref).logits)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_training_mode_forward_draws_the_unwrapped_models_dropout_masks(name, dtype):
    """In training mode each expert applies dropout with a mask drawn from torch's generator, expert by expert in
    ascending order: the wrapped model draws the same masks in the same order (and the router's jitter noise and
    every other dropout in between), so from the same seed its outputs are the unwrapped model's."""
    ref, model = _pair(name, dtype, dropout_rate=0.3, router_jitter_noise=0.1)
    ref.train()
    model.train()
    outputs = []
    for m in (ref, model):
        torch.manual_seed(5)
        with torch.no_grad():
            outputs.append([_forward(m).logits for _ in range(2)])
    assert not torch.equal(outputs[0][0], outputs[0][1])  # the masks are random
    assert all(torch.equal(a, b) for a, b in zip(*outputs))
    model.eval()
    ref.eval()
    with torch.no_grad():
        assert torch.equal(_forward(model).logits, _forward(ref).logits)  # eval mode: dropout does nothing


@pytest.mark.parametrize("name", NAMES)
def test_a_training_mode_forward_with_host_compute_is_refused(name):
    ref, model = _pair(name, dropout_rate=0.3)
    model = MiraMoEModel.wrap(model.unload(), MiraConfig(gpu_budget=0.25, device="cpu", host_compute="on"))
    model.train()
    with pytest.raises(UnsupportedOperationError, match=r"training-mode forward.*host_compute='on'.*dropout.*model.eval\(\)"):
        _forward(model)


@pytest.mark.parametrize("name", NAMES)
def test_what_follows_each_token_through_every_layer_refuses_an_encoder_decoder(name):
    """Calibration and routing traces follow each token through a decoder-only model's MoE layers; an
    encoder-decoder's encoder and decoder route different tokens, so they refuse it with what to do instead."""
    from mira_hf.calibrate import calibrate
    from mira_hf.trace import record_topk, record_trace

    _, model = _pair(name)
    calls = {
        "calibrate": lambda: calibrate(model, PROMPT, progress=False),
        "record_topk": lambda: record_topk(model, [PROMPT[0]], progress=False),
        "record_trace": lambda: record_trace(model, PROMPT, progress=False),
    }
    for what, call in calls.items():
        with pytest.raises(UnsupportedOperationError, match=f"{what} follows each token.*encoder-decoder.*mira.stats"):
            call()
    assert model.mira.stats()["loads"] == 0  # refused before any token was routed


@pytest.mark.parametrize("name", NAMES)
def test_the_server_refuses_an_encoder_decoder_before_it_starts(name):
    from mira_hf.serve import is_serve_available

    if not is_serve_available():
        pytest.skip("needs the serve extra")
    from mira_hf.serve import build_app

    _, model = _pair(name)
    with pytest.raises(UnsupportedOperationError, match="the server .* encoder-decoder"):
        build_app(model, tokenizer=None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_served_experts_compute_the_unwrapped_models_bits(name, dtype):
    """Wrapped for CUDA (experts copied into the device cache as tokens need them), the model computes what the
    unwrapped model computes on the GPU: logits, router logits and generation."""
    config = config_or_skip(name)
    torch.manual_seed(0)
    ref = build(config).to(dtype).eval()
    model = build(config).to(dtype).eval()
    model.load_state_dict(ref.state_dict())
    ref.to("cuda")
    model = MiraMoEModel.wrap(model, MiraConfig(gpu_budget=0.25, device="cuda"))
    ids, mask, dec = PROMPT.cuda(), MASK.cuda(), DECODER.cuda()
    with torch.no_grad():
        expected, got = _with_router_logits(
            ref, model, lambda m, **kw: m(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, **kw)
        )
    assert torch.equal(got.logits, expected.logits)
    assert len(_router_logits(got)) == len(_router_logits(expected))
    assert all(torch.equal(a, b) for a, b in zip(_router_logits(expected), _router_logits(got)))
    gen = dict(do_sample=False, max_new_tokens=6, min_new_tokens=6)
    assert torch.equal(model.generate(ids, attention_mask=mask, **gen), ref.generate(ids, attention_mask=mask, **gen))
    assert model.mira.stats()["loads"] > 0
