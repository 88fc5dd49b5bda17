"""Bit-identical in every dtype: a wrapped model's logits are `torch.equal` to the unwrapped model's in
fp32, bf16 and fp16, for every family (with an adapter or without), at prefill and at every decode step,
under each experts implementation transformers can run (grouped_mm, batched_mm, eager: they weight and
sum the experts' rows differently, and the proxy follows the one the model's config names at the call).

Routers are scaled so that top-k weights are far from uniform: a mis-weighted or swapped combine then
changes the logits instead of hiding in near-equal weights.
"""

import copy

import pytest
import torch
from conftest import ALL_TINY, MULTIMODAL, torch_threads
from tiny_models import AUTO_FAMILIES, build, config_or_skip

from mira_hf import ConfigError, MiraConfig, MiraMoEModel
from mira_hf.errors import UnsupportedOperationError
from mira_hf.proxy import MiraExperts

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = torch.tensor([[5, 9, 17, 33, 42, 7, 64, 100, 3]])
ROUTER_SCALE = 40.0  # tiny random routers give near-uniform weights; this makes the top-1 weight dominate
_BUILT = {}


def skewed(name: str, **overrides):
    """A tiny random model of family `name` (fp32) whose routers are scaled by ROUTER_SCALE (skipped where the
    installed transformers lacks the family). Built once per (name, overrides); callers get a copy."""
    key = (name, tuple(sorted(overrides.items())))
    if key not in _BUILT:
        config = config_or_skip(name)
        for k, v in overrides.items():
            setattr(config, k, v)
        torch.manual_seed(0)
        model = build(config).eval()
        with torch.no_grad():
            for path, module in model.named_modules():
                E = getattr(module, "num_experts", None)
                if path.endswith("experts") and isinstance(E, int):  # its router: the block's [E, H] weights
                    block = model.get_submodule(path.rpartition(".")[0])
                    for pname, p in block.named_parameters():
                        if not pname.startswith("experts.") and p.dim() == 2 and p.shape[0] == E:
                            p.mul_(ROUTER_SCALE)
        _BUILT[key] = model
    return copy.deepcopy(_BUILT[key])


def pair(name: str, dtype: torch.dtype, impl: str | None = None, mira: dict | None = None, **overrides):
    """(unwrapped, wrapped) copies of the same model in `dtype`; `impl` set on both (on the wrapped one
    after wrapping, through its `set_experts_implementation`); `mira`: more MiraConfig fields."""
    ref = skewed(name, **overrides).to(dtype)
    try:
        with torch.no_grad():
            ref(IDS, use_cache=False)
    except RuntimeError as e:  # Inkling 2's CPU code mixes fp32 and the model's dtype in a matmul
        pytest.skip(f"the unwrapped {name} model raises in {dtype} on the CPU ({e}): nothing to compare with")
    model = MiraMoEModel.wrap(copy.deepcopy(ref), MiraConfig(device="cpu", gpu_budget=0.5, **(mira or {})))
    if impl is not None:
        ref.set_experts_implementation(impl)
        model.set_experts_implementation(impl)
    return ref, model


def differences(ref, model, ids=IDS, steps: int = 3) -> list[str]:
    """Where the wrapped model's logits are not bit-identical: the whole prompt (prefill), then each decode step."""
    kw = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    kw.update(output_logits=True, return_dict_in_generate=True)
    found = []
    with torch.no_grad():
        # use_cache=False: hybrid families build no cache in a bare forward
        if not torch.equal(model(ids, use_cache=False).logits, ref(ids, use_cache=False).logits):
            found.append("prefill")
        expected, got = ref.generate(ids, **kw), model.generate(ids, **kw)
    found += [f"step {i}" for i, (a, b) in enumerate(zip(expected.logits, got.logits)) if not torch.equal(a, b)]
    if not torch.equal(expected.sequences, got.sequences):
        found.append("tokens")
    return found


def _every_family_and_dtype():
    """Every family in every dtype; the families without an adapter run bf16 in CI (where the arithmetic
    of the combine differs most) and fp32/fp16 with the slow tests, to keep CI short."""
    for name in ALL_TINY + MULTIMODAL + AUTO_FAMILIES:
        for dtype in DTYPES:
            slow = name in AUTO_FAMILIES and dtype != torch.bfloat16
            yield pytest.param(name, dtype, marks=[pytest.mark.slow] if slow else [], id=f"{name}-{str(dtype)[6:]}")


@pytest.mark.filterwarnings("ignore:mira-hf. model_type")
@pytest.mark.parametrize("name, dtype", list(_every_family_and_dtype()))
def test_logits_are_bit_identical_in_every_dtype(name, dtype):
    ref, model = pair(name, dtype)
    assert differences(ref, model) == []
    assert model.mira.stats()["loads"] > 0  # served from the store


@pytest.mark.filterwarnings("ignore:mira-hf. model_type")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", ["eager", "batched_mm"])  # grouped_mm, the default: every family above
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss", "nemotron_h"])
def test_each_experts_implementation_is_reproduced(name, impl, dtype):
    """mixtral: fp32 routing weights; qwen3_moe: weights in the hidden dtype; gpt_oss: transposed experts
    with biases; nemotron_h: non-gated experts, eager sums in the weights' dtype (before transformers 5.25)."""
    ref, model = pair(name, dtype, impl)
    assert model.config._experts_implementation == impl
    assert differences(ref, model) == []


@pytest.mark.parametrize("placement", ["packed", "dequant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_lossless_records_are_bit_identical(name, dtype, placement, impl="grouped_mm"):
    """Lossless transfer records, decoded in the slot ("dequant") or inside the matmul ("packed")."""
    from mira_hf.config import QuantConfig

    mira = dict(quantization="lossless", quant=QuantConfig(placement=placement))
    ref, model = pair(name, dtype, impl, mira)
    assert model.mira.placement == placement
    assert differences(ref, model) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_a_gate_function_that_rounds_by_layout_is_applied_as_the_implementation_applies_it(top_k, impl, dtype):
    """Exact GELU (`hidden_act="gelu"`): torch's CPU kernel rounds a strided view otherwise than one contiguous
    row. grouped_mm and batched_mm gate a block's T*K rows at once (their gate half strided), eager each expert's
    rows; an expert with one row in a block of more gates as the implementation does (one token and one expert per
    token: one contiguous row there too)."""
    ref, model = pair("mixtral", dtype, impl, hidden_act="gelu", num_experts_per_tok=top_k)
    assert differences(ref, model, steps=4) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
def test_four_experts_per_token_are_summed_in_the_implementations_order(impl, dtype):
    """With K > 2 the order of the additions shows in bf16/fp16 (eager: ascending expert ids, rounding
    after each; grouped_mm and batched_mm: slot order, one rounding)."""
    ref, model = pair("qwen3_moe", dtype, impl, num_experts_per_tok=4)
    assert differences(ref, model, steps=4) == []


def test_the_comparison_catches_an_output_off_by_one_part_in_a_million(monkeypatch):
    """The checks above would see every expert output scaled by (1 + 2**-20) in fp32."""
    ref, model = pair("mixtral", torch.float32)
    real = MiraExperts._expert
    monkeypatch.setattr(MiraExperts, "_expert", lambda self, *a, **k: real(self, *a, **k) * (1 + 2**-20))
    assert "prefill" in differences(ref, model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_comparison_catches_top_k_weights_swapped_at_decode_steps(monkeypatch, dtype):
    ref, model = pair("qwen3_moe", dtype)
    real = MiraExperts._combine

    def swapped(self, y, order, hidden, top_k_index, top_k_weights, *rest):
        if hidden.shape[0] == 1:
            top_k_weights = top_k_weights.flip(-1)
        return real(self, y, order, hidden, top_k_index, top_k_weights, *rest)

    monkeypatch.setattr(MiraExperts, "_combine", swapped)
    found = differences(ref, model)
    assert "prefill" not in found and "step 1" in found


# -- implementations mira-hf cannot reproduce ----------------------------------------------------------
@pytest.mark.parametrize("impl", ["deepgemm", "sonicmoe"])
def test_a_model_set_to_a_kernel_implementation_is_refused_untouched(impl):
    model = skewed("mixtral")
    model.config._experts_implementation = impl  # what from_pretrained(..., experts_implementation=impl) sets
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=f"experts_implementation='{impl}' is set on MixtralForCausalLM.*'grouped_mm'"):
        MiraMoEModel.wrap(model, MiraConfig(device="cpu"))
    assert not hasattr(model, "mira")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_setting_an_implementation_mira_cannot_compute_is_refused_and_changes_nothing():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    ExpertsInterface.register("my_kernel", ALL_EXPERTS_FUNCTIONS["grouped_mm"])
    try:
        _, model = pair("mixtral", torch.float32)
        for impl in ("deepgemm", "my_kernel", {"": "sonicmoe"}):
            with pytest.raises(ConfigError, match="mira-hf serves the routed experts from its own store"):
                model.set_experts_implementation(impl)
            assert model.config._experts_implementation == "grouped_mm"
        model.set_experts_implementation("eager")  # a supported one goes through to transformers
        assert model.config._experts_implementation == "eager"
        model.config._experts_implementation = "my_kernel"  # set behind the method's back: refused at the call
        with pytest.raises(UnsupportedOperationError, match="'my_kernel' is set in the model's config"):
            model(IDS)
    finally:
        ExpertsInterface._global_mapping.pop("my_kernel", None)


def test_unload_gives_back_transformers_own_set_experts_implementation():
    _, model = pair("mixtral", torch.float32)
    model.unload()
    assert "set_experts_implementation" not in model.__dict__
    model.set_experts_implementation("batched_mm")
    assert model.config._experts_implementation == "batched_mm"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama4_under_autocast_equals_the_unwrapped_model(dtype):
    """Llama 4's experts multiply with `bmm`, which autocast runs in its dtype: the experts' outputs come out in that
    dtype, and the block sums them there, as the unwrapped model does."""
    ref, model = pair("llama4", torch.float32)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        expected, got = ref(IDS, use_cache=False).logits, model(IDS, use_cache=False).logits
    assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_jetmoe_with_more_than_two_experts_per_token_equals_the_unwrapped_model(dtype):
    """JetMoE's block adds every token's weighted rows with one `index_add` (on a CPU, a bf16 one sums a token's rows
    in fp32 and rounds once): the proxy does the same, not one add per expert."""
    ref, model = pair("jetmoe", dtype, num_experts_per_tok=3)
    assert differences(ref, model) == []


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_eager_experts_with_a_hidden_size_not_a_multiple_of_four_equal_the_unwrapped_model(name):
    """transformers' eager loop gathers each expert's rows into a tensor of their own, and a CPU matmul can round by
    where its input starts: with rows of 38 fp32 values an expert's rows inside one gather of all start unaligned."""
    ref = skewed(name, hidden_size=38, head_dim=16, num_attention_heads=2, num_key_value_heads=1)
    ref.set_experts_implementation("eager")  # grouped_mm refuses rows of 38 fp32 values (strides of 16 bytes)
    model = MiraMoEModel.wrap(copy.deepcopy(ref), MiraConfig(device="cpu", gpu_budget=0.5))
    model.set_experts_implementation("eager")
    assert differences(ref, model) == []


@pytest.mark.parametrize("hidden, intermediate", [(42, 18), (64, 37)])
def test_jetmoe_rows_at_sizes_not_a_multiple_of_four_equal_the_unwrapped_model(hidden, intermediate):
    """JetMoE's block multiplies slices of one gather of every expert's rows, and of one tensor of every routed row's
    activations, not a tensor per expert: a CPU matmul rounds by where its input starts, so the proxy's rows start
    where the block's slices start, whatever the experts' row counts (prompt lengths)."""
    with torch_threads(1):
        ref, model = pair("jetmoe", torch.float32, hidden_size=hidden, intermediate_size=intermediate)
        for n in (5, 8, 11, 23):
            ids = torch.randint(3, 100, (1, n), generator=torch.Generator().manual_seed(0))
            assert differences(ref, model, ids) == [], n
