"""Loading a checkpoint without its routed experts, then reading them one expert at a time.

`transformers.from_pretrained` materialises every weight, so host memory at load would be the whole
checkpoint. Here transformers loads the model *without* the routed experts: a private subclass,
used for this one load, removes the expert parameters of each experts module right after
construction (still on the meta device), so the checkpoint's expert tensors are keys the model does
not have and transformers never reads them. The experts are then read from the safetensors shards
one expert at a time, straight into the `ExpertStore` records (`StreamedExperts`; the shards'
headers are read by `mira_hf.shards.ShardIndex`).

Peak host memory while loading ≈ non-expert weights + the store's host tier (`host_budget`) + one
expert's tensors, whatever the checkpoint's size.

Where each family keeps its experts on disk is data in `model_adapters` (`MoEAdapter.checkpoint_keys`),
found through transformers' own key renaming for families without a table, and always tried
under the fused in-memory names too (`mira_hf.expert_keys`). A checkpoint matching none of them is loaded the
ordinary way.
"""

from __future__ import annotations

import copy
import os
import re
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model_adapters import MoEAdapter

from .errors import BudgetError, CheckpointError, ConfigError, UnsupportedModelError
from .expert_keys import (
    NativeKeys,
    PerExpert,
    Rearranged,
    across_prefix,
    expert_key,
    expert_rows,
    key_candidates,
    native_codec_name,
    plan_keys,
    plan_native_keys,
    quantization_dict,
)
from .fp8_partial_blocks import block_size, find_partial_block_weights, set_partial_block_weights
from .load_report import LoadReport
from .resources import available_host_bytes
from .shards import GENERATION_CONFIG, NotStreamable, ShardEntry, ShardIndex, refetch, refetch_code


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
    # module path -> its key templates, for modules not in `keys` yet (planned at their first read)
    plan: Callable[[str], dict[str, tuple[str, ...]]] | None = None
    report: LoadReport = field(default_factory=LoadReport)  # read and h2d seconds go here
    _handles: dict[str, object] = field(default_factory=dict)
    _fds: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _staging: list = field(default_factory=list)  # free (page-locked buffer, CUDA stream) pairs of the readers

    def same_as(self, other: StreamedExperts) -> bool:
        """Whether `other` (from the model transformers built) has the same experts modules, tensors, shapes,
        dtypes and checkpoint keys as this one (from a skeleton), so the experts read through this one are
        the ones `other` would read."""

        def layout(s: StreamedExperts, module: str) -> dict:
            return {n: (tuple(t.shape), t.dtype) for n, t in s.meta[module].items()}

        return (
            self.meta.keys() == other.meta.keys()
            and not self.native
            and not other.native
            and all(layout(self, m) == layout(other, m) and self.keys.get(m) == other.keys.get(m) for m in self.meta)
        )

    def expert_fn(self, module: str, device: torch.device | str | None = None) -> Callable[[int], dict[str, torch.Tensor]]:
        """`e -> {tensor name: expert e's tensor}` of one experts module, read from the shards and cast to
        the model's dtype exactly as transformers' loader casts it. The quantized tensors of a pre-quantized
        checkpoint come as stored, with their scales (`<name><codec.scale_suffix>`). `device`: where the pieces
        go as they are read (concatenated and cast there: the same bits, without a host copy in between)."""
        if module not in self.keys:
            self.keys[module] = self.plan(module)
        meta, keys, native = self.meta[module], self.keys[module], self.native.get(module, {})

        def expert(e: int) -> dict[str, torch.Tensor]:
            out = {
                name: self._read_all(templates, e, device, meta[name].shape).to(meta[name].dtype)
                for name, templates in keys.items()
            }
            for name, nk in native.items():
                out[name] = self._read_all(nk.weights, e, device)
                out[name + self.codec.scale_suffix] = self._read_all(nk.scales, e, device)
            return out

        expert.thread_safe = True  # pread of each piece: several readers may call it at once (`RecordEncoder`)
        return expert

    def _read_all(
        self, templates: tuple[str, ...], e: int, device: torch.device | str | None = None, fused: torch.Size | None = None
    ) -> torch.Tensor:
        """Expert e's tensor of `templates`, its pieces concatenated along dim 0 (transformers' Concatenate(dim=1)),
        on `device` (the host where None). `fused`: the `[E, ...]` shape of the tensor read (`expert_rows`)."""
        device = torch.device(device) if device is not None else None
        if isinstance(templates, PerExpert):  # the converter's own operations on the expert's slices
            return templates.convert([self._read(t, e, device).unsqueeze(0) for t in templates])[0]
        pieces = [self._read(t, e, device, expert_key(t, templates, e), fused) for t in templates]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        return templates.undo(out) if isinstance(templates, Rearranged) else out

    def _read(
        self, template: str, e: int, device: torch.device | None = None, key: str | None = None, fused: torch.Size | None = None
    ) -> torch.Tensor:
        key = template.format(e=e) if key is None else key
        entry = self.index.entries[key]
        row = None if "{e}" in template else e
        shape = entry.shape if row is None else expert_rows(entry.shape, fused)
        try:
            if entry.offset is None or entry.dtype is None:  # a dtype torch has no name for: safetensors reads it
                with self._lock:  # a safetensors handle is not shared between threads
                    f = self._handles.get(entry.file) or self._open(entry.file)
                    t0 = time.perf_counter()
                    n = len(entry.shape) - len(shape)  # 1: row e of [E, ...]; 0: rows of expert e in [E * n, ...]
                    t = (
                        f.get_tensor(key)
                        if row is None
                        else f.get_slice(key)[e if n else slice(e * shape[0], (e + 1) * shape[0])]
                    )
                self.report.add("read", time.perf_counter() - t0, t.nbytes)
            elif device is not None and device.type == "cuda":
                return self._pread_to_device(entry, row, device, shape)
            else:
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

    def _pread(self, entry: ShardEntry, row: int | None, dst: torch.Tensor) -> None:
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

    def _pread_to_device(self, entry: ShardEntry, row: int | None, device: torch.device, shape: tuple[int, ...]) -> torch.Tensor:
        """`entry`'s tensor (or row) on a CUDA device: read into a page-locked staging buffer (reused for
        the whole load, so no page is faulted in or locked again), then copied at link speed on the buffer's
        own stream. The copy is waited for before returning: the buffer goes back to the next read, and the
        tensor is complete for whichever stream uses it next. `shape`: the entry's, or its row's (`expert_rows`)."""
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


def streaming_index(
    name_or_path,
    hf_kwargs: dict,
    stream_experts: bool | None,
    host_budget_set: bool,
    encoded: bool = False,
    config_json: dict | None = None,
) -> tuple[ShardIndex | None, bool, dict]:
    """Whether the experts are streamed: (the checkpoint's `ShardIndex` if so, else None; whether streaming is
    wanted, so that `load_model` warns or raises where it proves impossible; the keywords transformers then
    loads with: `hf_kwargs`, without `force_download` once the index has downloaded the weight files again, so
    that each is downloaded once per load, as transformers' own load does).

    Streaming is used when `stream_experts` is True, or when it is None (auto) and a host budget is set,
    the checkpoint, loaded in the dtype it is loaded in (`loaded_bytes`), is larger than the available host memory
    or it is pre-quantized in a format served in
    its own bytes (`native_codec_name`). When it is wanted but impossible (or the checkpoint is quantized
    in another format), the model is loaded whole with a warning, unless the user asked for streaming
    explicitly (`UnsupportedModelError`) or the checkpoint does not fit in host memory (`BudgetError`),
    both raised before any weight is read. `config_json`: the checkpoint's config.json. `encoded`: the experts
    will be encoded into records (or read from the record cache), so the model never needs them: streamed
    whenever the checkpoint allows, else loaded whole without a warning.
    """
    if stream_experts is False:
        return None, False, hf_kwargs
    config_json = config_json or {}
    quantization_config = config_json.get("quantization_config")
    wanted = bool(stream_experts) or host_budget_set
    try:
        native = native_codec_name(quantization_config)
        index = ShardIndex.find(name_or_path, hf_kwargs)
        fetched = {k: v for k, v in hf_kwargs.items() if k != "force_download"}
        refetch(name_or_path, GENERATION_CONFIG, hf_kwargs)  # with force_download: transformers then reads it fresh
        refetch_code(name_or_path, config_json, hf_kwargs)
        available = available_host_bytes()
        stored = load_dtype(config_json.get("dtype") or config_json.get("torch_dtype"))
        too_large = available is not None and index.loaded_nbytes(load_dtype(hf_kwargs.get("dtype"), stored), stored) > available
        wanted = wanted or native is not None or too_large
        if wanted or encoded:
            return index, wanted, fetched
        if hf_kwargs.get("force_download"):  # loaded whole: transformers reads the shards once all are downloaded
            index.wait_all()
        return None, wanted, fetched
    except NotStreamable as exc:
        if wanted or quantization_config is not None:
            _cannot_stream(name_or_path, exc, None, bool(stream_experts))
    return None, wanted, hf_kwargs


def load_dtype(dtype, config_dtype: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype transformers loads floating-point weights in, given from_pretrained's `dtype` (a dtype or its name):
    config.json's (`config_dtype`) under "auto"; None where each weight keeps its own (no dtype in config.json, or
    one per sub-model)."""
    dtype = config_dtype if dtype in (None, "auto") else dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def load_model(
    name_or_path,
    adapter: MoEAdapter,
    hf_kwargs: dict,
    index: ShardIndex | None,
    wanted: bool,
    stream_experts: bool | None,
    config_json: dict,
    model_class: type,
) -> tuple[torch.nn.Module, StreamedExperts | None, dict]:
    """Load the model for wrapping: without its routed experts when they are streamed (`index`, from
    `streaming_index`; the second value says where to read them), else whole through transformers (`None`); the
    third is the loading info transformers reports (`output_loading_info`), the streamed experts in no list.
    `config_json`: the checkpoint's config.json; `model_class`: the class to load it as (`model_class_of`)."""
    quantization_config = config_json.get("quantization_config")
    if index is not None:
        index.wait_all()  # every shard is there before transformers looks for them: it downloads none again
        try:
            return load_without_experts(name_or_path, adapter, index, hf_kwargs, bool(stream_experts), model_class)
        except NotStreamable as exc:
            if wanted or quantization_config is not None:
                _cannot_stream(name_or_path, exc, None, bool(stream_experts))
    if quantization_config is not None and _is_native(quantization_config):
        hf_kwargs = dequantizing(read_config(name_or_path, hf_kwargs, model_class), hf_kwargs)
    model, info = _from_pretrained(model_class, name_or_path, hf_kwargs)
    return model, None, info


def _from_pretrained(cls, name_or_path, hf_kwargs: dict) -> tuple[torch.nn.Module, dict]:
    """`cls.from_pretrained(name_or_path, **hf_kwargs)` and the loading info it reports (missing, unexpected and
    mismatched keys, error messages: what `output_loading_info=True` returns beside the model)."""
    return cls.from_pretrained(name_or_path, **hf_kwargs, output_loading_info=True)


def runs_own_code(config_json: dict, trust_remote_code: bool) -> bool:
    """Whether transformers builds a checkpoint of config.json with the checkpoint's own code (`auto_map`), as its auto
    classes decide: where trusted, or where transformers has no classes for the model type (it then asks for trust).
    A known model type without trust is built by transformers' own classes, its `auto_map` unused."""
    from transformers import CONFIG_MAPPING

    return "auto_map" in config_json and (trust_remote_code or config_json.get("model_type") not in CONFIG_MAPPING)


def model_class_of(config_json: dict, given: type | None = None, remote: bool = False):
    """The transformers class a checkpoint loads as: `given` (a model class, or an auto class such as
    `AutoModelForImageTextToText`), checked against config.json's model type, else `auto_model_class` of config.json
    (`remote`: built from the checkpoint's own code, `runs_own_code`). Raises `ConfigError` before anything is read
    where `given` cannot build that model type."""
    model_type = config_json.get("model_type")
    if given is None:
        return auto_model_class(model_type, config_json.get("architectures"), remote)
    from transformers import CONFIG_MAPPING, PreTrainedModel

    auto = isinstance(given, type) and hasattr(given, "_model_mapping")
    if not auto and not (isinstance(given, type) and issubclass(given, PreTrainedModel)):
        raise ConfigError(
            f"model_class={given!r} is neither a transformers model class nor an auto class. Pass one "
            "(AutoModelForImageTextToText, Qwen3VLMoeForConditionalGeneration, ...), or leave model_class out for the "
            "class AutoModelForCausalLM picks."
        )
    if model_type not in CONFIG_MAPPING:  # remote code, or a type this transformers does not know: not checkable
        return given
    config_class = CONFIG_MAPPING[model_type]
    if auto:
        if config_class not in given._model_mapping:
            raise ConfigError(
                f"model_class={given.__name__} has no class for model_type {model_type!r} ({config_class.__name__}) "
                "in this transformers. Pass an auto class that maps it, the model class itself, or leave model_class "
                "out for the class AutoModelForCausalLM picks."
            )
        return given
    builds = (config_class, *getattr(config_class, "sub_configs", {}).values())  # a text-only class of a composite
    if given.config_class not in builds:
        raise ConfigError(
            f"model_class={given.__name__} builds {given.config_class.__name__} models; this checkpoint is model_type "
            f"{model_type!r} ({config_class.__name__}). Pass a class of that type, or leave model_class out."
        )
    return given


def _is_native(quantization_config: dict) -> bool:
    """Whether config.json's `quantization_config` names a format mira-hf serves in its own bytes."""
    try:
        return native_codec_name(quantization_config) is not None
    except NotStreamable:  # another quantized format: transformers loads it its own way
        return False


def dequantizing(config, hf_kwargs: dict) -> dict:
    """`hf_kwargs` that load a checkpoint of `config` in a format mira-hf serves in its own bytes (FP8 with block
    scales, MXFP4) as transformers loads it where it dequantizes: FP8 linears in the model dtype, MXFP4 experts in
    bf16, and none of transformers' own kernels for the format (which transformers ≥ 5.25 fetches from the hub
    for MXFP4, even on a CPU). mira-hf decodes such experts exactly as that path does. Other checkpoints:
    `hf_kwargs` as given."""
    quantization = getattr(config, "quantization_config", None)
    if native_codec_name(quantization) is None:
        return hf_kwargs
    config.quantization_config = {**quantization_dict(quantization), "dequantize": True}
    overrides = config_overrides(config, hf_kwargs)  # set on `config` already (`read_config`): not the model's
    return {**{k: v for k, v in hf_kwargs.items() if k not in overrides}, "config": config}


def auto_model_class(model_type: str | None, architectures: list[str] | None = None, remote: bool = False):
    """The transformers class that builds a checkpoint of `model_type` with its head, as transformers' auto classes
    pick it: the causal LM; else the image-text-to-text model (a vision-language MoE, whose text decoder holds
    the experts); else the sequence-to-sequence model (an encoder-decoder: Switch Transformers); else, for a family
    with none of these (a token classifier, say), the class config.json names in `architectures`. A checkpoint built
    from its own code (`remote`: `runs_own_code`) and a type transformers does not know go to the causal-LM auto
    class, which reads the `auto_map`. Raises `UnsupportedModelError` where transformers has no class for it."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM, PreTrainedModel
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    if remote or model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type not in transformers.CONFIG_MAPPING:
        return AutoModelForCausalLM
    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    if model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForSeq2SeqLM
    for name in architectures or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
            return cls
    raise UnsupportedModelError(
        f"model_type {model_type!r} has no causal-LM or image-text-to-text class in transformers "
        f"{transformers.__version__}, and config.json names none it has (architectures={architectures!r}). Load it "
        "with its transformers class and wrap it: MiraMoEModel.wrap(SomeModelClass.from_pretrained(path))."
    )


def load_without_experts(
    name_or_path, adapter: MoEAdapter, index: ShardIndex, hf_kwargs: dict, explicit: bool, model_class: type
) -> tuple[torch.nn.Module, StreamedExperts | None, dict]:
    """`from_pretrained` without the routed experts, as `model_class` (`model_class_of`) loads it; returns
    the model, where its experts are and the loading info transformers reports (the experts' keys are not the
    model's, nor ignored checkpoint keys: in no list).

    Raises `NotStreamable` before loading anything when the model class cannot be built this way. If
    the experts modules do not match the checkpoint, the model is loaded whole (see `_cannot_stream`).
    """
    config = _model_config(name_or_path, hf_kwargs, model_class)
    quantization = getattr(config, "quantization_config", None)
    native = native_codec_name(quantization)
    hf_kwargs = dequantizing(config, hf_kwargs)  # the experts are read here; the other weights as transformers loads them
    base = _model_class(config, model_class)
    state: dict[str, object] = {}
    block = block_size(quantization_dict(quantization)) if native is not None else None
    partial = []  # FP8 weights transformers cannot dequantize (see fp8_partial_blocks): set after the load

    def ignore_keys(model: torch.nn.Module, names, exact: bool = False) -> None:
        """Checkpoint keys under `names` (`exact`: named so) are keys the model lacks: never read, and not reported."""
        ignored = getattr(model, "_keys_to_ignore_on_load_unexpected", None)
        state.setdefault("ignored", ignored)
        patterns = [re.escape(name) + ("$" if exact else "") for name in names]
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
        layout = adapter.experts_layout
        originals = {name: layout.parameters(module) for name, module in found}
        try:
            if not originals or not all(layout.num_experts(m) for _, m in found):
                raise NotStreamable(f"no fused experts module matches {list(adapter.experts_globs)}")
            modules = {name: _per_expert(layout, module, originals[name]) for name, module in found}
            if native is None:
                keys = plan_keys(adapter, model, modules, index, key_mapping=hf_kwargs.get("key_mapping"))
                native_keys, codec = {}, None
            else:
                keys, native_keys, codec = plan_native_keys(native, quantization, adapter, model, modules, index)
        except NotStreamable as exc:
            dtype = load_dtype(hf_kwargs.get("dtype"), load_dtype(getattr(config, "dtype", None)))
            _cannot_stream(name_or_path, exc, index.loaded_nbytes(dtype), explicit)  # loaded whole, dequantized
            return
        for name, module in found:
            for n in modules[name]:
                layout.put(module, n, None)
            module._is_hf_initialized = True  # nothing left for transformers to initialise
        state["stripped"] = [(module, originals[name]) for name, module in found]
        # the expert tensors mira reads, under the names transformers gives what it would load into them; any other
        # key under an experts module is reported unexpected, as transformers' own load reports it
        names = [f"{name}.{n}" for name, tensors in modules.items() for n in tensors]
        across = across_prefix(model, index)
        if across is not None:  # the checkpoint names the base model otherwise: transformers reports its names
            names += [f"{path}.{n}" for name, tensors in modules.items() if (path := across.path(name)) for n in tensors]
        ignore_keys(model, names, exact=True)
        state["experts"] = StreamedExperts(index, modules, keys, native_keys, codec)

    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        strip_experts(self)
        strip_partial_blocks(self)

    def _initialize_missing_keys(self, *args, **kwargs):
        """A parent's `_init_weights` may reach the experts' tensors (`module.experts.gate_up_proj`): during it
        they are their meta tensors again, flagged as loaded, which transformers' init functions leave alone."""
        stripped, layout = state.get("stripped", ()), adapter.experts_layout
        for module, tensors in stripped:
            for n, meta in tensors.items():
                meta._is_hf_initialized = True
                layout.put(module, n, meta)
        try:
            return base._initialize_missing_keys(self, *args, **kwargs)
        finally:
            for module, tensors in stripped:
                for n in tensors:
                    layout.put(module, n, None)

    # A subclass for this one load, so no transformers class is touched; the model gets its own class back.
    namespace = {"__init__": __init__, "_initialize_missing_keys": _initialize_missing_keys}
    namespace |= {"__module__": base.__module__, "__qualname__": base.__qualname__}
    model, info = _from_pretrained(type(base.__name__, (base,), namespace), name_or_path, hf_kwargs)
    model.__class__ = base
    if "ignored" in state:
        model._keys_to_ignore_on_load_unexpected = state["ignored"]
    set_partial_block_weights(model, partial, index, block)
    return model, state.get("experts"), info


# hf_kwargs the skeleton is built with as from_pretrained builds the model (others may change the model or config).
_SKELETON_KWARGS = ("dtype", "revision", "cache_dir", "local_files_only", "token", "subfolder", "trust_remote_code")


def build_skeleton(
    name_or_path, adapter: MoEAdapter, index: ShardIndex, hf_kwargs: dict, model_class: type
) -> tuple[torch.nn.Module, StreamedExperts]:
    """The model on the meta device, built from config.json as `model_class.from_pretrained` builds it
    (`model_class_of`), without its routed
    experts, and where to read them: the experts are read into the store while later shards still arrive,
    before transformers loads the other weights. Each module's key templates are planned when its experts
    are first read (waiting only for their shards). Raises `NotStreamable` where the skeleton could differ
    from the model transformers builds (extra from_pretrained arguments, a pre-quantized checkpoint, a dtype
    only the weights give); `load_without_experts` then builds the model first."""
    extra = sorted(set(hf_kwargs) - set(_SKELETON_KWARGS))
    if extra:
        raise NotStreamable(f"from_pretrained was given {extra}")
    config = _model_config(name_or_path, hf_kwargs, model_class)
    if getattr(config, "quantization_config", None):
        raise NotStreamable("it is pre-quantized")
    dtype = hf_kwargs.get("dtype", "auto")
    dtype = getattr(config, "dtype", None) if dtype == "auto" else dtype
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(dtype, torch.dtype):
        raise NotStreamable(f"the model's dtype is not given by its config ({dtype!r})")
    model_class = _model_class(config, model_class)
    text_config = getattr(config, "sub_configs", {}).get("text_config")
    if text_config is not None and getattr(model_class, "config_class", None) is text_config:
        config = config.get_text_config()  # the text-only model of a composite checkpoint, as the auto class builds it
    with torch.device("meta"):
        model = model_class._from_config(config, dtype=dtype)
    found = adapter.find_experts(model)
    if not found or not all(adapter.experts_layout.num_experts(m) for _, m in found):
        raise NotStreamable(f"no fused experts module matches {list(adapter.experts_globs)}")
    layout = adapter.experts_layout
    meta = expert_tensors(layout, found)
    for name, module in found:
        for n in meta[name]:
            layout.put(module, n, None)

    candidates = key_candidates(adapter, model, index, meta)  # once: transformers' renaming takes a while

    def plan(name: str) -> dict[str, tuple[str, ...]]:
        return plan_keys(adapter, model, {name: meta[name]}, index, candidates)[name]

    return model, StreamedExperts(index, meta, {}, plan=plan)


def expert_tensors(layout, found) -> dict[str, dict[str, torch.Tensor]]:
    """Each found experts module's (path, module) expert tensors as `[E, ...]`, as the store reads them."""
    return {name: _per_expert(layout, module, layout.parameters(module)) for name, module in found}


def _per_expert(layout, module: torch.nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An experts module's (meta) expert tensors as `[E, ...]`, as the store reads them (`MoEAdapter.experts_layout`)."""
    return {n: layout.per_expert(module, n, p) for n, p in params.items()}


def _model_config(name_or_path, hf_kwargs: dict, model_class: type):
    """config.json as `model_class.from_pretrained` reads it; `NotStreamable` for a model built from its own code
    (`runs_own_code`: a checkpoint's `auto_map` of a model type transformers knows is unused without trust)."""
    config = read_config(name_or_path, hf_kwargs, model_class)
    if not is_model_class(model_class) and runs_own_code(config.to_dict(), bool(hf_kwargs.get("trust_remote_code"))):
        raise NotStreamable(
            "it defines its own modeling code (auto_map)", "pass trust_remote_code=False to build transformers' own class"
        )
    return config


def is_model_class(cls) -> bool:
    """Whether `cls` is a model class (its `from_pretrained` builds it, config.json's `auto_map` unused), not an auto
    class (which picks one by config.json's model type or `auto_map`)."""
    return isinstance(cls, type) and not hasattr(cls, "_model_mapping")


def read_config(name_or_path, hf_kwargs: dict, model_class: type):
    """The config `model_class.from_pretrained(name_or_path, **hf_kwargs)` builds its model with: a copy of the
    config object given as `config`, else the config read from `config` (a path, which only a model class reads:
    `MiraMoEModel.from_pretrained` drops it for an auto class, as the auto class ignores it) or from the checkpoint,
    with the model class's own config class (whatever model type the file names) or, for an auto class, as
    `AutoConfig` reads it, and the keywords that name its attributes set on it (`config_overrides`)."""
    from transformers import AutoConfig, PretrainedConfig

    given = hf_kwargs.get("config")
    if isinstance(given, PretrainedConfig):
        return copy.deepcopy(given)
    where = name_or_path if given is None else given
    kwargs = _config_kwargs(hf_kwargs)
    if is_model_class(model_class):
        kwargs.pop("trust_remote_code", None)  # (a config class would keep it as an attribute)
        config = model_class.config_class.from_pretrained(where, **kwargs)
    else:
        config = AutoConfig.from_pretrained(where, **kwargs)
    for name, value in config_overrides(config, hf_kwargs).items():
        setattr(config, name, value)
    return config


# from_pretrained keywords that a config may have an attribute of the same name for, but which are no override of it
_LOADING_KWARGS = frozenset(
    {"config", "dtype", "torch_dtype", "quantization_config", "attn_implementation", "experts_implementation"}
)


def config_overrides(config, hf_kwargs: dict) -> dict:
    """The keywords of `hf_kwargs` that `from_pretrained` sets on the config it reads (`num_experts_per_tok=1`,
    `output_router_logits=True`): those naming attributes of `config`. None where a config object is given, as
    transformers then passes every keyword to the model."""
    from transformers import PretrainedConfig

    if isinstance(hf_kwargs.get("config"), PretrainedConfig):
        return {}
    skip = _LOADING_KWARGS | set(_config_kwargs(hf_kwargs))
    return {k: v for k, v in hf_kwargs.items() if k not in skip and hasattr(config, k)}


def own_code_skeleton(name_or_path, model_class: type, hf_kwargs: dict) -> torch.nn.Module | None:
    """The model a trusted checkpoint's own code (`runs_own_code`) builds, on the meta device, from config.json alone
    (no weight read), as `model_class.from_pretrained` would build it; None where its code cannot build it there."""
    try:
        config = read_config(name_or_path, hf_kwargs, model_class)
        with torch.device("meta"):
            if not is_model_class(model_class):  # an auto class: it reads config.json's auto_map
                return model_class.from_config(config, trust_remote_code=True)
            return model_class._from_config(config)
    except Exception:  # code that does not build on the meta device: checked once loaded instead
        return None


def _config_kwargs(hf_kwargs: dict) -> dict:
    """The keywords of `hf_kwargs` that AutoConfig.from_pretrained takes too (where the config is read from)."""
    names = ("revision", "cache_dir", "local_files_only", "token", "subfolder", "trust_remote_code")
    return {k: hf_kwargs[k] for k in names if k in hf_kwargs}


def _model_class(config, cls: type):
    """The transformers class `cls.from_pretrained` builds for `config` (`cls` itself, or an auto class's mapping)."""
    base = cls._model_mapping.get(type(config), None) if hasattr(cls, "_model_mapping") else cls
    if base is None:
        raise NotStreamable(f"{type(config).__name__} has no language-model class in transformers")
    return base


def _cannot_stream(name_or_path, why: NotStreamable, nbytes: int | None, explicit: bool) -> None:
    """The experts cannot be streamed: raise if that cannot work or was asked for, else warn."""
    reason = str(why)
    if not why.whole_helps:  # nothing to load, one way or the other
        raise CheckpointError(f"could not read the checkpoint at {name_or_path!s}: {reason}. To load it, {why.remedy}.")
    if explicit:
        raise UnsupportedModelError(
            f"LoaderConfig(stream_experts=True) was given, but the experts of {name_or_path!s} cannot be read one "
            f"at a time: {reason}. Drop stream_experts to load the whole checkpoint first, or {why.remedy}."
        )
    available = available_host_bytes()
    if nbytes is not None and available is not None and nbytes > available:
        raise BudgetError(
            f"the experts of {name_or_path!s} cannot be read one at a time ({reason}), and loading the whole "
            f"checkpoint ({nbytes:,} bytes in the dtype it is loaded in) needs more host memory than is available "
            f"({available:,} bytes). "
            f"Free host memory, or {why.remedy}."
        )
    warnings.warn(
        f"mira-hf: the experts of {name_or_path!s} cannot be read one at a time ({reason}); loading the whole "
        "checkpoint into host memory first.",
        stacklevel=4,
    )
