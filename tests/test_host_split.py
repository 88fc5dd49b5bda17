"""Experts split by neuron (`MiraConfig(host_compute="split")`): the GPU caches and receives each expert's device
part, the host computes the rest at every use, and the two add (in 16 bits, in fp32 before one rounding). Not
bit-exact (the host's rounding, the order of the fp32 sum), so outputs are checked within the host-compute bound; the
weights themselves (state dict, unload, casts) stay exact."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ALL_TINY, MULTIMODAL
from test_host_compute import BOUND, MS, costs, logits_within_bound
from tiny_models import AUTO_FAMILIES, build, config_or_skip
from transformers import AutoModelForCausalLM

import mira_hf.store_build as store_build
from mira_hf import ConfigError, MiraConfig, MiraMoEModel, bundled_model_path
from mira_hf.host_compute import MAX_HOST_ROWS
from mira_hf.layout import IdentityCodec
from mira_hf.neuron_split import NeuronSplit, host_neurons, pairing_of
from mira_hf.report import stats_table

IDS = torch.tensor([[5, 9, 17, 33, 42, 7, 64, 100, 3]])
FAMILIES = ["mixtral", "gpt_oss", "qwen3_moe", "deepseek_v3", "llama4", "nemotron_h"]


def _tiny(name: str, dtype=torch.float32):
    config = config_or_skip(name)
    torch.manual_seed(0)
    model = build(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("_bias") and "experts" in pname:
                p.normal_(0.0, 0.5)  # transformers initialises expert biases to zero, which would hide them
    return model.to(dtype)


def _split(model, share=0.25, gpu_budget=0.3, **kw):
    return MiraMoEModel.wrap(model, MiraConfig(device="cpu", gpu_budget=gpu_budget, host_compute="split", host_share=share, **kw))


def _experts_of(model):
    return next(m for p, m in model.named_modules() if p.endswith("experts") and isinstance(getattr(m, "num_experts", None), int))


# -- how an expert splits ----------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "pairing"), [("mixtral", "halves"), ("gpt_oss", "interleaved"), ("nemotron_h", "single")])
def test_the_gate_functions_pairing_of_columns_and_neurons_is_read_from_the_function(name, pairing):
    experts = _experts_of(_tiny(name))
    has_gate = getattr(experts, "has_gate", True)

    def act(h):
        if not has_gate:
            return experts.act_fn(h)
        gate = getattr(experts, "_apply_gate", None)
        if gate is not None:
            return gate(h)
        g, u = h.chunk(2, dim=-1)
        return experts.act_fn(g) * u

    assert pairing_of(act, has_gate) == pairing


def test_a_gate_function_that_mixes_neurons_is_refused():
    with pytest.raises(ConfigError, match="does not recognise"):
        pairing_of(lambda h: h[:, : h.shape[1] // 2] * h[:, h.shape[1] // 2 :].sum(dim=1, keepdim=True), True)


@pytest.mark.parametrize("pairing", ["halves", "interleaved", "single"])
@pytest.mark.parametrize("transposed", [False, True])
def test_the_two_parts_join_back_into_the_whole_tensors_and_their_outputs_add_up(pairing, transposed):
    H, I, E = 6, 8, 3  # noqa: E741
    split = NeuronSplit("up_proj" if pairing == "single" else "gate_up_proj", pairing, transposed, I, host=3)
    width = I if pairing == "single" else 2 * I
    g = torch.Generator().manual_seed(1)
    up = torch.randn(E, *((H, width) if transposed else (width, H)), generator=g, dtype=torch.float64)
    down = torch.randn(E, *((I, H) if transposed else (H, I)), generator=g, dtype=torch.float64)
    whole = {split.up: up, split.up + "_bias": torch.randn(E, width, generator=g, dtype=torch.float64), "down_proj": down}
    whole["down_proj_bias"] = torch.randn(E, H, generator=g, dtype=torch.float64)
    device, host = split.split(whole)
    assert set(host) == {split.up, split.up + "_bias", "down_proj"}  # the down bias is added once, by the device part
    joined = split.combine(device, host)
    assert all(torch.equal(joined[n], whole[n]) for n in whole)
    assert split.specs({n: (tuple(t.shape[1:]), t.dtype) for n, t in whole.items()})[1]["down_proj"][0] == (
        (3, H) if transposed else (H, 3)
    )

    def act(h):  # the gate function of each pairing: silu(gate) * up
        if pairing == "single":
            return torch.nn.functional.silu(h)
        if pairing == "halves":
            a, b = h.chunk(2, dim=-1)
        else:
            a, b = h[..., ::2], h[..., 1::2]
        return torch.nn.functional.silu(a) * b

    def expert(w, x, bias=True):
        mm = (lambda x, t: x @ t) if transposed else (lambda x, t: x @ t.T)
        h = act(mm(x, w[split.up]) + w[split.up + "_bias"])
        return mm(h, w["down_proj"]) + (w["down_proj_bias"] if bias else 0)

    x = torch.randn(4, H, generator=g, dtype=torch.float64)
    for e in range(E):
        one = lambda part, e=e: {n: t[e] for n, t in part.items()}  # noqa: E731
        total = expert(one(device), x) + expert(one(host), x, bias=False)
        assert torch.allclose(total, expert(one(whole), x), rtol=1e-12, atol=1e-12)


def test_the_host_share_is_rounded_to_aligned_neurons_and_leaves_both_parts_some():
    assert host_neurons(14336, 0.25) == 3584
    assert host_neurons(14336, 0.3) % 16 == 0
    assert host_neurons(14336, 0.0001) == 16 and host_neurons(14336, 0.9999) == 14336 - 16
    assert host_neurons(64, 0.01) == 16 and host_neurons(64, 0.99) == 48
    assert host_neurons(32, 0.25) == 8 and host_neurons(32, 0.01) == 8 and host_neurons(32, 0.99) == 24
    assert host_neurons(12, 0.5) == 8 and host_neurons(6, 0.3) == 2
    with pytest.raises(ConfigError, match="these experts have 8, too few"):
        host_neurons(8, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("share", [0.001, 0.999])
def test_a_share_at_either_edge_leaves_the_device_part_aligned_and_computes(share, dtype):
    """A share that rounds to a few neurons on one side still leaves the device part's rows aligned, so torch's
    grouped matmul takes them, and the logits stay within the bound."""
    ref = _tiny("mixtral", dtype)
    model = _split(copy.deepcopy(ref), share=share)
    assert len(list(logits_within_bound(ref, model, "mixtral", dtype, (IDS, IDS[:, :1])))) == 3  # each implementation


# -- in a model ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_stay_within_the_bound_with_each_expert_split_between_host_and_device(name, dtype):
    ref = _tiny(name, dtype)
    model = _split(copy.deepcopy(ref))
    inputs = (IDS, IDS[:, :1], IDS.expand(2, -1))  # a small block, a decode step, two sequences
    assert len(list(logits_within_bound(ref, model, name, dtype, inputs))) == (2 if name == "llama4" else 3)


@pytest.mark.filterwarnings("ignore:mira-hf. model_type")
@pytest.mark.parametrize("name", ALL_TINY + MULTIMODAL + AUTO_FAMILIES)
def test_every_family_splits_its_experts_within_the_bound(name):
    # Every family served, with an adapter or without: its experts split, the host computing their parts on a
    # small block and on a decode step.
    ref = _tiny(name)
    model = _split(copy.deepcopy(ref))
    jobs = []
    model.mira.host.start = lambda layer, experts, inputs, f=model.mira.host.start: (
        jobs.append(layer) or f(layer, experts, inputs)
    )
    for ids in (IDS, IDS[:, :1]):
        with torch.no_grad():
            expected, got = ref(ids).logits.float(), model(ids).logits.float()
        assert (got - expected).abs().max() <= BOUND[torch.float32] * expected.abs().max(), ids.shape
    assert set(jobs) == set(model.mira.layers)  # every MoE layer's host parts ran on the host


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3", "llama4", "gpt_oss"])
def test_in_16_bits_the_two_parts_are_summed_before_one_rounding_as_the_whole_expert_rounds_once(name):
    # The first MoE layer's experts get the unwrapped model's rows (the layers before are exact), so their outputs
    # differ only by how the two parts are summed. Rounded each to bf16 and then added, about a third of the
    # elements differ from the whole expert's one rounding; summed in fp32 and rounded once, only where the fp32
    # sum's order changes a rounding. gpt-oss adds a down bias to the rounded product (a second rounding): the split
    # adds it to the rounded sum, the same two roundings.
    for impl, ids, differing in _first_layer_differences(name, "cpu"):
        assert differing <= 0.01, (impl, ids.shape)


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_resident_experts_in_one_grouped_matmul_sum_the_two_parts_before_one_rounding(name, monkeypatch):
    # The grouped path a GPU takes for the experts resident at a block's start (`_on_slots`), turned on for the CPU:
    # its windows keep the down biases of the device parts for after the one rounding, as a single expert does.
    from mira_hf.proxy import MiraExperts

    windows, original = [], MiraExperts._on_window
    monkeypatch.setattr(MiraExperts, "GROUPED_SLOT_DEVICES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(MiraExperts, "_on_window", lambda self, w, s, *a: windows.append(s) or original(self, w, s, *a))
    for impl, ids, differing in _first_layer_differences(name, "cpu", gpu_budget=0.6):
        assert differing <= 0.01, (impl, ids.shape, differing)
    assert windows  # the grouped path ran


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_on_a_gpu_the_two_parts_are_summed_before_one_rounding(name):
    # As above, with the device parts on the GPU (at the second pass resident experts go in one grouped or batched
    # call, which gather their down biases by row) and the host parts on the CPU.
    for impl, ids, differing in _first_layer_differences(name, "cuda"):
        assert differing <= 0.01, (impl, ids.shape, differing)


def _first_layer_differences(name: str, device: str, gpu_budget: float | None = None):
    """(implementation, input ids, share of the first MoE layer's output elements that differ from the unwrapped
    model's) for a bf16 model with experts split, each input twice (the second time from the experts resident)."""
    ref = _tiny(name, torch.bfloat16).to(device)
    gpu_budget = gpu_budget or (0.3 if device == "cpu" else 0.6)
    cfg = MiraConfig(device=device, gpu_budget=gpu_budget, host_compute="split", host_share=0.25)
    model = MiraMoEModel.wrap(copy.deepcopy(ref), cfg)
    outs = {}
    for key, m in (("ref", ref), ("split", model)):
        experts = next(x for p, x in m.named_modules() if p.endswith("experts"))
        experts.register_forward_hook(lambda mod, args, out, key=key: outs.__setitem__(key, out))
    for impl in ("batched_mm", "eager") if name == "llama4" else ("grouped_mm", "batched_mm", "eager"):
        for m in (ref, model):
            m.set_experts_implementation(impl)
        for ids in (IDS, IDS[:, :1], IDS, IDS[:, :1]):
            with torch.no_grad():
                ref(ids.to(device)), model(ids.to(device))
            assert outs["split"].dtype == outs["ref"].dtype == torch.bfloat16
            yield impl, ids, outs["split"].ne(outs["ref"]).float().mean().item()


def test_prefill_sized_blocks_compute_their_host_parts_on_the_device():
    ref = _tiny("mixtral")
    model = _split(copy.deepcopy(ref))
    seen = []
    model.mira.host.start = lambda layer, experts, inputs, f=model.mira.host.start: (
        seen.append(len(experts)) or f(layer, experts, inputs)
    )
    ids = torch.randint(3, 128, (1, 8 * MAX_HOST_ROWS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = ref(ids).logits, model(ids).logits  # ~32 rows per expert: more than the host takes
    assert (got - expected).abs().max() <= BOUND[torch.float32] * expected.abs().max()
    assert sum(seen) < 8 * len(model.mira.layers)  # the crowded experts' host parts ran on the device
    assert model.mira.stats()["parts_copied"] == 8 * len(model.mira.layers) - sum(seen)


def test_the_host_parts_a_slower_host_would_finish_last_cross_the_link_as_hand_computed():
    # Host: 2 ms per part on 1 row, 8 ms on 4 rows; link: 1 ms per part (1 MB at 1 GB/s), busy 5 ms more.
    c = costs(host_s={0: {1: 2 * MS, 4: 8 * MS}})
    c.link_free_at = 100.0 + 5 * MS
    # A decode step's two experts: the host ends at 4 ms, before the link's 5: both parts stay.
    assert c.balance(0, [3, 7], [1, 1], nbytes=1_000_000, now=100.0) == []
    # A beam step's four experts, 26 ms on the host: moving the three four-row parts brings the block's end to
    # 18, 10 and 8 ms (the link's 6, 7, 8); moving the last would end it at 9 ms: that one stays.
    assert c.balance(0, [3, 7, 1, 5], [4, 4, 1, 4], nbytes=1_000_000, now=100.0) == [3, 7, 5]
    # The link idle: a decode step's first part crosses (ends at 2 ms instead of 4); the second would end the
    # block no sooner (2 ms either way): ties stay on the host.
    c.link_free_at = 0.0
    assert c.balance(0, [3, 7], [1, 1], nbytes=1_000_000, now=100.0) == [3]
    # The link idle, but the block about to queue three misses' copies (1 ms each): it ends at 3 ms, and moving
    # the first part would end the block at 4 ms, as late as the host: both parts stay.
    assert c.balance(0, [3, 7], [1, 1], nbytes=1_000_000, now=100.0, ahead=[1_000_000] * 3) == []


def test_a_blocks_host_parts_start_before_its_copies_are_queued():
    """The host's share of a block is on the block's path from its start: the job starts before the misses'
    copies are queued, and the placement counts those copies as the link's."""
    ref = _tiny("mixtral")
    model = _split(copy.deepcopy(ref), gpu_budget=0.1)
    m, events = model.mira, []
    m.host.start = lambda layer, experts, inputs, f=m.host.start: events.append(("host", layer)) or f(layer, experts, inputs)
    m.loader.copy_split = lambda *a, f=m.loader.copy_split, **kw: events.append(("copy", m._last_layer)) or f(*a, **kw)
    m.loader.copy = lambda *a, f=m.loader.copy, **kw: events.append(("copy", m._last_layer)) or f(*a, **kw)
    placed = []
    m.host.place_parts = lambda layer, experts, rows, misses, f=m.host.place_parts: (
        placed.append((layer, len(misses))) or f(layer, experts, rows, misses)
    )
    with torch.no_grad():
        expected, got = ref(IDS[:, :1]).logits, model(IDS[:, :1]).logits
    assert (got - expected).abs().max() <= BOUND[torch.float32] * expected.abs().max()
    s = m.stats()
    assert s["misses"] > 0 and sum(n for _, n in placed) == s["misses"]  # one token, nothing resident but prefetched
    per_layer = {layer: [kind for kind, at in events if at == layer] for layer in m.layers}
    assert all(kinds and kinds[0] == "host" for kinds in per_layer.values()), per_layer  # the job first, then the copies
    assert any("copy" in kinds for kinds in per_layer.values()), per_layer


@pytest.mark.parametrize(("link_bytes_per_s", "host_s"), [(1.0, 1e-6), (1e9, 1.0)], ids=["slow-link", "slow-host"])
def test_the_manager_places_each_host_part_as_the_costs_say(link_bytes_per_s, host_s):
    """A host faster than any copy keeps every part; one slower than the link gives every part to the device.
    Either way the outputs stay within the bound."""
    ref = _tiny("mixtral")
    model = _split(copy.deepcopy(ref))
    c = costs(link_bytes_per_s=link_bytes_per_s, host_s={layer: {1: host_s} for layer in model.mira.layers})
    model.mira.host.set_costs(c)
    started = []
    model.mira.host.start = lambda layer, experts, inputs, f=model.mira.host.start: (
        started.extend(experts) or f(layer, experts, inputs)
    )
    with torch.no_grad():
        expected, got = ref(IDS[:, :1]).logits, model(IDS[:, :1]).logits
    assert (got - expected).abs().max() <= BOUND[torch.float32] * expected.abs().max()
    s = model.mira.stats()
    uses = s["hits"] + s["misses"]
    assert uses == 2 * len(model.mira.layers)  # one token, top-2
    assert (s["parts_copied"], len(started)) == ((uses, 0) if host_s == 1.0 else (0, uses))


def test_stats_give_what_the_planner_measured_per_host_part_and_the_report_prints_it():
    """`stats()["host_costs"]`: a host part's time on the host at one row and its copy's time over the link, as the
    planner holds them (here given: 3 ms on the host, a part copied in 2 ms at the link's speed; then refined by the
    host parts the model computes)."""
    model = _split(_tiny("mixtral"))
    first = model.mira.first_ordinal
    part = model.mira.host.parts.expert_bytes(first)
    model.mira.host.set_costs(
        costs(link_bytes_per_s=part / 2e-3, host_s={layer: {1: 3e-3, 4: 5e-3} for layer in model.mira.layers})
    )
    got = model.mira.stats()["host_costs"]
    assert (got["unit"], got["layer"], got["unit_bytes"], got["link_bytes_per_s"]) == ("host part", first, part, part / 2e-3)
    assert got["host_s_one_row"] == pytest.approx(3e-3) and got["copy_s"] == pytest.approx(2e-3)
    assert got["host_s_four_rows"] == pytest.approx(5e-3)
    line = next(row for row in stats_table(model.mira.stats()).splitlines() if row.startswith("host compute"))
    assert "a host part takes 3 ms on the host at one row (5 at four), 2 ms to copy" in line and "slower path" in line
    with torch.no_grad():
        model(IDS[:, :1])  # each host part computed refines its row count's time
    refined = model.mira.host.costs.host_time(first, 1)
    assert refined != 3e-3 and model.mira.stats()["host_costs"]["host_s_one_row"] == refined
    unmeasured = _split(_tiny("mixtral"), gpu_budget=0.3).mira.stats()["host_costs"]  # not run yet
    assert unmeasured["host_s_one_row"] is None and unmeasured["host_s_four_rows"] is None
    sends = MiraMoEModel.wrap(_tiny("mixtral"), MiraConfig(device="cpu", gpu_budget=0.3, host_compute="on"))
    sends.mira.host.set_costs(costs(link_bytes_per_s=1e9, host_s={first: {1: 1e-3}}))
    got = sends.mira.stats()["host_costs"]  # whole misses sent to the host: the unit is an expert's record
    assert (got["unit"], got["unit_bytes"], got["copy_s"]) == (
        "expert",
        sends.mira.store.record_bytes(first),
        got["unit_bytes"] / 1e9,
    )
    assert got["host_s_four_rows"] == pytest.approx(4e-3)  # one row measured: extended in proportion to the rows
    assert "an expert takes 1 ms on the host at one row (4 at four)" in stats_table(sends.mira.stats())
    whole = MiraMoEModel.wrap(_tiny("mixtral"), MiraConfig(device="cpu", gpu_budget=0.3))
    assert whole.mira.stats()["host_costs"] is None  # host compute off
    assert not any(row.startswith("host compute") for row in stats_table(whole.mira.stats()).splitlines())


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_a_block_with_parts_on_both_paths_stays_within_the_bound(name):
    """Host times that grow steeply with rows, a link that copies a part in about the time of one row: in a batch
    the crowded experts' host parts cross to the device and the others stay on the host, in the same blocks."""
    ref = _tiny(name)
    model = _split(copy.deepcopy(ref))
    part = model.mira.host.parts.expert_bytes(model.mira.first_ordinal)
    host_s = {1: 1.0, 2: 2.5, 4: 6.0, 8: 14.0, 16: 30.0}
    model.mira.host.set_costs(costs(link_bytes_per_s=part / 2.0, host_s={layer: dict(host_s) for layer in model.mira.layers}))
    ids = torch.randint(3, 128, (6, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = ref(ids).logits, model(ids).logits
    assert (got - expected).abs().max() <= BOUND[torch.float32] * expected.abs().max()
    s = model.mira.stats()
    assert 0 < s["parts_copied"] < s["hits"] + s["misses"]


def test_the_store_holds_device_parts_so_the_same_budget_holds_more_experts():
    ref = _tiny("mixtral")
    whole = MiraMoEModel.wrap(copy.deepcopy(ref), MiraConfig(device="cpu", gpu_budget=0.3))
    split = _split(copy.deepcopy(ref), share=0.5)
    specs = whole.mira.store.expert_specs(0)
    record = IdentityCodec().plan(specs).nbytes
    assert split.mira.store.record_bytes(0) == record // 2  # half the neurons: half of every tensor but the biases
    assert sum(split.mira.budget.n_slots.values()) >= 2 * sum(whole.mira.budget.n_slots.values()) - 1
    assert split.mira.budget.budget_bytes == whole.mira.budget.budget_bytes  # a fraction of the whole experts' bytes
    layers, E = len(whole.mira.layers), whole.mira.store.num_experts(0)
    assert split.mira.stats()["host_part_bytes"] == layers * E * (record - record // 2)  # beside the store, in host memory
    assert whole.mira.stats()["host_part_bytes"] == 0
    # In 16 bits the host part's down projection is stored in fp32 (its product stays fp32 until the parts are summed):
    # a Mixtral expert is 2/3 gate and up, 1/3 down, so its host part takes a third more than its bf16 bytes.
    half = _split(copy.deepcopy(ref).to(torch.bfloat16), share=0.5)
    assert half.mira.stats()["host_part_bytes"] == layers * E * (record - record // 2) // 2 * 4 // 3


def test_the_host_memory_check_counts_the_host_parts_as_stored(monkeypatch):
    seen = []
    check = store_build.check_host_memory
    monkeypatch.setattr(
        store_build, "check_host_memory", lambda cfg, sizes, *a: seen.append(list(sizes)) or check(cfg, sizes, *a)
    )
    model = _split(_tiny("mixtral", torch.bfloat16))
    layers = len(model.mira.layers)
    assert sum(seen[0][layers:]) == model.mira.stats()["host_part_bytes"]  # the down projections widened included


def test_the_weights_stay_exact_state_dict_load_cast_and_unload():
    ref = _tiny("gpt_oss")
    original = {k: v.clone() for k, v in ref.state_dict().items()}
    model = _split(copy.deepcopy(ref))
    state = model.state_dict()
    assert state.keys() == original.keys()
    assert all(torch.equal(state[k], original[k]) for k in original)
    experts = [k for k in original if ".experts." in k and original[k].dim() >= 2]
    shapes = dict(model.named_parameters())
    assert all(shapes[k].shape == original[k].shape for k in experts)
    # load_state_dict writes both parts: the model computes with the loaded weights
    other = _tiny("gpt_oss")
    with torch.no_grad():
        for k in experts:
            other.get_parameter(k).mul_(-1.0)
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        expected, got = other(IDS).logits, model(IDS).logits
    assert (got - expected).abs().max() <= BOUND[torch.float32] * expected.abs().max()
    # a cast casts both parts as casting the tensors would
    parts = model.mira.host.parts
    assert all(t.dtype == torch.float32 for layer in parts.tensors.values() for t in layer.values())
    model.to(torch.bfloat16)
    other.to(torch.bfloat16)
    state = model.state_dict()
    assert all(torch.equal(state[k], other.state_dict()[k]) for k in experts)
    for tensors in parts.tensors.values():  # the host's down projection stays fp32, holding the bf16 values
        down = tensors["down_proj"]
        assert down.dtype == torch.float32 and tensors["gate_up_proj"].dtype == torch.bfloat16
        assert torch.equal(down, down.bfloat16().float())
    with torch.no_grad():
        expected, got = other(IDS).logits.float(), model(IDS).logits.float()
    assert (got - expected).abs().max() <= BOUND[torch.bfloat16] * expected.abs().max()
    back = model.unload()
    assert all(torch.equal(back.get_parameter(k), other.get_parameter(k)) for k in experts)


def test_a_cast_through_fp64_holds_the_values_the_direct_cast_holds():
    # The host's 16-bit down projection is stored in fp32: a cast into 16 bits rounds it, whichever dtype it comes from.
    ref = _tiny("mixtral")
    direct = _split(copy.deepcopy(ref)).to(torch.bfloat16)
    through = _split(copy.deepcopy(ref)).double().to(torch.bfloat16)
    for layer, tensors in through.mira.host.parts.tensors.items():
        assert torch.equal(tensors["down_proj"], direct.mira.host.parts.tensors[layer]["down_proj"])
    with torch.no_grad():
        assert torch.equal(through(IDS).logits, direct(IDS).logits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantization", [None, "lossless"], ids=["uncompressed", "lossless"])
@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_on_a_gpu_both_parts_hold_the_weights_and_the_logits_stay_within_the_bound(name, quantization):
    """On a GPU the lossless device parts are encoded there (planned, then encoded, in two passes over the
    experts): every expert's host part is written all the same, so the state dict is the original's, bit for bit."""
    ref = _tiny(name, torch.bfloat16).cuda()
    original = {k: v.clone() for k, v in ref.state_dict().items()}
    cfg = MiraConfig(device="cuda", gpu_budget=0.3, host_compute="split", quantization=quantization)
    model = MiraMoEModel.wrap(copy.deepcopy(ref), cfg)
    assert model.mira.store.quantized == (quantization is not None)
    state = model.state_dict()
    assert all(torch.equal(state[k].cpu(), original[k].cpu()) for k in original)
    ids = IDS.cuda()
    inputs = (ids, ids[:, :1], ids.expand(2, -1))
    assert len(list(logits_within_bound(ref, model, name, torch.bfloat16, inputs))) == 3


def test_bundled_model_greedy_tokens_are_unchanged_with_split_experts():
    path = bundled_model_path()
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = _split(copy.deepcopy(ref), gpu_budget=0.25, predictor="auto")
    prompt = torch.tensor([[3, 17, 250, 1024, 77, 5]])
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kw), ref.generate(prompt, **kw))
    assert model.mira.stats()["misses"] > 0


def test_a_budget_that_holds_every_whole_expert_warns_that_the_split_only_costs_time():
    with pytest.warns(UserWarning, match="holds every whole expert"):
        _split(_tiny("mixtral"), gpu_budget=1.0)


def test_split_is_validated_before_anything_changes():
    for share in (0, 1, 1.5, -0.1, "half", True):
        with pytest.raises(ConfigError, match="host_share="):
            MiraConfig(host_compute="split", host_share=share)
    with pytest.raises(ConfigError, match="store_path is set with host_compute='split'"):
        MiraConfig(host_compute="split", quantization="lossless", store_path="/tmp/records")
    with pytest.raises(ConfigError, match="device part only"):
        _split(_tiny("mixtral"), quantization="lossless").mira.save_store("/tmp/never-written")
    ref = _tiny("qwen3_moe")
    experts = _experts_of(ref)
    experts.has_post_expert_norm = True
    experts.post_expert_norm = torch.nn.RMSNorm(ref.config.hidden_size)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    with pytest.raises(ConfigError, match="not a sum over neurons"):
        _split(ref)
    after = ref.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert not hasattr(ref, "mira")


@pytest.mark.parametrize("quantization", [None, "lossless"])
def test_a_checkpoint_loads_split_from_disk_and_saves_back_whole(tiny_checkpoint, tmp_path, quantization):
    """The user's path: from_pretrained reads each expert from the checkpoint once, stores its device part (here
    uncompressed or lossless) and keeps its host part; save_pretrained writes the whole experts back."""
    path = tiny_checkpoint("qwen3_moe")
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    cfg = MiraConfig(device="cpu", gpu_budget=0.3, host_compute="split", quantization=quantization)
    model = MiraMoEModel.from_pretrained(path, cfg, progress=False).eval()
    assert model.mira.quantization == quantization
    with torch.no_grad():
        expected, got = ref(IDS).logits, model(IDS).logits
    assert (got - expected).abs().max() <= BOUND[torch.float32] * expected.abs().max()
    model.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ref.state_dict().items())
