"""The proxy's combine step, one experts module at a time: `MiraExperts` called with hand-made routing
computes exactly (`torch.equal`) what transformers' own experts module computes on the same inputs, under
each experts implementation ("grouped_mm", "batched_mm", "eager"), in fp32, bf16 and fp16, with routing
weights in fp32 or in the hidden dtype.

The routings are chosen to expose a wrong combine: skewed (most rows on one expert, some experts unused,
weights far from uniform), a decode step whose picks are not in ascending order (eager adds experts in
ascending order), four experts per token (the order of the additions shows in bf16/fp16), a repeated pick,
two tokens sharing the same K experts (K distinct picks, but not one token), and the expert-parallel sentinel (index E: a row that must stay zero whatever its weight).
The routings that pick the sentinel are compared only where transformers' implementation leaves its rows at zero
(`require_sentinel_reference`), and a post-expert norm only where transformers' implementations apply one (`POST_EXPERT_NORM`).
Fast: no generate, no checkpoint; a model per (family, dtype) built once.
"""

import copy
import inspect
import os

import pytest
import torch
from conftest import torch_threads
from tiny_models import build, config_or_skip, make_config
from transformers import AutoModelForCausalLM
from transformers.integrations.moe import use_experts_implementation

from mira_hf import ConfigError, MiraConfig, MiraMoEModel
from mira_hf.errors import UnsupportedOperationError
from mira_hf.experts_impl import (
    check_call,
    check_model_implementations,
    combine,
    eager_arithmetic,
    implementation_of,
)
from mira_hf.proxy import LAYOUT_FLAGS, MiraExperts

IMPLS = ("grouped_mm", "batched_mm", "eager")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# mixtral: gated [out, in] experts; qwen3_moe: the same with other routing; gpt_oss: transposed experts with
# biases and its own gate; nemotron_h: non-gated experts whose eager forward sums in the weights' dtype (before
# transformers 5.25; in the hidden dtype from 5.25).
FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss", "nemotron_h")
_BUILT: dict = {}
# grouped_mm and batched_mm normalise each expert's output where the module asks (the experts decorator's
# `has_post_expert_norm`); a transformers whose decorator has no such flag ignores a post-expert norm.
POST_EXPERT_NORM = "has_post_expert_norm" in inspect.signature(use_experts_implementation).parameters
needs_post_expert_norm = pytest.mark.skipif(
    not POST_EXPERT_NORM,
    reason="transformers' experts implementations apply no post-expert norm "
    "(its use_experts_implementation takes no has_post_expert_norm)",
)
# The routings that pick the expert-parallel sentinel, apart from the others: transformers gives no reference for them
# under some implementations (`require_sentinel_reference`), and the other routings are compared there all the same.
with_and_without_sentinel = pytest.mark.parametrize("sentinel", [False, True], ids=["no-sentinel", "sentinel"])


def experts_pair(
    name: str,
    dtype: torch.dtype,
    post_norm: bool = False,
    quantization: str | None = None,
    host_costs=None,
    predictor: str | None = "auto",
) -> tuple[torch.nn.Module, MiraExperts]:
    """(transformers' experts module of the first MoE layer, the proxy that replaced it in a wrapped copy).
    Expert biases are drawn at random (transformers initialises them to zero, which would hide them);
    `post_norm`: the experts module normalises each expert's output (transformers' `has_post_expert_norm`);
    `quantization`: the wrapped copy's expert format (None: the weights' own dtype);
    `host_costs(layers)`: wrap with host compute on, planning with these costs (`tests/test_host_compute.py`);
    `predictor`: the wrapped copy's (None: no expert is staged ahead of its block)."""
    key = (name, dtype, post_norm, quantization, predictor)
    if host_costs is not None:  # the host worker is a thread, which a forked process (mutmut's runner) lacks
        key += (host_costs, os.getpid())
    if key not in _BUILT:
        config = config_or_skip(name)
        torch.manual_seed(0)
        ref = build(config).eval()
        path = next(
            p for p, m in ref.named_modules() if p.endswith("experts") and isinstance(getattr(m, "num_experts", None), int)
        )
        experts = ref.get_submodule(path)
        with torch.no_grad():
            for pname, p in experts.named_parameters():
                if pname.endswith("_bias"):
                    p.normal_(0.0, 0.5)
        if post_norm:
            experts.has_post_expert_norm = True
            experts.post_expert_norm = torch.nn.RMSNorm(config.hidden_size, eps=1e-6)
            torch.nn.init.normal_(experts.post_expert_norm.weight, 1.0, 0.5)
        ref = ref.to(dtype)
        host = "on" if host_costs is not None else "off"
        config = MiraConfig(device="cpu", gpu_budget=0.5, quantization=quantization, host_compute=host, predictor=predictor)
        model = MiraMoEModel.wrap(copy.deepcopy(ref), config)
        if host_costs is not None:
            model.mira.host.set_costs(host_costs(list(model.mira.layers)))
        proxy = model.get_submodule(path)
        assert isinstance(proxy, MiraExperts)
        experts = ref.get_submodule(path)
        # transformers then treats index E as the EP sentinel (where it reads this flag), as the proxy always does
        experts._is_expert_parallel = True
        _BUILT[key] = (experts, proxy, model)
    return _BUILT[key][:2]


def routings(E: int, seed: int = 0, sentinel: bool | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (top_k_index [T, K], top_k_weights [T, K] fp32). `sentinel`: only the routings that pick the
    expert-parallel sentinel E (True), only those that do not (False), or all (None)."""
    g = torch.Generator().manual_seed(seed)

    def weights(T: int, K: int) -> torch.Tensor:  # far from uniform: one dominant slot, the rest small and unequal
        w = torch.rand(T, K, generator=g) * 0.2 + 0.01
        w[torch.arange(T), torch.randint(K, (T,), generator=g)] += 0.7 + 0.3 * torch.rand(T, generator=g)
        return w

    skew = torch.stack([torch.zeros(12, dtype=torch.long), torch.arange(12) % 3 + 1], 1)  # expert 0 on every token
    skew[::4] = skew[::4].flip(1)
    perms = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(5)])
    picks_and_sentinels = torch.tensor([[2, E], [E, 5], [1, 2], [E, E], [5, 1], [2, 7]])
    every = {
        "skewed prefill": (skew, weights(12, 2)),
        "decode, descending picks": (torch.tensor([[E - 1, 2]]), weights(1, 2)),
        "decode, four picks": (torch.tensor([[6, 1, E - 1, 0]]), weights(1, 4)),
        "prefill, four picks": (perms, weights(5, 4)),
        "decode, repeated pick": (torch.tensor([[3, 3]]), weights(1, 2)),
        "two tokens, the same two experts": (torch.tensor([[5, 2], [2, 5]]), weights(2, 2)),  # K experts, not a decode step
        "prefill, sentinel rows": (picks_and_sentinels, weights(6, 2)),
        "decode, sentinel slot": (torch.tensor([[E, 4]]), weights(1, 2)),
        "decode, only the sentinel": (torch.tensor([[E, E]]), weights(1, 2)),
        "decode, the sentinel among four picks": (torch.tensor([[6, E, 1, 0]]), weights(1, 4)),
    }
    return {case: r for case, r in every.items() if sentinel is None or bool((r[0] == E).any()) == sentinel}


def require_sentinel_reference(ref: torch.nn.Module, impl: str) -> None:
    """Skip the calling test where transformers' `impl` forward of experts module `ref` does not leave the rows of the
    expert-parallel sentinel at zero whatever their weight, as the proxy does: transformers then gives no reference
    for the routings that pick it. Eager loops without expert-parallel handling reject index E (`one_hot` over E
    classes) or index the experts with it; a batched_mm without it multiplies the sentinel's rows by their weight,
    counting on the router to have zeroed it."""
    E, before = ref.num_experts, ref.config._experts_implementation
    ref.config._experts_implementation = impl
    hidden = torch.ones(1, ref.config.hidden_size, dtype=next(ref.parameters()).dtype)  # [T=1, H]
    try:
        with torch.no_grad():
            out = ref(hidden, torch.tensor([[E]]), torch.ones(1, 1))  # [1, H]: its only slot the sentinel, weighted 1
    except (IndexError, RuntimeError) as exc:
        pytest.skip(f"transformers' {impl} forward of {type(ref).__name__} takes no expert-parallel sentinel (index {E}): {exc}")
    finally:
        ref.config._experts_implementation = before
    if out.any():
        pytest.skip(
            f"transformers' {impl} forward of {type(ref).__name__} does not zero the expert-parallel sentinel's rows: "
            "it weights them, counting on the router to give them weight zero"
        )


def mismatches(
    name: str,
    impl: str,
    sentinel: bool,
    post_norm: bool = False,
    quantization: str | None = None,
    dtypes=DTYPES,
    cases=None,
) -> list[str]:
    """The (routing, dtypes) cases where the proxy's output differs from transformers' experts module's.
    `sentinel`: the routings that pick the expert-parallel sentinel (the test skips where transformers gives no
    reference for them), or the others; `cases`: of those, the ones to try (default: all)."""
    found = []
    for dtype in dtypes:
        ref, proxy = experts_pair(name, dtype, post_norm, quantization)
        if sentinel:
            require_sentinel_reference(ref, impl)
        ref.config._experts_implementation = impl
        proxy.base.config._experts_implementation = impl
        H, E = proxy.base.config.hidden_size, proxy.num_experts
        for case, (index, w) in routings(E, sentinel=sentinel).items():
            if cases is not None and case not in cases:
                continue
            g = torch.Generator().manual_seed(len(case))
            hidden = (torch.randn(index.shape[0], H, generator=g) * 4).to(dtype)
            for w_dtype in {torch.float32, dtype}:
                with torch.no_grad():
                    expected = ref(hidden, index, w.to(w_dtype))
                    got = proxy(hidden, index, w.to(w_dtype))
                if got.dtype != expected.dtype or not torch.equal(got, expected):
                    found.append(f"{case}, hidden {dtype}, weights {w_dtype}")
    return found


@pytest.mark.filterwarnings("ignore:mira-hf. model_type")
@with_and_without_sentinel
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", FAMILIES)
def test_the_proxy_combines_as_transformers_experts_do(name, impl, sentinel):
    assert mismatches(name, impl, sentinel) == []


@pytest.mark.filterwarnings("ignore:mira-hf. model_type")
@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name", FAMILIES)
def test_experts_in_another_dtype_than_their_rows_compute_as_transformers_grouped_matmul_does(name, hidden_dtype):
    """bf16 experts given rows of another dtype (an FP8 checkpoint's experts left unconverted in a model loaded in
    fp32; a bitsandbytes model's bf16 norms before fp32 experts): transformers' grouped matmul casts the rows to the
    weights' dtype and weights the outputs after, and so does the proxy, never the weights to the rows' dtype."""
    ref, proxy = experts_pair(name, torch.bfloat16)
    ref.config._experts_implementation = proxy.base.config._experts_implementation = "grouped_mm"
    H, E = proxy.base.config.hidden_size, proxy.num_experts
    found = []
    for case, (index, w) in routings(E, sentinel=False).items():
        hidden = (torch.randn(index.shape[0], H, generator=torch.Generator().manual_seed(len(case))) * 4).to(hidden_dtype)
        with torch.no_grad():
            expected, got = ref(hidden, index, w), proxy(hidden, index, w)
        if got.dtype != expected.dtype or not torch.equal(got, expected):
            found.append(case)
    assert found == []


@needs_post_expert_norm
@with_and_without_sentinel
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])  # transformers' eager forwards have no post-norm
def test_a_normalised_expert_output_is_normalised_before_it_is_weighted(impl, sentinel):
    assert mismatches("qwen3_moe", impl, sentinel, post_norm=True) == []


@pytest.mark.filterwarnings("ignore:mira-hf. model_type")
@with_and_without_sentinel
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_experts_kept_packed_in_their_slots_combine_as_transformers_experts_do(name, impl, sentinel):
    """Lossless records stay packed in the cache (placement "packed") and each matmul decodes its weight:
    the decoded weights are the stored ones bit for bit, so the combine is still transformers' own (gpt_oss:
    transposed, with biases read from the record). A few routings: each matmul decodes a record."""
    assert experts_pair(name, torch.bfloat16, quantization="lossless")[1].manager.placement == "packed"
    cases = ("skewed prefill", "decode, descending picks", "prefill, sentinel rows", "decode, sentinel slot")
    assert mismatches(name, impl, sentinel, quantization="lossless", dtypes=(torch.float32, torch.bfloat16), cases=cases) == []


def test_lossy_records_kept_packed_compute_with_their_codec_under_every_implementation():
    """int8 records kept packed (placement "packed") are not transformers' weights: each expert runs through its
    codec's own matmul, so batched_mm gives the bits grouped_mm gives (not a bmm of decoded copies)."""
    from mira_hf.config import QuantConfig

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(make_config("mixtral")).eval()
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, quantization="int8", quant=QuantConfig(placement="packed"))
    proxy = MiraMoEModel.wrap(ref, cfg).model.layers[0].mlp.experts
    assert proxy.manager.placement == "packed" and not proxy.manager.store.exact
    H = proxy.base.config.hidden_size
    for case, (index, w) in routings(proxy.num_experts).items():
        hidden = torch.randn(index.shape[0], H, generator=torch.Generator().manual_seed(len(case))) * 4
        out = {}
        for impl in ("grouped_mm", "batched_mm"):
            proxy.base.config._experts_implementation = impl
            with torch.no_grad():
                out[impl] = proxy(hidden, index, w)
        assert torch.equal(out["batched_mm"], out["grouped_mm"]), case


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_experts_scaled_by_their_routing_weight_compute_as_llama4s_do(dtype):
    """Llama 4's experts module takes each expert's tokens already scaled by its routing weight ([E*T, H],
    zero rows where the router did not choose the expert) and splits each gate_up row into gate columns,
    then up columns: the proxy (`MiraScaledExperts`) gives its output bit for bit."""
    config = make_config("llama4")
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    path = next(p for p, m in ref.named_modules() if p.endswith("experts") and isinstance(getattr(m, "num_experts", None), int))
    model = MiraMoEModel.wrap(copy.deepcopy(ref), MiraConfig(device="cpu", gpu_budget=0.5))
    experts, proxy = ref.get_submodule(path), model.get_submodule(path)
    E, H, T = experts.num_experts, config.get_text_config().hidden_size, 3
    g = torch.Generator().manual_seed(0)
    x = torch.zeros(E, T, H)
    x[1] = torch.randn(T, H, generator=g) * 0.7  # expert 1 chosen by every token
    x[E - 1, 1] = torch.randn(H, generator=g) * 3  # the last expert by token 1 only; the others by none
    x = x.view(E * T, H).to(dtype)
    with torch.no_grad():
        expected, got = experts(x), proxy(x)
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert got.view(E, T, H)[0].abs().sum() == 0 and got.view(E, T, H)[1].abs().sum() > 0


def test_the_routings_tell_the_implementations_apart():
    """The cases above are strong enough to matter: on them, in bf16, transformers' three implementations
    do not all agree with one another, so a proxy combining as the wrong one would be caught. The routings
    without the expert-parallel sentinel already show it (and every implementation computes them)."""
    ref, _ = experts_pair("qwen3_moe", torch.bfloat16)
    E, H = ref.num_experts, ref.config.hidden_size
    outputs = {}
    for impl in IMPLS:
        ref.config._experts_implementation = impl
        got = []
        for case, (index, w) in routings(E, sentinel=False).items():
            hidden = (torch.randn(index.shape[0], H, generator=torch.Generator().manual_seed(len(case))) * 4).bfloat16()
            with torch.no_grad():
                got.append(ref(hidden, index, w.bfloat16()))
        outputs[impl] = got
    ref.config._experts_implementation = "grouped_mm"
    differ = lambda a, b: any(not torch.equal(x, y) for x, y in zip(outputs[a], outputs[b]))  # noqa: E731
    assert differ("eager", "grouped_mm") and differ("eager", "batched_mm")


# -- combine itself, against sums written out by hand --------------------------------------------------
def test_eager_adds_experts_in_ascending_order_rounding_after_each_add():
    # bf16 has 8 significant bits: 1 + 2**-8 rounds to 1 (ties to even), 2**-8 + 2**-8 does not vanish
    big, tiny = 1.0, 2.0**-8
    parts = torch.tensor([[big], [tiny], [tiny]], dtype=torch.bfloat16)  # token 0's K=3 rows, slot order
    ordered = torch.tensor([[0, 1, 2]])  # slot order is expert order: big + tiny + tiny, rounded after each
    reordered = torch.tensor([[2, 0, 1]])  # experts 2, 0, 1: tiny + tiny first, then big
    bf = torch.bfloat16
    assert combine(parts, ordered, "eager", bf, bf).item() == 1.0
    assert combine(parts, reordered, "eager", bf, bf).item() == 1.0 + 2.0**-7
    # grouped_mm / batched_mm: one sum over the K rows, in slot order, whatever the expert ids
    for impl in ("grouped_mm", "batched_mm"):
        assert combine(parts, reordered, impl, bf, bf).item() == parts.float().sum().bfloat16().item()


def test_combine_returns_each_tokens_sum_in_the_hidden_dtype():
    parts = torch.arange(12, dtype=torch.float32).view(6, 2)  # T=3 tokens, K=2, H=2
    index = torch.tensor([[1, 0], [0, 1], [3, 2]])
    expected = torch.tensor([[0.0 + 2.0, 1.0 + 3.0], [4.0 + 6.0, 5.0 + 7.0], [8.0 + 10.0, 9.0 + 11.0]])
    for impl in ("grouped_mm", "batched_mm", "eager"):
        out = combine(parts, index, impl, torch.float16, torch.float32)
        assert out.dtype == torch.float16 and torch.equal(out, expected.half()), impl
    single = combine(parts[:3], torch.tensor([[0], [1], [2]]), "eager", torch.float32, torch.float32)  # K=1
    assert torch.equal(single, parts[:3])


def test_eager_accumulates_in_the_dtype_it_is_given():
    # three bf16 rows whose fp32 sum differs from the bf16 running sum
    parts = torch.tensor([[1.0], [2.0**-8], [2.0**-8]], dtype=torch.float32)
    index = torch.tensor([[0, 1, 2]])
    in_fp32 = combine(parts, index, "eager", torch.float32, torch.float32)
    in_bf16 = combine(parts, index, "eager", torch.float32, torch.bfloat16)
    assert in_fp32.item() == 1.0 + 2.0**-7 and in_bf16.item() == 1.0


def test_one_experts_rows_through_the_grouped_kernel_are_its_matmul_on_the_cpu():
    """`grouped_linear`: what the proxy multiplies with where the unwrapped model runs torch's grouped kernel
    (grouped_mm off the CPU). On the CPU transformers falls back to one `mm` per expert: the same bits."""
    from mira_hf.experts_impl import grouped_linear

    g = torch.Generator().manual_seed(0)
    for rows in (5, 80):  # fewer and more rows than the weight's 64 inputs: every row is the group's
        x, w = torch.randn(rows, 64, generator=g), torch.randn(32, 64, generator=g)
        assert torch.equal(grouped_linear(x, w, False), torch.nn.functional.linear(x, w)), rows
        assert torch.equal(grouped_linear(x, w.t().contiguous(), True), x @ w.t().contiguous()), rows


def test_the_manager_sees_each_blocks_hidden_states_and_routing():
    """What a trace recorder (the learned predictor's training data) is given for a block: its layer, the
    hidden states and the top-k index the proxy was called with, under every implementation and at decode steps."""
    _, proxy = experts_pair("gpt_oss", torch.float32)
    seen = []
    proxy.manager.recorder = lambda layer, hidden, index: seen.append((layer, hidden, index))
    try:
        for impl in IMPLS:
            proxy.base.config._experts_implementation = impl
            for case in ("skewed prefill", "decode, descending picks", "decode, repeated pick"):
                index, w = routings(proxy.num_experts)[case]
                hidden = torch.randn(index.shape[0], proxy.base.config.hidden_size)
                seen.clear()
                with torch.no_grad():
                    proxy(hidden, index, w)
                assert len(seen) == 1 and seen[0][0] == proxy.layer, (impl, case)
                assert torch.equal(seen[0][1], hidden) and torch.equal(seen[0][2], index), (impl, case)
    finally:
        proxy.manager.recorder = None
        proxy.base.config._experts_implementation = "grouped_mm"


def test_a_wrapped_model_refuses_implementations_it_cannot_compute_and_sets_the_others():
    experts_pair("mixtral", torch.float32)
    model = _BUILT[("mixtral", torch.float32, False, None, "auto")][2]
    model.config._experts_implementation = "grouped_mm"
    try:
        for impl, name in (("deepgemm", "deepgemm"), ({"": "sonicmoe"}, "sonicmoe")):
            refusal = f"^experts_implementation='{name}' was requested for a model wrapped by mira-hf, but"
            with pytest.raises(ConfigError, match=refusal):
                model.set_experts_implementation(impl)
            assert model.config._experts_implementation == "grouped_mm"
        model.set_experts_implementation("eager")
        assert model.config._experts_implementation == "eager"
        model.set_experts_implementation({"": "batched_mm"})
        assert model.config._experts_implementation == "batched_mm"
    finally:
        model.config._experts_implementation = "grouped_mm"


# -- which implementation, and which accumulator ---------------------------------------------------------
def test_implementation_is_read_from_the_config_of_decorated_modules_only():
    ref, proxy = experts_pair("mixtral", torch.float32)
    ref.config._experts_implementation = "batched_mm"
    assert implementation_of(ref) == "batched_mm"
    ref.config._experts_implementation = "grouped_mm"
    assert implementation_of(ref) == "grouped_mm"

    class Plain(torch.nn.Module):  # not built by transformers' decorator: its own forward
        config = ref.config

    assert implementation_of(Plain()) == "eager"
    assert implementation_of(torch.nn.Module()) == "eager"  # no config at all
    bare = copy.copy(ref)
    bare.config = None
    assert implementation_of(bare) == "eager"
    ref.config._experts_implementation = None
    assert implementation_of(ref) == "eager"
    ref.config._experts_implementation = "grouped_mm"


def test_the_eager_loops_arithmetic_is_read_off_each_familys_own_loop():
    """ "weights" (the sum in the routing weights' dtype) only where transformers' loop does so, "fp32" only for a loop
    computing in fp32 throughout (OpenAI Privacy Filter's), "hidden" (the template) elsewhere; the probe leaves the
    module as it was."""
    nemotron, _ = experts_pair("nemotron_h", torch.bfloat16)
    mixtral, _ = experts_pair("mixtral", torch.bfloat16)

    def flags(m):
        return {n: getattr(m, n, default) for n, default in LAYOUT_FLAGS.items()}

    # NemotronH's loop allocated its accumulator with the weights' dtype before transformers 5.25
    loop = inspect.getsource(type(nemotron).forward.__wrapped__)
    assert eager_arithmetic(nemotron, flags(nemotron)) == ("weights" if "dtype=top_k_weights.dtype" in loop else "hidden")
    assert eager_arithmetic(mixtral, flags(mixtral)) == "hidden"
    before = {n: p for n, p in nemotron.named_parameters()}
    eager_arithmetic(nemotron, flags(nemotron))  # the probe runs on a stand-in: the module is untouched
    assert {n: p for n, p in nemotron.named_parameters()} == before and nemotron.num_experts == 8
    config = config_or_skip("openai_privacy_filter")
    from transformers import AutoModelForTokenClassification

    classifier = AutoModelForTokenClassification.from_config(config)
    privacy = next(m for n, m in classifier.named_modules() if n.endswith("experts"))
    assert eager_arithmetic(privacy, flags(privacy)) == "fp32"

    class Plain(torch.nn.Module):  # not built by transformers' decorator: computes as the template does
        pass

    assert eager_arithmetic(Plain(), flags(Plain())) == "hidden"


def test_implementations_mira_cannot_compute_are_refused_by_name():
    for name in ("grouped_mm", "batched_mm", "eager"):
        check_call(name)
    with pytest.raises(UnsupportedOperationError, match="experts_implementation='deepgemm' is set in the model's config"):
        check_call("deepgemm")

    class Config:
        _experts_implementation = "grouped_mm"
        sub_configs = {"text_config": None}
        text_config = type("Text", (), {"_experts_implementation": "sonicmoe"})()

    class Model(torch.nn.Module):
        config = Config()

    with pytest.raises(ConfigError, match="experts_implementation='sonicmoe' is set on Model"):
        check_model_implementations(Model())
    Config.text_config._experts_implementation = "eager"
    check_model_implementations(Model())  # every config supported: nothing raised
    Config._experts_implementation = "deepgemm"  # the model's own config is checked too, not only its sub-configs
    with pytest.raises(ConfigError, match="experts_implementation='deepgemm' is set on Model"):
        check_model_implementations(Model())
    Config._experts_implementation = None  # unset: transformers' default
    check_model_implementations(Model())

    class Bare:  # no experts implementation, no sub-configs; a sub-config named but absent
        sub_configs = {"vision_config": None}

    class BareModel(torch.nn.Module):
        config = Bare()

    for model in (BareModel(), torch.nn.Module()):  # and a module without a config: nothing to refuse
        check_model_implementations(model)
    del Bare.sub_configs
    check_model_implementations(BareModel())


# -- the proxy as one operator, and its refusal of a backward --------------------------------------------
def test_the_compiled_graphs_operator_runs_the_proxy_it_was_given():
    """`torch.ops.mira.experts(handle, ...)` (what a compiled graph calls) is the proxy's own forward, for the
    proxy whose handle it holds; its fake (shape-only) implementation gives the hidden states' shape and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    model = MiraMoEModel.wrap(
        AutoModelForCausalLM.from_config(make_config("qwen3_moe")).bfloat16().eval(), MiraConfig(device="cpu")
    )
    proxy = model.model.layers[0].mlp.experts  # handles are given as proxies are made: a model of its own
    _, other = experts_pair("mixtral", torch.bfloat16)  # another model's experts
    index, w = routings(proxy.num_experts)["skewed prefill"]
    hidden = torch.randn(index.shape[0], proxy.base.config.hidden_size).bfloat16()
    with torch.no_grad():
        got = torch.ops.mira.experts(proxy._handle, hidden, index, w.bfloat16())
        assert torch.equal(got, proxy(hidden, index, w.bfloat16()))
        assert not torch.equal(got, other(hidden, index, w.bfloat16()))
    with FakeTensorMode() as mode:
        fake = torch.ops.mira.experts(*map(mode.from_tensor, (proxy._handle, hidden, index, w)))
        assert fake.shape == hidden.shape and fake.dtype == torch.bfloat16


def test_a_backward_through_the_proxy_is_refused_with_the_reason():
    ref, proxy = experts_pair("mixtral", torch.float32)
    index, w = routings(proxy.num_experts)["skewed prefill"]
    hidden = torch.randn(index.shape[0], proxy.base.config.hidden_size, requires_grad=True)
    ref(hidden, index, w).sum().backward()  # transformers' module takes a backward
    out = proxy(hidden, index, w)
    assert out.requires_grad  # the graph reaches the input, so autograd would try
    with pytest.raises(UnsupportedOperationError, match="backward through mira-hf's offloaded experts is not supported"):
        out.sum().backward()
    with torch.no_grad():
        assert not proxy(hidden, index, w).requires_grad


THREADS = (1, 2, 4)


def _many_rows_routing(T: int, E: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens' distinct top-K picks at random slots (an expert is picked at slot 0 by some tokens and at slot
    1 by others, so rows taken by slot then token differ from rows taken by token then slot), softmax weights."""
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # [T, K]
    w = torch.softmax(torch.randn(T, K, generator=g) * 2, dim=-1)
    return index, w


@pytest.mark.filterwarnings("ignore:mira-hf. model_type")
@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_each_experts_rows_reach_its_matmul_in_the_unwrapped_models_order(name, impl):
    """Blocks of many tokens in fp32: on CPUs whose matmul kernels round a row by its place in the matmul
    (AVX-512: rows past the last full block take other code), only the unwrapped model's row order gives its
    bits: transformers' `torch.sort` of the expert ids for grouped_mm, slot then token for eager."""
    ref, proxy = experts_pair(name, torch.float32)
    ref.config._experts_implementation = impl
    proxy.base.config._experts_implementation = impl
    H, E = proxy.base.config.hidden_size, proxy.num_experts
    K = ref.config.num_experts_per_tok
    for threads in THREADS:  # how the kernels split rows among threads decides which rows are a block's tail
        with torch_threads(threads):
            for T, seed in ((9, 0), (24, 1), (40, 2)):
                index, w = _many_rows_routing(T, E, K, seed)
                hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(seed)) * 4
                with torch.no_grad():
                    expected, got = ref(hidden, index, w), proxy(hidden, index, w)
                assert torch.equal(got, expected), (T, impl, threads)


def test_llama4s_experts_compute_as_its_batched_matmul_does_with_any_thread_count():
    """Llama 4's module multiplies all experts in one `bmm`; on some CPUs a batch of one (or `mm`) rounds
    otherwise (here with 2 threads and 5-11 tokens), so the proxy multiplies one expert through a batch of two
    views of itself: the module's bits for every token count of 1-12, with 1, 2 and 4 threads."""
    config = make_config("llama4")
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config).eval()
    path = next(p for p, m in ref.named_modules() if p.endswith("experts") and isinstance(getattr(m, "num_experts", None), int))
    model = MiraMoEModel.wrap(copy.deepcopy(ref), MiraConfig(device="cpu", gpu_budget=1.0))
    experts, proxy = ref.get_submodule(path), model.get_submodule(path)
    E, H = experts.num_experts, config.get_text_config().hidden_size
    for threads in THREADS:
        with torch_threads(threads):
            for T in range(1, 13):
                g = torch.Generator().manual_seed(T)
                x = torch.randn(E, T, H, generator=g) * (torch.rand(E, T, 1, generator=g) < 0.5)  # chosen rows
                with torch.no_grad():
                    expected, got = experts(x.view(E * T, H)), proxy(x.view(E * T, H))
                assert torch.equal(got, expected), (T, threads)
