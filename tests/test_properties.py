"""Property-based exactness: random tiny configs × random budgets (down to the minimum) × every
policy × every predictor × batches with padding × greedy / seeded sampling / beam search give the
unwrapped model's logits (fp32, ≤ 1e-5) and tokens. Shrunk failures become regular tests."""

import copy

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tiny_models import RECIPES, make_config  # noqa: E402

from mira_hf import BudgetError, MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.budget import plan_budget  # noqa: E402
from mira_hf.config import LOSSLESS_CODES, PLACEMENTS, POLICIES, PREDICTORS, QUANTIZATIONS, QuantConfig  # noqa: E402
from mira_hf.predictors import PredictorConfig  # noqa: E402
from mira_hf.quant import NATIVE_CODECS  # noqa: E402

# Config keys of the expert count and top-k per family (to draw random shapes).
SHAPE_KEYS = {
    "mixtral": ("num_local_experts", "num_experts_per_tok"),
    "qwen2_moe": ("num_experts", "num_experts_per_tok"),
    "qwen3_moe": ("num_experts", "num_experts_per_tok"),
    "olmoe": ("num_experts", "num_experts_per_tok"),
    "phimoe": ("num_local_experts", None),  # sparsemixer routing is top-2 only
    "granitemoe": ("num_local_experts", "num_experts_per_tok"),
    "gpt_oss": ("num_local_experts", "num_experts_per_tok"),
    "deepseek_v3": ("n_routed_experts", "num_experts_per_tok"),
    "deepseek_v2": ("n_routed_experts", "num_experts_per_tok"),
    "llama4": ("num_local_experts", "num_experts_per_tok"),
    "dbrx": ("ffn_config.moe_num_experts", "ffn_config.moe_top_k"),  # a sub-config's
    "jetmoe": ("num_local_experts", "num_experts_per_tok"),
}
PREDICTORS_NO_TRAINING = [p for p in PREDICTORS if p != "learned"]
_MODELS: dict = {}


def _reference(family: str, experts: int, top_k: int):
    key = (family, experts, top_k)
    if key not in _MODELS:
        from transformers import AutoModelForCausalLM

        cfg = make_config(family)
        e_key, k_key = SHAPE_KEYS[family]
        _set(cfg, e_key, experts)
        if k_key:
            _set(cfg, k_key, top_k)
        torch.manual_seed(experts * 10 + top_k)
        _MODELS[key] = AutoModelForCausalLM.from_config(cfg).eval()
    return _MODELS[key]


def _set(config, key: str, value: int) -> None:
    """Set `key` of `config`, a dotted path into its sub-configs."""
    *path, name = key.split(".")
    for part in path:
        config = getattr(config, part)
    setattr(config, name, value)


case = st.fixed_dictionaries(
    dict(
        family=st.sampled_from(sorted(SHAPE_KEYS)),
        experts=st.sampled_from([4, 8]),
        top_k=st.integers(1, 3),
        budget=st.floats(0.0, 1.0),
        policy=st.sampled_from(POLICIES),
        predictor=st.sampled_from(PREDICTORS_NO_TRAINING),
        batch=st.integers(1, 4),
        mode=st.sampled_from(["greedy", "sample", "beam"]),
        seed=st.integers(0, 2**16),
        speculate=st.sampled_from([0, 1, 700, 10**9]),  # bytes of a cut-short copy (0: off, as on CPU by default)
        host_only=st.booleans(),  # expert 0 of every layer never keeps a slot
    )
)


@given(case)
def test_wrapped_model_is_exact_under_any_configuration(c):
    assert set(RECIPES) >= set(SHAPE_KEYS)
    ref = _reference(c["family"], c["experts"], c["top_k"])
    model = copy.deepcopy(ref)
    # Budget drawn between the minimum working set and all experts.
    probe = MiraMoEModel.wrap(copy.deepcopy(ref), MiraConfig(device="cpu"))
    layers = list(probe.mira.layers.values())
    record = {li.ordinal: probe.mira.store.record_bytes(li.ordinal) for li in layers}
    total = sum(record[li.ordinal] * li.num_experts for li in layers)
    minimum = sum(max(li.top_k for li in layers) * r for r in set(record.values()))
    budget = int(minimum + c["budget"] * (total - minimum))
    plan_budget(layers, record, budget)  # must be accepted
    prediction = PredictorConfig(speculate_bytes=c["speculate"])
    cfg = MiraConfig(gpu_budget=budget, device="cpu", policy=c["policy"], predictor=c["predictor"], prediction=prediction)
    MiraMoEModel.wrap(model, cfg)
    if c["host_only"]:
        model.mira.set_host_only({layer: [0] for layer in model.mira.layers})

    g = torch.Generator().manual_seed(c["seed"])
    ids = torch.randint(3, 128, (c["batch"], 7), generator=g)
    mask = torch.ones_like(ids)
    for row in range(1, c["batch"]):  # left padding of varying length
        pad = int(torch.randint(0, 4, (1,), generator=g))
        ids[row, :pad], mask[row, :pad] = 0, 0
    with torch.no_grad():
        assert (model(ids, attention_mask=mask).logits - ref(ids, attention_mask=mask).logits).abs().max() <= 1e-5
    kw = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, pad_token_id=0)
    kw.update(
        {"greedy": dict(do_sample=False), "sample": dict(do_sample=True, top_k=10), "beam": dict(num_beams=3, do_sample=False)}[
            c["mode"]
        ]
    )
    torch.manual_seed(c["seed"])
    expected = ref.generate(ids, **kw)
    torch.manual_seed(c["seed"])
    assert torch.equal(model.generate(ids, **kw), expected)
    s = model.mira.stats()
    assert s["resident_bytes"] <= s["budget_bytes"]


compressed_case = st.fixed_dictionaries(
    dict(
        family=st.sampled_from(sorted(SHAPE_KEYS)),
        # the checkpoint formats (fp8_block, mxfp4) are only for pre-quantized checkpoints: tests/test_prequantized.py
        quantization=st.sampled_from([q for q in QUANTIZATIONS if q not in (None, "nf4", *NATIVE_CODECS)]),
        placement=st.sampled_from(PLACEMENTS),
        budget=st.floats(0.0, 1.0),
        policy=st.sampled_from(POLICIES),
        predictor=st.sampled_from(PREDICTORS_NO_TRAINING),
        batch=st.integers(1, 3),
        seed=st.integers(0, 2**16),
        speculate=st.sampled_from([0, 1, 700]),
        code=st.sampled_from(LOSSLESS_CODES),
    )
)


@given(compressed_case)
@example(  # Llama 4's experts kept packed on a CPU: through the batched matmul its decoded slots take
    dict(family="llama4", quantization="int8", placement="mixed", budget=0.5, policy="lru", predictor=None, batch=1, seed=0)
    | dict(speculate=0, code="nibble")
)
def test_compressed_transfer_computes_the_same_at_any_budget(c):
    """With a compressed format the numbers change once, at quantisation; caching never changes them:
    any budget, policy and predictor gives the logits and tokens of the same format with every expert
    resident."""
    ref = _reference(c["family"], 8, 2)
    quant = dict(quantization=c["quantization"], quant=QuantConfig(placement=c["placement"], lossless_code=c["code"]))
    full = MiraMoEModel.wrap(copy.deepcopy(ref), MiraConfig(device="cpu", gpu_budget=1.0, **quant))
    layers = list(full.mira.layers.values())
    slot = {li.ordinal: full.mira.budget.slot_bytes[full.mira.budget.pool_of_layer[li.ordinal]] for li in layers}
    total = full.mira.budget.budget_bytes
    buffers = sum(full.mira.budget.buffer_bytes.values())  # codec buffers come out of the budget first
    minimum = sum(max(li.top_k for li in layers) * r for r in set(slot.values())) + buffers
    budget = max(1, int(c["budget"] * total))
    prediction = PredictorConfig(speculate_bytes=c["speculate"])
    cfg = MiraConfig(
        device="cpu", gpu_budget=budget, policy=c["policy"], predictor=c["predictor"], prediction=prediction, **quant
    )
    if budget < minimum:  # below the working set: refused before anything changes
        with pytest.raises(BudgetError):
            MiraMoEModel.wrap(copy.deepcopy(ref), cfg)
        return
    model = MiraMoEModel.wrap(copy.deepcopy(ref), cfg)
    ids = torch.randint(3, 128, (c["batch"], 6), generator=torch.Generator().manual_seed(c["seed"]))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, full(ids).logits)
    kw = dict(max_new_tokens=5, min_new_tokens=5, pad_token_id=0, do_sample=False)
    assert torch.equal(model.generate(ids, **kw), full.generate(ids, **kw))
    s = model.mira.stats()
    assert s["resident_bytes"] <= s["budget_bytes"]


learned_case = st.fixed_dictionaries(
    dict(
        family=st.sampled_from(sorted(SHAPE_KEYS)),
        budget=st.floats(0.0, 1.0),
        policy=st.sampled_from(POLICIES),
        mode=st.sampled_from(["greedy", "beam"]),
        seed=st.integers(0, 2**16),
    )
)


@settings(max_examples=10)
@given(learned_case)
def test_calibrated_learned_predictor_keeps_outputs_exact(c):
    """The `learned` predictor (trained by `calibrate` on random tokens here, so it guesses badly or
    well by chance) only decides what is copied early: logits and tokens stay the unwrapped model's."""
    from mira_hf import calibrate

    ref = _reference(c["family"], 8, 2)
    model = MiraMoEModel.wrap(
        copy.deepcopy(ref), MiraConfig(device="cpu", gpu_budget=0.3 + 0.7 * c["budget"], policy=c["policy"])
    )
    g = torch.Generator().manual_seed(c["seed"])
    calibrate(model, torch.randint(3, 128, (4, 32), generator=g), epochs=2, progress=False, seed=c["seed"])
    assert model.mira.predictor.name == "learned"
    ids = torch.randint(3, 128, (2, 6), generator=g)
    with torch.no_grad():
        assert (model(ids).logits - ref(ids).logits).abs().max() <= 1e-5
    kw = dict(max_new_tokens=5, min_new_tokens=5, pad_token_id=0, do_sample=False)
    if c["mode"] == "beam":
        kw.update(num_beams=3)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
