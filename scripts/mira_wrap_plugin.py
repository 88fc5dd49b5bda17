"""pytest plugin (test tooling, not part of mira_hf): every transformers model a test builds is wrapped by
`MiraMoEModel.wrap(model, MiraConfig(gpu_budget=0.25, device="cpu"))` right after it is built.

Loaded only with `-p mira_wrap_plugin` (scripts/run_transformers_tests.py does so for its wrapped runs), so the
hooks below exist only inside that pytest process:

* a model built by its constructor (`Model(config)`, `from_config`) is wrapped when its outermost
  `post_init()` returns: a causal LM builds its base model inside its own `__init__`, and only the outer
  one is wrapped, once its construction is complete;
* a model loaded by `from_pretrained` is wrapped after its weights are loaded (wrapping inside the loader
  would see weights not loaded yet).

A model whose minimum working set is above that budget is served at that minimum (a fraction is raised to it, with a
warning); `MIRA_WRAP_FALLBACK_BUDGET` names a budget to wrap with should `BudgetError` still be raised. A model with no routed-experts module (`UnsupportedModelError`) or weights left on the meta device is left as
it is and counted; any other wrapping error propagates, so the test fails with it. At the end of the session the
counts are written as JSON to the path in `MIRA_WRAP_STATS` (if set).
"""

from __future__ import annotations

import functools
import json
import os
import threading

import pytest
from transformers import PreTrainedModel

from mira_hf import MiraConfig, MiraMoEModel
from mira_hf.errors import BudgetError, UnsupportedModelError

# MIRA_WRAP_QUANTIZATION=lossless: the records in that transfer format (the default: "auto", as the library's)
_quantization = os.environ.get("MIRA_WRAP_QUANTIZATION", "auto")
MIRA_CONFIG = MiraConfig(gpu_budget=0.25, device="cpu", quantization=_quantization)
# MIRA_WRAP_FALLBACK_BUDGET=1.0: a model whose minimum working set is above 0.25 (a test config routing each
# token to most of its experts) is wrapped with that budget instead of failing its test with BudgetError.
_fallback = os.environ.get("MIRA_WRAP_FALLBACK_BUDGET")
FALLBACK_CONFIG = MiraConfig(gpu_budget=float(_fallback), device="cpu", quantization=_quantization) if _fallback else None

_state = threading.local()
_stats = {"wrapped": 0, "wrapped_with_fallback_budget": 0, "not_wrapped": 0, "not_wrapped_reasons": {}}
_originals: dict[str, object] = {}


def _get(name: str) -> int:
    return getattr(_state, name, 0)


def _wrap(model):
    if not isinstance(model, PreTrainedModel) or hasattr(model, "mira"):
        return model
    try:
        try:
            MiraMoEModel.wrap(model, MIRA_CONFIG)
        except BudgetError:
            if FALLBACK_CONFIG is None:
                raise
            MiraMoEModel.wrap(model, FALLBACK_CONFIG)  # refused before anything changed: the model is intact
            _stats["wrapped_with_fallback_budget"] += 1
    except UnsupportedModelError as exc:
        _stats["not_wrapped"] += 1
        reason = str(exc).split(":")[1].strip()[:120] if ":" in str(exc) else str(exc)[:120]
        _stats["not_wrapped_reasons"][reason] = _stats["not_wrapped_reasons"].get(reason, 0) + 1
        return model
    _stats["wrapped"] += 1
    return model


def _init(orig):
    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        _state.depth = _get("depth") + 1  # a model's construction starts; its post_init() ends it
        return orig(self, *args, **kwargs)

    return __init__


def _post_init(orig):
    @functools.wraps(orig)
    def post_init(self, *args, **kwargs):
        result = orig(self, *args, **kwargs)
        _state.depth = max(_get("depth") - 1, 0)
        if _get("depth") == 0 and _get("loading") == 0:
            _wrap(self)
        return result

    return post_init


def _from_pretrained(orig):
    @functools.wraps(orig.__func__)
    def from_pretrained(cls, *args, **kwargs):
        _state.loading = _get("loading") + 1
        try:
            result = orig.__func__(cls, *args, **kwargs)
        finally:
            _state.loading -= 1
        if _get("loading") == 0:
            _wrap(result[0] if isinstance(result, tuple) else result)
        return result

    return classmethod(from_pretrained)


def pytest_configure(config):
    _originals.update(
        __init__=PreTrainedModel.__init__,
        post_init=PreTrainedModel.post_init,
        from_pretrained=PreTrainedModel.__dict__["from_pretrained"],
    )
    PreTrainedModel.__init__ = _init(_originals["__init__"])
    PreTrainedModel.post_init = _post_init(_originals["post_init"])
    PreTrainedModel.from_pretrained = _from_pretrained(_originals["from_pretrained"])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _state.depth = _state.loading = 0  # a construction that raised before post_init() leaves no count behind


def pytest_unconfigure(config):
    for name, value in _originals.items():
        setattr(PreTrainedModel, name, value)
    path = os.environ.get("MIRA_WRAP_STATS")
    if path:
        with open(path, "w") as f:
            json.dump(_stats, f, indent=1)
