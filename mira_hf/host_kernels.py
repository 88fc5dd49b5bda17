"""Host matmuls on weights laid out once for the CPU's matrix kernels.

torch multiplies a bf16 weight on the CPU through oneDNN, which lays the plain [out, in] weight out in its blocked
format at every call: on the H200 machine's host (AMX) an expert's bf16 SwiGLU at one row reads its weights at
about half the memory's speed, the same weights widened to fp32 at the memory's full speed
(`benchmarks/host_kernel_probe.py`; benchmarks/NOTES.md, "Host compute"). A weight laid out once
(`torch.ops.mkldnn._reorder_linear_weight`, as torch's compiler does for frozen CPU models) skips that work at
every call. The host parts of `host_compute="split"` are read at every use, so they are laid out once at load
(`neuron_split.HostParts`); the plain tensors stay too (copies to the device, state dict, casts).

Where torch's CPU build or the CPU lacks the kernels for a dtype (bf16 needs AVX-512 or AVX-NE-CONVERT),
`can_prepack` says so and the plain weights are used.
"""

from __future__ import annotations

import functools

import torch

# Dtypes whose weights are laid out once where the CPU can: those oneDNN lays out at every call. fp32 runs
# through the CPU's BLAS on plain weights at the memory's speed already.
PREPACKED_DTYPES = (torch.bfloat16,)


class PrepackedLinear:
    """A weight [out, in] in oneDNN's layout: `self(x)` is `x @ weight.T` for rows x [n, in] of its dtype."""

    __slots__ = ("packed", "nbytes")

    def __init__(self, weight: torch.Tensor, rows_hint: int = 1) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows_hint)
        self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


@functools.cache
def can_prepack(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU lay out and multiply `dtype` weights (checked once per dtype)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(16, 16, dtype=dtype)
        y = PrepackedLinear(w)(torch.ones(1, 16, dtype=dtype))
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(y, torch.full((1, 16), 16.0, dtype=dtype)))


def prepacks(dtype: torch.dtype) -> bool:
    """Whether host parts of `dtype` are laid out once: a dtype oneDNN lays out per call, on a CPU that can."""
    return dtype in PREPACKED_DTYPES and can_prepack(dtype)


def host_linear(x: torch.Tensor, weight, transposed: bool) -> torch.Tensor:
    """x [n, in] times a host weight: a `PrepackedLinear`, or a plain tensor ([in, out] when `transposed`, else
    [out, in]) -> [n, out]."""
    if isinstance(weight, PrepackedLinear):
        return weight(x)
    return x @ weight if transposed else torch.nn.functional.linear(x, weight)
