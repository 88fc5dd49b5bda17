"""What a codec offers the runtime (`ExpertCodec`), and the shared base of the packed-record codecs.

    codec = make_codec("int4")                     # a registered name; kwargs are the codec's options
    layout = codec.plan({"gate_up_proj": ([2 * I, H], torch.bfloat16), ...})
    codec.encode(tensors, layout, pinned_record)    # host, load time
    codec.decode(cuda_record, layout, torch.bfloat16, out=cache_slot)   # placement "dequant"
    bound = codec.bind(cuda_slot_record, layout)    # placement "packed": checked once per slot
    bound.linear(x, "down_proj", transposed=False)  # per token: no checks, no look-ups

`RecordCodec` holds what the int8/int4, nf4 and lossless codecs share: the layout check, the loops of
`encode` and `decode` over a record's tensors, the checked `linear`, and the bound per-token form. The
backend (Triton kernels or torch) is resolved when the codec is built, never per call.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import ConfigError, IncompatibleFileError, MissingDependencyError
from .record import (
    CodecInputError,
    PackedLayout,
    TensorEntry,
    check_record,
    decode_outputs,
    encode_outputs,
    linear_input,
    raw_tensor,
    section_view,
    tensor_specs,
    validate_record,
)

Specs = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
BACKENDS = ("auto", "torch", "triton")


@runtime_checkable
class ExpertCodec(Protocol):
    """What the runtime calls to pack experts on the host and unpack them on the device.

    name: the registered format name. exact: decode(encode(w)) == w bit for bit. supports_calib:
    encode takes activations (`calib=`). A codec whose record size depends on the weights also has
    `plan_experts_from` (and `plan_args` to rebuild a saved layout); one that decodes weights into a
    device buffer for `linear` has `scratch_bytes`.
    """

    name: str
    exact: bool
    supports_calib: bool

    def plan(self, specs: Specs) -> Any: ...

    def encode(self, tensors: Mapping[str, torch.Tensor], layout: Any, out: torch.Tensor, **kw: Any) -> Any: ...

    def decode(
        self, record: torch.Tensor, layout: Any, dtype: torch.dtype, out: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]: ...

    def linear(self, x: torch.Tensor, record: torch.Tensor, layout: Any, name: str, transposed: bool) -> torch.Tensor: ...

    def record_bytes(self, layout: Any) -> int: ...


@functools.cache
def triton_available() -> bool:
    """Whether triton can be imported (CUDA records then use the Triton kernels)."""
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str) -> bool:
    """Whether `backend` means the Triton kernels where the record is on CUDA ("auto": when triton is
    importable) or always ("triton"); False for "torch". Checked once, when a codec is built."""
    if backend == "torch":
        return False
    if backend == "triton":
        if not triton_available():
            raise MissingDependencyError(
                'backend="triton" needs triton: pip install triton (it ships with CUDA builds of torch).'
            )
        return True
    if backend == "auto":
        return triton_available()
    raise ConfigError(f"backend={backend!r} is not supported; use {', '.join(repr(b) for b in BACKENDS)}.")


def write_raw(t: torch.Tensor, entry: TensorEntry, out: torch.Tensor) -> None:
    """Store a tensor as it is (in the entry's dtype) in its "raw" section of the record `out`."""
    section_view(out, entry.section("raw")).copy_(t.detach().to(entry.dtype).contiguous().reshape(-1).view(torch.uint8))


class RecordCodec:
    """Shared base of the codecs over `PackedLayout` records. A subclass gives `name`, `plan`,
    `layout_identity` and the per-tensor steps `encode_entry`, `decode_entry` and `matmul`."""

    name = ""
    exact = False
    supports_calib = False

    def __init__(self, backend: str = "auto") -> None:
        self.backend = backend
        self._triton = resolve_backend(backend)

    # -- what a subclass gives -----------------------------------------------------------------
    def layout_identity(self) -> dict[str, object]:
        """The `PackedLayout` fields a layout planned by this codec has (checked before every use)."""
        raise NotImplementedError

    def encode_entry(self, t: torch.Tensor, entry: TensorEntry, out: torch.Tensor, calib: torch.Tensor | None) -> Any:
        """Write one encoded tensor (`entry.quantized`) into the record `out`; may return a statistic."""
        raise NotImplementedError

    def decode_entry(
        self, record: torch.Tensor, entry: TensorEntry, dtype: torch.dtype, dst: torch.Tensor | None, use_triton: bool
    ) -> torch.Tensor:
        """One tensor of the record in `dtype`, written into `dst` when given."""
        raise NotImplementedError

    def matmul(
        self, x2: torch.Tensor, record: torch.Tensor, entry: TensorEntry, transposed: bool, use_triton: bool, scratch
    ) -> torch.Tensor:
        """x2 [T, in] -> [T, out] with the record's weight `entry`; unchecked (see `linear`, `bind`)."""
        raise NotImplementedError

    def calib_by_name(self, calib, layout: PackedLayout) -> dict[str, torch.Tensor]:
        """Activations per weight name from `encode`'s `calib` (codecs that use none refuse any)."""
        if calib is not None:
            raise CodecInputError(f"the {self.name} codec takes no calib activations.")
        return {}

    # -- shared --------------------------------------------------------------------------------
    def record_bytes(self, layout: PackedLayout) -> int:
        return layout.nbytes

    def validate(self, record: torch.Tensor, layout: PackedLayout) -> None:
        """Check a stored record's header against `layout` (`validate_record`): once, when it is stored."""
        validate_record(record, layout)

    def check_layout(self, layout: PackedLayout) -> None:
        if any(getattr(layout, k, None) != v for k, v in self.layout_identity().items()):
            raise IncompatibleFileError(
                f"layout was planned by codec {getattr(layout, 'codec', type(layout).__name__)!r} (fmt "
                f"{getattr(layout, 'fmt', '?')}, flags {getattr(layout, 'flags', '?')}, group "
                f"{getattr(layout, 'group_size', '?')}); this is {self!r}. Plan and decode with the same codec."
            )

    def uses_triton(self, record: torch.Tensor, backend: str | None = None) -> bool:
        """Whether records like `record` run on the Triton kernels: the backend resolved when the codec was
        built, unless `backend` overrides it for one call."""
        triton = self._triton if backend is None else resolve_backend(backend)
        return triton and (record.is_cuda or (backend or self.backend) == "triton")

    def encode(
        self,
        tensors: Mapping[str, torch.Tensor],
        layout: PackedLayout,
        out: torch.Tensor,
        *,
        calib: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, Any]:
        """Encode one expert into `out` (uint8 [layout.nbytes], e.g. pinned host memory), computing on the
        tensors' device. Returns what the codec reports per encoded tensor (lossless: escape counts)."""
        self.check_layout(layout)
        calib = self.calib_by_name(calib, layout)
        encode_outputs(tensors, layout, out)
        report = {}
        for entry in layout.entries:
            t = tensors[entry.name]
            if entry.quantized:
                report[entry.name] = self.encode_entry(t, entry, out, calib.get(entry.name))
            else:
                self.encode_raw(t, entry, out)
        return {n: r for n, r in report.items() if r is not None}

    def encode_raw(self, t: torch.Tensor, entry: TensorEntry, out: torch.Tensor) -> None:
        write_raw(t, entry, out)

    def decode(
        self,
        record: torch.Tensor,
        layout: PackedLayout,
        dtype: torch.dtype,
        out: Mapping[str, torch.Tensor] | None = None,
        *,
        backend: str | None = None,
    ) -> dict[str, torch.Tensor]:
        """Every tensor of the record in `dtype` on the record's device. out: preallocated contiguous
        tensors (e.g. a device cache slot) written in place and returned; names it lacks are allocated.
        backend: for this call only ("torch", "triton", "auto"; default: the codec's). CPU records have
        their header checked; CUDA records are not (that would sync): the store validates records."""
        self.check_layout(layout)
        out = decode_outputs(record, layout, dtype, out)
        use_triton = self.uses_triton(record, backend)
        return {e.name: self.decode_entry(record, e, dtype, out.get(e.name), use_triton) for e in layout.entries}

    def linear(
        self,
        x: torch.Tensor,
        record: torch.Tensor,
        layout: PackedLayout,
        name: str,
        transposed: bool,
        *,
        scratch: torch.Tensor | None = None,
        backend: str | None = None,
    ) -> torch.Tensor:
        """y = x @ W.T (W stored [out, in]) or x @ W (transposed: W stored [in, out]) straight from the
        record: x [..., in] -> y [..., out] in x.dtype. Checks layout, record and x first; the per-token
        path (`bind`) checks once per slot instead."""
        self.check_layout(layout)
        check_record(record, layout)
        entry = layout.entry(name)
        x2 = linear_input(x, entry, transposed, self.name)  # [T, in]
        y = self.matmul(x2, record, entry, transposed, self.uses_triton(record, backend), scratch)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def bind(self, record: torch.Tensor, layout: PackedLayout, scratch: torch.Tensor | None = None) -> BoundRecord:
        """`record` (a device slot of `layout`'s size) for the per-token path: layout and record checked
        here, once; the bound form's `linear` only computes."""
        self.check_layout(layout)
        check_record(record, layout)
        return BoundRecord(self, record, layout, self.uses_triton(record), scratch)


class BoundRecord:
    """A record slot bound to its codec (`RecordCodec.bind`): what `linear` needs, resolved once."""

    __slots__ = ("codec", "record", "entries", "use_triton", "scratch")

    def __init__(self, codec: RecordCodec, record: torch.Tensor, layout: PackedLayout, use_triton: bool, scratch) -> None:
        self.codec, self.record, self.use_triton, self.scratch = codec, record, use_triton, scratch
        self.entries = {e.name: e for e in layout.entries}

    def linear(self, x: torch.Tensor, name: str, transposed: bool) -> torch.Tensor:
        # x [..., in] -> [..., out]
        entry = self.entries[name]
        y = self.codec.matmul(x.reshape(-1, x.shape[-1]), self.record, entry, transposed, self.use_triton, self.scratch)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor `name` decoded in `dtype`, into the scratch buffer when it fits (valid until the next
        call that decodes into it: use it at once, on the same stream)."""
        entry = self.entries[name]
        return self.codec.decode_entry(self.record, entry, dtype, self._scratch_for(entry, dtype), self.use_triton)

    def _scratch_for(self, entry, dtype: torch.dtype) -> torch.Tensor | None:
        """The scratch buffer as `entry` in `dtype`, where it fits; else None (the decode allocates)."""
        nbytes = entry.numel * dtype.itemsize
        if self.scratch is not None and self.scratch.numel() >= nbytes and self.scratch.device == self.record.device:
            return self.scratch[:nbytes].view(dtype).view(entry.shape)
        return None

    def raw(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A tensor stored raw (a bias), as a fresh tensor of `dtype` (the slot is refilled later)."""
        return raw_tensor(self.record, self.entries[name], dtype)


def check_options(options: Mapping[str, Any], target: Any, name: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """`options` if `target` (a class or function) accepts every one of them (with `extra`), else a
    `ConfigError` naming what the codec `name` accepts."""
    import inspect

    accepted = [
        p.name
        for p in inspect.signature(target).parameters.values()
        if p.name not in ("self", "fmt") and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ] + list(extra)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(f"codec {name!r} got unknown options {unknown}; it accepts {accepted}.")
    return dict(options)


def pack_expert(
    codec: ExpertCodec,
    tensors: Mapping[str, torch.Tensor],
    *,
    calib: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
    pin_memory: bool = False,
) -> tuple[Any, torch.Tensor]:
    """Plan + encode one expert into a fresh record (pinned if asked): (layout, record)."""
    layout = codec.plan(tensor_specs(tensors))
    record = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=pin_memory)
    if calib is None:
        codec.encode(tensors, layout, record)
    else:
        codec.encode(tensors, layout, record, calib=calib)
    return layout, record
