"""`MiraConfig`: the few knobs that matter, frozen and validated when built.

The five that matter sit at the top (`gpu_budget`, `device`, `policy`, `predictor`, `quantization`);
tuning parameters of one mechanism live in that mechanism's own small dataclass.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import numbers
import os
import re
from dataclasses import dataclass, field
from typing import Union

from .errors import ConfigError, MissingDependencyError, check_count, check_finite, check_fraction
from .heat import HeatConfig
from .policies import PriorityConfig
from .quant import GROUP_SIZES, LOSSLESS_CODES, codec_names, find_codec_entry, is_native
from .registry import POLICIES as POLICY_REGISTRY
from .registry import PREDICTORS as PREDICTOR_REGISTRY

Budget = Union[int, float, str, None]

# The built-in choices (the registries in `mira_hf.registry` also hold what users register later).
POLICIES = POLICY_REGISTRY.names()
PREDICTORS: tuple[str | None, ...] = (None, *PREDICTOR_REGISTRY.names())
PLACEMENTS = ("auto", "dequant", "packed", "mixed")
# quantization="auto" picks "lossless" only for expert records at least this large. A packed record cost the
# host ~0.7 ms per use on an H200 machine (two decode launches, the sections' views, the escapes' patch), hits
# included; a miss saves 0.31 of the record's copy (5.6 ms per GB at 55 GB/s). With misses 70-90% of uses that
# pays from ~140-170 MB. Measured (benchmarks/NOTES.md, "Transfer formats"): gpt-oss's 50 MB experts decode
# 0.65-0.83x as fast packed as uncompressed, Mixtral's 352 MB 1.43-1.58x as fast.
AUTO_LOSSLESS_MIN_RECORD_BYTES = 128 * 2**20
HOST_MEMORY_KINDS = ("auto", "pinned", "pageable")
HOST_COMPUTE_MODES = ("off", "on", "auto", "split")  # mira_hf.host_compute, mira_hf.neuron_split

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, what: str, hint: str = "") -> int:
    """Parse `12GiB`, `500MB`, `1.5 GB` or an int into bytes (GB = 10**9, GiB = 2**30). `hint`: what else the
    field takes, added to the error for a unit-less string that is not whole bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}={value!r}: expected bytes as an int or a string such as '12GiB'.")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{what}={value}: must be a positive number of bytes.")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(
                f"{what}={value!r} is not a size. Use bytes as an int or a string such as "
                f"'12GiB', '500MB' (units: {', '.join(u for u in _UNITS if u)})."
            )
        if unit in ("", "b") and not float(m.group(1)).is_integer():
            raise ConfigError(
                f"{what}={value!r}: a size without a unit counts bytes, so it must be a whole number. "
                f"Give a unit ('{m.group(1)}GiB'){hint}."
            )
        n = int(float(m.group(1)) * _UNITS[unit])
        if n <= 0:
            raise ConfigError(f"{what}={value!r}: must be a positive size.")
        return n
    raise ConfigError(f"{what}={value!r} ({type(value).__name__}): expected an int or a string such as '12GiB'.")


def _as_fraction(value) -> str:
    """` (gpu_budget=0.25)` for a string that reads as a fraction in (0, 1], else ''."""
    try:
        x = float(value)
    except ValueError:
        return ""
    return f" (gpu_budget={x})" if 0.0 < x <= 1.0 else ""


@dataclass(frozen=True)
class CacheConfig:
    """How the GPU expert arena is split between tiers."""

    # Share of slots reserved for experts in flight or prefetched (STAGE); the rest hold resident
    # experts (HOT). A quarter of the arena by default.
    stage_fraction: float = 0.25
    # Demand copies one block keeps in flight, in bytes (at least two copies). The link moves one
    # copy at a time, so two in flight keep it busy; each further slot a block takes evicts an expert
    # that a later layer may need (a 512-token prefill needs every expert of every layer: streaming
    # them through two slots keeps the other layers' experts resident).
    demand_inflight_bytes: int = 64 * 2**20
    # Token-block prefill (opt-in): an expert computes its rows of a block this many tokens at a time, so
    # a long prompt's activations stay bounded (blocks of 16-64 tokens work well; each expert is still
    # loaded once per block call and shared by its token blocks). None (default): all its rows at once.
    # A matmul over fewer rows may round differently in the last bits, so with a block size the outputs
    # are close to the unwrapped model's but not bit-identical (fp32 logits within ~1e-5).
    prefill_block_tokens: int | None = None

    def __post_init__(self) -> None:
        check_fraction("CacheConfig.stage_fraction", self.stage_fraction, "[0, 1)")
        b = self.prefill_block_tokens
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ConfigError(
                f"prefill_block_tokens={b!r}: give a number of tokens ≥ 1 (16-64 work well), or None to compute "
                "each expert's rows at once (bit-identical outputs, the default)."
            )
        check_count("demand_inflight_bytes", self.demand_inflight_bytes, 1, "bytes")


@dataclass(frozen=True)
class LoaderConfig:
    """How experts cross from host memory to the device."""

    # Pinned staging ring used by a pageable store and by the disk tier (a pinned buffer the copy engine reads).
    staging_ring_bytes: int = 128 * 2**20
    # Seconds a caller waits for a background copy before it raises instead of hanging.
    copy_timeout_s: float = 60.0
    # Read the routed experts from the safetensors shards one expert at a time, straight into the
    # store, instead of loading the whole checkpoint into host memory first. None (auto): when
    # `host_budget` is set or the checkpoint is larger than the available host memory; True: always
    # (an error if the checkpoint's layout is not understood); False: never.
    stream_experts: bool | None = None
    # Copy each record in two parts where its slot holds it as it is ("raw" and "packed" placements):
    # the tensors of the expert's first matmul, then the rest; the first matmul (and in "packed" the
    # decode of its weights) starts while the rest is still crossing. False: one copy per record.
    split_copies: bool = True
    # Records smaller than this are copied in one piece even with `split_copies`: their last part
    # crosses in less time (~25 µs for 4 MiB at 55 GB/s) than a second copy call costs the host.
    # (Encoded records; uncompressed experts are stored tensor by tensor and copied one tensor at a time.)
    split_min_bytes: int = 4 * 2**20
    # Where encoded expert records are cached (`mira_hf.record_cache`), so a second load of a checkpoint
    # reads them instead of encoding again: "auto" ($MIRA_HF_RECORD_CACHE, else $HF_HOME/mira-hf/records),
    # a directory, or None (off). Writing an entry removes those whose checkpoint files are gone or changed.
    record_cache: str | None = "auto"

    def __post_init__(self) -> None:
        if self.record_cache is not None and (not isinstance(self.record_cache, str) or not self.record_cache):
            raise ConfigError(
                f"record_cache={self.record_cache!r}: give 'auto' (under the Hugging Face cache), a directory, or None to turn it off."
            )
        if self.split_copies not in (True, False):
            raise ConfigError(f"split_copies={self.split_copies!r}: must be True or False.")
        check_count("split_min_bytes", self.split_min_bytes, 0, "bytes; 0 splits every record")
        if not isinstance(self.staging_ring_bytes, int) or self.staging_ring_bytes < 2**20:
            raise ConfigError(f"staging_ring_bytes={self.staging_ring_bytes!r}: must be an int ≥ 1 MiB.")
        check_finite("copy_timeout_s", self.copy_timeout_s, "> 0", "seconds")
        if self.stream_experts not in (None, True, False):
            raise ConfigError(f"stream_experts={self.stream_experts!r}: must be None (auto), True or False.")


@dataclass(frozen=True)
class QuantConfig:
    """The compressed transfer format (used when `MiraConfig.quantization` is set)."""

    group_size: int = 64  # weights per scale group, along each weight's contiguous dimension (int8/int4/nf4)
    # "dequant": experts cross the link packed and are dequantised on the device into a slot of the
    # checkpoint dtype (same experts per budget, fewer bytes moved). "packed": experts stay packed in
    # the cache and are computed from packed weights (≈3.7× more int4 experts in the same budget;
    # lossless: ≈1.33×, minus one decoded weight of scratch). "mixed": as "dequant", except where the
    # budget holds every expert only if some stay packed: those few are then kept packed on the device
    # and decoded at each use, and nothing is copied again (for batches that use every expert at each
    # step: `mira serve` loads with it). Either way the device buffers this needs (a staging record,
    # and/or the scratch) are taken from gpu_budget. "auto": "packed" for
    # "lossless" (more experts per budget, measured faster on the H200: benchmarks/NOTES.md, "Transfer formats"),
    # "dequant" for the lossy formats (faster at batch 1).
    placement: str = "auto"
    # The lossless format's exponent code: "classes" (a 2-bit class plus 0-4 extra bits: 0.69x bf16's
    # bytes, decoded with a prefix sum per block of 256 weights) or "nibble" (4 bits per weight: 0.75x;
    # its decode is ~3x faster, 0.1 vs 0.27 ms per 58.7 M weights on the H200). Both bit-exact. "classes"
    # measured as fast or faster end to end on the H200 (benchmarks/NOTES.md, "Transfer formats"). Encoding "classes" on a
    # CPU is ~5x slower than "nibble" (at load; on a GPU both are fast).
    lossless_code: str = "classes"

    def __post_init__(self) -> None:
        for name, allowed in (("lossless_code", LOSSLESS_CODES), ("placement", PLACEMENTS)):
            object.__setattr__(self, name, normalize_choice(f"QuantConfig.{name}", getattr(self, name), allowed))
        if type(self.group_size) is not int or self.group_size not in GROUP_SIZES:
            raise ConfigError(
                f"QuantConfig.group_size={self.group_size!r}: must be one of {', '.join(map(str, GROUP_SIZES))} "
                "(weights per scale; default 64; nf4 takes 32 and up)."
            )


@dataclass(frozen=True)
class PredictorConfig:
    """How experts are predicted and staged ahead of the router (`MiraConfig.prediction`)."""

    lookahead: int = 2  # layers ahead that predictions are made (they also rank evictions)
    confidence: float = 0.3  # minimum probability for a guess to be counted (scored for precision)
    # Copies ahead of the router are made only for the next `stage_lookahead` layers: a copy issued two
    # layers early evicts an expert sooner than needed.
    stage_lookahead: int = 1
    # At steps of many tokens (no predictor; the batch's use rates guess), copies go this many blocks ahead, across
    # the end of a step: every expert of a layer is used at each step, so a copy's victim is an expert of the block
    # just queued, and a copy for the very next block would wait for that block's compute and then stall its successor.
    batch_stage_lookahead: int = 2
    # ... and only for guesses at least this likely: on a saturated link a wrong copy costs a whole
    # expert's transfer (mira-tiny, offline: 1.29× Belady's bytes at 0.95, 1.31× at 0.9; benchmarks/NOTES.md, "Prediction").
    stage_probability: float = 0.95
    max_staged_per_layer: int | None = None  # copies ahead of need one layer may hold; None: 2 × top-k
    markov_warmup_tokens: int = 1000  # tokens of routing that form the first Markov estimate (no re-checks before)
    markov_cumulative: float = 0.8  # candidates kept up to this cumulative probability
    markov_recheck_tokens: int = 256  # every N tokens, re-estimate if accuracy dropped
    position_window_tokens: int = 64  # "position": tokens over which each layer's expert frequency is counted
    hybrid_switch_tokens: int = 512  # "hybrid": tokens of a sequence predicted by "markov" before "position" takes over
    # Stage only while the predictor's recent precision (share of staged guesses that were used) is at
    # least this: when the link is the bottleneck, a wrong guess costs a whole expert's transfer.
    min_precision: float = 0.6
    precision_decay: float = 0.9  # weight of the past in the running precision estimate
    # Pause prediction (and staging) while it costs the host more time per block than the stalls it
    # could remove, reviewed every `payoff_window_steps` forward steps (`mira_hf.payoff.PayoffGate`): on a
    # model whose copies land before they are needed, prediction only adds host time. None: on CUDA;
    # True: on any device (on CPU a miss's stall is its synchronous copy); False: never pause.
    pause_unprofitable: bool | None = None
    payoff_window_steps: int = 32  # forward steps per payoff review (one window in 32 predicts again while paused)
    # Speculation: after a block's own copies are queued, the link idles until the next block's router
    # has run and the host has seen its experts. Into that idle time goes the first `speculate_bytes`
    # of the next layer's likeliest guess that is not resident (records larger than that only); the
    # next block finishes the copy if it uses the expert and drops it otherwise, so a wrong guess costs
    # idle link time, not a transfer. None: 48 MiB on CUDA; 0 (off) on CPU, where copies are
    # synchronous and the link never idles. Off with QuantConfig placement "dequant" (it decodes whole records).
    speculate_bytes: int | None = None

    def __post_init__(self) -> None:
        for name, least, unit in (
            ("lookahead", 1, "layers"),
            ("stage_lookahead", 1, "layers"),
            ("batch_stage_lookahead", 1, "blocks"),
            ("markov_warmup_tokens", 0, "tokens"),
            ("markov_recheck_tokens", 1, "tokens"),
            ("position_window_tokens", 1, "tokens"),
            ("hybrid_switch_tokens", 0, "tokens"),
            ("payoff_window_steps", 1, "forward steps"),
        ):
            check_count(f"PredictorConfig.{name}", getattr(self, name), least, unit)
        if self.max_staged_per_layer is not None:
            check_count("PredictorConfig.max_staged_per_layer", self.max_staged_per_layer, 0, "copies; None: 2 × top-k")
        if self.pause_unprofitable not in (None, True, False):
            raise ConfigError(
                f"PredictorConfig.pause_unprofitable={self.pause_unprofitable!r}: must be None (on CUDA), True or False."
            )
        for name, interval in (
            ("confidence", "[0, 1]"),
            ("stage_probability", "[0, 1]"),
            ("markov_cumulative", "(0, 1]"),
            ("min_precision", "[0, 1]"),
            ("precision_decay", "[0, 1)"),
        ):
            check_fraction(f"PredictorConfig.{name}", getattr(self, name), interval)
        if self.speculate_bytes is not None and (
            isinstance(self.speculate_bytes, bool) or not isinstance(self.speculate_bytes, int) or self.speculate_bytes < 0
        ):
            raise ConfigError(
                f"PredictorConfig.speculate_bytes={self.speculate_bytes!r}: give a number of bytes ≥ 0 (0 turns "
                "speculation off) or None for the default (48 MiB on CUDA, off on CPU)."
            )


def spelling(value: object) -> str:
    """How a user types a choice: `None` is written "none" (in Python and on the command line alike)."""
    return "none" if value is None else str(value)


# The built-in predictors that read no file (a predictor registered by a user may read `predictor_path`).
PATHLESS_PREDICTORS = (None, "gate", "markov", "global", "position", "hybrid")


def choices_text(allowed: tuple) -> str:
    """Choices as the user types them: `none, auto, gate`."""
    return ", ".join(spelling(a) for a in allowed)


def quantizations() -> tuple[str | None, ...]:
    """What `MiraConfig.quantization` takes: "auto", None, and every registered format: the exact ones
    first, then the lossy ones, then pre-quantized checkpoints' own formats ("fp8_block", "mxfp4": served
    as stored, never encoded into)."""
    entries = [find_codec_entry(n) for n in codec_names()]
    entries.sort(key=lambda e: (e.role == "native", not e.exact))  # stable: registration order within each
    return ("auto", None, *(e.name for e in entries))


def chosen_quantizations() -> tuple[str | None, ...]:
    """The formats a user chooses (`quantizations()` without pre-quantized checkpoints' own, which a load of such a
    checkpoint picks by itself)."""
    return tuple(q for q in quantizations() if q in ("auto", None) or find_codec_entry(q).role != "native")


def __getattr__(name: str) -> object:
    if name == "QUANTIZATIONS":  # read from the codec registry each time: formats registered later count
        return quantizations()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def normalize_choice(name: str, value: object, allowed: tuple, hint: str = "", shown: tuple | None = None) -> object:
    """The stored form of a choice typed in any case ("LRU", "None", None -> "lru", None), or `ConfigError`
    naming what was given and the choices as they are typed (`shown`, where only some of `allowed` are the user's)."""
    if isinstance(value, str):
        for a in allowed:
            if value.strip().lower() == spelling(a):
                return a
    elif value is None and None in allowed:
        return None
    listed = choices_text(allowed if shown is None else shown)
    raise ConfigError(f"{name}={value!r} is not supported. Supported: {listed} (any case). {hint}".rstrip())


@dataclass(frozen=True)
class MiraConfig:
    """Settings of one wrapped model. Frozen: build a new one with `dataclasses.replace` to change it.

    gpu_budget: device bytes for routed experts. An int (bytes), a string such as `"12GiB"`, or a
        float in (0, 1] meaning that fraction of all routed-expert bytes (raised, with a warning, to the
        minimum working set, the top-k experts of one layer of each expert size, when below it; bytes below it are refused).
        `None` = all experts if they fit in 90% of the device's free memory, else that much.
    device: `"cuda"`, `"cuda:N"` or `"cpu"` (or that `torch.device`); `None` picks cuda when available.
    policy: cache eviction policy: `"lru"` (reactive baseline), `"heat"` (evict the expert whose next use is
        expected furthest away), `"priority"` (predicted probability, recency and transfer cost). Choices are
        read in any case.
    predictor: how experts are staged ahead of the router. `"none"` (or `None`): no prefetch; `"auto"`: `"learned"`
        when `predictor_path` is given, else `"gate"` (needs no training); or one of `"gate"`,
        `"markov"`, `"global"`, `"position"`, `"hybrid"`, `"learned"`.
    predictor_path: directory written by `model.mira.save_predictor()` (a calibrated `"learned"` predictor).
    store_path: directory written by `model.mira.save_store()`: encoded expert records reused as they are
        (encode once); refused if made in another format, or from a model of another shape or with other routers
        (the experts themselves are not compared: save it again after changing them).
    quantization: expert transfer format. `"auto"` (default): `"lossless"` on a CUDA device when the
        budget cannot hold every expert and the experts are bf16/fp32 records of ≥ 128 MiB, else `None`
        (both exact; `model.mira.quantization` says which). `"none"` (or `None`): the checkpoint's dtype, bit-exact.
        `"lossless"`: bit-exact too, ~0.69× the bytes for bf16 experts with the default exponent code
        (`QuantConfig.lossless_code`; 0.75× with "nibble"; see `mira_hf.quant.lossless`). `"int8"`,
        `"int4"`: mira-hf's packed group-wise format (see `QuantConfig`); `"nf4"`: bitsandbytes. These
        three change the numbers.
        A pre-quantized checkpoint (FP8 with block scales, MXFP4) keeps its experts in its own bytes:
        `"auto"` and `None` pick its format (`"fp8_block"`, `"mxfp4"`), computed as transformers' dequantize
        path computes it; other formats are refused for it, and these two for any other checkpoint.
    host_memory: `"pinned"` (fastest copies; pinning takes ~0.5 s per GB at load), `"pageable"`
        (instant load, copies go through a pinned staging ring) or `"auto"` (pinned on CUDA).
    host_budget: host bytes for the expert store; experts beyond it are read from disk
        (`offload_dir`) through the staging ring. `None`: no limit. When set, `from_pretrained` reads
        the experts from the checkpoint one at a time (`LoaderConfig.stream_experts`), so a model
        larger than host memory loads. With host_compute="split" it bounds the device parts; the host parts
        (`host_share` of every expert, a 16-bit down projection stored in fp32) stay in host memory beside it.
    offload_dir: where experts beyond `host_budget` are written, memory-mapped and read back (given with
        `host_budget` only: without it every expert stays in host memory). A relative path names a directory of the
        working directory at load (a later cast writes there too, after an `os.chdir`).
    expert_layer_path: for models without an adapter, a glob of the routed-experts modules,
        e.g. `"model.layers.*.mlp.experts"` (fused 3-D expert tensors, as transformers 5 builds them).
    host_compute: compute some missed experts on the host CPU, where their weights are, instead of copying
        them (`mira_hf.host_compute`): `"off"` (default), `"auto"` (on a CUDA device where records are
        uncompressed; where `quantization="auto"` picks the lossless format, for large experts, that format is
        kept and host compute stays off) or `"on"` (on any device; `quantization="auto"` then stays
        uncompressed; refuses encoded records). Each miss goes to whichever path finishes it first (measured
        link speed and host time).
        `"split"`: every expert is split by its intermediate neurons (`mira_hf.neuron_split`); the host computes
        a share `host_share` of each expert's neurons at every use, and the GPU caches and receives only the
        rest, so each miss moves fewer bytes and the budget holds more experts; the two parts' outputs are added in
        fp32 and rounded once, as the whole expert's matmul rounds. Not bit-exact: the host's matmuls round
        differently from the device's (bounds in docs/usage.md).
    host_share: with host_compute="split", the share of each expert's intermediate neurons the host computes,
        in (0, 1), rounded so that both parts are whole multiples of 16 neurons (fewer for small experts) and the
        device's rows stay aligned. The host's time per layer grows with it and the link's shrinks (docs/usage.md).
    """

    gpu_budget: Budget = None
    device: str | None = None  # a torch.device given is kept as its string
    policy: str = "heat"  # measured best on real routing (benchmarks/NOTES.md, "Eviction"); "lru" is the reactive baseline
    predictor: str | None = "auto"  # "learned" when calibrated (predictor_path), else "gate": no training needed
    quantization: str | None = "auto"  # exact either way; lossless only where the link is the bottleneck
    host_memory: str = "auto"
    host_budget: int | str | None = None
    offload_dir: str | None = None
    expert_layer_path: str | None = None
    host_compute: str = "off"  # inexact (host rounding), so opt-in
    host_share: float = 0.25  # host_compute="split": faster than 0.35 on the Mixtral shape (benchmarks/NOTES.md, "Host compute")
    predictor_path: str | None = None
    store_path: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    heat: HeatConfig = field(default_factory=HeatConfig)
    priority: PriorityConfig = field(default_factory=PriorityConfig)
    prediction: PredictorConfig = field(default_factory=PredictorConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)

    def __post_init__(self) -> None:
        b = self.gpu_budget
        if not isinstance(b, (bool, int, float, str)) and isinstance(b, numbers.Real):  # numpy's scalars
            b = int(b) if isinstance(b, numbers.Integral) else float(b)
            object.__setattr__(self, "gpu_budget", b)
        if isinstance(b, bool) or not (b is None or isinstance(b, (int, float, str))):
            raise ConfigError(
                f"gpu_budget={b!r}: expected bytes (int), a size string such as '12GiB', "
                "or a float in (0, 1] (a fraction of all routed-expert bytes)."
            )
        if isinstance(b, float) and not 0.0 < b <= 1.0:
            raise ConfigError(
                f"gpu_budget={b}: a float is a fraction of all routed-expert bytes and must be in (0, 1]. "
                "For bytes pass an int or a string such as '12GiB'."
            )
        if isinstance(b, (int, str)) and not isinstance(b, float):
            parse_bytes(b, "gpu_budget", f", or pass a fraction of all routed-expert bytes as a float{_as_fraction(b)}")
        choices = (
            ("policy", POLICY_REGISTRY.names()),
            ("predictor", (None, *PREDICTOR_REGISTRY.names())),
            ("quantization", quantizations()),
            ("host_memory", HOST_MEMORY_KINDS),
            ("host_compute", HOST_COMPUTE_MODES),
        )
        for name, allowed in choices:  # frozen: the normalized spelling is stored in place
            shown = chosen_quantizations() if name == "quantization" else None
            object.__setattr__(self, name, normalize_choice(name, getattr(self, name), allowed, shown=shown))
        if type(self.device).__name__ == "device" and hasattr(self.device, "index"):  # a torch.device
            object.__setattr__(self, "device", str(self.device))
        if isinstance(self.device, str):
            object.__setattr__(self, "device", self.device.strip().lower())
        if self.device is not None:
            if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
                raise ConfigError(f"device={self.device!r}: supported are 'cpu', 'cuda' and 'cuda:N'.")
        requires = getattr(find_codec_entry(self.quantization), "requires", None)
        if requires is not None and importlib.util.find_spec(requires[0]) is None:
            raise MissingDependencyError(
                f"quantization={self.quantization!r} needs {requires[0]}, which is not installed. Install it with {requires[1]}."
            )
        if self.host_budget is not None:
            parse_bytes(self.host_budget, "host_budget")
            if self.offload_dir is None:
                raise ConfigError(
                    "host_budget is set but offload_dir is not: experts beyond the host budget are written "
                    "to disk. Pass MiraConfig(host_budget=..., offload_dir='/path/with/space')."
                )
        if self.offload_dir is not None and (not isinstance(self.offload_dir, (str, os.PathLike)) or not str(self.offload_dir)):
            raise ConfigError(
                f"offload_dir={self.offload_dir!r}: give a directory (a str or a path; it is created if missing) where "
                "the experts beyond host_budget are written."
            )
        if self.offload_dir is not None and self.host_budget is None:
            raise ConfigError(
                f"offload_dir={self.offload_dir!r} is where the experts beyond host_budget are written, but host_budget is "
                "not set: every expert stays in host memory, so it would change nothing. Give host_budget (e.g. "
                "host_budget='64GiB') to keep the rest on disk, or leave offload_dir out."
            )
        if self.expert_layer_path is not None and (
            not isinstance(self.expert_layer_path, str) or "." not in self.expert_layer_path
        ):
            raise ConfigError(
                f"expert_layer_path={self.expert_layer_path!r}: expected a module glob such as 'model.layers.*.mlp.experts'."
            )
        nested = dict(
            cache=CacheConfig,
            loader=LoaderConfig,
            heat=HeatConfig,
            priority=PriorityConfig,
            prediction=PredictorConfig,
            quant=QuantConfig,
        )
        for name, cls in nested.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name} must be a {cls.__name__} instance, got {type(getattr(self, name)).__name__}.")
        if self.store_path is not None and self.quantization in (None, "auto"):
            raise ConfigError(
                f"store_path is set but quantization is {self.quantization!r}: a saved store holds records of one format. Pass the quantization "
                "it was saved with, e.g. MiraConfig(quantization='int4', store_path=...)."
            )
        if self.store_path is not None and is_native(self.quantization):
            raise ConfigError(
                f"store_path is set with quantization={self.quantization!r}, a checkpoint's own format: its experts are "
                "served as the checkpoint stores them, so no saved store is read. Leave store_path out."
            )
        if self.host_compute == "on" and self.quantization not in ("auto", None):
            raise ConfigError(
                f"host_compute='on' computes experts from uncompressed records on the host, but quantization="
                f"{self.quantization!r} encodes them. Use quantization=None or 'auto' with it, or host_compute='auto' "
                "(off where records are encoded)."
            )
        if self.host_compute == "split" and self.store_path is not None:
            raise ConfigError(
                "store_path is set with host_compute='split': a saved store holds whole experts' records, and the split "
                "stores each expert's device part (read from the checkpoint at each load). Drop store_path, or use "
                "another host_compute."
            )
        share = self.host_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share < 1.0:
            raise ConfigError(
                f"host_share={share!r}: the share of each expert's neurons computed on the host with "
                "host_compute='split', a number strictly between 0 and 1 (e.g. 0.25)."
            )
        if self.host_compute != "split" and share != MiraConfig.host_share:
            raise ConfigError(
                f"host_share={share!r} is the share of each expert's neurons host_compute='split' computes on the host, "
                f"but host_compute={self.host_compute!r}: it would change nothing. Pass host_compute='split', or leave "
                "host_share out."
            )
        if self.predictor_path is not None and self.predictor in PATHLESS_PREDICTORS:
            raise ConfigError(
                f"predictor_path={self.predictor_path!r} is a calibrated 'learned' predictor's, and "
                f"predictor={spelling(self.predictor)!r} reads no file: it would change nothing. Give predictor='learned' "
                "(or 'auto', which picks it), or leave predictor_path out."
            )
        if self.predictor == "learned" and self.predictor_path is None:
            raise ConfigError(
                "predictor='learned' needs a calibrated predictor: pass predictor_path=<dir written by "
                "model.mira.save_predictor()>, or run mira_hf.calibrate(model, data) on a wrapped model first. "
                "predictor='auto' falls back to 'gate', which needs no training."
            )

    def replace(self, **changes: object) -> MiraConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def gpu_budget_bytes(self) -> int | None:
        """`gpu_budget` given in bytes (an int or a size string), else None (a fraction, or None)."""
        b = self.gpu_budget
        return None if b is None or isinstance(b, float) else parse_bytes(b, "gpu_budget")

    @property
    def host_budget_bytes(self) -> int | None:
        return None if self.host_budget is None else parse_bytes(self.host_budget, "host_budget")


def config_from_arguments(mira_config: MiraConfig | None, keywords: dict, where: str) -> MiraConfig:
    """The `MiraConfig` of a call given either `mira_config=` or MiraConfig's fields as keywords (the
    transformers habit: `from_pretrained(path, gpu_budget=0.25)`). The fields are taken out of `keywords`;
    what is left is not MiraConfig's. Both at once is a `ConfigError`, before anything loads."""
    misplaced = [k for k, v in keywords.items() if isinstance(v, MiraConfig)]
    if misplaced:  # `config=` is transformers' model config: the settings would be lost without a word
        raise ConfigError(
            f"{where} got a MiraConfig as {misplaced[0]}=, which is not where mira-hf reads its settings (config= is "
            f"transformers' model config). Pass it as mira_config= (or second, after the path): "
            f"{where}(path, mira_config=cfg)."
        )
    names = {f.name for f in dataclasses.fields(MiraConfig)}
    given = {k: keywords.pop(k) for k in list(keywords) if k in names}
    if mira_config is None:
        return MiraConfig(**given)
    if not isinstance(mira_config, MiraConfig):
        raise ConfigError(
            f"mira_config must be a MiraConfig, got {type(mira_config).__name__}. Build one, MiraConfig(gpu_budget='12GiB'), "
            f"or pass its fields as keywords: {where}(..., gpu_budget='12GiB')."
        )
    if given:
        shown = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise ConfigError(
            f"{where} got both mira_config and MiraConfig fields as keywords ({shown}). Pass one or the other: "
            f"mira_config=cfg.replace({shown}), or only the keywords."
        )
    return mira_config
