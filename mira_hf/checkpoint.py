"""Loading a checkpoint without its routed experts, then reading them one expert at a time.

`transformers.from_pretrained` materialises every weight, so host memory at load would be the whole
checkpoint. Here transformers loads the model *without* the routed experts: a private subclass,
used for this one load, removes the expert parameters of each experts module right after
construction (still on the meta device), so the checkpoint's expert tensors are keys the model does
not have and transformers never reads them. The experts are then read from the safetensors shards
one expert at a time, straight into the `ExpertStore` records (`ShardIndex`, `StreamedExperts`).

Peak host memory while loading ≈ non-expert weights + the store's host tier (`host_budget`) + one
expert's tensors, whatever the checkpoint's size.

Where each family keeps its experts on disk is data in `model_adapters` (`MoEAdapter.checkpoint_keys`),
derived from transformers' own conversion mapping for families without a table, and always tried
under the fused in-memory names too. A checkpoint matching none of them is loaded the ordinary way.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model_adapters import MoEAdapter

from .download import ShardArrivals, offline
from .errors import BudgetError, CheckpointError, UnsupportedModelError
from .fp8_partial_blocks import block_size, find_partial_block_weights, set_partial_block_weights
from .load_report import LoadReport

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
class _Entry:
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
        self.entries: dict[str, _Entry] = {}
        for path in files:
            try:
                offsets = _data_offsets(path)
                with safe_open(path, framework="pt") as f:
                    for key in f.keys():
                        s = f.get_slice(key)
                        entry = _Entry(path, tuple(s.get_shape()), _DTYPES.get(s.get_dtype()), offsets.get(key))
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


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# -- where each expert tensor is in the checkpoint ---------------------------------------------------------
KeysFn = Callable[[str, str], "tuple[str, ...] | None"]  # (module path, fused tensor name) -> key templates


def _candidates(adapter: MoEAdapter, model: torch.nn.Module) -> list[tuple[str, KeysFn]]:
    """Checkpoint layouts to try, in order: the adapter's tables (or, without any, one derived from
    transformers' conversion mapping), then the fused in-memory names."""
    found: list[tuple[str, KeysFn]] = [(f"{adapter.name} table", k.keys) for k in adapter.checkpoint_keys]
    if not found:
        derived = transformers_keys(model)
        if derived is not None:
            found.append(("transformers' conversion mapping", derived))
    found.append(("fused in-memory names", lambda path, tensor: (f"{path}.{tensor}",)))
    return found


def _literal(pattern: str) -> str | None:
    """A transformers key pattern as plain text, or None if it is a real regex."""
    text = pattern.replace("\\.", ".")
    return None if re.search(r"[\^$()\[\]{}?+|\\]", text) else text


def transformers_keys(model: torch.nn.Module) -> KeysFn | None:
    """Checkpoint keys of fused expert tensors, derived from transformers' own conversion mapping
    (`WeightConverter`s that stack per-expert tensors, `WeightRenaming`s of plain names). None when
    this transformers has no such mapping. Only the operations below are understood; any other
    converter is ignored, and a wrong guess is harmless since every key is checked in the checkpoint."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        conversions = get_model_conversion_mapping(model)
    except Exception:  # not in this transformers version, or a model it cannot map
        return None
    stacking = ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])
    renames: list[tuple[str, str]] = []  # (checkpoint, in-memory)
    converters: list[tuple[str, list[str]]] = []  # (in-memory target, per-expert checkpoint sources)
    for c in conversions:
        sources = [_literal(p) for p in c.source_patterns]
        targets = [_literal(p) for p in c.target_patterns]
        if None in sources or None in targets or len(targets) != 1:
            continue
        if isinstance(c, WeightConverter):
            ops = [(type(op).__name__, getattr(op, "dim", None)) for op in c.operations]
            if ops in stacking and all(s.count("*") == 1 for s in sources):
                converters.append((targets[0], sources))
        elif isinstance(c, WeightRenaming) and len(sources) == 1:
            renames.append((sources[0], targets[0]))

    def keys(path: str, tensor: str) -> tuple[str, ...]:
        key = f"{path}.{tensor}"
        templates = [key]
        for target, sources in converters:
            if _ends_with(key, target):
                templates = [key[: -len(target)] + s.replace("*", "{e}") for s in sources]
                break
        else:
            for source, target in renames:
                if _ends_with(key, target):
                    templates = [key[: -len(target)] + source]
                    break
        out = []
        for t in templates:  # undo plain renamings of the path (".block_sparse_moe." -> ".mlp.")
            t = "." + t
            for source, target in renames:
                if target.startswith(".") and target.endswith("."):
                    t = t.replace(target, source)
            out.append(t[1:])
        return tuple(out)

    return keys


def _ends_with(key: str, suffix: str) -> bool:
    return key.endswith(suffix) and (suffix.startswith(".") or key == suffix or key.endswith("." + suffix))


def _match(index: ShardIndex, templates: tuple[str, ...], shape: tuple[int, ...], dtype: torch.dtype, E: int) -> str | None:
    """None if `templates` give every expert's tensor of per-expert `shape`, else what is wrong."""
    rows = 0
    for t in templates:
        keys = [t.format(e=e) for e in range(E)] if "{e}" in t else [t]
        missing = [k for k in keys if k not in index.entries]
        if missing:
            return f"no {missing[0]}"
        if len({index.entries[k].shape for k in keys}) != 1:
            return f"the experts' {t} tensors differ in shape"
        for k in keys:
            entry = index.entries[k]
            piece = entry.shape if "{e}" in t else entry.shape[1:]
            if "{e}" not in t and (not entry.shape or entry.shape[0] != E):
                return f"{k} has shape {list(entry.shape)}, expected [{E}, ...]"
            if entry.dtype is None or not (entry.dtype.is_floating_point and dtype.is_floating_point):
                return f"{k} has dtype {entry.dtype}, the model computes in {dtype}"
            if len(piece) != len(shape) or tuple(piece[1:]) != tuple(shape[1:]):
                return f"{k} has shape {list(entry.shape)}, which does not fit {list(shape)}"
        rows += piece[0]
    if rows != shape[0]:
        return f"{list(templates)} give {rows} rows, expected {shape[0]}"
    return None


def plan_keys(
    adapter: MoEAdapter, model: torch.nn.Module, modules: dict[str, dict[str, torch.Tensor]], index: ShardIndex
) -> dict[str, dict[str, tuple[str, ...]]]:
    """For every experts module (`name -> {tensor: meta tensor [E, ...]}`), the checkpoint key templates
    of each tensor. Raises `NotStreamable` naming what was looked for when no layout fits."""
    candidates = _candidates(adapter, model)
    plan = {}
    for name, tensors in modules.items():
        problems = []
        for label, keys in candidates:
            found, problem = {}, None
            for tensor, meta in tensors.items():
                templates = keys(name, tensor)
                problem = f"{tensor}: not in the table" if not templates else None
                problem = problem or _match(index, templates, tuple(meta.shape[1:]), meta.dtype, meta.shape[0])
                if problem:
                    break
                found[tensor] = templates
            if problem is None:
                plan[name] = found
                break
            problems.append(f"{label}: {problem}")
        else:
            raise NotStreamable(f"the experts of {name} are not where mira-hf looks for them ({'; '.join(problems)})")
    return plan


# -- pre-quantized checkpoints ---------------------------------------------------------------------------
@dataclass(frozen=True)
class NativeKeys:
    """Where one quantized fused tensor of a pre-quantized checkpoint is: key templates of its weights and
    of their scales, each concatenated along dim 0 when there are several (`gate_proj`, `up_proj`)."""

    weights: tuple[str, ...]
    scales: tuple[str, ...]


def _config_dict(quantization) -> dict:
    return dict(quantization) if isinstance(quantization, dict) else quantization.to_dict()


def native_codec_name(quantization) -> str | None:
    """The codec serving a pre-quantized checkpoint's experts in the bytes it stores them in ("fp8_block",
    "mxfp4"), from config.json's `quantization_config`; None for a checkpoint that is not quantized.
    Raises `NotStreamable` naming the format of a quantized checkpoint served otherwise."""
    if not quantization:
        return None
    qc = _config_dict(quantization)
    method = qc.get("quant_method")
    if method == "fp8":
        unsupported = [
            f"{k}={qc.get(k)!r}"
            for k, ok in (
                ("weight_block_size", qc.get("weight_block_size") is not None),
                ("scale_fmt", qc.get("scale_fmt") in (None, "float")),
                ("expert_dtype", qc.get("expert_dtype") in (None, "fp8")),
                ("activation_scheme", qc.get("activation_scheme") in (None, "dynamic")),
            )
            if not ok
        ]
        if unsupported:
            raise NotStreamable(
                f"it is an FP8 checkpoint with {', '.join(unsupported)}; mira-hf reads the experts of FP8 checkpoints "
                "with block scales (weight_block_size), float scales and dynamic activations itself"
            )
        return "fp8_block"
    if method == "mxfp4":
        return "mxfp4"
    raise NotStreamable(
        f"it is pre-quantized with quant_method={method!r}, whose experts transformers' quantizer reads; mira-hf reads "
        "the experts of 'fp8' (block-wise) and 'mxfp4' checkpoints itself"
    )


def _fp8_keys(module: str, tensor: str, templates: tuple[str, ...]) -> NativeKeys:
    """FP8: the planned weight keys, each with its `weight_scale_inv` (a stacked `<fused>_scale_inv`)."""
    scales = tuple(t[: -len("weight")] + "weight_scale_inv" if t.endswith(".weight") else t + "_scale_inv" for t in templates)
    return NativeKeys(templates, scales)


def _mxfp4_keys(module: str, tensor: str, templates: tuple[str, ...]) -> NativeKeys:
    """MXFP4 (gpt-oss): `<fused>_blocks` and `<fused>_scales`, stacked over experts."""
    return NativeKeys((f"{module}.{tensor}_blocks",), (f"{module}.{tensor}_scales",))


# codec -> (NativeKeys of a quantized tensor, whether its weights are planned with the unquantized ones first)
_NATIVE_KEYS = {"fp8_block": (_fp8_keys, True), "mxfp4": (_mxfp4_keys, False)}


def _present(index: ShardIndex, templates: tuple[str, ...], E: int) -> str | None:
    """None if every expert's tensor of `templates` is in the checkpoint, else what is missing."""
    for t in templates:
        if "{e}" in t:
            missing = [t.format(e=e) for e in range(E) if t.format(e=e) not in index.entries]
            if missing:
                return f"no {missing[0]}"
        elif t not in index.entries:
            return f"no {t}"
        elif not index.entries[t].shape or index.entries[t].shape[0] != E:
            return f"{t} has shape {list(index.entries[t].shape)}, expected [{E}, ...]"
    return None


def plan_native_keys(
    codec_name: str,
    quantization,
    adapter: MoEAdapter,
    model: torch.nn.Module,
    modules: dict[str, dict[str, torch.Tensor]],
    index: ShardIndex,
):
    """`plan_keys` for a pre-quantized checkpoint: (keys of the tensors it stores unquantized (biases), cast
    to the model dtype as usual; `NativeKeys` of the quantized ones, read as stored; the codec serving
    them). Raises `NotStreamable` naming what was looked for when the checkpoint does not fit."""
    from .quant import make_codec

    keys_of, plan_weights = _NATIVE_KEYS[codec_name]
    plain = {n: {t: m for t, m in ts.items() if plan_weights or t.endswith("_bias")} for n, ts in modules.items()}
    keys = plan_keys(adapter, model, plain, index)
    native: dict[str, dict[str, NativeKeys]] = {}
    for name, tensors in modules.items():
        native[name] = {}
        E = next(iter(tensors.values())).shape[0]
        for tensor in [t for t in tensors if not t.endswith("_bias")]:
            nk = keys_of(name, tensor, keys[name].pop(tensor, ()))
            problem = _present(index, nk.weights, E) or _present(index, nk.scales, E)
            if problem:
                raise NotStreamable(f"the {codec_name} experts of {name} are not where mira-hf looks for them ({problem})")
            native[name][tensor] = nk
    pieces = {tensor: len(nk.weights) for per in native.values() for tensor, nk in per.items()}
    if any(len(nk.weights) != pieces[t] for per in native.values() for t, nk in per.items()):
        raise NotStreamable("its experts modules store their weights in different numbers of tensors")
    options = {"block_size": _config_dict(quantization).get("weight_block_size")} if codec_name == "fp8_block" else {}
    return keys, native, make_codec(codec_name, pieces=pieces, **options)


# -- loading ---------------------------------------------------------------------------------------------
@dataclass
class StreamedExperts:
    """The experts a skeleton load left out: their meta tensors (shapes, dtypes) and where to read them."""

    index: ShardIndex
    meta: dict[str, dict[str, torch.Tensor]]  # module path -> {tensor name: meta tensor [E, ...]}
    keys: dict[str, dict[str, tuple[str, ...]]]  # module path -> {tensor name: checkpoint key templates}
    # A pre-quantized checkpoint: module path -> {tensor name: NativeKeys} of its quantized tensors, read as
    # stored; `codec` serves them (its records hold those tensors).
    native: dict[str, dict[str, NativeKeys]] = field(default_factory=dict)
    codec: object | None = None
    report: LoadReport = field(default_factory=LoadReport)  # read and h2d seconds go here
    _handles: dict[str, object] = field(default_factory=dict)
    _fds: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _staging: list = field(default_factory=list)  # free (page-locked buffer, CUDA stream) pairs of the readers

    def expert_fn(self, module: str, device: torch.device | str | None = None) -> Callable[[int], dict[str, torch.Tensor]]:
        """`e -> {tensor name: expert e's tensor}` of one experts module, read from the shards and cast to
        the model's dtype exactly as transformers' loader casts it. The quantized tensors of a pre-quantized
        checkpoint come as stored, with their scales (`<name><codec.scale_suffix>`). `device`: where the pieces
        go as they are read (concatenated and cast there: the same bits, without a host copy in between)."""
        meta, keys, native = self.meta[module], self.keys[module], self.native.get(module, {})

        def expert(e: int) -> dict[str, torch.Tensor]:
            out = {name: self._read_all(templates, e, device).to(meta[name].dtype) for name, templates in keys.items()}
            for name, nk in native.items():
                out[name] = self._read_all(nk.weights, e, device)
                out[name + self.codec.scale_suffix] = self._read_all(nk.scales, e, device)
            return out

        expert.thread_safe = True  # pread of each piece: several readers may call it at once (`RecordEncoder`)
        return expert

    def _read_all(self, templates: tuple[str, ...], e: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Expert e's tensor of `templates`, its pieces concatenated along dim 0 (transformers' Concatenate(dim=1)),
        on `device` (the host where None)."""
        device = torch.device(device) if device is not None else None
        pieces = [self._read(t, e, device) for t in templates]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)

    def _read(self, template: str, e: int, device: torch.device | None = None) -> torch.Tensor:
        key = template.format(e=e)
        entry = self.index.entries[key]
        row = None if "{e}" in template else e
        try:
            if entry.offset is None or entry.dtype is None:  # a dtype torch has no name for: safetensors reads it
                with self._lock:  # a safetensors handle is not shared between threads
                    f = self._handles.get(entry.file) or self._open(entry.file)
                    t0 = time.perf_counter()
                    t = f.get_tensor(key) if row is None else f.get_slice(key)[e]
                self.report.add("read", time.perf_counter() - t0, t.nbytes)
            elif device is not None and device.type == "cuda":
                return self._pread_to_device(entry, row, device)
            else:
                shape = entry.shape if row is None else entry.shape[1:]
                t = torch.empty(shape, dtype=entry.dtype)
                with self.report.span("read", t.nbytes):
                    self._pread(entry, row, t.view(-1).view(torch.uint8))
        except Exception as exc:
            raise CheckpointError(
                f"could not read {key} from {entry.file}: {exc}. The file changed or is corrupted: copy it again."
            ) from exc
        if device is None or device.type == "cpu":
            return t
        with self.report.span("h2d", t.nbytes):
            return t.to(device)

    def _pread(self, entry: _Entry, row: int | None, dst: torch.Tensor) -> None:
        """Read `entry`'s bytes (row `row` of it along dim 0 where given) into `dst` (uint8, host, contiguous,
        its size) with `pread`: the GIL is released while the bytes move, so readers on several threads read
        at once, each straight into its destination."""
        view = memoryview(dst.numpy()).cast("B")
        offset = entry.offset + (0 if row is None else row * len(view))
        with self._lock:
            fd = self._fds.get(entry.file)
            if fd is None:
                fd = self._fds[entry.file] = os.open(entry.file, os.O_RDONLY)
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                raise OSError(f"the file ends {len(view) - got} bytes before the tensor does")
            got += n

    def _pread_to_device(self, entry: _Entry, row: int | None, device: torch.device) -> torch.Tensor:
        """`entry`'s tensor (or row) on a CUDA device: read into a page-locked staging buffer (reused for
        the whole load, so no page is faulted in or locked again), then copied at link speed on the buffer's
        own stream. The copy is waited for before returning: the buffer goes back to the next read, and the
        tensor is complete for whichever stream uses it next."""
        shape = entry.shape if row is None else entry.shape[1:]
        out = torch.empty(shape, dtype=entry.dtype, device=device)  # on the caller's stream, as any tensor
        nbytes = out.numel() * out.element_size()
        if nbytes == 0:
            return out
        staging, stream = self._take_staging(nbytes, device)
        try:
            with self.report.span("read", nbytes):
                self._pread(entry, row, staging[:nbytes])
            with self.report.span("h2d", nbytes):
                # the block `out` got may have been freed by work still queued on the caller's stream
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    out.view(-1).view(torch.uint8).copy_(staging[:nbytes], non_blocking=True)
                stream.synchronize()
        finally:
            with self._lock:
                self._staging.append((staging, stream))
        return out

    def _take_staging(self, nbytes: int, device: torch.device) -> tuple[torch.Tensor, torch.cuda.Stream]:
        """A page-locked staging buffer of at least `nbytes` and a stream for its copies, for one read: kept
        for the whole load (one per reader at most), so pages are locked once, not once per piece."""
        with self._lock:
            fits = [i for i, (buf, _) in enumerate(self._staging) if buf.numel() >= nbytes]
            if fits:
                return self._staging.pop(fits[0])
            if self._staging:  # too small for this piece: unlocked when dropped, a larger one is locked instead
                self._staging.pop()
        from .pinned import pinned_empty

        with torch.cuda.device(device):  # page-locked in the context of the device it is copied to
            return pinned_empty(nbytes), torch.cuda.Stream(device)

    def _open(self, path: str):
        from safetensors import safe_open

        try:  # pread: read each expert's bytes into its tensor; the shards are never mapped into the process
            f = safe_open(path, framework="pt", backend="pread")
        except TypeError:  # safetensors < 0.7 has no `backend`: memory-mapped (file pages, not held memory)
            f = safe_open(path, framework="pt")
        self._handles[path] = f
        return f

    def close(self) -> None:
        self._handles.clear()
        with self._lock:
            self._staging.clear()  # the readers' staging buffers: unlocked once the last copy from them is done
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def load_model(
    name_or_path,
    adapter: MoEAdapter,
    hf_kwargs: dict,
    stream_experts: bool | None,
    host_budget_set: bool,
    model_type: str | None = None,
    encoded: bool = False,
    quantization_config: dict | None = None,
) -> tuple[torch.nn.Module, StreamedExperts | None]:
    """Load the model for wrapping: without its routed experts when they are streamed (the second value
    says where to read them), else whole through transformers (`None`).

    Streaming is used when `stream_experts` is True, or when it is None (auto) and a host budget is set,
    the checkpoint is larger than the available host memory or it is pre-quantized in a format served in
    its own bytes (`native_codec_name`). When it is wanted but impossible (or the checkpoint is quantized
    in another format), the model is loaded whole with a warning, unless the user asked for streaming
    explicitly (`UnsupportedModelError`) or the checkpoint does not fit in host memory (`BudgetError`),
    both raised before any weight is read. `model_type` and `quantization_config` are config.json's.
    `encoded`: the experts will be encoded into records (or read from the record cache), so the model
    never needs them: streamed whenever the checkpoint allows, else loaded whole without a warning.
    """
    auto = auto_model_class(model_type)
    if stream_experts is False:
        return auto.from_pretrained(name_or_path, **hf_kwargs), None
    wanted = bool(stream_experts) or host_budget_set
    try:
        native = native_codec_name(quantization_config)
        index = ShardIndex.find(name_or_path, hf_kwargs)
        available = available_host_bytes()
        wanted = wanted or native is not None or (available is not None and index.nbytes > available)
        if wanted or encoded:
            return load_without_experts(name_or_path, adapter, index, hf_kwargs, bool(stream_experts))
    except NotStreamable as exc:
        if wanted or quantization_config is not None:
            _cannot_stream(name_or_path, str(exc), None, bool(stream_experts))
    return auto.from_pretrained(name_or_path, **hf_kwargs), None


def auto_model_class(model_type: str | None):
    """The transformers auto class that builds `model_type` with its language-model head: the causal LM,
    else the image-text-to-text model (a vision-language MoE, whose text decoder holds the experts)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_without_experts(
    name_or_path, adapter: MoEAdapter, index: ShardIndex, hf_kwargs: dict, explicit: bool
) -> tuple[torch.nn.Module, StreamedExperts | None]:
    """`from_pretrained` without the routed experts; returns the model and where its experts are.

    Raises `NotStreamable` before loading anything when the model class cannot be built this way. If
    the experts modules do not match the checkpoint, the model is loaded whole (see `_cannot_stream`).
    """
    from transformers import AutoConfig

    names = ("revision", "cache_dir", "local_files_only", "token", "subfolder", "trust_remote_code")
    config = AutoConfig.from_pretrained(name_or_path, **{k: hf_kwargs[k] for k in names if k in hf_kwargs})
    if getattr(config, "auto_map", None):
        raise NotStreamable("it defines its own modeling code (auto_map)")
    quantization = getattr(config, "quantization_config", None)
    native = native_codec_name(quantization)
    if native is not None:
        # The experts are read here; the other weights load as transformers loads this checkpoint where it
        # dequantizes (its dequantize path: FP8 linears to the model dtype; gpt-oss quantizes only experts).
        config.quantization_config = {**_config_dict(quantization), "dequantize": True}
        hf_kwargs = {**hf_kwargs, "config": config}
    base = auto_model_class(config.model_type)._model_mapping.get(type(config), None)
    if base is None:
        raise NotStreamable(f"{type(config).__name__} has no language-model class in transformers")
    state: dict[str, object] = {}
    block = block_size(_config_dict(quantization)) if native is not None else None
    partial = []  # FP8 weights transformers cannot dequantize (see fp8_partial_blocks): set after the load

    def ignore_keys(model: torch.nn.Module, names) -> None:
        """Checkpoint keys under `names` are keys the model lacks: never read, and not reported."""
        ignored = getattr(model, "_keys_to_ignore_on_load_unexpected", None)
        state.setdefault("ignored", ignored)
        patterns = [re.escape(name) for name in names]
        # (a set in recent transformers, a list in older ones: keep its type)
        if isinstance(ignored, list):
            model._keys_to_ignore_on_load_unexpected = ignored + patterns
        else:
            model._keys_to_ignore_on_load_unexpected = set(ignored or ()) | set(patterns)

    def strip_partial_blocks(model: torch.nn.Module) -> None:
        partial.extend(find_partial_block_weights(model, index, block) if block is not None else ())
        for w in partial:
            model.get_submodule(w.module).register_parameter(w.tensor, None)
        if partial:
            ignore_keys(model, [w.key for w in partial])  # the weight and its `_scale_inv`

    def strip_experts(model: torch.nn.Module) -> None:
        """Runs inside from_pretrained, right after the model is built on the meta device."""
        found = adapter.find_experts(model)
        modules = {name: dict(module.named_parameters(recurse=False)) for name, module in found}
        try:
            if not modules or not all(isinstance(getattr(m, "num_experts", None), int) for _, m in found):
                raise NotStreamable(f"no fused experts module matches {list(adapter.experts_globs)}")
            if native is None:
                keys, native_keys, codec = plan_keys(adapter, model, modules, index), {}, None
            else:
                keys, native_keys, codec = plan_native_keys(native, quantization, adapter, model, modules, index)
        except NotStreamable as exc:
            _cannot_stream(name_or_path, str(exc), index.nbytes, explicit)
            return
        for name, module in found:
            for n in modules[name]:
                module.register_parameter(n, None)
            module._is_hf_initialized = True  # nothing left for transformers to initialise
        ignore_keys(model, [name + "." for name in modules])  # the checkpoint's expert tensors
        state["experts"] = StreamedExperts(index, modules, keys, native_keys, codec)

    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        strip_experts(self)
        strip_partial_blocks(self)

    # A subclass for this one load, so no transformers class is touched; the model gets its own class back.
    namespace = {"__init__": __init__, "__module__": base.__module__, "__qualname__": base.__qualname__}
    model = type(base.__name__, (base,), namespace).from_pretrained(name_or_path, **hf_kwargs)
    model.__class__ = base
    if "ignored" in state:
        model._keys_to_ignore_on_load_unexpected = state["ignored"]
    set_partial_block_weights(model, partial, index, block)
    return model, state.get("experts")


def _cannot_stream(name_or_path, reason: str, nbytes: int | None, explicit: bool) -> None:
    """The experts cannot be streamed: raise if that cannot work or was asked for, else warn."""
    if explicit:
        raise UnsupportedModelError(
            f"LoaderConfig(stream_experts=True) was given, but the experts of {name_or_path!s} cannot be read one "
            f"at a time: {reason}. Drop stream_experts to load the whole checkpoint first, or register an adapter "
            "with checkpoint_keys=(ExpertKeys(...),) for this layout."
        )
    available = available_host_bytes()
    if nbytes is not None and available is not None and nbytes > available:
        raise BudgetError(
            f"the experts of {name_or_path!s} cannot be read one at a time ({reason}), and loading the whole "
            f"checkpoint ({nbytes:,} bytes) needs more host memory than is available ({available:,} bytes). "
            "Free host memory, or register an adapter with checkpoint_keys=(ExpertKeys(...),) for this layout."
        )
    warnings.warn(
        f"mira-hf: the experts of {name_or_path!s} cannot be read one at a time ({reason}); loading the whole "
        "checkpoint into host memory first.",
        stacklevel=4,
    )
