"""Interleaved A/B of `host_split.py` between two trees: what a change to the host path does to the split's and
the default's speed on one machine.

Each tree holds a revision's `mira_hf/`, `model_adapters/` and `benchmarks/`; every measurement is that tree's own
`host_split.py` in a fresh process (no allocator, pinned-memory or worker state carries over), the trees alternating
old, new, old, new, ... so that drift over the run (heat, other tenants) falls on both. The arguments this script
does not know (after `--`, for clarity) go to every process unchanged (give `--floor-from` a file with lru rows, or put lru in the first process's systems).
The processes' result files are merged into one: each process's tree, its order and its rows.

    git archive REV mira_hf model_adapters benchmarks | (mkdir -p /tmp/before && tar -x -C /tmp/before)
    python benchmarks/host_split_ab.py --old /tmp/before --name job-before-copies --out benchmarks/results/ -- \\
        --models mixtral --budgets consumer --shares 0.2,0.25 --rounds 3 --batch-tokens 6 --beam-tokens 6 \\
        --floor-from FILE                                              # GPU: ~80 s per process
    python benchmarks/host_split_ab.py --old /tmp/before --smoke --out /tmp     # CPU, tiny shapes: checks the script

Writes OUT/<date>-<device>-host-split[-NAME]-ab.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from common import print_table, write_json  # noqa: E402

COLUMNS = ["process", "system", "b1_tok_s", "x_limit_lossless", "b8_tok_s", "b8_parts_copied", "beam_tok_s"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="a tree with the older mira_hf/, model_adapters/ and benchmarks/")
    ap.add_argument("--new", default=REPO, help="a tree with the newer ones (default: this checkout)")
    ap.add_argument("--old-label", default="the tree given by --old", help="what the older tree does, for the file")
    ap.add_argument("--new-label", default="the tree given by --new", help="what the newer tree does, for the file")
    ap.add_argument("--pairs", type=int, default=2, help="old/new process pairs")
    ap.add_argument("--name", default="", help="what the trees differ in, for the file's name")
    ap.add_argument("--out", required=True, help="directory for the merged file")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="the longest one process may run")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, a few tokens: checks the script")
    # what this script does not know goes to host_split.py; `--` before it is optional
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--"]
    args, args.rest = ap.parse_known_args(argv)
    if args.pairs < 1:
        ap.error(f"--pairs {args.pairs}: give 1 or more")
    for flag in ("old", "new"):
        path = os.path.abspath(getattr(args, flag))
        script = os.path.join(path, "benchmarks", "host_split.py")
        if not (os.path.isfile(script) and os.path.isfile(os.path.join(path, "mira_hf", "__init__.py"))):
            ap.error(
                f"--{flag} {path}: no mira_hf/ or benchmarks/host_split.py there. Give a folder holding a revision's "
                "mira_hf/, model_adapters/ and benchmarks/, e.g. made with: git archive REV mira_hf model_adapters "
                "benchmarks | (mkdir -p DIR && tar -x -C DIR)"
            )
        setattr(args, flag, path)
    return args


def measure(tree: str, rest: list[str], out: str, smoke: bool, timeout_s: float) -> tuple[dict, str]:
    """One process of `tree`'s host_split.py writing into `out`: (its result, the result file's name)."""
    cmd = [
        sys.executable,
        os.path.join(tree, "benchmarks", "host_split.py"),
        *rest,
        "--out",
        out,
        *(["--smoke"] if smoke else []),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    files = sorted(glob.glob(os.path.join(out, "*-host-split*.json")))
    if done.returncode != 0 or not files:
        tail = (done.stdout + done.stderr)[-3000:]
        raise SystemExit(f"{' '.join(cmd)}: exit status {done.returncode}, result files {files}; its output ends:\n{tail}")
    with open(files[0]) as f:
        return json.load(f), os.path.basename(files[0])


def main(argv=None) -> int:
    args = parse_args(argv)
    labels = {"old": args.old_label, "new": args.new_label}
    runs, env, device = [], None, None
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(1, args.pairs + 1):
            for side in ("old", "new"):
                process = f"{side}{i}"
                data, name = measure(getattr(args, side), args.rest, os.path.join(tmp, process), args.smoke, args.timeout_s)
                kept = {k: data.get(k) for k in ("args", "bandwidth", "rows")}  # bandwidth: this process's link
                runs.append(dict(process=process, revision=labels[side], **kept))
                env, device = data["env"], name[len("YYYY-MM-DD-") :].split("-host-split")[0]
                print(
                    f"{process}: " + ", ".join(f"{r['system']} {r.get('b1_tok_s', float('nan')):.2f} tok/s" for r in data["rows"])
                )
    print_table([dict(process=r["process"], **row) for r in runs for row in r["rows"]], COLUMNS)
    path = os.path.join(args.out, f"{env['date']}-{device}-host-split{'-' + args.name if args.name else ''}-ab.json")
    write_json(path, dict(env=env, runs=runs))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
