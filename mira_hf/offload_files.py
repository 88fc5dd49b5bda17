"""The disk tier's files in `offload_dir`: each made with every block of it reserved on the disk (`create`), named
after the process that writes it, and removed by the next load once that process is gone (`remove_orphans`).

A file is written through a shared memory mapping of it. A page written where the disk has no block left for it is
not an error a write returns: the kernel ends the process (SIGBUS). So the blocks are reserved before the file is
mapped (`posix_fallocate`, else by writing zeros), and a disk that filled up since the load checked it (another
program, another load writing there) is a `BudgetError` naming the directory and the bytes, with the file removed.

`save_pretrained` writes decoded experts that host memory cannot hold beside the store into such a file too (named
`..._save_...`), unlinked as soon as it is mapped: the kernel writes its pages to the disk under memory pressure, and
its blocks are freed once the save no longer maps it.

A store removes its files itself (`ExpertStore.close`, or when it is dropped or the process exits); a process that is
killed (`kill -9`, the kernel's OOM killer) cannot. Its files are named `mira_experts_<host>-<pid>_layerNNNN_<random>.bin`,
so the next load on the same host that offloads to the directory finds them by the pid of a process no longer running
and removes them before it counts the free space. Files of running processes, of other hosts (or containers: another
host name, another set of pids) sharing the directory, and files named otherwise (other programs', and those of
mira-hf versions whose names carry no pid) are never touched.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import tempfile

from .errors import BudgetError
from .record_cache import alive

PREFIX = "mira_experts_"
_NAME = re.compile(rf"{PREFIX}([A-Za-z0-9.-]*)-(\d+)_(?:layer\d+|save)_[a-z0-9_]+\.bin")  # the last part: mkstemp's
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})  # no room: the disk, or the user's quota on it
OFFLOAD_REMEDY = "give offload_dir a disk with more room, or raise host_budget"
_ZEROS_BYTES = 16 * 2**20  # written at a time where blocks are reserved by writing zeros


def create(directory: str, label: str, nbytes: int, what: str, place: str = "offload_dir", remedy: str = OFFLOAD_REMEDY) -> str:
    """A new file of `nbytes` in `directory` (made if missing) for `what` (named by `label`: "layerNNNN" for a MoE
    layer's records, "save" for `save_pretrained`'s buffer), its blocks reserved; its path. `BudgetError` where the disk
    has not room for it (`no_room`, with `place` and `remedy`), the file removed."""
    os.makedirs(directory, exist_ok=True)
    # a name no other store has (another model, or another process, may offload to the same directory)
    fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{_host()}-{os.getpid()}_{label}_", suffix=".bin", dir=directory)
    try:
        try:
            _reserve(fd, nbytes)
        finally:
            os.close(fd)
    except BaseException as exc:
        os.remove(path)
        if isinstance(exc, OSError) and exc.errno in _FULL:
            raise no_room(directory, nbytes, what, place, remedy) from exc
        raise
    return path


def remove_orphans(directory: str) -> None:
    """Remove the files in `directory` that a store wrote for a process no longer running (module doc)."""
    for name, pid in _writers(directory).items():
        if not alive(pid):
            try:
                os.remove(os.path.join(directory, name))
            except OSError:  # removed meanwhile by another load, or not ours to remove
                pass


def held_by_others(directory: str) -> dict[int, int]:
    """Bytes of the files in `directory` written by each other running process (pid -> bytes)."""
    held: dict[int, int] = {}
    for name, pid in _writers(directory).items():
        if pid != os.getpid() and alive(pid):
            try:
                held[pid] = held.get(pid, 0) + os.path.getsize(os.path.join(directory, name))
            except OSError:
                pass
    return held


def _writers(directory: str) -> dict[str, int]:
    """The disk-tier files in `directory` written on this host (file name -> pid of the process that wrote it)."""
    try:
        names = os.listdir(directory)
    except OSError:  # not there yet
        return {}
    host = _host()
    return {name: int(m.group(2)) for name in names if (m := _NAME.fullmatch(name)) and m.group(1) == host}


def _host() -> str:
    """This host's name as it goes into a file name (characters other than letters, digits, '.' and '-' as '-')."""
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())


def check_room(directory: str, nbytes: int, what: str, remedy: str) -> None:
    """`BudgetError` where `directory`'s disk has not `nbytes` free for `what` (after the files of processes gone are
    removed), raised before anything is written; `remedy`: what to do, besides freeing space."""
    free = free_bytes(directory)
    if nbytes > free:
        raise BudgetError(
            f"{what} writes {nbytes:,} bytes of experts to offload_dir={directory!r}, but only {free:,} bytes are free "
            f"there{held_clause(directory)}. Nothing was changed. Free space on that disk, or {remedy}."
        )


def free_bytes(directory: str) -> int:
    """Bytes free on `directory`'s disk (a directory not made yet: where it will be), after the files of processes gone
    are removed from it."""
    remove_orphans(directory)
    return shutil.disk_usage(existing(directory)).free


def held_clause(directory: str) -> str:
    """Where other running processes' disk tiers take room in `directory`, a clause saying how much."""
    held = held_by_others(directory)
    if not held:
        return ""
    pids = ", ".join(str(pid) for pid in sorted(held))
    return f" ({sum(held.values()):,} bytes there are the experts of other running loads: pid {pids})"


def existing(path: str) -> str:
    """`path`, or the nearest directory above it that exists (where a directory not made yet will be)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def no_room(directory: str, nbytes: int, what: str, place: str = "offload_dir", remedy: str = OFFLOAD_REMEDY) -> BudgetError:
    """The error for `what` (`nbytes`) not fitting in `directory` (the user's `place`) as it is now."""
    try:
        free = f"only {shutil.disk_usage(directory).free:,} bytes are free there"
    except OSError:
        free = "the disk has not room for them"
    return BudgetError(
        f"{what} need {nbytes:,} bytes in {place}={directory!r}, but {free}: the disk filled up since it was "
        f"checked (another program or another load writes there). Free space on that disk, or {remedy}."
    )


def _reserve(fd: int, nbytes: int) -> None:
    """Give the file `fd` its `nbytes`, every block of them taken on the disk now (not at the first write)."""
    if nbytes == 0:
        return
    fallocate = getattr(os, "posix_fallocate", None)  # Linux and most Unix; not macOS or Windows
    if fallocate is not None:
        try:
            return fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):  # EOPNOTSUPP: a filesystem without it
                raise
    # Zeros written take the blocks as surely, at the cost of writing the file once more.
    zeros, offset = memoryview(bytes(min(nbytes, _ZEROS_BYTES))), 0
    os.lseek(fd, 0, os.SEEK_SET)
    while offset < nbytes:
        offset += os.write(fd, zeros[: nbytes - offset])
