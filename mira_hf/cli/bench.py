"""`mira bench`: run a script of benchmarks/ (a source checkout's), or list them."""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

from .. import report
from .options import doc

REPO_ROOT = Path(__file__).resolve().parents[2]


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="run a script of benchmarks/ (lists them without NAME)", description=doc(cmd_bench))
    b.add_argument("name", nargs="?", metavar="NAME", help="script name, e.g. run for benchmarks/run.py")
    b.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to the script (after an optional --)")
    b.set_defaults(run=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    """Run benchmarks/NAME.py with this Python, passing the remaining arguments, and print its output.
    Without NAME, list the scripts. Benchmarks live in a source checkout of mira-hf."""
    root = _benchmarks_dir()
    scripts = _bench_scripts(root)
    if args.name is None:
        print(f"benchmark scripts in {root}:")
        print("\n".join(report.aligned_rows([(name, _summary_line(path)) for name, path in scripts.items()])) or "  (none)")
        print("\nrun one with: mira bench NAME [-- ARGS...]")
        return 0
    name = args.name.removesuffix(".py")
    if name not in scripts:
        raise FileNotFoundError(f"no benchmark {args.name!r} in {root}; available: {', '.join(scripts) or 'none'}.")
    extra = args.args[1:] if args.args[:1] == ["--"] else args.args
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # stream the child's lines as they come
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    with subprocess.Popen(
        [sys.executable, str(scripts[name]), *extra],
        cwd=root.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
        except KeyboardInterrupt:
            proc.terminate()
            raise
    return proc.returncode


def _benchmarks_dir() -> Path:
    for candidate in (REPO_ROOT / "benchmarks", Path.cwd() / "benchmarks"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        "no benchmarks/ folder: `mira bench` runs the scripts of a source checkout of mira-hf (git clone it)."
    )


# Modules the benchmark scripts import (measuring, routing shaping, statistics), not scripts themselves.
BENCH_LIBRARIES = frozenset({"common", "timing", "routing_stats", "topic_routing"})


def _bench_scripts(root: Path) -> dict[str, Path]:
    """Runnable scripts: *.py except private ones and the modules they share (`BENCH_LIBRARIES`)."""
    return {p.stem: p for p in sorted(root.glob("*.py")) if not p.stem.startswith("_") and p.stem not in BENCH_LIBRARIES}


def _summary_line(path: Path) -> str:
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    except (SyntaxError, UnicodeDecodeError):
        doc = None
    return doc.strip().splitlines()[0] if doc else ""
