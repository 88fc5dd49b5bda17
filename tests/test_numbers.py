"""`scripts/check_numbers.py`: figures in the docs equal the result files they cite."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_numbers", ROOT / "scripts" / "check_numbers.py")
check_numbers = sys.modules["check_numbers"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_numbers)

RESULT = {
    "speedup": 1.4962,
    "decode": {"seconds": 233.64, "tokens": 12345, "share": 0.9512},
    "rows": [{"tok_s": 0.8341}, {"tok_s": 3.0}, {"tok_s": -1.23e-7}],
    "by_budget": {"0.25": {"hit_rate": 0.6666}},
    "label": "fast",
    "ok": True,
}


@pytest.fixture
def results(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps(RESULT))
    return tmp_path


def check(results, tmp_path, text):
    doc = tmp_path / "doc.md"
    doc.write_text(text)
    return check_numbers.check_file(doc, results)


@pytest.mark.parametrize(
    "line",
    [
        "Decode is 1.50× faster <!-- src: run.json:speedup -->",
        "about 1.5x <!-- src: run.json:speedup -->",
        "| mixtral | 233.6 s <!-- src: run.json:decode.seconds --> | 12,345 <!-- src: run.json:decode.tokens --> |",
        "12345 tokens <!-- src:run.json:decode.tokens-->",
        "0.83x <!-- src: run.json:rows.0.tok_s -->",
        "95 % of the time <!-- src: run.json:decode.share -->",  # a fraction, shown in percent
        "95.1% <!-- src: run.json:decode.share -->",
        "3 tok/s <!-- src: run.json:rows.1.tok_s -->",
        "-1.2e-7 <!-- src: run.json:rows.2.tok_s -->",
        "−1.2e-7 <!-- src: run.json:rows.-1.tok_s -->",  # a Unicode minus; a negative index
        "hit rate 0.667 at a quarter of the budget <!-- src: run.json:by_budget.0.25.hit_rate -->",
        "on the H200, 1.496× <!-- src: run.json:speedup -->",  # H200 is a name, not the figure
    ],
)
def test_figures_equal_to_their_source_pass(results, tmp_path, line):
    n, errors = check(results, tmp_path, f"# Title\n\n{line}\n")
    assert errors == [] and n == line.count("<!--")


@pytest.mark.parametrize(
    "line, message",
    [
        ("Decode is 1.51× faster <!-- src: run.json:speedup -->", "the doc says '1.51' but run.json:speedup holds 1.4962"),
        ("1.4× <!-- src: run.json:speedup -->", "the doc says '1.4'"),  # 1.4962 rounds to 1.5
        ("12,346 <!-- src: run.json:decode.tokens -->", "holds 12345"),
        ("96 % <!-- src: run.json:decode.share -->", "holds 0.9512"),
        ("-1.3e-7 <!-- src: run.json:rows.2.tok_s -->", "holds -1.23e-07"),
        ("1.23e-7 <!-- src: run.json:rows.2.tok_s -->", "the doc says '1.23e-7'"),  # the sign counts
        ("233.6 s <!-- src: run.json:decode.second -->", "no key 'second' (keys: seconds, tokens, share)"),
        ("0.8 <!-- src: run.json:rows.3.tok_s -->", "'3' is not an index of a list of 3"),
        ("1.5 <!-- src: other.json:speedup -->", "cites other.json, which is not in"),
        ("fast <!-- src: run.json:label -->", "no number before the citation of run.json:label"),
        ("1 <!-- src: run.json:ok -->", "which holds True, not a number"),
        ("1 <!-- src: run.json:decode -->", "which holds {"),
    ],
)
def test_a_wrong_or_broken_citation_fails_with_file_line_figure_and_value(results, tmp_path, line, message):
    n, errors = check(results, tmp_path, f"# Title\n\n{line}\n")
    assert n == 1 and len(errors) == 1
    assert errors[0].startswith(f"{tmp_path / 'doc.md'}:3: ") and message in errors[0], errors[0]


def test_each_citation_takes_the_number_nearest_before_it(results, tmp_path):
    line = "from 3 to 1.5× <!-- src: run.json:speedup -->, then 233.6 s <!-- src: run.json:decode.seconds -->\n"
    assert check(results, tmp_path, line) == (2, [])
    # the first citation takes 1.5, not 3; the second takes 3, not the 1.5 before the first comment
    n, errors = check(results, tmp_path, "1.5× <!-- src: run.json:speedup --> 3 <!-- src: run.json:decode.seconds -->\n")
    assert n == 2 and len(errors) == 1 and "'3'" in errors[0]


def test_the_command_line_exits_nonzero_on_a_wrong_figure(results, tmp_path, capsys):
    good, bad = tmp_path / "good.md", tmp_path / "bad.md"
    good.write_text("1.50× <!-- src: run.json:speedup -->\n")
    bad.write_text("ok\n2.0× <!-- src: run.json:speedup -->\n")
    assert check_numbers.main([str(good), "--results", str(results)]) == 0
    assert check_numbers.main([str(good), str(bad), "--results", str(results)]) == 1
    out = capsys.readouterr().out
    assert f"{bad}:2: the doc says '2.0'" in out and "2 cited figures checked, 1 wrong" in out


def test_the_docs_quote_their_result_files_correctly():
    docs = check_numbers.default_docs()
    assert ROOT / "README.md" in docs and ROOT / "benchmarks" / "NOTES.md" in docs
    errors = [e for doc in docs for e in check_numbers.check_file(doc)[1]]
    assert errors == []
