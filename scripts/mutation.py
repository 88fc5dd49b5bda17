#!/usr/bin/env python3
"""Mutation testing by module group: which functions each group mutates, a run, and a summary.

    pip install mutmut
    python scripts/mutation.py run combine        # or: codecs, core; several at once; none = all
    python scripts/mutation.py summary OUT.json   # counts per group and module, the survivors by name

`run` calls `mutmut run` on the group's functions (mutmut's configuration, the mutated files and the fast test
selection, is `[tool.mutmut]` in pyproject.toml); each mutant runs only the selected tests that call its
function. `summary` reads mutmut's results for the same functions. docs/RELIABILITY.md ("Mutation testing")
gives the numbers and says why each survivor computes the same thing as the original.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
from collections import Counter

M = "xǁ"  # mutmut's prefix of a method's mutants: mira_hf.proxy.xǁMiraExpertsǁserve__mutmut_3


def _methods(module: str, cls: str, names: str) -> list[str]:
    return [f"{module}.{M}{cls}ǁ{n}__mutmut_*" for n in names.split()]


def _functions(module: str, names: str) -> list[str]:
    return [f"{module}.x_{n}__mutmut_*" for n in names.split()]


GROUPS: dict[str, dict[str, list[str]]] = {
    # cache policies, the cache, heat tracking, budget planning
    "core": {
        "mira_hf/policies.py": ["mira_hf.policies.*"],
        "mira_hf/cache.py": ["mira_hf.cache.*"],
        "mira_hf/heat.py": ["mira_hf.heat.*"],
        "mira_hf/budget.py": _functions("mira_hf.budget", "plan_budget device_buffers _pools_by_size"),
    },
    # the proxy's compute and combine step: what transformers' experts implementations compute, bit for bit
    "combine": {
        "mira_hf/experts_impl.py": _functions(
            "mira_hf.experts_impl",
            "implementation_of check_model_implementations checked_set_experts_implementation check_call sum_dtype "
            "combine grouped_linear batched_linear",
        ),
        "mira_hf/proxy.py": _functions("mira_hf.proxy", "_guarded")
        + _methods(
            "mira_hf.proxy",
            "MiraExperts",
            "serve _decode_step _combine _batched _serve _expert _linear _up_proj _activate _down_proj",
        ),
        "mira_hf/ops.py": _functions("mira_hf.ops", "register"),
    },
    # the codecs' torch reference paths: encode and decode maths, not layout planning or validation
    "codecs": {
        # int8/int4: the whole decode and the superblock scale grid; not the encoder's fit and refinement
        # (_fit_groups, _store_scales, _quantize_entry) nor layout planning
        "mira_hf/quant/groupwise.py": _functions(
            "mira_hf.quant.groupwise",
            "pack_codes unpack_codes dequantize_torch group_scales_torch scale_from_code superblock_params _codes _safe",
        ),
        "mira_hf/quant/record.py": _functions("mira_hf.quant.record", "raw_tensor section_view dense_linear"),
        "mira_hf/quant/integer.py": _methods("mira_hf.quant.integer", "PackedCodec", "decode_entry"),
        "mira_hf/quant/base.py": _methods("mira_hf.quant.base", "RecordCodec", "decode"),
        # lossless: both torch decoders, and the encoder's choices that define a record (the nibble code's base,
        # the sign/mantissa plane); not the encoders' chunk loops
        "mira_hf/quant/lossless_bits.py": _functions(
            "mira_hf.quant.lossless_bits",
            "_high_low _sign_mantissa _words_and_planes _write_words _exponents _best_base _blocks _field_bits "
            "decode_words_torch is_class_coded decode_words_classes_torch patch_escapes",
        ),
        "mira_hf/quant/lossless.py": _methods("mira_hf.quant.lossless", "LosslessCodec", "decode_entry _decode_into"),
        # nf4: the record's bitsandbytes state and its decode
        "mira_hf/quant/nf4.py": _methods("mira_hf.quant.nf4", "Nf4Codec", "_state _dequantize"),
        "mira_hf/quant/native.py": _functions("mira_hf.quant.native", "split_rows")
        + _methods("mira_hf.quant.native", "NativeCodec", "encode views decode"),
        "mira_hf/quant/fp8_block.py": _functions("mira_hf.quant.fp8_block", "dequantize_fp8")
        + _methods("mira_hf.quant.fp8_block", "Fp8BlockCodec", "dequantize"),
        "mira_hf/quant/mxfp4.py": _functions("mira_hf.quant.mxfp4", "dequantize_mxfp4")
        + _methods("mira_hf.quant.mxfp4", "Mxfp4Codec", "dequantize _lut"),
    },
}


def patterns(groups: list[str]) -> list[str]:
    return [p for g in groups for pats in GROUPS[g].values() for p in pats]


def run(groups: list[str], children: int) -> int:
    # one torch thread: mutmut forks its test runner after torch has started its thread pool
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.call(["mutmut", "run", "--max-children", str(children), *patterns(groups)], env=env)


def statuses(directory: str = ".") -> dict[str, str]:
    """mutmut's verdict per mutant of the run in `directory` (killed, survived, not checked, ...)."""
    cmd = ["mutmut", "results", "--all", "true"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=directory).stdout
    return dict(line.strip().rsplit(": ", 1) for line in out.splitlines() if ": " in line)


def summary(path: str, directories: list[str]) -> None:
    found = {}
    for directory in directories:  # a later run's verdicts replace an earlier one's, mutant by mutant
        found.update({k: v for k, v in statuses(directory).items() if v != "not checked" or k not in found})
    result = {}
    for group, modules in GROUPS.items():
        rows = {}
        for module, pats in modules.items():
            names = sorted(n for n in found if any(fnmatch.fnmatchcase(n, p) for p in pats))
            counts = Counter(found[n] for n in names)
            rows[module] = {
                "mutants": len(names),
                "killed": counts["killed"],
                "survived": sorted(n for n in names if found[n] == "survived"),
                "other": {s: c for s, c in counts.items() if s not in ("killed", "survived")},  # not checked, timeout, ...
            }
        total = {k: sum(r[k] for r in rows.values()) for k in ("mutants", "killed")}
        total["survived"] = sum(len(r["survived"]) for r in rows.values())
        result[group] = {"modules": rows, "total": total}
    with open(path, "w") as f:
        json.dump(result, f, indent=1, ensure_ascii=False)
        f.write("\n")
    for group, data in result.items():
        print(f"{group}: {data['total']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("groups", nargs="*", help=f"any of {list(GROUPS)} (default: all)")
    r.add_argument("--max-children", type=int, default=2)
    s = sub.add_parser("summary")
    s.add_argument("out")
    s.add_argument("--dirs", nargs="+", default=["."], help="checkouts whose mutmut results to merge (default: this one)")
    args = parser.parse_args()
    if args.command == "run":
        unknown = sorted(set(args.groups) - set(GROUPS))
        if unknown:
            parser.error(f"unknown groups {unknown}; choose from {list(GROUPS)}")
        return run(args.groups or list(GROUPS), args.max_children)
    summary(args.out, args.dirs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
