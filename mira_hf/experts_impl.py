"""The arithmetic of transformers' experts implementations, reproduced on served experts.

transformers runs a fused experts module through the implementation named by
`config._experts_implementation`, read at every call: "grouped_mm" (the default), "batched_mm" (which
`generate()` puts in place of "grouped_mm" while decoding on a GPU) or "eager" (the module's own loop).
The maths is the same; the arithmetic is not, and in bf16/fp16 the bits differ:

* grouped_mm and batched_mm weight each (token, slot) row with `rows * weights` (dtype promotion as it
  comes: bf16 x bf16 stays bf16 where the router gives weights in the hidden dtype, bf16 x fp32 is fp32
  where it gives fp32) and sum the K rows of a token with one `sum(dim=1)`;
* eager adds each expert's weighted rows, cast to the accumulator's dtype, into a zero accumulator, one
  expert after the other in ascending expert order (one rounding per add). The accumulator has the hidden
  states' dtype, except in the loops that allocate it in the routing weights' dtype (NemotronH's before
  transformers 5.25): `eager_arithmetic` reads which, off the module's own forward, and whether the loop computes
  in fp32 throughout (OpenAI Privacy Filter's);
* grouped_mm multiplies each expert's rows by its weight with a grouped matmul (on the CPU, and on the GPU
  for dtypes without a grouped kernel, one `mm` per expert, which is what `F.linear` computes); batched_mm
  multiplies every row by its own copy of its expert's weights with one `bmm` (whose bits may differ from
  `mm`, e.g. fp32 on the CPU).

`MiraExperts` reads the implementation at each call, as transformers' decorator does, and computes as it
would. Implementations that read the module's fused tensors with their own kernels (deepgemm, sonicmoe,
an FP8 kernel, a name registered by the user) cannot run on experts that live in a host store: they are
refused when the model is wrapped, when the implementation is set, and at the call.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .errors import ConfigError, UnsupportedOperationError

SUPPORTED = ("grouped_mm", "batched_mm", "eager")


def implementation_of(base: nn.Module) -> str:
    """The implementation transformers would run `base` (an original experts module) with now. A module
    not built by transformers' decorator (which sets `is_concatenated` on each instance), or one without
    a config, runs its own forward: "eager"."""
    name = getattr(getattr(base, "config", None), "_experts_implementation", None)
    return "eager" if name is None or not hasattr(base, "is_concatenated") else name


def _refusal(name: object, when: str) -> str:
    return (
        f"experts_implementation={name!r} {when}, but mira-hf serves the routed experts from its own store and "
        f"computes them as transformers' {', '.join(repr(s) for s in SUPPORTED)} do (bit for bit). Other "
        "implementations (deepgemm, sonicmoe, FP8 kernels, ones registered with ExpertsInterface) read the "
        "module's fused expert tensors, which are not in the model. Use one of those three: "
        "model.set_experts_implementation('grouped_mm') (the default), or load without experts_implementation."
    )


def check_model_implementations(model: nn.Module) -> None:
    """Refuse a model set to an implementation mira-hf cannot reproduce (before anything changes)."""
    configs = [getattr(model, "config", None)]
    configs += [getattr(configs[0], key, None) for key in getattr(configs[0], "sub_configs", {})]
    for config in configs:
        name = getattr(config, "_experts_implementation", None)
        if name is not None and name not in SUPPORTED:
            raise ConfigError(_refusal(name, f"is set on {type(model).__name__}"))


def checked_set_experts_implementation(model: nn.Module, experts_implementation: str | dict) -> None:
    """`model.set_experts_implementation` of a wrapped model (bound per instance): refuse what mira-hf
    cannot compute, before transformers changes anything, then set it as transformers does."""
    names = experts_implementation.values() if isinstance(experts_implementation, dict) else [experts_implementation]
    for name in names:
        if name not in SUPPORTED:
            raise ConfigError(_refusal(name, "was requested for a model wrapped by mira-hf"))
    type(model).set_experts_implementation(model, experts_implementation)


def check_call(name: str) -> None:
    """At a call: refuse an implementation set behind `set_experts_implementation`'s back."""
    if name not in SUPPORTED:
        raise UnsupportedOperationError(_refusal(name, "is set in the model's config"))


# The probes of `eager_arithmetic`, each one bf16 token through two experts of width one (hidden size 1):
# - the sum's dtype: both rows exactly 1, weighted 1 and 2^-8 + 2^-20 in fp32. Summed in fp32 and rounded once to
#   bf16: 1 + 2^-7. Summed in bf16, the second row rounds to 2^-8 first and 1 + 2^-8 ties to even: 1.
# - the matmuls' dtype: expert 0 computes (1 + 2^-7) * (1 + 2^-7) = 1 + 2^-6 + 2^-14 in its down projection, expert
#   1 gives -(1 + 2^-6); both weighted 1. In fp32 throughout they sum to 2^-14; a bf16 down projection rounds
#   expert 0's row to 1 + 2^-6 first, and the sum is 0.
_PROBE_WEIGHTS = (1.0, 2.0**-8 + 2.0**-20)
_PROBE_SUM_IN_WEIGHTS_DTYPE = 1.0 + 2.0**-7
_PROBE_MATMULS = ((1.0 + 2.0**-7, 1.0 + 2.0**-7), (1.0 + 2.0**-6, -1.0))  # per expert: (gate weight, down weight)
_PROBE_MATMULS_IN_FP32 = 2.0**-14


def eager_arithmetic(base: nn.Module, flags: dict[str, bool]) -> str:
    """How the eager forward of `base` (an original experts module built by transformers' decorator) computes in
    bf16 and fp16: "hidden" (matmuls in the weights' dtype, the weighted rows added into an accumulator of the hidden
    states' dtype: transformers' template, every family but those below); "weights" (the same matmuls, added into an
    accumulator of the routing weights' dtype, cast to the hidden dtype at the end: NemotronH before transformers
    5.25); "fp32" (every matmul, the gate and the sum in fp32, cast to the hidden dtype at the end: OpenAI Privacy
    Filter).

    Read off the module's own loop once, when it is wrapped, not from a list of classes or versions: the loop of
    `type(base)` runs on a stand-in with `base`'s attributes and two experts of width one whose weights are chosen so
    that each arithmetic gives another result (`_PROBE_WEIGHTS`, `_PROBE_MATMULS`). `flags`: `base`'s resolved
    layout flags (`proxy.LAYOUT_FLAGS`). A module not built by the decorator, or whose loop gives another result on
    the stand-in, computes as the decorator's template does: "hidden"."""
    cls = type(base)
    if not hasattr(base, "is_concatenated") or not hasattr(cls.forward, "__wrapped__"):
        return "hidden"
    if _probe(base, flags, _PROBE_MATMULS, (1.0, 1.0)) == _PROBE_MATMULS_IN_FP32:
        return "fp32"  # (first: a loop in fp32 sums in fp32 too, which the second probe reads as "weights")
    if _probe(base, flags, ((1.0, 1.0), (1.0, 1.0)), _PROBE_WEIGHTS) == _PROBE_SUM_IN_WEIGHTS_DTYPE:
        return "weights"
    return "hidden"


def _probe(base: nn.Module, flags: dict[str, bool], experts: tuple, weights: tuple) -> float | None:
    """The loop of `type(base)` on one bf16 token of hidden size 1 (exactly 1) routed to two experts of width one,
    expert e with gate weight `experts[e][0]`, up weight 1 and down weight `experts[e][1]`, gate function gate * up,
    routing weights `weights` in fp32: its output, or None where the loop does not run on the stand-in."""
    cls = type(base)
    loop = cls.forward.__wrapped__  # the class's own forward, behind the decorator's dispatch on the config
    probe = cls.__new__(cls)  # a throwaway instance: `base` and its class are left as they are
    nn.Module.__init__(probe)
    probe.__dict__.update({k: v for k, v in vars(base).items() if not k.startswith("_") and not isinstance(v, nn.Module)})
    probe.num_experts, probe.has_post_expert_norm, probe.act_fn = 2, False, nn.Identity()

    def gate_times_up(h: torch.Tensor) -> torch.Tensor:  # whatever the family's own gate
        gate, up = h.chunk(2, dim=-1)
        return gate * up

    probe._apply_gate = gate_times_up
    bf16 = dict(dtype=torch.bfloat16)
    if flags["has_gate"]:
        up, w_up = "gate_up_proj", torch.tensor([[[g], [1.0]] for g, _ in experts], **bf16)  # [E, 2I, H], I = H = 1
    else:  # no gate: the activation (identity here) of the up projection, which takes the gate weight
        up, w_up = "up_proj", torch.tensor([[[g]] for g, _ in experts], **bf16)  # [E, I, H]
    setattr(probe, up, w_up.transpose(1, 2) if flags["is_transposed"] else w_up)
    probe.down_proj = torch.tensor([[[d]] for _, d in experts], **bf16)  # [E, H, I]
    if flags["has_bias"]:
        setattr(probe, up + "_bias", torch.zeros(2, w_up.shape[1], **bf16))
        probe.down_proj_bias = torch.zeros(2, 1, **bf16)
    hidden = torch.ones(1, 1, **bf16)  # [T, H]
    top_k_index = torch.tensor([[0, 1]])  # [T, K]
    top_k_weights = torch.tensor([weights], dtype=torch.float32)  # [T, K]
    try:
        with torch.no_grad():
            out = loop(probe, hidden, top_k_index, top_k_weights)  # [T, H]
    except Exception:  # a loop that needs more than the stand-in has is not one looked for: the template's arithmetic
        return None  # (every transformers family runs on the stand-in; a raise here would stop a wrap halfway)
    return out.item() if isinstance(out, torch.Tensor) and out.numel() == 1 else None


def combine(
    parts: torch.Tensor, top_k_index: torch.Tensor, implementation: str, hidden_dtype: torch.dtype, eager_dtype: torch.dtype
) -> torch.Tensor:
    """Sum each token's K weighted rows as `implementation` does. `parts` [T*K, H]: row t*K + k is the
    output of token t's k-th expert times its weight (zero for the expert-parallel sentinel), in the
    dtype `rows * weights` promotes to. Returns [T, H] in `hidden_dtype`."""
    T, K = top_k_index.shape
    H = parts.shape[-1]
    if implementation != "eager":
        return parts.view(T, K, H).sum(dim=1).to(hidden_dtype)  # [T, H]
    parts = parts.to(eager_dtype).view(T, K, H)
    if K > 1:  # eager adds experts in ascending expert order
        by_expert = top_k_index.argsort(dim=1)  # [T, K]
        parts = parts.gather(1, by_expert.unsqueeze(-1).expand(T, K, H))
    acc = parts.new_zeros((T, H))  # [T, H]
    for k in range(K):
        acc += parts[:, k]  # one rounding per add, as index_add_ into the accumulator
    return acc.to(hidden_dtype)


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, transposed: bool, offs: torch.Tensor | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows x [n, in] through transformers' grouped matmul: on a GPU the unwrapped model multiplies with
    torch's grouped kernel, whose bits may differ from cuBLAS's `mm`. One expert's rows as one group
    (`weight` [out, in], [in, out] if `transposed`), or, with `offs` [G] (cumulative rows per group), the
    rows of group g through `weight[g]` ([G, out, in]) and `bias` [n, out] added per row. Returns [n, out]."""
    from transformers.integrations.moe import _grouped_linear

    if offs is None:  # one group of every row (a tensor subclass, as a tracer's fake one, gets its own fill)
        offs = _one_group(x.shape[0], x.device) if type(x) is torch.Tensor else _fill(x.shape[0], x.device)
        weight = weight.unsqueeze(0)
    return _grouped_linear(x, weight, offs, bias=bias, is_transposed=transposed)


@functools.lru_cache(maxsize=256)
def _one_group(rows: int, device: torch.device) -> torch.Tensor:
    """The offsets [1] of one group of `rows` rows on `device`, made once and only ever read: each expert's two
    projections would otherwise launch a fill each (decode uses a handful of row counts). A normal tensor, also when
    first made under `torch.inference_mode()`, so a forward outside it may read it too."""
    with torch.inference_mode(False):
        return _fill(rows, device)


def _fill(rows: int, device: torch.device) -> torch.Tensor:
    return torch.full((1,), rows, dtype=torch.int32, device=device)  # a fill: no host copy, no sync


# batched_mm's `bmm` rounds a row alike in calls of 4, 8 and 16 rows as in one call of 8, 16, 32, 64 or 128 rows, at
# the expert shapes of Mixtral, Qwen3-30B-A3B and gpt-oss in bf16 and fp32, with the same bits on an H100 and an H200
# (on the CPU: tests/test_grouped_slots.py). Not so in calls of one to three rows (cuBLAS takes other code for so few
# batch elements, a last chunk of one or two rows included), for experts kept transposed ([n, in, out], `x @ w` per
# row: fp32 differed in chunks of every size; they stay one call, MiraExperts._batched), nor for tiny experts (64 x
# 128) even in chunks of 4, which the bound below never chunks. Measured: benchmarks/batched_mm_probe.py,
# `2026-12-05-nvidia-h200-batched-mm-probe.json`, `2026-12-05-nvidia-h100-80gb-hbm3-batched-mm-probe.json`. Blocks of
# other row counts are one call, as the unwrapped model's.
BMM_CHUNK_ROWS = (16, 8, 4)
BMM_SPLIT_ROWS = frozenset({8, 16, 32, 64, 128})
# A block's gathered weights above this many bytes are computed in chunks (the unwrapped model gathers every row's
# copy at once: 16 copies of a 352 MB Mixtral expert at batch 8).
BATCHED_CALL_BYTES = 1 << 30


def batched_rows(rows: int, row_bytes: int) -> list[slice]:
    """The chunks of a block's `rows` rows that batched_mm's products are computed in, each row's weights
    `row_bytes`: one call where their copies fit in BATCHED_CALL_BYTES or the block's row count is not one whose
    rows were measured to round alike in chunks (BMM_SPLIT_ROWS); else the largest chunk of BMM_CHUNK_ROWS rows that
    fits (the smallest where none does)."""
    if rows * row_bytes <= BATCHED_CALL_BYTES or rows not in BMM_SPLIT_ROWS:
        return [slice(0, rows)]
    step = next((c for c in BMM_CHUNK_ROWS if c < rows and c * row_bytes <= BATCHED_CALL_BYTES), BMM_CHUNK_ROWS[-1])
    return [slice(a, a + step) for a in range(0, rows, step)]


def batched_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """Every row x [S, in] by its own weights [S, out, in] ([S, in, out] if `transposed`), as batched_mm does."""
    from transformers.integrations.moe import _batched_linear

    return _batched_linear(x, weight, bias=bias, is_transposed=transposed)
