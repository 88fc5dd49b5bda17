"""The experts proxies as opaque operators, so that `torch.compile(model, fullgraph=True)` works.

A proxy cannot be traced: it syncs with the host to learn which experts a block needs, and its manager
holds state (cache slots, copies in flight, counters) that a graph must not capture. Under compilation
each proxy's forward is one call of a custom operator instead; the operator's real implementation finds
the proxy through a handle (a graph holds tensors, not modules) and runs it eagerly. Its fake
implementation gives the output's shape and dtype: those of the hidden states. Tagged
`cudagraph_unsafe`: a CUDA graph cannot replay host syncs and copies whose targets change every step, so
Inductor leaves graphs holding the operator out of CUDA-graph capture ("reduce-overhead" still compiles).
A backward through the operator raises the same error as through the eager proxy.
"""

from __future__ import annotations

import itertools
import os
import secrets
import weakref

import torch
from torch import nn

from .errors import UnsupportedOperationError

_proxies: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()


def _fresh_handles() -> itertools.count:
    """Handles from a random start: a graph exported (`torch.export.save`) in one process and run in another (a forked
    child included) finds no proxy of that process under its handles (a refusal), never another model's experts."""
    return itertools.count(secrets.randbits(48) << 8)


_handles = _fresh_handles()
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _reseed() -> None:
    global _handles
    _handles = _fresh_handles()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reseed)


def register(proxy: nn.Module) -> torch.Tensor:
    """A handle for `proxy` (held weakly: an unloaded model's proxies go away with it): a 0-dim int64 tensor on
    the CPU, which a graph takes as an input like any tensor, where it would take an integer as a constant and
    specialize on it: the decoder layers compiled one by one (`layer.compile()`) then share one graph."""
    handle = next(_handles)
    _proxies[handle] = proxy
    return torch.tensor(handle)


def _served(handle: torch.Tensor, autocast_dtype: torch.dtype | None, hidden_states: torch.Tensor, *routing) -> torch.Tensor:
    """The proxy's `serve(hidden_states, *routing)`, under the caller's autocast where it ran under one (a compiled
    graph calls the operators outside it), one block at a time (a graph runs without the step hooks)."""
    proxy = _proxies.get(int(handle))  # a CPU scalar: no device sync
    if proxy is None or proxy.manager.closed:
        raise UnsupportedOperationError(
            "this graph calls the experts of a mira-hf model that is no longer wrapped in this process: it was "
            "unloaded (model.unload()) or dropped after the graph was compiled or exported, or the graph was exported "
            "(torch.export) from another process. Compile or export the wrapped model in the process that runs it, "
            "after wrapping; an unloaded model runs its own experts modules again when called itself."
        )
    with proxy.manager.turn():
        if autocast_dtype is None:
            return proxy.serve(hidden_states, *routing)
        with torch.autocast(hidden_states.device.type, dtype=autocast_dtype):
            return proxy.serve(hidden_states, *routing)


@torch.library.custom_op("mira::experts", mutates_args=(), tags=_TAGS)
def experts(
    handle: torch.Tensor,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`MiraExperts.serve`: hidden [T, H], top-k index and weights [T, K] -> [T, H]. `autocast_dtype`: the caller's
    autocast, under which the experts' matmuls run, as the module's do (the output keeps the hidden states' dtype, as
    the experts implementations give it)."""
    return _served(handle, autocast_dtype, hidden_states, top_k_index, top_k_weights)


@experts.register_fake
def _(handle: torch.Tensor, hidden_states: torch.Tensor, *routing_and_autocast) -> torch.Tensor:
    return torch.empty_like(hidden_states)


@torch.library.custom_op("mira::scaled_experts", mutates_args=(), tags=_TAGS)
def scaled_experts(handle: torch.Tensor, hidden_states: torch.Tensor, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`MiraScaledExperts.serve`: input-scaled rows [E*T, H] -> [E*T, H]. `autocast_dtype`: the caller's autocast,
    whose dtype the experts' matmuls give, as the module's `bmm` does under autocast."""
    return _served(handle, autocast_dtype, hidden_states)


@scaled_experts.register_fake
def _(handle: torch.Tensor, hidden_states: torch.Tensor, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty_like(hidden_states, dtype=autocast_dtype or hidden_states.dtype)


def no_backward(grad: torch.Tensor) -> torch.Tensor:
    raise UnsupportedOperationError(
        "backward through mira-hf's offloaded experts is not supported: an expert's weights live in a cache slot "
        "that later copies overwrite, so they are gone when the backward pass needs them. mira-hf serves inference "
        "(generate, or forward under torch.no_grad()). To train or take gradients, load the model without mira-hf "
        "(or call model.unload() first)."
    )


@torch.library.custom_op("mira::refuse_backward", mutates_args=())
def refuse_backward(grad: torch.Tensor) -> torch.Tensor:
    """Raises the eager proxy's refusal when a backward reaches the experts. An operator rather than a
    Python raise: AOTAutograd traces the backward while compiling a forward with autograd on, and the
    forward itself must still work then (as it does eagerly)."""
    return no_backward(grad)


@refuse_backward.register_fake
def _(grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(grad)


@torch.library.custom_op("mira::refuse_backward_like", mutates_args=())
def refuse_backward_like(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The refusal, as the gradient of an expert parameter `like` (`RefuseBackward`): a gradient a compiled backward
    must compute, so it keeps the operator where it would drop one whose result nothing reads."""
    return no_backward(grad)


@refuse_backward_like.register_fake
def _(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(like)


class RefuseBackward(torch.autograd.Function):
    """`result` unchanged, made to require gradients through `anchor` (an expert parameter that asks for them): a
    backward that reaches it raises the refusal, where the experts' gradients would otherwise stay silently None
    (the experts compute from cache slots, which autograd does not see)."""

    @staticmethod
    def forward(ctx, result: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(anchor)
        return result.view_as(result)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (anchor,) = ctx.saved_tensors
        return torch.ops.mira.refuse_backward(grad), torch.ops.mira.refuse_backward_like(grad, anchor)


experts.register_autograd(lambda ctx, grad: (None, torch.ops.mira.refuse_backward(grad), None, None, None))
scaled_experts.register_autograd(lambda ctx, grad: (None, torch.ops.mira.refuse_backward(grad), None))
