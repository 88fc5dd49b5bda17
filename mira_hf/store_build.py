"""The store-building stage of wrapping: the transfer format resolved for this model, device and budget
(`resolve_format`); saved records reused (`store_path`, the record cache) or record layouts planned; every
budget and memory check, all before anything changes (`plan_store`); the predictor (`build_router_predictor`);
then each layer's experts stored, encoded or copied from the model or read from the checkpoint, with the model
given back untouched if anything fails (`fill_store`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from model_adapters import MoEAdapter

from .budget import BudgetPlan, LayerInfo, plan_records, resolve_budget_bytes
from .checkpoint import StreamedExperts
from .config import AUTO_LOSSLESS_MIN_RECORD_BYTES, MiraConfig
from .encode import RecordEncoder, encoder_for
from .errors import ConfigError, IncompatibleFileError
from .host_compute import own_tensors
from .layout import IdentityCodec
from .load_report import LoadReport
from .manager import ExpertManager
from .neuron_split import HostParts, NeuronSplit, SplitWeights, host_neurons, pairing_of
from .predictors import build_predictor
from .proxy import activate, layout_flags
from .quant import codec_for_config, codec_names, find_codec_entry, is_native
from .record_cache import RecordCache, default_root
from .resources import (
    budget_fraction,
    bytes_to_move,
    check_device_memory,
    check_host_memory,
    check_offload_space,
    host_has_room,
    unloaded_bytes,
)
from .saved_store import CorruptStoreError, SavedStore
from .settings import ManagerSettings
from .store import ExpertStore, codec_spec
from .targets import ROUTER_HASH, RouterTable, Target, expert_specs

T = TypeVar("T")


@dataclass
class StorePlan:
    """What `plan_store` decided and checked for one model, before anything in it changes."""

    cfg: MiraConfig  # with the transfer format and placement made concrete (`resolve_format`)
    layers: list[LayerInfo]
    specs: dict[int, dict]  # layer -> {tensor name: (per-expert shape, dtype)}
    raw_bytes: dict[int, int]  # layer -> bytes of one expert in the checkpoint's dtype
    all_bytes: int
    codec: object
    budget: BudgetPlan
    encoder: RecordEncoder
    store: ExpertStore  # empty; slabs of a streamed store may already be page-locked
    layouts: dict  # layer -> record layout ({} for raw records)
    saved: SavedStore | None  # saved records read instead of encoding
    cache: RecordCache | None  # None until every shard is there where the checkpoint still arrives
    parts: HostParts | None = None  # host_compute="split": the experts' host parts (the store holds the device parts)

    @property
    def weights(self):
        """The experts as whole tensors: the store, or its device parts joined to the host parts."""
        return self.store if self.parts is None else SplitWeights(self.store, self.parts)

    def close(self) -> None:
        """Give back what planning took: page-locked slabs, experts kept on the device between the passes."""
        self.store.close()
        self.encoder.finish()


def plan_store(
    model: nn.Module,
    cfg: MiraConfig,
    device: torch.device,
    adapter: MoEAdapter,
    targets: list[Target],
    streamed: StreamedExperts | None,
    progress: bool,
    report: LoadReport,
    fingerprint: dict,
) -> StorePlan:
    """Resolve the format and budget, find saved records or plan layouts, and run every check (device,
    disk and host memory): raises before anything in the model changes. `model` may be a skeleton on the
    meta device (`checkpoint.build_skeleton`), its experts read from shards as they arrive."""
    layers = [LayerInfo(t.ordinal, t.name, t.num_experts, adapter.top_k(t.parent, model.config, t.num_experts)) for t in targets]
    specs = expert_specs(targets)
    raw_bytes = {layer: IdentityCodec().plan(s).nbytes for layer, s in specs.items()}
    loading = unloaded_bytes(model)  # a skeleton's other weights load after the store is filled
    # A fractional budget is a share of the checkpoint's expert bytes, whatever the transfer format.
    all_bytes = sum(raw_bytes[li.ordinal] * li.num_experts for li in layers)
    parts = None
    pinned = device.type == "cuda" and cfg.host_memory in ("auto", "pinned")
    if cfg.host_compute == "split" and streamed is not None and streamed.codec is not None:
        raise ConfigError(
            f"host_compute='split' computes each expert's host part from its uncompressed weights, but this checkpoint "
            f"ships its experts as {streamed.codec.name}, which mira-hf serves in their own bytes. Use host_compute='off' "
            "or 'auto', or a checkpoint in bf16."
        )
    if cfg.host_compute == "split":  # the store holds each expert's device part; the host parts stay beside it
        parts = HostParts(neuron_splits(cfg, adapter, targets, specs), pinned=pinned)
        whole, specs = specs, {layer: parts.splits[layer].specs(s)[0] for layer, s in specs.items()}
        device_bytes = {layer: IdentityCodec().plan(s).nbytes for layer, s in specs.items()}
        host_bytes = {layer: parts.stored_bytes(layer, whole[layer]) for layer in specs}
        raw_bytes = device_bytes
    budget_bytes = resolve_budget_bytes(cfg, all_bytes, device, lambda: bytes_to_move(model, targets, device))
    if parts is not None and budget_bytes >= all_bytes:
        warnings.warn(
            "mira-hf: host_compute='split' with a GPU budget that holds every whole expert: nothing needs copying after "
            "the first uses, and the host parts still cost host time at every use. host_compute='off' is faster here.",
            stacklevel=4,
        )
    native = streamed.codec if streamed is not None else None  # a pre-quantized checkpoint's own format
    cfg = resolve_format(cfg, device, specs, raw_bytes, all_bytes, budget_bytes, native)
    codec = native if native is not None else codec_for_config(cfg.quantization, cfg.quant)
    placement = cfg.quant.placement if cfg.quantization is not None else "raw"
    # Record layouts: from saved records (store_path, or the record cache), else planned (lossless
    # reads the weights here: its records reserve room for their escapes).
    # what the model takes on the device once loaded: the rest may hold experts between the two passes
    after = budget_bytes + bytes_to_move(model, targets, device) if device.type == "cuda" else 0
    encoder = encoder_for(device, max(raw_bytes.values(), default=0), progress, keep_free_bytes=after, report=report)
    if streamed is not None:
        streamed.report = report
    # host parts are read from the checkpoint at each load: saved device parts alone would not do
    saved, cache = saved_records(cfg, codec, fingerprint, streamed, specs) if parts is None else (None, None)
    if cache is not None:
        cache.report = report
    layouts = saved_layouts(codec, targets, specs, saved) if saved is not None else None
    if layouts is None and saved is not None:  # the saved layouts do not fit these experts
        if cache is None:
            raise IncompatibleFileError(
                f"the expert store in {cfg.store_path} does not hold records of these experts in this format. Drop "
                "store_path to encode again, then save a new store with model.mira.save_store(dir)."
            )
        cache.drop("its layouts do not fit this checkpoint")
        saved = None
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
                expert = _experts(t, streamed, encoder.device, parts)
                # An expert kept on the device from here is encoded without being read again; a split one must be
                # read again, for its host part is written beside the store as it is read (`HostParts.splitter`).
                key = t.ordinal if parts is None else None
                layouts[t.ordinal] = encoder.plan_layer(codec, specs[t.ordinal], t.num_experts, expert, key=key)
                nbytes = t.num_experts * layouts[t.ordinal].nbytes
                unplanned = sum(raw_bytes[u.ordinal] * u.num_experts for u in targets[i + 1 :])
                early = early and host_has_room(reserved + nbytes + unplanned + loading)
                if early:
                    store.reserve({t.ordinal: nbytes})
                    reserved += nbytes
    layouts = layouts or {}
    try:  # experts kept on the device between the passes are given back if a check fails
        budget = plan_records(
            layers, budget_bytes, placement, codec, layouts, raw_bytes, budget_fraction(cfg.gpu_budget), all_bytes
        )
        check_device_memory(budget.device_bytes, device, model, targets)
        store_bytes = [(layouts[li.ordinal].nbytes if layouts else raw_bytes[li.ordinal]) * li.num_experts for li in layers]
        check_offload_space(cfg, store_bytes)
        if parts is not None:
            store_bytes += [host_bytes[li.ordinal] * li.num_experts for li in layers]
        # saved records give back no original tensors: the model's are kept until every layer is stored
        check_host_memory(cfg, store_bytes, targets, streamed is not None, codec.exact and saved is None, loading)
        if parts is not None:
            for li in layers:
                parts.allocate(li.ordinal, whole[li.ordinal], li.num_experts)
    except BaseException:
        store.close()  # slabs page-locked while planning
        encoder.finish()
        raise
    return StorePlan(cfg, layers, specs, raw_bytes, all_bytes, codec, budget, encoder, store, layouts, saved, cache, parts)


def build_router_predictor(plan: StorePlan, model: nn.Module, adapter: MoEAdapter, targets: list[Target], fingerprint: dict):
    """(the routers by layer, the predictor): the predictor and its files checked against the loaded model."""
    cfg = plan.cfg
    router_probs = RouterTable(adapter, targets)
    predictor = build_predictor(cfg.predictor, plan.layers, router_probs, cfg.prediction, cfg.predictor_path, model, fingerprint)
    return router_probs, predictor


def new_manager(plan: StorePlan, device: torch.device, router_probs, predictor, fingerprint: dict) -> ExpertManager:
    """The manager over the filled store."""
    settings = ManagerSettings.from_config(plan.cfg)
    return ExpertManager(
        plan.store,
        plan.layers,
        plan.budget,
        device,
        settings,
        predictor=predictor,
        router_probs=router_probs,
        fingerprint=fingerprint,
        record_cache=plan.cache,
        host_parts=plan.parts,
    )


def fill_store(
    plan: StorePlan,
    targets: list[Target],
    streamed: StreamedExperts | None,
    progress: bool,
    finish: Callable[[], T],
) -> T:
    """Store every layer's experts, then `finish()`: the manager over them, installed in the model (the model's own
    copies of the experts are dropped only once it returns). Experts taken from the model leave it layer by layer; if
    anything fails (in `finish` too, which undoes its own part first), the model gets them back untouched and the
    error propagates."""
    cfg, store, encoder, codec, layouts = plan.cfg, plan.store, plan.encoder, plan.codec, plan.layouts
    saved, cache = plan.saved, plan.cache
    encoding = cfg.quantization is not None and saved is None
    # Slabs page-locked ahead, for streamed experts only: experts in the model's host memory are freed one
    # layer at a time as they are stored, and slabs locked ahead would hold the whole store beside them.
    if streamed is not None:
        store.reserve(
            {t.ordinal: t.num_experts * (layouts[t.ordinal].nbytes if layouts else plan.raw_bytes[t.ordinal]) for t in targets}
        )

    # Validation done: from here on, any failure rolls back to the untouched model.
    # Exact records (uncompressed or lossless) encoded from the model's own tensors restore them exactly, so
    # each layer's tensors are dropped as soon as it is stored (peak host memory grows by one layer).
    # Quantized records would restore only approximately, and saved records (`store_path`) hold whatever
    # tensors they were saved from, so then the originals are kept until every layer is stored and a
    # failure can give them back untouched.
    restorable = store.exact and saved is None
    stripped: list[Target] = []
    try:
        with encoder.progress_pass(f"encoding {codec.name} records", plan.all_bytes if encoding else 0):
            for t in _progress(targets, progress and not encoding, "reading experts" if streamed else "storing experts"):
                saved = _add_layer(store, t, plan.specs[t.ordinal], layouts.get(t.ordinal), streamed, saved, cache, plan.parts)
                if streamed is not None:  # nothing in the model to free or to give back on failure
                    continue
                t.release()  # the parameter objects stay (`Target.params`): exposed again over the store's records
                if restorable:
                    t.free()  # the last reference to the layer's tensors: dropped one layer at a time
                stripped.append(t)
        encoder.finish()
        done = finish()
    except BaseException:
        for t in stripped:
            if restorable:
                t.restore(plan.weights)
            else:
                t.put_back()
        store.close()
        encoder.finish()  # experts kept on the device between the passes
        raise
    finally:
        if streamed is not None:
            streamed.close()
    for t in stripped:
        t.free()
    cache = plan.cache  # `finish` opens it where the checkpoint was still arriving when planned
    if cache is not None and saved is None:  # encoded here (or the entry was dropped): cache the records
        cache.write(store.slabs(), store.plans())
        store.read_by(cache.wait)
    return done


def resolve_format(
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
        if placement in ("packed", "mixed") and not native.computes_natively(device):
            raise ConfigError(
                f"QuantConfig(placement={placement!r}) was given for {native.name} experts, but transformers computes "
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
            # "on" computes misses from uncompressed records on the host; "auto" keeps the faster format and stays
            # off where it is encoded (host_compute.py)
            and cfg.host_compute != "on"
            and budget_bytes < all_bytes
            and min(raw_bytes.values()) >= AUTO_LOSSLESS_MIN_RECORD_BYTES
            and dtypes <= {torch.bfloat16, torch.float32}
            else None
        )
    placement = cfg.quant.placement
    if placement == "auto":
        placement = find_codec_entry(q).default_placement if q is not None else "dequant"
    return cfg.replace(quantization=q, quant=dataclasses.replace(cfg.quant, placement=placement))


def _experts(t: Target, streamed: StreamedExperts | None, device: torch.device | None = None, parts: HostParts | None = None):
    """`e -> {name: expert e's tensor}` of one target: read from the checkpoint (onto `device`, the
    encoder's), or views of its tensors; with `parts`, each expert's device part."""
    if streamed is not None:
        whole = streamed.expert_fn(t.name, device)
    else:
        whole = lambda e: {n: t.layout.expert(t.module, n, x, e) for n, x in t.tensors.items()}  # noqa: E731
    if parts is None:
        return whole
    split = parts.splits[t.ordinal]
    return lambda e: split.split(whole(e))[0]


def neuron_splits(cfg: MiraConfig, adapter: MoEAdapter, targets: list[Target], specs: dict) -> dict[int, NeuronSplit]:
    """How each layer's experts split by neuron for host_compute="split" (`neuron_split`); refused, before
    anything changes, for experts whose output is not a sum over neurons of what the host can compute."""
    splits = {}
    for t in targets:
        layout = t.layout
        if layout.nested:  # its layout says how its tensors hold neurons
            up, down, pairing, axes = layout.up, layout.down, layout.pairing, layout.neuron_axes
            transposed, down_transposed = False, layout.down_transposed
        else:
            flags = layout_flags(adapter, t.module)
            own = own_tensors(t.module, {*t.tensors, adapter.route_norm})  # a per-route norm follows the parts' sum
            if flags["has_post_expert_norm"] or own:
                raise ConfigError(
                    f"host_compute='split' adds each expert's host part to its device part, but the experts module at "
                    f"{t.name} ({type(t.module).__name__}) applies its own tensors to the expert's output "
                    f"({', '.join(own) or 'a post-expert norm'}), so its output is not a sum over neurons. Use "
                    "host_compute='auto', 'on' or 'off'."
                )
            has_gate = flags["has_gate"]
            apply_gate = getattr(t.module, "_apply_gate", None)
            pairing = pairing_of(lambda h, m=t.module, g=has_gate, a=apply_gate: activate(m, g, a, h), has_gate)
            up, down, axes = ("gate_up_proj" if has_gate else "up_proj"), "down_proj", {}
            transposed = down_transposed = flags["is_transposed"]
        neurons = specs[t.ordinal][down][0][-2 if down_transposed else -1]  # one expert's down rows: [I, H] or [H, I]
        splits[t.ordinal] = NeuronSplit(up, pairing, transposed, neurons, host_neurons(neurons, cfg.host_share), axes, down)
    return splits


def saved_records(
    cfg: MiraConfig, codec, fingerprint: dict, streamed: StreamedExperts | None, specs: dict
) -> tuple[SavedStore | None, RecordCache | None]:
    """The saved records this load reads instead of encoding: `store_path` (an error if they do not fit),
    else the record cache's entry for this checkpoint and format (None on a miss), and that cache. A
    checkpoint whose shards still arrive has no entry (none can name files not there yet): (None, None)."""
    if cfg.quantization is None or is_native(cfg.quantization):  # nothing encoded to keep
        return None, None
    if cfg.store_path is not None:
        try:
            return SavedStore(cfg.store_path, codec_spec(codec), fingerprint), None
        except IncompatibleFileError as exc:
            if getattr(exc, "differing", None) != [ROUTER_HASH]:
                raise
            # the routers' hash alone: what the same checkpoint gives loaded in another dtype than the store was saved from
            raise IncompatibleFileError(
                f"the expert store in {cfg.store_path} was made from other router weights than this model's "
                f"({ROUTER_HASH} differs): another checkpoint of this shape, or this one loaded in another dtype than "
                "the store was saved from (the routers round to it). Load the model in the dtype the store was saved "
                "from, or drop store_path to quantise again, then save a new store with model.mira.save_store(dir)."
            ) from exc
    if streamed is None or not streamed.index.all_arrived():
        return None, None
    cache = record_cache(cfg, codec, fingerprint, streamed, specs)
    return (cache.open() if cache is not None else None), cache


def record_cache(cfg: MiraConfig, codec, fingerprint: dict, streamed: StreamedExperts, specs: dict) -> RecordCache | None:
    """The record cache's entry for this checkpoint (once every shard is there) and format; None where records
    are not cached (raw records, a checkpoint's own format, `store_path`, the cache turned off)."""
    if cfg.quantization is None or is_native(cfg.quantization) or cfg.store_path is not None:
        return None
    if cfg.loader.record_cache is None:
        return None
    root = default_root() if cfg.loader.record_cache == "auto" else cfg.loader.record_cache
    # The identity of the checkpoint's files (path, size, mtime) pins the weights, so the key needs no
    # router weight: it is known before the non-expert weights load.
    shape = {k: v for k, v in fingerprint.items() if k != ROUTER_HASH}
    return RecordCache(root, streamed.index.files, codec_spec(codec), shape, specs)


def saved_layouts(codec, targets: list[Target], specs: dict, saved: SavedStore) -> dict | None:
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
        if saved.shape(t.ordinal) != (t.num_experts, layout.nbytes):
            return None
        layouts[t.ordinal] = layout
    return layouts


def _add_layer(
    store: ExpertStore, t: Target, specs, layout, streamed, saved: SavedStore | None, cache: RecordCache | None, parts=None
):
    """Store one target's experts: its saved records when there are some, else encoded (or copied) from
    its weights. A cache entry found damaged here is dropped and the layer encoded; returns the saved
    records still in use (None once dropped)."""
    E = t.num_experts
    if saved is not None:
        try:
            store.add_layer_from(t.ordinal, specs, E, _experts(t, streamed), records=saved.fill(t.ordinal), layout=layout)
            return saved
        except CorruptStoreError as exc:
            if cache is None:
                raise
            cache.drop(str(exc))
        except IncompatibleFileError as exc:  # records of these sizes, packed from other tensors
            if cache is None:
                tensors = ", ".join(f"{name} {str(dtype).removeprefix('torch.')}" for name, (_, dtype) in specs.items())
                raise IncompatibleFileError(
                    f"the expert store in {saved.directory} holds records packed from other tensors than these experts' "
                    f"({tensors}), such as another dtype ({exc}). Load the model in the dtype the store was saved from, "
                    "or drop store_path to encode again, then save a new store with model.mira.save_store(dir)."
                ) from exc
            cache.drop(str(exc))
    device = store.encoder.device if store.quantized else None  # raw records: copied from host memory into the slab
    expert = _experts(t, streamed, device)
    if parts is not None:  # each expert's host part written beside the store on the way
        expert = parts.splitter(t.ordinal, expert)
    store.add_layer_from(t.ordinal, specs, E, expert, layout=layout)
    return None


def _progress(items, enabled: bool, desc: str):
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="layer")
