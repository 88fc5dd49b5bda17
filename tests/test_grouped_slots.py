"""Resident experts computed together: one grouped matmul over their pool's slots gives every row the bits of the
unwrapped model's grouped matmul over all experts.

The path runs on devices whose grouped kernel computes each row independently of the call's other rows
(`MiraExperts.GROUPED_SLOT_DEVICES`: CUDA). These tests turn it on for the CPU, with one torch thread, where torch's
CPU kernel has that property (with several, a CPU kernel may round a row by its place); `pytest -m gpu` checks it
on CUDA, and `benchmarks/fidelity_real_dims.py --budget 1.0` at real dimensions."""

import copy

import pytest
import torch
from conftest import ALL_TINY, load_reference, torch_threads
from test_combine import needs_post_expert_norm, with_and_without_sentinel

from mira_hf import MiraConfig, MiraMoEModel, experts_impl
from mira_hf.config import QuantConfig
from mira_hf.experts_impl import BMM_CHUNK_ROWS, BMM_SPLIT_ROWS, batched_rows, implementation_of
from mira_hf.proxy import MiraExperts
from mira_hf.testing import build, make_config


@pytest.fixture
def grouped_on_cpu(monkeypatch):
    """The grouped path on for the CPU, one torch thread, and a count of its calls."""
    calls = []
    original = MiraExperts._on_slots

    def counted(self, slots, counts, x, *rest):
        calls.append((len(slots), sum(counts)))  # experts, rows
        return original(self, slots, counts, x, *rest)

    monkeypatch.setattr(MiraExperts, "GROUPED_SLOT_DEVICES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(MiraExperts, "_on_slots", counted)
    with torch_threads(1):
        yield calls


def _wrapped(path: str, budget: float, dtype=None):
    cfg = MiraConfig(gpu_budget=budget, device="cpu")
    return MiraMoEModel.from_pretrained(path, cfg, progress=False, **({"dtype": dtype} if dtype else {})).eval()


@pytest.mark.parametrize("name", ALL_TINY)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_grouped_resident_experts_give_the_unwrapped_logits(tiny_checkpoint, grouped_on_cpu, name, dtype):
    path = tiny_checkpoint(name)
    ref = load_reference(path, dtype)
    model = _wrapped(path, 1.0, dtype)  # nothing evicted: the last call finds every expert it needs resident
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
        for t in ids[1].flip(0):  # one token at a time: experts take slots in the order of first use, not by id
            model(t.view(1, 1))
        model(ids)
        got = model(ids).logits
    assert torch.equal(got, expected)
    proxy = next(m for m in model.modules() if isinstance(m, MiraExperts))
    if type(proxy) is MiraExperts and implementation_of(proxy.base) == "grouped_mm":
        assert any(rows > experts > 1 for experts, rows in grouped_on_cpu)  # the path ran on a block of several tokens


def bmm_rows_calls(monkeypatch, from_pool: bool) -> list[tuple[int, int]]:
    """(weight entries, rows) of each batched_mm computation whose weights were (`from_pool`) or were not gathered from
    the pool's slots (a list that fills)."""
    calls = []
    original = MiraExperts._bmm_rows

    def counted(self, x, weights, at, chunks, up, down, *rest):
        if (weights is self.manager.slot_views(self.layer)) == from_pool:
            calls.append((weights[up[0]].shape[0], x.shape[0]))
        return original(self, x, weights, at, chunks, up, down, *rest)

    monkeypatch.setattr(MiraExperts, "_bmm_rows", counted)
    return calls


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_grouped_decode_steps_give_the_unwrapped_logits(tiny_checkpoint, grouped_on_cpu, name):
    path = tiny_checkpoint(name)
    ref = load_reference(path)
    model = _wrapped(path, 1.0)  # everything resident after the prompt: decode steps take the grouped path
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(
        max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True
    )
    with torch.no_grad():
        for t in torch.randperm(128, generator=torch.Generator().manual_seed(4))[:12]:  # slots in first-use order
            model(t.view(1, 1))
    out, expected = model.generate(ids, **kw), ref.generate(ids, **kw)
    assert torch.equal(out.sequences, expected.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, expected.logits, strict=True))  # every step's logits
    assert sum(rows == experts for experts, rows in grouped_on_cpu) >= 8  # decode steps: one row per expert


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss", "qwen2_moe"])
def test_batched_mm_gathers_resident_experts_from_the_pool_exactly(tiny_checkpoint, monkeypatch, name):
    """batched_mm (what `generate` decodes with on a GPU) copies each row's expert weights: resident experts are
    gathered from their pool's slots in one index per tensor (when every row's expert is resident), on every device."""
    gathers = bmm_rows_calls(monkeypatch, from_pool=True)
    path = tiny_checkpoint(name)
    ref, model = load_reference(path), _wrapped(path, 1.0)
    for m in (ref, model):
        m.set_experts_implementation("batched_mm")
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(5))
    kw = dict(
        max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True
    )
    with torch.no_grad():
        for t in ids[0].flip(0):  # slots in first-use order
            model(t.view(1, 1))
        expected, got = ref(ids).logits, model(ids).logits
    assert torch.equal(got, expected)
    out, want = model.generate(ids[:1], **kw), ref.generate(ids[:1], **kw)
    assert torch.equal(out.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, want.logits, strict=True))
    assert gathers and max(rows for _, rows in gathers) > 2  # the path ran, on several experts' rows at once


@pytest.mark.parametrize(
    "name, store", [("mixtral", "raw"), ("qwen3_moe", "raw"), ("gpt_oss", "raw"), ("qwen2_moe", "raw"), ("qwen3_moe", "lossless")]
)
def test_batched_mm_blocks_with_misses_gather_every_expert_once_their_copies_land(tiny_checkpoint, monkeypatch, name, store):
    """A decode block whose misses all got slots at `begin` computes every expert from the pool in one gather per
    tensor once its copies land (decoded into their slots, for lossless records), instead of copying each expert into
    its rows: the same bits, with misses."""
    gathers, steps = bmm_rows_calls(monkeypatch, from_pool=True), []
    decode_step = MiraExperts._decode_step
    monkeypatch.setattr(MiraExperts, "_decode_step", lambda self, *a: steps.append(len(a[3])) or decode_step(self, *a))
    path = tiny_checkpoint(name)
    formats = dict(raw=dict(quantization=None), lossless=dict(quantization="lossless", quant=QuantConfig(placement="dequant")))
    ref = load_reference(path)
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=0.5, device="cpu", **formats[store]), progress=False).eval()
    for m in (ref, model):
        m.set_experts_implementation("batched_mm")
    kw = dict(
        max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True
    )
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out, want = model.generate(ids, **kw), ref.generate(ids, **kw)
    assert torch.equal(out.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, want.logits, strict=True))
    assert model.mira.stats()["misses"] > 0
    (k,) = set(steps)  # each decode block: one token's k experts
    assert [rows for _, rows in gathers].count(k) == len(steps)  # every one of them one gather, misses or not


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# Llama 4's experts (MiraScaledExperts) have no grouped path; on CUDA in fp32 their block's sum differs from the
# original's by one rounding step (docs/RELIABILITY.md).
@pytest.mark.parametrize("name", [n for n in ALL_TINY if n != "llama4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_resident_experts_on_cuda_give_the_unwrapped_logits(tiny_checkpoint, monkeypatch, name, dtype):
    calls = []
    original = MiraExperts._on_slots
    monkeypatch.setattr(MiraExperts, "_on_slots", lambda self, *a: calls.append(1) or original(self, *a))
    path = tiny_checkpoint(name)
    ref = load_reference(path, dtype).cuda()
    cfg = MiraConfig(gpu_budget=1.0, device="cuda")
    model = MiraMoEModel.from_pretrained(path, cfg, progress=False, dtype=dtype).eval()
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        for t in ids[1].flip(0):
            model(t.view(1, 1))
        model(ids)
        assert torch.equal(model(ids).logits, ref(ids).logits)
    proxy = next(m for m in model.modules() if isinstance(m, MiraExperts))
    assert calls or type(proxy) is not MiraExperts or implementation_of(proxy.base) != "grouped_mm"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_window_of_max_groups_is_one_call_of_torchs_grouped_kernel():
    """A window of `MAX_GROUPS` slots is within what torch's grouped matmul takes in one call."""
    from mira_hf.proxy import MAX_GROUPS

    def grouped(n):  # n groups of two rows each
        x = torch.randn(2 * n, 16, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, 16, 8, device="cuda", dtype=torch.bfloat16)
        offs = torch.arange(2, 2 * n + 1, 2, device="cuda", dtype=torch.int32)
        return torch.nn.functional.grouped_mm(x, w, offs=offs)

    assert grouped(MAX_GROUPS).shape == (2 * MAX_GROUPS, 8)


def test_one_window_or_two_give_the_same_rows(tiny_checkpoint, grouped_on_cpu, monkeypatch):
    """Two resident experts in slots further apart than one grouped call reaches: two windows, each expert's rows as
    a window of its own gives them."""
    from mira_hf import proxy as proxy_module

    model = _wrapped(tiny_checkpoint("gpt_oss"), 1.0)  # biased, transposed experts
    with torch.no_grad():
        model(torch.arange(3, 40).view(1, -1))  # every expert resident
    proxy = next(m for m in model.modules() if isinstance(m, MiraExperts))
    slots = sorted(s.index for s in model.mira.cache.pools[model.mira.budget.pool_of_layer[proxy.layer]].where.values())
    a, b = slots[0], slots[-1]
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(proxy_module, "MAX_GROUPS", b - a)  # b is out of a's window
    with torch.no_grad():
        both = proxy._on_slots([a, b], [2, 3], x)
        assert torch.equal(both[:2], proxy._on_slots([a], [2], x[:2])) and torch.equal(both[2:], proxy._on_slots([b], [3], x[2:]))
    assert both.shape == x.shape


def test_a_pool_wider_than_one_grouped_call_is_covered_by_windows(tiny_checkpoint, grouped_on_cpu, monkeypatch):
    """torch's grouped matmul takes at most 1023 groups: a larger pool is multiplied window by window, exactly."""
    from mira_hf import proxy

    monkeypatch.setattr(proxy, "MAX_GROUPS", 3)
    windows = []
    original = MiraExperts._on_window
    monkeypatch.setattr(MiraExperts, "_on_window", lambda self, w, s, *a: windows.append(s) or original(self, w, s, *a))
    for name in ("qwen2_moe", "gpt_oss"):  # gpt_oss: biases, gathered per row from each window
        path = tiny_checkpoint(name)
        ref, model = load_reference(path), _wrapped(path, 1.0)
        ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            for t in ids[1].flip(0):
                model(t.view(1, 1))
            model(ids)
            assert torch.equal(model(ids).logits, ref(ids).logits)
    assert windows and all(s[-1] - s[0] < 3 for s in windows) and any(len(s) > 1 for s in windows)


@pytest.mark.filterwarnings("ignore:mira-hf. model_type")
@with_and_without_sentinel
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_resident_experts_together_combine_as_transformers_experts_do(grouped_on_cpu, monkeypatch, name, impl, sentinel):
    """test_combine's routings (skewed prefill, decode steps, repeated picks, the expert-parallel sentinel) run twice:
    the second time the experts they use are resident and computed together."""
    from test_combine import mismatches

    gathered = bmm_rows_calls(monkeypatch, from_pool=True)
    assert mismatches(name, impl, sentinel) == []
    assert mismatches(name, impl, sentinel) == []
    # the path ran (batched_mm gathers all rows' weights from the slots only where no row is the sentinel's)
    assert grouped_on_cpu if impl == "grouped_mm" else gathered or sentinel


@needs_post_expert_norm
@with_and_without_sentinel
def test_a_normalised_expert_output_is_normalised_when_resident_experts_run_together(grouped_on_cpu, sentinel):
    from test_combine import mismatches

    assert mismatches("qwen3_moe", "grouped_mm", sentinel, post_norm=True) == []
    assert mismatches("qwen3_moe", "grouped_mm", sentinel, post_norm=True) == [] and grouped_on_cpu


def _generate_reading_counters(path, ids, kw, later: bool):
    """Greedy tokens, the uses counted so far as a hook after the second decoder layer reads them at each step, and
    the final hits, misses and loads; with `later=False` every block's end runs at once."""
    model = _wrapped(path, 1.0)
    if not later:
        end = model.mira.end
        model.mira.end = lambda plan, grouped=(), later=False: end(plan, grouped, False)
    seen = []
    model.model.layers[1].register_forward_hook(lambda *a: seen.append(model.mira.stats()["hits"] + model.mira.stats()["misses"]))
    with torch.no_grad():
        out = model.generate(ids, **kw)
    s = model.mira.stats()
    return out, seen, s["hits"], s["misses"], s["loads"]


def test_counters_read_within_a_forward_step_include_every_block_run_so_far(tiny_checkpoint, grouped_on_cpu):
    """A block's bookkeeping runs at the next block's start (its end is deferred while the device runs on), yet a
    hook that reads `model.mira.stats()` between layers sees every block before it counted, and the counters
    after generate are those of ends run at once."""
    path = tiny_checkpoint("qwen3_moe")
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    runs = [_generate_reading_counters(path, ids, kw, later) for later in (True, False)]
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1:] == runs[1][1:]
    assert sum(rows == experts for experts, rows in grouped_on_cpu) >= 6  # whole resident blocks: the deferred booking


def test_an_error_after_a_deferred_block_leaves_no_slot_pinned(tiny_checkpoint, grouped_on_cpu):
    path = tiny_checkpoint("qwen3_moe")
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    model = _wrapped(path, 1.0)
    with torch.no_grad():
        model(ids)  # every expert the prompt needs is resident: the next call's blocks are whole resident groups
        handle = model.model.layers[1].register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
        with pytest.raises(RuntimeError, match="injected"):
            model(ids)
        handle.remove()
        assert model.mira._tail is None and not model.mira._forward_lock.locked()
        assert all(s.pins == 0 for pool in model.mira.cache.pools.values() for s in pool.slots)
        assert torch.equal(model(ids).logits, load_reference(path)(ids).logits)


def test_another_thread_reading_counters_mid_step_leaves_the_blocks_bookkeeping_to_the_step(tiny_checkpoint, grouped_on_cpu):
    """A metrics reader in another thread (`mira serve`'s /metrics) calls `stats()` while a step runs: the deferred
    end of the block before stays with the thread running the step (its slot-free events belong to that thread's
    stream), which finishes it at its next block; the step's tokens and counters are unchanged."""
    import threading

    path = tiny_checkpoint("qwen3_moe")
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    model = _wrapped(path, 1.0)
    with torch.no_grad():
        model(ids)  # every expert the prompt needs is resident: the next call's blocks are whole resident groups
    pending = []

    def read_elsewhere(*_):
        reader = threading.Thread(target=model.mira.stats)
        reader.start()
        reader.join()
        pending.append(model.mira._tail is not None)

    handle = model.model.layers[0].register_forward_hook(read_elsewhere)
    with torch.no_grad():
        got = model(ids).logits
    handle.remove()
    assert pending == [True] and model.mira._tail is None
    assert torch.equal(got, load_reference(path)(ids).logits)


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8, 9, 16, 32, 33, 64, 128, 130])
@pytest.mark.parametrize("row_bytes", [1, 2**20, 2**28, 2**31])
def test_batched_mm_rows_are_chunked_only_where_chunks_round_as_one_call_and_the_copies_are_large(rows, row_bytes):
    chunks = batched_rows(rows, row_bytes)
    assert chunks[0].start == 0 and chunks[-1].stop == rows  # every row once, in order
    assert all(a.stop == b.start for a, b in zip(chunks, chunks[1:]))
    sizes = {c.stop - c.start for c in chunks}
    if len(chunks) > 1:  # equal chunks of a measured size, within the bound where a measured size fits it
        assert rows in BMM_SPLIT_ROWS and len(sizes) == 1
        (size,) = sizes
        assert size in BMM_CHUNK_ROWS and (size * row_bytes <= experts_impl.BATCHED_CALL_BYTES or size == min(BMM_CHUNK_ROWS))
    else:  # one call where the copies fit, or where no measurement says chunks round alike
        assert rows * row_bytes <= experts_impl.BATCHED_CALL_BYTES or rows not in BMM_SPLIT_ROWS


def count_bmm_calls(monkeypatch) -> list[int]:
    """The rows of each `bmm` batched_mm's path makes, up and down projections (a list that fills)."""
    calls = []
    original = experts_impl.batched_linear

    def counted(x, weight, bias, transposed):
        calls.append(x.shape[0])
        return original(x, weight, bias, transposed)

    monkeypatch.setattr("mira_hf.proxy.batched_linear", counted)
    return calls


@pytest.mark.filterwarnings("ignore:mira-hf. model_type")
@with_and_without_sentinel
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3", "nemotron_h"])
def test_batched_mm_in_chunks_of_rows_combines_as_transformers_experts_do(monkeypatch, name, sentinel):
    """With at most one row's weights gathered per call (so every block of a row count in BMM_SPLIT_ROWS is split
    into calls of 4 rows), batched_mm's rows keep the bits of transformers' one `bmm` over all rows:
    test_combine's routings, fp32, bf16 and fp16, each with and without resident experts."""
    from test_combine import mismatches

    monkeypatch.setattr(experts_impl, "BATCHED_CALL_BYTES", 1)
    calls = count_bmm_calls(monkeypatch)
    assert mismatches(name, "batched_mm", sentinel) == []
    assert 4 in calls and all(n == 4 or n not in BMM_SPLIT_ROWS for n in calls)  # chunked where it may be


@with_and_without_sentinel
def test_batched_mm_in_chunks_with_lossless_records_decoded_at_use_combines_as_transformers_experts_do(monkeypatch, sentinel):
    """Lossless records kept packed in the cache: each chunked block decodes every needed expert once into its table,
    and the chunks keep the bits of transformers' one call (fp32 and bf16)."""
    from test_combine import experts_pair, mismatches

    monkeypatch.setattr(experts_impl, "BATCHED_CALL_BYTES", 1)
    calls = count_bmm_calls(monkeypatch)
    assert experts_pair("mixtral", torch.bfloat16, quantization="lossless")[1].manager.placement == "packed"
    found = mismatches("mixtral", "batched_mm", sentinel, quantization="lossless", dtypes=(torch.float32, torch.bfloat16))
    assert found == []
    assert 4 in calls and all(n == 4 or n not in BMM_SPLIT_ROWS for n in calls)


@pytest.mark.filterwarnings("ignore:mira-hf. model_type")
def test_transposed_experts_keep_batched_mms_one_call(monkeypatch):
    """Experts kept transposed (`x @ w` per row, gpt-oss) are not chunked: the rounding by rows per call was measured
    on the `w @ x` form only. A block of 16 rows stays one call, equal to transformers' module."""
    from test_combine import experts_pair

    monkeypatch.setattr(experts_impl, "BATCHED_CALL_BYTES", 1)
    calls = count_bmm_calls(monkeypatch)
    ref, proxy = experts_pair("gpt_oss", torch.float32, False, None)
    assert proxy._transposed
    for m in (ref, proxy.base):
        m.config._experts_implementation = "batched_mm"
    E, H = proxy.num_experts, proxy.base.config.hidden_size
    index = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:2] for t in range(8)])  # [8, 2]
    weights = torch.rand(8, 2, generator=torch.Generator().manual_seed(9))
    hidden = torch.randn(8, H, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert torch.equal(proxy(hidden, index, weights), ref(hidden, index, weights))
    assert calls == [16, 16]  # the up and the down projection, one call each


def test_batched_mm_in_chunks_copies_each_missing_expert_once_not_once_per_row(tiny_checkpoint, monkeypatch):
    """A batched_mm block computed in chunks whose experts are copied into a buffer (not all of them in slots) holds
    one copy of each expert, not one per row: a prompt of 2 x 8 tokens routes 32 rows to at most 8 experts."""
    monkeypatch.setattr(experts_impl, "BATCHED_CALL_BYTES", 1)
    copied = bmm_rows_calls(monkeypatch, from_pool=False)
    path = tiny_checkpoint("mixtral")
    ref = load_reference(path)
    # the minimum budget: a prompt's misses stream through a few slots, so its block's experts cannot all be in slots
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=1e-6, device="cpu"), progress=False).eval()
    for m in (ref, model):
        m.set_experts_implementation("batched_mm")
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    assert copied and all(entries <= ref.config.num_local_experts + 1 < rows for entries, rows in copied)


# One MoE layer with the expert shapes of released models (Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3 with fewer
# experts): batched_mm's chunks are the ones the 1 GiB bound picks for them, not a bound forced down on tiny experts
# (whose small products cuBLAS may split by the call's row count even in calls of 4 rows or more).
RELEASED_SHAPES = {
    "mixtral": dict(num_hidden_layers=1, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, head_dim=128),
    "qwen3_moe": dict(num_hidden_layers=1, hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8),
    "deepseek_v3": dict(
        num_hidden_layers=1,
        first_k_dense_replace=0,
        hidden_size=7168,
        moe_intermediate_size=2048,
        n_routed_experts=16,
        num_experts_per_tok=8,
        n_group=4,
        topk_group=2,
    ),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", RELEASED_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_mm_in_chunks_at_released_expert_shapes_gives_the_unwrapped_logits_on_cuda(monkeypatch, name, dtype):
    """cuBLAS's `bmm` rounds a row of a released model's expert alike in calls of 4, 8 or 16 rows: batched_mm computed
    in the chunks the 1 GiB bound picks gives the unwrapped model's one-call logits and tokens on CUDA."""
    torch.manual_seed(0)
    model = build(make_config(name, **RELEASED_SHAPES[name])).to(dtype).eval()
    ref = copy.deepcopy(model).cuda()
    model = MiraMoEModel.wrap(model, MiraConfig(gpu_budget=0.5, device="cuda"))
    for m in (ref, model):
        m.set_experts_implementation("batched_mm")
    proxy = next(m for m in model.modules() if isinstance(m, MiraExperts))
    top_k = model.config.num_experts_per_tok
    shapes = [(b, n) for b, n in ((1, 1), (2, 1), (4, 1), (8, 1), (2, 4), (8, 2), (16, 1)) if b * n * top_k in BMM_SPLIT_ROWS]
    if all(len(batched_rows(b * n * top_k, proxy._row_bytes)) == 1 for b, n in shapes):
        pytest.skip(f"{name} in {dtype}: no block of these shapes passes the bound")
    plans = []  # (rows, chunks) of each batched_mm block

    def planned(rows, row_bytes):
        plans.append((rows, len(chunks := batched_rows(rows, row_bytes))))
        return chunks

    monkeypatch.setattr("mira_hf.proxy.batched_rows", planned)
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True)
    with torch.no_grad():
        for b, n in shapes:
            ids = torch.randint(3, 128, (b, n), generator=torch.Generator().manual_seed(b * n)).cuda()
            for _ in range(2):  # the second time with the experts the first left resident
                assert torch.equal(model(ids).logits, ref(ids).logits), (b, n)
            out = model.generate(ids, return_dict_in_generate=True, **kw)
            want = ref.generate(ids, return_dict_in_generate=True, **kw)
            assert torch.equal(out.sequences, want.sequences), (b, n)
            assert all(torch.equal(a, w) for a, w in zip(out.logits, want.logits, strict=True)), (b, n)
    assert any(n > 1 for _, n in plans)  # blocks ran in chunks
