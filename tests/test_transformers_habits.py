"""What transformers' own model and generation tests check, asserted of wrapped models.

transformers' `ModelTesterMixin` / `GenerationTesterMixin` build a model and use it the way its users do: every
generation mode, dict outputs with scores and router logits, left padding, a KV cache carried across calls,
`inputs_embeds`, labels, attention implementations, embeddings resized or replaced, save and reload.
`scripts/run_transformers_tests.py` runs those suites on wrapped models; each behaviour they rely on is
asserted here against the unwrapped model, built from the same weights, on every tiny family. Where mira-hf
promises exactness (fp32 on the CPU: logits, scores, router logits, losses) the comparison is `torch.equal`.
"""

import copy
import dataclasses
import hashlib
import re
import weakref

import pytest
import torch
import transformers
from conftest import ALL_TINY, halved_through_apply, load_reference, reinitialised, scaled_and_redrawn, shared_storages
from tiny_models import config_or_skip

from mira_hf import MiraConfig, MiraMoEModel
from mira_hf.errors import BudgetError, UnsupportedOperationError
from mira_hf.proxy import MiraExperts
from mira_hf.testing import step

# CI runs every test on three families of distinct layouts (Mixtral's standard experts; DeepSeek-V3's MLA
# attention, sigmoid group routing and dense first layer; gpt-oss's transposed, biased experts and sliding
# window); the other families run under -m slow (the whole sweep takes several minutes on a CPU).
# dbrx, jetmoe: experts in their own layouts (SeparateGluExperts, RoutedBlockExperts)
CI_FAMILIES = ("mixtral", "deepseek_v3", "gpt_oss", "dbrx", "jetmoe")
FAMILIES = [pytest.param(n, marks=() if n in CI_FAMILIES else pytest.mark.slow) for n in ALL_TINY]
WRAP = MiraConfig(gpu_budget=0.25, device="cpu")  # as scripts/mira_wrap_plugin.py wraps transformers' test models
IDS = torch.tensor([[5, 9, 14, 33, 60, 71, 80], [7, 21, 4, 8, 11, 3, 99]])
PADDED = torch.tensor([[0, 0, 0, 5, 9, 14, 33], [7, 21, 4, 8, 11, 3, 99]])  # left-padded with pad id 0
MASK = (PADDED != 0).long()


def _build(name: str, cls=transformers.AutoModelForCausalLM, **overrides):
    config = config_or_skip(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return cls.from_config(config).eval() if hasattr(cls, "from_config") else cls(config).eval()


def _pair(name: str, cls=transformers.AutoModelForCausalLM, **overrides):
    """(unwrapped, wrapped): two models with the same weights, the second wrapped right after construction."""
    ref = _build(name, cls, **overrides)
    model = _build(name, cls, **overrides)
    model.load_state_dict(ref.state_dict())
    return ref, MiraMoEModel.wrap(model, WRAP)


def _same(a, b) -> bool:
    """torch.equal over (nested tuples or dicts of) tensors; None matches None."""
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _both(call, ref, model):
    """(call(ref), call(model)); None where transformers' own code raises for the unwrapped model, after checking that
    the wrapped one raises the same (a drop-in fails where the original does)."""
    try:
        expected = call(ref)
    except Exception as exc:
        with pytest.raises(type(exc)):
            call(model)
        return None
    return expected, call(model)


def _generate(model, seed: int = 7, **kw):
    kw = dict(dict(max_new_tokens=5, min_new_tokens=5, pad_token_id=0), **kw)
    torch.manual_seed(seed)
    return model.generate(**kw)


# -- generation modes ---------------------------------------------------------------------------------------
# Greedy, beam-4 and top-k sampling on an unpadded prompt are in test_exactness.py; these are the other modes
# GenerationTesterMixin runs, each on a left-padded batch.
MODES = {
    "greedy": dict(do_sample=False),
    "sample_seeded": dict(do_sample=True, top_k=0, top_p=0.95, temperature=1.3),
    "beam3_return2": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "beam_sample": dict(do_sample=True, num_beams=2),
    "static_cache": dict(do_sample=False, cache_implementation="static"),
    "no_cache": dict(do_sample=False, use_cache=False),
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", FAMILIES)
def test_generation_mode_on_a_padded_batch_is_token_identical(name, mode):
    if mode == "static_cache" and name == "qwen3_next":
        pytest.skip("transformers has no static cache for linear-attention layers")
    ref, model = _pair(name)
    kw = dict(MODES[mode], input_ids=PADDED, attention_mask=MASK)
    outs = _both(lambda m: _generate(m, **kw), ref, model)  # Llama 4's static cache raises in transformers 5.17
    assert outs is None or torch.equal(*outs)


CB_BLOCKS = 16  # KV blocks of each continuous batching manager (each holds a block of tokens of every layer)
CB_BATCH_TOKENS = 64  # tokens per step: the three prompts' 12 at once, then one per request


def _continuous_batch(model, prompts, config) -> dict:
    """Each prompt's generated tokens under transformers' continuous batching (the scheduler `generate_batch` runs),
    every request queued before the scheduling loop starts: `generate_batch` starts the loop first, so which requests
    share its first steps, and the batch shapes whose floats the unwrapped model computes, depend on thread timing."""
    # A paged cache of a few blocks and small step buffers, the same for both models: older releases (5.17) size the
    # per-step buffers (attention masks over the whole cache among them) by the host's memory, ~20 GB on a CPU.
    bounded = transformers.ContinuousBatchingConfig(num_blocks=CB_BLOCKS, max_batch_tokens=CB_BATCH_TOKENS)
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=bounded)
    ids = manager.add_requests(inputs=prompts, max_new_tokens=config.max_new_tokens)
    manager.start()
    results = {}
    try:
        while len(results) < len(ids):
            result = manager.get_result(timeout=60)
            assert result is not None, f"continuous batching stopped after {len(results)} of {len(ids)} requests"
            if result.is_finished():
                assert result.error is None, result.error
                results[result.request_id] = result
    finally:
        manager.stop(block=True, timeout=60)
    return {tuple(r.prompt_ids): r.generated_tokens for r in results.values()}


# each run starts transformers' scheduler thread (~15 s on a CPU): one family in CI, the others under -m slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "mixtral" else pytest.mark.slow) for n in ALL_TINY])
def test_continuous_batching_is_token_identical(name):
    """transformers' continuous batching over a paged KV cache (`generate_batch`'s scheduler, which `mira serve`
    runs too): prompts of several lengths scheduled together give each the unwrapped model's tokens."""
    if not hasattr(transformers.GenerationMixin, "generate_batch"):
        pytest.skip(f"transformers {transformers.__version__} has no generate_batch")
    ref, model = _pair(name)
    prompts = [[5, 9, 14, 33], [7, 21, 4, 8, 11, 3, 99], [60]]
    config = transformers.GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    got = _both(lambda m: _continuous_batch(m, prompts, config), ref, model)
    if got is not None:
        expected, served = got
        assert len(expected) == len(prompts) and served == expected
        assert model.mira.stats()["loads"] > 0


@pytest.mark.parametrize("assistant", ["draft_model", "prompt_lookup"])
@pytest.mark.parametrize("name", FAMILIES)
def test_assisted_decoding_is_token_identical(name, assistant):
    """Candidate tokens, from a draft model (wrapped too) or from n-grams of the prompt, verified several at a
    time by the model (transformers supports both for one sequence only, and refuses both for some models with
    linear-attention layers, whose cache cannot be cut back: the wrapped model refuses as the original does)."""
    ref, model = _pair(name)
    prompt = torch.tensor([[5, 9, 14, 33, 5, 9, 14, 60]])  # a repeated n-gram for prompt lookup to find
    kw = dict(input_ids=prompt, do_sample=False)
    if assistant == "prompt_lookup":
        a, b = dict(prompt_lookup_num_tokens=2), dict(prompt_lookup_num_tokens=2)
    else:
        a, b = dict(assistant_model=_build(name)), dict(assistant_model=_pair(name)[1])
    helper = {id(ref): a, id(model): b}
    got = _both(lambda m: _generate(m, **helper[id(m)], **kw), ref, model)
    if got is not None:
        expected, served = got
        assert torch.equal(served, expected)


@pytest.mark.parametrize("name", FAMILIES)
def test_dict_outputs_of_generate_are_identical(name):
    """return_dict_in_generate with scores, logits, hidden states and (eager) attentions: every tensor equal."""
    ref, model = _pair(name)
    for m in (ref, model):
        m.set_attn_implementation("eager")
    kw = dict(
        input_ids=PADDED,
        attention_mask=MASK,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        output_hidden_states=True,
        output_attentions=name != "qwen3_next",  # its linear-attention layers have no attention weights
    )
    a, b = _generate(ref, **kw), _generate(model, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for field in ("scores", "logits", "hidden_states", "attentions"):
        assert _same(getattr(a, field, None), getattr(b, field, None)), field


@pytest.mark.parametrize("name", FAMILIES)
def test_beam_search_dict_outputs_are_identical(name):
    ref, model = _pair(name)
    kw = dict(input_ids=IDS, do_sample=False, num_beams=3, return_dict_in_generate=True, output_scores=True, output_logits=True)
    a, b = _generate(ref, **kw), _generate(model, **kw)
    for field in ("sequences", "sequences_scores", "scores", "logits", "beam_indices"):
        assert _same(getattr(a, field), getattr(b, field)), field


@pytest.mark.parametrize("name", FAMILIES)
def test_generate_from_inputs_embeds_is_token_identical(name):
    ref, model = _pair(name)
    embeds = ref.get_input_embeddings()(IDS)
    kw = dict(inputs_embeds=embeds, do_sample=False)
    assert torch.equal(_generate(model, **kw), _generate(ref, **kw))


# -- forward ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_router_logits_and_losses_are_identical(name):
    """output_router_logits=True with labels: logits, every layer's router logits, the loss and the aux loss."""
    ref, model = _pair(name)
    kw = dict(attention_mask=MASK, labels=PADDED, output_router_logits=True)
    with torch.no_grad():
        outs = _both(lambda m: m(PADDED, **kw), ref, model)  # granitemoe's aux loss raises in transformers 5.17
    if outs is None:
        return
    a, b = outs
    if "router_logits" not in {f.name for f in dataclasses.fields(a)}:
        pytest.skip(f"transformers' {type(ref).__name__} outputs no router logits ({type(a).__name__} has no router_logits)")
    assert len(a.router_logits) > 0
    for field in ("logits", "loss", "aux_loss", "router_logits"):
        assert _same(getattr(a, field, None), getattr(b, field, None)), field


@pytest.mark.parametrize("name", FAMILIES)
def test_kv_cache_carried_across_calls_is_identical(name):
    """A prompt's forward returns a cache; the next token's forward continues from it (as generate does)."""
    ref, model = _pair(name)
    nxt = torch.tensor([[17], [23]])
    outs = []
    with torch.no_grad():
        for m in (ref, model):
            first, cache = step(m, PADDED, attention_mask=MASK)
            mask = torch.cat([MASK, torch.ones_like(nxt)], dim=1)
            outs.append((first.logits, step(m, nxt, cache, attention_mask=mask)[0].logits))
    assert _same(outs[0], outs[1])


@pytest.mark.parametrize("name", FAMILIES)
def test_left_padding_gives_the_same_last_logits_as_the_unwrapped_model(name):
    """GenerationTesterMixin's left-padding check: the padded prompt's last logits, wrapped vs unwrapped."""
    ref, model = _pair(name)
    with torch.no_grad():
        a = ref(PADDED, attention_mask=MASK).logits[:, -1]
        b = model(PADDED, attention_mask=MASK).logits[:, -1]
        unpadded = model(PADDED[:1, 3:]).logits[:, -1]
    assert torch.equal(a, b)
    assert torch.allclose(b[:1], unpadded, atol=1e-5)  # padding changes no prediction (transformers' tolerance)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", FAMILIES)
def test_attention_implementations_compute_the_unwrapped_logits(name, attn):
    ref, model = _pair(name)
    try:
        ref.set_attn_implementation(attn)
    except ValueError as exc:  # gpt-oss has no sdpa attention (its attention sinks)
        pytest.skip(f"{name} has no {attn} attention in transformers: {str(exc)[:80]}")
    model.set_attn_implementation(attn)
    with torch.no_grad():
        assert torch.equal(model(PADDED, attention_mask=MASK).logits, ref(PADDED, attention_mask=MASK).logits)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_base_model_and_a_classification_head_are_wrapped_and_exact(name):
    """The common tests build every class of a family: the base model (hidden states) and the heads."""
    mapping = transformers.models.auto.modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
    model_type = config_or_skip(name).model_type
    classes = [transformers.AutoModel]
    if model_type in mapping:
        classes.append(getattr(transformers, mapping[model_type]))
    for cls in classes:
        ref, model = _pair(name, cls)
        assert model.mira.stats()["budget_bytes"] > 0
        with torch.no_grad():
            a, b = ref(PADDED, attention_mask=MASK), model(PADDED, attention_mask=MASK)
        field = "last_hidden_state" if cls is transformers.AutoModel else "logits"
        assert torch.equal(getattr(a, field), getattr(b, field)), cls.__name__


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_training_mode_forward_is_exact_and_backward_is_refused(name):
    """The common tests train: a forward in train mode (no dropout in these configs) matches; backward is refused
    with mira-hf's error, since expert weights live in cache slots that later copies overwrite."""
    ref, model = _pair(name)
    ref.train(), model.train()
    a, b = ref(IDS, labels=IDS), model(IDS, labels=IDS)
    assert torch.equal(a.loss, b.loss)
    with pytest.raises(UnsupportedOperationError, match="backward"):
        b.loss.backward()


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "glm4_moe"])
def test_gradient_checkpointing_backward_is_refused_with_mira_hfs_error(name, reentrant):
    """Training with activation checkpointing recomputes each layer in the backward. The experts compute without
    autograd, so the recomputation records what the forward did whatever the cache holds by then, and the backward
    stops at mira-hf's refusal (not at torch's check that the recomputed tensors match the saved ones); the model
    still serves afterwards."""
    ref, model = _pair(name)
    for m in (ref, model):
        if hasattr(m, "activation_checkpointing_enable"):  # the newer name of gradient_checkpointing_enable
            m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        else:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.train()
    ref(IDS, labels=IDS).loss.backward()  # transformers' model takes it
    with pytest.raises(UnsupportedOperationError, match="backward"):
        model(IDS, labels=IDS).loss.backward()
    ref.eval(), model.eval()
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_wrapped_models_fingerprint_hashes_its_routers(name):
    """Saved stores, predictors and traces carry the model's fingerprint, read from the wrapped model (whose experts
    modules are proxies by then, and whose blocks may no longer hold the child that kept the experts): it hashes
    the routers, the same for two wrapped models of the same weights."""
    ref, model = _pair(name)
    other = MiraMoEModel.wrap(ref, WRAP)
    assert model.mira.fingerprint == other.mira.fingerprint
    assert model.mira.fingerprint["router_sha256"] != hashlib.sha256().hexdigest()  # some router was hashed


# -- embeddings ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_input_and_output_embeddings_are_the_models_own(name):
    ref, model = _pair(name)
    path = next(n for n, m in ref.named_modules() if m is ref.get_input_embeddings())
    assert model.get_input_embeddings() is model.get_submodule(path)
    assert torch.equal(model.get_input_embeddings().weight, ref.get_input_embeddings().weight)
    assert torch.equal(model.get_output_embeddings().weight, ref.get_output_embeddings().weight)
    new = torch.nn.Embedding(128, ref.config.hidden_size, padding_idx=0)
    for m in (ref, model):
        m.set_input_embeddings(new)
        assert m.get_input_embeddings() is new
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)


@pytest.mark.parametrize("name", FAMILIES)
def test_resize_token_embeddings_matches_the_unwrapped_model(name):
    ref, model = _pair(name)
    for m in (ref, model):
        torch.manual_seed(3)
        m.resize_token_embeddings(144, mean_resizing=False)
        assert m.config.vocab_size == 144 and m.get_output_embeddings().weight.shape[0] == 144
    ids = torch.tensor([[5, 140, 14, 143, 60]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    assert torch.equal(_generate(model, input_ids=ids, do_sample=False), _generate(ref, input_ids=ids, do_sample=False))


# -- save and reload ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_save_pretrained_reloads_the_same_model_wrapped_or_not(name, tmp_path):
    ref, model = _pair(name)
    model.save_pretrained(tmp_path)
    plain = load_reference(str(tmp_path))  # its weights aligned, as the reference's (conftest.load_reference)
    again = MiraMoEModel.from_pretrained(tmp_path, WRAP, progress=False).eval()
    assert _same(dict(plain.state_dict()), dict(ref.state_dict()))
    with torch.no_grad():  # (against the unwrapped reload: a CPU kernel may round a weight by its address, and the
        # weights transformers maps from a file sit where the file put them: JetMoE's attention experts)
        expected = plain(PADDED, attention_mask=MASK).logits
        assert torch.equal(again(PADDED, attention_mask=MASK).logits, expected)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_tied_embeddings_stay_tied_through_save_and_reload(name, tmp_path):
    ref, model = _pair(name, tie_word_embeddings=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.save_pretrained(tmp_path)
    again = MiraMoEModel.from_pretrained(tmp_path, WRAP, progress=False).eval()
    assert again.get_output_embeddings().weight is again.get_input_embeddings().weight
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, ref(IDS).logits)


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "dbrx", "jetmoe"])
def test_unload_gives_back_the_unwrapped_models_parameters(name):
    ref, model = _pair(name)
    model.unload()
    assert _same(dict(model.state_dict()), dict(ref.state_dict()))
    assert model.num_parameters() == ref.num_parameters()
    assert [type(m) for _, m in model.named_modules()] == [type(m) for _, m in ref.named_modules()]


IDENTITY_STORES = {"uncompressed": {}, "lossless": {"quantization": "lossless"}, "split": {"host_compute": "split"}}


@pytest.mark.parametrize("store", IDENTITY_STORES)
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss", "dbrx"])
def test_every_parameter_keeps_its_identity_across_wrap_and_unload(name, store):
    """The expert parameters are the objects the model held before wrapping, as every other parameter is, and the
    unloaded model's are those the wrapped model exposed, holding the experts again: references and optimizers taken
    before or while wrapped keep reaching the model. Uncompressed records: an edit through a reference held from before
    wrapping reaches what the wrapped model computes (encoded ones refuse it, as through the model's own parameters)."""
    ref, model = _build(name), _build(name)
    model.load_state_dict(ref.state_dict())
    held = dict(model.named_parameters())
    MiraMoEModel.wrap(model, dataclasses.replace(WRAP, **IDENTITY_STORES[store]))
    exposed = dict(model.named_parameters())
    assert exposed.keys() == held.keys() and all(exposed[n] is held[n] for n in held)
    experts = [n for n in held if ".experts." in n]
    assert experts
    if store == "uncompressed":
        with torch.no_grad():
            held[experts[0]][1].mul_(0.5)
            ref.get_parameter(experts[0])[1].mul_(0.5)
            assert torch.equal(model(IDS).logits, ref(IDS).logits)
    else:
        assert all(held[n].is_meta for n in experts)  # the wrapped model's placeholders
    model.unload()
    back = dict(model.named_parameters())
    assert back.keys() == held.keys() and all(back[n] is held[n] for n in held)
    assert _same(dict(model.state_dict()), dict(ref.state_dict()))


def test_an_expert_parameter_torch_cannot_swap_is_replaced_saying_so():
    """A weak reference to an expert parameter makes torch refuse to swap it with its placeholder (lossless store):
    wrapping puts a new parameter there with a warning naming it, and computes the unwrapped model's logits."""
    ref, model = _build("mixtral"), _build("mixtral")
    model.load_state_dict(ref.state_dict())
    name = "model.layers.0.mlp.experts.gate_up_proj"
    held = model.get_parameter(name)
    alive = weakref.ref(held)
    with pytest.warns(UserWarning, match=rf"{re.escape(name)}: torch could not give this parameter its new data"):
        MiraMoEModel.wrap(model, dataclasses.replace(WRAP, quantization="lossless"))
    assert alive() is held and model.get_parameter(name) is not held and model.get_parameter(name).is_meta
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)


@pytest.mark.parametrize("store", ["uncompressed", "lossless"])
@pytest.mark.parametrize("name", ["mixtral", "gpt_oss", "dbrx"])
def test_an_optimizer_built_on_the_wrapped_model_trains_the_unloaded_one(name, store):
    """An optimizer built on the wrapped model, then unload() to train: one step gives every parameter, experts
    included, what the same step gives the unwrapped model."""
    ref, model = _build(name), _build(name)
    model.load_state_dict(ref.state_dict())
    MiraMoEModel.wrap(model, dataclasses.replace(WRAP, **IDENTITY_STORES[store]))
    optimizers = {ref: torch.optim.SGD(ref.parameters(), lr=0.1), model: torch.optim.SGD(model.parameters(), lr=0.1)}
    model.unload()
    for m, optimizer in optimizers.items():
        m.train()
        m(IDS, labels=IDS).loss.backward()
        optimizer.step()
    assert all(p.grad is not None for n, p in model.named_parameters() if ".experts." in n)
    assert _same(dict(model.state_dict()), dict(ref.state_dict()))


@pytest.mark.parametrize("name", FAMILIES)
def test_hooks_on_an_experts_module_run_wrapped_and_after_unload(name):
    """A forward hook that scales an experts module's output and a pre-hook that reads its input, registered before
    wrapping, run on the proxy called in its place; their handles remove them; one registered on the proxy is the
    original module's after unload(). Logits equal the unwrapped model's with the same hooks each time."""
    ref, model = _build(name), _build(name)
    model.load_state_dict(ref.state_dict())
    paths = [p for p, m in _pair(name)[1].named_modules() if isinstance(m, MiraExperts)]
    path = paths[-1]  # the last MoE layer's
    seen = {"ref": 0, "model": 0}

    def experts_of(m):
        return m.get_submodule(path)

    def hooks(m, key):
        scale = experts_of(m).register_forward_hook(lambda mod, args, out: out * 0.5)
        count = experts_of(m).register_forward_pre_hook(lambda mod, args: seen.__setitem__(key, seen[key] + 1))
        return scale, count

    ref_handles, handles = hooks(ref, "ref"), hooks(model, "model")
    model = MiraMoEModel.wrap(model, WRAP)
    # A tool that hooks every module (a profiler): the experts' `base`, listed too, is never called. (The modules
    # inside the experts module, an activation, are called once per expert by the proxy: not counted here.)
    calls = {"ref": 0, "model": 0}
    every = [
        m.register_forward_hook(lambda *a, key=key: calls.__setitem__(key, calls[key] + 1))
        for key, whole in (("ref", ref), ("model", model))
        for name, m in whole.named_modules()
        if not any(name.startswith(p + ".") and name != p + ".base" for p in paths)
    ]
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)
        assert seen["model"] == seen["ref"] > 0 and calls["model"] == calls["ref"]
        for handle in every:
            handle.remove()
        for handle in (*ref_handles, *handles):
            handle.remove()
        assert torch.equal(model(IDS).logits, ref(IDS).logits)
        assert seen["model"] == seen["ref"]  # removed from the proxy too
        hooks(ref, "ref"), hooks(model, "model")  # on the proxy, then given back
        model.unload()
        assert torch.equal(model(IDS).logits, ref(IDS).logits)
        assert seen["model"] == seen["ref"]


# -- budget ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_a_fraction_below_the_minimum_working_set_serves_at_that_minimum(name):
    """transformers' test configs route each token to a large share of few experts (DeepSeek-V3's: 8 of 8), so
    their 0.25 is below the top-k experts of one layer: a fraction is raised to that minimum with a warning and
    the model is exact; a byte budget below it is refused, the model untouched."""
    ref, model = _build(name), _build(name)
    model.load_state_dict(ref.state_dict())
    with pytest.warns(UserWarning, match=r"gpu_budget=0.01 \([\d,]+ bytes\) is below the minimum working set"):
        MiraMoEModel.wrap(model, MiraConfig(gpu_budget=0.01, device="cpu"))
    plan, layers = model.mira.budget, model.mira.layers.values()
    top_k = {g: max(li.top_k for li in layers if plan.pool_of_layer[li.ordinal] == g) for g in plan.n_slots}
    assert plan.n_slots == top_k
    minimum = sum(top_k[g] * plan.slot_bytes[g] for g in top_k) + sum(plan.buffer_bytes.values())
    assert model.mira.stats()["budget_bytes"] == minimum
    with torch.no_grad():
        assert torch.equal(model(PADDED, attention_mask=MASK).logits, ref(PADDED, attention_mask=MASK).logits)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    with pytest.raises(BudgetError, match=f"below the minimum working set of this model: {minimum:,} bytes"):
        MiraMoEModel.wrap(ref, MiraConfig(gpu_budget=minimum - 1, device="cpu"))
    assert not hasattr(ref, "mira") and _same(ref.state_dict(), before)


# -- parameters, casts and experts implementations, as transformers' tests check them -------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_num_parameters_counts_the_experts(name):
    ref, model = _pair(name)
    assert model.num_parameters() == ref.num_parameters()


@pytest.mark.parametrize("name", FAMILIES)
def test_state_dict_holds_the_expert_tensors(name):
    ref, model = _pair(name)
    assert set(model.state_dict()) == set(ref.state_dict())


def _strided(model) -> list[str]:
    return [n for n, p in model.named_parameters() if not p.is_contiguous()]


@pytest.mark.parametrize("name", FAMILIES)
def test_parameters_are_contiguous_when_built_and_when_reloaded(name, tmp_path):
    """transformers' `test_load_contiguous_weights`: every parameter is contiguous, after construction and after
    save_pretrained and from_pretrained. A wrapped model's fused expert tensors (`gate_up_proj [E, 2I, H]`, ...)
    are among its parameters and hold the unwrapped model's values."""
    ref, model = _pair(name)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert _strided(model) == []
    model.save_pretrained(tmp_path)
    streamed = MiraMoEModel.from_pretrained(tmp_path, WRAP, progress=False)
    loaded = MiraMoEModel.wrap(transformers.AutoModelForCausalLM.from_pretrained(tmp_path), WRAP)
    for again in (streamed, loaded):
        assert _strided(again) == []
        params = dict(again.named_parameters())
        assert all(torch.equal(params[n], p) for n, p in ref.named_parameters())


def _experts_modules(model) -> dict[str, tuple]:
    """Modules transformers' code takes for experts modules (they carry `has_gate`) and that hold expert weights,
    with their layout flags and those weights' names, as its parallel-plan tests find them (a wrapped model's
    `base`, the original module stripped of its weights, holds none)."""
    params = dict(model.named_parameters())
    found = {}
    for name, m in model.named_modules():
        weights = sorted(p for p in ("gate_up_proj", "up_proj", "down_proj") if f"{name}.{p}" in params)
        if hasattr(m, "has_gate") and weights:
            found[name] = (m.has_gate, getattr(m, "has_bias", None), getattr(m, "is_transposed", None), weights)
    return found


@pytest.mark.parametrize("name", FAMILIES)
def test_named_modules_are_the_unwrapped_models_and_each_experts_base(name):
    """Code that finds modules by name (get_submodule, hooks on an activation, target lists) finds the unwrapped
    model's: each experts module's members keep their names; the only addition is each proxy's `base` (the original
    experts module, kept for unload)."""
    ref, model = _pair(name)
    names = {n for n, _ in ref.named_modules()}
    experts = {n for n, m in model.named_modules() if isinstance(m, MiraExperts)}
    assert experts and {n for n, _ in model.named_modules()} == names | {f"{n}.base" for n in experts}
    # a child of the experts module that keeps their tensors (DBRX's `mlp`) is a holder of them, with its members
    held = {f"{e}.{path}" for e in experts for path in getattr(model.get_submodule(e), "_holders", {})}
    for n, module in ref.named_modules():
        got = model.get_submodule(n)
        if n in experts:
            assert isinstance(got, MiraExperts), n
        elif n in held:
            assert {c: type(m) for c, m in got.named_children()} == {c: type(m) for c, m in module.named_children()}, n
        else:
            assert type(got) is type(module), n


@pytest.mark.parametrize("name", FAMILIES)
def test_apply_with_transformers_init_does_what_it_does_to_the_unwrapped_model(name, tmp_path):
    """`model.apply(model._init_weights)` (re-initialising, as research code and transformers' own tests do):
    on a model built from its config it draws new experts in the same order from the same generator, which the
    next forward then computes with; on a loaded model transformers' flags make it leave loaded tensors alone,
    the experts included. Either way the logits equal the unwrapped model's after the same call."""
    ref, model = _pair(name)
    ref.save_pretrained(tmp_path)
    loaded_ref = load_reference(str(tmp_path))  # its experts aligned as mira-hf's copies are (conftest)
    loaded = MiraMoEModel.from_pretrained(tmp_path, WRAP, progress=False).eval()
    for a, b in ((ref, model), (loaded_ref, loaded)):
        got, expected = reinitialised(a, b, lambda m: m(IDS))
        assert torch.equal(got.logits, expected.logits)


@pytest.mark.parametrize("name", FAMILIES)
def test_apply_meets_each_module_and_parameter_once_as_on_the_unwrapped_model(name):
    """`model.apply(fn)` calls `fn` once on each module, which holds its own parameters there: an `fn` that scales
    them (`p.mul_(2)`), draws new values into them from the generator, or counts them, does to a wrapped model what it
    does to the unwrapped one. The experts module it meets is of the unwrapped class, holding the expert tensors."""
    ref, model = _pair(name)
    met_ref, met_model = scaled_and_redrawn(ref, model, lambda m: m(IDS))
    assert met_model == met_ref
    assert _same(dict(model.state_dict()), dict(ref.state_dict()))
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)


@pytest.mark.parametrize("name", FAMILIES)
def test_apply_meets_the_experts_module_with_its_parameters_and_members(name):
    """`model.apply(fn)` where `fn` freezes the experts modules it finds by `isinstance` (`m.requires_grad_(False)`):
    it meets each with the parameters and members the unwrapped one holds, and freezes what it freezes."""
    ref, model = _pair(name)
    path = next(p for p, m in model.named_modules() if isinstance(m, MiraExperts))
    experts_class = type(ref.get_submodule(path))
    met = {"ref": [], "model": []}

    def freeze_experts(key):
        def fn(m):
            if isinstance(m, experts_class):
                met[key].append(([n for n, _ in m.named_parameters()], [n for n, _ in m.named_modules()]))
                m.requires_grad_(False)

        return fn

    ref.apply(freeze_experts("ref")), model.apply(freeze_experts("model"))
    assert met["model"] == met["ref"] != []
    assert {n: p.requires_grad for n, p in model.named_parameters()} == {n: p.requires_grad for n, p in ref.named_parameters()}


@pytest.mark.parametrize("name", FAMILIES)
def test_parameters_apply_puts_in_place_of_the_experts_are_what_the_model_computes(name):
    """`model.apply(fn)` where `fn` gives the experts module and the modules inside it (found by `isinstance`) new
    parameters in place of theirs (`m.weight = nn.Parameter(...)`): the model computes with the new values and its
    state dict holds them, as the unwrapped model's does."""
    ref, model = _pair(name)
    path = next(p for p, m in model.named_modules() if isinstance(m, MiraExperts))
    kinds = tuple({type(m) for m in ref.get_submodule(path).modules()})
    before, expected, got = halved_through_apply(ref, model, kinds, lambda m: m(IDS))
    assert not torch.equal(expected, before) and torch.equal(got, expected)
    assert _same(dict(model.state_dict()), dict(ref.state_dict()))


@pytest.mark.parametrize("name", FAMILIES)
def test_hooks_registered_through_apply_on_the_experts_class_run(name):
    """`model.apply(fn)` where `fn` hooks the modules of the experts class (found by `isinstance`, as tools that
    instrument one kind of module do): the hook runs around each experts call, as on the unwrapped model."""
    ref, model = _pair(name)
    path = next(p for p, m in model.named_modules() if isinstance(m, MiraExperts))
    experts_class = type(ref.get_submodule(path))

    def halve_experts(m):
        if isinstance(m, experts_class):
            m.register_forward_hook(lambda mod, args, out: out * 0.5 if isinstance(out, torch.Tensor) else out)

    with torch.no_grad():
        before = ref(IDS).logits
        ref.apply(halve_experts), model.apply(halve_experts)
        expected = ref(IDS).logits
        assert not torch.equal(expected, before)
        assert torch.equal(model(IDS).logits, expected)


@pytest.mark.parametrize("name", FAMILIES)
def test_experts_modules_carry_transformers_layout_flags(name):
    """transformers finds experts modules by their `has_gate` flag and reads `has_bias` / `is_transposed` (its
    tests check that parallel plans shard every expert weight so found): a wrapped model's are the same modules,
    with the same flags and expert parameters."""
    ref, model = _pair(name)
    assert _experts_modules(ref) != {} or name in ("llama4", "dbrx", "jetmoe")  # their experts modules have no such flags
    assert _experts_modules(model) == _experts_modules(ref)


@pytest.mark.parametrize("name", FAMILIES)
def test_state_dict_tensors_share_storage_only_where_the_unwrapped_models_do(name):
    """transformers takes tensors on one storage for tied weights: save_pretrained keeps one name of each group,
    and its tests check that every group is declared in `_tied_weights_keys`. A wrapped model's expert tensors
    (views of one record slab per layer) must not form such groups; tied embeddings still do."""
    ref, model = _pair(name, tie_word_embeddings=True)
    assert shared_storages(model) == shared_storages(ref)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_base_model_of_a_wrapped_model_saves_what_the_unwrapped_one_loads(name, tmp_path):
    """transformers' tests save `model.base_model` alone (a submodule of the wrapped model) and load it back."""
    ref, model = _pair(name)
    model.base_model.save_pretrained(tmp_path / "wrapped")
    ref.base_model.save_pretrained(tmp_path / "unwrapped")
    # (DBRX's base model loaded alone computes its attention otherwise than inside the causal LM: compared with the
    # unwrapped model's own save, loaded the same way)
    loaded, want = (type(ref.base_model).from_pretrained(tmp_path / d).eval() for d in ("wrapped", "unwrapped"))
    with torch.no_grad():
        assert torch.equal(loaded(IDS)[0], want(IDS)[0])  # the last hidden state (llama4: the logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_a_cast_wrapped_model_computes_what_the_cast_unwrapped_model_computes(name, dtype):
    ref, model = _pair(name)
    ref.to(dtype), model.to(dtype)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)


def _implementation_cases():
    """(family, dtype, experts implementation): a model wrapped after its cast to the dtype."""
    for name in CI_FAMILIES:
        for dtype in (torch.float32, torch.bfloat16):
            for impl in ("eager", "batched_mm", "grouped_mm"):
                yield pytest.param(name, dtype, impl, id=f"{name}-{str(dtype)[6:]}-{impl}")


@pytest.mark.parametrize("name, dtype, impl", list(_implementation_cases()))
def test_every_experts_implementation_gives_the_unwrapped_bits(name, dtype, impl):
    """transformers' tests compare its experts implementations (eager, batched_mm, grouped_mm: the default)."""
    ref, model = _build(name), _build(name)
    model.load_state_dict(ref.state_dict())
    ref.to(dtype), model.to(dtype)
    MiraMoEModel.wrap(model, WRAP)
    try:
        ref.set_experts_implementation(impl)
    except ValueError as refused:  # a model whose experts are outside the interface (DBRX) takes no grouped_mm
        with pytest.raises(ValueError, match=re.escape(str(refused))):
            model.set_experts_implementation(impl)
    else:
        model.set_experts_implementation(impl)
    with torch.no_grad():
        assert torch.equal(model(PADDED, attention_mask=MASK).logits, ref(PADDED, attention_mask=MASK).logits)


def test_deep_copy_is_refused_with_a_clear_error():
    """transformers' tests deep-copy models (e.g. to compare two attention implementations); mira-hf refuses."""
    _, model = _pair("mixtral")
    with pytest.raises(UnsupportedOperationError, match="deep-copied"):
        copy.deepcopy(model)


@pytest.mark.parametrize("name, child", [("dbrx", "mlp"), ("jetmoe", "output_linear")])
def test_hooks_on_a_module_inside_the_experts_that_the_proxy_replaces_are_refused_before_wrapping(name, child):
    """DBRX and JetMoE keep their expert tensors on a child of the experts module, which the wrapped model no longer
    calls: a hook there would silently stop running, so wrapping is refused, saying where to register it instead, and
    the model is left as it was."""
    model = _build(name)
    path = [p for p, m in _pair(name)[1].named_modules() if isinstance(m, MiraExperts)][0]
    model.get_submodule(f"{path}.{child}").register_forward_hook(lambda mod, args, out: None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        UnsupportedOperationError, match=rf"{re.escape(path)}\.{child}'\], which have forward.*on {re.escape(path)} instead"
    ):
        MiraMoEModel.wrap(model, WRAP)
    assert not hasattr(model, "mira") and not any(isinstance(m, MiraExperts) for m in model.modules())
    assert _same(dict(model.state_dict()), before)


@pytest.mark.parametrize("name", FAMILIES)
def test_an_experts_modules_attributes_read_as_on_the_unwrapped_model(name):
    """Code that reads an experts module's own attributes (its sizes, its config, a gate's `alpha` and `limit`,
    transformers' layout flags, as exporters do) reads them off the proxy standing in its place."""
    ref, model = _pair(name)
    modules = dict(ref.named_modules())
    proxies = {n: m for n, m in model.named_modules() if isinstance(m, MiraExperts)}
    for path, proxy in proxies.items():
        original = modules[path]
        public = {k: v for k, v in vars(original).items() if not k.startswith("_") and k != "training"}
        assert public and all(getattr(proxy, k) == v for k, v in public.items()), path
    with pytest.raises(AttributeError, match="no attribute 'not_an_attribute'"):
        next(iter(proxies.values())).not_an_attribute  # noqa: B018


ACTIVATIONS = ("transformers.activations", "torch.nn.modules.activation")  # the modules of activation classes


def _activations(model) -> list[str]:
    """Paths of the model's activation modules, as an ablation finds them."""
    return [n for n, m in model.named_modules() if type(m).__module__ in ACTIVATIONS]


def _replace_activations(model, how: str) -> None:
    """Every activation module of `model` replaced by `Tanh`: found by `named_modules()` and replaced through
    `set_submodule`, or by `model.apply(fn)` with an `fn` that replaces the activations among a module's children."""
    if how == "set_submodule":
        for path in _activations(model):
            model.set_submodule(path, torch.nn.Tanh())
        return

    def fn(m):
        for name, child in list(m.named_children()):
            if type(child).__module__ in ACTIVATIONS:
                setattr(m, name, torch.nn.Tanh())

    model.apply(fn)


@pytest.mark.parametrize("how", ["set_submodule", "apply"])
@pytest.mark.parametrize("name", FAMILIES)
def test_activations_replaced_after_wrapping_are_what_the_model_computes(name, how):
    """An ablation replaces every activation module after wrapping, those of the experts among them: through
    `set_submodule` at the paths `named_modules()` lists, or on their parents through `model.apply(fn)`. The model
    computes with the new ones, as the unwrapped model with the same change does, and `unload()` gives back a model
    that holds them."""
    if name == "gpt_oss":
        pytest.skip("its experts' gate clamps by `alpha` and `limit`, with no activation module (the next test)")
    ref, model = _pair(name)
    with torch.no_grad():
        before = ref(IDS).logits
        assert _activations(model) == _activations(ref)
        _replace_activations(ref, how), _replace_activations(model, how)
        expected = ref(IDS).logits
        assert not torch.equal(expected, before)
        assert torch.equal(model(IDS).logits, expected)
        assert _activations(model) == _activations(ref)
        model.unload()
        assert torch.equal(model(IDS).logits, expected)


@pytest.mark.parametrize(
    "name, attr, value",
    [
        ("gpt_oss", "limit", lambda: 0.5),
        ("gpt_oss", "alpha", lambda: 3.0),
        ("mixtral", "act_fn", torch.nn.ReLU),
        ("deepseek_v3", "act_fn", torch.nn.ReLU),
        ("dbrx", "mlp.activation_fn", torch.nn.ReLU),
        ("jetmoe", "activation", torch.nn.ReLU),
    ],
)
def test_an_experts_modules_attributes_set_after_wrapping_are_what_the_model_computes(name, attr, value):
    """An attribute or member of each experts module (a gate's `limit` or `alpha`, the activation) set after wrapping
    (`experts.act_fn = nn.ReLU()`): the model computes with it, as the unwrapped model with the same change does, and
    `unload()` gives back experts modules that hold it."""
    ref, model = _pair(name)
    paths = [p for p, m in model.named_modules() if isinstance(m, MiraExperts)]
    owner, _, leaf = attr.rpartition(".")
    with torch.no_grad():
        before = ref(IDS).logits
        for m in (ref, model):
            for path in paths:
                setattr(m.get_submodule(f"{path}.{owner}" if owner else path), leaf, value())
        expected = ref(IDS).logits
        assert not torch.equal(expected, before)
        assert torch.equal(model(IDS).logits, expected)
        model.unload()
        assert torch.equal(model(IDS).logits, expected)
    for path in paths:  # (a value, or a module, as its repr shows it)
        got, want = (getattr(m.get_submodule(f"{path}.{owner}" if owner else path), leaf) for m in (model, ref))
        assert repr(got) == repr(want)


@pytest.mark.parametrize("name", ["jetmoe", "dbrx", "switch_transformers"])
def test_routers_quantized_dynamically_after_wrapping_are_served_as_the_unwrapped_model_is(name):
    """`torch.ao.quantization.quantize_dynamic(model, {nn.Linear})`, a CPU inference habit, turns these families' router
    `nn.Linear` into a quantized one whose `weight` is a method: prediction, which reads a router's weight matrix, does
    without it, and the model generates what the unwrapped one quantized the same way does."""
    from mira_hf.testing import build

    def quantized(model):
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)

    torch.manual_seed(0)
    ref = quantized(build(config_or_skip(name)).eval())
    torch.manual_seed(0)
    model = quantized(MiraMoEModel.wrap(build(config_or_skip(name)).eval(), MiraConfig(gpu_budget=0.25, device="cpu")))
    ids = torch.tensor([[5, 9, 14, 33, 60, 71, 80, 2]])
    kw = dict(max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
