"""The wrapped model's forward hooks: each forward is a step of the manager (its heat clock, serialised threads).

They sit on the model and on the modules code calls in its place: its base model (`model.model`, which a direct
`model.forward(...)` calls too), `get_decoder()`'s and `get_encoder()`'s. A call of any of them is a step; a call of
one from inside another's forward is part of that step (a depth count per thread), so one forward is one step
whichever module it was called through."""

from __future__ import annotations

import functools
import sys
import threading
import weakref

import torch
from torch import nn

from .manager import ExpertManager

# the frames of a module's call (`module(...)`): a module whose call is on the stack is running its forward
_CALL_CODES = frozenset(f.__code__ for f in (nn.Module._call_impl, nn.Module._wrapped_call_impl))


def on_stack(codes: frozenset, module: nn.Module | None = None, frame=None) -> bool:
    """Whether a frame of one of `codes` (code objects) is on this thread's stack (or from `frame` down another's);
    with `module`, one whose `self` is that module."""
    frame = sys._getframe(1) if frame is None else frame
    while frame is not None:
        if frame.f_code in codes and (module is None or frame.f_locals.get("self") is module):
            return True
        frame = frame.f_back
    return False


def running(module: nn.Module | None) -> bool:
    """Whether a call of `module` is on this thread's stack (its forward runs, around the caller)."""
    return module is not None and on_stack(_CALL_CODES, module)


def running_in(module: weakref.ref, thread: int) -> bool:
    """Whether a call of `module` is on thread `thread`'s stack (False where the thread has ended or the module is
    gone): whether that thread's step is still running."""
    frame, target = sys._current_frames().get(thread), module()
    return frame is not None and target is not None and on_stack(_CALL_CODES, target, frame)


class StepHooks:
    """The model's forward hooks: a forward step starts and ends for the manager. Bound methods of an
    object rather than lambdas, so that copying or pickling a wrapped model reaches the manager's clear
    refusal instead of failing on a lambda."""

    def __init__(self, manager: ExpertManager) -> None:
        self.manager = manager
        self.edited = None  # () -> None, run once the step has the model: experts changed in place (`ExpertState`)
        self._local = threading.local()  # this thread's step: (a weak reference to its outermost module, depth)

    # In a compiled graph the hooks are left out (fullgraph allows no break): the manager then finds step
    # boundaries from the order of its blocks (`ExpertManager.begin`), and threads take turns per block
    # (`ExpertManager.turn`).
    def before(self, module, args, kwargs) -> None:
        if not torch.compiler.is_compiling():
            outer, depth = getattr(self._local, "step", (None, 0))
            if depth and outer() is not module and running(outer()):  # called from the forward of the step's module
                self._local.step = (outer, depth + 1)
                return
            # a new step; or the same thread's step left open by an interrupt (KeyboardInterrupt skips the forward
            # hooks; its module's call is no longer on the stack), which `enter_forward` ends
            self._local.step = (None, 0)
            self._enter(module, args, kwargs)
            # weakly: a step left open by an interrupt does not keep a model its user dropped
            self._local.step = (weakref.ref(module), 1)

    def after(self, module, args, output) -> None:
        if not torch.compiler.is_compiling():
            outer, depth = getattr(self._local, "step", (None, 0))
            if depth > 1:
                self._local.step = (outer, depth - 1)
            elif depth == 1:
                self._local.step = (None, 0)
                self._exit()

    @torch.compiler.disable
    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        running = functools.partial(running_in, weakref.ref(module))
        self.manager.enter_forward(_starts_sequence(kwargs), _sequences(args, kwargs), running)
        if self.edited is not None:
            try:
                self.edited()
            except BaseException:
                self.manager.exit_forward()  # the step ends here; the forward hook's exit then finds none to end
                raise

    @torch.compiler.disable
    def _exit(self) -> None:
        self.manager.exit_forward()


def _starts_sequence(kwargs: dict) -> bool:
    """Whether a forward starts a new sequence: no KV cache yet, or an empty one (no device sync)."""
    cache = kwargs.get("past_key_values", kwargs.get("cache"))  # the name changed within transformers 5.x
    if cache is None:
        return True
    length = getattr(cache, "get_seq_length", None)
    return length is not None and length() == 0


def _sequences(args: tuple, kwargs: dict) -> int:
    """How many sequences the forward's inputs hold (their first dimension; 1 where none is given as a tensor)."""
    for x in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None):
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            return int(x.shape[0])
    return 1
