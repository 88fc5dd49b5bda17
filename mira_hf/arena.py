"""`DeviceArena`: the device memory a `BudgetPlan` grants, and the copies into it.

One uint8 slab per slot pool (a slot is one row, so the budget is never exceeded by later
allocations), the codec's device buffers ("dequant": the staging record copies land in before
they are decoded into their slot; "packed" lossless: the scratch a weight is decoded into) and, for
placement "mixed", one slab per layer of the records kept packed beside the cache (`BudgetPlan.kept`),
copied once. The arena knows slots by pool and index only; which expert a slot holds is the cache's business.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from .budget import BudgetPlan
from .cache import Slot
from .layout import IdentityCodec, PackedWeights, split_point
from .loader import Loader
from .store import ExpertStore


class DeviceArena:
    """Slabs, codec buffers and typed views of one placement of the experts on `device`."""

    def __init__(
        self,
        store: ExpertStore,
        budget: BudgetPlan,
        device: torch.device,
        loader: Loader,
        split_copies: bool,
        split_min_bytes: int,
    ) -> None:
        self.store, self.budget, self.device, self.loader = store, budget, device, loader
        self.placement = budget.slot_placement  # how a slot holds its expert ("mixed" slots: as "dequant")
        # One allocation per pool, made once: slots are views, so the budget is never exceeded.
        self.slabs: dict[Hashable, torch.Tensor] = {
            g: torch.empty((n, budget.slot_bytes[g]), dtype=torch.uint8, device=device) for g, n in budget.n_slots.items()
        }
        self.buffers: dict[str, torch.Tensor] = {
            k: torch.empty(n, dtype=torch.uint8, device=device) for k, n in budget.buffer_bytes.items()
        }
        # Records copied in two parts where a slot holds them as they are (LoaderConfig.split_copies): the
        # tensors of the first matmul, then the rest, so the first matmul (and its decode) overlaps the rest.
        split = split_copies and self.placement != "dequant"
        self.split: dict[int, int | None] = {
            layer: split_point(store.layout(layer)) if split and store.record_bytes(layer) >= split_min_bytes else None
            for layer in budget.pool_of_layer
        }
        self._views: dict[tuple, object] = {}  # (pool, slot, layer) -> tensors or PackedWeights
        self._slab_views: dict[int, dict[str, torch.Tensor] | None] = {}  # layer -> tensors [n_slots, ...]
        self.kept = self._keep(budget.kept)  # (layer, expert) -> PackedWeights

    def _keep(self, kept) -> dict[tuple[int, int], PackedWeights]:
        """Copy the records `kept` names (layer -> experts) into one slab per layer, once, and bind each; the copies
        are finished when this returns."""
        out, scratch = {}, self.buffers.get("scratch")
        for layer, experts in kept.items():
            layout, pinned = self.store.layout(layer), self.store.tier(layer) == "pinned"
            slab = self.slabs[("kept", layer)] = torch.empty((len(experts), layout.nbytes), dtype=torch.uint8, device=self.device)
            for row, e in zip(slab, experts):
                self.loader.copy(row, self.store.pieces(layer, e), pinned)
                out[layer, e] = PackedWeights(self.store.codec, row, layout, self.store.dtype(layer), scratch)
        if out:
            self.loader.synchronize()
        return out

    def fill(self, slot: Slot, nbytes: int, pinned: bool) -> None:
        """Copy the first `nbytes` of the record of `slot.key` into `slot` after its last reader (`slot.free`):
        "dequant" copies the whole record into the staging buffer while that reader may still run and decodes
        it into the slot on the copy stream once it has; otherwise the bytes land as they are (`copy_into`)."""
        layer = slot.key[0]
        if self.placement == "dequant":
            layout, dtype = self.store.layout(layer), self.store.dtype(layer)
            staging, views = self.buffers["staging"][: layout.nbytes], self.views(layer, slot)
            decode = lambda: self.store.codec.decode(staging, layout, dtype, out=views)  # noqa: E731
            slot.first_ready = None
            slot.ready = self.loader.copy(staging, self.store.pieces(*slot.key), pinned, after=slot.free, then=decode)
        else:
            self.copy_into(slot, 0, nbytes, pinned, after=slot.free)

    def copy_into(self, slot: Slot, start: int, end: int, pinned: bool, after: object = None) -> None:
        """Copy bytes [start, end) of the record of `slot.key` into `slot` (not "dequant": the bytes land as
        they are). In two parts when the tensors of the first matmul end inside the range (`slot.first_ready`
        marks them); when they ended before `start`, the slot's previous copy brought them and its event
        marks them."""
        s = self.split[slot.key[0]]
        split = s if s is not None and start < s < end else 0
        before = slot.ready if s is not None and 0 < start and s <= start else None
        dst = self.slabs[self.budget.pool_of_layer[slot.key[0]]][slot.index]
        pieces = self.store.pieces(*slot.key, start, end)
        first, slot.ready = self.loader.copy_split(dst, pieces, pinned, split, after)
        slot.first_ready = first if split else before

    def views(self, layer: int, slot: Slot):
        """What the proxy computes with: typed views into the slot, or the packed record itself."""
        g = self.budget.pool_of_layer[layer]
        # keyed by layer too: layers sharing a pool (one record size) may lay their records out differently
        # (lossless: per-layer escape room; other shapes of the same size)
        key = (g, slot.index, layer)
        views = self._views.get(key)
        if views is None:
            record = self.slabs[g][slot.index]
            # normal tensors, kept: a typed view made in inference mode would be an inference tensor, which a later
            # forward with autograd on cannot read, nor a copy outside inference mode write
            with torch.inference_mode(False):
                if self.placement == "packed":
                    layout = self.store.layout(layer)
                    views = PackedWeights(
                        self.store.codec, record[: layout.nbytes], layout, self.store.dtype(layer), self.buffers.get("scratch")
                    )
                else:
                    views = IdentityCodec().decode(record, self.store.raw_layout(layer))
            self._views[key] = views
        return views

    def slab_views(self, layer: int) -> dict[str, torch.Tensor] | None:
        """Typed views of `layer`'s tensors in every slot of its pool at once, each [n_slots, *shape] (slot i's
        expert at index i), for one grouped matmul over many slots; None where slots hold packed records or the
        slot size is not a multiple of 16 bytes (grouped kernels read each group's weights at 16-byte alignment)."""
        if layer not in self._slab_views:
            g = self.budget.pool_of_layer[layer]
            slab = self.slabs[g]
            views = None
            if self.placement != "packed" and slab.shape[1] % 16 == 0:
                with torch.inference_mode(False):  # normal tensors, kept (`views`)
                    views = {
                        spec.name: slab[:, spec.offset : spec.offset + spec.nbytes].view(spec.dtype).view(len(slab), *spec.shape)
                        for spec in self.store.raw_layout(layer).tensors
                    }
            self._slab_views[layer] = views
        return self._slab_views[layer]

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())

    @property
    def kept_bytes(self) -> int:
        """Bytes of the records kept packed beside the slots (placement "mixed")."""
        return sum(slab.numel() for key, slab in self.slabs.items() if isinstance(key, tuple) and key[0] == "kept")

    @property
    def device_bytes(self) -> int:
        """Bytes held on the device: the slabs and the codec buffers (≤ the plan's budget_bytes)."""
        return sum(a.numel() for a in self.slabs.values()) + self.buffer_bytes

    def close(self) -> None:
        """Give the device memory back (the manager is done with this placement)."""
        self.slabs.clear()
        self.buffers.clear()
        self._views.clear()
        self._slab_views.clear()
        self.kept.clear()
