#!/usr/bin/env python3
"""Prepare the training corpus and tokenizer for the bundled "mira-tiny" MoE model.

Why this corpus: the model only has to be a realistic, *trained* MoE (so that routing
statistics mean something), and it must be rebuildable without internet access.  The
Python sources shipped with the interpreter (standard library, including its test
suite) are present on every full CPython install; optionally the ``.py`` files of
installed packages top the corpus up towards ~20M tokens (varies per machine, so the
exact file list is fingerprinted in ``meta.json``).

Outputs (under ``--out``, default ``build/tiny_data``):

* ``tokenizer/``   byte-level BPE, loadable with ``AutoTokenizer.from_pretrained``.
                   ``<|endoftext|>`` is the only special token, id 0, used as bos/eos/pad.
* ``train.bin``    uint16 token ids, every file preceded by ``<|endoftext|>`` (id 0).
* ``heldout.bin``  same layout for the ~2% held-out files (split by a hash of the path).
* ``meta.json``    vocab size, token/file counts, seed, Python version, corpus fingerprint.

Deterministic: files are visited in sorted order, the split is a salted SHA-256 of the
relative path, and the BPE trainer is deterministic for a given input.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import sysconfig
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 0  # first special token of the trainer -> id 0; uint16 and padding friendly.
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class SourceFile:
    """One corpus document: ``name`` is the stable relative path used for the split."""

    name: str
    text: str


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("build/tiny_data"), help="output directory")
    parser.add_argument("--vocab-size", type=int, default=6144, help="BPE vocabulary size (4k-8k)")
    parser.add_argument(
        "--max-train-tokens", type=int, default=20_000_000, help="stop adding training files once this many tokens are collected"
    )
    parser.add_argument(
        "--site-packages-mb",
        type=float,
        default=40.0,
        help="MB of installed packages' .py files to add after the stdlib (0 = stdlib only)",
    )
    parser.add_argument(
        "--max-file-kb", type=int, default=512, help="skip larger files (mostly generated tables that teach nothing)"
    )
    parser.add_argument("--heldout-permille", type=int, default=20, help="held-out share of files, in 1/1000")
    parser.add_argument("--seed", type=int, default=0, help="salt of the train/held-out hash split")
    return parser.parse_args()


def read_python_file(path: Path, max_bytes: int) -> str | None:
    """Return the file's text, or None if it is too large, not UTF-8, or empty."""
    data = path.read_bytes()
    if not data.strip() or len(data) > max_bytes:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:  # the stdlib test suite deliberately ships a few non-UTF-8 files
        return None


def python_files(root: Path) -> list[Path]:
    """All *.py files below ``root`` in sorted order, not descending into package dirs."""
    return sorted(p for p in root.rglob("*.py") if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]))


def collect_stdlib(max_bytes: int) -> list[SourceFile]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in python_files(root):
        text = read_python_file(path, max_bytes)
        if text is not None:
            files.append(SourceFile(f"stdlib/{path.relative_to(root).as_posix()}", text))
    return files


def allocate_budget(sizes: dict[str, int], budget: int) -> dict[str, int]:
    """Water-filling: give every package an equal share, redistributing what small ones leave.

    Keeps the top-up diverse instead of being dominated by a few huge packages.
    """
    allocation, remaining = {}, budget
    ordered = sorted(sizes, key=lambda name: (sizes[name], name))
    for i, name in enumerate(ordered):
        allocation[name] = min(sizes[name], remaining // (len(ordered) - i))
        remaining -= allocation[name]
    return allocation


def collect_site_packages(budget_bytes: int, max_bytes: int) -> list[SourceFile]:
    """Installed packages' .py files, at most ``budget_bytes`` in total, spread across packages."""
    if budget_bytes <= 0:
        return []
    root = Path(sysconfig.get_paths()["purelib"])
    per_package: dict[str, list[SourceFile]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if "__pycache__" in rel.parts or not path.is_file():
            continue
        text = read_python_file(path, max_bytes)
        if text is not None:
            per_package.setdefault(rel.parts[0], []).append(SourceFile(f"site-packages/{rel.as_posix()}", text))
    sizes = {name: sum(len(f.text.encode()) for f in files) for name, files in per_package.items()}
    allocation = allocate_budget(sizes, budget_bytes)
    chosen = []
    for name in sorted(per_package):
        used = 0
        for f in per_package[name]:
            size = len(f.text.encode())
            if used + size > allocation[name]:
                break
            chosen.append(f)
            used += size
    return chosen


def deduplicate(files: Iterable[SourceFile]) -> list[SourceFile]:
    """Drop exact duplicates (vendored copies) so they cannot leak across the split."""
    seen, unique = set(), []
    for f in files:
        digest = hashlib.sha256(f.text.encode()).digest()
        if digest not in seen:
            seen.add(digest)
            unique.append(f)
    return unique


def is_heldout(name: str, seed: int, permille: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < permille


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """GPT-2 style byte-level BPE: no unknown tokens, lossless on any source file."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tokenizer.token_to_id(EOS_TOKEN) == EOS_ID
    return tokenizer


def save_hf_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    hf_tokenizer.save_pretrained(out_dir)


def tokenize(tokenizer: Tokenizer, files: list[SourceFile], max_tokens: int | None) -> tuple[np.ndarray, int]:
    """Concatenate ``[EOS] + ids(file)`` for each file, stopping before ``max_tokens`` is exceeded.

    Returns the uint16 stream and the number of files it contains.
    """
    chunks, total, batch_size = [], 0, 256
    for start in range(0, len(files), batch_size):
        batch = files[start : start + batch_size]
        for encoding in tokenizer.encode_batch([f.text for f in batch], add_special_tokens=False):
            ids = np.asarray([EOS_ID, *encoding.ids], dtype=np.uint16)
            if max_tokens is not None and total + len(ids) > max_tokens:
                return np.concatenate(chunks), len(chunks)
            chunks.append(ids)
            total += len(ids)
    return np.concatenate(chunks), len(chunks)


def fingerprint(files: list[SourceFile]) -> str:
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0" + hashlib.sha256(f.text.encode()).digest())
    return digest.hexdigest()


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    max_bytes = args.max_file_kb * 1024
    stdlib = collect_stdlib(max_bytes)
    site = collect_site_packages(int(args.site_packages_mb * 1e6), max_bytes)
    files = deduplicate(stdlib + site)
    heldout = [f for f in files if is_heldout(f.name, args.seed, args.heldout_permille)]
    train = [f for f in files if not is_heldout(f.name, args.seed, args.heldout_permille)]
    print(
        f"collected {len(stdlib)} stdlib + {len(site)} site-packages files; "
        f"{len(files)} unique -> {len(train)} train / {len(heldout)} held-out "
        f"({time.perf_counter() - start:.0f}s)",
        flush=True,
    )

    tokenizer = train_tokenizer([f.text for f in train], args.vocab_size)
    vocab_size = tokenizer.get_vocab_size()
    assert vocab_size <= np.iinfo(np.uint16).max + 1
    print(f"trained BPE tokenizer, vocab {vocab_size} ({time.perf_counter() - start:.0f}s)", flush=True)

    train_ids, n_train_files = tokenize(tokenizer, train, args.max_train_tokens)
    heldout_ids, n_heldout_files = tokenize(tokenizer, heldout, None)

    args.out.mkdir(parents=True, exist_ok=True)
    save_hf_tokenizer(tokenizer, args.out / "tokenizer")
    train_ids.tofile(args.out / "train.bin")
    heldout_ids.tofile(args.out / "heldout.bin")
    train_bytes = sum(len(f.text.encode()) for f in train[:n_train_files])
    meta = {
        "vocab_size": vocab_size,
        "eos_token": EOS_TOKEN,
        "eos_token_id": EOS_ID,
        "bos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
        "dtype": "uint16",
        "layout": "each file is preceded by eos_token_id",
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(heldout_ids.size),
        "train_files": n_train_files,
        "heldout_files": n_heldout_files,
        "train_bytes_per_token": round(train_bytes / train_ids.size, 4),
        "stdlib_files": len(stdlib),
        "site_packages_files": len(site),
        "duplicates_dropped": len(stdlib) + len(site) - len(files),
        "train_files_skipped_by_token_cap": len(train) - n_train_files,
        "corpus_sha256": fingerprint(train[:n_train_files] + heldout),
        "seed": args.seed,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib_path": sysconfig.get_paths()["stdlib"],
        "platform": sys.platform,
    }
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(
        f"wrote {args.out}: {meta['train_tokens']:,} train tokens ({n_train_files} files), "
        f"{meta['heldout_tokens']:,} held-out tokens ({n_heldout_files} files), "
        f"{meta['train_bytes_per_token']} bytes/token, {time.perf_counter() - start:.0f}s total"
    )


if __name__ == "__main__":
    main()
