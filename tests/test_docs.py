"""The reference pages stay true to the code: docs/configuration.md documents every field of MiraConfig and of
each nested config dataclass, and is exactly what docs/make_configuration.py generates from them."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from mira_hf.config import MiraConfig

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("make_configuration", ROOT / "docs" / "make_configuration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config_classes() -> list[type]:
    nested = [f.default_factory for f in dataclasses.fields(MiraConfig) if dataclasses.is_dataclass(f.default_factory)]
    return [MiraConfig, *nested]


@pytest.mark.parametrize("cls", _config_classes(), ids=lambda c: c.__name__)
def test_every_config_field_is_documented(cls):
    text = PAGE.read_text(encoding="utf-8")
    section = text.split(f"## {cls.__name__}", 1)[1].split("\n## ", 1)[0]
    for f in dataclasses.fields(cls):
        row = next((line for line in section.splitlines() if line.startswith(f"| `{f.name}` |")), None)
        assert row is not None, f"{cls.__name__}.{f.name} is not in docs/configuration.md"
        assert row.rstrip(" |").split(" | ")[-1].strip(), f"{cls.__name__}.{f.name} has an empty description"


def test_the_nested_configs_are_all_there():
    assert {c.__name__ for c in _config_classes()} >= {
        "MiraConfig",
        "CacheConfig",
        "LoaderConfig",
        "HeatConfig",
        "PriorityConfig",
        "PredictorConfig",
        "QuantConfig",
    }


def test_the_committed_page_is_the_generated_one(generator):
    assert PAGE.read_text(encoding="utf-8") == generator.render(), "run: python docs/make_configuration.py"


def test_a_field_without_a_comment_is_refused(generator):
    @dataclasses.dataclass(frozen=True)
    class Bare:
        """No entries."""

        documented: int = 1  # it says what it is
        silent: int = 2

    with pytest.raises(SystemExit, match="silent"):
        generator.field_docs(Bare)


def test_the_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = [line for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines() if line.startswith("python")]
    assert ci[:-1] == ["python3 -m pip install -q torch==2.13.0"], "before the README's line, CI only installs torch's CPU build"
    assert f"```bash\n{ci[-1]}\n```" in readme


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation other than '-' and '_' dropped, spaces as '-'."""
    import re

    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    import re

    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no headings
    return {_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_every_link_to_a_section_of_the_docs_finds_it():
    """Links of the README and docs to a page's section (`#anchor`, `page.md#anchor`) name a heading there."""
    import re

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)\s#]*\.md)?#([^)\s]+)\)", page.read_text()):
            linked = (page.parent / target).resolve() if target else page
            if linked.exists() and anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken


def test_the_readmes_sample_run_is_what_mira_generate_prints():
    """The README's `mira generate` output, but for its timings (tokens, tokens/s, stall), is what the command
    prints on the CPU: the bundled model's greedy tokens, and so its routing and the cache's counts, are fixed."""
    import contextlib
    import io
    import re

    from mira_hf import cli

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    prompt = re.search(r'mira generate --prompt "([^"]+)"', readme).group(1)
    sample = readme[readme.index("```\nmodel            mira-tiny") :].split("\n[... then one row per MoE layer ...]")[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(["generate", "--prompt", prompt, "--device", "cpu"]) == 0
    printed = out.getvalue()
    timed = ("tokens ", "tokens/s ", "stall ")
    lines = [line for line in sample.splitlines()[1:] if not line.startswith(timed)]
    assert lines and all(f"\n{line}\n" in printed for line in lines), [line for line in lines if f"\n{line}\n" not in printed]
