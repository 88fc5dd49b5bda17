"""Lossless expert records: bf16/fp32 weights split into byte planes and a 4-bit exponent code
(or the denser "classes" exponent code described below the format's constants, MiraConfig's default).

Bit-exact: decoding gives back every bit of every weight (NaN payloads, -0.0 and subnormals
included), so a model served from these records computes exactly what the resident model does,
while ~25 % fewer bytes cross the PCIe link (bf16).

Why it compresses: trained (and randomly initialised) weights use few exponents. In mira-tiny and
in N(0, 0.02) bf16 weights, 14 consecutive exponents hold all but 0.03 % of the weights (the
exponent's entropy is ~2.55 bits of its 8). Sign and mantissa are close to uniform: kept as they are.

Per weight w with 16-bit high word hi (bf16: all of it; fp32: the top half) and exponent
e = (hi >> 7) & 0xFF:

    sm     uint8              (sign << 7) | top 7 mantissa bits          (1 B / weight)
    lo     int16  fp32 only   the low 16 mantissa bits, as they are        (2 B / weight)
    code   4 bits             0: e = 0 (zero, subnormal)
                              1..14: e = base + code
                              15: escape: e lies outside [base + 1, base + 14]; patched
    escape (int32 index, int16 value): the index of hi among the output's 16-bit words (bf16:
                              the element; fp32: 2 * element + 1, little-endian) and the true hi

so bf16 takes 12 bits + escapes (0.75x), fp32 28 bits + escapes (0.875x). `base` is chosen per
tensor and expert: the 14-exponent window (exponent 0 excluded: it has its own code) that holds the
most weights. Exact zeros cost nothing extra, so pruned weights compress as well as dense ones.

Record: the packed record of `mira_hf.quant.record` (same 64 B header, magic b"MIRQ", format code 4,
every section on ALIGN_BYTES), sections per encoded tensor:

    meta       int32 [2]                  (base, escapes in this expert)
    sm         uint8 [numel]
    lo         int16 [numel]              fp32 only
    codes      uint8 [ceil(numel / 2)]    element 2i in the low nibble of byte i, 2i+1 in the high
    esc_index  int32 [capacity]
    esc_value  int16 [capacity]

Records of one layer share one layout (slots have one size), so `capacity` is the largest escape
count over the layer's experts, measured when the layout is planned from the weights
(`plan_experts`); an expert with fewer escapes fills the rest with a harmless entry (the first
weight's own value), so decoding patches all `capacity` entries without reading the count (no
device->host sync). A tensor whose encoding would not be smaller (1-D biases; weights with very
spread exponents) is stored raw ("raw" section). Decoding: the bulk planes by one Triton kernel on
CUDA (`triton_kernels.lossless_decode`; the torch reference of `lossless_bits` on CPU), then the escapes patched
(one more launch on CUDA, one `index_put_` on CPU).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..errors import ConfigError
from .base import BoundRecord, RecordCodec
from .formats import LOSSLESS_CODES as CODES
from .lossless_bits import (
    CLASS_BLOCK,
    class_code_size,
    decode_words_classes_torch,
    decode_words_torch,
    encode_entry_classes,
    encode_entry_nibble,
    escape_count,
    is_class_coded,
    patch_escapes,
)
from .record import (
    FORMAT_VERSION,
    CodecInputError,
    PackedLayout,
    TensorEntry,
    _align,
    check_record,
    dense_linear,
    lay_out,
    raw_parts,
    section_view,
)

FMT = "lossless"
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
_MAX_WORDS = 2**31 - 1  # escape indices are int32 indices of 16-bit words


# The "classes" exponent code (LosslessCodec(code="classes"), MiraConfig's default, ~0.69x bf16 instead of 0.75x). Per tensor
# and expert, the four most frequent exponents t0..t3 and a window of 15 exponents [lo, lo + 14]; a 2-bit
# class per weight says t0 | t1 | t2 or t3 (+1 extra bit) | lo + v (+4 extra bits v; v = 15: an escape,
# patched like the nibble code's escapes). t0..t3 never take class 3, so the window holds the next most
# frequent exponents. Each block of CLASS_BLOCK weights starts its extra bits on a byte (offset per
# block), so a decoder finds every field with one prefix sum over its block, and turns (class, field)
# into an exponent with arithmetic and selects on five numbers (`exps`), no table lookups.


def _words_per_element(dtype: torch.dtype) -> int:
    return 2 if dtype == torch.float32 else 1


def _encoded_sections(numel: int, dtype: torch.dtype, capacity: int) -> list[tuple[str, int, bool]]:
    """(name, bytes, is_payload) of one encoded tensor; escapes and metadata are overhead."""
    parts = [("meta", 8, False), ("sm", numel, True)]
    if dtype == torch.float32:
        parts.append(("lo", 2 * numel, True))
    parts += [("codes", (numel + 1) // 2, True), ("esc_index", 4 * capacity, False), ("esc_value", 2 * capacity, False)]
    return parts


def _class_sections(numel: int, dtype: torch.dtype, capacity: int, extra: int) -> list[tuple[str, int, bool]]:
    """Sections of one tensor under the classes code; `extra`: bytes of extra bits reserved (+2: a decoder
    reads a 2-byte window at the last field)."""
    parts = [("meta", 8, False), ("exps", 4 * 8, False), ("sm", numel, True)]  # exps: t0, t1, t2, t3, lo, 0, 0, 0
    if dtype == torch.float32:
        parts.append(("lo", 2 * numel, True))
    parts += [
        ("cls", (numel + 3) // 4, True),
        ("boff", 4 * (-(-numel // CLASS_BLOCK)), False),
        ("extra", extra + 2, True),
        ("esc_index", 4 * capacity, False),
        ("esc_value", 2 * capacity, False),
    ]
    return parts


def _span(parts: list[tuple[str, int, bool]]) -> int:
    return sum(_align(n) for _, n, _ in parts)


def _check_specs(specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    for name, (shape, dtype) in specs.items():
        if len(shape) >= 2 and dtype not in SUPPORTED_DTYPES:
            raise ConfigError(
                f"quantization='lossless' supports bfloat16 and float32 expert weights; {name!r} is {dtype}. "
                "Load the model in one of those (from_pretrained(..., dtype=torch.bfloat16)) or use quantization=None."
            )
        if len(shape) >= 2 and math.prod(shape) * _words_per_element(dtype) > _MAX_WORDS:
            raise ConfigError(
                f"lossless: {name!r} {tuple(shape)} has more than 2**31 16-bit words, beyond the format's int32 "
                "escape indices; use quantization=None for this model."
            )


def build_lossless_layout(
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    capacity: Mapping[str, int],
    extra: Mapping[str, int] | None = None,
) -> PackedLayout:
    """Layout of one expert record: `capacity[name]` escapes reserved per tensor; with `extra` (bytes of
    extra bits per tensor) the tensors use the classes exponent code, else the nibble code."""
    _check_specs(specs)
    tensors = []
    for name, (shape, dtype) in specs.items():
        shape = tuple(int(d) for d in shape)
        raw = raw_parts(shape, dtype)
        parts, encoded = raw, False
        if len(shape) >= 2:
            numel, cap = math.prod(shape), int(capacity.get(name, 0))
            coded = _encoded_sections(numel, dtype, cap) if extra is None else _class_sections(numel, dtype, cap, extra[name])
            if _span(coded) < _span(raw):  # else escapes so many that raw is smaller: store raw
                parts, encoded = coded, True
        tensors.append((name, shape, dtype, encoded, parts))
    return lay_out(FMT, FMT, 0, 0, 0, tensors, (FMT, FORMAT_VERSION))


class LosslessCodec(RecordCodec):
    """Bit-exact compressed records for bf16 / fp32 experts (see the module doc for the format).

    Its layout depends on the weights (the escape capacity): plan it with `plan_experts(fused)`
    over all experts that will share it; `plan(specs, capacity)` is the shape-level form.
    """

    name = FMT
    exact = True  # decode(encode(w)) == w bit for bit

    def __init__(self, code: str = "nibble", backend: str = "auto") -> None:
        """code: the exponent code, "nibble" (4 bits, 0.75x bf16; this class's default) or "classes" (a 2-bit
        class plus 0-4 extra bits, ~0.69x bf16; what MiraConfig uses by default, QuantConfig.lossless_code).
        backend: "auto" (Triton's bulk decode for CUDA records when triton is importable), "torch" or "triton"."""
        if code not in CODES:
            raise ConfigError(f"LosslessCodec(code={code!r}): supported are {list(CODES)}.")
        super().__init__(backend)
        self.code = code

    def __repr__(self) -> str:
        return f"LosslessCodec(code={self.code!r})"

    def plan(
        self,
        specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        capacity: Mapping[str, int] | None = None,
        extra: Mapping[str, int] | None = None,
    ) -> PackedLayout:
        """Layout for tensors {name: (shape, dtype)} with `capacity[name]` escapes reserved (default
        0: only experts whose exponents all fit their window can be encoded); the classes code also
        reserves `extra[name]` bytes of extra bits (default: the most any tensor of that size can need)."""
        if self.code == "nibble":
            return build_lossless_layout(specs, capacity or {})
        most = {n: -(-math.prod(shape) // CLASS_BLOCK) * CLASS_BLOCK // 2 for n, (shape, _) in specs.items()}
        return build_lossless_layout(specs, capacity or {}, {**most, **(extra or {})})

    def plan_experts(self, fused: Mapping[str, torch.Tensor]) -> PackedLayout:
        """Layout for every expert of one layer, from its fused tensors name -> [E, ...]: each
        tensor's escape capacity is its largest escape count over the E experts."""
        specs = {n: (tuple(t.shape[1:]), t.dtype) for n, t in fused.items()}
        E = next(iter(fused.values())).shape[0]
        return self.plan_experts_from(specs, E, lambda e: {n: t[e] for n, t in fused.items()})

    def plan_experts_from(
        self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], num_experts: int, expert
    ) -> PackedLayout:
        """As `plan_experts`, reading the experts one at a time (`expert(e) -> {name: tensor}`): a
        checkpoint streamed from disk is planned without holding a whole layer."""
        _check_specs(specs)
        return self.plan_from_sizes(specs, [self.expert_sizes(expert(e)) for e in range(num_experts)])

    def expert_sizes(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
        """What one expert's record must hold, per encoded tensor: (escapes, bytes of extra bits; 0 for
        the nibble code). Computed on the tensors' device; `plan_from_sizes` combines the experts'."""
        sizes = {}
        for name, t in tensors.items():
            if t.dim() >= 2 and t.dtype in SUPPORTED_DTYPES:
                sizes[name] = (escape_count(t), 0) if self.code == "nibble" else class_code_size(t)
        return sizes

    def plan_from_sizes(
        self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], sizes: list[Mapping[str, tuple[int, int]]]
    ) -> PackedLayout:
        """The layout for experts whose `expert_sizes` are `sizes`: room for the most any of them needs."""
        _check_specs(specs)
        capacity = {name: 0 for name, (shape, _) in specs.items() if len(shape) >= 2}
        extra = dict.fromkeys(capacity, 0)
        for expert in sizes:
            for name in capacity:
                escapes, nbytes = expert[name]
                capacity[name], extra[name] = max(capacity[name], escapes), max(extra[name], nbytes)
        return build_lossless_layout(specs, capacity, extra if self.code == "classes" else None)

    def plan_args(self, layout: PackedLayout) -> dict:
        """What `plan` needs to rebuild `layout` from its specs (escape capacity and extra bytes per
        tensor), as JSON-able numbers: a saved store keeps them instead of reading the weights again."""
        capacity, extra = {}, {}
        for entry in layout.entries:
            names = {s.name: s for s in entry.sections}
            if entry.quantized:
                capacity[entry.name] = names["esc_index"].nbytes // 4
                if "extra" in names:
                    extra[entry.name] = names["extra"].nbytes - 2
            elif len(entry.shape) >= 2:
                capacity[entry.name] = entry.numel  # an escape per weight: more than raw, so it stays raw
        return {"capacity": capacity, "extra": extra}

    def scratch_bytes(self, layout: PackedLayout) -> int:
        """Device bytes `linear` decodes one weight into (placement "packed"): the largest 2-D one."""
        return max((e.numel * e.dtype.itemsize for e in layout.entries if len(e.shape) == 2), default=0)

    def layout_identity(self) -> dict[str, object]:
        return dict(codec=FMT)

    def calib_by_name(self, calib, layout: PackedLayout) -> dict[str, torch.Tensor]:
        if calib is not None:
            raise CodecInputError("the lossless codec keeps every bit; it takes no calib activations.")
        return {}

    def _check_dtype(self, t: torch.Tensor, entry: TensorEntry) -> None:
        if t.dtype != entry.dtype:
            raise CodecInputError(
                f"encode: {entry.name!r} is {t.dtype}; the layout holds {entry.dtype} (lossless keeps the dtype)."
            )

    def encode_entry(self, t: torch.Tensor, entry: TensorEntry, out: torch.Tensor, calib: torch.Tensor | None) -> int:
        """Encode one weight into `out`, computing on its device; returns its escape count."""
        self._check_dtype(t, entry)
        return (encode_entry_classes if is_class_coded(entry) else encode_entry_nibble)(t, entry, out)

    def encode_raw(self, t: torch.Tensor, entry: TensorEntry, out: torch.Tensor) -> None:
        self._check_dtype(t, entry)
        section_view(out, entry.section("raw")).copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))

    def decode_entry(self, record, entry, dtype, dst, use_triton, sections=None) -> torch.Tensor:
        """Bit-exact in the stored dtype (converted if `dtype` is another one). `sections`: the entry's
        `EntrySections`, where a bound slot keeps them."""
        if entry.dtype == dtype:
            if dst is None:
                dst = torch.empty(entry.shape, dtype=dtype, device=record.device)
            return self._decode_into(record, entry, dst, use_triton, sections)
        empty = torch.empty(entry.shape, dtype=entry.dtype, device=record.device)
        w = self._decode_into(record, entry, empty, use_triton, sections)
        return w.to(dtype) if dst is None else dst.copy_(w)

    @staticmethod
    def _decode_into(
        record: torch.Tensor, entry: TensorEntry, dst: torch.Tensor, use_triton: bool, sections=None
    ) -> torch.Tensor:
        """Decode one tensor of the record into `dst` (contiguous, entry.shape, entry.dtype)."""
        if not entry.quantized:
            return dst.copy_(section_view(record, entry.section("raw"), entry.dtype).view(entry.shape))
        classes = is_class_coded(entry)
        if use_triton:
            from . import triton_kernels

            if sections is None:
                sections = EntrySections(record, entry)
            if classes:
                triton_kernels.lossless_classes_decode(record, entry, dst, sections=sections.decode)
            else:
                triton_kernels.lossless_decode(record, entry, dst)
            triton_kernels.patch_escapes(sections.esc_index, sections.esc_value, dst.view(-1).view(torch.int16))
            return dst
        words = dst.view(-1).view(torch.int32 if entry.dtype == torch.float32 else torch.int16)
        (decode_words_classes_torch if classes else decode_words_torch)(record, entry, words)
        patch_escapes(record, entry, dst)
        return dst

    def matmul(self, x2, record, entry, transposed, use_triton, scratch, sections=None) -> torch.Tensor:
        """W decoded into `scratch` (a uint8 device buffer of `scratch_bytes(layout)`, reused call after call)
        and multiplied with the same op the resident model uses, so y is bit-identical to it."""
        nbytes = entry.numel * entry.dtype.itemsize
        if scratch is not None and scratch.numel() >= nbytes and scratch.device == record.device:
            w = scratch[:nbytes].view(entry.dtype).view(entry.shape)
        else:
            w = torch.empty(entry.shape, dtype=entry.dtype, device=record.device)
        w = self._decode_into(record, entry, w, use_triton, sections)
        if x2.dtype != entry.dtype:
            w = w.to(x2.dtype)
        return dense_linear(x2, w, transposed)

    def bind(self, record: torch.Tensor, layout: PackedLayout, scratch: torch.Tensor | None = None) -> BoundLossless:
        """As `RecordCodec.bind`, with each encoded tensor's section views made here, once per slot."""
        self.check_layout(layout)
        check_record(record, layout)
        return BoundLossless(self, record, layout, self.uses_triton(record), scratch)


class EntrySections:
    """The views of one encoded tensor's sections that a Triton decode reads (no copy, nothing read): made once
    per bound slot, so a use launches its kernels without slicing the record again (on a GPU, slicing and
    viewing each section per use cost more host time than the decode's launch)."""

    __slots__ = ("decode", "esc_index", "esc_value")

    def __init__(self, record: torch.Tensor, entry: TensorEntry) -> None:
        from . import triton_kernels

        self.decode = triton_kernels.classes_sections(record, entry) if is_class_coded(entry) else None
        self.esc_index = section_view(record, entry.section("esc_index"), torch.int32)
        self.esc_value = section_view(record, entry.section("esc_value"), torch.int16)


class BoundLossless(BoundRecord):
    """A lossless record slot bound to its codec: `BoundRecord` with the section views of each encoded tensor
    (`EntrySections`) made once, where the slot decodes with Triton."""

    __slots__ = ("sections",)

    def __init__(self, codec: LosslessCodec, record: torch.Tensor, layout: PackedLayout, use_triton: bool, scratch) -> None:
        super().__init__(codec, record, layout, use_triton, scratch)
        self.sections = {e.name: EntrySections(record, e) for e in layout.entries if e.quantized} if use_triton else {}

    def linear(self, x: torch.Tensor, name: str, transposed: bool) -> torch.Tensor:
        # x [..., in] -> [..., out]
        entry, sections = self.entries[name], self.sections.get(name)
        y = self.codec.matmul(x.reshape(-1, x.shape[-1]), self.record, entry, transposed, self.use_triton, self.scratch, sections)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        entry = self.entries[name]
        return self.codec.decode_entry(
            self.record, entry, dtype, self._scratch_for(entry, dtype), self.use_triton, self.sections.get(name)
        )


def for_config(quant) -> LosslessCodec:
    """The codec of a model configured with `quant` (QuantConfig): its exponent code."""
    return LosslessCodec(code=quant.lossless_code)
