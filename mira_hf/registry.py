"""Registries of the runtime's extension points: predictors and eviction policies, by name.

Each predictor or policy registers itself (`register_predictor`, `register_policy`) beside its code;
`MiraConfig` validates names against these registries and the manager builds from them, so adding
one never edits the library. The built-ins are known by name before their modules are imported (a
config is validated without importing torch): each built-in name maps to the module that registers
it, imported on first use. This module imports nothing of the package but its errors.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class Entry:
    """One registered name: what builds it, and what it needs (`uses_routers`: the model's routers;
    `uses_hidden`: the hidden states of each block; `needs_path`: a file made by calibration)."""

    name: str
    factory: Callable
    uses_routers: bool = False
    uses_hidden: bool = False
    needs_path: bool = False


class Registry:
    """Names -> `Entry`. Duplicate names are refused; `builtins` maps the package's own names to the
    module that registers each (imported when the name is first looked up)."""

    def __init__(self, kind: str, builtins: dict[str, str]) -> None:
        self.kind = kind
        self._builtins = dict(builtins)
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, factory: Callable, **needs: bool) -> None:
        if not isinstance(name, str) or not name or name != name.strip().lower() or name == "none":
            raise ConfigError(f"{self.kind} name {name!r}: give a lower-case name other than 'none'.")
        if name in self._builtins and name not in self._entries:
            # a built-in's name: its module registers it first (while that module is being imported this
            # returns it as it stands, so its own registration goes through)
            importlib.import_module(self._builtins[name])
        if name in self._entries:
            raise ConfigError(f"a {self.kind} named {name!r} is already registered; pick another name (or unregister it first).")
        if not callable(factory):
            raise ConfigError(f"register_{self.kind}({name!r}, ...): the factory must be callable, got {type(factory).__name__}.")
        self._entries[name] = Entry(name, factory, **needs)

    def unregister(self, name: str) -> None:
        """Forget a registered name (`MiraConfig` refuses it from then on)."""
        if name not in self._entries and name not in self._builtins:
            raise ConfigError(f"no {self.kind} named {name!r} is registered. Registered: {', '.join(self.names())}.")
        self._entries.pop(name, None)
        self._builtins.pop(name, None)

    def names(self) -> tuple[str, ...]:
        """Every registered name, built-ins first (in their order), then the others in registration order."""
        return tuple(dict.fromkeys([*self._builtins, *self._entries]))

    def get(self, name: str) -> Entry:
        if name not in self._entries and name in self._builtins:
            importlib.import_module(self._builtins[name])  # registers it
        entry = self._entries.get(name)
        if entry is None:
            raise ConfigError(f"{self.kind}={name!r} is not registered. Registered: {', '.join(self.names())}.")
        return entry


PREDICTORS = Registry(
    "predictor",
    {
        "auto": "mira_hf.predictors",
        "gate": "mira_hf.predictors",
        "markov": "mira_hf.predictors",
        "global": "mira_hf.predictors",
        "position": "mira_hf.predictors",
        "hybrid": "mira_hf.predictors",
        "learned": "mira_hf.learned",
    },
)
POLICIES = Registry("policy", {"lru": "mira_hf.policies", "heat": "mira_hf.policies", "priority": "mira_hf.policies"})


def register_predictor(
    name: str, factory: Callable, *, uses_routers: bool = False, uses_hidden: bool = False, needs_path: bool = False
) -> None:
    """Make `MiraConfig(predictor=name)` build `factory(spec)`, `spec` a `mira_hf.predictors.PredictorSpec`
    (the MoE layers, the model's routers, the `PredictorConfig`, ...), returning an object with
    `observe(layer, hidden, top_k_index)`, `predict(layer, hidden) -> {layer: probs [E]}` and `reset()`.
    `uses_routers` / `uses_hidden`: it applies the model's routers / reads hidden states (an offline
    replay then needs them); `needs_path`: it loads a calibrated file (`MiraConfig.predictor_path`)."""
    PREDICTORS.register(name, factory, uses_routers=uses_routers, uses_hidden=uses_hidden or uses_routers, needs_path=needs_path)


def register_policy(name: str, factory: Callable) -> None:
    """Make `MiraConfig(policy=name)` build `factory(context, settings)` per slot pool: `context` a
    `mira_hf.policies.PolicyContext` (what a policy may read of the running model), `settings` the
    manager's `ManagerSettings`; it returns an eviction policy (`mira_hf.cache.CachePolicy`)."""
    POLICIES.register(name, factory)
