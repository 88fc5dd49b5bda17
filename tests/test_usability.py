"""What a new user runs into first: the transformers habits (`from_pretrained(path, gpu_budget=...)`), one
spelling per choice in Python and on the command line, a missing path said plainly, an instant `mira --help`,
labels that mean one thing, and an unambiguous import name for the adapters."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mira_hf import CheckpointError, ConfigError, MiraConfig, MiraMoEModel, bundled_model_path, cli
from mira_hf.config import (
    HOST_MEMORY_KINDS,
    POLICIES,
    PREDICTORS,
    CacheConfig,
    PredictorConfig,
    QuantConfig,
    chosen_quantizations,
)

ROOT = Path(__file__).resolve().parent.parent


# -- MiraConfig's fields as keywords ----------------------------------------------------------------
def test_from_pretrained_takes_mira_config_fields_as_keywords():
    model = MiraMoEModel.from_pretrained(
        bundled_model_path(), gpu_budget=0.25, device="cpu", policy="LRU", predictor="none", dtype=torch.float32, progress=False
    )
    cfg = model._mira_config
    assert (cfg.gpu_budget, cfg.device, cfg.policy, cfg.predictor) == (0.25, "cpu", "lru", None)
    assert model.dtype == torch.float32  # the rest still goes to transformers
    assert model.mira.stats()["hits"] == 0


def test_mira_config_and_its_fields_together_are_refused_before_loading(tmp_path):
    missing = tmp_path / "never-read"  # the error comes before any file is looked at
    with pytest.raises(ConfigError, match=r"both mira_config and MiraConfig fields.*gpu_budget=0\.5"):
        MiraMoEModel.from_pretrained(missing, MiraConfig(device="cpu"), gpu_budget=0.5)


def test_a_mira_config_given_as_transformers_config_is_refused_before_loading(tmp_path):
    """`config=` is transformers' model config: a MiraConfig there would be dropped and the model loaded with the
    default settings; it is refused, naming where it goes."""
    missing = tmp_path / "never-read"
    with pytest.raises(ConfigError, match=r"MiraConfig as config=.*mira_config="):
        MiraMoEModel.from_pretrained(missing, config=MiraConfig(device="cpu", gpu_budget=0.25))


def test_wrap_takes_mira_config_fields_as_keywords(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("mixtral"))
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        want = model(ids).logits
    with pytest.raises(ConfigError, match="unexpected keywords gpu_budegt"):
        MiraMoEModel.wrap(model, gpu_budegt=0.5)
    with pytest.raises(ConfigError, match="both mira_config"):
        MiraMoEModel.wrap(model, MiraConfig(device="cpu"), policy="lru")
    assert not hasattr(model, "mira")  # refused before anything changed
    wrapped = MiraMoEModel.wrap(model, gpu_budget=0.5, device="cpu", policy="lru")
    assert wrapped._mira_config == MiraConfig(gpu_budget=0.5, device="cpu", policy="lru")
    with torch.no_grad():
        assert torch.equal(wrapped(ids).logits, want)


# -- one spelling per choice, any case --------------------------------------------------------------
@pytest.mark.parametrize(
    "field, typed, stored",
    [
        ("policy", "LRU", "lru"),
        ("policy", "Heat", "heat"),
        ("predictor", "none", None),
        ("predictor", "None", None),
        ("predictor", None, None),
        ("predictor", "GATE", "gate"),
        ("quantization", "none", None),
        ("quantization", "Lossless", "lossless"),
        ("host_memory", "Pageable", "pageable"),
    ],
)
def test_choices_are_read_in_any_case_with_none_spelled_none(field, typed, stored):
    assert getattr(MiraConfig(**{field: typed}), field) == stored


@pytest.mark.parametrize(
    "field, allowed", [("policy", POLICIES), ("predictor", PREDICTORS), ("quantization", chosen_quantizations())]
)
def test_a_wrong_choice_lists_the_choices_as_typed(field, allowed):
    with pytest.raises(ConfigError) as info:
        MiraConfig(**{field: "nonsense"})
    message = str(info.value)
    shown = ", ".join("none" if a is None else a for a in allowed)
    assert f"{field}='nonsense'" in message and f"Supported: {shown}" in message
    assert "None," not in message and "'" not in message.split("Supported:")[1]


def test_host_memory_choices_are_typed_as_listed():
    assert all(MiraConfig(host_memory=kind.upper()).host_memory == kind for kind in HOST_MEMORY_KINDS)


def test_nested_configs_read_their_choices_in_any_case():
    from mira_hf.heat import HeatConfig

    assert HeatConfig(clock="WALL").clock == "wall" and HeatConfig(clock=" Steps ").clock == "steps"
    assert MiraConfig(quant=QuantConfig(placement="MIXED")).quant.placement == "mixed"


def test_cli_and_python_accept_the_same_spellings():
    parser = cli.build_parser()
    for typed in ("none", "None", "NONE"):
        args = parser.parse_args(["generate", "--prompt", "x", "--predictor", typed, "--quantization", typed, "--policy", "LRU"])
        cfg = cli.options.mira_config(args)
        assert (cfg.predictor, cfg.quantization, cfg.policy) == (None, None, "lru")
        assert cfg == cfg.replace(predictor=typed, quantization=typed, policy="LRU")  # Python reads them alike
    generate_help = parser._subparsers._group_actions[0].choices["generate"].format_help()
    assert "none, auto, gate" in " ".join(generate_help.split())


# -- a missing path is said to be missing -------------------------------------------------------------
@pytest.mark.parametrize("given", ["checkpoints/does-not-exist", "./does-not-exist", "/does/not/exist/model"])
def test_a_missing_local_path_says_it_does_not_exist(given, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError) as info:
        MiraMoEModel.from_pretrained(given, device="cpu")
    message = str(info.value)
    assert message.startswith(f"{given} does not exist: no such directory")
    assert "Repo id must be" not in message and ".." not in message.replace("../", "")


def test_a_model_given_to_from_pretrained_points_to_wrap(tiny_checkpoint):
    """from_pretrained reads a checkpoint; a model object (or anything but a path) is refused, naming what it got and,
    for a model, `wrap`, which serves a model already built."""
    from conftest import load_reference

    model = load_reference(tiny_checkpoint("mixtral"))
    with pytest.raises(ConfigError, match=r"given MixtralForCausalLM\. To serve a model already built, call MiraMoEModel\.wrap"):
        MiraMoEModel.from_pretrained(model, gpu_budget=0.25, device="cpu")
    with pytest.raises(ConfigError, match="a str or a path.*given int"):
        MiraMoEModel.from_pretrained(3, device="cpu")
    assert not hasattr(model, "mira")


def test_a_path_given_to_wrap_points_to_from_pretrained(tiny_checkpoint):
    """wrap serves a model already built; a checkpoint's path (or anything but a module) is refused, naming what it
    got and, for a path, `from_pretrained`."""
    path = tiny_checkpoint("mixtral")
    with pytest.raises(ConfigError, match=r"given str\. To load a checkpoint, call MiraMoEModel\.from_pretrained"):
        MiraMoEModel.wrap(path, gpu_budget=0.25, device="cpu")
    with pytest.raises(ConfigError, match=r"torch\.nn\.Module.*given NoneType\.$"):
        MiraMoEModel.wrap(None, gpu_budget=0.25, device="cpu")


# -- `mira --help` does not import torch or transformers ------------------------------------------------
def _modules_after(code: str) -> set[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    return set(out.split())


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["generate", "--help"], ["bench", "--help"], ["generate", "--prompt", "x", "--policy", "nonsense"]],
)
def test_help_and_argument_errors_import_neither_torch_nor_transformers(argv):
    code = (
        "import sys, contextlib, io\n"
        "from mira_hf import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        f"    rc = cli.main({argv!r})\n"
        "assert rc in (0, 2), rc\n"
        "print(' '.join(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))\n"
    )
    assert _modules_after(code) == set()


def test_python_m_mira_hf_cli_help_imports_neither():
    code = (
        "import runpy, sys, contextlib, io\n"
        "sys.argv = ['mira', '--help']\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        runpy.run_module('mira_hf.cli', run_name='__main__')\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0\n"
        "print(' '.join(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))\n"
    )
    assert _modules_after(code) == set()


def test_the_package_still_offers_its_api_lazily():
    import mira_hf

    assert mira_hf.MiraMoEModel is MiraMoEModel
    from mira_hf.calibrate import calibrate

    assert mira_hf.calibrate is calibrate  # the function, even after its module of the same name was imported


# -- hot and stage mean one thing: used since its copy, or copied ahead of its use ---------------------
def _generate(policy: str, predictor: str):
    from transformers import AutoTokenizer

    path = bundled_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = MiraMoEModel.from_pretrained(
        path, gpu_budget=0.25, device="cpu", policy=policy, predictor=predictor, dtype=torch.float32, progress=False
    )
    model.generate(**tok("def fibonacci(n):", return_tensors="pt"), max_new_tokens=16, do_sample=False)
    return model.mira


@pytest.mark.parametrize("policy", ["lru", "heat"])
def test_without_prediction_every_hit_is_a_reuse(policy):
    manager = _generate(policy, "none")
    s = manager.stats()
    assert s["hits"] > 0 and s["hot_hits"] == s["hits"] and s["stage_hits"] == 0


def test_stage_hits_are_the_prefetches_that_were_used():
    pytest.importorskip("pandas")
    manager = _generate("heat", "gate")
    s = manager.stats()
    assert s["stage_hits"] == s["prefetch_used"] and s["hot_hits"] + s["stage_hits"] == s["hits"]
    table = manager.heat_table()
    assert not (table["is_hot"] & (table["tier"] == "")).any()  # nothing is hot off the device
    assert (table["is_hot"] == (table["tier"] == "hot")).all()


# -- packaging -----------------------------------------------------------------------------------------
def test_adapters_have_an_unambiguous_import_name():
    import model_adapters
    from mira_hf import adapters

    assert adapters.register_adapter is model_adapters.register_adapter
    assert set(adapters.__all__) == set(model_adapters.__all__)
    assert all(getattr(adapters, name) is getattr(model_adapters, name) for name in adapters.__all__)


def test_the_sdist_leaves_the_tests_out():
    lines = (ROOT / "MANIFEST.in").read_text().splitlines()
    assert "prune tests" in lines


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (dict(offload_dir="some/dir"), r"offload_dir='some/dir' is where the experts beyond host_budget.*host_budget is not set"),
        (dict(host_share=0.4), r"host_share=0.4 is the share .* but host_compute='off': it would change nothing"),
        (dict(host_share=0.4, host_compute="on"), r"host_compute='on': it would change nothing"),
    ],
)
def test_a_setting_that_would_change_nothing_is_refused(fields, says):
    """Settings that only take effect beside another (offload_dir with host_budget, host_share with
    host_compute='split') are refused without it, saying which one to give, rather than silently ignored."""
    with pytest.raises(ConfigError, match=says):
        MiraConfig(**fields)
    assert MiraConfig(offload_dir="some/dir", host_budget="1GiB").offload_dir == "some/dir"
    assert MiraConfig(host_share=0.4, host_compute="split").host_share == 0.4


@pytest.mark.parametrize("predictor", ["gate", "markov", None])
def test_a_predictor_file_for_a_predictor_that_reads_none_is_refused(predictor):
    """predictor_path is the learned predictor's: with a predictor that reads no file it would change nothing."""
    with pytest.raises(
        ConfigError, match=r"predictor_path='some/dir' is a calibrated 'learned' predictor's.*would change nothing"
    ):
        MiraConfig(predictor=predictor, predictor_path="some/dir")
    assert MiraConfig(predictor="auto", predictor_path="some/dir").predictor_path == "some/dir"


@pytest.mark.parametrize(
    "fields",
    [
        dict(max_staged_per_layer=-1),
        dict(max_staged_per_layer=1.5),
        dict(position_window_tokens=0),
        dict(lookahead=1.5),
        dict(lookahead="2"),
        dict(stage_lookahead=0),
        dict(markov_recheck_tokens=0),
        dict(markov_warmup_tokens=-1),
        dict(hybrid_switch_tokens=-5),
        dict(min_precision=5),
        dict(precision_decay=1.0),
        dict(markov_cumulative=0),
        dict(confidence=float("nan")),
        dict(stage_probability="0.9"),
    ],
)
def test_predictor_settings_out_of_range_are_refused_when_built(fields):
    """Each would have loaded and then failed in every generate (or been ignored): refused when the config is built,
    naming the field and what it takes."""
    ((name, value),) = fields.items()
    with pytest.raises(ConfigError, match=rf"PredictorConfig\.{name}={re.escape(repr(value))}: must be"):
        PredictorConfig(**fields)


def test_a_stage_fraction_that_is_no_number_in_range_is_refused_when_built():
    for value in ("0.5", 1.0, -0.1, float("nan"), True):
        with pytest.raises(ConfigError, match=r"CacheConfig\.stage_fraction=.*must be a number in \[0, 1\)"):
            CacheConfig(stage_fraction=value)


def test_no_copies_ahead_are_staged_with_max_staged_per_layer_zero(tiny_checkpoint):
    """max_staged_per_layer=0 stages nothing ahead of the router (it had meant the default, 2 × top-k); outputs
    unchanged."""
    from conftest import load_reference

    path = tiny_checkpoint("mixtral")
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    outs = {}
    for cap in (None, 0):
        prediction = PredictorConfig(max_staged_per_layer=cap, pause_unprofitable=False, stage_probability=0, min_precision=0)
        cfg = MiraConfig(device="cpu", gpu_budget=0.3, predictor="gate", prediction=prediction)
        model = MiraMoEModel.from_pretrained(path, cfg, progress=False).eval()
        outs[cap] = (model.generate(ids, **kw), model.mira.stats()["prefetches"])
    assert outs[None][1] > 0 and outs[0][1] == 0
    assert torch.equal(outs[0][0], outs[None][0])
    assert torch.equal(outs[0][0], load_reference(path).generate(ids, **kw))


@pytest.mark.parametrize("policy", POLICIES)
def test_reset_stats_between_generates_changes_no_eviction(policy):
    """`reset_stats()` zeroes counters only: the policies keep their own clock of forward steps, so a model reset between
    two generates evicts as one that was not, and both give the unwrapped model's tokens."""
    import copy

    from tiny_models import build, make_config

    torch.manual_seed(0)
    ref = build(make_config("mixtral")).eval()
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, policy=policy, predictor=None)
    models = [MiraMoEModel.wrap(copy.deepcopy(ref), cfg) for _ in range(2)]
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    for ids in (torch.tensor([[5, 9, 14, 33]]), torch.tensor([[5, 9, 14, 33]]), torch.tensor([[7, 21, 4, 8, 11]])):
        expected = ref.generate(ids, **kw)
        for model in models:
            assert torch.equal(model.generate(ids, **kw), expected)
        models[0].mira.reset_stats()
    assert sorted(models[0].mira.cache.resident()) == sorted(models[1].mira.cache.resident())
    assert models[1].mira.stats()["evictions"] > 0  # the second prompt evicted (counted where nothing was reset)


def test_after_reset_stats_prefetches_used_or_wasted_are_never_more_than_prefetches():
    """Experts copied ahead of need before `reset_stats()` and used or evicted after it are counted as prefetches of
    the new window, so `prefetch_used + prefetch_wasted` never exceeds `prefetches` (and a stage hit is a prefetch
    used)."""
    from tiny_models import build, make_config

    config = make_config("mixtral")
    config.num_hidden_layers = 3  # a layer two ahead of the first, which markov stages for
    torch.manual_seed(0)
    prediction = PredictorConfig(stage_probability=0.3, min_precision=0.0, markov_warmup_tokens=8)
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, policy="lru", predictor="markov", prediction=prediction)
    model = MiraMoEModel.wrap(build(config).eval(), cfg)
    g = torch.Generator().manual_seed(2)
    carried = 0
    for _ in range(6):
        ids = torch.randint(3, 128, (1, 6), generator=g)
        model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        s = model.mira.stats()
        assert s["prefetch_used"] + s["prefetch_wasted"] <= s["prefetches"] and s["stage_hits"] == s["prefetch_used"]
        model.mira.reset_stats()
        carried += model.mira.stats()["prefetches"]  # unused copies carried into the new window
    assert carried > 0  # the case looked at arose
