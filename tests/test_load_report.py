"""The load report: where a from_pretrained's time went, stage by stage, with the bytes each moved."""

import pytest
import torch

from mira_hf import MiraConfig, MiraMoEModel
from mira_hf.config import LoaderConfig
from mira_hf.load_report import STAGES, LoadReport


def _expert_bytes(model) -> int:
    store = model.mira.store
    return sum(t.numel() * t.dtype.itemsize for layer in store.layers for t in store.fused(layer).values())


@pytest.mark.parametrize("quantization", [None, "lossless"])
def test_streamed_load_reports_each_stage_with_the_bytes_it_moved(tiny_checkpoint, tmp_path, quantization):
    path = tiny_checkpoint("mixtral")
    loader = LoaderConfig(stream_experts=True, record_cache=str(tmp_path / "records"))
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, quantization=quantization, loader=loader)
    model = MiraMoEModel.from_pretrained(path, cfg, progress=False)
    if model.mira.record_cache is not None:
        model.mira.record_cache.wait()
    report = model.mira_load_report().as_dict()
    stages, raw = report["stages"], _expert_bytes(model)
    assert report["wall_s"] > 0 and set(stages) <= set(STAGES)
    assert stages["model"]["seconds"] > 0
    assert stages["read"]["bytes"] == raw * (2 if quantization else 1)  # lossless on a CPU: plan pass, then encode pass
    assert "pin" not in stages  # pageable slabs on a CPU: nothing to page-lock
    if quantization is None:
        assert stages["copy"]["bytes"] == raw and "encode" not in stages
    else:
        assert stages["plan"]["bytes"] == stages["encode"]["bytes"] == raw
        assert stages["cache_write"]["bytes"] == model.mira.store.nbytes
    assert all(v["seconds"] >= 0 for v in stages.values())
    assert "read" in str(model.mira_load_report()) and "mira_load_report" not in vars(model.unload())


def test_cached_load_reports_the_cache_read_and_no_encoding(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("mixtral")
    loader = LoaderConfig(stream_experts=True, record_cache=str(tmp_path / "records"))
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, quantization="lossless", loader=loader)
    MiraMoEModel.from_pretrained(path, cfg, progress=False).mira.record_cache.wait()
    model = MiraMoEModel.from_pretrained(path, cfg, progress=False)
    stages = model.mira_load_report().as_dict()["stages"]
    assert stages["cache_read"]["bytes"] == model.mira.store.nbytes
    assert not {"read", "plan", "encode", "cache_write"} & set(stages)


def test_unknown_stage_is_refused():
    with pytest.raises(KeyError, match="unknown load stage 'reading'"):
        LoadReport().add("reading", 1.0)


def test_wrapped_model_reports_its_copy(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("mixtral"), dtype=torch.float32)
    model = MiraMoEModel.wrap(model, MiraConfig(device="cpu", gpu_budget=0.5))
    stages = model.mira_load_report().as_dict()["stages"]
    assert stages["copy"]["bytes"] == _expert_bytes(model) and "read" not in stages


def test_the_wall_time_counts_from_the_call(tiny_checkpoint, monkeypatch):
    """The report's wall time is the whole from_pretrained call's, reading config.json (and what it imports) included."""
    import time

    import mira_hf.model

    raw_config = mira_hf.model._raw_config
    monkeypatch.setattr(mira_hf.model, "_raw_config", lambda *a: time.sleep(0.5) or raw_config(*a))  # a slow disk
    model = MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), MiraConfig(device="cpu"), progress=False)
    assert model.mira_load_report().wall_s >= 0.5
