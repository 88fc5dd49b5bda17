"""The routed experts as the wrapped model's parameters: state dict, `load_state_dict`, casts and moves.

Each `MiraExperts` proxy holds its layer's expert tensors as parameters under their original names
(`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, ...), so `state_dict()`, `named_parameters()`,
`num_parameters()` and `get_memory_footprint()` see what the unwrapped model has:
- uncompressed records: each parameter is a contiguous view of its layer's host slab (no copy; the store
  *is* the weights, kept tensor by tensor). It stays in host memory whatever `model.device` is;
- encoded records (lossless, int8/int4/nf4): each parameter is a placeholder on the `meta` device (shape
  and dtype only, no memory); `state_dict()` gives a decoded copy instead, with a warning where the
  format is lossy (the values are the dequantized ones, not the checkpoint's).
The device holds only the manager's cache, never all experts. `load_state_dict` writes expert tensors
into the store (strict semantics as torch's: missing, unexpected and mis-shaped keys are reported the
same way) and empties the cache, so the next forward computes with the loaded weights.

`model.to(dtype)`, `.half()`, `.bfloat16()`, `.float()`, `.to(device)`, `.cuda()`, `.cpu()` reach every
module through `nn.Module._apply(fn)`. The `_apply` of the model and of every module above a proxy (set
per instance) first learns what `fn` does from a one-element probe, checks that the store can follow (a
dtype its codec holds exactly, a slot plan that fits the budget on the target device, a module that holds
every layer's experts) and raises before anything changes otherwise; then it re-encodes the store to the
new dtype exactly as casting each expert tensor would, rebuilds the manager's cache on the target device,
and lets `fn` reach the other weights. A proxy never applies `fn` to its expert parameters itself.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from . import offload_files
from .budget import BudgetPlan
from .errors import ConfigError, DeviceError, MiraError, UnsupportedOperationError
from .layout import IdentityCodec
from .manager import ExpertManager
from .normal_tensors import builds_normal_tensors
from .quant.cast import widens
from .step_hooks import on_stack
from .store import own_storage
from .weak import bound_weakly

# (new record layouts by layer, uncompressed record bytes by layer, device) -> the slot plan there (raises BudgetError)
Replan = Callable[[Mapping[int, object], Mapping[int, int], torch.device, Mapping[int, int]], BudgetPlan]
# (tensor name, its path on the module, data) -> the expert parameter there
MakeParameter = Callable[[str, str, torch.Tensor], nn.Parameter]

SUPPORTED_DEVICES = ("cpu", "cuda")
_APPLY_CODES = frozenset({nn.Module.apply.__code__})  # a cast or move that came through `model.apply(fn)`


class ExpertState:
    """One per wrapped model, shared by its proxies: the manager, the proxies by layer, and how to plan
    slots again after the records changed size or the model moved."""

    def __init__(self, manager: ExpertManager, proxies: Mapping[int, nn.Module], replan: Replan) -> None:
        self.manager = manager
        # weakly: the model holds its proxies, and each proxy this state (`mira_hf.weak`)
        self.proxies: Mapping[int, nn.Module] = weakref.WeakValueDictionary(proxies)
        self.replan = replan  # holds the model weakly too
        self.applying = False  # a cast or move of the whole model is under way (its proxies follow it)
        # `save_pretrained`'s experts (`unload.SaveExperts`), which state_dict() on its thread gives for encoded layers
        self._saving = threading.local()
        # each layer's expert parameters and their version counts when exposed (`edited`)
        self._paths: dict[int, list[str]] = {}  # where each watched parameter is on its proxy
        self._entries: dict[int, list[tuple[dict, str]]] = {}  # and the parameter table entry that holds it
        self._module_links: dict[int, list[tuple[dict, str, nn.Module, str]]] = {}  # (a parent's _modules, name, child, path)
        # each owner of a layer's expert parameters (weakly: the proxy holds this state) and its class: a
        # parametrization registered on an owner gives it a class of its own, which the check within a step looks at
        # (`edited(quick=True)`)
        self._owners: dict[int, list[tuple[weakref.ref, type]]] = {}
        self._watched: dict[int, list[nn.Parameter]] = {}
        # (version count, data pointer) of each: in-place changes count, a `.data` assignment moves the data
        self._seen: dict[int, list[tuple[int, int]]] = {}

    @property
    def store(self):
        """The experts as whole tensors: the manager's store, or its device parts joined to their host parts."""
        return self.manager.whole

    # -- parameters -----------------------------------------------------------------------------
    @builds_normal_tensors
    def expose(self, proxy: nn.Module, parameter: MakeParameter | None = None) -> None:
        """(Re)point `proxy`'s expert parameters at its layer's records: views of raw slabs, else meta
        placeholders. A parameter that exists keeps its identity (optimizers and user references stay valid); one
        that does not is given by `parameter(name, path, data)` (`Target.parameter`: the unwrapped module's own
        parameter at `path`, else a new one with the original tensor's attributes). Normal tensors whatever the
        caller's mode (a `load_state_dict` inside `torch.inference_mode()`), as the unwrapped model's parameters stay:
        edits and forwards outside it use them."""
        store, layer, layout = self.store, proxy.layer, proxy.experts_layout
        views = store.expert_views(layer)
        E = store.num_experts(layer)
        for name, (shape, dtype) in store.expert_specs(layer).items():
            data = views[name] if views is not None else torch.empty((E, *shape), dtype=dtype, device="meta")
            for path, part in at_paths(layout, name, data, E):  # the module's shapes
                param = layout.get(proxy, path)
                if param is not None:
                    param.data = part
                else:
                    layout.set(proxy, path, parameter(name, path, part) if parameter is not None else nn.Parameter(part))
        self._paths[layer] = expert_paths(layout, store, layer)
        self._watched[layer] = [layout.get(proxy, path) for path in self._paths[layer]]
        # the modules between the proxy and each owner of a parameter (experts kept on child modules), which an
        # assignment may replace with other modules; and where each parameter is kept (its owner's parameter table,
        # its name there): both checked at every step
        links = {path: _links(proxy, path) for path in self._paths[layer]}
        self._module_links[layer] = list({link[3]: link for chain in links.values() for link in chain}.values())
        self._entries[layer] = [
            ((chain[-1][2] if chain else proxy)._parameters, path.rpartition(".")[2]) for path, chain in links.items()
        ]
        owners = {id(m): m for m in (chain[-1][2] if chain else proxy for chain in links.values())}
        self._owners[layer] = [(weakref.ref(m), type(m)) for m in owners.values()]
        self._seen[layer] = self._seen_now(layer)

    def store_views_again(self, layer: int) -> None:
        """After `Module.apply`'s `fn` met the unwrapped modules that keep `layer`'s parameters (experts on child
        modules: `proxy._HeldExperts`): a cast of one of them alone (torch's `_apply`, which sets their data) is undone,
        for a layer's experts share one dtype and the store follows a cast of the experts module; in-place changes stay
        (they are the store's)."""
        dtype = self.store.dtype(layer)
        if any(p.dtype != dtype for p in self._watched.get(layer, ())):
            self.expose(self.proxies[layer])

    def asking_for_grad(self, layer: int) -> nn.Parameter | None:
        """One of `layer`'s expert parameters that requires grad, or None."""
        return next((p for p in self._watched.get(layer, ()) if p.requires_grad), None)

    def _seen_now(self, layer: int) -> list[tuple[int, int]]:
        return [(p._version, p.data_ptr()) for p in self._watched[layer]]  # data_ptr 0: a placeholder on meta

    def edited(self, layers=None, quick: bool = False) -> None:
        """At each forward step (of `layers`' parameters: None, every layer's): expert parameters changed since they
        were exposed reach what the experts compute, as they do in the unwrapped model. `quick`: a block within a
        step whose start checked every layer looks only for a parametrization registered since on an owner of its
        experts (peft's LoRA on experts registers one around each experts call), then checks that layer in full.
        - Changed in place (a `mul_`, `copy_` or item assignment under `torch.no_grad()`, which torch counts): a raw
          store's parameters are its records, so the cache, whose copies are stale, starts empty. An encoded store's
          are placeholders that no edit reaches: that raises `UnsupportedOperationError`, at every step until
          `load_state_dict` writes those experts.
        - Given other data (`p.data = t`, as `torch.nn.utils.vector_to_parameters` does): the values are written into
          the store as `load_state_dict` writes them, and the parameter views the store again.
        - Replaced by another tensor on the module, or a module holding them replaced (an assignment, a
          parametrization, `torch.func.functional_call`): `UnsupportedOperationError`, nothing computed. The store holds the experts the model computes with; what
          stands in for a parameter for one call cannot be told from a lasting change."""
        if quick:
            layers = [layer for layer in layers if any(type(m()) is not cls for m, cls in self._owners.get(layer, ()))]
            if not layers:
                return
        changed = self._adopt_given_data(layers)
        if not changed:
            return
        placeholders = [layer for layer in changed if any(p.is_meta for p in self._watched[layer])]
        if placeholders:
            raise UnsupportedOperationError(
                f"the expert parameters of MoE layer(s) {placeholders} were changed in place, but the store holds "
                f"those experts {self.manager.held_as_placeholders}, and their parameters are "
                f"placeholders that no change reaches; the model would compute with the experts as stored. "
                f"{self.manager.placeholders_remedy}"
            )
        manager = self.manager
        manager.relocate(manager.store, manager.budget, manager.device)
        for layer in changed:
            self._seen[layer] = self._seen_now(layer)

    def _adopt_given_data(self, layers=None) -> list[int]:
        """`edited`'s first part: refuse replaced parameters, write data given to parameters (`p.data = t`) into the
        store; returns the layers whose parameters changed in place. What `load_state_dict` runs first (it is how
        in-place changes of encoded experts are written, so it must not refuse them)."""
        changed, moved = [], []
        for layer in self._watched if layers is None else layers:
            params = self._watched[layer]
            now = [
                (p._version, p.data_ptr()) if table.get(name) is p else None
                for (table, name), p in zip(self._entries[layer], params)
            ]
            moved_modules = [path for d, name, m, path in self._module_links[layer] if d.get(name) is not m]
            if now == self._seen[layer] and not moved_modules:
                continue
            if None in now or moved_modules:
                replaced = moved_modules or [path for path, seen in zip(self._paths[layer], now) if seen is None]
                raise UnsupportedOperationError(
                    f"the expert parameter(s) or their modules {', '.join(replaced)} of MoE layer {layer} were replaced by "
                    "other tensors or modules (an assignment; a parametrization, such as peft's LoRA on experts: "
                    "target_parameters, or target_modules naming expert projections or 'all-linear'; "
                    "torch.func.functional_call; accelerate's cpu_offload or dispatch_model onto the CPU or disk). "
                    "mira-hf computes with its store "
                    "of the experts, which changes in place (with torch.no_grad(): p.copy_(new)) and "
                    "model.load_state_dict(...) reach; nothing was done. Put the original parameters back and write "
                    "new values one of those ways (or put them back, model.unload(), and change the unwrapped model). "
                    "An adapter on the experts (peft) is merged into the unwrapped model (merge_and_unload()) before "
                    "wrapping; adapters on attention and other modules run on the wrapped model as they are."
                )
            was = self._seen[layer]
            (moved if any(a[1] != b[1] for a, b in zip(now, was)) else changed).append(layer)
        for layer in moved:
            self._adopt(layer)
        return changed

    def assign(self, layer: int, given: Mapping[str, torch.Tensor]) -> None:
        """Write `given` (path on the proxy -> a tensor put in place of that expert parameter, as `model.apply`'s `fn`
        may do on the unwrapped module) into the store, as `load_state_dict` writes experts."""
        placeholders = [path for path, t in given.items() if t.is_meta]
        if placeholders:  # computed from a placeholder (`p * 0.5`): the values the unwrapped model would hold are unknown
            raise UnsupportedOperationError(
                f"model.apply's fn put tensors on the meta device in place of the expert parameter(s) {placeholders} of "
                f"MoE layer {layer}: the store holds those experts {self.manager.held_as_placeholders}, their parameters "
                f"are placeholders, and what is computed from them holds no values to write. "
                f"{self.manager.placeholders_remedy}"
            )
        self._adopt(layer, given, "a parameter model.apply's fn put in its place")

    def _adopt(self, layer: int, given: Mapping[str, torch.Tensor] | None = None, how: str = "p.data = ...") -> None:
        """Write the data `layer`'s expert parameters were given (`p.data = t`), or the tensors `given` by path in their
        place, into the store, as `load_state_dict` writes experts; a parameter still a placeholder keeps the stored
        values."""
        store, proxy, given = self.store, self.proxies[layer], given or {}
        layout, E = proxy.experts_layout, store.num_experts(layer)
        fused = {}
        for name, (shape, dtype) in store.expert_specs(layer).items():
            parts = [(given[path] if path in given else layout.get(proxy, path)).detach() for path in layout.paths(name, E)]
            if any(p.is_meta for p in parts):
                current = layout.parts(name, store.fused(layer)[name])
                parts = [c if p.is_meta else p for p, c in zip(parts, current)]
            joined = layout.joined(proxy, name, parts)
            if joined.dtype != dtype or tuple(joined.shape) != (E, *shape):
                raise UnsupportedOperationError(
                    f"the expert parameter {name} of MoE layer {layer} was given data of {joined.dtype} "
                    f"{tuple(joined.shape)} ({how}), where the experts are {dtype} {(E, *shape)}. Give it data of "
                    "the same shape and dtype, or cast the whole model (model.to(dtype))."
                )
            fused[name] = joined.to("cpu").contiguous()
        with torch.no_grad():
            self.write(layer, fused)

    def hide(self, proxy: nn.Module) -> None:
        for path in self._paths.get(proxy.layer, ()):  # none where `install` stopped before exposing them
            proxy.experts_layout.pop(proxy, path)
        proxy.restore_owners()
        for table in (self._watched, self._paths, self._entries, self._module_links, self._owners, self._seen):
            table.pop(proxy.layer, None)

    # -- state dict -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def saving(self, experts) -> Iterator[None]:
        """Within it, state_dict() on this thread takes encoded layers' tensors from `experts` (`unload.SaveExperts`:
        decoded once, where host memory allows); other threads' decode their own copies."""
        self._saving.experts = experts
        try:
            yield
        finally:
            self._saving.experts = None

    def save(self, proxy: nn.Module, destination: dict, prefix: str, keep_vars: bool) -> bool:
        """Put decoded copies of an encoded layer's tensors in `destination` (within `saving`, those it gives), and the
        parameters holders keep (`_HeldExperts`); False where the proxy's own parameters (views of raw records) go in
        as they are."""
        store, layout = self.store, proxy.experts_layout
        if not store.quantized and not layout.nested:
            return False
        if not store.exact:
            warnings.warn(
                f"the experts are stored as {store.codec.name}: state_dict() gives their dequantized values, not "
                "the checkpoint's. Load the model again without quantization for the original weights.",
                stacklevel=4,
            )
        own = proxy._parameters.items() if layout.nested else ()  # a block's own (a bias), first, as it keeps them
        for name, param in own:
            if param is not None:
                destination[prefix + name] = param if keep_vars else param.detach()
        decoded = None
        if store.quantized:
            saving = getattr(self._saving, "experts", None)
            decoded = saving.fused(proxy.layer) if saving is not None else store.fused(proxy.layer)
        parts = {name: separate(layout.parts(name, t)) for name, t in decoded.items()} if decoded is not None else None
        for name, i, path in _entries(layout, store, proxy.layer):
            if parts is not None:
                destination[prefix + path] = parts[name][i]
            else:
                param = layout.get(proxy, path)
                destination[prefix + path] = param if keep_vars else param.detach()
        return True

    def load(
        self,
        proxy: nn.Module,
        state_dict: dict,
        prefix: str,
        missing_keys: list,
        unexpected_keys: list,
        error_msgs: list,
        local_metadata: Mapping | None = None,
    ) -> None:
        """`proxy`'s part of `load_state_dict`, as torch's `_load_from_state_dict` reports it: expert tensors
        are cast to the stored dtype (as `copy_` would) and written into the store; with `assign=True`, the layer's
        experts take the given tensors' dtype first (as assigned parameters would), and a tensor torch would not assign
        (an inference tensor for a parameter that requires grad, outside inference mode) is reported as torch reports
        it, its experts left as they are. Keys of the original experts module's other members go to `proxy.base`,
        whose own load reads them."""
        self._adopt_given_data()  # data given to expert parameters since the last step stays where this load gives none
        assign = bool((local_metadata or {}).get("assign_to_params_buffers", False))
        store, layer, layout = self.store, proxy.layer, proxy.experts_layout
        E = store.num_experts(layer)
        specs = store.expert_specs(layer)
        given = {}
        for name, (shape, _) in specs.items():
            paths = layout.paths(name, E)
            expected = [t.shape for t in layout.parts(name, torch.empty((E, *shape), device="meta"))]  # the module's
            values = {}
            for i, (path, shape_i) in enumerate(zip(paths, expected)):
                value = _loadable(state_dict, prefix + path, shape_i, missing_keys, error_msgs)
                if value is not None and assign:
                    value = _assignable(value, layout.get(proxy, path), prefix + path, error_msgs)
                if value is not None:
                    values[i] = value
            if values and len(values) < len(paths):  # some of a tensor's experts (one module each): the others stay
                current = layout.parts(name, store.fused(layer)[name])
                values = {i: values.get(i, current[i]) for i in range(len(paths))}
            if values:
                given[name] = layout.joined(proxy, name, [values[i] for i in range(len(paths))])
        base = proxy.base
        base_names = {*base._parameters, *base._buffers, *base._modules}
        for key in [k for k in state_dict if k.startswith(prefix)]:
            head = key[len(prefix) :].split(".", 1)[0]
            if head in proxy._modules and base._modules.get(head) is proxy._modules[head] and head != "base":
                # a member both hold (Ergo's per-expert norms): its load runs under both names, so both get the value
                state_dict.setdefault(prefix + "base." + key[len(prefix) :], state_dict[key])
            if key[len(prefix) :] in specs or head == "base" or head in proxy._modules:
                continue  # (a member's keys are read, or reported, by its own load)
            if head in base_names:  # a member the proxy keeps on `base` alone
                state_dict[prefix + "base." + key[len(prefix) :]] = state_dict.pop(key)
            else:
                unexpected_keys.append(key)
        if not given:
            return
        dtype = store.dtype(layer)
        try:
            if assign:
                dtype = self._assigned_dtype(layer, given, dtype)
            fused = {n: t.detach().to("cpu", dtype).contiguous() for n, t in given.items()}
            self.write(layer, fused)
        except (ValueError, UnsupportedOperationError) as exc:  # a budget or format they do not fit: the layer unchanged
            error_msgs.append(f"{prefix}*: {exc}")

    def _assigned_dtype(self, layer: int, given: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.dtype:
        """`load_state_dict(..., assign=True)`: the dtype of the tensors given for `layer`'s experts, to which the
        layer is cast first (the unwrapped model's parameters become the given tensors). One dtype for all of them."""
        dtypes = {t.dtype for t in given.values()}
        if dtypes == {dtype}:
            return dtype
        if len(dtypes) > 1 or len(given) < len(self.store.expert_specs(layer)):
            raise ConfigError(
                f"load_state_dict(assign=True) gave MoE layer {layer}'s expert tensors {sorted(map(str, dtypes))} for "
                f"{sorted(given)}, where its experts are {dtype}: mira-hf keeps one dtype per layer's experts. Give all "
                "of them in one dtype, or load without assign=True (the values are cast to the model's dtype)."
            )
        new = dtypes.pop()
        change = self.plan_change({dtype: new}, self.manager.device, [layer])
        if change is not None and hasattr(change.layouts[layer], "chain"):
            # the records would stay in their own dtype: other values than the cast's need a format that holds `new`
            # (asked last: planning lossless records reads the layer), else they are refused before the cast
            cast = {n: t.to(new) for n, t in self.store.fused(layer).items()}
            if not all(torch.equal(t.detach().cpu(), cast[n]) for n, t in given.items()) and not self._encodes(layer, new):
                raise UnsupportedOperationError(
                    f"load_state_dict(assign=True) gave MoE layer {layer}'s experts {new} tensors, which its "
                    f"{self.store.codec.name} records cannot hold: they keep {dtype} values. Nothing was changed. Load "
                    f"them without assign=True (the values cast to {dtype}), or call model.unload() and load them into that."
                )
        if change is not None:
            self.apply_change(change)
            self.forget_routers()
        return self.store.dtype(layer)

    def _encodes(self, layer: int, dtype: torch.dtype) -> bool:
        """Whether `layer`'s records can be encoded again in `dtype` (other values written into them)."""
        if not self.store.writable:
            return False
        try:
            self.store.plan_rewrite(layer, dtype=dtype)
        except ConfigError:
            return False
        return True

    @builds_normal_tensors
    def write(self, layer: int, fused: Mapping[str, torch.Tensor]) -> None:
        """Encode `fused` (some or all of `layer`'s tensors, `[E, ...]`, the stored dtype) into the store and
        empty the manager's cache. A record that changes size (lossless) is planned first: a plan that does
        not fit raises before anything changes. New records are normal tensors, also when written inside
        `torch.inference_mode()`."""
        store, manager = self.store, self.manager
        chain = getattr(store.layout(layer), "chain", None)  # records cast in place (`ExpertStore.plan_cast`)
        if not store.writable or chain is not None:
            current = store.fused(layer)
            if all(torch.equal(t, current[n]) for n, t in fused.items()):
                self.expose(self.proxies[layer])  # the values it holds (a model's own state dict loaded back)
                return
            if not store.writable:
                raise UnsupportedOperationError(f"other values for MoE layer {layer}'s experts: {manager.placeholders_remedy}")
            try:
                layout = store.plan_rewrite(layer, fused)  # encoded in the layer's dtype, where the format holds it
            except ConfigError:
                layout = None
            if layout is not None:
                return self._rewrite(layer, fused, layout)
            raise UnsupportedOperationError(
                f"other values for MoE layer {layer}'s experts: the model was cast to {chain[-1]} after loading, which "
                f"its {store.codec.name} records cannot hold (they decode to {chain[0]} and are cast at every use), so "
                f"no other {chain[-1]} values can be written into them. Call model.unload() and load them into that (and "
                f"wrap it again with quantization=None, whose records hold any dtype), or, for {chain[0]} values, cast "
                f"the model back to {chain[0]} first."
            )
        self._rewrite(layer, fused, store.plan_rewrite(layer, fused))

    def _rewrite(self, layer: int, fused: Mapping[str, torch.Tensor], layout) -> None:
        """Encode `fused` into `layer`'s records as `layout` (from `plan_rewrite`), with the slots planned again where
        the records change size."""
        store, manager = self.store, self.manager
        budget = manager.budget
        if layout != store.layout(layer):
            self._check_offload_room({layer: (store.dtype(layer), layout)}, f"loading MoE layer {layer}'s experts")
            layouts = {li: store.layout(li) for li in store.layers}
            layouts[layer] = layout
            raw_bytes = {li: store.raw_layout(li).nbytes for li in store.layers}
            budget = self.replan(layouts, raw_bytes, manager.device, self._expert_bytes({}))
        manager.loader.synchronize()  # no copy still reads the records about to change
        store.rewrite(layer, fused, layout=layout)
        manager.relocate(manager.store, budget, manager.device)
        self.expose(self.proxies[layer])

    # -- casts and moves ------------------------------------------------------------------------
    def target(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[dict[torch.dtype, torch.dtype], torch.device]:
        """What `fn` does to the experts: stored dtype -> new dtype, and the device the cache goes to,
        from a one-element probe of each stored dtype on the cache's device. Raises before anything changes
        where the probe fails (e.g. `.cuda()` without a GPU) or the target is no supported device."""
        manager = self.manager
        dtypes, device = {}, manager.device
        for dtype in {self.store.dtype(layer) for layer in self.store.layers}:
            try:
                out = fn(torch.zeros(1, dtype=dtype, device=manager.device))
            except Exception as exc:
                raise DeviceError(
                    f"this cast or move cannot reach the experts (a probe of it on {manager.device} raised: {exc}). "
                    "Nothing was changed."
                ) from exc
            dtypes[dtype], device = out.dtype, out.device
        if device.type not in SUPPORTED_DEVICES:
            raise DeviceError(
                f"the model was asked to move to {device}; mira-hf keeps the expert cache on {', '.join(SUPPORTED_DEVICES)} "
                f"devices only. Nothing was changed: keep it on {manager.device}, or move it to a CUDA device."
            )
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return dtypes, device

    def plan_change(self, dtypes: Mapping[torch.dtype, torch.dtype], device: torch.device, layers=None):
        """Check that the store can follow a cast (`dtypes`: stored -> new) of `layers` (None: all) and/or move
        (`device`), and return what applies it (new layouts and slot plan), or None where nothing changes for the
        experts."""
        store, manager = self.store, self.manager
        layers = store.layers if layers is None else layers
        cast = {layer: dtypes[store.dtype(layer)] for layer in layers if dtypes[store.dtype(layer)] != store.dtype(layer)}
        if not cast and device == manager.device:
            return None
        for layer, dtype in cast.items():
            old = store.dtype(layer)
            if not (dtype.is_floating_point and old.is_floating_point):
                raise ConfigError(
                    f"the experts are stored as {old} and cannot be cast to {dtype}: mira-hf casts floating-point "
                    "experts to floating-point dtypes. Nothing was changed."
                )
            if not store.writable and manager.placement != "dequant":
                raise UnsupportedOperationError(
                    f"the experts are kept in the checkpoint's own {store.codec.name} bytes and computed by "
                    f"transformers' {store.codec.name} kernels (placement {manager.placement!r}), which compute in "
                    f"the format itself, not in {dtype}. Nothing was changed. Load the model in that dtype "
                    f"(MiraMoEModel.from_pretrained(..., dtype={dtype})), or call model.unload() and cast that."
                )
            if store.quantized and not store.exact:
                raise UnsupportedOperationError(
                    f"the experts are stored as {store.codec.name} (lossy): casting them to {dtype} would not give what "
                    f"casting the original model gives. Nothing was changed. Load the model again in that dtype "
                    f"(MiraMoEModel.from_pretrained(..., dtype={dtype})), or call model.unload() (dequantized weights) "
                    "and cast that."
                )
        layouts = {layer: store.layout(layer) for layer in store.layers}
        raw_bytes = {layer: store.raw_layout(layer).nbytes for layer in store.layers}
        for layer, dtype in cast.items():
            layouts[layer] = self._cast_layout(layer, dtype)
            specs = {n: (shape, dtype) for n, (shape, _) in manager.store.expert_specs(layer).items()}  # what a slot holds
            raw_bytes[layer] = IdentityCodec().plan(specs).nbytes
        self._check_offload_room({layer: (dtype, layouts[layer]) for layer, dtype in cast.items()}, "this cast")
        budget = self.replan(layouts, raw_bytes, device, self._expert_bytes(cast))
        return _Change(cast, layouts, budget, device)

    def _check_offload_room(self, changes: Mapping[int, tuple[torch.dtype, object]], what: str) -> None:
        """`BudgetError` before anything changes where `offload_dir` has not room for the records that rewriting the
        layers in `changes` (layer -> (dtype, layout)) writes there: each layer's new file beside its old one."""
        need = self.store.offload_bytes_to_rewrite(changes)
        if need:
            remedy = "load the model again in that dtype (from_pretrained(..., dtype=...)), or with a larger host_budget"
            offload_files.check_room(self.store.offload_dir, need, what, remedy)

    def _expert_bytes(self, cast: Mapping[int, torch.dtype]) -> dict[int, int]:
        """Bytes of one whole expert of each layer, uncompressed, in its dtype after `cast` (layer -> new dtype): what
        a fractional budget is a share of, where slots may hold less (device parts, with `host_compute="split"`)."""
        store = self.store
        return {
            layer: IdentityCodec()
            .plan({n: (shape, cast.get(layer, d)) for n, (shape, d) in store.expert_specs(layer).items()})
            .nbytes
            for layer in store.layers
        }

    def _cast_layout(self, layer: int, dtype: torch.dtype):
        """The layout of `layer`'s records once cast to `dtype`: the same records decoded to their own dtype and cast
        at every use (`plan_cast`) where the cast widens encoded records (bf16 lossless ones to fp32: no value
        changes, and the records stay as small as they are) or their format cannot hold `dtype` (the checkpoint's own
        FP8/MXFP4 bytes, lossless records cast to fp16); else encoded again as the cast tensors. Either way the
        experts compute with the tensors the unwrapped model holds after the same cast."""
        store = self.store
        encoded = not isinstance(store.codec, IdentityCodec)
        if encoded and widens(store.dtype(layer), dtype):
            return store.plan_cast(layer, dtype)  # nothing to round: the records stay, as small as they are
        if store.writable:
            try:
                return store.plan_rewrite(layer, dtype=dtype)
            except ConfigError:
                if not encoded:
                    raise
        return store.plan_cast(layer, dtype)

    @builds_normal_tensors
    def apply_change(self, change: _Change) -> None:
        """Re-encode the cast layers (one at a time), rebuild the cache on the target device, and point
        every proxy's parameters at the new records: normal tensors, as at wrapping, even when cast in inference
        mode."""
        store, manager = self.store, self.manager
        manager.loader.synchronize()
        for layer, dtype in change.cast.items():
            store.rewrite(layer, dtype=dtype, layout=change.layouts[layer])
        manager.relocate(manager.store, change.budget, change.device)
        for proxy in self.proxies.values():
            self.expose(proxy)

    def apply_from(self, module: nn.Module, fn, recurse: bool):
        """`module._apply(fn)` with the experts following: learn what `fn` does, refuse before anything changes
        what the store cannot follow (or a move of a part of the model that holds only some of the experts: the
        layers share one device cache), re-encode and relocate, then let `fn` reach the rest. A cast of a part casts
        the experts it holds, as casting that part of the unwrapped model casts its tensors (`model.apply(lambda m:
        m.to(dtype))` reaches every module so, one after another)."""
        try:
            self.edited()  # data given to expert parameters since the last step (`p.data = t`) is cast with the rest
            change = self._planned(module, fn)
        except MiraError as exc:
            if not on_stack(_APPLY_CODES):  # not reached through `Module.apply`
                raise
            raise type(exc)(
                f"{exc} This cast or move came through model.apply(...), which had already applied it to the modules it "
                "visited before this one: those stay changed. Apply it to the model itself instead (model.to(...), "
                "model.half(), ...), or load the model again."
            ) from exc
        if change is not None:
            self.apply_change(change)
        self.applying = True
        try:
            return type(module)._apply(module, fn, recurse)
        finally:
            self.applying = False
            if change is not None:
                self.forget_routers()

    def _planned(self, module: nn.Module, fn):
        """`apply_from`'s checks, before anything changes: the change `fn` makes to the experts `module` holds."""
        dtypes, device = self.target(fn)
        layers = None
        if device != self.manager.device or any(a != b for a, b in dtypes.items()):
            inside = {id(m) for m in module.modules()}
            layers = [layer for layer, proxy in self.proxies.items() if id(proxy) in inside]
            if len(layers) < len(self.proxies) and device != self.manager.device:
                raise UnsupportedOperationError(
                    f"a part of a mira-hf model ({type(module).__name__}) was moved to {device}: its experts share one "
                    f"device cache with the other layers, so they follow only a move of a module that holds them all. "
                    "Nothing was changed. Call model.to(...) or model.cuda() on the model itself."
                )
        return self.plan_change(dtypes, device, layers)

    def forget_routers(self) -> None:
        """After a cast or move: predictors take the routers again (their buffers are new tensors)."""
        for holder in (self.manager.router_probs, self.manager.predictor):
            forget = getattr(holder, "forget_routers", None)
            if forget is not None:
                forget()


@dataclass(frozen=True)
class _Change:
    cast: dict[int, torch.dtype]  # layer -> new dtype (layers whose dtype changes)
    layouts: dict[int, object]  # layer -> record layout after the change
    budget: BudgetPlan  # the slot plan on the target device
    device: torch.device


# -- the wrapped model's side ---------------------------------------------------------------------
def install(
    model: nn.Module,
    manager: ExpertManager,
    proxies: list,
    parameters: Mapping[int, MakeParameter],
    replan: Replan,
) -> None:
    """Give each proxy its expert parameters and state-dict hook, and the model and every module above a
    proxy an `_apply` of their own (per instance), so that a cast or move from any of them is served or refused
    before it changes anything. On an exception (a KeyboardInterrupt included) what it did is undone first."""
    state = ExpertState(manager, {p.layer: p for p in proxies}, replan)
    try:
        for proxy in proxies:
            object.__setattr__(proxy, "_mira_state", state)  # shared, not a submodule
            state.expose(proxy, parameters[proxy.layer])
            proxy._mira_hook = proxy.register_state_dict_post_hook(_unwrapped_names)
            proxy._mira_load_hook = proxy.register_load_state_dict_post_hook(_missing_once)
        served = {id(p) for p in proxies}
        for module in model.modules():
            if id(module) not in served and any(id(m) in served for m in module.modules()):
                module._mira_state = state
                module._apply = bound_weakly(_ancestor_apply, module)
    except BaseException:
        _uninstall(model, state)
        raise


def uninstall(model: nn.Module) -> None:
    """Undo `install` (for `unload`, and a wrap that fails after it)."""
    _uninstall(model, model._mira_state)


def _uninstall(model: nn.Module, state: ExpertState) -> None:
    """Undo what `install` did with `state`, all of it or the part done before an exception."""
    for module in model.modules():
        if module.__dict__.get("_mira_state") is state:
            del module.__dict__["_mira_state"]
            module.__dict__.pop("_apply", None)
    for proxy in state.proxies.values():
        state.hide(proxy)
        for name in ("_mira_hook", "_mira_load_hook"):
            handle = proxy.__dict__.pop(name, None)
            if handle is not None:
                handle.remove()
        proxy.__dict__.pop("_mira_state", None)


def _ancestor_apply(module: nn.Module, fn, recurse: bool = True):
    """`_apply` of the model and of every module above a proxy."""
    state: ExpertState = module._mira_state
    if state.applying:  # reached from a cast or move of a module above, which the experts follow already
        return type(module)._apply(module, fn, recurse)
    return state.apply_from(module, fn, recurse)


def _entries(layout, store, layer: int) -> list[tuple[str, int, str]]:
    """(tensor name, index in its `FusedExperts.paths`, path) of each of `layer`'s expert parameters on a proxy, in
    the unwrapped module's order: tensor by tensor, or expert by expert where each expert is a module."""
    E = store.num_experts(layer)
    per_name = [[(name, i, path) for i, path in enumerate(layout.paths(name, E))] for name in store.expert_specs(layer)]
    return [entry for group in zip(*per_name) for entry in group]


def separate(parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A tensor's parts at its several paths (`ExpertModules`: views of one `[E, ...]` tensor), each on a storage of its
    own, as the unwrapped model's separate parameters are (`store.own_storage`)."""
    return parts if len(parts) == 1 else tuple(own_storage(p) for p in parts)


def at_paths(layout, name: str, tensor: torch.Tensor, num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, part) of the fused `[E, ...]` `tensor` named `name` at each path the module keeps it at (one for fused
    experts, one per expert for `ExpertModules`), each part as `separate` gives it."""
    return zip(layout.paths(name, num_experts), separate(layout.parts(name, tensor)))


def put_data(param: nn.Parameter, data: torch.Tensor) -> bool:
    """Make `data` the tensor `param` holds, keeping the object (optimizers and references held stay valid): `.data =
    data`, or, between a real tensor and a `meta` placeholder (which `.data` cannot exchange), the two tensors'
    contents swapped (`torch.utils.swap_tensors`), `param`'s requires_grad and attributes kept; its gradient, on the
    other device, is dropped. False, `param` unchanged, where torch refuses the swap (a weak reference to `param`, or a
    view of it still alive)."""
    if param.is_meta == data.is_meta:
        param.data = data
        return True
    new = nn.Parameter(data, requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)
    try:
        torch.utils.swap_tensors(param, new)
    except RuntimeError:
        return False
    return True


def _links(module: nn.Module, path: str) -> list[tuple[dict, str, nn.Module, str]]:
    """(parent's `_modules`, name, child, the child's path) for each module between `module` and the owner of the
    parameter at `path`."""
    out, parent, names = [], module, path.split(".")[:-1]
    for i, name in enumerate(names):
        child = parent._modules[name]
        out.append((parent._modules, name, child, ".".join(names[: i + 1])))
        parent = child
    return out


def expert_paths(layout, store, layer: int) -> list[str]:
    """The paths of `layer`'s expert parameters on its proxy (relative to it), in the unwrapped module's order."""
    return [path for _, _, path in _entries(layout, store, layer)]


def _loadable(state_dict: Mapping, key: str, expected: torch.Size, missing_keys: list, error_msgs: list):
    """`state_dict[key]` where it can be loaded into a parameter of shape `expected`, else None, the reason
    reported as torch's `_load_from_state_dict` reports it."""
    if key not in state_dict:
        missing_keys.append(key)
        return None
    value = state_dict[key]
    if not isinstance(value, torch.Tensor):
        error_msgs.append(
            f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like object from '
            f"checkpoint but received {type(value)}"
        )
    elif value.shape != expected:
        error_msgs.append(
            f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, the shape in "
            f"current model is {expected}."
        )
    elif value.is_meta:
        error_msgs.append(f"{key}: the given tensor is on the meta device (it holds no values to load).")
    else:
        return value
    return None


def _assignable(value: torch.Tensor, param: nn.Parameter, key: str, error_msgs: list) -> torch.Tensor | None:
    """`value` where `load_state_dict(assign=True)` would make it the parameter `param` stands for, else None, the
    reason reported as torch's `_load_from_state_dict` reports it (an inference tensor given outside inference mode
    for a parameter that requires grad). mira-hf writes the values into its store instead of assigning the tensor,
    but refuses what torch refuses, and leaves those experts as they are."""
    try:
        nn.Parameter(value, requires_grad=param.requires_grad)  # torch's assignment, made and dropped
    except Exception as exc:
        error_msgs.append(
            f'While copying the parameter named "{key}", whose dimensions in the model are {param.size()} and '
            f"whose dimensions in the checkpoint are {value.size()}, an exception occurred : {exc.args}."
        )
        return None
    return value


def proxy_apply(proxy: nn.Module, fn, recurse: bool = True):
    """A proxy's `_apply`: `fn` reaches its other members (`base`), never its expert parameters (those follow
    a cast or move through the store)."""
    state: ExpertState | None = getattr(proxy, "_mira_state", None)
    if state is not None and not state.applying:
        return state.apply_from(proxy, fn, recurse)
    if recurse:
        for child in proxy.children():
            child._apply(fn)
    return proxy


def _missing_once(module: nn.Module, incompatible_keys) -> None:
    """Load-state-dict post-hook of a proxy: a member both the proxy and `base` hold (Ergo's per-expert norms) is
    loaded under both names; a key missing for it is reported once, under its unwrapped name."""
    missing = incompatible_keys.missing_keys
    for key in [k for k in missing if ".base." in k]:
        if key.replace(".base.", ".", 1) in missing:
            missing.remove(key)


def _unwrapped_names(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict post-hook of a proxy: members of the original experts module that the proxy keeps on `base`
    (`prefix.base.x`) get their unwrapped names (`prefix.x`)."""
    for key in [k for k in state_dict if k.startswith(prefix + "base.")]:
        state_dict[prefix + key[len(prefix) + len("base.") :]] = state_dict.pop(key)
