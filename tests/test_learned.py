"""The `learned` predictor: calibrated on the bundled mira-tiny, it predicts decode steps better than
`gate`, never changes outputs, round-trips through its files, refuses other models' files and stays
within 1% of the model's parameters."""

import json
import os

import pytest
import torch
from conftest import load_reference, torch_threads
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache

from mira_hf import ConfigError, IncompatibleFileError, MiraConfig, MiraMoEModel
from mira_hf.bundled import bundled_model_path
from mira_hf.calibrate import calibrate
from mira_hf.learned import LearnedPredictor, model_parameters
from mira_hf.proxy import MiraExperts

BUNDLED = bundled_model_path()
HELDOUT = load_file(os.path.join(BUNDLED, "heldout_tokens.safetensors"))["input_ids"].long()  # [64, 256]
CALIBRATION = HELDOUT[:12]  # windows the predictor is trained on
EVALUATION = HELDOUT[12:16, :64]  # other windows, decoded token by token


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One-token steps of an 8M-parameter model: OpenMP fork/join costs more than a second thread gives
    (7 ms vs 140 ms per step on 2 shared cores)."""
    with torch_threads(1):
        yield


def mira(predictor: str, predictor_path=None):
    cfg = MiraConfig(device="cpu", gpu_budget=0.25, predictor=predictor, predictor_path=predictor_path)
    return MiraMoEModel.from_pretrained(BUNDLED, cfg, dtype=torch.float32, progress=False)


def decode(model, ids: torch.Tensor) -> None:
    """Teacher-forced decode: one token per forward (T = 1), through the KV cache, row by row."""
    with torch.no_grad():
        for row in ids:
            cache = DynamicCache(config=model.config)
            for i in range(len(row)):
                model(input_ids=row[None, i : i + 1], cache=cache, use_cache=True)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """(wrapped model it was calibrated on, the predictor, the directory it was saved to)."""
    model = mira("gate")
    predictor = calibrate(model, CALIBRATION, progress=False)
    directory = str(tmp_path_factory.mktemp("learned"))
    model.mira.save_predictor(directory)
    return model, predictor, directory


@pytest.fixture(scope="module")
def learned_model(calibrated):
    return mira("learned", calibrated[2])


@pytest.fixture(scope="module")
def gate_model():
    return mira("gate")


def test_calibrate_installs_the_predictor_and_restores_the_recorder(calibrated):
    model, predictor, _ = calibrated
    assert isinstance(predictor, LearnedPredictor) and model.mira.predictor is predictor
    assert model.mira.recorder is None
    s = predictor.summary
    assert s["samples"] + s["validation_samples"] == CALIBRATION.numel()
    # within-step heads, then the next-step head (the layer itself, the next token)
    assert predictor.targets[0] == [1, 2, 0] and predictor.targets[4] == [5, 4] and predictor.targets[5] == [5]
    assert sorted(s["validation"]) == ["0", "1", "2", "3", "4", "5"]  # keyed by predicted layer, as stats() is
    assert all(row["recall@1"] > 0.8 for row in s["validation"].values() if "recall@1" in row)
    assert all(row["recall@next"] > 0.5 for row in s["validation"].values())  # the next token's experts: harder


def test_predictions_are_token_unions_on_cpu(calibrated):
    _, predictor, _ = calibrated
    hidden = torch.randn(3, 192)
    out = predictor.predict(0, hidden)
    assert (
        sorted(out) == [0, 1, 2]
        and sorted(predictor.predict(4, hidden)) == [4, 5]
        and sorted(predictor.predict(5, hidden)) == [5]
    )
    per_token = torch.sigmoid(predictor.nets[0](hidden))  # [3, 24]: heads for layers 1, 2, then the next step
    union = 1 - torch.prod(1 - per_token, dim=0)
    assert torch.allclose(torch.cat([out[1], out[2], out[0]]), union)
    assert all(p.device.type == "cpu" and p.shape == (8,) for p in out.values())


def test_parameters_are_at_most_one_percent_of_the_model(calibrated):
    model, predictor, directory = calibrated
    n_model = sum(p.numel() for p in load_reference(BUNDLED).parameters())
    assert model_parameters(model) == n_model  # experts held by mira-hf are counted too
    assert predictor.num_parameters() <= 0.01 * n_model
    with open(os.path.join(directory, "predictor.json")) as f:
        meta = json.load(f)
    assert meta["parameters"] == predictor.num_parameters() and meta["rank"] <= 64


def test_learned_recall_at_2_beats_gate_on_decode_steps(gate_model, learned_model):
    recall = {}
    for name, model in (("gate", gate_model), ("learned", learned_model)):
        model.mira.reset_stats()
        decode(model, EVALUATION)
        per_layer = model.mira.stats()["per_layer"]
        recall[name] = [s["recall@2"] for s in per_layer.values() if s.get("recall@2") is not None]
    assert len(recall["learned"]) == len(recall["gate"]) == 4  # layers 2..5 are predicted two layers ahead
    mean = {name: sum(r) / len(r) for name, r in recall.items()}
    assert mean["learned"] >= 0.85 and mean["learned"] > mean["gate"] + 0.05, mean  # measured: 0.95 vs 0.72


def test_outputs_are_identical_with_the_learned_predictor(gate_model, learned_model):
    ref = AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    ids = HELDOUT[16:18, :64]
    with torch.no_grad():
        logits = learned_model(ids).logits
        assert torch.equal(logits, gate_model(ids).logits)  # what was staged never changes a result
        assert torch.equal(logits, ref(ids).logits)  # and what transformers' own experts compute
    prompt = HELDOUT[18:19, :16]
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.equal(learned_model.generate(prompt, **kw), ref.generate(prompt, **kw))


def test_save_load_round_trip_gives_the_same_predictions(calibrated, learned_model, tmp_path):
    model, predictor, directory = calibrated
    loaded = LearnedPredictor.load(directory, model=model)
    assert isinstance(learned_model.mira.predictor, LearnedPredictor)
    hidden = torch.randn(5, 192)
    for p in (loaded, learned_model.mira.predictor):
        for layer in predictor.nets:
            a, b = predictor.predict(layer, hidden), p.predict(layer, hidden)
            assert a.keys() == b.keys() and all(torch.equal(a[t], b[t]) for t in a)
    assert loaded.summary == predictor.summary
    loaded.save(tmp_path, model.mira.fingerprint)  # a loaded predictor saves again, unchanged
    again, first = load_file(tmp_path / "predictor.safetensors"), load_file(os.path.join(directory, "predictor.safetensors"))
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)


def assert_untouched(model, ids, expected_logits):
    assert not hasattr(model, "mira") and not any(isinstance(m, MiraExperts) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected_logits)


def test_file_of_another_architecture_is_refused_before_any_change(calibrated, tiny_checkpoint):
    directory = calibrated[2]
    model = load_reference(tiny_checkpoint("mixtral"))
    ids = HELDOUT[:1, :32] % model.config.vocab_size
    with torch.no_grad():
        expected = model(ids).logits
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, predictor="learned", predictor_path=directory)
    with pytest.raises(IncompatibleFileError, match="made for mixtral, 6 MoE layers"):
        MiraMoEModel.wrap(model, cfg)
    assert_untouched(model, ids, expected)


def test_file_of_same_shape_other_routers_is_refused_before_any_change(calibrated):
    directory = calibrated[2]
    model = AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    with torch.no_grad():
        model.model.layers[3].mlp.gate.weight.mul_(1.01)  # another checkpoint of the same architecture
        expected = model(HELDOUT[:1, :32]).logits
    cfg = MiraConfig(device="cpu", gpu_budget=0.25, predictor="learned", predictor_path=directory)
    with pytest.raises(IncompatibleFileError, match="router_sha256"):
        MiraMoEModel.wrap(model, cfg)
    assert_untouched(model, HELDOUT[:1, :32], expected)


def test_missing_or_foreign_files_are_clear_errors(calibrated, tmp_path):
    model = calibrated[0]
    with pytest.raises(ConfigError, match="holds no calibrated predictor"):
        LearnedPredictor.load(tmp_path, model=model)
    (tmp_path / "predictor.json").write_text(json.dumps({"format": "something-else", "version": 1}))
    (tmp_path / "predictor.safetensors").write_bytes(b"")
    with pytest.raises(IncompatibleFileError, match="not a mira-hf-learned-predictor"):
        LearnedPredictor.load(tmp_path, model=model)


@pytest.mark.parametrize("form", ["tensor", "iterable", "strings"])
def test_calibrate_accepts_tensors_iterables_and_strings(calibrated, form):
    model = calibrated[0]
    data = {
        "tensor": HELDOUT[20:22, :40],
        "iterable": (row[: 20 + 10 * i] for i, row in enumerate(HELDOUT[20:23])),  # 1-D, ragged lengths
        "strings": ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog."],
    }[form]
    predictor = calibrate(model, data, epochs=1, progress=False, validation_fraction=0)
    expected = {"tensor": 80, "iterable": 20 + 30 + 40, "strings": None}[form]
    if expected is not None:
        assert predictor.summary["samples"] == expected
    assert model.mira.predictor is predictor and model.mira.recorder is None


def test_strings_without_a_tokenizer_are_a_clear_error(tiny_checkpoint):
    model = MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), MiraConfig(device="cpu"), progress=False)
    with pytest.raises(ConfigError, match="no tokenizer could be loaded"):
        calibrate(model, ["some text"], progress=False)
    with pytest.raises(ConfigError, match="float32"):
        calibrate(model, torch.randn(2, 8), progress=False)


def test_too_little_data_is_refused_before_a_predictor_is_installed(tiny_checkpoint, tmp_path):
    """An empty tensor is data without tokens; one token cannot train (its scale would be NaN): both refused,
    nothing installed or written."""
    model = MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), MiraConfig(device="cpu"), progress=False)
    with pytest.raises(ConfigError, match="held no tokens"):
        calibrate(model, torch.zeros(0, dtype=torch.long), progress=False)
    with pytest.raises(ConfigError, match=r"gave 1 token\(s\), 1 to train on .*at least 2"):
        calibrate(model, torch.tensor([5]), out_dir=tmp_path / "p", progress=False)
    assert not isinstance(model.mira.predictor, LearnedPredictor) and not (tmp_path / "p").exists()


def test_a_model_whose_layers_route_some_tokens_only_is_refused_as_recording_refuses_it(tmp_path):
    """ERNIE-4.5-VL's vision experts route only image tokens: on text their layer has no routing to learn from, so
    calibrate says which layers routed too few tokens (as `record_trace` does), before installing or writing
    anything."""
    import composite_models
    import transformers

    from mira_hf import UnsupportedModelError

    torch.manual_seed(0)
    model = MiraMoEModel.wrap(composite_models.ernie_vl(transformers).eval(), MiraConfig(device="cpu", gpu_budget=0.25))
    predictor = model.mira.predictor
    with pytest.raises(UnsupportedModelError, match=r"MoE layers \[1\] of \[0, 1\] routed fewer than the 128 tokens"):
        calibrate(model, torch.randint(3, 100, (4, 32)), out_dir=tmp_path / "p", epochs=1, progress=False)
    assert model.mira.predictor is predictor and not (tmp_path / "p").exists()


def test_calibrate_needs_a_wrapped_model(tiny_checkpoint):
    with pytest.raises(ConfigError, match="wrapped by mira-hf"):
        calibrate(load_reference(tiny_checkpoint("mixtral")), HELDOUT[:1, :8] % 128, progress=False)


def test_calibrate_works_on_a_tiny_random_model(tiny_checkpoint):
    model = MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), MiraConfig(device="cpu", gpu_budget=0.5), progress=False)
    predictor = calibrate(model, torch.randint(3, 128, (4, 32)), epochs=2, progress=False)
    assert predictor.targets == {0: [1, 0], 1: [1]}  # two MoE layers: only layer 0 has one ahead; both a next step
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 8)))
    assert model.mira.stats()["per_layer"][1]["recall@1"] is not None


def test_calibrate_counts_experts_and_can_mark_unused_ones_host_only(tiny_checkpoint):
    model = MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), MiraConfig(device="cpu", gpu_budget=0.5), progress=False)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(3, 128, (2, 6), generator=g)  # 12 tokens: some experts get none
    predictor = calibrate(model, data, epochs=1, progress=False, validation_fraction=0, host_only_unused=True)
    counts = predictor.summary["expert_counts"]
    K = model.config.num_experts_per_tok
    assert all(sum(c) == data.numel() * K for c in counts.values())
    unused = {(int(L), e) for L, c in counts.items() for e, n in enumerate(c) if n == 0}
    assert unused and model.mira.host_only == unused
    ref = load_reference(tiny_checkpoint("mixtral"))
    ids = torch.randint(3, 128, (1, 16), generator=g)
    gen = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **gen), ref.generate(ids, **gen))  # host-only changes no output
    assert model.mira.stats()["host_only_experts"] == len(unused)


def test_a_file_saved_after_the_routers_changed_names_them_as_they_are_then(calibrated, tmp_path):
    """Routers changed after wrapping (load_state_dict of fine-tuned weights, an in-place edit): a predictor saved
    then is for the model as it is, so it loads with that model's checkpoint and is refused by the original's."""
    model, predictor, _ = calibrated
    edited = mira("gate")
    with torch.no_grad():
        edited.model.layers[3].mlp.gate.weight.mul_(1.01)
    edited.mira.predictor = predictor  # as calibrate sets it
    edited.mira.save_predictor(tmp_path / "predictor")
    edited.save_pretrained(tmp_path / "model")
    cfg = MiraConfig(device="cpu", gpu_budget=0.25, predictor="learned", predictor_path=str(tmp_path / "predictor"))
    again = MiraMoEModel.from_pretrained(tmp_path / "model", cfg, progress=False, dtype=torch.float32)
    assert again.mira.predictor is not None
    with pytest.raises(IncompatibleFileError, match="router_sha256"):
        MiraMoEModel.from_pretrained(BUNDLED, cfg, progress=False, dtype=torch.float32)
