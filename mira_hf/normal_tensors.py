"""What mira-hf builds and keeps is made of normal tensors, whatever autograd mode its caller is in.

A tensor allocated under `torch.inference_mode()` is an inference tensor for good: outside that mode nothing may
write into it (`copy_`, `mul_`) nor make it a parameter that requires grad. The expert store, the device arena and
its slots, the typed views of both and the expert parameters outlive the call that builds them (a wrap, a cast, a
`load_state_dict`, an in-place edit found at the next forward), and later forwards and edits run in any mode: so
everything that builds them runs through `builds_normal_tensors`, as the unwrapped model's tensors stay normal
whatever mode they were loaded or edited in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def builds_normal_tensors(fn: F) -> F:
    """`fn` run outside inference mode and without autograd (nothing it builds is part of a graph)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.inference_mode(False), torch.no_grad():
            return fn(*args, **kwargs)

    return run
