"""What the notebook and the CLI show: the heat table agrees with the manager's counters, figures are plain
matplotlib Figures, text summaries read saved files, and optional dependencies fail with the pip command."""

import io
import json
import re
import sys

import pytest
import torch

from mira_hf import ConfigError, IncompatibleFileError, MiraConfig, MiraMoEModel, MissingDependencyError, report

STEPS = 6


@pytest.fixture(scope="module")
def manager(tiny_checkpoint):
    """A tiny Mixtral (8 experts per layer, top-2) wrapped with half its experts cached, after a few forward steps."""
    model = MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), MiraConfig(gpu_budget=0.5, device="cpu"), progress=False)
    torch.manual_seed(0)
    with torch.no_grad():
        for _ in range(STEPS):
            model(torch.randint(3, 128, (1, 5)))
    return model.mira


def test_heat_table_agrees_with_the_manager(manager, tmp_path):
    pd = pytest.importorskip("pandas")
    table = manager.heat_table()
    assert tuple(table.columns) == report.HEAT_TABLE_COLUMNS
    counts, scores = manager.expert_counts(), manager.heat_scores()
    assert len(table) == sum(len(c) for c in counts.values())
    for layer, rows in table.groupby("layer"):
        assert rows["expert"].tolist() == list(range(len(counts[layer])))
        assert rows["count"].tolist() == counts[layer]
        assert rows["score"].tolist() == pytest.approx(scores[layer])
        assert rows["share"].sum() == pytest.approx(1.0)
        assert (rows["is_hot"] == (rows["tier"] == "hot")).all()  # one meaning: never hot off the device
        assert rows["tier"].tolist() == [manager.tier_of(layer, e) or "" for e in rows["expert"]]
    assert set(table["tier"]) <= {"hot", "stage", ""} and (table["tier"] != "").any()
    table.to_csv(tmp_path / "heat.csv", index=False)
    assert pd.read_csv(tmp_path / "heat.csv").shape == table.shape


@pytest.mark.parametrize("value", ["score", "count"])
def test_heatmap_is_a_plain_figure(manager, value):
    pytest.importorskip("matplotlib")
    fig = manager.plot_heatmap(value=value)
    assert type(fig).__name__ == "Figure" and fig.canvas.manager is None  # no pyplot state behind it
    fig.savefig(io.BytesIO(), format="png")


def test_heatmap_rejects_an_unknown_value(manager):
    with pytest.raises(ConfigError, match="score"):
        report.plot_heatmap(manager, value="temperature")


def test_hit_rate_plot_has_one_point_per_step(manager):
    pytest.importorskip("matplotlib")
    fig = manager.plot_hit_rate()
    line = fig.axes[0].lines[0]
    assert len(line.get_xdata()) == len(manager.hit_rate_history()) >= STEPS - 1
    fig.savefig(io.BytesIO(), format="png")


def test_stats_table_reads_live_and_json_stats_alike(manager):
    stats = manager.stats()
    text = report.stats_table(stats)
    assert "hit rate" in text and "bytes moved" in text
    assert len([line for line in text.splitlines() if line.strip().startswith(("0 ", "1 "))]) == 2  # one row per layer
    assert report.stats_table(json.loads(json.dumps(stats))) == text  # layer keys become strings in JSON


def test_summarize_file_reads_stats_and_traces(manager, tmp_path):
    stats_file = tmp_path / "stats.json"
    stats_file.write_text(json.dumps(manager.stats()))
    assert "hit rate" in report.summarize_file(stats_file)
    trace_file = tmp_path / "trace.json"
    trace_file.write_text(json.dumps({"steps": 10, "layers": [[5, 0, 3, 12], {"counts": [1, 1, 1, 17]}]}))
    text = report.summarize_file(trace_file)
    assert re.search(r"^steps\s+10$", text, re.M) and "top-25% share" in text and "85.0%" in text  # top 1 of 4: 17/20


@pytest.mark.parametrize("content", ["not json", json.dumps([1, 2]), json.dumps({"weights": 1})])
def test_summarize_file_names_the_formats_it_reads(tmp_path, content):
    path = tmp_path / "x.json"
    path.write_text(content)
    with pytest.raises(IncompatibleFileError, match="expected"):
        report.summarize_file(path)
    with pytest.raises(FileNotFoundError):
        report.summarize_file(tmp_path / "missing.json")


@pytest.mark.parametrize("module, call", [("pandas", "heat_table"), ("matplotlib.figure", "plot_heatmap")])
def test_missing_notebook_extra_names_the_pip_command(manager, monkeypatch, module, call):
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail as if not installed
    with pytest.raises(MissingDependencyError, match=r'pip install "mira-hf\[notebook\]"'):
        getattr(report, call)(manager)


def test_prometheus_collector_exports_the_counters(manager):
    prometheus_client = pytest.importorskip("prometheus_client")
    from mira_hf.prometheus import register

    registry = prometheus_client.CollectorRegistry()
    collector = register(manager, registry=registry, model_name="tiny")
    collector.record_tokens(10, 0.5)
    stats = manager.stats()
    value = lambda name, **labels: registry.get_sample_value(name, {"model": "tiny", **labels})  # noqa: E731
    assert value("mira_hit_rate") == pytest.approx(stats["hit_rate"])
    assert value("mira_expert_misses_total") == stats["misses"]
    assert value("mira_expert_hits_total", tier="hot") + value("mira_expert_hits_total", tier="stage") == stats["hits"]
    assert value("mira_h2d_bytes_total") == stats["bytes_h2d"]
    assert value("mira_tokens_per_second") == pytest.approx(20.0)
    assert value("mira_layer_hit_rate", layer="0") == pytest.approx(stats["per_layer"][0]["hit_rate"])
    assert value("mira_experts_kept_packed") == stats["kept_packed_experts"] == 0
    assert b"mira_stall_seconds_total" in prometheus_client.generate_latest(registry)


def test_several_models_share_a_registry_one_family_per_metric(manager, tiny_checkpoint):
    """Two models on one registry: one family (one HELP and TYPE line) per metric, each model's samples told apart by
    its `model` label, as the text format wants; a second model without a distinct name is refused, saying so."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from mira_hf.prometheus import register

    other = MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), MiraConfig(gpu_budget=1.0, device="cpu"), progress=False)
    registry = prometheus_client.CollectorRegistry()
    register(manager, registry=registry, model_name="a")
    register(other.mira, registry=registry, model_name="b").record_tokens(6, 2.0)
    for name in ("a", None):
        with pytest.raises(ConfigError, match="distinct model_name"):
            register(other.mira, registry=registry, model_name=name)
    text = prometheus_client.generate_latest(registry).decode()
    assert text.count("# TYPE mira_expert_misses_total counter") == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    misses = {s.labels["model"]: s.value for s in families["mira_expert_misses"].samples}
    assert misses == {"a": manager.stats()["misses"], "b": other.mira.stats()["misses"]}
    assert registry.get_sample_value("mira_tokens_generated_total", {"model": "b"}) == 6


def test_track_generate_counts_new_tokens_of_an_encoder_decoder_and_of_inputs(manager):
    """`track_generate` records the tokens generate added: after the prompt given as `input_ids`, positionally or as
    `inputs`; an encoder-decoder's output is its decoder's start token and the new tokens."""
    pytest.importorskip("prometheus_client")
    from mira_hf.prometheus import MiraCollector

    class Generator:
        def __init__(self, encoder_decoder: bool) -> None:
            self.config = type("Config", (), {"is_encoder_decoder": encoder_decoder})()

        def generate(self, *args, **kwargs):
            prompt = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
            start = prompt[:, :1] if self.config.is_encoder_decoder else prompt
            return torch.cat([start, torch.zeros(prompt.shape[0], 5, dtype=torch.long)], dim=1)

    prompt = torch.ones(2, 7, dtype=torch.long)
    for model, call in [
        (Generator(False), dict(inputs=prompt)),
        (Generator(False), dict(input_ids=prompt)),
        (Generator(True), {}),
    ]:
        collector = MiraCollector(manager)
        collector.track_generate(model, **call) if call else collector.track_generate(model, prompt)
        assert collector._tokens == 2 * 5


def test_prometheus_missing_names_the_pip_command(manager, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    from mira_hf.prometheus import MiraCollector

    with pytest.raises(MissingDependencyError, match=r'pip install "mira-hf\[prometheus\]"'):
        MiraCollector(manager)


def test_stats_table_says_when_the_payoff_gate_paused_prediction(manager):
    stats = dict(manager.stats(), predictor_precision=0.8, predictor_recall=0.7)
    assert "paused" not in report.stats_table(dict(stats, prediction_paused_steps=0))
    text = report.stats_table(dict(stats, prediction_paused_steps=40, prediction_active=False))
    assert "precision 80.0%, recall 70.0%; paused 40 steps" in text and "paused now" in text


def test_counters_survive_a_rebuild_of_the_cache(tiny_checkpoint):
    """A cast, a load_state_dict or an in-place expert edit rebuilds the cache (a new loader among it): the stall
    seconds and copy latencies so far stay, as every other counter does (Prometheus reads a drop as a reset)."""
    model = MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), MiraConfig(gpu_budget=0.3, device="cpu"), progress=False)
    ids = torch.tensor([[5, 9, 14, 33, 60]])
    with torch.no_grad():
        model(ids)
        before = model.mira.stats()
        model.model.layers[0].mlp.experts.down_proj.mul_(1.0)  # an edit: the next forward rebuilds the cache
        model(ids[:, :1])
    after = model.mira.stats()
    assert before["stall_s"] > 0 and after["stall_s"] >= before["stall_s"] and after["loads"] > before["loads"]
    assert all(after["per_layer"][k]["stall_s"] >= v["stall_s"] for k, v in before["per_layer"].items())
    assert after["load_latency_p50_s"] is not None


def test_experts_are_named_by_any_kind_of_integer(manager):
    """A heat table's rows give numpy integers, a router's picks torch ones: `tier_of` and `set_host_only` take them
    as they take ints; a bare number where a list is expected is the usual ConfigError."""
    import numpy as np

    assert manager.tier_of(np.int64(0), np.int64(1)) == manager.tier_of(0, 1)
    assert manager.tier_of(torch.tensor(0), torch.tensor(1)) == manager.tier_of(0, 1)
    manager.set_host_only({np.int64(0): torch.tensor([1, 2])})
    assert manager.host_only == {(0, 1), (0, 2)} and all(type(e) is int for key in manager.host_only for e in key)
    manager.set_host_only({})
    with pytest.raises(ConfigError, match="set_host_only: layer 0 experts 3 do not exist"):
        manager.set_host_only({0: 3})


def test_stats_after_unload_hold_no_device_memory():
    """`unload()` gives the device arena back: a manager kept past it reports no slot and nothing resident."""
    from mira_hf import MiraConfig, MiraMoEModel
    from mira_hf.testing import build, tiny_config

    model = MiraMoEModel.wrap(build(tiny_config("mixtral")).eval(), MiraConfig(device="cpu", gpu_budget=0.5))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    manager = model.mira
    before = manager.stats()
    assert before["resident_bytes"] > 0 and before["slots"] > 0
    model.unload()
    after = manager.stats()
    assert (after["resident_bytes"], after["capacity_bytes"], after["slots"]) == (0, 0, 0)
    assert after["hits"] + after["misses"] == before["hits"] + before["misses"]  # the counts of what ran stay
    experts = manager.layers[0].num_experts
    assert [manager.tier_of(0, e) for e in range(experts)] == [None] * experts
    pd = pytest.importorskip("pandas")
    assert isinstance(manager.heat_table(), pd.DataFrame) and set(manager.heat_table()["tier"]) == {""}


def test_an_unloaded_or_dropped_model_leaves_its_registry_and_is_not_kept_alive_by_it(tiny_checkpoint):
    """A model unloaded leaves the registry (its name is free again for the model loaded next), and a registry
    holds no model alive: a dropped model's manager is freed and its samples go."""
    import gc
    import weakref

    prometheus_client = pytest.importorskip("prometheus_client")
    from mira_hf.prometheus import register

    registry = prometheus_client.CollectorRegistry()

    def load():
        return MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), MiraConfig(gpu_budget=0.5, device="cpu"), progress=False)

    first = load()
    register(first.mira, registry=registry, model_name="m")
    with torch.no_grad():
        first(torch.tensor([[1, 2, 3]]))
    assert registry.get_sample_value("mira_expert_misses_total", {"model": "m"}) == first.mira.stats()["misses"] > 0
    first.unload()
    assert registry.get_sample_value("mira_expert_misses_total", {"model": "m"}) is None
    second = load()
    register(second.mira, registry=registry, model_name="m")  # the name is free again
    assert registry.get_sample_value("mira_expert_misses_total", {"model": "m"}) == 0
    manager = weakref.ref(second.mira)
    del second
    gc.collect()
    assert manager() is None
    assert registry.get_sample_value("mira_expert_misses_total", {"model": "m"}) is None
