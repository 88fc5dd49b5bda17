"""`ExpertStore`: every routed expert in host memory, in one slab per layer.

A layer's experts live in one slab of `E · record_bytes` bytes, laid out by what the records hold:
- encoded records (lossless, int8/int4/nf4, native FP8/MXFP4): expert by expert, `[E, record_bytes]`, so
  expert `e` is the row `slab[e]` and one copy moves it;
- uncompressed records (the checkpoint's bytes): tensor by tensor, as the model's fused parameters are
  (`gate_up_proj [E, 2I, H]`, then `down_proj [E, H, I]`, ...): tensor `t` of every expert fills
  `[E · offset_t, E · (offset_t + nbytes_t))`, so each fused parameter is one contiguous tensor over the
  slab (`expert_views`, what `state_dict()` and `parameters()` expose) and expert `e`'s share of it is a
  contiguous slice. Moving an expert copies one slice per tensor into the slot's record (`pieces`), which
  is laid out as `layout` says; the same bytes as a row would be, without the alignment gaps.
Three host tiers, fastest first:
- pinned slabs (page-locked: the GPU's copy engine reads them directly at full PCIe speed);
- pageable slabs (no pinning cost at load; copies go through the loader's pinned staging ring);
- disk slabs beyond `host_budget`, files of the store's own in `offload_dir`, memory-mapped shared (records
  written in place go to the file, not to RAM) and read through the same ring.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from . import offload_files
from .encode import Alloc, RecordEncoder, read_ahead
from .layout import IdentityCodec, RawLayout, plan_layer
from .pinned import pinned_empty
from .quant.cast import CastCodec, CastLayout, records_layout, simplify


def codec_spec(codec) -> dict:
    """What identifies a codec's record format (saved records are only reused with the same one)."""
    return dict(name=codec.name, group_size=getattr(codec, "group_size", None), inner=repr(getattr(codec, "inner", codec)))


def over_host_budget(host_bytes: int, nbytes: int, host_budget_bytes: int | None) -> bool:
    """Whether a layer of `nbytes` goes to the disk tier, with `host_bytes` already in host memory: a
    layer stays in host memory while `host_budget` allows (later, smaller layers may still fit)."""
    return host_budget_bytes is not None and host_bytes + nbytes > host_budget_bytes


@dataclass
class _Slab:
    data: torch.Tensor  # uint8 [E, record_bytes]: rows are records when encoded, else tensor by tensor (module doc)
    layout: object
    tier: str  # "pinned" | "pageable" | "disk"
    dtype: torch.dtype  # dtype the experts compute in
    raw_layout: RawLayout  # the uncompressed layout (what a dequantised slot holds)
    path: str | None = None


class ExpertStore:
    """Host-side expert records keyed by MoE layer ordinal."""

    def __init__(
        self,
        codec=None,
        pinned: bool = False,
        host_budget_bytes: int | None = None,
        offload_dir: str | None = None,
        encoder: RecordEncoder | None = None,
    ) -> None:
        """encoder: where records are encoded (a `RecordEncoder`: the CUDA device, or host threads);
        default: on the CPU, one expert at a time."""
        self.codec = codec or IdentityCodec()
        self.encoder = encoder or RecordEncoder("cpu", workers=1)
        self.pinned = pinned
        self.host_budget_bytes = host_budget_bytes
        # resolved now: a later cast writes, and `close` removes, files in the same place after an os.chdir
        self.offload_dir = os.path.abspath(offload_dir) if offload_dir is not None else None
        self._slabs: dict[int, _Slab] = {}
        self._host_bytes = 0
        # Waits for readers of the slabs that run beside the model (a record cache's background write: `read_by`)
        self._readers: list[Callable[[], None]] = []
        self._reserved: dict[int, tuple[int, Future]] = {}  # layer -> (bytes, its pinned slab being allocated)
        self._pin_pool: ThreadPoolExecutor | None = None
        self._reserved_host_bytes = 0
        # the disk files this store wrote: removed by `close`, or when the store is dropped (the model let go of
        # without `unload()`) or the process exits, so they never pile up in `offload_dir`
        # (path -> the process that wrote it: only that one removes it, not a forked child's copy of this store)
        self._files: dict[str, int] = {}
        weakref.finalize(self, _remove_files, self._files)

    # -- building -------------------------------------------------------------------------------
    def add_layer(
        self,
        layer: int,
        fused: Mapping[str, torch.Tensor],
        calib: torch.Tensor | None = None,
        records: torch.Tensor | None = None,
        layout: object | None = None,
    ) -> None:
        """Copy one layer's fused expert tensors (`name -> [E, ...]`) into records.

        The caller frees `fused` afterwards, so host memory while loading grows by one layer at a time.
        `records` (uint8 `[E, record_bytes]`, from `save` of a store with the same codec) are taken as
        they are instead of encoding `fused` again: quantise once. `layout`: the layer's record layout
        when the caller has planned it already (`plan_layer(codec, fused)`).
        """
        num_experts = {t.shape[0] for t in fused.values()}
        if len(num_experts) != 1:
            raise ValueError(f"layer {layer}: expert tensors disagree on the expert count: {sorted(num_experts)}")
        (E,) = num_experts
        specs = {name: (tuple(t.shape[1:]), t.dtype) for name, t in fused.items()}
        layout = layout if layout is not None else plan_layer(self.codec, fused)
        self.add_layer_from(layer, specs, E, lambda e: {n: t[e] for n, t in fused.items()}, calib, records, layout)

    def add_layer_from(
        self,
        layer: int,
        specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        num_experts: int,
        expert: Callable[[int], Mapping[str, torch.Tensor]],
        calib: torch.Tensor | None = None,
        records: torch.Tensor | Callable[[torch.Tensor], None] | None = None,
        layout: object | None = None,
    ) -> None:
        """Build one layer's records from `expert(e) -> {name: tensor of that expert}`, one expert at a
        time (`specs`: name -> (per-expert shape, dtype)). A disk-tier layer is written record by record,
        so loading a checkpoint expert by expert needs one expert of working memory, not one layer.
        `layout`: planned by the caller when the codec needs the weights to plan (lossless). `records`: the
        layer's saved records, a uint8 tensor [E, record_bytes] or `fill(rows)` that writes them into the
        store's own slab (read straight from a saved store, `mira_hf.saved_store`); `expert` is not called."""
        E = num_experts
        if layout is None:
            if hasattr(self.codec, "plan_experts"):
                raise ValueError(
                    f"codec {self.codec.name!r} plans a layer from its weights: pass layout=plan_layer(codec, fused)"
                )
            layout = self.codec.plan(specs)
        raw_layout = IdentityCodec().plan(specs)
        if isinstance(records, torch.Tensor) and tuple(records.shape) != (E, layout.nbytes):
            from .errors import IncompatibleFileError

            raise IncompatibleFileError(
                f"layer {layer}: the saved records are {tuple(records.shape)} but these weights need ({E}, {layout.nbytes}) "
                "in this format. Drop store_path to encode again, then save a new store."
            )
        nbytes = E * layout.nbytes
        tier = self.next_tier(nbytes)
        dtype = next(iter(specs.values()))[1]
        extra = {"calib": calib} if calib is not None else {}
        path = None
        try:
            if tier == "disk":
                path = offload_files.create(
                    self.offload_dir, f"layer{layer:04d}", nbytes, f"MoE layer {layer}'s experts"
                )  # its blocks reserved: no SIGBUS
                self._files[path] = os.getpid()
                with open(path, "r+b") as f:
                    if callable(records):  # straight into the file, through a shared mapping of it
                        records(torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8).view(E, layout.nbytes))
                    elif records is not None:
                        for e in range(E):
                            os.pwrite(f.fileno(), records[e].numpy().data, e * layout.nbytes)
                    elif not self.quantized:  # the checkpoint's bytes, expert by expert, through a shared mapping
                        mapped = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8).view(E, layout.nbytes)
                        for e in range(E):
                            _write_raw(mapped, layout, e, expert(e))
                        del mapped
                    else:  # record by record: one expert of working memory (per encoding thread)
                        sink = lambda e, record: os.pwrite(f.fileno(), record.cpu().numpy().data, e * layout.nbytes)  # noqa: E731
                        self.encoder.encode_layer(self.codec, layout, E, expert, sink, extra, key=layer)
                # Shared: a rewrite in place (`load_state_dict`, a write into `expert_views`) writes the file, where a
                # private mapping would copy each page written into anonymous memory beyond `host_budget`. Only files
                # this store made itself are mapped (saved stores and the record cache are read with pread).
                slab = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8).view(E, layout.nbytes)
            else:
                report = self.encoder.report
                reserved = self._reserved.pop(layer, None)
                if not self._reserved and self._pin_pool is not None:
                    self._pin_pool.shutdown(wait=False)  # its thread ends after the last slab
                    self._pin_pool = None
                if tier == "pinned" and reserved is not None and reserved[0] == nbytes:
                    with report.span("pin_wait"):
                        slab = reserved[1].result().view(E, layout.nbytes)
                elif tier == "pinned":
                    slab = self._pinned(nbytes).view(E, layout.nbytes)
                else:
                    slab = torch.empty((E, layout.nbytes), dtype=torch.uint8)
                if callable(records):
                    with report.span("cache_read", nbytes):
                        records(slab)
                elif records is not None:
                    slab.copy_(records)
                elif not self.quantized:  # the checkpoint's bytes: copies, nothing to compute
                    readers = self.encoder.readers if getattr(expert, "thread_safe", False) else 1
                    ahead = read_ahead(E, expert, readers)
                    try:
                        for e, tensors in enumerate(ahead):
                            with report.span("copy", layout.nbytes):
                                _write_raw(slab, layout, e, tensors)
                    finally:
                        ahead.close()
                else:
                    self.encoder.encode_into(self.codec, layout, E, expert, slab, extra, key=layer)
                self._host_bytes += nbytes
            validate = getattr(self.codec, "validate", None)  # codecs whose records carry a header
            for e in range(E if validate is not None else 0):  # once, here: a decode on the device never reads it (a sync)
                validate(slab[e], layout)
        except BaseException:
            if path is not None:  # a layer that failed leaves no file behind (another attempt makes its own)
                _remove_files({path: self._files.pop(path)})
            raise
        self._slabs[layer] = _Slab(slab, layout, tier, dtype, raw_layout, path)

    def reserve(self, layer_bytes: Mapping[int, int]) -> None:
        """Page-lock the pinned slabs of layers about to be added (ordinal -> bytes, in the order
        `add_layer_from` will get them; a layer reserved already is skipped) on a background thread, one
        after another, so page-locking a layer overlaps reading and encoding the ones before it. A layer
        added with another size gets its own slab; `close` drops the slabs not taken."""
        if not self.pinned:
            return  # pageable slabs cost nothing until they are written
        if self._pin_pool is None:
            # page-locked in the caller's CUDA context (a new thread would start on device 0)
            device = torch.cuda.current_device() if torch.cuda.is_available() else None
            init = (torch.cuda.set_device, (device,)) if device is not None else (None, ())
            self._pin_pool = ThreadPoolExecutor(1, thread_name_prefix="mira-pin", initializer=init[0], initargs=init[1])
            self._reserved_host_bytes = self._host_bytes
        for layer, nbytes in layer_bytes.items():
            if layer in self._reserved or layer in self._slabs:
                continue
            if over_host_budget(self._reserved_host_bytes, nbytes, self.host_budget_bytes):
                continue  # the disk tier (what `next_tier` will say)
            self._reserved_host_bytes += nbytes
            self._reserved[layer] = (nbytes, self._pin_pool.submit(self._pinned, nbytes))

    def _pinned(self, nbytes: int) -> torch.Tensor:
        # exactly its size: torch's pinned allocator would round it up to a power of two
        with self.encoder.report.span("pin", nbytes):
            return pinned_empty(nbytes)

    def next_tier(self, nbytes: int) -> str:
        """The tier a layer of `nbytes` would go to if added now: host until `host_budget` is used up."""
        if over_host_budget(self._host_bytes, nbytes, self.host_budget_bytes):
            return "disk"
        return "pinned" if self.pinned else "pageable"

    # -- reading --------------------------------------------------------------------------------
    @property
    def layers(self) -> list[int]:
        return sorted(self._slabs)

    def layout(self, layer: int):
        return self._slabs[layer].layout

    def raw_layout(self, layer: int) -> RawLayout:
        """The uncompressed layout of one expert of `layer` (equal to `layout` without quantization)."""
        return self._slabs[layer].raw_layout

    @property
    def quantized(self) -> bool:
        """Whether records are encoded (not the checkpoint's bytes): they must be decoded on the device."""
        return not isinstance(self.codec, IdentityCodec)

    @property
    def writable(self) -> bool:
        """Whether other values can be encoded into the records (a cast, `load_state_dict`): not a checkpoint-native
        format's, which hold the checkpoint's quantized bytes and scales (`NativeCodec.encodes_values`)."""
        return getattr(self.codec, "encodes_values", True)

    @property
    def exact(self) -> bool:
        """Whether decoding gives back the checkpoint's tensors bit for bit (no codec, or lossless)."""
        return self.codec.exact

    def dtype(self, layer: int) -> torch.dtype:
        return self._slabs[layer].dtype

    def num_experts(self, layer: int) -> int:
        return self._slabs[layer].data.shape[0]

    def record(self, layer: int, expert: int) -> torch.Tensor:
        """The record (uint8 [record_bytes]) of one expert: the slab's row where records are encoded; a copy
        put together from `pieces` where they are uncompressed (alignment gaps zero)."""
        slab = self._slabs[layer]
        if self.quantized:
            return slab.data[expert]
        out = torch.zeros(slab.layout.nbytes, dtype=torch.uint8)
        for offset, piece in self.pieces(layer, expert):
            out[offset : offset + piece.numel()] = piece
        return out

    def pieces(self, layer: int, expert: int, start: int = 0, end: int | None = None) -> list[tuple[int, torch.Tensor]]:
        """Bytes [start, end) of one expert's record as they lie in host memory: `(offset in the record,
        uint8 tensor)` in record order, no copy. One piece (a row of the slab) where records are encoded; one
        per tensor where they are uncompressed (the expert's slice of each fused parameter; the alignment
        gaps between tensors hold nothing and are left out)."""
        slab = self._slabs[layer]
        end = slab.layout.nbytes if end is None else end
        if self.quantized:
            return [(start, slab.data[expert, start:end])]
        E, flat, out = slab.data.shape[0], slab.data.view(-1), []
        for t in slab.layout.tensors:
            lo, hi = max(start, t.offset), min(end, t.offset + t.nbytes)
            if lo < hi:
                base = E * t.offset + expert * t.nbytes - t.offset  # record offset -> slab offset
                out.append((lo, flat[base + lo : base + hi]))
        return out

    def tier(self, layer: int) -> str:
        return self._slabs[layer].tier

    def record_bytes(self, layer: int) -> int:
        return self._slabs[layer].layout.nbytes

    @property
    def nbytes(self) -> int:
        return sum(s.data.numel() for s in self._slabs.values())

    def tier_bytes(self) -> dict[str, int]:
        out = {"pinned": 0, "pageable": 0, "disk": 0}
        for s in self._slabs.values():
            out[s.tier] += s.data.numel()
        return out

    def fused(self, layer: int, alloc: Alloc = torch.empty) -> dict[str, torch.Tensor]:
        """Rebuild one layer's fused tensors `name -> [E, ...]` (for unload and save), each a new tensor of the
        layer's dtype from `alloc(shape, dtype=...)`, filled expert by expert (`save_pretrained` gives a file-backed
        buffer's). Encoded records are decoded by the store's encoder: on the device where it encodes, for exact
        codecs (`RecordEncoder.decode_layer`)."""
        slab = self._slabs[layer]
        if not self.quantized:
            return {name: alloc(view.shape, dtype=view.dtype).copy_(view) for name, view in self.expert_views(layer).items()}
        return self.encoder.decode_layer(self.codec, slab.data, slab.layout, slab.dtype, alloc)  # where records are encoded

    def expert_views(self, layer: int) -> dict[str, torch.Tensor] | None:
        """`name -> [E, ...]` over every expert of `layer`: contiguous typed views of its slab (no copy;
        writing into them writes the records), or None where records are encoded (`quantized`)."""
        if self.quantized:
            return None
        slab = self._slabs[layer]
        E = slab.data.shape[0]
        flat = slab.data.view(-1)  # [E·R] bytes, the slab's memory (no copy)
        # Each view on its own storage (`own_storage`): storage-identity checks (transformers' tied-weight detection in
        # save_pretrained, safetensors) would otherwise take the tensors of one layer for one tensor shared under
        # several names.
        return {
            t.name: own_storage(flat[E * t.offset : E * (t.offset + t.nbytes)].view(t.dtype).view(E, *t.shape))
            for t in slab.layout.tensors
        }

    def expert_specs(self, layer: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (per-expert shape, dtype) of `layer`'s expert tensors, as the checkpoint has them."""
        return {t.name: (t.shape, t.dtype) for t in self._slabs[layer].raw_layout.tensors}

    def plan_rewrite(self, layer: int, fused: Mapping[str, torch.Tensor] | None = None, dtype: torch.dtype | None = None):
        """The record layout `layer` would get from `rewrite(layer, fused, dtype)`, planned before anything
        changes (a lossless layout depends on the values). Raises the codec's error for a dtype it cannot hold."""
        specs = self.expert_specs(layer)
        dtype = dtype or self._slabs[layer].dtype
        new_specs = {n: (shape, dtype) for n, (shape, _) in specs.items()}
        return self.encoder.plan_layer(self.codec, new_specs, self.num_experts(layer), self._rewritten(layer, fused, dtype))

    def plan_cast(self, layer: int, dtype: torch.dtype):
        """The layout of `layer`'s records cast to `dtype` in place (`mira_hf.quant.cast`): they stay as they are,
        and every decode casts what they hold through the dtypes since, in order. For records in a format that
        cannot hold `dtype` (the checkpoint's own FP8 or MXFP4 bytes, lossless records to fp16), or that a cast rounds
        nothing of (bf16 lossless records to fp32)."""
        old = self._slabs[layer]
        chain = simplify((*getattr(old.layout, "chain", (old.dtype,)), dtype))
        inner = records_layout(old.layout)
        return inner if len(chain) == 1 else CastLayout(inner, chain)

    def _recast(self, layer: int, dtype: torch.dtype, layout) -> None:
        """Give `layer` the layout `plan_cast` planned: its experts compute in `dtype` from the same records."""
        old = self._slabs[layer]
        specs = {name: (shape, dtype) for name, (shape, _) in self.expert_specs(layer).items()}
        self._slabs[layer] = dataclasses.replace(old, layout=layout, dtype=dtype, raw_layout=IdentityCodec().plan(specs))
        self._codec_for_layouts()

    def _codec_for_layouts(self) -> None:
        """The codec wrapped to decode cast records while some layer has them, else the records' own (as a saved
        store names it)."""
        cast = any(isinstance(s.layout, CastLayout) for s in self._slabs.values())
        if cast and not isinstance(self.codec, CastCodec):
            self.codec = CastCodec(self.codec)
        elif not cast and isinstance(self.codec, CastCodec):
            self.codec = self.codec.inner

    @property
    def cast_in_place(self) -> bool:
        """Whether some layer's records decode to another dtype than its experts compute in (`plan_cast`)."""
        return isinstance(self.codec, CastCodec)

    def read_by(self, wait: Callable[[], None]) -> None:
        """A reader of the slabs runs beside the model (a record cache's background write); `wait` returns once it
        has finished. A rewrite of records waits for it first."""
        self._readers.append(wait)

    def rewrite(self, layer: int, fused: Mapping[str, torch.Tensor] | None = None, dtype: torch.dtype | None = None, layout=None):
        """Encode `layer` again: with the tensors in `fused` (`name -> [E, ...]`, some or all of them) in place of
        the stored ones, and/or every tensor cast to `dtype`, exactly as casting the original tensors would.
        Records of the same size are written in place; otherwise the layer gets a new slab in the tier the host
        budget gives it (host memory grows by at most this layer meanwhile). `layout`: from `plan_rewrite`."""
        old = self._slabs[layer]
        dtype = dtype or old.dtype
        if layout is not None and _rewrite_kind(old, dtype, layout, fused) == "recast":
            return self._recast(layer, dtype, layout)  # planned by `plan_cast`: the records stay
        layout = layout if layout is not None else self.plan_rewrite(layer, fused, dtype)
        while self._readers:  # they read the records as loaded: not records written over meanwhile
            self._readers.pop()()
        expert = self._rewritten(layer, fused, dtype)
        E = self.num_experts(layer)
        if dtype == old.dtype and layout == old.layout:
            # each expert's tensors are read (expert(e)) before they are overwritten
            if not self.quantized:
                for e in range(E):
                    _write_raw(old.data, layout, e, expert(e))
            else:
                self.encoder.encode_layer(
                    self.codec, layout, E, expert, lambda e, record: old.data[e].copy_(record), {}, key=layer
                )
            return
        specs = {n: (shape, dtype) for n, (shape, _) in self.expert_specs(layer).items()}
        if old.path is None:
            self._host_bytes -= old.data.numel()
        try:
            self.add_layer_from(layer, specs, E, expert, layout=layout)  # on disk: a file of its own
        except BaseException:
            self._slabs[layer] = old
            if old.path is None:
                self._host_bytes += old.data.numel()
            raise
        if old.path is not None:
            _remove_files({old.path: self._files.pop(old.path)})  # the old mapping keeps its pages until it is dropped
        self._codec_for_layouts()

    def offload_bytes_to_rewrite(self, changes: Mapping[int, tuple[torch.dtype, object]]) -> int:
        """The most bytes that `rewrite` of the layers in `changes` (layer -> (dtype, layout from `plan_rewrite` or
        `plan_cast`)), one after another in that order, adds to `offload_dir` beyond the files there now: a layer
        given a new slab on disk is written while its old file is still there, and host layers that grow may pass
        `host_budget` and go to disk."""
        host, added, most = self._host_bytes, 0, 0
        for layer, (dtype, layout) in changes.items():
            old = self._slabs[layer]
            if _rewrite_kind(old, dtype, layout, None) != "new slab":
                continue
            nbytes = old.data.shape[0] * layout.nbytes
            if old.path is None:
                host -= old.data.numel()
            if over_host_budget(host, nbytes, self.host_budget_bytes):
                added += nbytes
                most = max(most, added)
            else:
                host += nbytes
            if old.path is not None:
                added -= old.data.numel()  # removed once the new slab is written
        return most

    def _rewritten(self, layer: int, fused: Mapping[str, torch.Tensor] | None, dtype: torch.dtype):
        """`e -> {name: tensor}`: expert e of `layer` as stored, with `fused` replacing tensors, cast to `dtype`."""
        slab = self._slabs[layer]
        fused = fused or {}

        def expert(e: int) -> dict[str, torch.Tensor]:
            stored = self._expert(slab, e) if len(fused) < len(slab.raw_layout.tensors) else {}
            out = {}
            for spec in slab.raw_layout.tensors:
                t = fused[spec.name][e] if spec.name in fused else stored[spec.name].to(slab.dtype)
                out[spec.name] = t.to(dtype)
            return out

        return expert

    def _expert(self, slab: _Slab, e: int) -> dict[str, torch.Tensor]:
        """Expert `e`'s tensors as stored: views of an uncompressed slab, else its record decoded."""
        if not self.quantized:
            return _raw_expert(slab.data, slab.layout, e)
        return self.codec.decode(slab.data[e], slab.layout, slab.dtype)

    def save(self, directory: str, fingerprint: dict) -> None:
        """Write every record and a header (`mira_hf.saved_store`), so a later load with
        `MiraConfig(store_path=directory)` reads them instead of quantising again."""
        from .saved_store import write_store

        write_store(directory, self.slabs(), self.codec_spec(), fingerprint, self.plans())

    def slabs(self) -> dict[int, torch.Tensor]:
        """Each layer's records, uint8 [E, record_bytes] (the store's own memory: read, never write)."""
        return {layer: s.data for layer, s in self._slabs.items()}

    def plans(self) -> dict[int, dict | None]:
        """Each layer's layout arguments for `codec.plan(specs, **args)` where the layout depends on the
        weights (`codec.plan_args`), else None: what a saved store needs to rebuild its layouts."""
        plan_args = getattr(self.codec, "plan_args", None)
        return {layer: plan_args(s.layout) if plan_args else None for layer, s in self._slabs.items()}

    def codec_spec(self) -> dict:
        """What identifies the record format (a saved store is only reused with the same one)."""
        return codec_spec(self.codec)

    def drop(self, layer: int) -> None:
        """Let go of `layer`'s records (`unload()`, once the model holds its experts as tensors of their own): their
        memory is freed when nothing else holds it (a disk-tier file is removed by `close`)."""
        self._slabs.pop(layer, None)

    def close(self) -> None:
        """Drop every record and remove the disk files this store wrote."""
        _remove_files(self._files)
        self._files.clear()
        self._slabs.clear()
        self._host_bytes = 0
        for _, slab in self._reserved.values():
            slab.cancel()  # one being allocated is freed when its future is
        self._reserved.clear()
        if self._pin_pool is not None:
            self._pin_pool.shutdown(wait=False)
            self._pin_pool = None


def _rewrite_kind(old: _Slab, dtype: torch.dtype, layout, fused) -> str:
    """How `rewrite` gives a layer (`old`) records in `dtype` as `layout`: "recast" (the records stay; planned by
    `plan_cast`), "in place" (the same layout and dtype: written over) or "new slab"."""
    if fused is None and records_layout(layout) is records_layout(old.layout):
        return "recast"
    if dtype == old.dtype and layout == old.layout:
        return "in place"
    return "new slab"


def _remove_files(files: Mapping[str, int]) -> None:
    """Remove the files of `files` (path -> the process that wrote it) that this process wrote: a child forked from
    the process that loaded the model leaves its parent's files alone, whether it drops its copy of the store, closes
    it (`unload()`) or exits."""
    pid = os.getpid()
    for path, writer in files.items():
        if writer == pid:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` (a contiguous CPU tensor) as a tensor over the same bytes on a storage of its own, starting at its first
    byte (no copy): views of one slab then look like the separate tensors they stand for to storage-identity checks
    (transformers' tied-weight detection, safetensors). Other tensors are returned as they are."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return t
    return torch.from_numpy(t.reshape(-1).view(torch.uint8).numpy()).view(t.dtype).view(t.shape)


def _raw_expert(data: torch.Tensor, layout: RawLayout, e: int) -> dict[str, torch.Tensor]:
    """Typed views of expert `e`'s tensors in an uncompressed slab `data` (uint8 [E, R], tensor by tensor)."""
    E, flat = data.shape[0], data.view(-1)
    return {
        t.name: flat[E * t.offset + e * t.nbytes : E * t.offset + (e + 1) * t.nbytes].view(t.dtype).view(t.shape)
        for t in layout.tensors
    }


def _write_raw(data: torch.Tensor, layout: RawLayout, e: int, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy expert `e`'s tensors into an uncompressed slab `data` (`_raw_expert`'s places)."""
    for name, view in _raw_expert(data, layout, e).items():
        view.copy_(tensors[name])
