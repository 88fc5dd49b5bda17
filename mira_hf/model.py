"""`MiraMoEModel`: load or wrap a transformers MoE model so its routed experts live in host memory.

The returned object *is* the transformers model (e.g. `MixtralForCausalLM`): `__call__`, `generate`,
`.config`, `.generation_config` and `.device` behave as usual. Its routed-experts modules are replaced,
per instance, by `MiraExperts` proxies; `model.mira` is the shared `ExpertManager`; `model.unload()`
gives back an ordinary model; `model.save_pretrained()` writes an ordinary checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import warnings
import weakref
from collections.abc import Callable

import torch
from torch import nn

from model_adapters import MoEAdapter

from .checkpoint import (
    StreamedExperts,
    build_skeleton,
    expert_tensors,
    is_model_class,
    load_model,
    model_class_of,
    own_code_skeleton,
    runs_own_code,
    streaming_index,
)
from .config import MiraConfig, config_from_arguments
from .errors import CheckpointError, ConfigError, DeviceError, MiraError, UnsupportedModelError
from .expert_keys import native_codec_name
from .experts_impl import check_model_implementations, checked_set_experts_implementation
from .load_report import LoadReport
from .manager import ExpertManager
from .normal_tensors import builds_normal_tensors
from .proxy import proxy_for
from .resources import replan
from .shards import NotStreamable, ShardIndex, missing_checkpoint_error
from .state import install as install_state
from .state import uninstall as uninstall_state
from .step_hooks import StepHooks
from .store_build import StorePlan, build_router_predictor, fill_store, new_manager, plan_store, record_cache
from .targets import (
    SERVED,
    RouterHash,
    Target,
    expert_specs,
    find_targets,
    model_fingerprint,
    own_classes_hint,
    places,
    resolve_adapter,
    sub_model_types,
)
from .unload import forget_wrapping, put_back_modules, refuse_copy, save_pretrained, unload
from .weak import bound_weakly, weak_method


class MiraMoEModel:
    """Entry points. Not instantiated: `from_pretrained` and `wrap` return the transformers model."""

    def __init__(self) -> None:
        raise TypeError("Use MiraMoEModel.from_pretrained(...) or MiraMoEModel.wrap(model, mira_config).")

    @staticmethod
    @builds_normal_tensors
    def from_pretrained(
        name_or_path: str | os.PathLike,
        mira_config: MiraConfig | None = None,
        *,
        progress: bool = True,
        model_class: type | None = None,
        **hf_kwargs,
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
        checkpoint, which has no causal-LM class; for a family with neither, the class config.json's `architectures`
        names, such as a token classifier) (`dtype`, `revision`, `trust_remote_code`, ...), or to `model_class`'s
        where given: a transformers model class or auto class to load the checkpoint as, as its own `from_pretrained`
        would (`AutoModelForImageTextToText` for the whole vision-language model of a checkpoint whose causal-LM
        class is its text decoder alone),
        except `device_map`: mira-hf places weights itself (non-experts on `mira_config.device`, experts in host
        memory), so a map names that device (`device_from_map`). With `output_loading_info=True`, returns
        `(model, loading_info)` as transformers does, with the keys transformers reports (streamed experts included
        as the whole load reports them: in no list).
        """
        report = LoadReport()  # its wall time is the whole call's, config reading and imports included
        if not isinstance(name_or_path, (str, os.PathLike)):
            wrap = " To serve a model already built, call MiraMoEModel.wrap(model, gpu_budget=...)."
            raise ConfigError(
                f"MiraMoEModel.from_pretrained takes a checkpoint: a directory or a hub id (a str or a path); it was "
                f"given {type(name_or_path).__name__}.{wrap if isinstance(name_or_path, nn.Module) else ''}"
            )
        cfg = config_from_arguments(mira_config, hf_kwargs, "MiraMoEModel.from_pretrained")
        output_loading_info = bool(hf_kwargs.pop("output_loading_info", False))
        # accelerate's placement keywords; None is transformers' default (which wrappers pass on): not given
        placement = {name: hf_kwargs.pop(name, None) for name in ("device_map", *_PLACEMENT_KWARGS)}
        if placement["device_map"] is not None:
            cfg = dataclasses.replace(cfg, device=device_from_map(placement["device_map"], cfg.device))
        for name, instead in _PLACEMENT_KWARGS.items():
            if placement[name] is not None:  # transformers would ignore them without a device_map; the user meant a limit
                raise ConfigError(
                    f"{name}={placement[name]!r} was given: it is accelerate's offloading limit, which mira-hf does not "
                    f"use (it keeps non-expert weights on one device and the routed experts in host memory). {instead}"
                )
        device = _resolve_device(cfg.device)
        trust = bool(hf_kwargs.get("trust_remote_code", False))
        config_dict = _raw_config(name_or_path, hf_kwargs)
        # a model class given builds itself, config.json's `auto_map` unused (as its own from_pretrained does)
        remote = not is_model_class(model_class) and runs_own_code(config_dict, trust)
        if remote and not trust:
            raise UnsupportedModelError(
                f"{name_or_path!s} defines its own modeling code (auto_map in config.json) for model_type "
                f"{config_dict.get('model_type')!r}, which transformers has no classes of its own for. mira-hf runs it "
                "only if you trust it: pass trust_remote_code=True to MiraMoEModel.from_pretrained."
            )
        # what serves its experts, and the class transformers builds for it: both checked before any weight is read
        adapter = resolve_adapter(config_dict.get("model_type"), cfg, remote, sub_model_types(config_dict))
        model_class = model_class_of(config_dict, model_class, remote)
        if not is_model_class(model_class) and isinstance(hf_kwargs.get("config"), (str, os.PathLike)):
            del hf_kwargs["config"]  # an auto class ignores a path given as config: it reads the checkpoint's config.json
        if remote:  # the checkpoint's own code: where its experts cannot be served, say so before loading its weights
            skeleton = own_code_skeleton(name_or_path, model_class, hf_kwargs)
            if skeleton is not None:
                with warnings.catch_warnings():  # what serving it warns of is said once, when it is served
                    warnings.simplefilter("ignore")
                    meta = expert_tensors(adapter.experts_layout, adapter.find_experts(skeleton))
                    _find_targets(skeleton, adapter, meta, remote=True)
        _check_prequantized(cfg, config_dict.get("quantization_config"), name_or_path)
        if "torch_dtype" in hf_kwargs:  # transformers' older name, which it still takes (`dtype` wins where both are)
            torch_dtype = hf_kwargs.pop("torch_dtype")
            if hf_kwargs.get("dtype") is None:
                hf_kwargs["dtype"] = torch_dtype
        hf_kwargs.setdefault("dtype", "auto")
        with _checkpoint_errors(name_or_path):
            index, wanted, hf_kwargs = streaming_index(
                name_or_path,
                hf_kwargs,
                cfg.loader.stream_experts,
                cfg.host_budget is not None,
                # encoded records never need the experts in the model ("auto" encodes only on a GPU)
                encoded=cfg.quantization not in (None, "auto") or (cfg.quantization == "auto" and device.type == "cuda"),
                config_json=config_dict,
            )
        loaded = {}

        def load() -> tuple[nn.Module, StreamedExperts | None]:
            model, streamed, loaded["info"] = load_model(
                name_or_path, adapter, hf_kwargs, index, wanted, cfg.loader.stream_experts, config_dict, model_class
            )
            return model, streamed

        model = None
        if index is not None:
            model = MiraMoEModel._wrap_arriving(
                name_or_path, adapter, index, hf_kwargs, cfg, device, progress, report, load, model_class
            )
        if model is None:
            with report.span("model"), _checkpoint_errors(name_or_path):
                model, streamed = load()
            if streamed is not None and streamed.index.download_s:
                report.add("download", streamed.index.download_s)
            model = MiraMoEModel._wrap(model, cfg, device, progress, streamed, report)
        return (model, loaded["info"]) if output_loading_info else model

    @staticmethod
    @builds_normal_tensors
    def wrap(model: nn.Module, mira_config: MiraConfig | None = None, *, progress: bool = False, **config_fields):
        """Wrap a model already in CPU memory (e.g. in a notebook). Idempotent: wrapping a wrapped model
        with the same config returns it unchanged. Settings: `mira_config=MiraConfig(...)`, or MiraConfig's
        fields as keywords (`wrap(model, gpu_budget=0.25)`); not both."""
        if not isinstance(model, nn.Module):
            load = " To load a checkpoint, call MiraMoEModel.from_pretrained(path_or_hub_id, gpu_budget=...)."
            raise ConfigError(
                f"MiraMoEModel.wrap takes a model already built (a torch.nn.Module, such as a transformers model); it "
                f"was given {type(model).__name__}.{load if isinstance(model, (str, os.PathLike)) else ''}"
            )
        compiled = _compiled_module(model)
        if compiled is not None:  # torch.compile(model): its model is wrapped in place, then compiled again when called
            MiraMoEModel.wrap(compiled, mira_config, progress=progress, **config_fields)
            return model
        cfg = config_from_arguments(mira_config, config_fields, "MiraMoEModel.wrap")
        if config_fields:
            fields = ", ".join(f.name for f in dataclasses.fields(MiraConfig))
            raise ConfigError(
                f"MiraMoEModel.wrap got unexpected keywords {', '.join(sorted(config_fields))}: it takes the model, "
                f"mira_config or MiraConfig's fields ({fields}), and progress."
            )
        manager = getattr(model, "mira", None)
        if isinstance(manager, ExpertManager):
            if _resolved(model._mira_config) == _resolved(cfg):  # the same settings (device=None: the one it chose)
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
        remote = not type(model).__module__.startswith("transformers.")  # a class of its own (remote code, a subclass)
        config = getattr(model, "config", None)
        adapter = resolve_adapter(getattr(config, "model_type", None), cfg, remote, sub_model_types(config or {}))
        targets = _find_targets(model, adapter, streamed.meta if streamed else None, remote)
        check_model_implementations(model)
        fingerprint = model_fingerprint(model, targets, expert_specs(targets))
        plan = plan_store(model, cfg, device, adapter, targets, streamed, progress, report, fingerprint)  # every check
        try:  # the predictor (and its files) is checked before anything changes too
            router_probs, predictor = build_router_predictor(plan, model, adapter, targets, fingerprint)
        except BaseException:
            plan.close()
            raise
        # on failure the model is as it was
        wrapped = fill_store(
            plan,
            targets,
            streamed,
            progress,
            lambda: _install(
                model, cfg, plan, adapter, targets, new_manager(plan, device, router_probs, predictor, fingerprint), device
            ),
        )
        return _loaded(wrapped, report, progress)

    @staticmethod
    def _wrap_arriving(
        name_or_path,
        adapter: MoEAdapter,
        index: ShardIndex,
        hf_kwargs: dict,
        cfg: MiraConfig,
        device: torch.device,
        progress: bool,
        report: LoadReport,
        load: Callable[[], tuple[nn.Module, StreamedExperts | None]],
        model_class: type,
    ):
        """`from_pretrained` with streamed experts, in the order that lets them be read while a hub id's later
        shards still download: the model's skeleton from config.json, each layer's experts stored as its shards
        arrive, then the other weights through transformers (every shard there: none downloaded again), then the
        fingerprint, predictor and record cache. A local checkpoint is the same load with every shard there
        from the start. None where a skeleton cannot stand in for the model (the caller loads it first); if the
        model transformers builds differs from the skeleton, its experts are stored again the ordinary way.
        `load()`: the model without its experts, through transformers (`load_model`); `model_class`: the class it loads as."""
        if cfg.store_path is not None:  # a saved store is checked against the routers' weights: loaded first
            return None
        try:
            skeleton, early = build_skeleton(name_or_path, adapter, index, hf_kwargs, model_class)
        except NotStreamable:
            return None
        targets = find_targets(skeleton, adapter, early.meta)
        check_model_implementations(skeleton)
        shape = model_fingerprint(skeleton, targets, expert_specs(targets), routers=False)

        def finish() -> nn.Module:
            with report.span("model"), _checkpoint_errors(name_or_path):
                model, streamed = load()
            if streamed is None or not early.same_as(streamed):
                raise _SkeletonDiffers(model, streamed)
            streamed.close()
            with warnings.catch_warnings():  # what the skeleton's targets said (an adapter found automatically)
                warnings.simplefilter("ignore")
                found = find_targets(model, adapter, streamed.meta)
            check_model_implementations(model)
            fingerprint = model_fingerprint(model, found, plan.specs)
            router_probs, predictor = build_router_predictor(plan, model, adapter, found, fingerprint)
            if plan.cache is None:  # planned while shards were still arriving: the entry this load writes
                plan.cache = record_cache(plan.cfg, plan.codec, fingerprint, early, plan.specs)
                if plan.cache is not None:
                    plan.cache.report = report
            return _install(
                model, cfg, plan, adapter, found, new_manager(plan, device, router_probs, predictor, fingerprint), device
            )

        try:
            plan = plan_store(skeleton, cfg, device, adapter, targets, early, progress, report, shape)
            model = fill_store(plan, targets, early, progress, finish)
        except NotStreamable:  # a module's experts are not where the shards say: the ordinary load says why
            early.close()
            return None
        except _SkeletonDiffers as differs:
            return MiraMoEModel._wrap(differs.model, cfg, device, progress, differs.streamed, report)
        if index.download_s:
            report.add("download", index.download_s)
        return _loaded(model, report, progress)

    @staticmethod
    def unload(model: nn.Module) -> nn.Module:
        """Same as `model.unload()`."""
        return unload(model)


def _called_in_its_place(model: nn.Module, proxies: list) -> list[nn.Module]:
    """The model, and the modules holding experts that code calls in its place: its base model (`model.model`, what
    a direct `model.forward(...)` calls), `get_decoder()`'s and `get_encoder()`'s (a vision-language model's text
    model, an encoder-decoder's stacks)."""
    found = [model]
    served = {id(p) for p in proxies}
    for get in (lambda: model.base_model, lambda: model.get_decoder(), lambda: model.get_encoder()):
        try:
            module = get()
        except (AttributeError, NotImplementedError, TypeError):
            continue
        if isinstance(module, nn.Module) and all(module is not m for m in found):
            if any(id(m) in served for m in module.modules()):
                found.append(module)
    return found


def _install(
    model: nn.Module,
    user_cfg: MiraConfig,
    plan: StorePlan,
    adapter: MoEAdapter,
    targets: list[Target],
    manager: ExpertManager,
    device: torch.device,
) -> nn.Module:
    """Swap each experts module for its proxy on its parent, move the rest of the model to `device`, and
    bind the per-instance hooks and methods that `unload()` removes again. On any exception (the device out of
    memory while the rest moves, a KeyboardInterrupt) every step done is undone, last first, and `manager` closed,
    before it propagates; the caller gives the experts back (`fill_store`)."""
    where = next((p.device for p in model.parameters()), torch.device("cpu"))  # the experts are out of the model
    with contextlib.ExitStack() as undo:
        undo.callback(manager.close)
        proxies, installed = [], []
        undo.callback(put_back_modules, installed, model)
        spots = places(model, [m for t in targets for m in (t.module, *(twin for _, _, twin in t.twins))])
        for t in targets:
            t.proxy = proxy_for(adapter, t.module, manager, t.ordinal, plan.cfg.cache.prefill_block_tokens)
            proxies.append(t.proxy)
            installed.append(t)
            for owner, attr, module in [(t.parent, t.attr, t.module), *t.twins]:
                for parent, name in spots[id(module)] or [(owner, attr)]:  # every block the module (or a twin) serves
                    setattr(parent, name, t.proxy)
                SERVED[module] = weakref.ref(manager)
        undo.callback(model.to, where)
        model.to(device)
        # Per-instance hooks mark forward steps (the heat clock, serialised threads); always_call
        # releases the step even when the forward raises, so an interrupted generate leaves no lock.
        steps = StepHooks(manager)
        hooks = []
        for m in _called_in_its_place(model, proxies):
            hooks.append(m.register_forward_pre_hook(steps.before, with_kwargs=True))
            undo.callback(hooks[-1].remove)
            hooks.append(m.register_forward_hook(steps.after, always_call=True))
            undo.callback(hooks[-1].remove)
        undo.callback(forget_wrapping, model)
        model.mira = manager
        model._mira_config = user_cfg  # as given: wrapping again with it is a no-op
        model._mira_targets = targets
        model._mira_hooks = tuple(hooks)
        # Bound weakly, as is every link from what the model owns back to it: `del model` frees it (`mira_hf.weak`).
        model.unload = bound_weakly(unload, model)
        model.save_pretrained = bound_weakly(save_pretrained, model)
        model.set_experts_implementation = bound_weakly(checked_set_experts_implementation, model)
        model.__reduce_ex__ = refuse_copy  # copy.copy too: a shallow copy would share the proxies and the manager
        # The experts as parameters (views of the store), and casts and moves that the store follows.
        replan_model = _Replan(model, manager, plan.layers)
        install_state(model, manager, proxies, {t.ordinal: t.parameter for t in targets}, replan_model)
        undo.callback(uninstall_state, model)
        steps.edited = model._mira_state.edited  # experts changed in place reach what they compute
        manager.step_check = weak_method(model._mira_state.edited)
        manager.router_fields = RouterHash(model)  # files saved later name the routers as they are then
        undo.pop_all()
    return model


def _loaded(model: nn.Module, report: LoadReport, progress: bool) -> nn.Module:
    """The wrapped model, its load's report finished (`model.mira_load_report()`) and printed with `progress`."""
    report.finish()
    model.mira_load_report = lambda: report
    if progress:  # the progress bars' last line: where the load's time went
        print(f"mira-hf: {report}", file=sys.stderr, flush=True)
    return model


class _Replan:
    """`resources.replan` of the model with the config and targets it is wrapped with. It holds the model weakly
    (`mira_hf.weak`); a part of the model kept after the model itself was dropped (`model.model`) is cast with the
    manager, the config and the experts' layers alone."""

    def __init__(self, model: nn.Module, manager: ExpertManager, layers) -> None:
        self._model, self._manager, self._cfg, self._layers = weakref.ref(model), manager, model._mira_config, layers

    def __call__(self, *args):
        model = self._model()
        targets = [] if model is None else model._mira_targets
        return replan(self._manager, model, self._cfg, self._layers, targets, *args)


class _SkeletonDiffers(Exception):
    """The model transformers built does not have the skeleton's experts: they are stored again from it."""

    def __init__(self, model: nn.Module, streamed: StreamedExperts | None) -> None:
        super().__init__("the model transformers built differs from its skeleton")
        self.model, self.streamed = model, streamed


@contextlib.contextmanager
def _checkpoint_errors(name_or_path):
    """A weight file that transformers or safetensors cannot read is a `CheckpointError` saying what to do."""
    try:
        yield
    except MiraError:
        raise
    except Exception as exc:
        if type(exc).__name__ == "SafetensorError" or isinstance(exc, (OSError, EOFError)):
            said = str(exc).rstrip(". ")
            if isinstance(exc, OSError) and "no file named" in said:  # transformers found no file for the arguments
                what = "No weight file matches the arguments given (variant, use_safetensors, gguf_file): pass those the checkpoint's files have"
            else:
                what = "A weight file is missing, truncated or corrupted: copy or download it again"
            raise CheckpointError(
                f"could not read the checkpoint at {name_or_path!s}: {said}. {what} (nothing was changed)."
            ) from exc
        raise


# -- the facade's arguments -----------------------------------------------------------------------
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


# from_pretrained keywords of accelerate's offloading and what sets the same limit in mira-hf
_PLACEMENT_KWARGS = {
    "max_memory": "Set gpu_budget= (device bytes for the routed experts, e.g. '12GiB'; the non-expert weights come "
    "on top) and host_budget= (host bytes for the expert store; the rest is read from disk).",
    "offload_folder": "Set host_budget= with offload_dir= (experts beyond the host budget are written there and read back).",
}

# device_map strategies of transformers/accelerate that spread a model over several devices; mira-hf runs on one
_SPREADING_MAPS = ("balanced", "balanced_low_0", "sequential")


def device_from_map(device_map, device: str | None) -> str | None:
    """The `MiraConfig.device` a transformers `device_map` asks for, where `device` is the one the config names
    (None: not named). mira-hf places the weights itself, on one device: "auto" leaves the choice to it (the
    config's device, else a CUDA GPU when there is one); a device ("cuda:0", 0, torch.device, "cpu") or a map
    that puts every module on one device (`{"": 0}`) names that device. Raises `ConfigError` for a map that
    spreads the model over several devices or onto disk, and for one that names another device than `device`."""

    def one(value) -> str:
        if isinstance(value, bool) or not isinstance(value, (int, str, torch.device)):
            raise TypeError(value)
        if isinstance(value, int):
            return f"cuda:{value}"
        name = str(torch.device(value))
        return "cuda:0" if name == "cuda" else name

    if device_map == "auto":
        return device
    how = (
        "mira-hf keeps the non-expert weights on one device and the routed experts in host memory, copying the ones in "
        "use to that device. Pass device_map='auto', one device (device_map='cuda:0', 0, 'cpu'), or drop device_map and "
        "set MiraConfig(device=...)."
    )
    if device_map in _SPREADING_MAPS:
        raise ConfigError(f"device_map={device_map!r} spreads a model over several devices; {how}")
    values = list(device_map.values()) if isinstance(device_map, dict) and device_map else [device_map]
    try:
        named = {one(v) for v in values}
    except (TypeError, RuntimeError):
        raise ConfigError(f"device_map={device_map!r} is not a device or a map onto one device; {how}") from None
    if len(named) != 1:
        raise ConfigError(f"device_map={device_map!r} puts the model on {', '.join(sorted(named))}; {how}")
    (name,) = named
    if device is not None and one(device) != name:
        raise ConfigError(
            f"device_map={device_map!r} names {name}, but MiraConfig(device={device!r}) names another device. Give one of them."
        )
    return name


def _compiled_module(model: nn.Module) -> nn.Module | None:
    """The module `torch.compile(module)` gave `model` for (a dynamo `OptimizedModule`), else None."""
    from torch._dynamo.eval_frame import OptimizedModule

    return model._orig_mod if isinstance(model, OptimizedModule) else None


def _resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"device={name!r} was requested but this PyTorch sees no CUDA GPU "
                f"(torch {torch.__version__}). Use device='cpu' (`--device cpu` on the command line), or install a CUDA build of "
                "torch on a GPU machine."
            )
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise DeviceError(f"device={name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible (cuda:0..).")
        device = torch.device("cuda", index)
    return device


def _resolved(cfg: MiraConfig) -> MiraConfig:
    """`cfg` with its device as wrapping resolves it (None: a CUDA GPU where there is one, else the CPU; "cuda":
    "cuda:0"), so that configs naming the same device compare equal."""
    device = _resolve_device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
    return dataclasses.replace(cfg, device=str(device))


def _config_kwargs(hf_kwargs: dict) -> dict:
    names = ("revision", "cache_dir", "local_files_only", "token", "subfolder", "force_download")
    return {k: hf_kwargs[k] for k in names if k in hf_kwargs}


def _find_targets(model: nn.Module, adapter: MoEAdapter, streamed: dict | None, remote: bool) -> list:
    """`find_targets`; where a model built by its checkpoint's own code (`remote`) cannot be served but transformers'
    own classes for its type can be, the error says so (`own_classes_hint`)."""
    try:
        return find_targets(model, adapter, streamed)
    except UnsupportedModelError as exc:
        hint = own_classes_hint(type(model), getattr(getattr(model, "config", None), "model_type", None)) if remote else ""
        if not hint:
            raise
        raise UnsupportedModelError(f"{exc} {hint}") from exc


def _raw_config(name_or_path, hf_kwargs: dict) -> dict:
    """config.json as a dict, without running any model code; a config object given as `config=` instead, as
    transformers then builds the model from it (a directory may hold the weights alone)."""
    from transformers import PretrainedConfig

    given = hf_kwargs.get("config")
    if isinstance(given, PretrainedConfig):
        return given.to_dict()
    if os.path.isfile(name_or_path):  # transformers would read a config file given as such, then fail on the weights
        raise missing_checkpoint_error(name_or_path, hf_kwargs, FileNotFoundError(name_or_path))
    config_file = os.path.join(name_or_path, hf_kwargs.get("subfolder") or "", "config.json")
    if os.path.isdir(name_or_path) and not os.path.isfile(config_file):  # transformers would read {} from the subfolder
        raise missing_checkpoint_error(name_or_path, hf_kwargs, FileNotFoundError(config_file))
    try:
        config_dict, _ = PretrainedConfig.get_config_dict(name_or_path, **_config_kwargs(hf_kwargs))
    except OSError as exc:
        raise missing_checkpoint_error(name_or_path, hf_kwargs, exc) from None  # one line: no chained traceback
    return config_dict
