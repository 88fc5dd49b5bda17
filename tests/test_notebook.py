"""notebooks/quickstart.ipynb runs top to bottom on the CPU (the README links it; it must not rot)."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"


def test_committed_notebook_is_executed_and_uses_the_defaults():
    """Committed with its outputs (readable on GitHub without running it): every code cell ran, in order, without
    an error, the plots are there, and it builds models with mira-hf's defaults but for the budget it explains."""
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and [c.execution_count for c in code] == list(range(1, len(code) + 1))
    outputs = [o for c in code for o in c.outputs]
    assert all(c.outputs for c in code) and not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2
    source = "\n".join(c.source for c in code)
    assert "MiraConfig(" not in source and "gpu_budget=0.25" in source
    assert "gpu_budget=0.25" in nb.cells[0].source and "nbconvert --to notebook --execute" in nb.cells[0].source


def test_quickstart_notebook_runs(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("pandas")
    pytest.importorskip("matplotlib")
    # The kernel is a subprocess: it finds this checkout of mira_hf through PYTHONPATH, and uses the CPU.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2  # the heat map and the hit-rate plot
    tables = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    assert any("lru" in t and "default" in t and "hit rate" in t for t in tables)  # the comparison of systems
