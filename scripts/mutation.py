#!/usr/bin/env python3
"""Mutation testing by module group: which functions each group mutates, a run, and a summary.

    pip install mutmut
    python scripts/mutation.py run combine        # or: codecs, core; several at once; none = all
    python scripts/mutation.py run combine --survivors   # after adding tests: only the mutants not yet killed
    python scripts/mutation.py summary OUT.json   # counts per group and module, the score, survivors not argued
    python scripts/mutation.py summary OUT.json --groups core   # only core's counts replaced; OUT's other groups kept

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
            "implementation_of check_model_implementations checked_set_experts_implementation check_call "
            "eager_sums_in_weights_dtype combine grouped_linear batched_linear",
        ),
        "mira_hf/proxy.py": _functions("mira_hf.proxy", "_guarded")
        + _methods(
            "mira_hf.proxy",
            "MiraExperts",
            "serve _row_order _decode_step _combine _batched _from_slots _serve _grouped_on _on_slots _on_window _expert "
            "_linear _up_proj _activate _down_proj",
        )
        + _methods("mira_hf.proxy", "MiraScaledExperts", "_linear"),
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


def _names(module: str, function: str, numbers: str) -> list[str]:
    """mutmut's names of mutants `numbers` of `function` ("combine", or "MiraExperts.serve" for a method)."""
    cls, _, fn = function.rpartition(".")
    prefix = f"{module}.{M}{cls}ǁ{fn}" if cls else f"{module}.x_{fn}"
    return [f"{prefix}__mutmut_{n}" for n in numbers.split()]


# Survivors that compute what the original computes, by class; docs/RELIABILITY.md ("Mutation testing") says
# why for each class. And survivors only a GPU run can kill: on the CPU the line they change picks a branch
# that gives the same bits there (transformers' grouped kernel, a host tensor indexed on its own device, the
# Triton kernels). Numbers are mutmut's for the code as committed: editing a function renumbers its mutants,
# so a run on changed code lists them again as survivors to be argued or killed.
_PROXY, _IMPL = "mira_hf.proxy", "mira_hf.experts_impl"
_LB, _LL = "mira_hf.quant.lossless_bits", "mira_hf.quant.lossless"
_POL, _HEAT, _BUDGET = "mira_hf.policies", "mira_hf.heat", "mira_hf.budget"
_CACHE = "mira_hf.cache"
EQUIVALENT: dict[str, list[str]] = {
    # core
    "a value never read (LRU order's and HOT's values, `staged` in LRU's `inserted`, a victim always reassigned)": _names(
        _POL, "LRUPolicy.inserted", "1"
    )
    + _names(_POL, "PriorityPolicy.inserted", "2")
    + _names("mira_hf.cache", "ExpertCache.allocate", "9")
    + _names("mira_hf.cache", "ExpertCache.use", "13"),
    "a tie of one is what the recency search over it returns": _names(_POL, "HeatPolicy.victim", "12"),
    "a list of candidates copied once more": _names(_POL, "HeatPolicy.victim", "2"),
    "any negative default ranks an unknown key first": _names(_POL, "PriorityPolicy.victim", "17"),
    "table sizes that differ only by rows never read": _names(_HEAT, "HeatTracker.__init__", "29 57 59"),
    "window counts only used divided by their layer's largest": _names(_HEAT, "HeatTracker.activate", "18"),
    "NumPy stores None as False in a bool array": _names(_HEAT, "HeatTracker.end_step", "17")
    + _names(_HEAT, "HeatTracker._end_period", "7"),
    "NumPy's default dtype is the one given (float64 losses, int64 = intp candidate indices and counts)": _names(
        _HEAT, "UseRates.__init__", "21 23 27 30 39 41"
    ),
    "half the six candidates is 3 as a float or an int": _names(_HEAT, "UseRates.__init__", "31"),
    "an all-true padding mask where nothing is padded (× 1)": _names(_HEAT, "UseRates.__init__", "43"),
    "the flush mask kept as 0.0/1.0: putmask reads it as bool": _names(_HEAT, "UseRates.__init__", "51 53"),
    "a fresh array instead of the buffer made once": _names(_HEAT, "UseRates.__init__", "54")
    + _names(_HEAT, "UseRates.update", "14 16"),
    "a 1-byte slot budget buys no slot; each pool's top-k is at least 1; raising top-k slots to top-k": _names(
        _BUDGET, "plan_budget", "14 31 62"
    ),
    "the keep-value's floor and batching: the same float64 values either way": _names(
        _POL, "ExpectedDistance.keep_values", "2 3 8 9 19"
    ),
    # core: slot arrays (cache.py, policies.py)
    "np.full's default dtype is its fill value's, int64: intp on 64-bit platforms": _names(
        _CACHE, "SlotTable.__init__", "4 7 13 16"
    ),
    "pins kept as float64: only compared with 0; stamps as float64: whole numbers, exact below 2**53, same order": _names(
        _CACHE, "SlotTable.__init__", "21 23 36 38"
    ),
    "the clock's start and step: only the stamps' order is read": _names(_CACHE, "SlotTable.__init__", "40")
    + _names(_CACHE, "Slot.touch", "4"),
    "a free slot's flags and byte count: `allocate` sets them before anything reads them": _names(
        _CACHE, "Slot.__init__", "9 10 11 12 15 16"
    ),
    "a free slot's copy events: its first copy (`DeviceArena.fill`) sets both before anything reads them": _names(
        _CACHE, "Slot.__init__", "13 14"
    ),
    "a tie of one is the least recently used of the one": _names(_POL, "HeatPolicy.victim_slots", "9"),
    "the float64 arrays of the valuation: fromiter's count only sizes its buffer; astype(None) and asarray of a "
    "list of floats give float64": _names(_POL, "ExpectedDistance._keep_values_np", "11")
    + _names(_POL, "ExpectedDistance._terms", "3")
    + _names(_POL, "ExpectedDistance._guess_array", "9 11"),
    "a layer's guesses converted again instead of read from the conversion cache: the same values": _names(
        _POL, "ExpectedDistance._terms", "19"
    )
    + _names(_POL, "ExpectedDistance._guess_array", "1 2 5"),
    # combine and codecs
    "zeros or uninitialised rows that are never read or are zeroed later": _names(_PROXY, "MiraExperts._batched", "12 13 15")
    + _names(_PROXY, "MiraExperts._decode_step", "57 58 83 84 110 111")
    + _names(_PROXY, "MiraExperts._combine", "25 30"),
    "the sentinel's rows not zeroed after weighting: zero already (zero weights when batched, else new_zeros)": _names(
        _PROXY, "MiraExperts.serve", "82 90"
    )
    + _names(_PROXY, "MiraExperts._decode_step", "30 38 123 131"),
    "a sentinel mask made where no row is the sentinel's: it zeroes nothing": _names(_PROXY, "MiraExperts.serve", "91"),
    "the decode step's one token: any slice of the hidden states from 0 or before to 1 or after": _names(
        _PROXY, "MiraExperts._batched", "94 95 96 101"
    ),
    "rows counted for the planner with host compute off: `begin` reads them only when it is on": _names(
        _PROXY, "MiraExperts._batched", "104"
    ),
    "a [1, H] host output put into one row: indexed assignment drops the leading 1": _names(
        _PROXY, "MiraExperts._batched", "172"
    ),
    "the host's up projection through transformers' grouped matmul: F.linear's bits on the CPU": _names(
        _PROXY, "MiraExperts._up_proj", "1"
    ),
    "combine given None for batched_mm": _names(_PROXY, "MiraExperts.serve", "81")
    + _names(_PROXY, "MiraExperts._decode_step", "29"),
    "the eager accumulator's dtype from routing weights in fp32 or the hidden dtype": _names(
        _PROXY, "MiraExperts._combine", "40"
    ),
    "the whole record acquired at once": _names(_PROXY, "MiraExperts._serve", "41 44 45"),
    "one window's output concatenated alone: the same rows": _names(_PROXY, "MiraExperts._on_slots", "29"),
    "the group sizes' dtype: their cumulative sum is taken in int32 whatever it is": _names(
        _PROXY, "MiraExperts._on_window", "10 12"
    ),
    "a slice from None starts at 0": _names(_PROXY, "MiraExperts._serve", "16"),
    "resident experts grouped on a CPU too: the same bits in every test with one to four threads (the path is kept "
    "to CUDA because a CPU kernel may round a row by its place where threads split the rows)": _names(
        _PROXY, "MiraExperts._grouped_on", "1"
    ),
    "one expert, or a block of exactly `prefill_block_tokens` rows, by the grouped call or by its own call: the same "
    "bits wherever the grouped path runs (each row's result does not depend on the call's other rows)": _names(
        _PROXY, "MiraExperts._serve", "20"
    )
    + _names(_PROXY, "MiraExperts.serve", "137"),
    "two addends in either order, a one-column sort, a 2-D tensor's dim 1 as -1": _names(_IMPL, "combine", "3 25 26")
    + _names(_PROXY, "MiraExperts._activate", "11"),
    "a uint8 view of a uint8 view": _names("mira_hf.quant.record", "section_view", "2"),
    "one more zero count after the sentinel's": _names(_PROXY, "MiraExperts.serve", "36 43"),
    "Llama 4's batch of two holds the same expert twice: either output": _names(_PROXY, "MiraScaledExperts._linear", "19"),
    "a default that no caller uses": _names(_PROXY, "MiraExperts._down_proj", "1"),
    "a dtype cast whose values every use keeps": _names(_LB, "_high_low", "9 12")
    + _names(_LB, "_sign_mantissa", "1")
    + _names(_LB, "decode_words_torch", "23 51")
    + _names(_LB, "decode_words_classes_torch", "37 49 52 101 117 133"),
    "an arithmetic shift of int16 repeats the sign bit": _names(_LB, "_sign_mantissa", "5"),
    "a slice one longer, cut to length after": _names(_LB, "decode_words_torch", "48")
    + _names(_LB, "decode_words_classes_torch", "76")
    + _names(_LB, "_blocks", "9"),
    "use_triton None is False": _names(_LL, "LosslessCodec.decode_entry", "13 22")
    + _names("mira_hf.quant.base", "RecordCodec.decode", "11 20"),
    "a zero scale decodes every code to zero": _names("mira_hf.quant.groupwise", "_safe", "7"),
    "an empty superblock is the one whose smallest scale is infinite": _names(
        "mira_hf.quant.groupwise", "superblock_params", "71"
    ),
    "a host index into a device tensor": _names("mira_hf.quant.groupwise", "group_scales_torch", "31 33"),
    "reshapes that give the same elements in the same order": _names("mira_hf.quant.fp8_block", "dequantize_fp8", "9 10 15 29")
    + _names("mira_hf.quant.native", "split_rows", "8")
    + _names("mira_hf.quant.nf4", "Nf4Codec._dequantize", "5 15"),
    "float32 scales are already float32; a bf16 scale promotes exactly": _names(
        "mira_hf.quant.fp8_block", "dequantize_fp8", "28"
    ),
    "one piece per fused tensor gives the same blocks": _names("mira_hf.quant.native", "NativeCodec.decode", "20")
    + _names("mira_hf.quant.fp8_block", "Fp8BlockCodec.dequantize", "22"),
    "an extra copy": _names("mira_hf.quant.native", "NativeCodec.decode", "30"),
    "the e2m1 table exact in every float dtype, made here or cached": _names(
        "mira_hf.quant.mxfp4", "Mxfp4Codec.dequantize", "4 8 10"
    )
    + _names("mira_hf.quant.mxfp4", "Mxfp4Codec._lut", "1 3 5 8")
    + _names("mira_hf.quant.mxfp4", "dequantize_mxfp4", "4 7"),
    "bitsandbytes reads nf4's table from quant_type, not code": _names("mira_hf.quant.nf4", "Nf4Codec._state", "25 33"),
}
NEEDS_GPU: dict[str, list[str]] = {
    "transformers' grouped kernel instead of F.linear (the same bits on the CPU)": _names(
        _PROXY, "MiraExperts._decode_step", "49 54"
    )
    + _names(_PROXY, "MiraExperts._expert", "1 5 8 15 18")
    + _names(_PROXY, "MiraExperts._up_proj", "6")
    + _names(_PROXY, "MiraExperts._down_proj", "6")
    + _names(_PROXY, "MiraExperts.serve", "121 126")
    + _names(_PROXY, "MiraExperts._linear", " ".join(str(n) for n in (*range(1, 10), *range(24, 31)))),
    # not a GPU, but a run mutmut cannot make: its forked runner runs torch single-threaded, and the row order
    # and Llama 4's batch matter only where the kernels split rows among threads (each mutant below fails
    # test_combine's row-order or Llama 4 test in a plain run, with 2 threads; checked by hand)
    "rows in another order, or Llama 4's expert by `mm`: seen only with several torch threads": _names(
        _PROXY, "MiraExperts._row_order", "1 2 3 9 13"
    )
    + _names(_PROXY, "MiraExperts.serve", "46")
    + _names(_PROXY, "MiraScaledExperts._linear", "2 3 4 5"),
    "Llama 4's matmul for a GPU or for records kept packed, which the fast selection does not run": _names(
        _PROXY, "MiraScaledExperts._linear", "1 20 21 22 23 24 25 26 27"
    ),
    "a tensor made on the host instead of the record's or the rows' device": _names(
        "mira_hf.quant.mxfp4", "Mxfp4Codec._lut", "6 9"
    )
    + _names("mira_hf.quant.mxfp4", "Mxfp4Codec.dequantize", "11")
    + _names("mira_hf.quant.mxfp4", "dequantize_mxfp4", "5 8")
    + _names(_LB, "decode_words_classes_torch", "2 50 53")
    + _names(_IMPL, "grouped_linear", "6 10")
    + _names(_PROXY, "MiraExperts._batched", "77")
    + _names(_PROXY, "MiraExperts._decode_step", "89 91")
    + _names(_PROXY, "MiraExperts._on_window", "22 30")
    + _names(_PROXY, "MiraExperts.serve", "153"),
    "a slot's `free` event: a copy waits on it and a block records on it only on CUDA": _names(_CACHE, "Slot.__init__", "17"),
    "the Triton kernels' call": _names("mira_hf.quant.integer", "PackedCodec.decode_entry", "9 10 11 12 13 14 15 16 17 18")
    + _names(_LL, "LosslessCodec._decode_into", "15 16 17 18 19 20 21 22"),
}


def patterns(groups: list[str]) -> list[str]:
    return [p for g in groups for pats in GROUPS[g].values() for p in pats]


def run(groups: list[str], children: int, survivors: bool = False) -> int:
    """`mutmut run` on the groups' mutants. `survivors`: only those still to decide, after new tests: the
    ones not checked yet and the survivors not argued equivalent or left to a GPU run."""
    names = patterns(groups)
    if survivors:
        argued = {n for group in (EQUIVALENT, NEEDS_GPU) for names in group.values() for n in names}
        names = sorted(
            n
            for n, v in statuses().items()
            if (v == "not checked" or (v == "survived" and n not in argued)) and any(fnmatch.fnmatchcase(n, p) for p in names)
        )
        if not names:
            print("nothing to rerun")
            return 0
    # one torch thread: mutmut forks its test runner after torch has started its thread pool
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.call(["mutmut", "run", "--max-children", str(children), *names], env=env)


def statuses(directory: str = ".") -> dict[str, str]:
    """mutmut's verdict per mutant of the run in `directory` (killed, survived, not checked, ...)."""
    cmd = ["mutmut", "results", "--all", "true"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=directory).stdout
    return dict(line.strip().rsplit(": ", 1) for line in out.splitlines() if ": " in line)


def summary(path: str, directories: list[str], groups: list[str] | None = None) -> None:
    found = {}
    for directory in directories:  # a later run's verdicts replace an earlier one's, mutant by mutant
        found.update({k: v for k, v in statuses(directory).items() if v != "not checked" or k not in found})
    equivalent = {n for names in EQUIVALENT.values() for n in names}
    needs_gpu = {n for names in NEEDS_GPU.values() for n in names}
    result = {}
    for group, modules in GROUPS.items():
        if groups and group not in groups:
            continue
        if not any(fnmatch.fnmatchcase(n, p) and v != "not checked" for n, v in found.items() for p in patterns([group])):
            print(f"{group}: no mutant checked, left out")
            continue
        rows = {}
        for module, pats in modules.items():
            names = sorted(n for n in found if any(fnmatch.fnmatchcase(n, p) for p in pats))
            counts = Counter(found[n] for n in names)
            survived = [n for n in names if found[n] == "survived"]
            rows[module] = {
                "mutants": len(names),
                "checked": len(names) - counts["not checked"],
                # the tests failed: an assertion, or the mutant crashed or hung the test process
                "killed": counts["killed"] + counts["timeout"] + counts["segfault"],
                "equivalent": len([n for n in survived if n in equivalent]),
                "needs_gpu": len([n for n in survived if n in needs_gpu]),
                "survived": len(survived),
                "not_argued": sorted(n for n in survived if n not in equivalent and n not in needs_gpu),
                "other": {s: c for s, c in counts.items() if s not in ("killed", "survived")},  # not checked, timeout, ...
            }
        keys = ("mutants", "checked", "killed", "equivalent", "needs_gpu", "survived")
        total = {k: sum(r[k] for r in rows.values()) for k in keys}
        total["not_argued"] = sum(len(r["not_argued"]) for r in rows.values())
        # the score: killed share of the checked mutants that are not equivalent (needs_gpu counts as not killed)
        scored = total["checked"] - total["equivalent"]
        total["score"] = round(total["killed"] / scored, 4) if scored else None
        result[group] = {"modules": rows, "total": total}
    if groups and os.path.exists(path):  # the other groups of an earlier summary stay as they were measured
        with open(path) as f:
            result = {**json.load(f), **result}
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
    r.add_argument("--max-children", type=int, default=1)
    r.add_argument("--survivors", action="store_true", help="rerun only the mutants the last run did not kill")
    s = sub.add_parser("summary")
    s.add_argument("out")
    s.add_argument(
        "--groups", nargs="+", choices=list(GROUPS), help="the groups to summarise, others kept from OUT (default: every one run)"
    )
    s.add_argument("--dirs", nargs="+", default=["."], help="checkouts whose mutmut results to merge (default: this one)")
    args = parser.parse_args()
    if args.command == "run":
        unknown = sorted(set(args.groups) - set(GROUPS))
        if unknown:
            parser.error(f"unknown groups {unknown}; choose from {list(GROUPS)}")
        return run(args.groups or list(GROUPS), args.max_children, args.survivors)
    summary(args.out, args.dirs, args.groups)
    return 0


if __name__ == "__main__":
    sys.exit(main())
