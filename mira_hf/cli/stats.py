"""`mira stats`: the summary of a saved stats or routing file."""

from __future__ import annotations

import argparse

from .. import report
from .options import doc


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("stats", help="summarise a saved stats or routing-trace JSON file", description=doc(cmd_stats))
    s.add_argument("file", metavar="FILE", help="JSON written by `mira generate --stats-out` or `mira calibrate`")
    s.set_defaults(run=cmd_stats)


def cmd_stats(args: argparse.Namespace) -> int:
    """Print a summary of FILE: a stats JSON from `mira generate --stats-out` (or json.dump(model.mira.stats())),
    or a routing summary (router_topk.json from `mira calibrate`, a trace's JSON, or any JSON with "layers"/"steps" keys)."""
    print(report.summarize_file(args.file))
    return 0
