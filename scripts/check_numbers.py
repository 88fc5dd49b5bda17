#!/usr/bin/env python3
"""Check that numbers quoted in the docs equal the result files they cite.

A figure is cited by an HTML comment after it on the same line:

    Decode runs 1.50× faster <!-- src: 2026-11-30-nvidia-h200-mixtral-25.json:speedup.decode -->

FILE is relative to `benchmarks/results/`; the dotted path indexes JSON objects by key and lists by
position (`rows.3.tok_s`; a key that itself holds dots, such as `"0.25"`, is matched whole). The figure
is the nearest number before the comment (after any earlier comment on the line): `1.50×`, `233.6 s`,
`12,345`, `0.83x`, `95 %`, `-1.2e-7`, `−3` all read as numbers; a number glued to letters (`H200`,
`x86`) does not. It must equal the JSON value rounded to the digits shown: `1.50` matches 1.495 to
1.505, `12,345` matches 12344.5 to 12345.5, `-1.2e-7` matches -1.25e-7 to -1.15e-7. A figure with `%`
matches a value in percent or a fraction (0.95 for `95 %`).

Usage: python scripts/check_numbers.py [FILE.md ...]   (default: README.md, docs/*.md, benchmarks/NOTES.md)
Exit status 1, with one `file:line` message per mismatch, when any citation fails.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_DOCS = ("README.md", "docs/*.md", "benchmarks/NOTES.md")

CITATION = re.compile(r"<!--\s*src:\s*(?P<file>[^\s:]+\.json):(?P<path>\S+?)\s*-->")
# A number not glued to a preceding letter, digit, dot or underscore: 12,345 / 1.50 / -1.2e-7 / −3
NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>[-−+]?)(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?P<frac>\.\d+)?(?:[eE](?P<exp>[-−+]?\d+))?(?![\w.]*\d)"
    r"(?P<unit>\s?%)?"
)


@dataclass(frozen=True)
class Figure:
    """A number as written: its value, and the half-width of the interval its last digit stands for."""

    text: str
    value: float
    half_unit: float
    percent: bool

    def matches(self, value: float) -> bool:
        candidates = [value, value * 100] if self.percent else [value]
        # the last digit's half unit, and a little slack for the binary representation of both numbers
        slack = self.half_unit * (1 + 1e-9) + 1e-12 * abs(self.value)
        return any(abs(v - self.value) <= slack for v in candidates)


def last_figure(text: str) -> Figure | None:
    """The last number written in `text`, or None."""
    found = list(NUMBER.finditer(text))
    if not found:
        return None
    m = found[-1]
    sign = -1.0 if m["sign"] in ("-", "−") else 1.0
    digits = m["int"].replace(",", "") + (m["frac"] or "")
    decimals = len(m["frac"]) - 1 if m["frac"] else 0
    exp = int(m["exp"].replace("−", "-")) if m["exp"] else 0
    value = sign * float(digits) * 10.0**exp
    return Figure(m.group(0).strip(), value, 0.5 * 10.0 ** (exp - decimals), bool(m["unit"]))


def lookup(data, dotted: str):
    """`data` indexed by a dotted path; a key holding dots is matched whole (the longest key first)."""
    parts = dotted.split(".")
    i = 0
    while i < len(parts):
        if isinstance(data, list):
            try:
                data = data[int(parts[i])]
            except (ValueError, IndexError):
                raise KeyError(f"{parts[i]!r} is not an index of a list of {len(data)}") from None
            i += 1
        elif isinstance(data, dict):
            for j in range(len(parts), i, -1):
                key = ".".join(parts[i:j])
                if key in data:
                    data, i = data[key], j
                    break
            else:
                keys = ", ".join(list(data)[:12])
                raise KeyError(f"no key {parts[i]!r} (keys: {keys}{', ...' if len(data) > 12 else ''})")
        else:
            raise KeyError(f"{'.'.join(parts[:i])} is a {type(data).__name__}, not an object or list")
    return data


def check_file(doc: Path, results: Path = RESULTS) -> tuple[int, list[str]]:
    """(citations checked, error messages) for one Markdown file."""
    errors: list[str] = []
    checked = 0
    cache: dict[Path, object] = {}
    for lineno, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        start = 0
        for m in CITATION.finditer(line):
            where, src = f"{doc}:{lineno}", f"{m['file']}:{m['path']}"
            figure = last_figure(line[start : m.start()])
            start = m.end()
            checked += 1
            if figure is None:
                errors.append(f"{where}: no number before the citation of {src}")
                continue
            path = results / m["file"]
            try:
                if path not in cache:
                    cache[path] = json.loads(path.read_text(encoding="utf-8"))
                value = lookup(cache[path], m["path"])
            except FileNotFoundError:
                errors.append(f"{where}: {figure.text!r} cites {m['file']}, which is not in {results}")
                continue
            except (KeyError, json.JSONDecodeError) as exc:
                errors.append(f"{where}: {figure.text!r} cites {src}: {exc}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                errors.append(f"{where}: {figure.text!r} cites {src}, which holds {value!r}, not a number")
            elif not figure.matches(value):
                errors.append(f"{where}: the doc says {figure.text!r} but {src} holds {value!r}")
    return checked, errors


def default_docs(root: Path = ROOT) -> list[Path]:
    return sorted({p for pattern in DEFAULT_DOCS for p in root.glob(pattern)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("docs", nargs="*", type=Path, help="Markdown files (default: README.md, docs/*.md, benchmarks/NOTES.md)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="directory the citations are relative to")
    args = parser.parse_args(argv)
    total, errors = 0, []
    for doc in args.docs or default_docs():
        n, errs = check_file(doc, args.results)
        total += n
        errors += errs
    for e in errors:
        print(e)
    print(f"{total} cited figures checked, {len(errors)} wrong")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
