"""The record cache: encoded expert records kept on disk, so the next load of a checkpoint reads them
instead of encoding every expert again.

An entry is a saved store (`mira_hf.saved_store`) in `<root>/<key>/`, where `root` is
`LoaderConfig.record_cache` ("auto": `$MIRA_HF_RECORD_CACHE`, else `$HF_HOME/mira-hf/records`) and `key` hashes everything the
records depend on: the checkpoint's files (path, size, modification time), the model's shape fingerprint
(no router weights: the files pin them, and the key is then known before the non-expert weights load), the codec
and its settings, and `RECORD_FORMAT_VERSION`. Changing any
of them gives another key, so a stale entry is never found; the header repeats the identity and is
checked too. A truncated or damaged entry fails its size or checksum checks while it is read: it is
dropped and the records are encoded again (and written again).

Writing is atomic: the entry is written into a temporary directory beside it, then renamed into
place. A load that is interrupted leaves no entry (only its temporary directory, removed by a later
write once its process is gone); two loads of the same checkpoint at once both encode, the first
rename wins and the other drops its copy. Entries are never modified in place.

An entry that no load can find again is removed when the next entry is written: one whose checkpoint files are
gone, or were rewritten or replaced since (their identity differs from its header's). So a checkpoint saved again
in place, or a hub model updated to a new revision whose old snapshot is deleted, leaves one entry, not one per
version. Entries of checkpoints still on disk stay; the directory can be deleted at any time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
import uuid
import warnings

import torch

from .load_report import LoadReport
from .saved_store import STORE_FORMAT, STORE_HEADER, CorruptStoreError, SavedStore, write_store

# Bump when the bytes a codec writes for the same weights change (any codec): older entries are not found.
RECORD_FORMAT_VERSION = 1
_TMP = ".tmp-"


def default_root() -> str:
    """`$MIRA_HF_RECORD_CACHE` if set, else `$HF_HOME/mira-hf/records` (HF_HOME as huggingface_hub
    resolves it: ~/.cache/huggingface by default)."""
    if os.environ.get("MIRA_HF_RECORD_CACHE"):
        return os.environ["MIRA_HF_RECORD_CACHE"]
    try:
        from huggingface_hub import constants

        home = constants.HF_HOME
    except Exception:  # an old huggingface_hub: its documented default
        home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
    return os.path.join(home, "mira-hf", "records")


def checkpoint_identity(files: list[str]) -> list[list]:
    """Each weight file as [real path, size, mtime_ns, inode, ctime_ns]: a rewritten or replaced file gives another
    identity, even where its modification time was put back (`cp -p`, `rsync -a`, an archive): no one sets the
    inode's change time, which any write or replacement moves. (A metadata change, such as a chmod, moves it too:
    the entry is then encoded again.)"""
    out = []
    for path in files:
        real = os.path.realpath(path)
        st = os.stat(real)
        out.append([real, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns])
    return out


class RecordCache:
    """The cache entry of one checkpoint in one record format."""

    def __init__(self, root: str, files: list[str], codec_spec: dict, fingerprint: dict, specs: dict) -> None:
        self.root = root
        self.identity = dict(
            records=RECORD_FORMAT_VERSION,
            store=STORE_FORMAT,
            checkpoint=checkpoint_identity(files),
            model=fingerprint,
            specs={str(layer): {n: [list(shape), str(dtype)] for n, (shape, dtype) in s.items()} for layer, s in specs.items()},
        )
        self.codec_spec = codec_spec
        text = json.dumps([self.identity, codec_spec], sort_keys=True)
        self.key = hashlib.sha256(text.encode()).hexdigest()[:40]
        self.directory = os.path.join(root, self.key)
        self.writer: threading.Thread | None = None
        self.report: LoadReport | None = None  # the load's report: the write's seconds and bytes go there

    def open(self) -> SavedStore | None:
        """The entry, its header checked; None when there is none. An entry that is not what it should
        be (damaged header, wrong size) is dropped and None returned."""
        if not os.path.isdir(self.directory):
            return None
        try:
            return SavedStore(self.directory, self.codec_spec, self.identity)
        except CorruptStoreError as exc:
            self.drop(str(exc))
        except Exception as exc:  # another identity under this key (a hash collision) or an unreadable file
            self.drop(str(exc))
        return None

    def drop(self, reason: str) -> None:
        """Remove the entry (renamed away first, so no load can open it half removed)."""
        warnings.warn(f"mira-hf: the record cache entry {self.directory} is unusable ({reason}); encoding again.", stacklevel=3)
        trash = os.path.join(self.root, f"{_TMP}{self.key}-{uuid.uuid4().hex[:8]}-drop")
        try:
            os.rename(self.directory, trash)
        except OSError:
            return  # already dropped (or replaced) by another load
        shutil.rmtree(trash, ignore_errors=True)

    def write(self, slabs: dict[int, torch.Tensor], plans: dict, background: bool = True) -> None:
        """Save the records as this entry, atomically; in a background thread by default (the slabs are
        read only, and the load does not wait). The process waits for it at exit (`self.writer`)."""
        if background:
            self.writer = threading.Thread(target=self._write, args=(slabs, plans), name="mira-record-cache", daemon=False)
            self.writer.start()
        else:
            self._write(slabs, plans)

    def wait(self) -> None:
        """Until the background write (if any) has finished."""
        if self.writer is not None:
            self.writer.join()

    def _write(self, slabs: dict[int, torch.Tensor], plans: dict) -> None:
        tmp = os.path.join(self.root, f"{_TMP}{self.key}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            os.makedirs(self.root, exist_ok=True)
            _remove_orphans(self.root)
            t0 = time.perf_counter()
            write_store(tmp, slabs, self.codec_spec, self.identity, plans)
            if self.report is not None:
                self.report.add("cache_write", time.perf_counter() - t0, sum(s.numel() for s in slabs.values()))
            if os.path.isfile(self.directory):  # a file where the entry goes: no entry, and in the way of one
                os.remove(self.directory)
            try:
                os.rename(tmp, self.directory)  # atomic; fails if another load has put its entry there first
            except OSError:
                pass
            _remove_stale(self.root, keep=self.key)
        except Exception as exc:  # a full or read-only disk costs the next load an encode, nothing more
            warnings.warn(f"mira-hf: could not write the record cache in {self.root} ({exc}).", stacklevel=2)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale(root: str, keep: str) -> None:
    """Entries whose checkpoint files were changed or deleted (`checkpoint_identity` differs from the header's, or
    `_deleted`): no load can find them again. Only directories named as entries are (hex keys) and whose header reads
    are looked at."""
    for name in os.listdir(root):
        if name == keep or not re.fullmatch(r"[0-9a-f]{40}", name):
            continue
        directory = os.path.join(root, name)
        try:
            with open(os.path.join(directory, STORE_HEADER)) as f:
                files = json.load(f)["fingerprint"]["checkpoint"]
        except Exception:  # not an entry, or one the load that opens it will drop
            continue
        if not any(_changed(*file) for file in files):
            continue
        trash = os.path.join(root, f"{_TMP}{name}-{uuid.uuid4().hex[:8]}-stale")
        try:
            os.rename(directory, trash)  # renamed first, so no load opens it half removed
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)


def _changed(path, *identity) -> bool:
    """Whether a checkpoint file an entry names (its real path and identity) is not that file any more."""
    try:
        return checkpoint_identity([path]) != [[path, *identity]]
    except FileNotFoundError:
        return _deleted(path)
    except (OSError, TypeError, ValueError):
        return False


def _deleted(path: str) -> bool:
    """Whether a checkpoint file that is not there was deleted: its directory is still there, or the nearest
    directory above it that is holds something else (`rm -rf` of the checkpoint, a repository dropped from the hub's
    cache). Where that directory is empty it may be a mount point whose disk is not mounted now: the entry stays."""
    directory = os.path.dirname(path)
    if os.path.isdir(directory):
        return True
    while not os.path.isdir(directory):
        parent = os.path.dirname(directory)
        if parent == directory:
            return False
        directory = parent
    try:
        return bool(os.listdir(directory))
    except OSError:
        return False


def _remove_orphans(root: str) -> None:
    """Temporary directories of writes whose process is gone (an interrupted load)."""
    for name in os.listdir(root):
        if not name.startswith(_TMP):
            continue
        parts = name[len(_TMP) :].split("-")
        pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
        if pid is None or not alive(pid):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def alive(pid: int) -> bool:
    """Whether process `pid` is running (one of another user's counts: it cannot be signalled, but it is there)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
