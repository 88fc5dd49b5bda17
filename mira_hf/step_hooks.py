"""The wrapped model's forward hooks: each forward is a step of the manager (its heat clock, serialised threads)."""

from __future__ import annotations

import torch

from .manager import ExpertManager


class StepHooks:
    """The model's forward hooks: a forward step starts and ends for the manager. Bound methods of an
    object rather than lambdas, so that copying or pickling a wrapped model reaches the manager's clear
    refusal instead of failing on a lambda."""

    def __init__(self, manager: ExpertManager) -> None:
        self.manager = manager
        self.edited = None  # () -> None, run once the step has the model: experts changed in place (`ExpertState`)

    # In a compiled graph the hooks are left out (fullgraph allows no break): the manager then finds step
    # boundaries from the order of its blocks (`ExpertManager.begin`), and steps are not serialised.
    def before(self, module, args, kwargs) -> None:
        if not torch.compiler.is_compiling():
            self._enter(args, kwargs)

    def after(self, module, args, output) -> None:
        if not torch.compiler.is_compiling():
            self._exit()

    @torch.compiler.disable
    def _enter(self, args: tuple, kwargs: dict) -> None:
        self.manager.enter_forward(_starts_sequence(kwargs), _sequences(args, kwargs))
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
