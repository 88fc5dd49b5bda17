"""Host compute (`MiraConfig(host_compute=...)`): a miss is computed on the host when that finishes before
its copy would. The planner's choices against hand-computed costs; outputs within the documented bound
when the host path is forced (injected costs: on a CPU the device is the host); a miss served on the host
takes no slot and copies nothing; prefill-sized blocks stay on the device; clear errors."""

import copy

import pytest
import torch
from conftest import ALL_TINY, MULTIMODAL, new_thread_cpu_threads, torch_threads
from test_combine import FAMILIES as COMBINE_FAMILIES
from test_combine import (
    IMPLS,
    experts_pair,
    needs_post_expert_norm,
    require_sentinel_reference,
    routings,
    with_and_without_sentinel,
)
from tiny_models import AUTO_FAMILIES, build, config_or_skip, make_config
from transformers import AutoModelForCausalLM

from mira_hf import ConfigError, MiraConfig, MiraMoEModel, bundled_model_path
from mira_hf.host_compute import MAX_HOST_ROWS, HostCosts

IDS = torch.tensor([[5, 9, 17, 33, 42, 7, 64, 100, 3]])
MS = 1e-3


def costs(link_bytes_per_s=1e9, host_s=None, host_overhead_s=0.0) -> HostCosts:
    return HostCosts(link_bytes_per_s, copy_overhead_s=0.0, host_overhead_s=host_overhead_s, host_s=host_s or {})


# -- the planner, by hand ------------------------------------------------------------------------
def test_each_miss_goes_to_the_path_that_finishes_it_first():
    # Copies of 2 ms each (2 MB at 1 GB/s), 3 ms per expert on the host, link idle:
    # miss a: link 2 < host 3 -> link; b: link 4 > host 3 -> host; c: link 4 < host 6 -> link.
    c = costs(host_s={0: {1: 3 * MS}})
    assert c.split(0, [10, 11, 12], [1, 1, 1], nbytes=2_000_000, now=100.0) == ([10, 12], [11])


def test_the_planner_counts_copies_queued_ahead_and_the_host_jobs_fixed_cost():
    c = costs(host_s={0: {1: 3 * MS}}, host_overhead_s=0.5 * MS)
    c.link_free_at = 100.0 + 5 * MS  # 5 ms of copies still queued
    # a: link 7 > host 3.5 -> host; b: link 7 > host 6.5 -> host; c: link 7 < host 9.5 -> link.
    assert c.split(0, [1, 2, 3], [1, 1, 1], nbytes=2_000_000, now=100.0) == ([3], [1, 2])
    # Once the queue has drained (later `now`), the first miss is copied again.
    assert c.split(0, [1, 2, 3], [1, 1, 1], nbytes=2_000_000, now=200.0) == ([1, 3], [2])


def test_host_jobs_that_ran_late_move_misses_back_to_the_link():
    # As in test_each_miss_goes_to_the_path_that_finishes_it_first (miss b goes to the host: 3 < 4 ms) ...
    c = costs(host_s={0: {1: 3 * MS}})
    # ... until jobs planned at 3 ms take 5 ms (the device work queued ahead of their rows): the lag's moving
    # average is 0.25 * 2 ms, then 0.75 * 0.5 + 0.25 * 2 = 0.875 ms, and b's host finish 3.875 ms still beats 4 ms;
    # a third late job makes it 0.75 * 0.875 + 0.25 * 2 = 1.156 ms: b is copied (4 < 4.156 ms), and c, behind two
    # copies (6 ms), goes to the host; after a job 17 ms late (5.117 ms) every miss is copied.
    c.observe_job(c.job_s(0, [1]), 5 * MS)
    assert c.host_lag_s == pytest.approx(0.5 * MS)
    c.observe_job(c.job_s(0, [1]), 5 * MS)
    assert c.host_lag_s == pytest.approx(0.875 * MS)
    assert c.split(0, [10, 11, 12], [1, 1, 1], nbytes=2_000_000, now=100.0) == ([10, 12], [11])
    c.observe_job(c.job_s(0, [1]), 5 * MS)
    assert c.split(0, [10, 11, 12], [1, 1, 1], nbytes=2_000_000, now=100.0) == ([10, 11], [12])
    c.observe_job(c.job_s(0, [1]), 20 * MS)
    assert c.host_lag_s == pytest.approx((0.75 * 1.15625 + 0.25 * 17) * MS)
    assert c.split(0, [10, 11, 12], [1, 1, 1], nbytes=2_000_000, now=100.0) == ([10, 11, 12], [])
    lag = c.host_lag_s
    c.observe_job(c.job_s(0, [1]), 1 * MS)  # a job faster than planned adds no negative lag
    assert c.host_lag_s == pytest.approx(0.75 * lag)


def test_experts_with_many_rows_stay_on_the_device():
    c = costs(host_s={0: {1: 1e-9}}, link_bytes_per_s=1.0)  # the host is free, the link is hopeless ...
    assert c.split(0, [4, 5], [MAX_HOST_ROWS + 1, 1], nbytes=10**6, now=0.0) == ([4], [5])  # ... but not for a prefill


def test_host_times_are_interpolated_and_refined_online():
    c = costs(host_s={0: {1: 1 * MS, 4: 4 * MS, 8: 6 * MS}})
    assert c.host_time(0, 1) == pytest.approx(1 * MS)
    assert c.host_time(0, 2) == pytest.approx(2 * MS)
    assert c.host_time(0, 6) == pytest.approx(5 * MS)
    assert c.host_time(0, 16) == pytest.approx(10 * MS)  # past the last point: the last segment's slope (0.5 ms/row)
    c.observe(0, 1, 5 * MS)
    assert c.host_time(0, 1) == pytest.approx(0.75 * 1 * MS + 0.25 * 5 * MS)


def test_issued_copies_advance_the_link_clock():
    c = costs()
    c.copy_issued(2_000_000, now=10.0)
    assert c.link_free_at == pytest.approx(10.0 + 2 * MS)
    c.copy_issued(2_000_000, now=10.0 + 1 * MS)  # queued behind the first
    assert c.link_free_at == pytest.approx(10.0 + 4 * MS)
    c.copy_issued(2_000_000, now=20.0)  # the link was idle meanwhile
    assert c.link_free_at == pytest.approx(20.0 + 2 * MS)


@pytest.mark.parametrize(
    ("small_s", "big_s"),
    [(2e-3, 1e-3), (1e-3, 1e-3), (0.0, 0.0), (265e-6, 305e-6)],
    ids=["inverted", "equal", "zero", "small-copy-delayed"],
)
def test_link_timings_without_a_credible_slope_give_the_large_copys_average_speed(small_s, big_s, monkeypatch):
    """Timer noise can time the small probe copy as long as the large one (or both as nothing), and a busy host can
    delay the small copy so that the slope makes a 55 GB/s link look like 400 GB/s: the link's speed is then the
    large copy's average, never a division by zero."""
    import mira_hf.host_compute as hc

    model = MiraMoEModel.wrap(_tiny(), MiraConfig(device="cpu", gpu_budget=0.3, host_compute="on"))
    host = model.mira.host
    ticks = iter([0.0, small_s] * 6 + [0.0, big_s] * 6)  # (start, end) of each timed copy: six small, six large
    monkeypatch.setattr(hc.time, "perf_counter", lambda: next(ticks))
    host._measure_link(model.mira.first_ordinal)
    speed = host.costs.link_bytes_per_s
    assert speed > 0 and speed != float("inf")
    record = max(piece.numel() for _, piece in model.mira.store.pieces(model.mira.first_ordinal, 0))
    if big_s > 0:
        assert speed == pytest.approx(min(hc.LINK_PROBE_BYTES, record) / big_s)


def test_link_timings_with_a_credible_slope_give_the_slopes_speed_and_the_fixed_cost(monkeypatch):
    """Two probe copies at 55 GB/s with a fixed cost of 2% of the large one's time: the slope gives the speed and
    what is left of the small copy the fixed cost."""
    import mira_hf.host_compute as hc

    model = MiraMoEModel.wrap(_tiny(), MiraConfig(device="cpu", gpu_budget=0.3, host_compute="on"))
    host, layer = model.mira.host, model.mira.first_ordinal
    big = min(hc.LINK_PROBE_BYTES, max(piece.numel() for _, piece in model.mira.store.pieces(layer, 0)))
    small = max(min(hc.LINK_PROBE_SMALL_BYTES, big // 4), 1)
    per_byte = 1 / 55e9
    fixed = 0.02 * big * per_byte
    ticks = iter([0.0, fixed + small * per_byte] * 6 + [0.0, fixed + big * per_byte] * 6)
    monkeypatch.setattr(hc.time, "perf_counter", lambda: next(ticks))
    host._measure_link(layer)
    assert host.costs.link_bytes_per_s == pytest.approx(55e9)
    assert host.costs.copy_overhead_s == pytest.approx(fixed)


def test_the_link_speed_the_copies_met_replaces_the_probes_and_an_injected_one_stays():
    model = MiraMoEModel.wrap(_tiny(), MiraConfig(device="cpu", gpu_budget=0.3, host_compute="on"))
    host = model.mira.host
    assert model.mira.loader.time_link is False  # a CPU device has no link to time
    host.costs.link_bytes_per_s = 406e9  # a probe misread
    host.observe_link(None)  # too few copies timed yet
    assert host.costs.link_bytes_per_s == 406e9
    host.observe_link(54e9)
    assert host.costs.link_bytes_per_s == 54e9
    host.set_costs(costs(link_bytes_per_s=1e9, host_s={}))
    host.observe_link(54e9)
    assert host.costs.link_bytes_per_s == 1e9


def test_each_block_plans_with_the_link_speed_its_copies_met():
    """Where copies are timed (a CUDA device), every block hands the loader's latest link speed to the planner
    before it plans; the outputs keep their bound."""
    ref = _tiny()
    model = MiraMoEModel.wrap(copy.deepcopy(ref), MiraConfig(device="cpu", gpu_budget=0.3, host_compute="on"))
    m, asked = model.mira, []
    m.loader.time_link = True  # as on CUDA: the CPU's copies are not timed on a stream
    m.loader.link_speed = lambda: asked.append(1) or 33e9
    with torch.no_grad():
        expected, got = ref(IDS).logits, model(IDS).logits
    assert len(asked) == len(m.layers) and m.host.costs.link_bytes_per_s == 33e9
    assert (got - expected).abs().max() <= BOUND[torch.float32] * expected.abs().max()


# -- configuration ---------------------------------------------------------------------------------
def test_host_compute_is_off_by_default_and_validated():
    assert MiraConfig().host_compute == "off"
    assert MiraConfig(host_compute="On").host_compute == "on"
    with pytest.raises(ConfigError, match="host_compute='sometimes'.*off, on, auto"):
        MiraConfig(host_compute="sometimes")
    with pytest.raises(ConfigError, match="quantization='int8' encodes them"):
        MiraConfig(host_compute="on", quantization="int8")


def _tiny(name="mixtral", dtype=torch.float32):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config(name)).eval().to(dtype)


def _forced(model, predictor=None, gpu_budget=0.3, **kw):
    """`model` wrapped with host compute on and costs that send every miss of a small block to the host."""
    wrapped = MiraMoEModel.wrap(
        model, MiraConfig(device="cpu", gpu_budget=gpu_budget, predictor=predictor, host_compute="on", **kw)
    )
    layers = list(wrapped.mira.layers)
    wrapped.mira.host.set_costs(costs(link_bytes_per_s=1.0, host_s={layer: {1: 1e-6} for layer in layers}))
    return wrapped


def test_auto_is_off_where_it_cannot_pay_and_outputs_stay_bit_identical():
    ref = _tiny()
    encoded = MiraMoEModel.wrap(copy.deepcopy(ref), MiraConfig(device="cpu", host_compute="auto", quantization="int8"))
    assert not encoded.mira.host.active  # int8 records would need a host decode per use
    model = MiraMoEModel.wrap(copy.deepcopy(ref), MiraConfig(device="cpu", gpu_budget=0.3, host_compute="auto"))
    assert not model.mira.host.active  # on a CPU the device is the host: nothing to gain
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)
    assert model.mira.stats()["host_computed"] == 0


def test_host_compute_leaves_the_users_random_numbers_alone():
    """The host times measured at a layer's first block use random rows of their own: seeded sampling after a
    forward draws what it draws with the unwrapped model."""
    ref = _tiny()
    model = MiraMoEModel.wrap(copy.deepcopy(ref), MiraConfig(device="cpu", gpu_budget=0.3, host_compute="on"))
    drawn = []
    with torch.no_grad():
        for m in (ref, model):
            torch.manual_seed(0)
            m(IDS)
            drawn.append(torch.rand(4))
    assert model.mira.host.costs.host_s  # the host times were measured in that forward
    assert torch.equal(*drawn)


# -- the host path in a model ------------------------------------------------------------------------
def test_the_manager_splits_a_blocks_misses_as_the_costs_say():
    model = MiraMoEModel.wrap(_tiny(), MiraConfig(device="cpu", gpu_budget=1.0, predictor=None, host_compute="on"))
    m = model.mira
    record = m.store.record_bytes(0)
    m.host.set_costs(costs(link_bytes_per_s=record / (2 * MS), host_s={layer: {1: 3 * MS} for layer in m.layers}))
    plan = m.begin(0, [0, 1, 2], rows=[1, 1, 1])
    try:
        assert plan.host == [1]  # as in test_each_miss_goes_to_the_path_that_finishes_it_first
        assert sorted(plan.order) == [0, 2]
    finally:
        m.end(plan)
    s = m.stats()
    assert (s["misses"], s["host_computed"], s["loads"]) == (3, 1, 2)
    assert m.cache.lookup((0, 1)) is None  # served on the host: never admitted
    # The experts used most lately are planned first, so the link (whose copies stay cached) carries them:
    # expert 5 first (link), then 3 (host), then 4 (link).
    m.heat.use_rate[1][5] = 0.9
    plan = m.begin(1, [3, 4, 5], rows=[1, 1, 1])
    m.end(plan)
    assert (plan.host, m.cache.lookup((1, 3))) == ([3], None)
    assert m.cache.lookup((1, 5)) is not None and m.cache.lookup((1, 4)) is not None


def test_a_miss_served_on_the_host_takes_no_slot_and_copies_nothing():
    model = _forced(_tiny())
    with torch.no_grad():
        model(IDS)
    s = model.mira.stats()
    assert s["misses"] == s["host_computed"] > 0
    assert (s["loads"], s["bytes_h2d"], s["resident_bytes"]) == (0, 0, 0)


def test_prefill_sized_blocks_stay_on_the_device():
    model = _forced(_tiny())
    routing = []
    model.mira.recorder = lambda layer, hidden, top_k_index: routing.append(top_k_index.reshape(-1))
    ids = torch.randint(3, 128, (1, 8 * MAX_HOST_ROWS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)  # 128 tokens x top-2 over 8 experts: 32 rows per expert on average
    rows = torch.cat([torch.bincount(r, minlength=8) for r in routing])  # every expert of every layer misses once
    s = model.mira.stats()
    assert s["loads"] == int((rows > MAX_HOST_ROWS).sum()) > 0  # copied: more rows than the host takes
    assert s["host_computed"] == int(((rows > 0) & (rows <= MAX_HOST_ROWS)).sum())


# Relative bound on the logits (max |difference| / max |logit|) with every miss of a small block computed on
# the host, on a CPU: the same kernels run, so grouped_mm and eager are bit-identical, and batched_mm differs
# by its `bmm` against the host's `mm` (~3e-7 in fp32; bf16 rounds both to the same values here).
BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
FAMILIES = ["mixtral", "gpt_oss", "deepseek_v3", "llama4"]  # qwen3_moe and nemotron_h: the routing test below


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_stay_within_the_bound_when_misses_run_on_the_host(name, dtype):
    ref = _tiny(name, dtype)
    model = _forced(copy.deepcopy(ref))
    for impl in logits_within_bound(ref, model, name, dtype, (IDS, IDS[:, :1])):  # a small block, a decode-sized one
        assert model.mira.stats()["host_computed"] > 0, impl


@pytest.mark.parametrize("mode", ["on", "split"])
@pytest.mark.parametrize("name", FAMILIES)
def test_under_autocast_the_host_computes_in_the_weights_dtype_within_the_bf16_bound(name, mode):
    # An fp32 model under torch.autocast: the device's expert matmuls round to bf16 where the unwrapped model's do,
    # while the host worker computes in the weights' dtype (autocast is a thread's state). The logits keep the
    # unwrapped model's dtype and stay within the bf16 bound of its own logits under autocast.
    ref = _tiny(name)
    if mode == "on":
        model = _forced(copy.deepcopy(ref))
    else:
        model = MiraMoEModel.wrap(
            copy.deepcopy(ref), MiraConfig(device="cpu", gpu_budget=0.3, host_compute="split", host_share=0.25)
        )
    for impl in ("batched_mm", "eager"):  # grouped_mm runs outside autocast: fp32 on both paths
        ref.set_experts_implementation(impl)
        model.set_experts_implementation(impl)
        model.mira.reset_stats()
        for ids in (IDS, IDS[:, :1]):
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                expected, got = ref(ids).logits, model(ids).logits
            assert got.dtype == expected.dtype, impl
            diff = (got.float() - expected.float()).abs().max()
            assert diff <= BOUND[torch.bfloat16] * expected.float().abs().max(), (impl, ids.shape, float(diff))
        if mode == "on":
            assert model.mira.stats()["host_computed"] > 0, impl


@pytest.mark.filterwarnings("ignore:mira-hf. model_type")
@pytest.mark.parametrize("name", ALL_TINY + MULTIMODAL + AUTO_FAMILIES)
def test_every_family_computes_misses_on_the_host_within_the_bound(name):
    # Every family served, with an adapter or without: the misses of one-token forwards (one row per expert)
    # computed on the host, the logits within the bound.
    config = config_or_skip(name)
    torch.manual_seed(0)
    ref = build(config).eval()
    model = _forced(copy.deepcopy(ref))
    for token in IDS[0, :4]:
        ids = token.view(1, 1)
        with torch.no_grad():
            expected, got = ref(ids).logits.float(), model(ids).logits.float()
        assert (got - expected).abs().max() <= BOUND[torch.float32] * expected.abs().max(), int(token)
    assert model.mira.stats()["host_computed"] > 0


# A whole bf16 model rounds at every layer, so its logits carry bf16's own noise: where the unwrapped bf16 model is
# further than BOUND from the same weights computed in fp32, the wrapped model's logits may be as far from those as
# BF16_NOISE times the unwrapped model's (two partial sums, or another kernel's order, round unlike one; a wrong
# or missing row lands far outside either).
BF16_NOISE = 1.5


def logits_within_bound(ref, model, name: str, dtype, inputs):
    """For each experts implementation transformers runs `name` with: set it on both models, assert that `model`'s
    logits on each of `inputs` are within BOUND[dtype] of `ref`'s (relative to the largest; in bf16, or within
    BF16_NOISE of `ref`'s own distance from fp32 arithmetic), and yield it (the caller checks what it needs of that
    implementation's run; the stats were reset before it)."""
    exact = copy.deepcopy(ref).float() if dtype == torch.bfloat16 else None  # the same weights, computed in fp32
    for impl in ("grouped_mm", "batched_mm", "eager"):
        if name == "llama4" and impl == "grouped_mm":
            continue  # Llama 4's experts scale their inputs: transformers runs them with their own loop
        for m in (ref, model, exact):
            if m is not None:
                m.set_experts_implementation(impl)
        model.mira.reset_stats()
        for ids in inputs:
            with torch.no_grad():
                expected, got = ref(ids).logits.float(), model(ids).logits.float()
                if (got - expected).abs().max() <= BOUND[dtype] * expected.abs().max():
                    continue
                assert exact is not None, (impl, ids.shape, float((got - expected).abs().max() / expected.abs().max()))
                fp32 = exact(ids).logits
            noise = (expected - fp32).abs().max()  # the unwrapped bf16 model's own rounding
            assert (got - fp32).abs().max() <= BF16_NOISE * noise, (impl, ids.shape, float((got - fp32).abs().max() / noise))
        yield impl


def all_on_host(layers) -> HostCosts:
    """Costs under which every miss of a small block is computed on the host."""
    return costs(link_bytes_per_s=1.0, host_s={layer: {1: 1e-6} for layer in layers})


# Each family under each implementation; with a post-expert norm, the implementations that apply one (not eager).
HOST_ROUTING_CASES = [(name, False, impl) for name in COMBINE_FAMILIES for impl in IMPLS]
HOST_ROUTING_CASES += [
    pytest.param("qwen3_moe", True, impl, marks=needs_post_expert_norm) for impl in ("grouped_mm", "batched_mm")
]


@pytest.mark.filterwarnings("ignore:mira-hf. model_type")
@with_and_without_sentinel
@pytest.mark.parametrize(("name", "post_norm", "impl"), HOST_ROUTING_CASES)
def test_host_outputs_go_to_the_rows_the_device_would_fill(name, post_norm, impl, sentinel):
    """`tests/test_combine.py`'s hard routings (skewed, repeated picks, four per token, the expert-parallel
    sentinel) with every miss on the host: each experts implementation within the bound of transformers'
    own experts module; with a post-expert norm (its weights stay on the device: it runs there)."""
    for dtype in (torch.float32, torch.bfloat16):
        ref, proxy = experts_pair(name, dtype, post_norm, host_costs=all_on_host)
        if sentinel:
            require_sentinel_reference(ref, impl)
        H, E = proxy.base.config.hidden_size, proxy.num_experts
        ref.config._experts_implementation = proxy.base.config._experts_implementation = impl
        proxy.manager.reset_stats()
        for case, (index, w) in routings(E, sentinel=sentinel).items():
            hidden = (torch.randn(index.shape[0], H, generator=torch.Generator().manual_seed(len(case))) * 4).to(dtype)
            with torch.no_grad():
                expected, got = ref(hidden, index, w).float(), proxy(hidden, index, w).float()
            assert (got - expected).abs().max() <= BOUND[dtype] * expected.abs().max(), (case, impl, dtype)
        assert proxy.manager.stats()["host_computed"] > 0


def test_bundled_model_greedy_tokens_are_unchanged_with_misses_on_the_host():
    path = bundled_model_path()
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = _forced(copy.deepcopy(ref), predictor="auto", gpu_budget=0.25)
    prompt = torch.tensor([[3, 17, 250, 1024, 77, 5]])
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kw), ref.generate(prompt, **kw))
    assert model.mira.stats()["host_computed"] > 0
    ids = prompt[:, :1]
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        ref.to(dtype)
        model.mira.host.set_costs(costs(link_bytes_per_s=1.0, host_s={layer: {1: 1e-6} for layer in model.mira.layers}))
        with torch.no_grad():
            expected, got = ref(ids).logits.float(), model(ids).logits.float()
        assert (got - expected).abs().max() <= BOUND[dtype] * expected.abs().max()


def test_dropping_a_model_frees_its_store_and_host_worker():
    import gc
    import weakref

    model = _forced(_tiny())
    with torch.no_grad():
        model(IDS)  # the worker has run
    store, host = weakref.ref(model.mira.store), weakref.ref(model.mira.host)
    workers = list(model.mira.host._pool._threads)
    assert workers
    del model
    gc.collect()
    assert store() is None and host() is None
    for t in workers:  # the idle worker exits once its pool is collected
        t.join(timeout=5)
        assert not t.is_alive()


def test_unload_ends_the_host_worker():
    """`unload()` gives back an ordinary model: the host worker thread ends with it, even while the manager is kept
    (its `stats()` are read after unloading)."""
    model = _forced(_tiny())
    with torch.no_grad():
        model(IDS)  # the worker has run
    manager = model.mira
    workers = list(manager.host._pool._threads)
    assert workers
    model.unload()
    for t in workers:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in workers)
    assert manager.stats()["host_computed"] > 0 and manager.stats()["host_costs"] is None  # nothing planned any more


def test_the_host_worker_leaves_the_thread_count_of_threads_started_later_alone():
    """The worker runs with threads of its own (all cores but one); a thread the user starts afterwards (a server's
    request thread) still gets the process's count, so it computes as fast and with the same bits as before."""
    model = _forced(_tiny())
    with torch_threads(model.mira.host.threads + 1):  # a count the worker's differs from
        before = new_thread_cpu_threads()
        with torch.no_grad():
            model(IDS)  # the worker has started and set its own count
        assert model.mira.stats()["host_computed"] > 0
        assert model.mira.host._pool.submit(torch.get_num_threads).result() == model.mira.host.threads
        assert new_thread_cpu_threads() == before == torch.get_num_threads()


def test_a_forked_process_gets_its_own_host_worker():
    # A process forked after the model computed on the host has the parent's pool but not its thread, so a job
    # queued there would never run. Here the pid the pool was made in is set to another process's.
    model = _forced(_tiny())
    host = model.mira.host
    with torch.no_grad():
        expected = model(IDS).logits
    parents_pool = host._pool
    host._pid = -1  # as seen from a forked child
    with torch.no_grad():
        logits = model(IDS).logits
    assert host._pool is not parents_pool and host._pid == __import__("os").getpid()
    assert torch.equal(logits, expected) and model.mira.stats()["host_computed"] > 0
    parents_pool.shutdown(wait=True)
