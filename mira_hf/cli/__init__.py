"""The `mira` command.

    mira generate --prompt "def fib(n):"                 # the bundled mira-tiny model, on the GPU if there is one
    mira generate PATH --prompt ... --budget 12GiB --stats-out run.json
    mira calibrate PATH --data corpus.txt --out cal/     # router top-k per token, and the learned predictor
    mira bench run -- --models bundled                   # a script of benchmarks/
    mira stats run.json                                  # summary of a saved stats or trace file
    mira env --model PATH                                # GPU, PCIe, bandwidth, versions and a suggested gpu_budget
    mira serve PATH --port 8000 --kv-cache-memory 4GiB   # OpenAI-compatible server (pip install "mira-hf[serve]")

A user mistake (bad budget, missing model, unknown policy, ...) prints one line, `mira: error: ...`, and exits
with status 2, as argparse does for bad arguments; `--traceback` shows the full traceback instead.

One module per command (generate, calibrate, bench, stats, serve, env), each adding its parser with `register`;
`options` holds what they share. None imports torch or transformers before its command runs.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import MiraError
from . import bench, calibrate, env, generate, serve, stats
from .options import parse_budget

__all__ = ["build_parser", "main", "parse_budget"]

# What a user can get wrong; anything else is a bug and keeps its traceback.
USER_ERRORS = (MiraError, FileNotFoundError, ValueError)
COMMANDS = (generate, calibrate, bench, stats, serve, env)  # in the order `mira --help` lists them


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `mira` console script; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, already printed): return it rather than exit
        return exc.code if isinstance(exc.code, int) else 0
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except USER_ERRORS as exc:
        if args.traceback:
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"mira: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mira: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of the output went away (`mira stats FILE | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the interpreter's own flush at exit is quiet
        return 141


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mira",
        description="Run Mixture-of-Experts transformers models with routed experts in host memory and a GPU expert cache.",
        epilog="Run `mira COMMAND --help` for the options of each command.",
    )
    parser.add_argument("--traceback", action="store_true", help="show the full traceback of errors (for bug reports)")
    parser.set_defaults(command=None, traceback=False)
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser
