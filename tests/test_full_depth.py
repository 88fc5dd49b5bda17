"""benchmarks/full_depth.py and its parts: routing statistics on known traces, topic-shaped routers that give a
random model a trained model's routing statistics, checkpoints written in the hub's pre-quantized layout, and
a --smoke run (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import reference_kwargs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import routing_stats as rs  # noqa: E402
import topic_routing as tr  # noqa: E402


def seq(*steps):
    """[1, T, K] routing of one sequence of one layer."""
    return torch.tensor([list(s) for s in steps])[None]


# -- statistics ----------------------------------------------------------------------------------
def test_load_stats_of_a_known_distribution():
    # 10 experts; expert 0 takes 6 of 12 picks, experts 1..6 one each: top 20% (2 experts) take 7/12
    idx = seq([0, 1], [0, 2], [0, 3], [0, 4], [0, 5], [0, 6])
    s = rs.load_stats(idx, 10)
    assert s["top20_share"] == pytest.approx(7 / 12)
    assert s["max_over_mean"] == pytest.approx(6 / 1.2)
    balanced = rs.load_stats(seq(*[[2 * i, 2 * i + 1] for i in range(5)]), 10)
    assert balanced["entropy"] == pytest.approx(1.0) and balanced["max_over_mean"] == pytest.approx(1.0)


def test_reuse_counts_experts_shared_with_the_previous_token_of_the_same_sequence():
    assert rs.reuse(seq([0, 1], [1, 2], [3, 4])) == pytest.approx((0.5 + 0.0) / 2)
    two = torch.cat([seq([0, 1], [0, 1]), seq([2, 3], [4, 5])])  # sequences never compared with each other
    assert rs.reuse(two) == pytest.approx(0.5)
    assert rs.reuse(seq([0, -1], [0, -1])) == pytest.approx(1.0)  # padding is not an expert


def test_next_layer_recall_is_one_when_a_layer_determines_the_next():
    g = torch.Generator().manual_seed(0)
    a = torch.stack([torch.randperm(16, generator=g)[:2] for _ in range(400)])[None]  # [1, 400, 2]
    b = (a + 5) % 16  # layer b's experts are a function of layer a's
    r = rs.next_layer_recall(a, b, 16)
    assert r["cooccurrence"] == pytest.approx(1.0)
    assert r["popularity"] < 0.3
    independent = rs.next_layer_recall(a, torch.stack([torch.randperm(16, generator=g)[:2] for _ in range(400)])[None], 16)
    assert independent["cooccurrence"] < 0.3


def test_records_split_into_prompt_and_decode_routing():
    B, S, K = 2, 3, 2
    prefill = torch.arange(B * S * K).reshape(B * S, K)
    records = [(0, prefill), (1, prefill + 100), (0, torch.tensor([[7, 8], [9, 10]])), (1, torch.tensor([[1, 2], [3, 4]]))]
    prompt, decode = rs.from_records(records, B)
    assert [p.shape for p in prompt] == [(B, S, K)] * 2
    assert torch.equal(prompt[0][1, 0], torch.tensor([6, 7]))  # sequence-major rows
    assert torch.equal(decode[1], torch.tensor([[[1, 2]], [[3, 4]]]))


# -- shaped routing ------------------------------------------------------------------------------
def _model(seed=0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=256,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=32,
        num_experts_per_tok=4,
        norm_topk_prob=True,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _routing(model, ids):
    """Each MoE layer's routing [B, S, K] of a teacher-forced forward, read from the experts modules' inputs."""
    out = {}
    hooks = [
        r.experts.register_forward_pre_hook(lambda m, a, r=r: out.__setitem__(r.layer, a[1].reshape(*ids.shape, -1)))
        for r in tr._routers(model)
    ]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return [out[i] for i in sorted(out)]


@pytest.fixture(scope="module")
def shaped():
    targets = tr.RoutingTargets(correction_rounds=1)
    model = _model()
    ids = tr.topic_prompts(4, 128, 2048, targets.topics, targets.p_stay, seed=1)
    before = rs.routing_stats(_routing(model, ids), [32] * 4)
    info = tr.shape_routing(model, ids, targets)
    held_out = tr.topic_prompts(4, 128, 2048, targets.topics, targets.p_stay, seed=7)
    return model, info, before, rs.routing_stats(_routing(model, held_out), [32] * 4)


def test_shaped_routers_give_skewed_reused_layer_correlated_routing_on_new_prompts(shaped):
    _, info, before, after = shaped
    # random weights: no layer predicts the next better than popularity does
    assert before["next_layer_recall"]["mean"] < before["next_layer_recall_popularity"]["mean"] + 0.03
    assert 0.25 <= after["reuse"]["mean"] <= 0.6  # chance: 4 of 32
    assert 0.3 <= after["top20_share"]["mean"] <= 0.6
    assert after["entropy"]["min"] > 0.8  # skewed, not collapsed onto a few experts
    assert after["next_layer_recall"]["mean"] > after["next_layer_recall_popularity"]["mean"] + 0.04
    assert min(info["topic_snr_by_layer"]) > 3


def test_shaped_lm_head_keeps_greedy_decoding_on_its_topic(shaped):
    model, info, _, _ = shaped
    assert info["head_stay_fraction"] == pytest.approx(0.85, abs=0.1)
    ids = tr.topic_prompts(2, 64, 2048, 16, 0.85, seed=3)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=0)
    topics = tr.topic_of(out[:, 64:], 16)
    stays = (topics[:, 1:] == topics[:, :-1]).float().mean().item()
    assert stays > 0.5  # random next tokens would keep the topic 1 time in 16
    assert all(len(set(row.tolist())) > 8 for row in out[:, 64:])  # and do not repeat one token


def test_topic_prompts_are_seeded_walks_in_the_vocabulary():
    a = tr.topic_prompts(3, 200, 1000, 16, 0.85, seed=5)
    assert torch.equal(a, tr.topic_prompts(3, 200, 1000, 16, 0.85, seed=5))
    assert a.min() >= 3 and a.max() < 1000
    topics = tr.topic_of(a, 16)
    assert 0.75 < (topics[:, 1:] == topics[:, :-1]).float().mean() < 0.95


# -- checkpoints in the hub's layout -------------------------------------------------------------
@pytest.mark.parametrize(
    "family, fmt",
    [pytest.param("deepseek_v3", "fp8", marks=pytest.mark.slow), ("gpt_oss", "mxfp4")],  # FP8: ~10-25 s
)
def test_written_checkpoint_has_the_hub_layout_and_loads_as_transformers_loads_it(tmp_path, family, fmt):
    import full_depth
    from quantized_checkpoints import FP8_WIDTHS, _config, write_fp8_checkpoint, write_mxfp4_checkpoint
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from mira_hf import MiraConfig, MiraMoEModel

    def layout(path):
        out = {}
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(path, f), "pt") as st:
                    out.update({k: (tuple(st.get_slice(k).get_shape()), st.get_slice(k).get_dtype()) for k in st.keys()})
        return out

    ref = str(tmp_path / "reference")
    write_fp8_checkpoint(family, ref) if fmt == "fp8" else write_mxfp4_checkpoint(ref)
    config = _config(family, **(FP8_WIDTHS if fmt == "fp8" else {}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    ours = str(tmp_path / "ours")
    facts = full_depth.write_prequantized(model, ours, fmt)
    assert layout(ours) == layout(ref)
    with open(os.path.join(ours, "config.json")) as f, open(os.path.join(ref, "config.json")) as g:
        assert json.load(f)["quantization_config"] == json.load(g)["quantization_config"]
    assert facts["checkpoint_bytes"] > 0

    ids = torch.randint(3, config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(2))
    expected = AutoModelForCausalLM.from_pretrained(ours, **reference_kwargs(ours, torch.bfloat16)).eval()(ids).logits
    wrapped = MiraMoEModel.from_pretrained(ours, MiraConfig(device="cpu", gpu_budget=0.5), progress=False, dtype=torch.bfloat16)
    assert torch.equal(wrapped.eval()(ids).logits, expected)


# -- the script ----------------------------------------------------------------------------------
@pytest.mark.slow  # ~30-60 s each on a 2-core CPU
@pytest.mark.parametrize("model", ["qwen3", "gpt-oss"])
def test_smoke_run_writes_results_with_routing_statistics_beside_the_numbers(tmp_path, model):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "full_depth.py"), "--model", model, "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (path,) = tmp_path.glob("*-full-depth-*.json")
    result = json.loads(path.read_text())
    assert path.with_suffix(".md").read_text().count("\n|") >= 2
    (row,) = result["rows"]
    assert row["status"] == "ok", row.get("error")
    for key in ("ttft_s", "decode_tok_s_b8", "beam_tok_s", "host_rss_gb", "hit_rate"):
        assert row[key] is not None and row[key] > 0, key
    assert row["floor"]["belady_bytes_per_token"] is not None
    for part in ("prompt", "decode"):
        stats = row["routing"][part]
        assert stats["tokens"] > 0 and 0 < stats["reuse"]["mean"] <= 1 and stats["top20_share"]["mean"] > 0
    if model == "gpt-oss":
        assert row["load_first_s"] > 0 and row["load_cached_s"] > 0 and row["cache"]["quantization"] == "mxfp4"
    else:  # built whole, measured all resident first: the wrapped model decodes the same tokens
        assert result["resident"]["decode_tok_s_b8"] > 0 and row["same_tokens_as_resident"] is True
