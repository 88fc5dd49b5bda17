"""The adapter registry. It imports nothing of the library: adapters register themselves."""

from __future__ import annotations

from collections.abc import Iterable

_ADAPTERS: dict[str, object] = {}  # model_type -> adapter


class AdapterRegistryError(ValueError):
    """A registration conflicts with an existing one."""


def register_adapter(adapter, *, override: bool = False):
    """Register `adapter` for each of its `model_types`. A model type already taken is rejected
    unless `override=True` (to replace a built-in adapter with your own). Returns the adapter, so it
    can be used as a decorator-like call at module level."""
    taken = [t for t in adapter.model_types if t in _ADAPTERS and _ADAPTERS[t] is not adapter]
    if taken and not override:
        raise AdapterRegistryError(
            f"adapter {adapter.name!r}: model types {taken} already have adapters "
            f"({', '.join(sorted({_ADAPTERS[t].name for t in taken}))}). Pass override=True to replace them."
        )
    for t in adapter.model_types:
        _ADAPTERS[t] = adapter
    return adapter


def unregister_adapter(model_type: str) -> None:
    _ADAPTERS.pop(model_type, None)


def get_adapter(model_type: str):
    """The adapter for `model_type`, or None."""
    return _ADAPTERS.get(model_type)


def registered_model_types() -> list[str]:
    return sorted(_ADAPTERS)


def registered_adapters() -> Iterable[object]:
    seen = {}
    for a in _ADAPTERS.values():
        seen[id(a)] = a
    return sorted(seen.values(), key=lambda a: a.name)
