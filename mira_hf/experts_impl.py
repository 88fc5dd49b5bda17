"""The arithmetic of transformers' experts implementations, reproduced on served experts.

transformers runs a fused experts module through the implementation named by
`config._experts_implementation`, read at every call: "grouped_mm" (the default), "batched_mm" (which
`generate()` puts in place of "grouped_mm" while decoding on a GPU) or "eager" (the module's own loop).
The maths is the same; the arithmetic is not, and in bf16/fp16 the bits differ:

* grouped_mm and batched_mm weight each (token, slot) row with `rows * weights` (dtype promotion as it
  comes: bf16 x bf16 stays bf16 where the router gives weights in the hidden dtype, bf16 x fp32 is fp32
  where it gives fp32) and sum the K rows of a token with one `sum(dim=1)`;
* eager adds each expert's weighted rows, cast to the accumulator's dtype, into a zero accumulator, one
  expert after the other in ascending expert order (one rounding per add);
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

import torch
from torch import nn

from .errors import ConfigError, UnsupportedOperationError

SUPPORTED = ("grouped_mm", "batched_mm", "eager")

# Experts classes whose eager forward accumulates in the routing weights' dtype rather than the hidden
# states' (`zeros_like(hidden_states, dtype=top_k_weights.dtype)`, cast back at the end).
EAGER_SUMS_IN_WEIGHTS_DTYPE = frozenset({"NemotronHExperts"})


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


def sum_dtype(base: nn.Module, hidden_dtype: torch.dtype, weights_dtype: torch.dtype) -> torch.dtype:
    """The dtype eager accumulates the experts' weighted rows in."""
    return weights_dtype if type(base).__name__ in EAGER_SUMS_IN_WEIGHTS_DTYPE else hidden_dtype


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

    if offs is None:
        offs = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)  # a fill: no host copy, no sync
        weight = weight.unsqueeze(0)
    return _grouped_linear(x, weight, offs, bias=bias, is_transposed=transposed)


def batched_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """Every row x [S, in] by its own weights [S, out, in] ([S, in, out] if `transposed`), as batched_mm does."""
    from transformers.integrations.moe import _batched_linear

    return _batched_linear(x, weight, bias=bias, is_transposed=transposed)
