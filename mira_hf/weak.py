"""Links that do not keep what they point at alive.

A wrapped model owns its manager, its expert state and its proxies. Where one of those calls back into the
model (a method kept on the instance, a module's `_apply`, a check run at each step), a strong reference would
close a cycle that only Python's garbage collector frees; `del model` would keep the host store, the device cache
and the host worker thread until a collection happens to run. These links go one way, so reference counting
frees a dropped model at once, as it frees the unwrapped one.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

from .errors import UnsupportedOperationError


def bound_weakly(fn: Callable, obj: object) -> Callable:
    """`fn` bound to `obj` (`fn(obj, ...)`), holding `obj` weakly: a method kept on an instance or a callback of an
    object `obj` owns. Called once `obj` is gone (a method taken from a model no variable holds, as in
    `MiraMoEModel.from_pretrained(...).unload()`: the model is dropped before the call), it raises
    `UnsupportedOperationError` saying so."""
    ref = weakref.ref(obj)

    @functools.wraps(fn)
    def method(*args, **kwargs):
        target = ref()
        if target is None:
            raise UnsupportedOperationError(
                f"{fn.__name__}() was called on a model that nothing holds any more: it was dropped before the call "
                f"(an expression such as MiraMoEModel.from_pretrained(...).{fn.__name__}(...)). Keep the model in a "
                f"variable first (model = MiraMoEModel.from_pretrained(...)), then call model.{fn.__name__}(...)."
            )
        return fn(target, *args, **kwargs)

    return method


def weak_method(method) -> Callable:
    """The bound method `method` (`obj.name`), holding its object weakly (`bound_weakly`)."""
    return bound_weakly(method.__func__, method.__self__)
