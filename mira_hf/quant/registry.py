"""The codec registry. It imports nothing of the library: formats register themselves (the built-in
ones in `formats.py`, by `Lazy` references to their modules).

One `CodecEntry` per format name says everything the rest of the library asks about a format: how to
build its codec (from keywords, or from a `QuantConfig`), the code its records carry in their header,
whether it is exact, whether it is a pre-quantized checkpoint's own format, and what it needs installed.
`MiraConfig` validates `quantization` against it, `FMT_CODES` is read from it, and the model builds its
codec through it. Add a format without editing the library:

    from mira_hf.quant import CodecEntry, register_codec
    register_codec(CodecEntry("copy", factory=CopyCodec, exact=True))
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Roles: "encoded": weights are encoded into this format at load (MiraConfig(quantization=name));
# "native": a pre-quantized checkpoint's own format, served as stored and never encoded into.
ROLES = ("encoded", "native")


class CodecRegistryError(ValueError):
    """A registration conflicts with an existing one, or names nothing registered."""


class Lazy:
    """A callable named by "module:attribute" (with leading `args`), imported on its first call: an entry
    can point at a codec without importing it (the built-in formats do, so `MiraConfig` and `mira --help`
    never import torch)."""

    __slots__ = ("target", "args", "_obj")

    def __init__(self, target: str, *args: Any) -> None:
        if not isinstance(target, str) or ":" not in target:
            raise CodecRegistryError(f"Lazy({target!r}): give 'package.module:attribute'.")
        self.target, self.args, self._obj = target, args, None

    def resolve(self) -> Callable[..., Any]:
        """The named object (imported once)."""
        if self._obj is None:
            module, _, attr = self.target.partition(":")
            obj = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
            self._obj = obj
        return self._obj

    def __call__(self, *args: Any, **kw: Any) -> Any:
        return self.resolve()(*self.args, *args, **kw)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Lazy) and (other.target, other.args) == (self.target, self.args)

    def __hash__(self) -> int:
        return hash((self.target, self.args))

    def __repr__(self) -> str:
        return f"Lazy({', '.join(repr(a) for a in (self.target, *self.args))})"


@dataclass(frozen=True)
class CodecEntry:
    """One registered format.

    name: what `MiraConfig(quantization=...)` and `make_codec` take.
    factory: `factory(**options) -> codec` (what `make_codec(name, **options)` calls); a `Lazy` names one
        without importing it.
    from_config: `from_config(quant_config) -> codec`, the codec a wrapped model uses (e.g. with the
        configured group size, padded to it); None: `factory()`.
    format_code: the byte in a packed record's header that names this format (0..255, unique; kept
        forever once records exist on disk); None for formats without that header.
    exact: decoding gives back the weights bit for bit (the model computes what the original does).
    role: "encoded" or "native" (see ROLES).
    default_placement: the placement `QuantConfig(placement="auto")` resolves to ("dequant" or "packed").
    requires: (module, install hint) of an optional dependency, checked by MiraConfig before loading.
    """

    name: str
    factory: Callable[..., Any]
    from_config: Callable[[Any], Any] | None = None
    format_code: int | None = None
    exact: bool = False
    role: str = "encoded"
    default_placement: str = "dequant"
    requires: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name != self.name.strip().lower():
            raise CodecRegistryError(f"codec name {self.name!r}: use a non-empty lower-case string such as 'int4'.")
        if self.name in ("auto", "none"):
            raise CodecRegistryError(f"codec name {self.name!r} is reserved (MiraConfig's 'auto' and None).")
        if self.role not in ROLES:
            raise CodecRegistryError(f"codec {self.name!r}: role={self.role!r}; supported: {list(ROLES)}.")
        if self.default_placement not in ("dequant", "packed"):
            raise CodecRegistryError(
                f"codec {self.name!r}: default_placement={self.default_placement!r}; use 'dequant' or 'packed'."
            )
        if self.format_code is not None and (isinstance(self.format_code, bool) or not 0 < self.format_code < 256):
            raise CodecRegistryError(f"codec {self.name!r}: format_code={self.format_code!r} must be an int in 1..255 or None.")

    def build(self, quant_config: Any = None) -> Any:
        """The codec a model configured with `quant_config` uses."""
        if self.from_config is not None and quant_config is not None:
            return self.from_config(quant_config)
        return self.factory()


_CODECS: dict[str, CodecEntry] = {}


def register_codec(entry: CodecEntry, *, override: bool = False) -> CodecEntry:
    """Register `entry`. A name or format code already taken is rejected unless `override=True` (to
    replace a built-in codec with your own); registering an equal entry again (a module imported
    twice) is a no-op. Returns the entry."""
    old = _CODECS.get(entry.name)
    if old is not None and (old == entry or _same_definition(old, entry)):
        _CODECS[entry.name] = entry
        return entry
    if old is not None and not override:
        raise CodecRegistryError(
            f"codec {entry.name!r} is already registered ({_where(old)}). Pick another name, or pass override=True to replace it."
        )
    if entry.format_code is not None:
        clash = [e.name for e in _CODECS.values() if e.format_code == entry.format_code and e.name != entry.name]
        if clash:
            raise CodecRegistryError(
                f"codec {entry.name!r}: format code {entry.format_code} is taken by {clash[0]!r} (records on disk carry it). "
                f"Taken codes: {sorted(c for c in format_codes().values())}."
            )
    _CODECS[entry.name] = entry
    return entry


def unregister_codec(name: str) -> None:
    _CODECS.pop(name, None)


def get_codec_entry(name: str) -> CodecEntry:
    """The entry registered as `name`; `CodecRegistryError` naming the registered ones otherwise."""
    entry = _CODECS.get(name) if isinstance(name, str) else None
    if entry is None:
        hint = " None means no compression (the checkpoint's bytes)." if name is None else ""
        raise CodecRegistryError(f"codec {name!r} is not registered; registered: {codec_names()}.{hint}")
    return entry


def find_codec_entry(name: object) -> CodecEntry | None:
    """The entry registered as `name`, or None (also for None and "auto")."""
    return _CODECS.get(name) if isinstance(name, str) else None


def is_native(name: object) -> bool:
    """Whether `name` is a pre-quantized checkpoint's own format (served as stored, never encoded into)."""
    entry = find_codec_entry(name)
    return entry is not None and entry.role == "native"


def codec_names(role: str | None = None) -> list[str]:
    """Registered names (of one role), in registration order."""
    return [n for n, e in _CODECS.items() if role is None or e.role == role]


def format_codes() -> dict[str, int]:
    """name -> the format code its records carry in their header (formats that have one)."""
    return {n: e.format_code for n, e in _CODECS.items() if e.format_code is not None}


def _same_definition(a: CodecEntry, b: CodecEntry) -> bool:
    """Whether `b` is `a` defined again by the same code (its module imported a second time)."""
    return _where(a) == _where(b) and a.format_code == b.format_code and a.role == b.role


def _where(entry: CodecEntry) -> str:
    f = getattr(entry.factory, "func", entry.factory)  # a functools.partial: the function it calls
    if isinstance(f, Lazy):
        return repr(f)
    return f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', type(f).__name__)}"
