"""`MiraMoEModel`: load or wrap a transformers MoE model so its routed experts live in host memory.

The returned object *is* the transformers model (e.g. `MixtralForCausalLM`): `__call__`, `generate`,
`.config`, `.generation_config` and `.device` behave as usual. Its routed-experts modules are replaced,
per instance, by `MiraExperts` proxies; `model.mira` is the shared `ExpertManager`; `model.unload()`
gives back an ordinary model; `model.save_pretrained()` writes an ordinary checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import sys
import types
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from model_adapters import MoEAdapter, generic_adapter, get_adapter, registered_model_types
from model_adapters.base import AutoAdapter, auto_adapter, uses_experts_interface

from .budget import LayerInfo, plan_records, resolve_budget_bytes
from .checkpoint import (
    NotStreamable,
    StreamedExperts,
    available_host_bytes,
    load_model,
    missing_checkpoint_error,
    native_codec_name,
)
from .config import AUTO_LOSSLESS_MIN_RECORD_BYTES, MiraConfig, config_from_arguments
from .encode import encoder_for
from .errors import (
    BudgetError,
    CheckpointError,
    ConfigError,
    DeviceError,
    IncompatibleFileError,
    MiraError,
    UnsupportedModelError,
)
from .experts_impl import check_model_implementations, checked_set_experts_implementation
from .layout import IdentityCodec
from .load_report import LoadReport
from .manager import ExpertManager
from .predictors import build_predictor
from .proxy import KNOWN_EXPERT_TENSORS, LAYOUT_FLAGS, MiraExperts, MiraScaledExperts
from .quant import codec_for_config, codec_names, find_codec_entry, is_native
from .record_cache import RecordCache, default_root
from .saved_store import CorruptStoreError, SavedStore
from .settings import ManagerSettings
from .state import install as install_state
from .state import uninstall as uninstall_state
from .store import ExpertStore, codec_spec, over_host_budget

_HOW_TO_ADD = (
    "Pass MiraConfig(expert_layer_path='model.layers.*.mlp.experts') (the glob of its routed-experts modules), "
    "or register an adapter: model_adapters.register_adapter(MoEAdapter(name=..., model_types=(...,), experts_globs=(...,)))."
)


@dataclass
class _Target:
    """One routed-experts module to replace, found and validated before anything changes."""

    name: str
    parent: nn.Module
    attr: str
    module: nn.Module
    ordinal: int
    tensors: dict[str, torch.Tensor]
    requires_grad: dict[str, bool]


class MiraMoEModel:
    """Entry points. Not instantiated: `from_pretrained` and `wrap` return the transformers model."""

    def __init__(self) -> None:
        raise TypeError("Use MiraMoEModel.from_pretrained(...) or MiraMoEModel.wrap(model, mira_config).")

    @staticmethod
    def from_pretrained(
        name_or_path: str | os.PathLike, mira_config: MiraConfig | None = None, *, progress: bool = True, **hf_kwargs
    ):
        """Load a causal-LM MoE checkpoint: a local directory, or a hub id (downloaded into the Hugging Face
        cache as transformers does, honouring `revision`, `token`, `cache_dir`, `local_files_only` and
        `HF_HUB_OFFLINE`).

        Settings: `mira_config=MiraConfig(...)`, or MiraConfig's fields as keywords
        (`from_pretrained(path, gpu_budget=0.25, policy="lru")`); not both.

        With a `host_budget` (or a checkpoint larger than the available host memory, or
        `LoaderConfig(stream_experts=True)`), the routed experts are read from the safetensors shards one
        expert at a time straight into the store, so host memory at load stays near the non-expert
        weights plus `host_budget` (see `mira_hf.checkpoint`). The result is the same model.

        `hf_kwargs` go to `AutoModelForCausalLM.from_pretrained` (`AutoModelForImageTextToText` for a vision-language
        checkpoint, which has no causal-LM class) (`dtype`, `revision`, `trust_remote_code`, ...),
        except `device_map`: mira-hf places weights itself (non-experts on `mira_config.device`, experts in host memory).
        """
        cfg = config_from_arguments(mira_config, hf_kwargs, "MiraMoEModel.from_pretrained")
        if "device_map" in hf_kwargs:
            raise ConfigError(
                f"device_map={hf_kwargs['device_map']!r} was given, but mira-hf places weights itself: non-expert weights "
                "on MiraConfig.device, routed experts in host memory. Drop device_map and set MiraConfig(device=...)."
            )
        device = _resolve_device(cfg.device)
        trust = bool(hf_kwargs.get("trust_remote_code", False))
        config_dict = _raw_config(name_or_path, hf_kwargs)
        if "auto_map" in config_dict and not trust:
            raise UnsupportedModelError(
                f"{name_or_path!s} defines its own modeling code (auto_map in config.json). mira-hf runs it only if you "
                "trust it: pass trust_remote_code=True to MiraMoEModel.from_pretrained."
            )
        adapter = _resolve_adapter(config_dict.get("model_type"), cfg)  # fail before loading any weight
        _check_prequantized(cfg, config_dict.get("quantization_config"), name_or_path)
        hf_kwargs.setdefault("dtype", "auto")
        report = LoadReport()
        try:
            with report.span("model"):
                model, streamed = load_model(
                    name_or_path,
                    adapter,
                    hf_kwargs,
                    cfg.loader.stream_experts,
                    cfg.host_budget is not None,
                    config_dict.get("model_type"),
                    # encoded records never need the experts in the model ("auto" encodes only on a GPU)
                    encoded=cfg.quantization not in (None, "auto") or (cfg.quantization == "auto" and device.type == "cuda"),
                    quantization_config=config_dict.get("quantization_config"),
                )
            if streamed is not None and streamed.index.download_s:
                report.add("download", streamed.index.download_s)
        except MiraError:
            raise
        except Exception as exc:
            if type(exc).__name__ == "SafetensorError" or isinstance(exc, (OSError, EOFError)):
                raise CheckpointError(
                    f"could not read the checkpoint at {name_or_path!s}: {exc}. A weight file is missing, truncated or "
                    "corrupted: copy or download it again (nothing was changed)."
                ) from exc
            raise
        return MiraMoEModel._wrap(model, cfg, device, progress, streamed, report)

    @staticmethod
    def wrap(model: nn.Module, mira_config: MiraConfig | None = None, *, progress: bool = False, **config_fields):
        """Wrap a model already in CPU memory (e.g. in a notebook). Idempotent: wrapping a wrapped model
        with the same config returns it unchanged. Settings: `mira_config=MiraConfig(...)`, or MiraConfig's
        fields as keywords (`wrap(model, gpu_budget=0.25)`); not both."""
        cfg = config_from_arguments(mira_config, config_fields, "MiraMoEModel.wrap")
        if config_fields:
            fields = ", ".join(f.name for f in dataclasses.fields(MiraConfig))
            raise ConfigError(
                f"MiraMoEModel.wrap got unexpected keywords {', '.join(sorted(config_fields))}: it takes the model, "
                f"mira_config or MiraConfig's fields ({fields}), and progress."
            )
        manager = getattr(model, "mira", None)
        if isinstance(manager, ExpertManager):
            if model._mira_config == cfg:
                return model
            raise ConfigError(
                "this model is already wrapped with another MiraConfig. Call model.unload() first, then wrap it again."
            )
        return MiraMoEModel._wrap(model, cfg, _resolve_device(cfg.device), progress)

    @staticmethod
    def _wrap(
        model: nn.Module,
        cfg: MiraConfig,
        device: torch.device,
        progress: bool,
        streamed: StreamedExperts | None = None,
        report: LoadReport | None = None,
    ):
        """Replace the routed experts. `streamed`: the model was loaded without them (`load_model`);
        they are read from the checkpoint into the store instead of taken from the modules. `report`:
        the load's stage timings (`model.mira_load_report()`)."""
        report = report if report is not None else LoadReport()
        config = getattr(model, "config", None)
        adapter = _resolve_adapter(getattr(config, "model_type", None), cfg)
        targets = _find_targets(model, adapter, streamed.meta if streamed else None)
        check_model_implementations(model)
        layers = [
            LayerInfo(t.ordinal, t.name, t.module.num_experts, adapter.top_k(t.parent, model.config, t.module.num_experts))
            for t in targets
        ]
        specs = {t.ordinal: {n: (tuple(p.shape[1:]), p.dtype) for n, p in t.tensors.items()} for t in targets}
        raw_bytes = {layer: IdentityCodec().plan(s).nbytes for layer, s in specs.items()}
        # A fractional budget is a share of the checkpoint's expert bytes, whatever the transfer format.
        all_bytes = sum(raw_bytes[li.ordinal] * li.num_experts for li in layers)
        budget_bytes = resolve_budget_bytes(cfg, all_bytes, device, lambda: _bytes_to_move(model, targets, device))
        native = streamed.codec if streamed is not None else None  # a pre-quantized checkpoint's own format
        user_cfg, cfg = cfg, _resolve_format(cfg, device, specs, raw_bytes, all_bytes, budget_bytes, native)
        codec = native if native is not None else codec_for_config(cfg.quantization, cfg.quant)
        placement = cfg.quant.placement if cfg.quantization is not None else "raw"
        # Record layouts: from saved records (store_path, or the record cache), else planned (lossless
        # reads the weights here: its records reserve room for their escapes).
        fingerprint = model_fingerprint(model, targets, specs)
        # what the model takes on the device once loaded: the rest may hold experts between the two passes
        after = budget_bytes + _bytes_to_move(model, targets, device) if device.type == "cuda" else 0
        encoder = encoder_for(device, max(raw_bytes.values(), default=0), progress, keep_free_bytes=after, report=report)
        if streamed is not None:
            streamed.report = report
        saved, cache = _saved_records(cfg, codec, fingerprint, streamed, specs)
        if cache is not None:
            cache.report = report
        layouts = _saved_layouts(codec, targets, specs, saved) if saved is not None else None
        if layouts is None and saved is not None:  # the saved layouts do not fit these experts
            if cache is None:
                raise IncompatibleFileError(
                    f"the expert store in {cfg.store_path} does not hold records of these experts in this format. Drop "
                    "store_path to encode again, then save a new store with model.mira.save_store(dir)."
                )
            cache.drop("its layouts do not fit this checkpoint")
            saved = None
        pinned = device.type == "cuda" and cfg.host_memory in ("auto", "pinned")
        store = ExpertStore(
            codec, pinned=pinned, host_budget_bytes=cfg.host_budget_bytes, offload_dir=cfg.offload_dir, encoder=encoder
        )
        if layouts is None and cfg.quantization is not None:
            layouts = {}
            # A streamed store all in host memory is page-locked layer by layer while the next layers are
            # planned, in order, while the rest of the store (at most its raw size) fits besides.
            early, reserved = streamed is not None and cfg.host_budget_bytes is None, 0
            with encoder.progress_pass(f"planning {codec.name} records", all_bytes):
                for i, t in enumerate(targets):
                    expert = _experts(t, streamed, encoder.device)
                    layouts[t.ordinal] = encoder.plan_layer(codec, specs[t.ordinal], t.module.num_experts, expert, key=t.ordinal)
                    nbytes = t.module.num_experts * layouts[t.ordinal].nbytes
                    unplanned = sum(raw_bytes[u.ordinal] * u.module.num_experts for u in targets[i + 1 :])
                    early = early and _host_has_room(reserved + nbytes + unplanned)
                    if early:
                        store.reserve({t.ordinal: nbytes})
                        reserved += nbytes
        layouts = layouts or {}
        try:  # experts kept on the device between the passes are given back if a check fails
            budget = plan_records(
                layers, budget_bytes, placement, codec, layouts, raw_bytes, round_up_from=_fraction(cfg.gpu_budget)
            )
            _check_device_memory(budget.device_bytes, device, model, targets)
            store_bytes = [(layouts[li.ordinal].nbytes if layouts else raw_bytes[li.ordinal]) * li.num_experts for li in layers]
            _check_offload_space(cfg, store_bytes)
            _check_host_memory(cfg, store_bytes, targets, streamed is not None, codec.exact)
            # The predictor (and its files) is checked before anything changes too.
            router_probs = RouterTable(adapter, targets)
            predictor = build_predictor(
                cfg.predictor, layers, router_probs, cfg.prediction, cfg.predictor_path, model, fingerprint
            )
        except BaseException:
            store.close()  # slabs page-locked while planning
            encoder.finish()
            raise
        encoding = cfg.quantization is not None and saved is None
        # Slabs page-locked ahead, for streamed experts only: experts in the model's host memory are freed one
        # layer at a time as they are stored, and slabs locked ahead would hold the whole store beside them.
        if streamed is not None:
            store.reserve(
                {
                    t.ordinal: t.module.num_experts * (layouts[t.ordinal].nbytes if layouts else raw_bytes[t.ordinal])
                    for t in targets
                }
            )

        # Validation done: from here on, any failure rolls back to the untouched model.
        # Exact records (uncompressed or lossless) restore exactly, so each layer's tensors are dropped as soon
        # as it is stored (peak host memory grows by one layer). Quantized records would restore only
        # approximately, so the originals are kept until every layer is stored and a failure can give them
        # back untouched.
        keep = {}
        stripped: list[_Target] = []
        try:
            with encoder.progress_pass(f"encoding {codec.name} records", all_bytes if encoding else 0):
                for t in _progress(targets, progress and not encoding, "reading experts" if streamed else "storing experts"):
                    saved = _add_layer(store, t, specs[t.ordinal], layouts.get(t.ordinal), streamed, saved, cache)
                    if streamed is not None:  # nothing in the model to free or to give back on failure
                        continue
                    if not store.exact:
                        keep[t.ordinal] = {n: t.module.get_parameter(n) for n in t.tensors}
                    for n in t.tensors:
                        t.module.register_parameter(n, None)
                    t.tensors = {}  # the store holds them now: drop the last reference, one layer at a time
                    stripped.append(t)
            encoder.finish()
            manager = ExpertManager(
                store,
                layers,
                budget,
                device,
                ManagerSettings.from_config(cfg),
                predictor=predictor,
                router_probs=router_probs,
                fingerprint=fingerprint,
                record_cache=cache,
            )
        except BaseException:
            for t in stripped:
                if t.ordinal in keep:
                    for n, p in keep[t.ordinal].items():
                        t.module.register_parameter(n, p)
                else:
                    _restore_tensors(t, store)
            store.close()
            encoder.finish()  # experts kept on the device between the passes
            raise
        finally:
            if streamed is not None:
                streamed.close()
        keep.clear()
        if cache is not None and saved is None:  # encoded here (or the entry was dropped): cache the records
            cache.write(store.slabs(), store.plans())
        proxy = MiraScaledExperts if adapter.input_scaled else MiraExperts
        proxies = []
        for t in targets:
            flags = {n: adapter.flag(t.module, n, default) for n, default in LAYOUT_FLAGS.items()}
            proxies.append(proxy(t.module, manager, t.ordinal, flags, cfg.cache.prefill_block_tokens))
            setattr(t.parent, t.attr, proxies[-1])
        model.to(device)
        # Per-instance hooks mark forward steps (the heat clock, serialised threads); always_call
        # releases the step even when the forward raises, so an interrupted generate leaves no lock.
        steps = _StepHooks(manager)
        hooks = (
            model.register_forward_pre_hook(steps.before, with_kwargs=True),
            model.register_forward_hook(steps.after, always_call=True),
        )
        model.mira = manager
        model._mira_config = user_cfg  # as given: wrapping again with it is a no-op
        model._mira_targets = targets
        model._mira_hooks = hooks
        model.unload = types.MethodType(_unload, model)
        model.save_pretrained = types.MethodType(_save_pretrained, model)
        model.set_experts_implementation = types.MethodType(checked_set_experts_implementation, model)
        # The experts as parameters (views of the store), and casts and moves that the store follows.
        replan = functools.partial(_replan, model, user_cfg, layers, targets)
        install_state(model, manager, proxies, {t.ordinal: t.requires_grad for t in targets}, replan)
        report.finish()
        model.mira_load_report = lambda: report
        if progress:  # the progress bars' last line: where the load's time went
            print(f"mira-hf: {report}", file=sys.stderr, flush=True)
        return model

    @staticmethod
    def unload(model: nn.Module) -> nn.Module:
        """Same as `model.unload()`."""
        return _unload(model)


# -- helpers --------------------------------------------------------------------------------------
def _resolve_format(
    cfg: MiraConfig, device: torch.device, specs: dict, raw_bytes: dict, all_bytes: int, budget_bytes: int, native=None
):
    """`cfg` with `quantization="auto"` and `placement="auto"` made concrete for this model, device and
    budget. Auto only ever picks an exact format: "lossless" where copies are the bottleneck (a CUDA
    device, a budget smaller than the experts, records of ≥ AUTO_LOSSLESS_MIN_RECORD_BYTES), else None.
    `native`: the codec of a pre-quantized checkpoint read in its own bytes: its format, records decoded
    into slots as transformers' dequantize path loads them ("dequant"); "packed" only on request, where
    the codec runs transformers' own kernels on packed records (`computes_natively`)."""
    if native is not None:
        placement = "dequant" if cfg.quant.placement == "auto" else cfg.quant.placement
        if placement == "packed" and not native.computes_natively(device):
            raise ConfigError(
                f"QuantConfig(placement='packed') was given for {native.name} experts, but transformers computes "
                f"{native.name} with its own kernels only on GPUs that support them (not on {device}), and dequantizes "
                "elsewhere; mira-hf does the same. Use placement='auto' or 'dequant'."
            )
        return cfg.replace(quantization=native.name, quant=dataclasses.replace(cfg.quant, placement=placement))
    if is_native(cfg.quantization):
        encoded = ", ".join(repr(n) for n in codec_names("encoded"))
        raise ConfigError(
            f"quantization={cfg.quantization!r} names the format of pre-quantized checkpoints, which mira-hf serves in "
            "their own bytes when it loads one with from_pretrained; it does not quantize other weights into it. Use "
            f"quantization='auto', None or one of {encoded}."
        )
    q = cfg.quantization
    if q == "auto":
        dtypes = {dtype for s in specs.values() for _, dtype in s.values()}
        q = (
            "lossless"
            if device.type == "cuda"
            and cfg.host_compute == "off"  # the host computes from uncompressed records (host_compute.py)
            and budget_bytes < all_bytes
            and min(raw_bytes.values()) >= AUTO_LOSSLESS_MIN_RECORD_BYTES
            and dtypes <= {torch.bfloat16, torch.float32}
            else None
        )
    placement = cfg.quant.placement
    if placement == "auto":
        placement = find_codec_entry(q).default_placement if q is not None else "dequant"
    return cfg.replace(quantization=q, quant=dataclasses.replace(cfg.quant, placement=placement))


def _experts(t: _Target, streamed: StreamedExperts | None, device: torch.device | None = None):
    """`e -> {name: expert e's tensor}` of one target: read from the checkpoint (onto `device`, the
    encoder's), or views of its tensors."""
    if streamed is not None:
        return streamed.expert_fn(t.name, device)
    return lambda e: {n: x[e] for n, x in t.tensors.items()}


def _saved_records(
    cfg: MiraConfig, codec, fingerprint: dict, streamed: StreamedExperts | None, specs: dict
) -> tuple[SavedStore | None, RecordCache | None]:
    """The saved records this load reads instead of encoding: `store_path` (an error if they do not fit),
    else the record cache's entry for this checkpoint and format (None on a miss), and that cache."""
    if cfg.quantization is None:
        return None, None
    if is_native(cfg.quantization):  # the checkpoint's own bytes: read as stored, nothing encoded to keep
        return None, None
    if cfg.store_path is not None:
        return SavedStore(cfg.store_path, codec_spec(codec), fingerprint), None
    if streamed is None or cfg.loader.record_cache is None:  # only a checkpoint's files identify the weights
        return None, None
    root = default_root() if cfg.loader.record_cache == "auto" else cfg.loader.record_cache
    cache = RecordCache(root, streamed.index.files, codec_spec(codec), fingerprint, specs)
    return cache.open(), cache


def _saved_layouts(codec, targets: list[_Target], specs: dict, saved: SavedStore) -> dict | None:
    """Each layer's layout rebuilt from the saved plan arguments (no weight read), or None where the saved
    records do not fit these experts in this format."""
    layouts = {}
    for t in targets:
        if t.ordinal not in saved.layers:
            return None
        args = saved.plan(t.ordinal)
        if args is None and hasattr(codec, "plan_args"):
            return None
        layout = codec.plan(specs[t.ordinal], **args) if args is not None else codec.plan(specs[t.ordinal])
        if saved.shape(t.ordinal) != (t.module.num_experts, layout.nbytes):
            return None
        layouts[t.ordinal] = layout
    return layouts


def _add_layer(store: ExpertStore, t: _Target, specs, layout, streamed, saved: SavedStore | None, cache: RecordCache | None):
    """Store one target's experts: its saved records when there are some, else encoded (or copied) from
    its weights. A cache entry found damaged here is dropped and the layer encoded; returns the saved
    records still in use (None once dropped)."""
    E = t.module.num_experts
    if saved is not None:
        try:
            store.add_layer_from(t.ordinal, specs, E, _experts(t, streamed), records=saved.fill(t.ordinal), layout=layout)
            return saved
        except CorruptStoreError as exc:
            if cache is None:
                raise
            cache.drop(str(exc))
    device = store.encoder.device if store.quantized else None  # raw records: copied from host memory into the slab
    store.add_layer_from(t.ordinal, specs, E, _experts(t, streamed, device), layout=layout)
    return None


def _check_prequantized(cfg: MiraConfig, quantization_config: dict | None, name_or_path) -> None:
    """Refuse, before loading, a transfer format other than the checkpoint's own for a pre-quantized checkpoint
    read in its own bytes: encoding its experts again would lose what the checkpoint holds or add nothing."""
    try:
        native = native_codec_name(quantization_config)
    except NotStreamable:  # another quantized format: loaded by transformers, then wrapped as any model
        return
    if native is not None and cfg.quantization not in ("auto", None, native):
        raise ConfigError(
            f"quantization={cfg.quantization!r} was given, but {name_or_path!s} is pre-quantized "
            f"({quantization_config.get('quant_method')!r}): mira-hf keeps its experts in the checkpoint's own bytes "
            f"({native!r}), which each use decodes exactly as transformers does. Drop quantization (or pass "
            f"'auto' or {native!r})."
        )


def _resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"device={name!r} was requested but this PyTorch sees no CUDA GPU "
                f"(torch {torch.__version__}). Use MiraConfig(device='cpu'), or install a CUDA build of torch on a GPU machine."
            )
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise DeviceError(f"device={name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible (cuda:0..).")
        device = torch.device("cuda", index)
    return device


def _config_kwargs(hf_kwargs: dict) -> dict:
    return {k: hf_kwargs[k] for k in ("revision", "cache_dir", "local_files_only", "token", "subfolder") if k in hf_kwargs}


def _raw_config(name_or_path, hf_kwargs: dict) -> dict:
    """config.json as a dict, without running any model code."""
    from transformers import PretrainedConfig

    try:
        config_dict, _ = PretrainedConfig.get_config_dict(name_or_path, **_config_kwargs(hf_kwargs))
    except OSError as exc:
        raise missing_checkpoint_error(name_or_path, hf_kwargs, exc) from None  # one line: no chained traceback
    return config_dict


def _resolve_adapter(model_type: str | None, cfg: MiraConfig) -> MoEAdapter:
    if cfg.expert_layer_path is not None:
        return generic_adapter(cfg.expert_layer_path)
    adapter = get_adapter(model_type) if model_type else None
    if adapter is not None:
        return adapter
    if model_type and uses_experts_interface(model_type) is False:
        raise UnsupportedModelError(
            f"model_type {model_type!r} has no mira-hf adapter, and transformers' code for it builds no experts module "
            f"(a dense model, or experts outside transformers' experts interface). Supported: "
            f"{', '.join(registered_model_types())}, and any model whose experts transformers builds with its experts "
            f"interface. {_HOW_TO_ADD}"
        )
    return auto_adapter(model_type)  # found by transformers' experts interface, or refused by _find_targets


def _find_targets(
    model: nn.Module, adapter: MoEAdapter, streamed: dict[str, dict[str, torch.Tensor]] | None = None
) -> list[_Target]:
    """Every routed-experts module, validated. `streamed`: module path -> the meta tensors of experts
    left out of the model at load (they are read from the checkpoint instead)."""
    found = adapter.find_experts(model)
    auto_type = (adapter.model_types or (None,))[0] if isinstance(adapter, AutoAdapter) else None
    if not found and isinstance(adapter, AutoAdapter):
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type {auto_type!r}) has no mira-hf adapter, and none of its modules "
            f"is a routed-experts module built by transformers' experts interface. Supported: "
            f"{', '.join(registered_model_types())}. {_HOW_TO_ADD}"
        )
    if found and isinstance(adapter, AutoAdapter):
        warnings.warn(
            f"mira-hf: model_type {auto_type!r} has no adapter; serving the {len(found)} routed-experts modules "
            f"transformers built ({found[0][0]}, ...). Outputs are exact as for every family; the router beside them "
            "ranks predictions. register_adapter(MoEAdapter(...)) records its routing and checkpoint layout.",
            stacklevel=4,
        )
    if not found:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no routed-experts module matches {list(adapter.experts_globs)} "
            f"(adapter {adapter.name!r}). A dense model has nothing for mira-hf to offload; for an MoE model "
            f"with experts elsewhere: {_HOW_TO_ADD}"
        )
    targets = []
    for ordinal, (name, module) in enumerate(found):
        if isinstance(module, MiraExperts):
            raise ConfigError(f"{name} is already a MiraExperts proxy: this model is wrapped. Call model.unload() first.")
        E = getattr(module, "num_experts", None)
        tensors = dict(module.named_parameters(recurse=False))
        in_checkpoint = streamed is not None and name in streamed
        if in_checkpoint:
            tensors = streamed[name]
        unknown = sorted(set(tensors) - set(KNOWN_EXPERT_TENSORS))
        up = "gate_up_proj" if adapter.flag(module, "has_gate", LAYOUT_FLAGS["has_gate"]) else "up_proj"
        problem = None
        if not isinstance(E, int) or not (hasattr(module, "is_transposed") or "is_transposed" in adapter.expert_flags):
            problem = "it is not a fused experts module (transformers' @use_experts_implementation layout with `num_experts`)"
        elif unknown:
            problem = f"it holds tensors mira-hf does not know how to compute with: {unknown}"
        elif up not in tensors or "down_proj" not in tensors:
            problem = f"it lacks `{up}` or `down_proj` (has {sorted(tensors)})"
        elif any(p.shape[0] != E for p in tensors.values()):
            problem = f"its tensors' first dimension is not num_experts={E}: {[tuple(p.shape) for p in tensors.values()]}"
        elif not in_checkpoint and any(p.device.type == "meta" for p in tensors.values()):
            problem = "its weights are on the meta device (not loaded)"
        if problem:
            raise UnsupportedModelError(
                f"{name} ({type(module).__name__}) cannot be served: {problem}. Supported: fused 3-D experts "
                f"({', '.join(KNOWN_EXPERT_TENSORS)}). {_HOW_TO_ADD}"
            )
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        targets.append(
            _Target(
                name,
                parent,
                attr,
                module,
                ordinal,
                {n: p.data for n, p in tensors.items()},
                {n: p.requires_grad for n, p in tensors.items()},
            )
        )
    return targets


def model_fingerprint(model: nn.Module, targets: list[_Target], specs: dict) -> dict:
    """What identifies a model for files made from it (predictors, packed stores): its shape and a
    hash of its routers' weights, so a file from another checkpoint of the same shape is refused too."""
    import hashlib

    h = hashlib.sha256()
    for t in targets:
        for name, p in sorted(t.parent.named_parameters()):
            if not name.startswith(t.attr + ".") and p.dim() == 2 and p.shape[0] == t.module.num_experts:
                h.update(p.detach().float().cpu().numpy().tobytes())
    return {
        "model_type": getattr(model.config, "model_type", None),
        "moe_layers": len(targets),
        "num_experts": [t.module.num_experts for t in targets],
        "hidden_size": getattr(model.config, "hidden_size", None),
        "expert_shapes": {n: list(shape) for n, (shape, _) in specs[targets[0].ordinal].items()} if targets else {},
        "router_sha256": h.hexdigest(),
    }


class _StepHooks:
    """The model's forward hooks: a forward step starts and ends for the manager. Bound methods of an
    object rather than lambdas, so that copying or pickling a wrapped model reaches the manager's clear
    refusal instead of failing on a lambda."""

    def __init__(self, manager: ExpertManager) -> None:
        self.manager = manager

    # In a compiled graph the hooks are left out (fullgraph allows no break): the manager then finds step
    # boundaries from the order of its blocks (`ExpertManager.begin`), and steps are not serialised.
    def before(self, module, args, kwargs) -> None:
        if not torch.compiler.is_compiling():
            self._enter(kwargs)

    def after(self, module, args, output) -> None:
        if not torch.compiler.is_compiling():
            self._exit()

    @torch.compiler.disable
    def _enter(self, kwargs: dict) -> None:
        self.manager.enter_forward(_starts_sequence(kwargs))

    @torch.compiler.disable
    def _exit(self) -> None:
        self.manager.exit_forward()


def _starts_sequence(kwargs: dict) -> bool:
    """Whether a forward starts a new sequence: no KV cache yet, or an empty one (no device sync)."""
    cache = kwargs.get("past_key_values", kwargs.get("cache"))  # the name changed within transformers 5.x
    if cache is None:
        return True
    length = getattr(cache, "get_seq_length", None)
    return length is not None and length() == 0


class RouterTable:
    """The wrapped model's routers by MoE layer ordinal, for predictors: called as `(layer, hidden [T, H])
    -> [T, E]` router probabilities (a `RouterProbs`), and `linear(layer)`, the router as one linear map
    (`RouterLinear`) or None, resolved once (the gate predictor applies it at every block)."""

    def __init__(self, adapter: MoEAdapter, targets: list[_Target]) -> None:
        self._adapter = adapter
        self._blocks = {t.ordinal: t.parent for t in targets}
        self._linear: dict = {}

    def __call__(self, layer: int, hidden: torch.Tensor) -> torch.Tensor | None:
        linear = self.linear(layer)
        with torch.no_grad():
            return None if linear is None else linear.probs(hidden)

    def linear(self, layer: int):
        if layer not in self._linear:
            self._linear[layer] = self._adapter.router_linear(self._blocks[layer])
        return self._linear[layer]

    def forget_routers(self) -> None:
        """Resolve the routers again at their next use: a cast or move replaced their buffers."""
        self._linear.clear()


def _fraction(budget) -> float | None:
    """The budget if it is a fraction of the experts' bytes (raised to the minimum working set when below it)."""
    return budget if isinstance(budget, float) else None


def _bytes_to_move(model: nn.Module, targets: list[_Target], device: torch.device) -> int:
    """Bytes of non-expert weights and buffers that `model.to(device)` will still copy there (the experts,
    before wrapping the modules' tensors, after it the proxies' parameters, stay in the store)."""
    experts = {t.tensors[n].data_ptr() for t in targets for n in t.tensors}
    served = {id(p) for m in model.modules() if isinstance(m, MiraExperts) for p in m.parameters(recurse=False)}
    tensors = [x for x in [*model.parameters(), *model.buffers()] if id(x) not in served]
    return sum(x.numel() * x.element_size() for x in tensors if x.device != device and x.data_ptr() not in experts)


def _check_device_memory(
    capacity: int, device: torch.device, model: nn.Module, targets: list[_Target], reclaim_bytes: int = 0
) -> None:
    """`reclaim_bytes`: device memory freed before the arena is allocated (the arena a new plan replaces)."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    free += reclaim_bytes
    need = capacity + _bytes_to_move(model, targets, device)
    if need > free:
        raise BudgetError(
            f"the expert arena ({capacity:,} bytes) plus the weights that move to {device} need {need:,} bytes, but "
            f"only {free:,} are free there. Lower MiraConfig(gpu_budget=...) (e.g. a fraction such as 0.25)."
        )


def _check_offload_space(cfg: MiraConfig, layer_bytes: list[int]) -> None:
    """Experts beyond `host_budget` go to `offload_dir`: refuse a load that cannot fit there."""
    if cfg.host_budget_bytes is None:
        return
    _, disk = _host_and_disk_bytes(layer_bytes, cfg.host_budget_bytes)
    path = os.path.abspath(cfg.offload_dir)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    free = shutil.disk_usage(path).free
    if disk > free:
        raise BudgetError(
            f"host_budget={cfg.host_budget!r} leaves {disk:,} bytes of experts for offload_dir={cfg.offload_dir!r}, "
            f"but only {free:,} bytes are free there. Give offload_dir a disk with more space, or raise host_budget."
        )


def _host_and_disk_bytes(layer_bytes: list[int], host_budget: int | None) -> tuple[int, int]:
    """Bytes of the store in host memory and on disk, layer by layer as `ExpertStore` places them."""
    host = disk = 0
    for n in layer_bytes:
        if over_host_budget(host, n, host_budget):
            disk += n
        else:
            host += n
    return host, disk


def _host_has_room(nbytes: int) -> bool:
    """Whether `nbytes` of host memory are available now (unknown: no)."""
    available = available_host_bytes()
    return available is not None and nbytes <= available


def _check_host_memory(cfg: MiraConfig, layer_bytes: list[int], targets: list[_Target], streamed: bool, exact: bool) -> None:
    """Refuse a store that cannot fit in host memory, before anything changes (instead of the kernel's
    OOM killer halfway through). Experts already in host memory with an exact format are freed layer by
    layer as the store takes them, so only one layer is new memory; otherwise (streamed from the
    checkpoint, on a GPU, or kept until the end because a lossy format cannot give them back) the whole
    host tier is."""
    available = available_host_bytes()
    if available is None:
        return
    host, _ = _host_and_disk_bytes(layer_bytes, cfg.host_budget_bytes)
    in_host = not streamed and all(p.device.type == "cpu" for t in targets for p in t.tensors.values())
    need = max(layer_bytes, default=0) if in_host and exact else host
    if need > available:
        raise BudgetError(
            f"the expert store needs {need:,} more bytes of host memory ({host:,} in all, {len(layer_bytes)} layers), "
            f"but only {available:,} are available. Keep part of the experts on disk: MiraConfig(host_budget=..., "
            "offload_dir=...) (e.g. host_budget='16GiB'), or use a smaller transfer format (quantization='int4'), "
            "or free host memory."
        )


def _replan(
    model: nn.Module, cfg: MiraConfig, layers: list[LayerInfo], targets: list[_Target], layouts, raw_bytes, device: torch.device
):
    """The slot plan of a wrapped model whose records changed (`layouts`, `raw_bytes`: per layer, after a
    cast or a load) or that moves to `device`, from the budget it was wrapped with; raises `BudgetError`
    before anything changes. A fraction budget is a share of the experts' bytes in their new dtype."""
    manager: ExpertManager = model.mira
    all_bytes = sum(raw_bytes[li.ordinal] * li.num_experts for li in layers)
    same = device == manager.device
    if cfg.gpu_budget is None and device.type == "cuda" and same:
        budget_bytes = manager.budget.budget_bytes  # what free memory gave at wrap; it now excludes the arena
    else:
        budget_bytes = resolve_budget_bytes(cfg, all_bytes, device, lambda: _bytes_to_move(model, targets, device))
    budget = plan_records(
        layers, budget_bytes, manager.placement, manager.store.codec, layouts, raw_bytes, round_up_from=_fraction(cfg.gpu_budget)
    )
    _check_device_memory(budget.device_bytes, device, model, targets, reclaim_bytes=manager.device_bytes if same else 0)
    return budget


def _progress(items, enabled: bool, desc: str):
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="layer")


def _restore_tensors(t: _Target, store: ExpertStore, device: torch.device | None = None) -> None:
    for n, tensor in store.fused(t.ordinal).items():
        t.module.register_parameter(n, nn.Parameter(tensor.to(device) if device else tensor, requires_grad=t.requires_grad[n]))


def _warn_if_lossy(manager: ExpertManager, what: str) -> None:
    if not manager.store.exact:
        warnings.warn(
            f"the experts are stored as {manager.store.codec.name}: {what} their dequantized values, not the "
            "checkpoint's. Load the model again without quantization for the original weights.",
            stacklevel=3,
        )


def _unload(model: nn.Module) -> nn.Module:
    """Give back an ordinary transformers model, on the CPU, with every expert in place."""
    manager: ExpertManager = model.mira
    _warn_if_lossy(manager, "unload() gives back")
    uninstall_state(model)
    for hook in model._mira_hooks:
        hook.remove()
    manager.close()
    model.to("cpu")
    for t in model._mira_targets:
        _restore_tensors(t, manager.store)
        setattr(t.parent, t.attr, t.module)
    manager.store.close()
    bound = ("unload", "save_pretrained", "set_experts_implementation", "mira_load_report")  # per-instance, from `_wrap`
    for attr in ("mira", "_mira_config", "_mira_targets", "_mira_hooks", *bound):
        model.__dict__.pop(attr, None)
    return model


def _save_pretrained(model: nn.Module, save_directory, **kwargs):
    """Write an ordinary transformers checkpoint (experts included), as the unwrapped model would."""
    if "state_dict" in kwargs:
        raise ConfigError("save_pretrained of a mira-hf model builds the state dict itself; do not pass state_dict.")
    _warn_if_lossy(model.mira, "save_pretrained() writes")
    with warnings.catch_warnings():  # state_dict() would say it again for every layer
        warnings.simplefilter("ignore")
        state = model.state_dict()
    for t in model._mira_targets:  # one contiguous tensor each (views of raw records share their slab)
        for n, tensor in model.mira.store.fused(t.ordinal).items():
            state[f"{t.name}.{n}"] = tensor
    return type(model).save_pretrained(model, save_directory, state_dict=state, **kwargs)
