"""Leaving mira-hf: `unload()` gives back an ordinary transformers model, `save_pretrained()` writes an ordinary
checkpoint (experts included), as the unwrapped model would."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .errors import ConfigError, UnsupportedOperationError
from .manager import ExpertManager
from .proxy import give_back_hooks
from .state import at_paths
from .state import uninstall as uninstall_state
from .targets import Target, places


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
        if t.parent._modules.get(t.attr) is t.proxy and all(p is not t.parent for p, _ in found):
            found.append((t.parent, t.attr))  # its MoE block moved into another model: the module goes back there too
        for parent, name in found:
            setattr(parent, name, t.module)


def save_pretrained(model: nn.Module, save_directory, **kwargs):
    """Write an ordinary transformers checkpoint (experts included), as the unwrapped model would. A `state_dict`
    given is written as given, as transformers writes one (a subset, edited tensors), its expert tensors that are
    the model's own (from `model.state_dict()`) each written from a tensor of its own."""
    given = kwargs.pop("state_dict", None)  # None: transformers' default, which Trainer passes
    model._mira_state.edited()  # data given to expert parameters since the last step (`p.data = t`) is in the store
    warn_if_lossy(model.mira, "save_pretrained() writes")
    with warnings.catch_warnings():  # state_dict() would say it again for every layer
        warnings.simplefilter("ignore")
        views = model.state_dict()
    state = dict(views)
    # Where each proxy sits now, as `state_dict()` names it: a layer removed or moved since wrapping (layer pruning)
    # takes its experts with it, and a proxy no longer in the model writes nothing.
    where: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        where.setdefault(id(module), []).append(name)
    for t in model._mira_targets:  # one tensor of its own each (views of raw records share their slab)
        E = model.mira.store.num_experts(t.ordinal)
        for prefix in where.get(id(t.proxy), ()):
            for n, tensor in model.mira.whole.fused(t.ordinal).items():
                state.update((f"{prefix}.{path}", part) for path, part in at_paths(t.layout, n, tensor, E))
    if given is not None:
        state = {k: state[k] if k in views and _same_view(v, views[k]) else v for k, v in given.items()}
    return type(model).save_pretrained(model, save_directory, state_dict=state, **kwargs)


def _same_view(a: object, b: torch.Tensor) -> bool:
    """Whether `a` is the tensor `b` (the same memory, shape, strides and dtype: `state_dict()` makes new views)."""
    return isinstance(a, torch.Tensor) and (a.data_ptr(), a.shape, a.stride(), a.dtype) == (
        b.data_ptr(),
        b.shape,
        b.stride(),
        b.dtype,
    )
