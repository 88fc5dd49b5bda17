"""Per-architecture adapters for mira-hf. Importing this package registers the built-in ones.

Add your own without editing the library:

    from model_adapters import MoEAdapter, register_adapter
    register_adapter(MoEAdapter(name="mymoe", model_types=("mymoe",), experts_globs=("*.moe.experts",)))
"""

from . import families  # noqa: F401  (registers the built-in adapters)
from .base import ExpertKeys, ExpertModules, GenericAdapter, MoEAdapter, RoutedBlockExperts, SeparateGluExperts, generic_adapter
from .registry import (
    AdapterRegistryError,
    get_adapter,
    register_adapter,
    registered_adapters,
    registered_model_types,
    unregister_adapter,
)

__all__ = [
    "AdapterRegistryError",
    "ExpertKeys",
    "ExpertModules",
    "GenericAdapter",
    "MoEAdapter",
    "RoutedBlockExperts",
    "SeparateGluExperts",
    "generic_adapter",
    "get_adapter",
    "register_adapter",
    "registered_adapters",
    "registered_model_types",
    "unregister_adapter",
]
