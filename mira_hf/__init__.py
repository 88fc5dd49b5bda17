"""mira-hf: run Mixture-of-Experts transformers models on one GPU that cannot hold all their experts."""

import importlib
import sys
import types
from typing import TYPE_CHECKING

from .bundled import bundled_model_path
from .config import CacheConfig, LoaderConfig, MiraConfig
from .errors import (
    BudgetError,
    CheckpointError,
    ConcurrencyError,
    ConfigError,
    DeviceError,
    IncompatibleFileError,
    LoaderError,
    MiraError,
    MissingDependencyError,
    UnsupportedModelError,
    UnsupportedOperationError,
)
from .registry import register_policy, register_predictor

if TYPE_CHECKING:
    from .calibrate import calibrate
    from .manager import ExpertManager
    from .model import MiraMoEModel

# Imported on first use: they import torch and transformers, which take seconds, and `mira --help`,
# a bad flag or `from mira_hf import MiraConfig` should not wait for them.
_LAZY = {"MiraMoEModel": "model", "ExpertManager": "manager", "calibrate": "calibrate"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """`mira_hf.calibrate` is the function: importing the submodule of that name must not replace it."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__version__ = "0.1.0"

__all__ = [
    "BudgetError",
    "CacheConfig",
    "CheckpointError",
    "ConcurrencyError",
    "ConfigError",
    "DeviceError",
    "ExpertManager",
    "IncompatibleFileError",
    "LoaderConfig",
    "LoaderError",
    "MiraConfig",
    "MiraError",
    "MiraMoEModel",
    "MissingDependencyError",
    "UnsupportedModelError",
    "UnsupportedOperationError",
    "bundled_model_path",
    "calibrate",
    "register_policy",
    "register_predictor",
]
