"""mira-hf: run Mixture-of-Experts transformers models on one GPU that cannot hold all their experts."""

from .bundled import bundled_model_path
from .calibrate import calibrate
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
from .manager import ExpertManager
from .model import MiraMoEModel

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
]
