"""The shards of a hub checkpoint as they arrive: downloaded into the Hugging Face cache one file per
worker, in the index's order, each one usable as soon as it has landed.

`ShardArrivals(repo_id, filenames, hf_kwargs)` starts the downloads (`huggingface_hub.hf_hub_download`,
honouring `revision`, `token`, `cache_dir`, `subfolder`, `local_files_only`, `force_download` and
`HF_HUB_OFFLINE` as transformers does); files already in the cache arrive at once, without a download
(with `force_download`, each is downloaded again, once). `wait(name)` gives
one file's local path as soon as it is there. A file the repository lacks (or, with downloads off, the
cache lacks) is None; any other failure is raised by the `wait` that needs that file. `ArrivedFiles` is
the same for files already on disk (a local directory), each one there from the start.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

# The hub kwargs of transformers' from_pretrained that locate a file (the rest do not concern downloads).
HUB_KWARGS = ("revision", "cache_dir", "local_files_only", "token", "subfolder", "force_download")
DEFAULT_WORKERS = 8  # files downloaded at once (transformers' default for a model's shards)


def offline() -> bool:
    """Whether huggingface_hub is in offline mode (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)."""
    try:
        from huggingface_hub import is_offline_mode
    except ImportError:  # huggingface_hub < 1.0
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    return bool(is_offline_mode())


class ShardArrivals:
    """Files of one hub repository, downloaded in the order given by `workers` threads at a time."""

    def __init__(self, repo_id: str, filenames: list[str], hf_kwargs: dict, workers: int = DEFAULT_WORKERS) -> None:
        self.repo_id = repo_id
        self.filenames = list(filenames)
        self._kwargs = {k: hf_kwargs[k] for k in HUB_KWARGS if hf_kwargs.get(k) is not None}
        self.started = time.perf_counter()
        self.arrived: dict[str, float] = {}  # filename -> when it was there (time.perf_counter())
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(workers, len(self.filenames))), thread_name_prefix="mira-dl")
        self._futures: dict[str, Future] = {name: self._pool.submit(self._fetch, name) for name in self.filenames}
        self._pool.shutdown(wait=False)  # the submitted downloads run on; no more are taken

    def _fetch(self, filename: str) -> str | None:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

        try:
            path = hf_hub_download(self.repo_id, filename, **self._kwargs)
        except LocalEntryNotFoundError:  # not in the cache: absent when downloads are off, else a failed download
            if not (self._kwargs.get("local_files_only") or offline()):
                raise
            path = None
        except EntryNotFoundError:  # the repository has no such file (LocalEntryNotFoundError is one too)
            path = None
        self.arrived[filename] = time.perf_counter()
        return path

    def done(self, filename: str) -> bool:
        """Whether `filename` has arrived (or failed): `wait` would not block."""
        return self._futures[filename].done()

    def wait(self, filename: str) -> str | None:
        """The local path of `filename` once it has arrived (None: the repository lacks it)."""
        return self._futures[filename].result()

    def cancel(self) -> None:
        """Drop the downloads not yet started (those under way finish into the cache)."""
        for future in self._futures.values():
            future.cancel()


class ArrivedFiles:
    """Files already on disk, each one there from the start: `ShardArrivals` for a local directory."""

    def __init__(self, paths: dict[str, str | None]) -> None:
        self.filenames = list(paths)
        self._paths = paths
        self.started = time.perf_counter()
        self.arrived = dict.fromkeys(paths, self.started)

    def done(self, filename: str) -> bool:
        return True

    def wait(self, filename: str) -> str | None:
        return self._paths[filename]

    def cancel(self) -> None:
        pass
