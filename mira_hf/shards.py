"""A safetensors checkpoint's files and tensors: where its shards are (a local directory, or a hub id's
files in the Hugging Face cache, downloaded several at once where missing), and each tensor's file,
shape, dtype and byte offset, from the shard headers (`ShardIndex`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch

from .download import ShardArrivals, offline
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
    """Why a checkpoint's experts cannot be read one at a time (the reason is shown to the user)."""


@dataclass(frozen=True)
class ShardEntry:
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    offset: int | None = None  # of the tensor's first byte in `file` (None: read through safetensors)


class ShardIndex:
    """Every tensor of a safetensors checkpoint: its file, shape and dtype, from the shard headers.

    Building it opens every shard, so a missing, truncated or corrupted shard raises `CheckpointError`
    here, before any weight is read or any model built.
    """

    def __init__(self, files: list[str]) -> None:
        from safetensors import safe_open

        self.files = files
        self.entries: dict[str, ShardEntry] = {}
        for path in files:
            try:
                offsets = _data_offsets(path)
                with safe_open(path, framework="pt") as f:
                    for key in f.keys():
                        s = f.get_slice(key)
                        entry = ShardEntry(path, tuple(s.get_shape()), _DTYPES.get(s.get_dtype()), offsets.get(key))
                        self.entries[key] = entry
            except Exception as exc:  # SafetensorError (not importable by name in every version) or OSError
                raise CheckpointError(
                    f"could not read the checkpoint shard {path}: {exc}. The file is missing, truncated or corrupted: "
                    "copy or download it again (nothing was loaded)."
                ) from exc
        self.nbytes = sum(os.path.getsize(p) for p in files)
        self.download_s = 0.0  # resolving a hub id's files in the cache, downloading those not there (`find`)

    @staticmethod
    def find(name_or_path, hf_kwargs: dict) -> ShardIndex:
        """The safetensors shards of a local directory or a hub id (downloaded into the local cache if not there).
        Raises `NotStreamable` when the weights are not plain safetensors shards."""
        given = sorted(k for k in _NOT_SAFETENSORS_KWARGS if hf_kwargs.get(k) is not None)
        if given or hf_kwargs.get("use_safetensors") is False:
            raise NotStreamable(f"from_pretrained was given {given or ['use_safetensors=False']}")
        start = time.perf_counter()
        files = ShardIndex._files(name_or_path, hf_kwargs)
        download_s = 0.0 if os.path.isdir(name_or_path) else time.perf_counter() - start
        index = ShardIndex(files)
        index.download_s = download_s
        return index

    @staticmethod
    def _files(name_or_path, hf_kwargs: dict) -> list[str]:
        """Local paths of the checkpoint's safetensors files (a hub id's downloaded into the cache)."""
        index = _resolve(name_or_path, "model.safetensors.index.json", hf_kwargs)
        if index is not None:
            try:
                with open(index) as f:
                    names = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError) as exc:
                raise CheckpointError(f"{index} is not a valid safetensors index ({exc}): copy it again.") from exc
            files = []
            for name, path in zip(names, _resolve_all(name_or_path, names, hf_kwargs)):
                if path is None:
                    raise CheckpointError(
                        f"{name_or_path!s}: shard {name} listed in model.safetensors.index.json is missing. "
                        "Copy or download the checkpoint again (nothing was loaded)."
                    )
                files.append(path)
            return files
        single = _resolve(name_or_path, "model.safetensors", hf_kwargs)
        if single is None:
            raise NotStreamable("it has no safetensors weights (model.safetensors or its index)")
        return [single]


def _resolve_all(name_or_path, filenames: list[str], hf_kwargs: dict) -> list[str | None]:
    """Local paths of several checkpoint files, None for each one the checkpoint lacks. The files of a hub
    id that are not in the local cache are downloaded several at once, in the order given, as transformers
    downloads a model's shards (`mira_hf.download.ShardArrivals`); a failed download raises `CheckpointError`."""
    if os.path.isdir(name_or_path) or len(filenames) < 2:
        return [_resolve(name_or_path, f, hf_kwargs) for f in filenames]
    arrivals = ShardArrivals(str(name_or_path), filenames, hf_kwargs)
    paths = []
    try:
        for name in filenames:
            paths.append(arrivals.wait(name))
    except Exception as exc:
        arrivals.cancel()
        cause = exc.__cause__ or exc  # huggingface_hub's LocalEntryNotFoundError wraps the HTTP error that says why
        why = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise CheckpointError(
            f"{name_or_path!s}: downloading shard {name} failed ({type(cause).__name__}: {why}). Check the connection, "
            "the revision and the token, then load again: shards already downloaded stay in the cache."
        ) from exc
    return paths


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

    kwargs = {k: hf_kwargs[k] for k in ("revision", "cache_dir", "local_files_only", "token") if k in hf_kwargs}
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


def missing_checkpoint_error(name_or_path, hf_kwargs: dict, exc: Exception) -> CheckpointError:
    """One line saying that `name_or_path` is neither a checkpoint directory nor a model the hub gave,
    and what to do (the hub's own message, first line only, says why; never the hub validator's text
    for something that is plainly a path)."""
    name = str(name_or_path)
    why = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(". ")
    if os.path.isdir(name):
        return CheckpointError(f"{name} holds no config.json ({why}): give the directory save_pretrained wrote.")
    if os.path.exists(name):
        return CheckpointError(f"{name} is a file; a model is a directory holding config.json and the weights.")
    where = f"{name} does not exist: no such directory" + ("" if os.path.isabs(name) else f" (relative to {os.getcwd()})")
    if not _looks_like_hub_id(name):
        return CheckpointError(f"{where}. Give a local directory holding config.json and the weights, or a hub id.")
    if hf_kwargs.get("local_files_only") or offline():
        off = "local_files_only=True" if hf_kwargs.get("local_files_only") else "HF_HUB_OFFLINE=1"
        cache = hf_kwargs.get("cache_dir") or "the Hugging Face cache"
        return CheckpointError(
            f"{where}, and as a hub id it is not in {cache} while downloads are off ({off}): download it first "
            f"(hf download {name}), drop {off}, or give a local directory."
        )
    return CheckpointError(
        f"{where}, and the hub did not give it as a model id ({why}): check the id, the revision and the token "
        "(gated and private models need token=...)."
    )


def _looks_like_hub_id(name: str) -> bool:
    """`org/name` or `name`: what the hub accepts as a model id (a path with ./, ~, / or more parts is not)."""
    return not name.startswith((".", "~", "/")) and name.count("/") <= 1 and "\\" not in name and bool(name)
