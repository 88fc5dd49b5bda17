"""A safetensors checkpoint's files and tensors: where its shards are (a local directory, or a hub id's
files in the Hugging Face cache, downloaded several at once where missing), and each tensor's file,
shape, dtype and byte offset, from the shard headers (`ShardIndex`).
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from .download import HUB_KWARGS, ArrivedFiles, ShardArrivals, offline
from .errors import CheckpointError

# safetensors dtype names (header strings) -> torch dtypes.
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
    "F8_E5M2": getattr(torch, "float8_e5m2", None),
}
# hf_kwargs that make transformers read something other than the plain safetensors shards.
_NOT_SAFETENSORS_KWARGS = ("gguf_file", "variant", "state_dict", "quantization_config", "from_tf", "from_flax")


class NotStreamable(Exception):
    """Why a checkpoint's experts cannot be read one at a time (the reason is shown to the user), and `remedy`, what
    the user can do about it besides loading the whole checkpoint (`whole_helps`: whether that loads it at all)."""

    DEFAULT_REMEDY = "register an adapter with checkpoint_keys=(ExpertKeys(...),) for this layout"

    def __init__(self, reason: str, remedy: str = DEFAULT_REMEDY, whole_helps: bool = True) -> None:
        super().__init__(reason)
        self.remedy, self.whole_helps = remedy, whole_helps


@dataclass(frozen=True)
class ShardEntry:
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    offset: int | None = None  # of the tensor's first byte in `file` (None: read through safetensors)


class ShardIndex:
    """Every tensor of a safetensors checkpoint: its file, shape, dtype and offset, from the shard headers.

    The shards of a hub id download several at once (`ShardArrivals`), and each header is read when its
    shard has landed: `entries` lists every tensor from the start (model.safetensors.index.json names each
    one's shard), and looking one up waits for that shard only, so experts are read from the first shards
    while later ones still download. Shards already on disk (a local directory, a hub id with downloads off)
    have all arrived: `find` reads every header before returning, so a missing, truncated or corrupted
    shard raises `CheckpointError` before any weight is read or any model built.
    """

    def __init__(self, where: str, arrivals, weight_map: dict[str, str] | None = None, total_size: int | None = None) -> None:
        """`arrivals`: the shard files as they arrive (`ShardArrivals`, `ArrivedFiles`); `weight_map`: tensor key
        -> shard name (None for a checkpoint in one file); `total_size`: the tensors' bytes, as the index says."""
        self.where = where
        self._total_size = total_size
        self.arrivals = arrivals
        self.shards: list[str] = arrivals.filenames
        self._weight_map = weight_map
        self._paths: dict[str, str] = {}
        self._headers: dict[str, dict[str, ShardEntry]] = {}
        self._locks = {name: threading.Lock() for name in self.shards}  # one reader per header; others wait
        self.entries: Mapping[str, ShardEntry] = _Entries(self)

    def shard(self, name: str) -> dict[str, ShardEntry]:
        """The entries of shard `name`, once it has arrived (its header is read once)."""
        with self._locks[name]:
            if name not in self._headers:
                path = self._wait(name)
                self._headers[name] = _read_header(path)
                self._paths[name] = path
        return self._headers[name]

    def _wait(self, name: str) -> str:
        try:
            path = self.arrivals.wait(name)
        except Exception as exc:
            self.arrivals.cancel()
            cause = exc.__cause__ or exc  # huggingface_hub's LocalEntryNotFoundError wraps the HTTP error that says why
            why = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
            raise CheckpointError(
                f"{self.where}: downloading shard {name} failed ({type(cause).__name__}: {why}). Check the connection, "
                "the revision and the token, then load again: shards already downloaded stay in the cache."
            ) from exc
        if path is None:
            raise CheckpointError(
                f"{self.where}: shard {name} listed in model.safetensors.index.json is missing. "
                "Copy or download the checkpoint again (nothing was loaded)."
            )
        return path

    def all_arrived(self) -> bool:
        """Whether every shard is on disk now (nothing left to wait for)."""
        return all(self.arrivals.done(name) for name in self.shards)

    def wait_all(self) -> list[str]:
        """Local paths of every shard, once all have arrived (each header read). A tensor of a shard that the index's
        weight map leaves out is added to it: transformers loads every tensor of the files the index lists."""
        for name in self.shards:
            entries = self.shard(name)
            if self._weight_map is not None:
                for key in entries:  # in the shard's order
                    self._weight_map.setdefault(key, name)
        return [self._paths[name] for name in self.shards]

    @property
    def files(self) -> list[str]:
        return self.wait_all()

    @property
    def nbytes(self) -> int:
        """The checkpoint's bytes: its files' sizes, or while shards still arrive, the tensors' bytes from the index."""
        if self._total_size is not None and not self.all_arrived():
            return self._total_size
        return sum(os.path.getsize(p) for p in self.files)

    def loaded_nbytes(self, dtype: torch.dtype | None, stored: torch.dtype | None = None) -> int:
        """Host bytes the checkpoint's tensors take once loaded with their floating-point ones in `dtype` (None: each in
        its own), as transformers loads them whole: a bf16 checkpoint loaded in float32 takes twice its files, FP8
        weights dequantized take their values in `dtype`, MXFP4 blocks (`*_blocks`, two values a byte) unpacked too.
        While shards still arrive (their headers unread), the index's total scaled from `stored` (config.json's dtype)."""
        if dtype is None:
            return self.nbytes
        if not self.all_arrived():
            known = stored is not None and stored.is_floating_point
            return self.nbytes * dtype.itemsize // stored.itemsize if known else self.nbytes
        total = 0
        for key, entry in self.entries.items():
            numel = math.prod(entry.shape)
            if entry.dtype is not None and entry.dtype.is_floating_point:
                total += numel * dtype.itemsize
            elif entry.dtype == torch.uint8 and key.endswith("_blocks"):
                total += 2 * numel * dtype.itemsize
            else:
                total += numel * (entry.dtype.itemsize if entry.dtype is not None else 1)
        return total

    @property
    def download_s(self) -> float:
        """Seconds from the start of `find` until the last shard arrived (0 for a local directory)."""
        self.wait_all()
        return max(self.arrivals.arrived.values(), default=self.arrivals.started) - self.arrivals.started

    @staticmethod
    def find(name_or_path, hf_kwargs: dict) -> ShardIndex:
        """The safetensors shards of a local directory or a hub id, downloading those not in the local cache (in
        the background: `entries` waits per shard). Raises `NotStreamable` when the weights are not plain
        safetensors shards."""
        given = sorted(k for k in _NOT_SAFETENSORS_KWARGS if hf_kwargs.get(k) is not None)
        if given or hf_kwargs.get("use_safetensors") is False:
            raise NotStreamable(
                f"from_pretrained was given {given or ['use_safetensors=False']}", "load it without those arguments"
            )
        # transformers reads model.safetensors where there is one, its index only otherwise (a directory or a
        # repository can hold both)
        single = _resolve(name_or_path, "model.safetensors", hf_kwargs)
        index_file = None if single is not None else _resolve(name_or_path, "model.safetensors.index.json", hf_kwargs)
        weight_map = total_size = None
        if index_file is not None:
            try:
                with open(index_file) as f:
                    content = json.load(f)
                weight_map = dict(content["weight_map"])
                total_size = (content.get("metadata") or {}).get("total_size")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index_file} is not a valid safetensors index ({exc}): copy it again.") from exc
            names = sorted(set(weight_map.values()))
        else:
            names = ["model.safetensors"]
        local = os.path.isdir(name_or_path)
        downloads = not (local or hf_kwargs.get("local_files_only") or offline())
        if downloads and weight_map is not None:
            arrivals = ShardArrivals(str(name_or_path), names, hf_kwargs)
        elif weight_map is None:
            arrivals = ArrivedFiles({names[0]: single})  # resolved once (with force_download, downloaded once)
        else:
            arrivals = ArrivedFiles({name: _resolve(name_or_path, name, hf_kwargs) for name in names})
        if weight_map is None and arrivals.wait(names[0]) is None:
            if any(_resolve(name_or_path, f, hf_kwargs) for f in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
                raise NotStreamable(
                    "it has no safetensors weights (model.safetensors or its index), only pytorch_model.bin",
                    "save it once as safetensors (load it with transformers, then save_pretrained)",
                )
            raise NotStreamable(
                "it has no weight files (model.safetensors, its index or pytorch_model.bin)",
                "give the directory save_pretrained wrote, with its weights",
                whole_helps=False,
            )
        index = ShardIndex(str(name_or_path), arrivals, weight_map, total_size if isinstance(total_size, int) else None)
        if not downloads:
            index.wait_all()  # every shard is on disk: read every header now
        return index


class _Entries(Mapping):
    """Tensor key -> `ShardEntry` of a `ShardIndex`: the keys from the start, an entry once its shard is there."""

    def __init__(self, index: ShardIndex) -> None:
        self._index = index

    def _keys(self) -> Mapping:
        index = self._index
        return index._weight_map if index._weight_map is not None else index.shard(index.shards[0])

    def __getitem__(self, key: str) -> ShardEntry:
        index = self._index
        if index._weight_map is None:  # one file: its header lists every key
            return index.shard(index.shards[0])[key]
        name = index._weight_map[key]
        entries = index.shard(name)
        if key in entries:
            return entries[key]
        for other in index.shards:  # a stale index: transformers reads every listed file, wherever the key is
            if other != name and key in index.shard(other):
                return index.shard(other)[key]
        raise CheckpointError(
            f"{index.where}: model.safetensors.index.json puts {key} in {name}, and no file of the checkpoint holds "
            "it. Copy or download the checkpoint again."
        )

    def __contains__(self, key: object) -> bool:
        return key in self._keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())


def _read_header(path: str) -> dict[str, ShardEntry]:
    """The entries of one shard, from its header; a missing, truncated or corrupted file is a `CheckpointError`."""
    from safetensors import safe_open

    entries = {}
    try:
        offsets = _data_offsets(path)
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                s = f.get_slice(key)
                entries[key] = ShardEntry(path, tuple(s.get_shape()), _DTYPES.get(s.get_dtype()), offsets.get(key))
    except Exception as exc:  # SafetensorError (not importable by name in every version) or OSError
        raise CheckpointError(
            f"could not read the checkpoint shard {path}: {exc}. The file is missing, truncated or corrupted: "
            "copy or download it again (nothing was loaded)."
        ) from exc
    return entries


def _data_offsets(path: str) -> dict[str, int]:
    """Each tensor's first byte in a safetensors file (an 8-byte little-endian header length, the JSON
    header, then the data), so experts are read with `pread` straight into their tensors."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: 8 + n + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def _resolve(name_or_path, filename: str, hf_kwargs: dict) -> str | None:
    """Local path of one checkpoint file, or None when the checkpoint has no such file."""
    subfolder = hf_kwargs.get("subfolder") or ""
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, subfolder, filename)
        return path if os.path.isfile(path) else None
    from transformers.utils import cached_file

    kwargs = {k: hf_kwargs[k] for k in HUB_KWARGS if k != "subfolder" and k in hf_kwargs}
    try:
        return cached_file(
            name_or_path,
            filename,
            subfolder=subfolder,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
            **kwargs,
        )
    except OSError:
        return None


GENERATION_CONFIG = "generation_config.json"


def refetch(name_or_path, filename: str, hf_kwargs: dict) -> None:
    """Download `filename` of a hub checkpoint again where `hf_kwargs` asks for `force_download` (a file the
    checkpoint lacks, or a local directory: nothing to do), so that a load continuing without `force_download` (the
    weights are downloaded again once, by the shard index) still reads it fresh, as transformers' own load does."""
    if hf_kwargs.get("force_download") and not os.path.isdir(name_or_path):
        _resolve(name_or_path, filename, hf_kwargs)


def refetch_code(name_or_path, config_json: Mapping, hf_kwargs: dict) -> None:
    """Download again the code files of a hub checkpoint that ships its own classes (config.json's `auto_map`, each
    module with the modules it imports, from its own repository where a reference names another: "repo--module.Class")
    where `hf_kwargs` asks for `force_download` and `trust_remote_code`, as transformers' own load does for the classes
    it builds, so that the load continuing without `force_download` builds them from fresh files."""
    if not (hf_kwargs.get("force_download") and hf_kwargs.get("trust_remote_code")) or os.path.isdir(name_or_path):
        return
    from transformers.dynamic_module_utils import get_cached_module_file

    refs = set()
    for ref in (config_json.get("auto_map") or {}).values():
        refs.update(r for r in (ref if isinstance(ref, (list, tuple)) else [ref]) if isinstance(r, str))
    hub = {k: hf_kwargs.get(k) for k in ("cache_dir", "token", "local_files_only") if hf_kwargs.get(k) is not None}
    for repo, module in sorted({(r.rpartition("--")[0] or str(name_or_path), r.rpartition("--")[2].split(".")[0]) for r in refs}):
        revision = hf_kwargs.get("code_revision") or hf_kwargs.get("revision") if repo == str(name_or_path) else None
        get_cached_module_file(repo, f"{module}.py", force_download=True, revision=revision, **hub)


def missing_checkpoint_error(name_or_path, hf_kwargs: dict, exc: Exception) -> CheckpointError:
    """One line saying that `name_or_path` is neither a checkpoint directory nor a model the hub gave,
    and what to do (the hub's own message, first line only, says why; never the hub validator's text
    for something that is plainly a path)."""
    name = str(name_or_path)
    why = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(". ")
    subfolder = hf_kwargs.get("subfolder") or ""
    if os.path.isdir(name):
        if subfolder and not os.path.isfile(os.path.join(name, subfolder, "config.json")):
            return CheckpointError(
                f"subfolder={subfolder!r}: {_no_subfolder(name, subfolder)}. Give the subfolder that holds the checkpoint, "
                "or leave it out."
            )
        if os.path.isfile(os.path.join(name, subfolder, "config.json")):
            return CheckpointError(
                f"{os.path.join(name, subfolder, 'config.json')} could not be read ({why}): copy or download it again."
            )
        return CheckpointError(f"{name} holds no config.json ({why}): give the directory save_pretrained wrote.")
    if os.path.exists(name):
        return CheckpointError(f"{name} is a file; a model is a directory holding config.json and the weights.")
    where = f"{name} does not exist: no such directory" + ("" if os.path.isabs(name) else f" (relative to {os.getcwd()})")
    if not _looks_like_hub_id(name):
        return CheckpointError(f"{where}. Give a local directory holding config.json and the weights, or a hub id.")
    if hf_kwargs.get("local_files_only") or offline():
        off = "local_files_only=True" if hf_kwargs.get("local_files_only") else "HF_HUB_OFFLINE=1"
        cache = hf_kwargs.get("cache_dir") or "the Hugging Face cache"
        revision = hf_kwargs.get("revision")
        snapshot = _cached_snapshot(name, hf_kwargs) if subfolder else None
        if snapshot is not None:  # the revision is there: the subfolder is what is missing
            label = f"hub id {name}'s snapshot of revision {revision or 'main'!r} in {cache}"
            return CheckpointError(
                f"subfolder={subfolder!r}: {_no_subfolder(snapshot, subfolder, label)}. Give the subfolder that holds "
                "the checkpoint, or leave it out; "
                f"if the repository has that subfolder, download it first (hf download {name} --include '{subfolder}/*'"
                f"{f' --revision {revision}' if revision else ''}) or drop {off}."
            )
        what, flag = (f"revision {revision!r}", f" --revision {revision}") if revision else ("it", "")
        return CheckpointError(
            f"{where}, and as a hub id {what} is not in {cache} while downloads are off ({off}): download it first "
            f"(hf download {name}{flag}), drop {off}, or give a local directory."
        )
    return CheckpointError(
        f"{where}, and the hub did not give it as a model id ({why}): check the id, the revision and the token "
        "(gated and private models need token=...)."
    )


def _no_subfolder(root: str, subfolder: str, label: str | None = None) -> str:
    """That `root` (`label`: what to call it) holds no `subfolder`/config.json, and where in it a config.json is."""
    label = label or root
    missing = (
        f"{subfolder!r} holds no config.json" if os.path.isdir(os.path.join(root, subfolder)) else f"no subfolder {subfolder!r}"
    )
    found = []
    for directory, subdirectories, files in os.walk(root, followlinks=True):
        place = os.path.relpath(directory, root)
        found += [place] if "config.json" in files else []
        if place.count(os.sep) >= 1 and place != ".":  # two levels down at most: a checkpoint is not buried deeper
            subdirectories.clear()
    found.sort()
    if not found:
        return f"{label} has {missing}, and no config.json anywhere in it"
    places = ", ".join("its top" if place == "." else repr(place) for place in found[:8])
    return f"{label} has {missing}; it has a config.json at {places}"


def _cached_snapshot(name: str, hf_kwargs: dict) -> str | None:
    """The directory of hub id `name`'s revision in the local cache, or None where that revision is not there."""
    from huggingface_hub import snapshot_download

    kwargs = {k: hf_kwargs[k] for k in ("revision", "cache_dir") if hf_kwargs.get(k) is not None}
    try:
        return snapshot_download(name, local_files_only=True, **kwargs)
    except Exception:  # not in the cache (LocalEntryNotFoundError), or no valid id
        return None


def _looks_like_hub_id(name: str) -> bool:
    """`org/name` or `name`: what the hub accepts as a model id (a path with ./, ~, / or more parts is not)."""
    return not name.startswith((".", "~", "/")) and name.count("/") <= 1 and "\\" not in name and bool(name)
