"""`MoEAdapter`: per-architecture facts as data.

transformers 5 builds the routed experts of (almost) every MoE model as one module holding fused
3-D tensors (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, transposed for some families, with
biases for others), decorated with `@use_experts_implementation`. What differs between families is
where that module sits, what the router is called and how router logits become probabilities.
That is what an adapter records; the proxy reads the rest (flags, gate function) from the module.
"""

from __future__ import annotations

import fnmatch
import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class ExpertKeys:
    """Where a family's checkpoints keep one experts module's tensors, for loading them expert by expert.

    `tensors` maps each fused in-memory tensor (`gate_up_proj`, `down_proj`, biases) to checkpoint key
    templates relative to the module's checkpoint path, which is its in-memory path with `path_renames`
    applied (`(in-memory fragment, checkpoint fragment)` pairs). `{e}` is the expert index. A template
    with `{e}` names one expert's tensor; several are concatenated along dim 0, in order (w1 then w3 =
    gate rows then up rows, as transformers' `Concatenate(dim=1)` of the stacked tensors). A template
    without `{e}` names a stacked `[E, ...]` tensor, read one expert at a time.
    """

    tensors: dict[str, tuple[str, ...]] = field(hash=False)
    path_renames: tuple[tuple[str, str], ...] = ()

    def keys(self, module_path: str, tensor: str) -> tuple[str, ...] | None:
        """Full checkpoint key templates of one fused tensor of the module at `module_path`."""
        if tensor not in self.tensors:
            return None
        path = "." + module_path
        for in_memory, on_disk in self.path_renames:
            path = path.replace(in_memory, on_disk)
        return tuple(f"{path[1:]}.{t}" for t in self.tensors[tensor])


@dataclass(frozen=True)
class RouterLinear:
    """A router that is one linear map, then a scoring: what predictors apply to earlier hidden states."""

    weight: torch.Tensor  # [E, H]
    bias: torch.Tensor | None  # [E]
    scoring: str  # "softmax", or "sigmoid" (plus `correction`, the DeepSeek-V3 selection bias)
    correction: torch.Tensor | None  # [E]
    # Group-limited routing (DeepSeek's `num_group`, `topk_group`): the experts form `groups` equal groups and each
    # token chooses only among those of its `topk_group` best groups, a group scored by the sum of its two best
    # selection scores ("top2", DeepSeek-V3's and its kin's) or by its best ("max", DeepSeek-V2's group-limited greedy)
    groups: int = 1
    topk_group: int = 0
    group_score: str = "top2"
    # The router's own scoring function where it keeps one (`score_fn`: DeepSeek-V4's sqrt-softplus), in place of
    # `scoring`'s; the selection bias is added to its scores
    score_fn: Callable[[torch.Tensor], torch.Tensor] | None = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, E], in the router's dtype."""
        return torch.nn.functional.linear(hidden.to(self.weight.dtype), self.weight, self.bias)

    def probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, E] float32 probabilities (sigmoid scores for sigmoid routers)."""
        return self.probs_from(self.logits(hidden))

    def probs_from(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [T, E] -> [T, E] float32 probabilities (selection scores: those of experts outside a token's
        chosen groups are -inf, ranked last)."""
        logits = logits.float()
        if self.score_fn is not None or self.scoring == "sigmoid":
            scores = self.score_fn(logits) if self.score_fn is not None else logits.sigmoid()
            scores = scores + self.correction.float() if self.correction is not None else scores
        else:
            scores = logits.softmax(dim=-1)
        if not 0 < self.topk_group < self.groups:
            return scores
        T, E = scores.shape
        by_group = scores.view(T, self.groups, E // self.groups)
        rank = by_group.topk(2, dim=-1).values.sum(-1) if self.group_score == "top2" else by_group.amax(-1)  # [T, G]
        chosen = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, rank.topk(self.topk_group, dim=-1).indices, True)
        return scores.masked_fill(~chosen.repeat_interleave(E // self.groups, dim=1), float("-inf"))


@dataclass(frozen=True)
class FusedExperts:
    """Where transformers' experts interface keeps a module's expert tensors: its own parameters (`gate_up_proj
    [E, 2I, H]`, `down_proj [E, H, I]`, ...), each already `[E, ...]`. Every `MoEAdapter` reads and writes a
    module's expert tensors through its `experts_layout` (this, or a `HeldExperts`: `SeparateGluExperts`,
    `RoutedBlockExperts`)."""

    nested = False  # the tensors are the module's own parameters, named as the store names them
    stacks_copies = False  # `parameters` gives the module's tensors themselves (or views), not copies
    outside = ()  # the module's members applied around its experts' sum, not per expert (none)

    def parameters(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """The module's expert tensors by the name the store gives them (none once removed)."""
        return dict(module.named_parameters(recurse=False))

    def num_experts(self, module: nn.Module) -> int | None:
        """How many experts the module holds (its `num_experts`), or None where it says not."""
        E = getattr(module, "num_experts", None)
        return E if isinstance(E, int) else None

    def get(self, module: nn.Module, name: str) -> nn.Parameter | None:
        """The module's tensor `name`, or None."""
        owner, leaf = self._owner(module, name)
        return owner._parameters.get(leaf)

    def pop(self, module: nn.Module, name: str) -> None:
        """Remove tensor `name` from the module, its entry included."""
        owner, leaf = self._owner(module, name)
        owner._parameters.pop(leaf, None)

    def per_expert(self, module: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A module tensor `name` as `[E, ...]`, one row per expert (a view)."""
        return tensor

    def as_module(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`[E, ...]` experts as the module keeps tensor `name` (a view)."""
        return tensor

    def paths(self, name: str, E: int) -> tuple[str, ...]:
        """The paths on the module of the parameters that keep tensor `name` (`[E, ...]` in the store): one that
        holds every expert (as `as_module` lays them out), or one per expert (`ExpertModules`)."""
        return (name,)

    def parts(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`[E, ...]` experts as the parameters at `paths` keep them (views), in the same order."""
        return (self.as_module(name, tensor),)

    def held(self, module: nn.Module, name: str) -> list[torch.Tensor]:
        """The module's parameters that keep tensor `name` (those at `paths`), where present."""
        E = self.num_experts(module) or 0
        return [p for p in (self.get(module, path) for path in self.paths(name, E)) if p is not None]

    def expert(self, module: nn.Module, name: str, stacked: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e's tensor `name` of the module, `stacked` being what `parameters` gave as `[E, ...]` (a view of the
        module's tensor, or of the expert's own where the layout keeps one per expert)."""
        return stacked[e]

    def joined(self, module: nn.Module, name: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Tensor `name` as `[E, ...]` from the tensors at its `paths` (the inverse of `parts`)."""
        return self.per_expert(module, name, parts[0])

    def put(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        """Put tensor `name` on the module as `parameters` gives it (None: remove it, entries included)."""
        self.set(module, name, param)

    def hidden_width(self, tensors: dict[str, torch.Tensor], transposed: bool) -> int:
        """The width H of the rows the experts take, from their `[E, ...]` tensors (`transposed`: the module's flag)."""
        return tensors["down_proj"].shape[2 if transposed else 1]  # [E, H, I], or [E, I, H] transposed

    def set(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        """Put `param` where the module keeps tensor `name` (None: an empty entry, as a removed tensor leaves)."""
        owner, leaf = self._owner(module, name)
        owner.register_parameter(leaf, param)

    @staticmethod
    def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
        path, _, leaf = name.rpartition(".")
        return (module.get_submodule(path) if path else module), leaf


@dataclass(frozen=True)
class HeldExperts(FusedExperts):
    """A layout whose expert tensors sit on child modules of the experts module, named by their paths there (`names`);
    the subclasses say how each expert computes."""

    nested = True

    @property
    def names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def owners(self, E: int) -> tuple[str, ...]:
        """The paths of the descendant modules that keep the expert tensors of a module of `E` experts, in the order
        of `names`."""
        return tuple(dict.fromkeys(path.rpartition(".")[0] for name in self.names for path in self.paths(name, E)))

    def parameters(self, module: nn.Module) -> dict[str, nn.Parameter]:
        found = {name: self.get(module, name) for name in self.names}
        return {name: p for name, p in found.items() if p is not None}


@dataclass(frozen=True)
class SeparateGluExperts(HeldExperts):
    """An experts module outside transformers' experts interface whose experts are gated MLPs over separate
    tensors, each kept stacked along dim 0 as `[E * n, ...]` on a child module (DBRX: `mlp.w1`, `mlp.v1`,
    `mlp.w2`, each `[E * I, H]`): expert e is `down(act(x @ gate_e.T) * (x @ up_e.T))` and the module adds its
    experts' weighted outputs in ascending expert order (the eager loop of the experts interface). The store
    names each tensor by its path on the module."""

    gate: str  # parameter paths on the experts module
    up: str
    down: str
    down_transposed: bool  # expert e's down rows are [I, H] (outputs = h @ down_e), else [H, I]
    activation: str  # path of the activation module on the experts module
    batch_output: bool = False  # the module returns its rows viewed as (inputs.shape[0], -1, H)

    pairing = "single"  # (host_compute="split") one row of the gate and of the up tensor per neuron

    @property
    def names(self) -> tuple[str, str, str]:
        return (self.gate, self.up, self.down)

    def per_expert(self, module: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
        E = self.num_experts(module)
        return tensor if tensor.shape[0] % E else tensor.view(E, -1, *tensor.shape[1:])  # (refused by its shape)

    def as_module(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.flatten(0, 1)

    def hidden_width(self, tensors: dict[str, torch.Tensor], transposed: bool) -> int:
        return tensors[self.down].shape[2 if self.down_transposed else 1]

    @property
    def neuron_axes(self) -> dict[str, int]:
        """Each tensor's axis of intermediate neurons, from the end of an expert's tensor (gate and up `[I, H]`)."""
        return {self.gate: -2, self.up: -2, self.down: -2 if self.down_transposed else -1}

    @property
    def call_args(self) -> int:
        """How many arguments the module's forward takes: the experts call (hidden_states, top_k_index, top_k_weights)."""
        return 3


@dataclass(frozen=True)
class RoutedBlockExperts(HeldExperts):
    """A sparse block outside transformers' experts interface that routes and combines inside its own forward
    (`forward(hidden [B, S, H]) -> [B, S, H]`), keeping its experts as stacked `[E, ...]` tensors on child modules
    (JetMoE: `input_linear.weight [E, 2I, H]`, gate rows then up rows, and `output_linear.weight [E, H, I]`). Its
    router (a child) is called as the block calls it; each expert is `down(act(gate) * up)` on the rows the router
    grouped by expert (`torch.sort` of the flattened top-k), the weighted rows added per token in ascending expert
    order, then the block's `bias`."""

    up: str  # parameter paths on the block: the gate-and-up rows, and the down projection
    down: str
    activation: str  # path of the activation module on the block
    router: str  # path of the router module on the block, called as `router(rows [T, H])`
    bias: str  # path of the block's output bias (added after the experts' sum)

    down_transposed = False  # expert e's down rows are [H, I]
    pairing = "halves"  # (host_compute="split") gate rows then up rows in one tensor, split as transformers' fused ones

    @property
    def neuron_axes(self) -> dict[str, int]:
        return {}  # (split by `pairing`, as transformers' fused tensors)

    @property
    def names(self) -> tuple[str, str]:
        return (self.up, self.down)

    def hidden_width(self, tensors: dict[str, torch.Tensor], transposed: bool) -> int:
        return tensors[self.down].shape[1]  # [E, H, I]

    def num_experts(self, module: nn.Module) -> int | None:
        return super().num_experts(module.get_submodule(self.up.rpartition(".")[0]))  # the child that holds them

    @property
    def outside(self) -> tuple[str, ...]:
        return (self.router, self.bias)

    @property
    def call_args(self) -> int:
        return 1


@dataclass(frozen=True)
class ExpertModules(HeldExperts):
    """Experts kept as one module each, the children of the experts module named `child.format(e)` (Switch
    Transformers' `nn.ModuleDict` of `expert_{e}` MLPs). Expert e is `down(dropout(act(up(x))))` over the tensors at
    `up` and `down` on its module (`wi.weight [I, H]`, `wo.weight [H, I]`, no biases; `F.linear` each), its hidden
    rows cast to the down weight's dtype where they differ, as the expert's own forward does. The experts module is
    called as `(hidden [T, H], dispatch [T, K, E], weights [T, K])`: route k of token t goes to the expert its one-hot
    row of `dispatch` marks (to none where the row is zero: a token over an expert's capacity), weighted by
    `weights[t, k]`, and the weighted rows are added per token in ascending expert order (the module's loop, the
    experts interface's eager sum). The store keeps each tensor as `[E, ...]`; the model keeps expert e's at
    `child.format(e) + "." + name`."""

    up: str  # parameter paths on one expert's module
    down: str
    activation: str  # path of the activation module on one expert's module
    dropout: str = ""  # path of the dropout module between the activation and `down` ("": none)
    child: str = "expert_{}"  # the name of expert e's module on the experts module

    down_transposed = False  # the down projection's rows are [H, I]
    pairing = "single"  # (host_compute="split") one row of the up tensor per neuron
    stacks_copies = True  # `parameters` stacks the experts' own tensors into new ones

    @property
    def names(self) -> tuple[str, str]:
        return (self.up, self.down)

    @property
    def neuron_axes(self) -> dict[str, int]:
        return {self.up: -2, self.down: -1}  # up [I, H], down [H, I]

    def paths(self, name: str, E: int) -> tuple[str, ...]:
        return tuple(f"{self.child.format(e)}.{name}" for e in range(E))

    def parts(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(tensor.unbind(0))

    def joined(self, module: nn.Module, name: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack([p.detach() for p in parts])

    def num_experts(self, module: nn.Module) -> int | None:
        E = super().num_experts(module)
        return E if E is not None or not isinstance(module, (nn.ModuleDict, nn.ModuleList)) else len(module)

    def parameters(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """Each tensor's experts stacked as one `[E, ...]` parameter (a copy: the model keeps one per expert)."""
        E, found = self.num_experts(module), {}
        for name in self.names:
            params = [self.get(module, path) for path in self.paths(name, E or 0)]
            if params and all(p is not None for p in params):
                found[name] = _like(params[0], self.joined(module, name, params), all_flagged=params)
        return found

    def expert(self, module: nn.Module, name: str, stacked: torch.Tensor, e: int) -> torch.Tensor:
        return self.get(module, self.paths(name, self.num_experts(module))[e]).detach()  # `stacked` is a copy (or meta)

    def put(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        paths = self.paths(name, self.num_experts(module))
        parts = self.parts(name, param) if param is not None else (None,) * len(paths)
        for path, part in zip(paths, parts):
            self.set(module, path, None if part is None else _like(param, part))

    def hidden_width(self, tensors: dict[str, torch.Tensor], transposed: bool) -> int:
        return tensors[self.down].shape[1]  # [E, H, I]

    @property
    def call_args(self) -> int:
        return 3


def _like(template: torch.Tensor, data: torch.Tensor, all_flagged: Sequence[torch.Tensor] = ()) -> nn.Parameter:
    """A parameter over `data` with `template`'s `requires_grad`, and transformers' loaded flag where `template` has it
    (and each of `all_flagged`, where given)."""
    param = nn.Parameter(data, requires_grad=template.requires_grad)
    if all(getattr(t, "_is_hf_initialized", False) for t in (*all_flagged, template)):
        param._is_hf_initialized = True
    return param


FUSED_EXPERTS = FusedExperts()


@dataclass(frozen=True)
class MoEAdapter:
    name: str  # family name, for messages
    model_types: tuple[str, ...]  # config.model_type values served
    experts_globs: tuple[str, ...] = ("*.mlp.experts",)  # module paths of the routed-experts modules
    router_attr: str = "gate"  # the router's attribute name on the parent block
    router_weight_attr: str = "weight"  # the router's [E, H] weight, relative to the router
    router_scoring: str = "softmax"  # how logits become probabilities: "softmax" or "sigmoid"
    notes: str = ""  # routing quirks worth knowing (shown in docs)
    # Checkpoint layouts of the routed experts, tried in order, for loading them one expert at a time
    # without building the fused tensors. Empty: found through transformers' own key renaming.
    checkpoint_keys: tuple[ExpertKeys, ...] = ()
    # Layout flags of experts modules that do not carry those of `@use_experts_implementation`
    # (`is_transposed`, `has_gate`, `has_bias`): what the module's own forward does.
    expert_flags: dict[str, bool] = field(default_factory=dict, hash=False)
    # The block scales each expert's *input* by its routing weight and calls the experts module with
    # `[E·T, H]` rows, every token for every expert (rows of experts a token did not choose are zero),
    # then sums the `[E·T, H]` outputs over experts itself (Llama 4). Default: the experts module gets
    # `(hidden [T, H], top_k_index, top_k_weights)` and weighs and sums the outputs (transformers 5).
    input_scaled: bool = False
    # The experts module's forward replaces the experts interface's to normalise each (token, expert) route's output
    # with the expert's own learned norm before the weighted sum (Ergo): the name of that norm on the module,
    # called as `norm(rows [R, H], expert_ids [R])`. Default "": the module's forward is the interface's.
    route_norm: str = ""
    # Where the number of experts per token is found: the first of these attributes set on the block, its
    # router, the model config or its text config (vision-language models). Gemma 4's config says `top_k_experts`,
    # Aria's, Hunyuan's and LongCat's `moe_topk`.
    top_k_attrs: tuple[str, ...] = (
        "top_k",
        "num_experts_per_tok",
        "moe_top_k",
        "num_experts_per_token",
        "top_k_experts",
        "moe_topk",
    )
    # Where the experts module keeps its expert tensors and how each expert computes: transformers' fused layout,
    # or `SeparateGluExperts` for a module outside its experts interface (DBRX).
    experts_layout: FusedExperts = field(default=FUSED_EXPERTS, hash=False)

    def top_k(self, block: nn.Module, config: object, num_experts: int) -> int:
        """Experts per token of `block`'s layer (the minimum working set of a layer; at most
        `num_experts`): from the block, its router or `config` (`top_k_attrs`); 1 where none says."""
        for obj in (block, self.router(block), config, getattr(config, "text_config", None)):
            for attr in self.top_k_attrs:
                k = getattr(obj, attr, None) if obj is not None else None
                if isinstance(k, int) and k > 0:
                    return min(k, num_experts)
        return 1

    def flag(self, module: nn.Module, name: str, default: bool) -> bool:
        """A layout flag of an experts module: the module's own (set by transformers' decorator), else the adapter's."""
        return bool(getattr(module, name, self.expert_flags.get(name, default)))

    def find_experts(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The routed-experts modules, in model order."""
        return [(n, m) for n, m in model.named_modules() if any(fnmatch.fnmatchcase(n, g) for g in self.experts_globs)]

    def router(self, block: nn.Module) -> nn.Module | None:
        return _get_path(block, self.router_attr)  # (a path: JetMoE's router sits inside its sparse block)

    def router_linear(self, block: nn.Module) -> RouterLinear | None:
        """`block`'s router as one linear map and a scoring, or None where it has no `[E, H]` weight. Used
        only to *predict* experts (never to route), so an approximation costs bandwidth, not correctness."""
        router = self.router(block)
        weight = None if router is None else _get_path(router, self.router_weight_attr)
        linear = router
        if weight is None and router is not None:  # its map is a Linear inside it, all its parameters (HunYuan's `wg`)
            linear = _only_linear(router)
            weight = None if linear is None else linear.weight
        if not (isinstance(weight, torch.Tensor) and weight.dim() == 2):  # a quantized Linear's `weight` is a method
            return None
        if _reads_token_ids(router):  # its choice is not the hidden states' (a hash router looks experts up by token)
            return None
        score_fn = getattr(router, "score_fn", None)
        return RouterLinear(
            weight,
            getattr(linear, "bias", None),
            self.scoring(router, block),
            _selection_bias(router, block),
            *_groups(router, weight.shape[0]),
            score_fn if callable(score_fn) else None,
        )

    def scoring(self, router: nn.Module, block: nn.Module | None = None) -> str:
        """How this router's logits become probabilities: `router_scoring`."""
        return self.router_scoring


def _groups(router: nn.Module, num_experts: int) -> tuple[int, int, str]:
    """(groups, topk_group, group score) of a router with group-limited routing, as DeepSeek's routers keep them
    (`num_group`, `topk_group`; a `topk_method` other than "greedy" scores a group by its best expert); (1, 0, "top2")
    for one that chooses among all its experts."""
    groups, topk_group = getattr(router, "num_group", None), getattr(router, "topk_group", None)
    method = getattr(router, "topk_method", None)
    grouped = isinstance(groups, int) and isinstance(topk_group, int) and groups > 1 and num_experts % groups == 0
    if not grouped or method == "greedy":
        return 1, 0, "top2"
    return groups, topk_group, "top2" if method is None else "max"


def _reads_token_ids(router: nn.Module) -> bool:
    """Whether `router`'s forward takes token ids (DeepSeek-V4's hash router looks its experts up by token): what it
    chooses cannot be predicted from hidden states."""
    try:
        names = list(inspect.signature(type(router).forward).parameters)
    except (TypeError, ValueError):
        return False
    return any(name in ("input_ids", "token_ids") for name in names)


def _selection_bias(router: nn.Module, block: nn.Module | None) -> torch.Tensor | None:
    """The bias added to a router's scores to choose experts (`e_score_correction_bias`, DeepSeek-V3's; AFMoE's
    `expert_bias`): the router's own, or its block's, which passes it to the router (MiniMax-M2's, AFMoE's)."""
    for owner in (router, block):
        for name in ("e_score_correction_bias", "expert_bias"):
            bias = getattr(owner, name, None) if owner is not None else None
            if isinstance(bias, torch.Tensor):
                return bias
    return None


def _only_linear(router: nn.Module) -> nn.Linear | None:
    """The `nn.Linear` inside `router` that holds every parameter it has (a router module around one linear map), or
    None where it has others (a norm's scale, a second layer: then it is no single linear map)."""
    linears = [m for m in router.modules() if isinstance(m, nn.Linear)]
    if len(linears) != 1:
        return None
    params = {id(p) for p in router.parameters()}
    return linears[0] if params == {id(p) for p in linears[0].parameters()} else None


def _get_path(obj: object, path: str):
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def generic_adapter(expert_layer_path: str) -> MoEAdapter:
    """An adapter from a user-given glob of the routed-experts modules (models with no adapter)."""
    return GenericAdapter(name=f"generic({expert_layer_path})", model_types=(), experts_globs=(expert_layer_path,))


@dataclass(frozen=True)
class GenericAdapter(MoEAdapter):
    """Finds the router as the block's child whose weight is `[E, H]`."""

    def router(self, block: nn.Module) -> nn.Module | None:
        experts = getattr(block, "experts", None)
        E = getattr(experts, "num_experts", None)
        routes = lambda w: isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == E  # noqa: E731
        children = [(name, child) for name, child in block.named_children() if name != "experts"]
        for _, child in children:
            if routes(getattr(child, "weight", None)):
                return child
        for _, child in children:  # a router module around one linear map (HunYuan's `gate.wg`, AFMoE's `router.gate`)
            linear = _only_linear(child)
            if linear is not None and routes(linear.weight):
                return child
        return None


def is_transformers_experts(module: nn.Module) -> bool:
    """Whether `module` is a routed-experts module built by transformers' `@use_experts_implementation`:
    the flags the decorator sets on every instance, and fused `[E, ...]` expert tensors."""
    E = getattr(module, "num_experts", None)
    if not isinstance(E, int) or not all(hasattr(module, flag) for flag in ("has_gate", "has_bias", "is_transposed")):
        return False
    down = getattr(module, "down_proj", None)
    if down is None:  # left out of a streamed load (its tensors are read from the checkpoint instead)
        return "down_proj" in module._parameters
    return isinstance(down, torch.Tensor) and down.dim() == 3 and down.shape[0] == E


def replaces_interface_forward(module: nn.Module) -> bool:
    """Whether `module` was built by transformers' experts interface (`@use_experts_implementation`, which sets
    `is_concatenated` on each instance) but its class replaces the interface's forward with one of its own that
    computes more around it (Ergo's experts: a learned RMSNorm per expert on each route before the weighted sum).
    The interface's forward is the decorator's dispatch (`functools.wraps` of the class's own loop)."""
    return hasattr(module, "is_concatenated") and not hasattr(type(module).forward, "__wrapped__")


def uses_experts_interface(model_type: str) -> bool | None:
    """Whether transformers' modeling code of `model_type` builds its experts with `@use_experts_implementation`
    (the test transformers itself uses to allow switching experts implementations); None when that code is
    not part of transformers (remote code, or an unknown type)."""
    source = _modeling_source(model_type)
    return None if source is None else "@use_experts_implementation" in source


# An experts class that is a container of one module per expert (Switch Transformers' and NLLB-MoE's `nn.ModuleDict`
# of `expert_{i}` MLPs), as transformers' modeling code declares it.
_PER_EXPERT_MODULES = re.compile(r"^class \w*Experts\((?:nn\.)?Module(?:Dict|List)\)", re.MULTILINE)


def keeps_experts_as_modules(model_type: str) -> bool | None:
    """Whether transformers' modeling code of `model_type` keeps its experts as one module each in a container
    (`nn.ModuleDict` / `nn.ModuleList`) rather than as `[E, ...]` tensors; None where that code is not transformers'."""
    source = _modeling_source(model_type)
    return None if source is None else bool(_PER_EXPERT_MODULES.search(source))


def _modeling_source(model_type: str) -> str | None:
    """The source of transformers' modeling module of `model_type`, or None (remote code, an unknown type)."""
    import importlib
    import inspect

    try:
        from transformers.models.auto.configuration_auto import model_type_to_module_name

        name = model_type_to_module_name(model_type)
        return inspect.getsource(importlib.import_module(f"transformers.models.{name}.modeling_{name}"))
    except (ImportError, OSError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class AutoAdapter(GenericAdapter):
    """For a model type without an adapter: every module transformers built with its experts interface is
    served (the proxy reads the layout flags and gate function from the module itself, so outputs are
    exact as for any family). The router is found beside the experts as in `GenericAdapter`; its logits
    are scored with a sigmoid where it or its block carries a selection bias (`e_score_correction_bias`,
    the DeepSeek-V3 style), else a softmax. That only ranks predictions: a family whose routing differs costs
    prefetch accuracy, never a token."""

    def find_experts(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(n, m) for n, m in model.named_modules() if is_transformers_experts(m)]

    def scoring(self, router: nn.Module, block: nn.Module | None = None) -> str:
        return "sigmoid" if _selection_bias(router, block) is not None else "softmax"


def auto_adapter(model_type: str | None) -> AutoAdapter:
    """The adapter for a model type that has none (not registered: `model_types` only names it)."""
    return AutoAdapter(name=f"auto({model_type})", model_types=(model_type,) if model_type else (), experts_globs=())
