"""The errors mira-hf raises. Each subclasses a built-in so callers can catch either.

Messages say what was given, what is supported and what to do, and they are raised before any
state changes: a model is never left half-converted.
"""

from __future__ import annotations

import numbers


class MiraError(Exception):
    """Base class of every error mira-hf raises on purpose."""


class ConfigError(MiraError, ValueError):
    """A `MiraConfig` value (or a sub-config value) is invalid."""


def check_count(name: str, value: object, least: int, unit: str) -> None:
    """`ConfigError` unless `value` is an int ≥ `least` (a count of `unit`)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{name}={value!r}: must be an int ≥ {least} ({unit}).")


def check_finite(name: str, value: object, bound: str, unit: str = "") -> None:
    """`ConfigError` unless `value` is a finite number above 0 (`bound` "> 0") or from 0 ("≥ 0"), of `unit`."""
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy scalars too
    if not (number and (0 < value if bound == "> 0" else 0 <= value) and value < float("inf")):
        raise ConfigError(f"{name}={value!r}: must be a finite number{f' of {unit}' if unit else ''} {bound}.")


def check_fraction(name: str, value: object, interval: str, otherwise: str = "") -> None:
    """`ConfigError` unless `value` is a number in `interval` ("[0, 1]", "(0, 1]" or "[0, 1)"); `otherwise`: what else
    the caller accepts, for the message (", or None (chosen online)")."""
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy scalars too
    if number and 0 <= value <= 1 and not (interval[0] == "(" and value == 0) and not (interval[-1] == ")" and value == 1):
        return
    raise ConfigError(f"{name}={value!r}: must be a number in {interval}{otherwise}.")


class UnsupportedModelError(MiraError, ValueError):
    """The model has no adapter, no sparse-MoE block, or an expert layout mira-hf cannot serve."""


class BudgetError(MiraError, ValueError):
    """The GPU budget is below the minimum working set or above what the device can give."""


class DeviceError(MiraError, RuntimeError):
    """The requested device is not available."""


class MissingDependencyError(MiraError, ImportError):
    """An optional dependency is needed for the requested feature."""


class IncompatibleFileError(MiraError, ValueError):
    """A predictor, packed store or trace file was made for another model or format, or is corrupt."""


class CheckpointError(MiraError, OSError):
    """A checkpoint file is missing, truncated or corrupted."""


class LoaderError(MiraError, RuntimeError):
    """Copying an expert to the device failed; the cache was left consistent."""


class ConcurrencyError(MiraError, RuntimeError):
    """Two threads tried to run the same wrapped model at once."""


class UnsupportedOperationError(MiraError, RuntimeError):
    """An operation a wrapped model does not support: backward through its offloaded experts, or
    copying / pickling it (its experts live in one host store and GPU arena)."""


def require_decoder_only(model, what: str) -> None:
    """Raise `UnsupportedOperationError` before anything runs where `model` is an encoder-decoder: `what` routes a
    sequence's tokens through every MoE layer in turn, and an encoder-decoder's encoder and decoder route different
    tokens."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise UnsupportedOperationError(
            f"{what} follows each token through a decoder-only model's MoE layers, and {type(model).__name__} is an "
            "encoder-decoder, whose encoder and decoder route different tokens. Its experts are served as any "
            "model's: generate with it and read model.mira.stats(), or its router logits (output_router_logits=True)."
        )
