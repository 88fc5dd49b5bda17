"""Target discovery: every routed-experts module of a model, found by its adapter and validated before anything
changes (`find_targets`), what identifies the model for files made from it (`model_fingerprint`), and its
routers by MoE layer for predictors (`RouterTable`).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from model_adapters import MoEAdapter, generic_adapter, get_adapter, registered_model_types
from model_adapters.base import (
    FUSED_EXPERTS,
    AutoAdapter,
    FusedExperts,
    auto_adapter,
    keeps_experts_as_modules,
    replaces_interface_forward,
    uses_experts_interface,
)

from .config import MiraConfig
from .errors import ConfigError, UnsupportedModelError, UnsupportedOperationError
from .proxy import CALL_HOOK_TABLES, KNOWN_EXPERT_TENSORS, LAYOUT_FLAGS, MiraExperts
from .state import at_paths, put_data
from .store import ExpertStore

_HOW_TO_ADD = (
    "Pass MiraConfig(expert_layer_path='model.layers.*.mlp.experts') (the glob of its routed-experts modules), "
    "or register an adapter: model_adapters.register_adapter(MoEAdapter(name=..., model_types=(...,), experts_globs=(...,)))."
)


ROUTER_HASH = "router_sha256"  # the fingerprint's hash of the routers' weights

# Every experts module a wrapped model serves now -> that model's manager (both weakly): a module another model holds
# too (assigned into it) is found empty there, and wrapping that model is refused saying why.
SERVED: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


@dataclass
class Target:
    """One routed-experts module to replace, found and validated before anything changes."""

    name: str
    parent: nn.Module
    attr: str
    module: nn.Module
    ordinal: int
    tensors: dict[str, torch.Tensor]
    requires_grad: dict[str, bool]
    # transformers' flag on a parameter it loaded or initialised (`_is_hf_initialized`): its init functions then
    # leave the tensor as it is
    initialized: dict[str, bool] = field(default_factory=dict)
    layout: FusedExperts = FUSED_EXPERTS  # where the module keeps them (`MoEAdapter.experts_layout`)
    # read from the module when found: once wrapped, a module whose experts sit on a child no longer holds it (JetMoE)
    num_experts: int = 0

    # the parameter objects standing for the module's expert tensors, by their path on the module: the module's own
    # when found in it (`release` frees their data once stored), then those the proxy exposes (made or kept by
    # `parameter`); `restore` gives them back, so optimizers and references held across wrap and unload stay valid
    params: dict[str, nn.Parameter] = field(default_factory=dict)
    # the data `release` took out of those parameters, by (tensor name, path), until `free`: what `put_back` gives back
    kept: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    # what stands for `module` in the model once wrapped (`_install`): found where it sits then (`places`), wherever
    # the model's owner has moved it since (another layer, inside a module of theirs)
    proxy: nn.Module | None = None
    # experts modules that are `module` in all but identity (`_twin_of`: their expert parameters are its own objects, as
    # where an encoder's experts are tied to its decoder's), with where each sits: the proxy stands there too, and
    # the experts are stored once; `unload()` puts each back in its own place
    twins: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)

    def parameter(self, name: str, path: str, data: torch.Tensor) -> nn.Parameter:
        """The parameter at `path` (one holding tensor `name`) over `data`: the one kept there (`params`), else a new
        one with the original tensor's `requires_grad`, and transformers' loaded flag where the tensor had it."""
        param = self.params.get(path)
        if param is not None and put_data(param, data):
            return param
        if param is not None:
            warnings.warn(
                f"{self.name}.{path}: torch could not give this parameter its new data in place (a weak reference to "
                "it, or a view of it, is alive), so a new parameter stands there; references to the old one (an "
                "optimizer's) no longer reach the model.",
                stacklevel=2,
            )
        param = nn.Parameter(data, requires_grad=self.requires_grad[name])
        if self.initialized.get(name):
            param._is_hf_initialized = True
        self.params[path] = param
        return param

    def release(self) -> None:
        """Take the expert tensors out of the module once the store holds them: `params` keeps the objects, emptied (an
        edit of one before the proxy exposes it again reaches nothing), and `kept` their data until `free`, whatever
        the parameters are given meanwhile."""
        for name in self.tensors:
            for path in self.layout.paths(name, self.num_experts):
                param = self.params.get(path)
                if param is not None:
                    self.kept[name, path] = param.data
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            self.layout.put(self.module, name, None)
        self.tensors = {}

    def free(self) -> None:
        """Drop the data `release` took out: the store holds the experts now."""
        self.kept = {}

    def put_back(self) -> None:
        """Give the module back the tensors `release` took out of it, as they were, in the parameters that stood for
        them (its twins' too)."""
        for (name, path), data in self.kept.items():
            self._set(path, self.parameter(name, path, data))

    def restore(self, store: ExpertStore) -> None:
        """Give the module back its tensors, rebuilt from the store's records, in the parameters that stood for them
        (`params`), each a tensor of its own (its twins the same parameters)."""
        for name, tensor in store.fused(self.ordinal).items():
            for path, part in at_paths(self.layout, name, tensor, self.num_experts):
                self._set(path, self.parameter(name, path, part))

    def _set(self, path: str, param: nn.Parameter) -> None:
        self.layout.set(self.module, path, param)
        for _, _, twin in self.twins:  # the same parameter, as before wrapping (a new one, where torch made one)
            self.layout.set(twin, path, param)


def places(model: nn.Module, modules: list[nn.Module]) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(m) -> every (parent, name) in `model` whose child `name` is m, for each of `modules`, in one walk of the
    model: one place for a module in one place, several for one shared by several parents (one experts module in two
    MoE blocks), none for one no longer in the model."""
    found: dict[int, list[tuple[nn.Module, str]]] = {id(m): [] for m in modules}
    for parent in model.modules():
        for name, child in parent._modules.items():
            if id(child) in found:
                found[id(child)].append((parent, name))
    return found


def resolve_adapter(model_type: str | None, cfg: MiraConfig, remote: bool = False, parts: tuple[str, ...] = ()) -> MoEAdapter:
    """The adapter of `model_type`: `expert_layer_path`'s if given, else the registered one, else `AutoAdapter`
    where transformers builds its experts with the experts interface; refused before any weight is read otherwise.
    `remote`: the model's code is its own, not transformers' code for `model_type` (which then says nothing).
    `parts`: the model types of its sub-configs (`sub_model_types`): a composite model may build its text decoder
    from another family's code (Kimi K2.5's is DeepSeek-V3's), whose experts count as its own."""
    if cfg.expert_layer_path is not None:
        return generic_adapter(cfg.expert_layer_path)
    adapter = get_adapter(model_type) if model_type else None
    if adapter is not None:
        return adapter
    if model_type and not remote and all(uses_experts_interface(t) is False for t in (model_type, *parts)):
        if any(keeps_experts_as_modules(t) for t in (model_type, *parts)):
            raise UnsupportedModelError(
                f"model_type {model_type!r} keeps each expert as a module of its own (transformers builds its experts "
                f"as an nn.ModuleDict of per-expert MLPs, as for NLLB-MoE) and has no mira-hf adapter saying how its "
                f"experts module is called and computes. Such experts are served where an adapter's "
                f"experts_layout=ExpertModules(...) describes them (Switch Transformers'). Supported: "
                f"{', '.join(registered_model_types())}, and any model whose experts transformers builds with its "
                f"experts interface. Run this model with transformers alone (device_map='auto' offloads to the host)."
            )
        raise UnsupportedModelError(
            f"model_type {model_type!r} has no mira-hf adapter, and transformers' code for it builds no experts module "
            f"(a dense model, or experts outside transformers' experts interface). Supported: "
            f"{', '.join(registered_model_types())}, and any model whose experts transformers builds with its experts "
            f"interface. {_HOW_TO_ADD}"
        )
    return auto_adapter(model_type)  # found by transformers' experts interface, or refused by find_targets


def own_classes_hint(model_class: type, model_type: str | None) -> str:
    """What to say where a model built by its checkpoint's own code (`model_class`) cannot be served but transformers'
    own classes for its `model_type` can be (registered, or built with the experts interface); "" otherwise."""
    import transformers

    if model_type not in transformers.CONFIG_MAPPING:
        return ""
    if get_adapter(model_type) is None and not uses_experts_interface(model_type):
        return ""
    return (
        f"{model_class.__name__} is the checkpoint's own code (trust_remote_code=True); transformers "
        f"{transformers.__version__} has classes of its own for model_type {model_type!r}, whose experts mira-hf serves: "
        "load it without trust_remote_code (transformers then builds its own classes, as AutoModelForCausalLM does)."
    )


def sub_model_types(config) -> tuple[str, ...]:
    """The model types of a config's sub-configs, nested ones included (a config object, or config.json as a dict)."""
    found = []
    for value in (config if isinstance(config, dict) else config.to_dict()).values():
        if isinstance(value, dict) and isinstance(value.get("model_type"), str):
            found += [value["model_type"], *sub_model_types(value)]
    return tuple(found)


def _has_call_hooks(module: nn.Module) -> bool:
    return any(getattr(module, table) for table in CALL_HOOK_TABLES)


def find_targets(
    model: nn.Module, adapter: MoEAdapter, streamed: dict[str, dict[str, torch.Tensor]] | None = None
) -> list[Target]:
    """Every routed-experts module, validated. `streamed`: module path -> the meta tensors of experts
    left out of the model at load (they are read from the checkpoint instead)."""
    found = adapter.find_experts(model)
    auto_type = (adapter.model_types or (None,))[0] if isinstance(adapter, AutoAdapter) else None
    if not found and isinstance(adapter, AutoAdapter):
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type {auto_type!r}) has no mira-hf adapter, and none of its modules "
            f"is a routed-experts module built by transformers' experts interface. Supported: "
            f"{', '.join(registered_model_types())}. {_HOW_TO_ADD}"
        )
    if not found:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no routed-experts module matches {list(adapter.experts_globs)} "
            f"(adapter {adapter.name!r}). A dense model has nothing for mira-hf to offload; for an MoE model "
            f"with experts elsewhere: {_HOW_TO_ADD}"
        )
    targets = []
    for name, module in found:
        if isinstance(module, MiraExperts):
            raise ConfigError(f"{name} is already a MiraExperts proxy: this model is wrapped. Call model.unload() first.")
        twin = _twin_of(module, targets, adapter.experts_layout) if streamed is None else None
        if twin is not None:  # served by its twin's proxy, from its twin's records
            parent_name, _, attr = name.rpartition(".")
            twin.twins.append((model.get_submodule(parent_name) if parent_name else model, attr, module))
            continue
        ordinal = len(targets)
        serving = SERVED.get(module)
        if serving is not None and serving() is not None and not serving().closed:
            raise ConfigError(
                f"{name} ({type(module).__name__}) is an experts module another wrapped model serves: the two models "
                "share it, and wrapping that one took its experts into its store. Give each model experts modules of "
                "its own (copy.deepcopy) before wrapping, or unload() the other model first."
            )
        layout = adapter.experts_layout
        E = layout.num_experts(module)
        tensors = layout.parameters(module)
        in_checkpoint = streamed is not None and name in streamed
        if in_checkpoint:
            tensors = streamed[name]
        problem = _layout_problem(adapter, module, tensors, E)
        # each tensor as [E, ...] (a checkpoint's meta tensors are already)
        data = (
            {} if problem else {n: p.data if in_checkpoint else layout.per_expert(module, n, p.data) for n, p in tensors.items()}
        )
        problem = problem or _served_problem(adapter, name, module, tensors, data, E, in_checkpoint)
        if problem and serving is not None and not tensors:  # served before, by a model gone now
            raise ConfigError(
                f"{name} ({type(module).__name__}) holds no expert weights: a wrapped model that served it took them "
                "into its store and was dropped or closed without unload(), and they went with it. Load the model "
                "again; to keep a wrapped model's modules, call its unload() first, which gives them their weights back."
            )
        if problem:
            raise UnsupportedModelError(
                f"{name} ({type(module).__name__}) cannot be served: {problem}. Supported: fused 3-D experts "
                f"({', '.join(KNOWN_EXPERT_TENSORS)}). {_HOW_TO_ADD}"
            )
        # the modules from the experts module down to each that keeps expert tensors: none is called once wrapped
        owners = layout.owners(E) if layout.nested else ()
        chain = {".".join(path.split(".")[: i + 1]) for path in owners for i in range(path.count(".") + 1)}
        hooked = [path for path in sorted(chain) if _has_call_hooks(module.get_submodule(path))]
        if hooked:
            raise UnsupportedOperationError(
                f"{name} ({type(module).__name__}) keeps its experts on {[f'{name}.{p}' for p in hooked]}, which have "
                "forward or backward hooks: wrapped, the experts are computed by the proxy of the experts module, and "
                "those modules are no longer called, so their hooks would not run. Register the hooks on "
                f"{name} instead (they run around its proxy), or remove them before wrapping."
            )
        if layout.stacks_copies and not in_checkpoint:  # kept as shapes: the store reads each expert's own tensors
            data = {n: torch.empty(x.shape, dtype=x.dtype, device="meta") for n, x in data.items()}
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        targets.append(
            Target(
                name,
                parent,
                attr,
                module,
                ordinal,
                data,
                {n: p.requires_grad for n, p in tensors.items()},
                {n: bool(getattr(p, "_is_hf_initialized", False)) for n, p in tensors.items()},
                layout,
                E,
                {} if in_checkpoint else _module_parameters(module, layout, tensors, E),
            )
        )
    if isinstance(adapter, AutoAdapter):
        warnings.warn(
            f"mira-hf: model_type {auto_type!r} has no adapter; serving the {len(found)} routed-experts modules "
            f"transformers built ({found[0][0]}, ...). Outputs are exact as for every family; the router beside them "
            "ranks predictions. register_adapter(MoEAdapter(...)) records its routing and checkpoint layout.",
            stacklevel=4,
        )
    return targets


def _twin_of(module: nn.Module, targets: list[Target], layout: FusedExperts) -> Target | None:
    """The target whose experts module `module` matches in all but identity (`_alike`), or None. Such a module shares
    its experts with the other (Diffusion Gemma's encoder ties each layer's to its decoder's): one store layer serves
    both, and the layer is visited twice per forward, as a looped decoder's is."""
    if layout.nested or not any(True for _ in module.parameters()):
        return None
    return next((t for t in targets if not t.layout.nested and _alike(t.module, module)), None)


_MODULE_INTERNALS = frozenset(vars(nn.Module())) - {"training"}  # what every module keeps: parameters, buffers, hooks


def _alike(a: nn.Module, b: nn.Module) -> bool:
    """Whether module `b` computes as `a` does, and may stand in `a`'s place: the same class, each parameter and
    buffer the very tensor `a` holds under that name, its other attributes the same objects or equal, no hooks of its
    own (they would not run where `a`'s proxy stands), and its children alike in turn."""
    if type(a) is not type(b) or a is b:
        return False
    if any(table for key, table in vars(b).items() if "hook" in key and key != "_is_full_backward_hook"):
        return False
    if a._parameters.keys() != b._parameters.keys() or a._buffers.keys() != b._buffers.keys():
        return False
    tensors = [*zip(a._parameters.values(), b._parameters.values()), *zip(a._buffers.values(), b._buffers.values())]
    if any(x is not y for x, y in tensors):
        return False
    own = lambda m: {k: v for k, v in vars(m).items() if k not in _MODULE_INTERNALS}  # noqa: E731
    oa, ob = own(a), own(b)
    if oa.keys() != ob.keys() or a._modules.keys() != b._modules.keys():
        return False
    if not all(_same_value(v, ob[key]) for key, v in oa.items()):
        return False
    children = zip(a._modules.values(), b._modules.values())
    return all(x is y or (x is not None and y is not None and _alike(x, y)) for x, y in children)


def _same_value(v: object, w: object) -> bool:
    """Whether attribute values `v` and `w` are the same object or equal values of one type (a `functools.partial`, as
    an activation keeps, by its function and arguments); an equality that raises (a per-layer config read globally)
    or gives no bool (tensors) is not known to hold."""
    if v is w:
        return True
    if type(v) is not type(w):
        return False
    if isinstance(v, functools.partial):
        return (
            v.func is w.func
            and len(v.args) == len(w.args)
            and all(map(_same_value, v.args, w.args))
            and (v.keywords.keys() == w.keywords.keys() and all(_same_value(x, w.keywords[k]) for k, x in v.keywords.items()))
        )
    try:
        return bool(v == w)
    except Exception:
        return False


def _module_parameters(module: nn.Module, layout: FusedExperts, tensors: dict, E: int) -> dict[str, nn.Parameter]:
    """The module's own parameters that keep its expert `tensors`, by their path on it."""
    found = {path: layout.get(module, path) for name in tensors for path in layout.paths(name, E)}
    return {path: param for path, param in found.items() if param is not None}


def _served_problem(adapter: MoEAdapter, name: str, module: nn.Module, tensors: dict, data: dict, E: int, in_checkpoint: bool):
    """What keeps experts module `module` (at `name`, its expert `tensors` as found and as `[E, ...]` `data`, laid out
    as its adapter says) from being served, or None. Raises for a module whose forward computes more than the
    experts."""
    if any(p.shape[0] != E for p in data.values()):
        return f"its tensors' first dimension is not num_experts={E}: {[tuple(p.shape) for p in data.values()]}"
    if not in_checkpoint and any(p.device.type == "meta" for p in tensors.values()):
        raise UnsupportedModelError(
            f"{name} ({type(module).__name__}) cannot be served: its weights are on the meta device (a model built "
            "without them), and mira-hf stores the experts' values. Load the weights into the model first "
            "(load_state_dict(..., assign=True)), or let MiraMoEModel.from_pretrained(path) read them from the checkpoint."
        )
    if adapter.route_norm and not isinstance(getattr(module, adapter.route_norm, None), nn.Module):
        return f"it has no per-route norm `{adapter.route_norm}` (adapter {adapter.name!r})"
    if replaces_interface_forward(module) and not adapter.route_norm:
        raise UnsupportedModelError(
            f"{name} ({type(module).__name__}) cannot be served: its class's forward "
            f"({type(module).__qualname__}.forward) replaces that of transformers' experts interface and computes "
            "more than the experts' matmuls and weighted sum, which is what mira-hf computes for a served expert; "
            "serving it would change the model's outputs. Supported: experts modules whose forward is the "
            "interface's (every family in docs/models.md). Load this model with transformers alone "
            "(device_map='auto' offloads to the host)."
        )
    return None


def _layout_problem(adapter: MoEAdapter, module: nn.Module, tensors: dict, E) -> str | None:
    """What keeps `module`'s expert `tensors` (its layout's names) from being served, or None."""
    layout = adapter.experts_layout
    if layout.nested:
        if not isinstance(E, int):
            return "it has no `num_experts`"
        missing = [n for n in layout.names if n not in tensors]
        if missing:
            return f"it lacks {missing} (has {sorted(tensors)})"
        call = list(inspect.signature(type(module).forward).parameters)[1:]
        if len(call) != layout.call_args:  # the proxy is called as the module is
            return f"its forward takes {call}, not the {layout.call_args} argument(s) of its layout ({type(layout).__name__})"
        held = {path for name in layout.names for path in layout.paths(name, E)}
        for path in layout.owners(E):
            owner = module.get_submodule(path)
            others = [f"{path}.{n}" for n, _ in (*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False))]
            others = sorted(set(others) - held)
            if others:
                return f"its {path} keeps tensors besides the experts' ({others})"
        return None
    unknown = sorted(set(tensors) - set(KNOWN_EXPERT_TENSORS))
    up = "gate_up_proj" if adapter.flag(module, "has_gate", LAYOUT_FLAGS["has_gate"]) else "up_proj"
    if not isinstance(E, int) or not (hasattr(module, "is_transposed") or "is_transposed" in adapter.expert_flags):
        return "it is not a fused experts module (transformers' @use_experts_implementation layout with `num_experts`)"
    if unknown:
        return f"it holds tensors mira-hf does not know how to compute with: {unknown}"
    if up not in tensors or "down_proj" not in tensors:
        return f"it lacks `{up}` or `down_proj` (has {sorted(tensors)})"
    return None


def expert_specs(targets: list[Target]) -> dict[int, dict]:
    """Layer -> {tensor name: (one expert's shape, dtype)} of every target."""
    return {t.ordinal: {n: (tuple(p.shape[1:]), p.dtype) for n, p in t.tensors.items()} for t in targets}


def model_fingerprint(model: nn.Module, targets: list[Target], specs: dict, routers: bool = True) -> dict:
    """What identifies a model for files made from it (predictors, packed stores): its shape and a
    hash of its routers' weights, so a file from another checkpoint of the same shape is refused too.
    `routers=False`: its shape only (a skeleton's routers are not loaded yet)."""
    shape = {
        "model_type": getattr(model.config, "model_type", None),
        "moe_layers": len(targets),
        "num_experts": [t.num_experts for t in targets],
        "hidden_size": getattr(model.config, "hidden_size", None),
        "expert_shapes": {n: list(shape) for n, (shape, _) in specs[targets[0].ordinal].items()} if targets else {},
    }
    if not routers:
        return shape
    return {**shape, **router_fields(targets)}


def router_fields(targets: list[Target]) -> dict[str, str]:
    """The fingerprint's hash of the routers' weights as they are now (each MoE block's [E, ...] matrices beside its
    experts): {ROUTER_HASH: sha256}."""
    return _router_hash(_router_weights(targets))


def _router_weights(targets: list[Target]) -> list[torch.Tensor]:
    return [
        p
        for t in targets
        for name, p in sorted(t.parent.named_parameters())
        if not name.startswith(t.attr + ".") and p.dim() == 2 and p.shape[0] == t.num_experts
    ]


def _router_hash(weights: list[torch.Tensor]) -> dict[str, str]:
    h = hashlib.sha256()
    for p in weights:
        h.update(p.detach().float().cpu().numpy().tobytes())
    return {ROUTER_HASH: h.hexdigest()}


class RouterHash:
    """`router_fields` of a wrapped model for its manager (`ExpertManager.router_fields`), without keeping the model
    alive (`mira_hf.weak`): read through the model while it is wrapped, else (unloaded, or dropped while its manager
    is kept: `from_pretrained(...).mira.save_store(...)`) from the router weights it held when last read."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self._weights = _router_weights(model._mira_targets)

    def __call__(self) -> dict[str, str]:
        targets = getattr(self._model(), "_mira_targets", None)
        if targets is not None:
            self._weights = _router_weights(targets)
        return _router_hash(self._weights)


class RouterTable:
    """The wrapped model's routers by MoE layer ordinal, for predictors: called as `(layer, hidden [T, H])
    -> [T, E]` router probabilities (a `RouterProbs`), and `linear(layer)`, the router as one linear map
    (`RouterLinear`) or None, resolved once (the gate predictor applies it at every block)."""

    def __init__(self, adapter: MoEAdapter, targets: list[Target]) -> None:
        self._adapter = adapter
        self._blocks = {t.ordinal: weakref.ref(t.parent) for t in targets}  # the model's, held weakly (`mira_hf.weak`)
        # The width of each layer's experts' input rows (`FusedExperts.hidden_width`): the hidden states a predictor
        # sees there. A router may read a wider state (Muse Spark projects the hidden state down before its experts),
        # or another stack's (a vision encoder's experts beside the text's).
        self._width = {
            t.ordinal: t.layout.hidden_width(t.tensors, adapter.flag(t.module, "is_transposed", False)) for t in targets
        }
        self._linear: dict = {}

    def __call__(self, layer: int, hidden: torch.Tensor) -> torch.Tensor | None:
        linear = self.linear(layer)
        if linear is None or linear.weight.shape[1] != hidden.shape[-1]:
            return None
        with torch.no_grad():
            return linear.probs(hidden)

    def width(self, layer: int) -> int:
        """The width of the hidden states `layer`'s experts take (and a predictor observes there)."""
        return self._width[layer]

    def linear(self, layer: int):
        """`layer`'s router as one linear map, or None where it is not one or reads other states than the
        experts' input rows."""
        if layer not in self._linear:
            linear = self._adapter.router_linear(self._blocks[layer]())
            self._linear[layer] = None if linear is None or linear.weight.shape[1] != self._width[layer] else linear
        return self._linear[layer]

    def forget_routers(self) -> None:
        """Resolve the routers again at their next use: a cast or move replaced their buffers."""
        self._linear.clear()
