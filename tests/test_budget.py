"""Budget planning: how a byte budget becomes device buffers and slots, on numbers worked out by hand."""

import copy
import os
import warnings
from types import SimpleNamespace

import pytest
import torch

from mira_hf import BudgetError, MiraConfig, MiraMoEModel
from mira_hf.budget import LayerInfo, device_buffers, plan_budget, plan_records
from mira_hf.config import QuantConfig

# Layer 0: 8 experts of 1000 bytes, top-2; layer 1: 4 experts of 500 bytes, top-1. Expert bytes: 8000 + 2000.
LAYERS = [LayerInfo(0, "layers.0.mlp.experts", 8, 2), LayerInfo(1, "layers.1.mlp.experts", 4, 1)]
RECORDS = {0: 1000, 1: 500}


def test_slots_are_split_by_each_pools_share_of_expert_bytes_after_the_buffers():
    plan = plan_budget(LAYERS, RECORDS, 6000, buffers={"staging": 1000})
    # 5000 bytes for slots: pool 1000 gets 5000 · 8000/10000 = 4000 → 4 slots, pool 500 gets 1000 → 2 slots
    assert plan.pool_of_layer == {0: 1000, 1: 500} and plan.slot_bytes == {1000: 1000, 500: 500}
    assert plan.n_slots == {1000: 4, 500: 2}
    assert (plan.capacity_bytes, plan.device_bytes, plan.buffer_bytes) == (5000, 6000, {"staging": 1000})
    # a share that is not a whole number of slots rounds down: 5999 − 1000 = 4999 → 3999 // 1000, 999 // 500
    assert plan_budget(LAYERS, RECORDS, 5999, buffers={"staging": 1000}).n_slots == {1000: 3, 500: 1}
    # never more slots than the pool has experts
    assert plan_budget(LAYERS, RECORDS, 10**9).n_slots == {1000: 8, 500: 4}


def test_the_minimum_working_set_is_the_boundary_and_the_error_names_it():
    # minimum: top-k records of one layer per pool (2 · 1000 + 1 · 500) plus the buffers (1000) = 3500
    plan = plan_budget(LAYERS, RECORDS, 3500, buffers={"staging": 1000})
    assert plan.n_slots == {1000: 2, 500: 1}
    with pytest.raises(BudgetError) as err:
        plan_budget(LAYERS, RECORDS, 3499, buffers={"staging": 1000})
    msg = str(err.value)
    assert "gpu_budget of 3,499 bytes" in msg and "3,500 bytes" in msg and "10,000 bytes hold every expert" in msg
    assert "1,000 bytes of codec buffers (staging)" in msg and "fraction ≥ 0.350" in msg
    with pytest.raises(
        BudgetError, match="this model: 2,500 bytes \\(the top-k experts of one layer of each of its 2 expert sizes;"
    ):
        plan_budget(LAYERS, RECORDS, 2499)  # without buffers the message names none
    with pytest.raises(BudgetError, match="this model: 2,000 bytes \\(the top-k experts of one layer;"):
        plan_budget(LAYERS[:1], {0: 1000}, 1999)  # one expert size: one layer's top-k
    with pytest.raises(BudgetError):
        plan_budget(LAYERS, RECORDS, 500, buffers={"staging": 1000})  # buffers larger than the budget


def test_record_sizes_within_a_sixteenth_share_a_pool():
    layers = [LayerInfo(i, f"layers.{i}", 4, 1) for i in range(3)]
    # 938 ≥ 1000 · 15/16 = 937.5 joins the 1000-byte pool; 937 and 900 do not (900 forms its own)
    assert plan_budget(layers, {0: 1000, 1: 938, 2: 900}, 10**6).pool_of_layer == {0: 1000, 1: 1000, 2: 900}
    assert plan_budget(layers, {0: 1000, 1: 937, 2: 900}, 10**6).pool_of_layer == {0: 1000, 1: 937, 2: 937}
    assert plan_budget(layers[:2], {0: 1600, 1: 1500}, 10**6).pool_of_layer == {0: 1600, 1: 1600}  # exactly 15/16
    plan = plan_budget(layers[:2], {0: 1000, 1: 938}, 8000)
    assert plan.n_slots == {1000: 8} and plan.slot_bytes == {1000: 1000}  # merged records take slots of the larger size


def test_device_buffers_by_placement():
    layouts = {0: SimpleNamespace(nbytes=700), 1: SimpleNamespace(nbytes=900)}
    with_scratch = SimpleNamespace(scratch_bytes=lambda layout: layout.nbytes // 2)
    assert device_buffers("dequant", with_scratch, layouts) == {"staging": 900}  # the largest record
    assert device_buffers("packed", with_scratch, layouts) == {"scratch": 450}  # the largest scratch
    assert device_buffers("packed", SimpleNamespace(), layouts) == {}  # a codec that computes without a scratch
    assert device_buffers("raw", with_scratch, layouts) == {}


@pytest.mark.parametrize("placement", ["dequant", "packed"])
def test_codec_buffers_are_planned_out_of_the_budget(tiny_checkpoint, placement):
    """Lossless on the tiny Mixtral (hidden 64, intermediate 64, fp32): "dequant" copies land in one staging
    record (the largest); "packed" decodes a weight at a time into a scratch the size of the largest one,
    gate_up_proj [128, 64] fp32 = 32768 bytes. Both come out of the budget before the slots."""
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, quantization="lossless", quant=QuantConfig(placement=placement))
    model = MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), cfg, progress=False)
    mira = model.mira
    want = max(mira.store.record_bytes(layer) for layer in mira.layers) if placement == "dequant" else 128 * 64 * 4
    s = mira.stats()
    assert s["buffer_bytes"] == want
    name = {"dequant": "staging", "packed": "scratch"}[placement]
    assert mira.budget.buffer_bytes == {name: want} and s["quantization"] == "lossless" and s["placement"] == placement
    assert s["capacity_bytes"] + want <= s["budget_bytes"] and mira.device_bytes == s["capacity_bytes"] + want


def test_records_cast_in_place_plan_room_for_the_cast_weight_beside_the_codec_scratch(tiny_checkpoint):
    """Placement "packed" decodes a weight into the scratch at each use; records cast in place (bf16 lossless ones
    after `float()`) decode there in bf16 and are cast beside it into fp32, so the scratch holds both, out of the
    budget: the largest weight, gate_up_proj [128, 64], in bf16 (16,384 bytes) and in fp32 (32,768)."""
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, quantization="lossless", quant=QuantConfig(placement="packed"))
    model = MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), cfg, dtype=torch.bfloat16, progress=False)
    mira = model.mira
    assert mira.budget.buffer_bytes == {"scratch": 128 * 64 * 2}
    model.float()
    assert mira.store.cast_in_place and mira.budget.buffer_bytes == {"scratch": 128 * 64 * 2 + 128 * 64 * 4}
    s = mira.stats()
    assert mira.device_bytes == s["capacity_bytes"] + 128 * 64 * 6 <= s["budget_bytes"]


def test_a_pool_shared_by_several_layers_counts_all_their_experts():
    layers = [LayerInfo(i, f"layers.{i}", 4, 1) for i in range(3)]
    # pool 1000: layers 0 and 1, 8000 bytes; pool 500: layer 2, 2000 bytes. 5000 bytes → 4000 and 1000
    assert plan_budget(layers, {0: 1000, 1: 1000, 2: 500}, 5000).n_slots == {1000: 4, 500: 2}


def test_the_error_lists_every_codec_buffer():
    with pytest.raises(BudgetError, match=r"2,000 bytes of codec buffers \(staging, scratch\)"):
        plan_budget(LAYERS, RECORDS, 3000, buffers={"staging": 1000, "scratch": 1000})


def test_a_fraction_below_the_minimum_working_set_is_raised_to_it_with_a_warning():
    # 0.1 of the 10,000 expert bytes is 1,000: below the 3,500 of the top-k records (2 · 1000 + 500) and the buffer
    advice = r"of one layer of each of its 2 expert sizes\)\. Give a larger fraction, or a byte budget, to choose the budget yourself\.$"
    with pytest.warns(
        UserWarning, match=r"gpu_budget=0.1 \(1,000 bytes\) is below .* using 3,500 bytes \(a fraction of 0.350.*" + advice
    ):
        plan = plan_budget(LAYERS, RECORDS, 1000, {"staging": 1000}, round_up_from=0.1)
    assert plan.n_slots == {1000: 2, 500: 1} and plan.budget_bytes == plan.device_bytes == 3500
    # a split that leaves one pool short of its top-k within a budget that holds every pool's: slots move, silently
    # (layer 0: 8 experts of 1000 bytes, top-1; layer 1: 4 of 500, top-2; 3000 → 2400 → 2 slots and 600 → 1 slot)
    layers = [LayerInfo(0, "layers.0.mlp.experts", 8, 1), LayerInfo(1, "layers.1.mlp.experts", 4, 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = plan_budget(layers, RECORDS, 3000, round_up_from=0.3)
    assert plan.n_slots == {1000: 2, 500: 2} and plan.budget_bytes == plan.device_bytes == 3000
    # at or above the minimum a fraction plans as a byte budget does, silently
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan_budget(LAYERS, RECORDS, 6000, {"staging": 1000}, round_up_from=0.6) == plan_budget(
            LAYERS, RECORDS, 6000, {"staging": 1000}
        )


# The tiny Mixtral: 2 layers of 8 fp32 experts of 49,152 bytes (gate_up [128, 64], down [64, 64]), uncompressed.
TINY_EXPERT_BYTES = 2 * 8 * 49152


@pytest.mark.parametrize(
    "kw",
    [
        dict(quantization="int4", quant=QuantConfig(placement="packed")),
        dict(quantization="lossless"),
        dict(host_compute="split", host_share=0.5),
    ],
    ids=["int4-packed", "lossless", "split"],
)
def test_the_fraction_a_budget_error_names_is_a_share_of_the_uncompressed_experts_and_suffices(tiny_checkpoint, kw):
    """A fractional budget is a share of every expert's bytes, uncompressed and whole, whatever the slots hold (packed
    records, device parts): the fraction the error and the round-up warning name is the minimum over those bytes, so
    the least fraction above it is accepted as it is."""
    import re

    path = tiny_checkpoint("mixtral")
    with pytest.raises(BudgetError) as refused:
        MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", gpu_budget=1000, **kw), progress=False)
    minimum = int(re.search(r"at least ([\d,]+) bytes", str(refused.value))[1].replace(",", ""))
    fraction = float(re.search(r"a fraction ≥ (\d+\.\d+)", str(refused.value))[1])
    assert fraction == round(minimum / TINY_EXPERT_BYTES, 3)
    with pytest.warns(UserWarning, match=rf"using {minimum:,} bytes \(a fraction of {fraction:.3f}"):
        MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", gpu_budget=1e-6, **kw), progress=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*below the minimum working set")
        model = MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", gpu_budget=fraction + 0.001, **kw), progress=False)
    assert model.mira.stats()["budget_bytes"] == int((fraction + 0.001) * TINY_EXPERT_BYTES)


def test_the_round_up_warning_names_the_line_that_asked_for_the_plan():
    """`plan_records`' caller (the stage that plans the store; here this test), not a line of the planning."""
    import mira_hf.budget as budget

    with pytest.warns(UserWarning, match="below the minimum working set") as caught:
        plan = plan_records(LAYERS, 1000, "raw", None, {}, RECORDS, round_up_from=0.1)
    assert plan.budget_bytes == 2500  # the top-k records of one layer in each pool, no codec buffers
    assert len(caught) == 1 and caught[0].filename != budget.__file__
    if "MUTANT_UNDER_TEST" not in os.environ:  # mutation testing (mutmut) wraps every call in two more frames
        assert caught[0].filename == __file__


# -- placement "mixed": the fewest experts kept packed so that every expert is on the device ------------------------

# Two layers of 4 experts, top-1: decoded records of 1000 bytes, packed ones of 700 (a saving of 300 each).
MIXED_LAYERS = [LayerInfo(0, "layers.0.mlp.experts", 4, 1), LayerInfo(1, "layers.1.mlp.experts", 4, 1)]
DECODED, PACKED = {0: 1000, 1: 1000}, {0: 700, 1: 700}


def _mixed(budget: int):
    from mira_hf.budget import keep_packed

    return keep_packed(plan_budget(MIXED_LAYERS, DECODED, budget, placement="mixed"), MIXED_LAYERS, PACKED)


def test_mixed_keeps_the_fewest_experts_packed_that_put_every_expert_on_the_device():
    # 7000 bytes: every expert decoded needs 8000, so 1000 must be saved: four experts kept (4 × 300 ≥ 1000),
    # taken one layer at a time, the highest-numbered first; the other four get decoded slots
    plan = _mixed(7000)
    assert plan.kept == {0: (2, 3), 1: (2, 3)} and plan.kept_bytes == {0: 700, 1: 700}
    assert plan.n_slots == {1000: 4}
    assert plan.device_bytes == 4 * 1000 + 4 * 700 <= plan.budget_bytes
    # 7400 bytes: 600 to save, two kept, one per layer
    assert _mixed(7400).kept == {0: (3,), 1: (3,)} and _mixed(7400).n_slots == {1000: 6}
    # 7650: 350 to save, still two (one expert saves only 300); the layers take turns from the first
    assert _mixed(7650).kept == {0: (3,), 1: (3,)}
    assert _mixed(7750).kept == {0: (3,)} and _mixed(7750).n_slots == {1000: 7}


def test_mixed_is_the_decoded_plan_where_every_expert_fits_decoded_or_keeping_cannot_make_them_fit():
    assert _mixed(8000).kept == {} and _mixed(8000).n_slots == {1000: 8}
    # Each layer keeps its top-k experts in slots: at most 3 + 3 kept saves 1800; 6100 would need 1900
    low = _mixed(6100)
    assert low.kept == {} and low.n_slots == plan_budget(MIXED_LAYERS, DECODED, 6100).n_slots == {1000: 6}
    edge = _mixed(6200)  # exactly 1800 to save
    assert edge.kept == {0: (1, 2, 3), 1: (1, 2, 3)} and edge.n_slots == {1000: 2}


def test_mixed_plans_the_staging_record_and_the_decode_scratch():
    from mira_hf.quant import LosslessCodec

    codec = LosslessCodec()
    w = {"gate_up_proj": torch.randn(4, 64, 32, dtype=torch.bfloat16), "down_proj": torch.randn(4, 32, 32, dtype=torch.bfloat16)}
    layout = codec.plan_experts(w)
    buffers = device_buffers("mixed", codec, {0: layout})
    assert buffers == {"staging": layout.nbytes, "scratch": codec.scratch_bytes(layout)}
    assert device_buffers("dequant", codec, {0: layout}).keys() == {"staging"}
    assert device_buffers("packed", codec, {0: layout}).keys() == {"scratch"}


# -- experts of several sizes: one slot pool per size --------------------------------------------------------------


def test_a_pool_short_of_its_top_k_gets_them_and_the_others_share_the_rest():
    # layer 1 routes each token to all 4 of its experts: its pool needs 2000 bytes at any budget below every expert
    layers = [LayerInfo(0, "layers.0.mlp.experts", 8, 2), LayerInfo(1, "layers.1.mlp.experts", 4, 4)]
    # minimum 2 · 1000 + 4 · 500 = 4000; 8000 would give pool 500 only 1600 → it takes 2000, pool 1000 the other 6000
    assert plan_budget(layers, RECORDS, 4000).n_slots == {1000: 2, 500: 4}
    assert plan_budget(layers, RECORDS, 8000).n_slots == {1000: 6, 500: 4}
    for budget in range(4000, 10001, 50):  # every budget from the minimum to every expert is held
        plan = plan_budget(layers, RECORDS, budget)
        assert plan.n_slots[1000] >= 2 and plan.n_slots[500] == 4 and plan.capacity_bytes <= budget
    assert plan.n_slots == {1000: 8, 500: 4}
    with pytest.raises(BudgetError, match="this model: 4,000 bytes"):
        plan_budget(layers, RECORDS, 3999)


def _experts_of_three_sizes():
    """A tiny Mixtral whose three MoE layers have experts of three shapes, (experts, top-k, intermediate size): one
    slot pool per layer; the middle layer routes each token to all of its experts."""
    from tiny_models import build, make_config
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = make_config("mixtral", num_hidden_layers=3)
    torch.manual_seed(0)
    model = build(config).eval()
    for layer, (experts, top_k, inter) in zip(model.model.layers, [(8, 2, 64), (4, 4, 16), (16, 1, 96)]):
        block = copy.deepcopy(config)
        block.num_local_experts, block.num_experts_per_tok, block.intermediate_size = experts, top_k, inter
        layer.mlp = MixtralSparseMoeBlock(block)
        for p in layer.mlp.parameters():
            torch.nn.init.normal_(p, 0.0, 0.05)
    return model.eval()


@pytest.mark.parametrize("share", [0.0, 0.1, 0.5, 0.99])
def test_experts_of_several_sizes_run_exactly_at_any_budget_from_the_minimum(share):
    ref = _experts_of_three_sizes()
    probe = MiraMoEModel.wrap(copy.deepcopy(ref), MiraConfig(device="cpu")).mira
    layers = list(probe.layers.values())
    record = {li.ordinal: probe.store.record_bytes(li.ordinal) for li in layers}
    assert len(set(record.values())) == 3
    total = sum(record[li.ordinal] * li.num_experts for li in layers)
    minimum = sum(li.top_k * record[li.ordinal] for li in layers)  # each layer's own pool holds its top-k
    budget = minimum + int(share * (total - minimum))
    model = MiraMoEModel.wrap(copy.deepcopy(ref), MiraConfig(device="cpu", gpu_budget=budget))
    plan = model.mira.budget
    assert all(plan.n_slots[plan.pool_of_layer[li.ordinal]] >= li.top_k for li in layers)
    assert plan.capacity_bytes <= budget
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    s = model.mira.stats()
    assert s["resident_bytes"] <= s["budget_bytes"] == budget
    if share == 0.0:
        with pytest.raises(
            BudgetError, match=f"this model: {minimum:,} bytes \\(the top-k experts of one layer of each of its 3"
        ):
            MiraMoEModel.wrap(copy.deepcopy(ref), MiraConfig(device="cpu", gpu_budget=minimum - 1))


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_available_host_memory_is_what_the_memory_cgroup_leaves_where_that_is_less(tmp_path, monkeypatch, version):
    """In a container (a memory cgroup with a limit), the host memory a load may take is the limit less the group's
    usage (its inactive file pages counted as room), where that is less than the machine's MemAvailable: the
    store's memory check refuses what the cgroup's OOM killer would end, not only what the machine cannot hold.
    The least room under any limit from the process's group up to the root counts; a group without a limit none."""
    from mira_hf import resources

    group = tmp_path / ("memory" if version == "v1" else "") / "job" / "task"
    group.mkdir(parents=True)
    names = (
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        if version == "v1"
        else ("memory.max", "memory.current", "inactive_file")
    )
    (group / names[0]).write_text("3000000\n")
    (group / names[1]).write_text("2500000\n")
    (group / "memory.stat").write_text(f"active_file 7\n{names[2]} 400000\n")
    (group.parent / names[0]).write_text("max\n" if version == "v2" else f"{2**63 - 4096}\n")  # no limit above
    (group.parent / names[1]).write_text("9000000\n")
    (tmp_path / "cgroup").write_text("0::/job/task\n" if version == "v2" else "4:memory:/job/task\n0::/\n")
    monkeypatch.setattr(resources, "_PROC_CGROUP", str(tmp_path / "cgroup"))
    monkeypatch.setattr(resources, "_CGROUP_ROOT", str(tmp_path))
    assert resources.cgroup_room() == 3000000 - 2500000 + 400000
    assert resources.available_host_bytes() == 900000  # the machine has more
    (group / names[0]).write_text("max\n" if version == "v2" else f"{2**63 - 4096}\n")
    assert resources.cgroup_room() is None and resources.available_host_bytes() > 900000
