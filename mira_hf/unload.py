"""Leaving mira-hf: `unload()` gives back an ordinary transformers model, `save_pretrained()` writes an ordinary
checkpoint (experts included), as the unwrapped model would."""

from __future__ import annotations

import math
import os
import warnings

import torch
from torch import nn

from . import offload_files
from .errors import BudgetError, ConfigError, UnsupportedOperationError
from .manager import ExpertManager
from .proxy import give_back_hooks
from .resources import available_host_bytes
from .state import at_paths, expert_paths
from .state import uninstall as uninstall_state
from .store import own_storage
from .targets import Target, places

# Decoded experts that would take more than this share of the host memory available go to a file-backed buffer
# (`SaveExperts`): transformers' save then holds at most a shard of its own beside them.
SAVE_HOST_SHARE = 0.5
BUFFER_ALIGN = 64  # bytes: each tensor's start in that buffer (any dtype's alignment)


def warn_if_lossy(manager: ExpertManager, what: str) -> None:
    if not manager.store.exact:
        warnings.warn(
            f"the experts are stored as {manager.store.codec.name}: {what} their dequantized values, not the "
            "checkpoint's. Load the model again without quantization for the original weights.",
            stacklevel=4,  # the user's call: through model.unload() (`mira_hf.weak`) or MiraMoEModel.unload()
        )


def unload(model: nn.Module) -> nn.Module:
    """Give back an ordinary transformers model, on the CPU, with every expert in place."""
    manager = getattr(model, "mira", None)
    if not isinstance(manager, ExpertManager):
        raise ConfigError(
            f"unload() was given a {type(model).__name__} that mira-hf has not wrapped: there is nothing to unload. "
            "Pass the model MiraMoEModel.from_pretrained or MiraMoEModel.wrap returned."
        )
    warn_if_lossy(manager, "unload() gives back")
    # Another thread's step ends first; one waiting for its turn then runs the unwrapped model (`ExpertManager.turn`).
    with manager.turn():
        model._mira_state.edited()  # data given to expert parameters since the last step (`p.data = t`) is in the store
        uninstall_state(model)
        manager.close()
        model.to("cpu")
        for t in model._mira_targets:
            t.restore(manager.whole)
            manager.whole.drop(t.ordinal)  # its records, rebuilt: freed now, so that unload() holds one layer twice at most
        put_back_modules(model._mira_targets, model)
        # last: a step that starts meanwhile meets them and waits for its turn, then runs the unwrapped modules
        for hook in model._mira_hooks:
            hook.remove()
        manager.store.close()
        forget_wrapping(model)
    model.unload = unloaded_already  # a second model.unload() says why there is nothing to do
    return model


def unloaded_already() -> None:
    """`model.unload()` of a model unloaded already (a plain function: the model keeps no reference to itself)."""
    raise ConfigError(
        "model.unload() was called on a model unloaded already: it is an ordinary transformers model, there is nothing "
        "to unload. Wrap it again with MiraMoEModel.wrap(model, ...) to serve it from mira-hf."
    )


def refuse_copy(protocol: int = 2):
    """A wrapped model's `__reduce_ex__`, which `copy.copy`, `copy.deepcopy` and pickling reach (a plain function: the
    model keeps no reference to itself)."""
    raise UnsupportedOperationError(
        "a mira-hf model cannot be deep-copied, copied (copy.copy) or pickled (torch.save(model), multiprocessing): its "
        "experts live in a host store and device cache that its proxies share, which a copy would share with the model "
        "(unloading one would take the experts from both) or could not take along. Load a second model with "
        "MiraMoEModel.from_pretrained(...), save it with model.save_pretrained(dir) (a full transformers checkpoint, "
        "experts included), or call model.unload() first."
    )


# What wrapping sets on the model instance: the manager, what `unload` reads, and the methods bound on it
WRAPPED_ATTRIBUTES = (
    "mira",
    "_mira_config",
    "_mira_targets",
    "_mira_hooks",
    "unload",
    "save_pretrained",
    "set_experts_implementation",
    "mira_load_report",
    "__reduce_ex__",
)


def forget_wrapping(model: nn.Module) -> None:
    """Remove what wrapping set on the model instance (`WRAPPED_ATTRIBUTES`)."""
    for attr in WRAPPED_ATTRIBUTES:
        model.__dict__.pop(attr, None)


def put_back_modules(targets: list[Target], model: nn.Module) -> None:
    """Put the experts module of each of `targets` back wherever its proxy sits in `model` now (where it was wrapped,
    or wherever the model's owner moved or shared it since; nowhere where they replaced it), with the hooks registered
    on the proxy meanwhile and the children the proxy stood in for."""
    spots = places(model, [t.proxy for t in targets])
    for t in targets:
        give_back_hooks(t.proxy, t.module)
        t.proxy.restore_owners()
        found = spots[id(t.proxy)]
        for parent, attr, _ in [(t.parent, t.attr, t.module), *t.twins]:
            if parent._modules.get(attr) is t.proxy and all(p is not parent for p, _ in found):
                found.append((parent, attr))  # its MoE block moved into another model: the module goes back there too
        twin_at = {(id(parent), attr): twin for parent, attr, twin in t.twins}  # where a twin sat, it goes back
        for parent, name in found:
            setattr(parent, name, twin_at.get((id(parent), name), t.module))


def save_pretrained(model: nn.Module, save_directory, **kwargs):
    """Write an ordinary transformers checkpoint (experts included), as the unwrapped model would. A `state_dict`
    given is written as given, as transformers writes one (a subset, edited tensors), its expert tensors that are
    the model's own (from `model.state_dict()`) each written from a tensor of its own. The experts go to transformers
    as `SaveExperts` gives them: views of an uncompressed store, else decoded once, layer by layer."""
    given = kwargs.pop("state_dict", None)  # None: transformers' default, which Trainer passes
    model._mira_state.edited()  # data given to expert parameters since the last step (`p.data = t`) is in the store
    warn_if_lossy(model.mira, "save_pretrained() writes")
    if os.path.isfile(save_directory):  # transformers says so, and writes nothing
        return type(model).save_pretrained(model, save_directory, **kwargs)
    whole = model.mira.whole
    # Where each proxy sits now, as `state_dict()` names it: a layer removed or moved since wrapping (layer pruning)
    # takes its experts with it, and a proxy no longer in the model writes nothing.
    where: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        where.setdefault(id(module), []).append(name)
    sites = [(t, prefix) for t in model._mira_targets for prefix in where.get(id(t.proxy), ())]
    if given is None:  # encoded layers decoded once, by state_dict(), which runs the model's hooks on them
        encoded = sorted({t.ordinal for t, _ in sites}) if whole.quantized else []
        experts = SaveExperts(whole, encoded, model, save_directory)
        with warnings.catch_warnings(), model._mira_state.saving(experts):  # state_dict() would warn for every layer
            warnings.simplefilter("ignore")
            written = model.state_dict()
    else:  # an encoded layer's own parameters given (`dict(model.named_parameters())`: placeholders) are decoded
        placeholders = [(t, prefix, keys) for t, prefix in sites for keys in [_placeholders(whole, t, prefix, given)] if keys]
        experts, written = SaveExperts(whole, sorted({t.ordinal for t, _, _ in placeholders}), model, save_directory), dict(given)
        for t, prefix, keys in placeholders:
            written.update((k, v) for k, v in _tensors(whole, t, prefix, experts.fused(t.ordinal)) if k in keys)
    # Views of an uncompressed store (not replaced by a hook, nor given otherwise): the store's, a tensor of its own at
    # each place (a module at two is copied at the second).
    for t, prefix in [] if whole.quantized else sites:
        keys = {k for k, v in _tensors(whole, t, prefix) if _same_view(written.get(k), v)}
        if keys:
            written.update((k, v) for k, v in _tensors(whole, t, prefix, experts.fused(t.ordinal)) if k in keys)
    return type(model).save_pretrained(model, save_directory, state_dict=written, **kwargs)


def _placeholders(whole, target: Target, prefix: str, given: dict) -> set[str]:
    """The keys of `target`'s experts (an encoded layer's, where its proxy sits at `prefix`) whose tensor in `given` is
    on the meta device: the layer's own parameters, which hold no data."""
    if not whole.quantized:
        return set()
    keys = (f"{prefix}.{path}" for path in expert_paths(target.layout, whole, target.ordinal))
    return {k for k in keys if isinstance(given.get(k), torch.Tensor) and given[k].is_meta}


def _tensors(whole, target: Target, prefix: str, fused=None) -> list[tuple[str, torch.Tensor]]:
    """(state dict key, tensor) of `target`'s experts where its proxy sits at `prefix`: parts of `fused` (name ->
    [E, ...]), by default the store's views (an uncompressed store)."""
    E, fused = whole.num_experts(target.ordinal), fused or whole.expert_views(target.ordinal)
    return [(f"{prefix}.{path}", part) for n, t in fused.items() for path, part in at_paths(target.layout, n, t, E)]


class SaveExperts:
    """The experts' tensors `save_pretrained` gives transformers, layer by layer (`fused`): views of an uncompressed
    store (no copy), else decoded. Decoded layers go to host memory, unless together they would take more than
    SAVE_HOST_SHARE of what the host has available beside the store: then to a buffer mapped from a file in the
    store's offload_dir, else in the save directory, unlinked at once, whose pages the kernel writes to the disk
    instead of the process running out of memory. Its disk blocks are reserved first, where the disk has room for it
    (and for the checkpoint, where the checkpoint goes to the same disk): else `BudgetError`, before anything is
    written. They are freed once the save has dropped the tensors."""

    def __init__(self, whole, layers: list[int], model: nn.Module, save_directory) -> None:
        self.whole, self._buffer, self._at, self._handed = whole, None, 0, set()
        # layers whose experts modules have twins (`Target.twins`: tied to them), and the tensors handed for each
        self._tied = {t.ordinal for t in getattr(model, "_mira_targets", ()) if t.twins}
        self._first: dict[int, dict[str, torch.Tensor]] = {}
        need = sum(_decoded_bytes(whole, layer) for layer in layers)
        room = available_host_bytes()
        if not need or room is None or need <= SAVE_HOST_SHARE * room:
            return
        place, directory = ("offload_dir", whole.offload_dir) if whole.offload_dir else ("save_directory", save_directory)
        directory, save_directory = os.path.abspath(directory), os.path.abspath(save_directory)
        beside = 0  # the checkpoint's bytes, where it is written to the same disk
        if os.stat(offload_files.existing(directory)).st_dev == os.stat(offload_files.existing(save_directory)).st_dev:
            beside = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        free = offload_files.free_bytes(directory)  # the buffers of saves whose process was killed removed first
        remedy = (
            f"free host memory (the decoded experts take {need:,} bytes; {room:,} are available), or load the model with "
            "offload_dir set to a directory on a disk with room, where save_pretrained() decodes them first"
        )
        if need + beside > free:
            also = f", and the checkpoint about {beside:,} more" if beside else ""
            raise BudgetError(
                f"save_pretrained() decodes the experts into a file in {place}={directory!r} first, as host memory "
                f"cannot hold them beside the store: they take {need:,} bytes there{also}, but only {free:,} bytes are "
                f"free. Nothing was written. Free space on that disk, {remedy}."
            )
        path = offload_files.create(directory, "save", need, "save_pretrained()'s decoded experts", place, remedy)
        try:
            self._buffer = torch.from_file(path, shared=True, size=need, dtype=torch.uint8)
        finally:
            os.remove(path)  # mapped: its blocks stay taken until the buffer is dropped

    def fused(self, layer: int) -> dict[str, torch.Tensor]:
        """name -> [E, ...] of `layer`'s experts: the store's views, or decoded; asked again (the experts module sits
        at another place too), a copy of its own in host memory (one tensor under two names would be taken for one
        tied weight), except for a layer whose experts are tied (its twins' places): the same tensors, as the unwrapped
        model's state dict gives, which transformers writes once."""
        again = layer in self._handed
        self._handed.add(layer)
        if again and layer in self._first:
            return self._first[layer]
        views = self.whole.expert_views(layer)
        if views is not None:
            out = {n: v.clone() for n, v in views.items()} if again else views
        else:
            out = self.whole.fused(layer, torch.empty if again else self._alloc)
        if layer in self._tied:
            self._first[layer] = out
        return out

    def _alloc(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor in the buffer (each on a storage of its own, as separate tensors are), or in host memory."""
        n = math.prod(shape) * dtype.itemsize
        if self._buffer is None or self._at + n > self._buffer.numel():
            return torch.empty(shape, dtype=dtype)
        t = own_storage(self._buffer[self._at : self._at + n].view(dtype).view(shape))
        self._at += _aligned(n)
        return t


def _decoded_bytes(whole, layer: int) -> int:
    """Bytes of `layer`'s experts decoded (`fused`), with each tensor's alignment in `SaveExperts`' buffer."""
    E, size = whole.num_experts(layer), whole.dtype(layer).itemsize
    return sum(_aligned(E * math.prod(shape) * size) for shape, _ in whole.expert_specs(layer).values())


def _aligned(nbytes: int) -> int:
    """`nbytes` rounded up to the next tensor start in `SaveExperts`' buffer."""
    return -(-nbytes // BUFFER_ALIGN) * BUFFER_ALIGN


def _same_view(a: object, b: torch.Tensor) -> bool:
    """Whether `a` is the tensor `b` (the same memory, shape, strides and dtype: `state_dict()` makes new views)."""
    return isinstance(a, torch.Tensor) and (a.data_ptr(), a.shape, a.stride(), a.dtype) == (
        b.data_ptr(),
        b.shape,
        b.stride(),
        b.dtype,
    )
