"""benchmarks/ab_revisions.py, the interleaved A/B of two revisions of the package: its summary on known
measurements, its refusal of a folder that holds no revision, and a --smoke run of two trees (slow)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ab_revisions as ab  # noqa: E402


def measurement(tok_s: float, tokens: list, hit: float = 0.5, repeat: bool = True) -> dict:
    return dict(wrap_s=1.0, b1=dict(tok_s=tok_s, hit_rate=hit, stall_share=0.1, tokens=tokens, tokens_repeat=repeat))


def pair(old: dict, new: dict, same_logits: bool = True, diff: float = 0.0) -> dict:
    agree = dict(same_tokens_b1=old["b1"]["tokens"] == new["b1"]["tokens"], same_logits=same_logits)
    return dict(old=old, new=new, agreement=dict(agree, max_abs_logit_diff=diff))


def test_summary_gives_medians_per_revision_and_the_new_over_old_ratio_of_each_pair():
    pairs = [
        pair(measurement(10.0, [[5, 6]]), measurement(11.0, [[5, 6]])),
        pair(measurement(20.0, [[5, 6]]), measurement(18.0, [[5, 6]])),
        pair(measurement(12.0, [[5, 6]]), measurement(12.0, [[5, 6]])),
    ]
    s = ab.summarize(pairs, ["b1"])
    assert s["old"]["b1"]["tok_s"] == 12.0 and s["new"]["b1"]["tok_s"] == 12.0
    assert s["ratio_b1"]["each"] == pytest.approx([1.1, 0.9, 1.0])  # per pair, not a ratio of medians
    assert (s["ratio_b1"]["median"], s["ratio_b1"]["min"], s["ratio_b1"]["max"]) == pytest.approx((1.0, 0.9, 1.1))
    assert s["agree"] == dict(same_tokens_b1=True, same_logits=True, max_abs_logit_diff=0.0)
    assert s["repeatable"] == dict(old=True, new=True)


def test_summary_reports_a_pair_that_disagrees_and_a_revision_that_is_not_repeatable():
    pairs = [
        pair(measurement(10.0, [[5, 6]]), measurement(10.0, [[5, 6]])),
        pair(measurement(10.0, [[5, 6]]), measurement(10.0, [[5, 7]]), same_logits=False, diff=0.25),
    ]
    s = ab.summarize(pairs, ["b1"])
    assert s["agree"] == dict(same_tokens_b1=False, same_logits=False, max_abs_logit_diff=0.25)
    assert s["repeatable"] == dict(old=True, new=False)  # the new revision decoded differently in two processes


def test_a_folder_without_a_revision_is_refused_with_how_to_make_one(tmp_path):
    (tmp_path / "mira_hf").mkdir()
    (tmp_path / "mira_hf" / "__init__.py").write_text("")
    with pytest.raises(SystemExit, match=r"no model_adapters/__init__\.py there.*git archive REV mira_hf model_adapters"):
        ab.check_tree(str(tmp_path), "--old")
    assert ab.check_tree(str(ROOT), "--new") == str(ROOT)


@pytest.mark.slow  # four fresh processes: ~1-2 min on a 2-core CPU
def test_smoke_alternates_two_trees_each_imported_by_its_own_processes(tmp_path):
    old = tmp_path / "old"
    for part in ("mira_hf", "model_adapters"):
        shutil.copytree(ROOT / part, old / part, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "ab_revisions.py"), "--old", str(old), "--model", "bundled"]
    proc = subprocess.run(cmd + ["--smoke", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert [p["first"] for p in result["runs"]] == ["old", "new"]
    for p in result["runs"]:
        assert p["old"]["mira_hf_file"].startswith(str(old.resolve()))
        assert p["new"]["mira_hf_file"].startswith(str(ROOT / "mira_hf"))
    s = result["summary"]
    assert s["agree"] == dict(same_tokens_b1=True, same_tokens_b8=True, same_logits=True, max_abs_logit_diff=0.0)
    assert s["old"]["b1"]["tok_s"] > 0 and s["new"]["b8"]["tok_s"] > 0 and s["ratio_b1"]["median"] > 0
