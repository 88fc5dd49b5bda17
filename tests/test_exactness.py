"""A wrapped model computes what the original computes: same logits, same tokens, at every budget."""

import pytest
import torch
from conftest import ALL_TINY, load_reference
from tiny_models import MULTIMODAL_RECIPES, RECIPES, SEQ2SEQ_RECIPES

from mira_hf import MiraConfig, MiraMoEModel
from mira_hf.config import LoaderConfig
from model_adapters import registered_adapters

BUDGETS = ["all", "half", "min"]


def _budget(model_dir: str, which: str):
    if which == "all":
        return 1.0
    if which == "half":
        return 0.5
    # The smallest budget that can run: top-k experts of one layer. Find it from the error's number.
    from mira_hf import BudgetError

    try:
        MiraMoEModel.from_pretrained(model_dir, MiraConfig(gpu_budget=1, device="cpu"), progress=False)
    except BudgetError as e:
        return int(str(e).split("minimum working set of this model: ")[1].split(" bytes")[0].replace(",", ""))
    raise AssertionError("a 1-byte budget must be refused")


def _wrapped(path: str, which: str, **kw):
    cfg = MiraConfig(gpu_budget=_budget(path, which), device="cpu", **kw)
    return MiraMoEModel.from_pretrained(path, cfg, progress=False).eval()


def test_every_registered_adapter_has_a_tiny_model():
    assert {a.name for a in registered_adapters()} <= set(RECIPES) | set(MULTIMODAL_RECIPES) | set(SEQ2SEQ_RECIPES)


@pytest.mark.parametrize("name", ALL_TINY)
@pytest.mark.parametrize("which", BUDGETS)
def test_logits_match_unwrapped_model(tiny_checkpoint, name, which):
    path = tiny_checkpoint(name)
    ref = load_reference(path)
    model = _wrapped(path, which)
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
        got = model(ids).logits
    assert torch.equal(got, expected)  # bit-identical (other dtypes: tests/test_fidelity_dtypes.py)
    stats = model.mira.stats()
    assert stats["resident_bytes"] <= stats["budget_bytes"]
    assert stats["hits"] + stats["misses"] > 0


@pytest.mark.parametrize("name", ALL_TINY)
def test_outputs_do_not_depend_on_the_budget(tiny_checkpoint, name):
    """Bit-identical logits whatever is resident: a cache state changes time, never a number."""
    path = tiny_checkpoint(name)
    ids = torch.randint(3, 128, (3, 13), generator=torch.Generator().manual_seed(2))
    outs = []
    for which in BUDGETS:
        with torch.no_grad():
            outs.append(_wrapped(path, which)(ids).logits)
    with torch.no_grad():  # every record copied in two parts (tiny records are below LoaderConfig.split_min_bytes)
        outs.append(_wrapped(path, "min", loader=LoaderConfig(split_min_bytes=0))(ids).logits)
    assert all(torch.equal(outs[0], out) for out in outs[1:])


GEN_MODES = {
    "greedy": dict(do_sample=False),
    "beam4": dict(do_sample=False, num_beams=4),
    "sample": dict(do_sample=True, top_k=20, temperature=0.9),
}


@pytest.mark.parametrize("name", ALL_TINY)
@pytest.mark.parametrize("mode", sorted(GEN_MODES))
def test_generate_is_token_identical(tiny_checkpoint, name, mode):
    path = tiny_checkpoint(name)
    ref = load_reference(path)
    model = _wrapped(path, "min")
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(GEN_MODES[mode], max_new_tokens=8, min_new_tokens=8, pad_token_id=0)
    torch.manual_seed(7)
    expected = ref.generate(ids, **kw)
    torch.manual_seed(7)
    got = model.generate(ids, **kw)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", ALL_TINY)
def test_padded_batch_generate_is_token_identical(tiny_checkpoint, name):
    path = tiny_checkpoint(name)
    ref = load_reference(path)
    model = _wrapped(path, "half")
    # Three prompts of different lengths, left-padded with pad id 0 and masked.
    ids = torch.tensor([[0, 0, 0, 5, 9, 14, 33], [0, 7, 8, 21, 40, 41, 50], [3, 4, 5, 6, 7, 8, 9]])
    mask = (ids != 0).long()
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


MORE_MODES = {
    "static cache": dict(do_sample=False, cache_implementation="static"),
    "no cache": dict(do_sample=False, use_cache=False),
    "3 samples per prompt": dict(do_sample=True, num_return_sequences=3, top_p=0.9),
    "penalties": dict(do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=2),
}


@pytest.mark.parametrize("mode", sorted(MORE_MODES))
def test_other_generation_modes_are_token_identical(tiny_checkpoint, mode):
    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), _wrapped(path, "min")
    ids = torch.tensor([[0, 0, 5, 9, 14, 33], [7, 21, 4, 8, 11, 3]])
    kw = dict(MORE_MODES[mode], attention_mask=(ids != 0).long(), max_new_tokens=8, min_new_tokens=8, pad_token_id=0)
    torch.manual_seed(7)
    expected = ref.generate(ids, **kw)
    torch.manual_seed(7)
    assert torch.equal(model.generate(ids, **kw), expected)


def test_assisted_decoding_with_a_draft_model_is_token_identical(tiny_checkpoint):
    """Speculative decoding: a draft model proposes tokens and the wrapped model verifies several at once."""
    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), _wrapped(path, "min")
    ids = torch.tensor([[7, 21, 4, 8, 11, 3]])
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    expected = ref.generate(ids, assistant_model=load_reference(path), **kw)
    assert torch.equal(model.generate(ids, assistant_model=load_reference(path), **kw), expected)


def test_streamer_receives_the_same_tokens(tiny_checkpoint):
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens.extend(value.reshape(-1).tolist())

        def end(self):
            pass

    path = tiny_checkpoint("mixtral")
    model = _wrapped(path, "min")
    ids = torch.tensor([[5, 6, 7]])
    s = Collect()
    out = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, streamer=s, pad_token_id=0)
    assert s.tokens == out[0].tolist()


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("quantization", [None, "lossless"])
def test_speculative_copies_keep_outputs_identical(tiny_checkpoint, name, quantization):
    """Copies cut short into idle link time (`PredictorConfig.speculate_bytes`), finished or dropped by
    the next block: logits, greedy and beam tokens equal the unwrapped model's."""
    from mira_hf.predictors import PredictorConfig

    path = tiny_checkpoint(name)
    ref = load_reference(path)
    cfg = MiraConfig(
        gpu_budget=0.3,
        device="cpu",
        policy="heat",
        predictor="gate",
        quantization=quantization,
        prediction=PredictorConfig(speculate_bytes=3000),
        loader=LoaderConfig(split_min_bytes=0),  # the rest of a cut-short copy is split where the first part is missing
    )
    model = MiraMoEModel.from_pretrained(path, cfg, progress=False).eval()
    assert 0 < model.mira.staging.speculate_bytes < model.mira.store.record_bytes(0)  # copies are cut short
    ids = torch.tensor([[5, 9, 14, 33, 7, 21, 2, 8]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    gen = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **gen), ref.generate(ids, **gen))
    assert torch.equal(model.generate(ids, num_beams=3, **gen), ref.generate(ids, num_beams=3, **gen))
    s = model.mira.stats()
    assert s["speculated"] > 0 and s["speculated_used"] > 0  # (wrong guesses: tests/test_cache.py)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_token_block_prefill_is_close_and_loads_each_expert_once(tiny_checkpoint, name, monkeypatch):
    """`CacheConfig(prefill_block_tokens=...)` (opt-in): an expert's rows are computed a few tokens at a
    time. Not bit-exact (a smaller matmul may round differently) but within fp32 noise, with the same
    tokens and the same copies as computing every row at once."""
    from mira_hf.config import CacheConfig

    path = tiny_checkpoint(name)
    ref = load_reference(path)
    whole = _wrapped(path, "min")
    blocks = _wrapped(path, "min", cache=CacheConfig(prefill_block_tokens=4))
    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    from mira_hf.proxy import MiraExperts

    calls = []
    real = MiraExperts._up_proj
    monkeypatch.setattr(MiraExperts, "_up_proj", lambda self, x, w, *a: calls.append(x.shape[0]) or real(self, x, w, *a))
    with torch.no_grad():
        logits = blocks(ids).logits
        n_blocks, calls[:] = list(calls), []
        whole(ids)
        assert max(n_blocks) <= 4 < max(calls) and sum(n_blocks) == sum(calls)  # the same rows, split in blocks
        assert (logits - ref(ids).logits).abs().max() <= 1e-5
    assert blocks.mira.stats()["loads"] == whole.mira.stats()["loads"]  # each expert once per block call
    gen = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(blocks.generate(ids, **gen), ref.generate(ids, **gen))


def test_prefill_block_tokens_is_validated():
    from mira_hf import ConfigError
    from mira_hf.config import CacheConfig

    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="prefill_block_tokens"):
            CacheConfig(prefill_block_tokens=bad)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_computes_the_same_bits_as_a_block_of_tokens(tiny_checkpoint, name, dtype):
    """One token goes through the proxy's decode-step path (no sort, gather or scatter); its row must be
    bit-identical to the same token's row in a block of tokens routed to other experts (the general
    path), the EP sentinel (index E, a zero row) included."""
    from mira_hf.proxy import MiraExperts

    cfg = MiraConfig(gpu_budget=0.5, device="cpu", quantization=None)
    model = MiraMoEModel.from_pretrained(tiny_checkpoint(name), cfg, dtype=dtype, progress=False)
    proxy = next(m for m in model.modules() if isinstance(m, MiraExperts))
    E, H = proxy.num_experts, model.config.hidden_size
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, H, generator=g).to(dtype)
    w = torch.rand(2, 2, generator=g).to(dtype)
    for first, second in (([1, 3], [0, 2]), ([2, E], [0, 1])):  # disjoint experts: one row each in both paths
        idx = torch.tensor([first, second])
        if E in first:
            w[0, 1] = float("inf")  # the sentinel's weight is never applied
        with torch.no_grad():
            one = proxy(h[:1], idx[:1], w[:1])
            block = proxy(h, idx, w)
        assert one.shape == (1, H) and torch.equal(one[0], block[0]) and torch.isfinite(one).all()
