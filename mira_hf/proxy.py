"""`MiraExperts`: the module that takes the place of a block's routed experts.

Only the routed experts are replaced: the block's router, routing buffers and shared experts stay
where transformers put them, so routing is transformers' own code (identical numerics) and
`output_router_logits` and the aux loss keep working. The forward has the signature of transformers'
experts modules, `(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`.

Each (token, slot) row gets its own output row, weighted and summed over K at the end as the experts
implementation the unwrapped model would run does (`experts_impl`): the result does not depend on which
experts were resident or in which order their copies arrived, and is bit-identical to the unwrapped model's.
Under torch.compile each proxy is one opaque operator (`ops`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from model_adapters.base import FUSED_EXPERTS, ExpertModules, RoutedBlockExperts, SeparateGluExperts

from .errors import ConfigError, UnsupportedOperationError
from .experts_impl import (
    batched_linear,
    batched_rows,
    check_call,
    combine,
    eager_arithmetic,
    grouped_linear,
    implementation_of,
)
from .host_compute import host_expert_math
from .layout import PackedWeights, decodes_exactly
from .manager import ExpertManager
from .neuron_split import NARROW, wide_batched_linear, wide_linear
from .ops import RefuseBackward, register
from .state import proxy_apply
from .weak import weak_method


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype of the autocast running on `x`'s device, or None (what a compiled graph gives the experts operators,
    which it calls outside the autocast)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


# Expert tensor names of transformers' fused experts modules (per expert after dropping dim 0).
KNOWN_EXPERT_TENSORS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
# The layout flags the proxy computes with, and their values where neither the module nor its adapter sets them.
LAYOUT_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "has_post_expert_norm": False}
TRANSFORMERS_FLAGS = ("has_gate", "has_bias", "is_transposed")


def layout_flags(adapter, module: nn.Module) -> dict[str, bool]:
    """Every LAYOUT_FLAGS entry for experts module `module`, as its adapter resolves them."""
    return {n: adapter.flag(module, n, default) for n, default in LAYOUT_FLAGS.items()}


MAX_GROUPS = 1023  # groups torch's grouped matmul takes in one call (fewer than 1024)
CPU_ALIGNMENT = 64  # bytes: where torch's CPU allocator starts a tensor


_UNPROBED = object()  # `MiraExperts._probed` before its first probe


class MiraExperts(nn.Module):
    """Routed experts served by an `ExpertManager`. `base` is the original experts module with its
    expert tensors removed (kept for its gate function, activation, flags and config, and for `unload`).

    Computes what `base` computes under the experts implementation its config names at the call
    (`mira_hf.experts_impl`): the same matmuls on the same rows, weighted and summed in the same order
    and dtypes, so the logits are bit-identical to the unwrapped model's."""

    # Devices whose grouped matmul gives each row the same bits whatever other rows and groups share the call, so
    # resident experts may share one (`_on_slots`). Not the CPU: where threads split the rows, a CPU kernel may round
    # a row by its place (docs/ARCHITECTURE.md), and there the launches this saves cost little.
    GROUPED_SLOT_DEVICES = frozenset({"cuda"})

    def __init__(
        self,
        base: nn.Module,
        manager: ExpertManager,
        layer: int,
        flags: dict[str, bool],  # every LAYOUT_FLAGS entry, resolved for `base` (MoEAdapter.flag)
        block_tokens: int | None = None,
        route_norm: str = "",  # MoEAdapter.route_norm (MiraRouteNormExperts)
    ) -> None:
        super().__init__()
        self._route_norm = route_norm
        # The experts module's members (its activation; Ergo's per-expert norms, which hold tensors besides the
        # experts) under their unwrapped names, ahead of `base`, which holds them too: named_parameters() gives the
        # unwrapped model's names, named_modules() and get_submodule() them too, `base` besides (state_dict() renames
        # `base.x` to `x`: `state`).
        for name, child in base.named_children():
            self.add_module(name, child)
        self.base = base
        self.training = base.training  # the mode of the module it replaces (train() and eval() reach both)
        # Hooks on the experts module run around the proxy, which is called in its place: the proxy takes its hook
        # tables (so a handle registered before wrapping still removes its hook) and `base`, listed by
        # named_modules() but never called, gets empty ones; unload() gives the tables back (`give_back_hooks`).
        for name in CALL_HOOK_TABLES:
            table = getattr(base, name)
            object.__setattr__(self, name, table)
            object.__setattr__(base, name, type(table)())
        self._is_full_backward_hook, base._is_full_backward_hook = base._is_full_backward_hook, None
        self.layer = layer
        self.block_tokens = block_tokens  # CacheConfig.prefill_block_tokens: rows per matmul, None = all
        self.num_experts = self.experts_layout.num_experts(base)
        object.__setattr__(self, "manager", manager)  # shared, not a submodule
        self._has_gate = flags["has_gate"]
        self._up = "gate_up_proj" if self._has_gate else "up_proj"
        self._has_bias = flags["has_bias"]
        self._transposed = flags["is_transposed"]
        self._post_norm = flags["has_post_expert_norm"]
        self._down, self._down_transposed = "down_proj", self._transposed
        self._tensor_names()
        # Resolved once, off the module's own loop: the dtypes eager computes and sums the weighted rows in (experts_impl).
        self._eager_arithmetic = eager_arithmetic(base, flags)
        # Resolved once: the gate function transformers' decorator gives every experts module (None: gate
        # columns first, then up, as Llama 4's experts), and whether slots hold packed records.
        self._apply_gate = getattr(base, "_apply_gate", None)
        self._gated_together = False  # the block's gate function takes more than one row at once (set per block)
        self._probed: tuple[object, bool] = (_UNPROBED, False)  # (activation probed, whether it rounds by layout)
        self._packed = manager.placement == "packed"
        self._kept_packed = manager.placement == "mixed"  # experts kept packed compute as their decoded slots would
        self._split = manager.host.mode == "split"  # each expert's host part computed on the host (neuron_split)
        # Whether batched_mm's gather of decoded weights gives the unwrapped model's bits: unpacked experts, or packed
        # records (in slots, or kept beside them: "mixed") that decode exactly (`decodes_exactly`).
        self._gathers = manager.placement not in ("packed", "mixed") or decodes_exactly(manager.store.codec)
        self._handle = register(self)  # how the compiled graph's operator finds this module
        raw = manager.store.raw_layout(layer)
        self._row_bytes = raw.payload_bytes  # one expert's weights, as batched_mm copies them
        fn, hidden = host_expert_math(self, raw)  # host_compute.py
        fn = self._host_part if manager.host.mode == "split" else fn
        # weakly: the manager's host path does not keep the model's proxies alive (`mira_hf.weak`)
        manager.host.register(layer, None if fn is None else weak_method(fn), hidden)
        # transformers' flags of an experts module (`@use_experts_implementation`), where `base` has them: its
        # code finds experts modules, and reads their layout, by them (parallel plans, exporters, quantizers)
        for flag in TRANSFORMERS_FLAGS:
            if hasattr(base, flag):
                setattr(self, flag, getattr(base, flag))
        self._built = True  # the attributes set so far are this module's own; later writes may reach `base` (`__setattr__`)

    def __getattr__(self, name: str):
        """nn.Module's lookup (parameters, buffers, submodules), then the public attributes of the experts module
        this proxy stands in for (`intermediate_dim`, `config`, a gate's `alpha` and `limit`, transformers' layout
        flags), as code reading them off the unwrapped model's experts module finds them there."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            base = self.__dict__.get("_modules", {}).get("base")
            if base is None or name.startswith("_") or name not in vars(base):  # (its tensors and modules: not there)
                raise
            return vars(base)[name]

    def __setattr__(self, name: str, value) -> None:
        """nn.Module's, except that a write to a public attribute or a member of the experts module this proxy stands
        in for (its activation, a gate's `alpha` and `limit`) reaches that module (`base`): the experts compute with
        what it holds, and `unload` gives it back. A member is replaced here too, where named_modules() lists it
        (`set_submodule` writes there). This module's own attributes (those its __init__ set) stay here."""
        if not self._reaches_base(name):
            super().__setattr__(name, value)
            return
        members = self._base_members()
        if name in members:
            super().__setattr__(name, value)  # (refuses what nn.Module refuses for a member, before `base` changes)
            members[name] = value
        else:
            setattr(self.base, name, value)

    def _reaches_base(self, name: str) -> bool:
        """Whether a write to `name` goes to `base` (`__setattr__`): a public name this module does not hold itself,
        which `base` holds as an attribute or a member."""
        own = self.__dict__
        if not own.get("_built") or name.startswith("_") or name in own:
            return False
        return name in self._base_members() or name in vars(self.base)

    def _base_members(self) -> dict[str, nn.Module | None]:
        """Where `base` keeps its members (children) while wrapped, which `unload` gives back: its own table."""
        return self.base._modules

    # Where this module keeps its expert parameters (`model_adapters.FusedExperts`: its own, as the original
    # module did), read by `state` and `apply`.
    experts_layout = FUSED_EXPERTS
    # Whether the module's eager loop gives each expert its rows in a tensor of their own (transformers' loop gathers
    # them per expert), rather than slices of one gather of all rows (JetMoE's block splits one)
    _fresh_gather = True

    def _tensor_names(self) -> None:
        """Set the names of the tensors each projection reads (a subclass's layout names its own)."""

    def restore_owners(self) -> None:
        """Give `base` back the modules this proxy stood in for while it served them (none: its experts are `base`'s
        own tensors)."""

    def extra_repr(self) -> str:
        return f"layer={self.layer}, num_experts={self.num_experts}, record_bytes={self.manager.store.record_bytes(self.layer)}"

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one opaque operator in the graph (mira_hf.ops): the manager is stateful
            dtype = _autocast_dtype(hidden_states)
            return self._refusing(torch.ops.mira.experts(self._handle, hidden_states, top_k_index, top_k_weights, dtype))
        return self._served(hidden_states, top_k_index, top_k_weights)

    def _served(self, *inputs: torch.Tensor) -> torch.Tensor:
        """`serve(*inputs)`, one block at a time across threads (`ExpertManager.turn`: a block called outside a step
        waits for another thread's step); with autograd on, computed without it and given the refusal (`_refusing`)."""
        if torch.jit.is_tracing():
            raise UnsupportedOperationError(
                "torch.jit.trace cannot record a mira-hf model: which experts a block copies and computes depends on "
                "its routing, which a trace would freeze at the example's. torch.compile (fullgraph=True too) and "
                "torch.export run each MoE block as one operator instead; or trace the unwrapped model (model.unload())."
            )
        with self.manager.turn():
            if not torch.is_grad_enabled():
                return self.serve(*inputs)
            with torch.no_grad():
                result = self.serve(*inputs)
        return self._refusing(result, *inputs)

    def _refusing(self, result: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        """`result` of a forward with autograd on, made to require gradients where an expert parameter or one of
        `inputs` asks for them: a backward that reaches it raises mira-hf's refusal (the experts compute from cache
        slots, unseen by autograd) instead of leaving the experts' gradients silently None or failing elsewhere. The
        eager experts compute without autograd, so a forward records no tensor that depends on the cache (gradient
        checkpointing's recomputation, in the backward, finds what the forward saved, and the backward reaches
        the refusal)."""
        if torch.is_grad_enabled() and not result.requires_grad:
            state = getattr(self, "_mira_state", None)
            anchor = state.asking_for_grad(self.layer) if state is not None else None
            anchor = anchor if anchor is not None else next((t for t in inputs if t.requires_grad), None)
            if anchor is not None:
                return RefuseBackward.apply(result, anchor)
        return result

    def serve(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        impl = implementation_of(self.base)  # read at each call, as transformers does (generate swaps it)
        check_call(impl)
        if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
            self._bad_routing(f"expert indices of dtype {top_k_index.dtype}")
        self.manager.observe(self.layer, hidden_states, top_k_index)  # the predictor's copy is finished by the block's sync
        if impl == "eager" and self._eager_arithmetic == "fp32" and hidden_states.dtype != torch.float32:
            # a loop in fp32 throughout: rows, weights (`_linear`), gate and sum, cast back once
            return self._experts(hidden_states.float(), top_k_index, top_k_weights, impl).to(hidden_states.dtype)
        return self._experts(hidden_states, top_k_index, top_k_weights, impl)

    def _experts(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, impl: str
    ) -> torch.Tensor:
        """The weighted sum of each token's experts, as `impl` computes it, the block's routing observed."""
        # T tokens, K experts per token, H hidden, E experts; rows r = t * K + k
        T, H = hidden_states.shape
        K = top_k_index.shape[1]
        E = self.num_experts
        # grouped_mm and batched_mm apply the gate function once to the block's T*K rows; eager to each expert's
        self._gated_together = impl != "eager" and T * K > 1
        flat = top_k_index.reshape(-1)  # [T*K]
        if T == 1:
            picks = flat.tolist()  # [K] one host sync per block
            if not all(0 <= e <= E for e in picks):
                self._bad_routing(f"expert indices {picks}")
            if len(set(picks)) == K:  # distinct experts (as top-k picks are)
                return self._decode_step(hidden_states, top_k_index, top_k_weights, picks, impl)
            counts = [picks.count(e) for e in range(E + 1)]
        else:
            try:
                counts = torch.bincount(flat, minlength=E + 1).tolist()  # [E+1] one host sync per block; E = EP sentinel
            except RuntimeError:  # a negative index
                self._bad_routing(f"expert indices from {int(flat.min())} to {int(flat.max())}")
            if len(counts) > E + 1:
                self._bad_routing(f"expert indices up to {len(counts) - 1}")
        order = self._row_order(top_k_index, impl)  # [T*K] rows grouped by expert; after the sync, off its path
        starts, acc = [], 0
        for c in counts:
            starts.append(acc)
            acc += c
        needed = [e for e in range(E) if counts[e]]
        routed = T * K - counts[E]  # rows of real experts (the EP sentinel E sorts last); the rest stay zero
        order = order[:routed]
        if impl == "batched_mm" and self._gathers:
            rows = self._batched(hidden_states, top_k_index, needed, lambda e: order[starts[e] : starts[e] + counts[e]], routed)
            return self._combine(rows, None, hidden_states, top_k_index, top_k_weights, impl, flat == E if counts[E] else None)
        x = hidden_states[order // K]  # [routed, H]: each row's token, grouped by expert (one gather, not one per expert)
        y = None  # [routed, H], the experts' outputs in the same order
        kernel = impl == "grouped_mm"
        # transformers' eager loop gathers each expert's rows into a tensor of its own, and a CPU matmul can round by
        # where its input starts (MKL: 64-byte alignment): an expert's rows that do not start so are copied first
        realign = impl == "eager" and x.device.type == "cpu" and self._fresh_gather

        biases = _BiasRows((routed, H))  # host_compute="split": down biases added after the parts' sum is rounded

        def compute(plan, e: int, w) -> None:
            nonlocal y
            start, end = starts[e], starts[e] + counts[e]  # its rows, in the unwrapped model's order
            step = self.block_tokens or counts[e]  # token blocks share w
            for a in range(start, end, step):
                b = min(end, a + step)
                rows = x[a:b]
                rows = rows.clone() if realign and rows.data_ptr() % CPU_ALIGNMENT else rows
                part = self._expert(plan, e, w, rows, kernel, at=a)  # [n, H]
                if y is None:
                    y = part.new_empty((routed, H))
                y[a:b] = part
                biases.put(slice(a, b), self._down_bias(w, rows, kernel))

        group = None
        if kernel and self._grouped_on(x) and (self.block_tokens is None or routed <= self.block_tokens):

            def group(plan, experts: list[int]) -> None:  # resident experts: one grouped matmul per projection
                nonlocal y
                by_slot = sorted((plan.slots[e].index, e) for e in experts)
                sizes = [counts[e] for _, e in by_slot]
                rows = _to(x.device, torch.from_numpy(_ranges([starts[e] for _, e in by_slot], sizes)))  # [n] slot by slot
                group_biases = _BiasRows((len(rows), H))
                out = self._on_slots([slot for slot, _ in by_slot], sizes, x[rows], group_biases)  # [n, H]
                if y is None:
                    y = out.new_empty((routed, H))
                y[rows] = out
                biases.put(rows, group_biases.rows)

        host = self._serve(needed, compute, [counts[e] for e in needed], lambda e: x[starts[e] : starts[e] + counts[e]], group)
        for e, out, adds in host:  # [n, H] computed on the host (host_compute), into the rows the device fills
            y = out.new_empty((routed, H)) if y is None else y
            _put(y, slice(starts[e], starts[e] + counts[e]), out, adds)
        y = self._parts_summed(y, x.dtype, kernel, biases)
        return self._combine(y, order, hidden_states, top_k_index, top_k_weights, impl, None)

    def _bad_routing(self, given: str):
        raise ConfigError(
            f"the experts module of MoE layer {self.layer} was given {given}: it has {self.num_experts} experts, "
            f"indexed 0 to {self.num_experts - 1} by integers ({self.num_experts} marks a token's slot that expert "
            "parallelism skips). Pass top_k_index as the block's router gives it."
        )

    @staticmethod
    def _row_order(top_k_index: torch.Tensor, impl: str) -> torch.Tensor:
        """The rows r = t * K + k grouped by expert (the EP sentinel last), each expert's rows in the order the
        unwrapped model gives them to its matmul: a row's place in a matmul can change its rounding (CPU kernels
        handle the rows past their last full block with other code). grouped_mm sorts with `torch.sort` (not
        stable: the same call gives the same permutation); eager takes an expert's rows by slot k, then token."""
        if impl == "eager":
            T, K = top_k_index.shape
            i = torch.argsort(top_k_index.t().reshape(-1), stable=True)  # i = k * T + t, grouped by expert
            return (i % T) * K + i // T
        return torch.sort(top_k_index.reshape(-1)).indices

    def _decode_step(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, picks: list[int], impl: str
    ) -> torch.Tensor:
        """`serve` for one token (a decode step) whose K `picks` are distinct: each expert's output row
        goes to its slot k directly, without the sort, gather and scatter that group many tokens' rows by
        expert (launch-bound models spend their decode time on such launches). The same arithmetic as
        `serve`, so the same bits."""
        H, E, K = hidden_states.shape[1], self.num_experts, len(picks)
        slot_of = {e: k for k, e in enumerate(picks) if e != E}
        sentinel = [k for k, e in enumerate(picks) if e == E]  # the EP sentinel's slot: its row stays zero
        if impl == "batched_mm" and self._gathers:
            rows = self._batched(hidden_states, top_k_index, sorted(slot_of), slot_of.__getitem__, len(slot_of))
            return self._combine(rows, None, hidden_states, top_k_index, top_k_weights, impl, sentinel or None)
        y = None  # [K, H], in the experts' output dtype
        kernel = impl == "grouped_mm"
        biases = _BiasRows((K, H))  # host_compute="split": down biases added after the parts' sum is rounded

        def compute(plan, e: int, w) -> None:
            nonlocal y
            part = self._expert(plan, e, w, hidden_states, kernel)  # [1, H]
            if y is None:
                y = part.new_zeros((K, H)) if sentinel else part.new_empty((K, H))
            y[slot_of[e]] = part[0]
            biases.put(slot_of[e], self._down_bias(w, hidden_states, kernel))

        group = None
        if kernel and self._grouped_on(hidden_states):

            def group(plan, experts: list[int]) -> None:  # resident experts: one grouped matmul per projection
                nonlocal y
                slots = sorted((plan.slots[e].index, slot_of[e]) for e in experts)  # (pool slot, output row k)
                group_biases = _BiasRows((len(slots), H))
                x = hidden_states.expand(len(slots), H).contiguous()
                out = self._on_slots([s for s, _ in slots], [1] * len(slots), x, group_biases)
                if y is None:
                    y = out.new_zeros((K, H)) if sentinel else out.new_empty((K, H))
                rows = _to(out.device, torch.tensor([k for _, k in slots]))
                y[rows] = out
                biases.put(rows, group_biases.rows)

        host = self._serve(sorted(slot_of), compute, [1] * len(slot_of), lambda e: hidden_states, group)
        for e, out, adds in host:  # host_compute
            y = (out.new_zeros((K, H)) if sentinel else out.new_empty((K, H))) if y is None else y
            _put(y, slot_of[e], out[0], adds)
        y = self._parts_summed(y, hidden_states.dtype, kernel, biases)
        return self._combine(y, None, hidden_states, top_k_index, top_k_weights, impl, sentinel or None)

    def _combine(self, y, order, hidden_states, top_k_index, top_k_weights, impl: str, sentinel) -> torch.Tensor:
        """Weight and sum the experts' output rows as `impl` does. `y`: [routed, H] rows grouped by
        expert (row i belongs to (token, slot) `order[i]`), or [T*K, H] in (token, slot) order when
        `order` is None; None when every pick was the EP sentinel. `sentinel`: the rows to leave at zero
        (their weight is never applied), or None."""
        T, H = hidden_states.shape
        if y is None:
            return hidden_states.new_zeros((T, H))
        w = top_k_weights.reshape(-1, 1)  # [T*K, 1]
        if order is None:
            parts = y * w  # [T*K, H], dtype promoted as the unwrapped model's `rows * weights`
            if sentinel is not None:
                parts[sentinel] = 0
        else:
            shape, dtype = (len(w), H), torch.promote_types(y.dtype, w.dtype)
            parts = y.new_zeros(shape, dtype=dtype) if len(order) < len(w) else y.new_empty(shape, dtype=dtype)
            parts[order] = y * w[order]  # one weighting and scatter for all rows
        eager_dtype = top_k_weights.dtype if self._eager_arithmetic == "weights" else hidden_states.dtype
        return combine(parts, top_k_index, impl, hidden_states.dtype, eager_dtype)  # [T, H]

    def _batched(self, hidden_states, top_k_index, needed: list[int], rows_of, written: int) -> torch.Tensor | None:
        """The experts' output rows [T*K, H] in (token, slot) order, as batched_mm computes them: each row
        multiplied by its own copy of its expert's weights with `bmm` (rows of the EP sentinel get zero weights).
        Where all rows' copies fit in `BATCHED_CALL_BYTES`, one call, the copies gathered as the unwrapped model's
        `weight[expert_ids]` (from the pool's slots where every expert has one, else copied into each expert's rows);
        else a chunk of rows at a time (`batched_rows`), gathered from the slots or from one copy of each needed
        expert. `rows_of(e)`: expert e's rows (an index, a slot or an index tensor); `written`: how many rows real
        experts fill."""
        S, E, n = top_k_index.numel(), self.num_experts, len(needed)
        # (transposed experts, `x @ w` per row, keep one call: chunks were measured on the `w @ x` form only)
        chunks = [slice(0, S)] if self._transposed else batched_rows(S, self._row_bytes)
        one_call = len(chunks) == 1
        entry = {e: j for j, e in enumerate(needed)}
        table: dict[str, torch.Tensor] = {}  # every row's weights [S, ...], or each needed expert's once [n (+1), ...]
        y = None  # [S, H]
        biases = _BiasRows((S, hidden_states.shape[1]))  # host_compute="split": added after the parts' sum is rounded

        def put(w, names, e: int) -> None:
            for name in names:
                t = w.weight(name) if isinstance(w, PackedWeights) else w[name]  # decoded: copied at once
                buf = table.get(name)
                if buf is None:
                    shape = (S if one_call else n + (written < S), *t.shape)  # a last entry of zeros: the sentinel's
                    buf = table[name] = t.new_empty(shape) if written == S else t.new_zeros(shape)
                buf[rows_of(e) if one_call else entry[e]] = t

        up = (self._up, self._up + "_bias") if self._has_bias else (self._up,)
        down = (self._down, self._down + "_bias") if self._has_bias else (self._down,)
        x = hidden_states.repeat_interleave(top_k_index.shape[1], dim=0)  # [S, H], as batched_mm repeats each token

        def rows_at(index_of: dict[int, int], fill: int) -> torch.Tensor:
            """[S] each row's entry: `index_of[e]` for its expert e, `fill` for the sentinel's."""
            at = torch.full((E + 1,), fill, dtype=torch.long)
            at[list(index_of)] = torch.tensor(list(index_of.values()))
            return _to(hidden_states.device, at)[top_k_index.reshape(-1)]

        def compute(plan, e: int, w) -> None:
            put(w, up, e)  # the up half may be copied before the rest of the record lands
            self.manager.acquire_rest(plan, e)
            put(w, down, e)

        group = together = None
        views = self.manager.slot_views(self.layer)
        if views is not None:  # raw weights in the slots

            def together(plan, experts: list[int]) -> None:  # every row's expert, acquired in its slot
                nonlocal y  # computed from the pool while the slots are held: no copy of each expert beside it
                y = self._bmm_rows(x, views, rows_at({e: plan.slots[e].index for e in experts}, 0), chunks, up, down, biases)

            def group(plan, experts: list[int]) -> None:  # resident experts, acquired
                if len(experts) < len(needed) or written < S:  # some rows come later: each expert copied now
                    for e in experts:
                        put(self.manager.weights(plan, e), up + down, e)
                    return
                together(plan, experts)

        K = top_k_index.shape[1]
        tokens = lambda r: r // K if isinstance(r, torch.Tensor) else slice(r // K, r // K + 1)  # noqa: E731
        counts = (
            [r.numel() if isinstance(r, torch.Tensor) else 1 for r in map(rows_of, needed)] if self.manager.host.active else None
        )
        inputs = lambda e: hidden_states[tokens(rows_of(e))]  # noqa: E731
        host = self._serve(needed, compute, counts, inputs, group, together if written == S else None)
        if table:
            y = self._bmm_rows(x, table, None if one_call else rows_at(entry, n), chunks, up, down, biases)
        if y is not None:
            y = self._post(y)
        for e, out, adds in host:  # [n, H] computed on the host (host_compute): its rows' bmm outputs are replaced
            y = out.new_zeros((S, out.shape[1])) if y is None else y
            r = rows_of(e)
            _put(y, r, out if isinstance(r, torch.Tensor) else out[0], adds)
        return self._parts_summed(y, x.dtype, True, biases)

    def _bmm_rows(self, x: torch.Tensor, weights: dict[str, torch.Tensor], at, chunks, up, down, biases) -> torch.Tensor:
        """batched_mm's output rows [S, H] for inputs x [S, H]: row r with the expert weights at entry `at[r]` of
        `weights` (each [n, ...]), gathered per chunk of rows (`chunks`), or (`at` None) with row r of each weight
        ([S, ...]) in one call. `up`, `down`: the names of a projection's weight and its bias, if any. A split
        expert's down bias goes to its rows of `biases` (`_BiasRows`) instead."""
        bias = lambda names, a: weights[names[1]][a] if len(names) > 1 else None  # noqa: E731
        out = []
        for rows in chunks if at is not None else [slice(None)]:
            a = at[rows] if at is not None else rows
            h = batched_linear(x[rows], weights[up[0]][a], bias(up, a), self._transposed)  # [n, I']
            h = self._activate(h)  # [n, I]
            if self._wide(h.dtype, h.device):  # host_compute="split": the device parts' products kept in fp32 (`_part_down`)
                out.append(wide_batched_linear(h, weights[down[0]][a], self._transposed))
                biases.put(rows, bias(down, a))
            else:
                out.append(batched_linear(h, weights[down[0]][a], bias(down, a), self._transposed))  # [n, H]
        return out[0] if len(out) == 1 else torch.cat(out)

    def _serve(
        self, needed: list[int], compute, rows=None, inputs=None, group=None, together=None
    ) -> list[tuple[int, torch.Tensor]]:
        """One block call of the manager's protocol: `begin`, then for each expert in `plan.order` (resident
        first) `acquire` its first part (the rest of the record may still be crossing: `_expert` waits for
        it), `compute(plan, e, w)`, `release`; `end` even when a compute raises (it unpins the slots).
        `group(plan, experts)`: computes the experts resident and landed at `begin` (`plan.ready`, two or more) at
        once, between `acquire_group` and `release_group`, instead of `compute` on each (where no other expert of the
        block waits for a copy, `end` books them; experts kept packed follow, through `compute`). The block's
        bookkeeping after its last launch waits for the manager's next verb (`end(..., later=True)`): the device runs
        meanwhile. `rows`: each needed
        expert's row count, `inputs(e)`: its rows [n, H]. With host compute on, the misses `begin` sent to the
        host run there meanwhile, and with host_compute="split" every expert's host part. `together(plan,
        experts)`: computes all of a block's experts from their slots once each is acquired (its copy landed), where
        some were not resident and landed at `begin`, `begin` gave every miss a slot and none is kept packed or
        computed on the host: one call for the block instead of `compute` on each miss (`batched_mm` multiplies every
        row in one call anyway). Returns
        [(expert, outputs [n, H] on the device, adds)]: a whole expert's outputs (post-expert norm applied) take
        the place of its rows (`adds` False), a host part's are added to the device part's (True)."""
        plan = self.manager.begin(self.layer, needed, rows, inputs)
        job, grouped, parts = plan.job, (), []  # the job: the misses `begin` sent to the host, or the host parts
        try:
            if self._split:  # the host parts `begin` placed on the device; the host computes the others meanwhile
                parts = self._copied_parts(plan, inputs)
            first = 0
            together_ok = not (plan.pending or plan.kept or plan.host or self._split)  # every expert has its slot now
            if together is not None and together_ok and 1 < len(plan.order) > plan.ready:
                self.manager.acquire_group(plan, plan.order[: plan.ready])  # landed at begin: booked in one pass
                for e in plan.order[plan.ready :]:  # waits for its copy
                    self.manager.acquire(plan, e)
                together(plan, plan.order)
                self.manager.release_group(plan, plan.order)
                first = len(plan.order)
            elif group is not None and plan.ready > 1:
                first = plan.ready
                resident = plan.order[:first]
                if first + plan.kept == len(plan.order):  # nothing awaited: their uses are booked with the block's end
                    group(plan, resident)
                    grouped = resident
                else:
                    self.manager.acquire_group(plan, resident)
                    group(plan, resident)
                    self.manager.release_group(plan, resident)
            for e in plan.order[first:]:
                w = self.manager.acquire(plan, e, first_part=True)
                compute(plan, e, w)
                self.manager.release(plan, e)
        except BaseException:
            self.manager.end(plan)  # unpins now
            raise
        self.manager.end(plan, grouped, later=True)
        done = job.collect() if job is not None else []
        if self._split:
            return [(e, out, True) for e, out in done + parts]
        return [(e, self._post(out), False) for e, out in done]

    def _copied_parts(self, plan, inputs) -> list[tuple[int, torch.Tensor]]:
        """[(expert, output [n, H])] of the host parts `plan.parts_copied`: the manager copies to the device the
        host parts of experts with many rows in the block (a prefill's: the host's time grows with rows, the
        copy's does not) and those the host would finish after the link (`HostCompute.place_parts`); they are
        computed here, on the device."""
        host = self.manager.host
        parts = []
        for e in plan.parts_copied:
            x = inputs(e)  # [n, H]
            w = {name: t.to(x.device, non_blocking=True) for name, t in host.weights(self.layer, e).items()}
            parts.append((e, self._host_part(e, w, x)))
        return parts

    def _grouped_on(self, x: torch.Tensor) -> bool:
        """Whether resident experts may share one grouped matmul (`_on_slots`): on a `GROUPED_SLOT_DEVICES` device,
        with raw weights in the slots."""
        return x.device.type in self.GROUPED_SLOT_DEVICES and self.manager.slot_views(self.layer) is not None

    def _on_slots(self, slots: list[int], counts: list[int], x: torch.Tensor, biases=None) -> torch.Tensor:
        """Resident experts, acquired, on their rows x [n, H] in one grouped matmul per projection over their
        pool's slots (`manager.slot_views`), as transformers' grouped_mm runs one over all experts: slot
        `slots[i]` (ascending) takes the next `counts[i]` rows; slots not listed get no rows. A pool of more slots
        than torch's grouped kernel takes groups is covered by windows of `MAX_GROUPS` slots. Returns [n, H]. A split
        expert's down bias goes to its rows of `biases` (`_BiasRows` of x's rows) instead (`_down_bias`)."""
        views = self.manager.slot_views(self.layer)  # name -> [n_slots, ...]
        parts, i, row = [], 0, 0
        while i < len(slots):
            j = i
            while j < len(slots) and slots[j] - slots[i] < MAX_GROUPS:
                j += 1
            n = sum(counts[i:j])
            parts.append(self._on_window(views, slots[i:j], counts[i:j], x[row : row + n], biases, row))
            i, row = j, row + n
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _on_window(
        self, views: dict[str, torch.Tensor], slots: list[int], counts: list[int], x: torch.Tensor, biases=None, row: int = 0
    ) -> torch.Tensor:
        """`_on_slots` for slots that span fewer than `MAX_GROUPS`: one group per slot of the span. `x`: the span's
        rows, row `row` onwards of `_on_slots`' (where its down biases go in `biases`)."""
        first = slots[0]
        w = {name: t[first : slots[-1] + 1] for name, t in views.items()}  # [span, ...]
        sizes = np.zeros(slots[-1] + 1 - first, dtype=np.int32)
        sizes[np.asarray(slots) - first] = counts
        offs = _to(x.device, torch.from_numpy(np.cumsum(sizes, dtype=np.int32)))  # [span] cumulative rows
        up_bias = down_bias = None  # [n, out] each, added per row as transformers does
        if self._has_bias:
            at = _to(x.device, torch.repeat_interleave(torch.tensor(slots) - first, torch.tensor(counts)))  # [n] row -> slot
            up_bias, down_bias = w[self._up + "_bias"][at], w["down_proj_bias"][at]
        h = self._activate(grouped_linear(x, w[self._up], self._transposed, offs, up_bias))  # [n, I]
        if self._wide(h.dtype, h.device):  # host_compute="split": the device parts' products kept in fp32, their down
            if down_bias is not None:  # biases added once the parts' sum is rounded
                biases.put(slice(row, row + x.shape[0]), down_bias)
            return wide_linear(h, [w["down_proj"][s - first] for s in slots], self._transposed, counts)
        return self._post(grouped_linear(h, w["down_proj"], self._transposed, offs, down_bias))  # [n, H]

    def _expert(self, plan, e: int, w, x: torch.Tensor, kernel: bool = False, at: int = 0) -> torch.Tensor:
        """Expert `e` (acquired with `first_part=True`) on rows x [n, H] -> [n, H]: the up half may start
        before the rest of its record has landed; the down half waits for it. `kernel`: multiply with
        transformers' grouped matmul (grouped_mm off the CPU) instead of `F.linear`. `at`: the rows' first index in
        the block's rows sorted by expert."""
        h = self._up_proj(x, w, kernel)  # [n, I]
        self.manager.acquire_rest(plan, e)
        return self._down_proj(h, w, kernel)

    # One expert, exactly as transformers' experts implementations compute it, in two halves: the first
    # reads only the up (gate_up) tensors, which a record split in two parts brings first.
    # `w`: typed views of the expert's tensors, or `PackedWeights` (placement "packed", and experts kept packed: "mixed").
    def _linear(self, x: torch.Tensor, w, name: str, kernel: bool) -> torch.Tensor:
        packed = isinstance(w, PackedWeights)
        if packed and not self._kept_packed:  # placement "packed": the codec's own matmul, with no decoded copy
            if kernel and w.exact:  # the unwrapped model's grouped kernel on the decoded weight: its bits
                y = grouped_linear(x, w.weight(name), self._transposed)
            elif x.dtype != w.dtype:  # rows in fp32 (a loop in fp32, `serve`): the decoded weight, widened
                y = plain_linear(x, w.decoded(name).to(x.dtype), self._transposed)
            else:
                y = w.linear(x, name, self._transposed)
            return y + w.raw(name + "_bias") if self._has_bias else y
        # A slot's typed views, or an expert kept packed ("mixed") decoded at each use as its slot would hold it: the
        # same matmul as a slot's, so the same bits at any budget (the codec's own matmul may round otherwise).
        weight = w.decoded(name) if packed else w[name]
        if weight.dtype != x.dtype and not kernel:  # rows in fp32 (a loop in fp32, `serve`): the weight widened, as
            weight = weight.to(x.dtype)  # the loop does; transformers' grouped matmul casts the rows to the weight's
        y = grouped_linear(x, weight, self._transposed) if kernel else plain_linear(x, weight, self._transposed)
        if not self._has_bias:
            return y
        bias = w.raw(name + "_bias") if packed else w.get(name + "_bias")  # none: a split expert's host part's down
        return y if bias is None else y + bias

    def _up_proj(self, x: torch.Tensor, w, kernel: bool = False) -> torch.Tensor:
        # x [n, H] -> [n, I]
        return self._activate(self._linear(x, w, self._up, kernel))  # [n, 2I] or [n, I] -> [n, I]

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[0] == 1 and self._gated_together and self._has_gate and h.device.type == "cpu" and self._by_layout():
            # the unwrapped block's gate half of its T*K rows is a strided view, and torch's CPU kernels of some
            # functions (GELU's erf) round a strided view otherwise than one contiguous row: gate a strided row too
            return activate(self.base, True, self._apply_gate, h.expand(2, -1))[:1]
        return activate(self.base, self._has_gate, self._apply_gate, h)

    def _by_layout(self) -> bool:
        """Whether the gate function, as the module holds it now (an activation may be replaced), rounds a row of a
        strided view otherwise than the row alone on the CPU: probed once per activation, in each float dtype."""
        fn = getattr(self.base, "act_fn", None)
        if self._probed[0] is not fn:
            h = torch.randn(3, 2 * 512, generator=torch.Generator().manual_seed(0)) * 4  # [n, 2I] rows of a block
            differs = False
            with torch.no_grad():
                for dtype in (torch.float32, torch.bfloat16, torch.float16):
                    rows = h.to(dtype)
                    strided = activate(self.base, True, self._apply_gate, rows)[:1]  # row 0 of a strided gate half
                    alone = activate(self.base, True, self._apply_gate, rows[:1])  # the same row, contiguous
                    differs = differs or not torch.equal(strided, alone)
            self._probed = (fn, differs)
        return self._probed[1]

    def _down_proj(self, h: torch.Tensor, w, kernel: bool = False) -> torch.Tensor:
        # h [n, I] -> [n, H]
        if self._split:
            return self._part_down(h, w, kernel)
        return self._post(self._linear(h, w, self._down, kernel))

    # host_compute="split": where the whole expert's down projection rounds its product to 16 bits, each part's (the
    # device's, the host's) keeps it in fp32 and the block rounds their sum once (`_parts_summed`), as the whole
    # expert's one matmul, accumulating in fp32, rounds once. Two roundings would differ from it in about a third of
    # the output elements, one in well under 1% (benchmarks/NOTES.md, "Host compute").
    def _part_down(self, h: torch.Tensor, w, kernel: bool = False) -> torch.Tensor:
        """A split expert's part of its down projection, h [n, I'] -> [n, H]: in fp32 and without the down bias
        (`_down_bias`) where the whole expert's would round to 16 bits (`_keeps_wide`), else as `_linear` computes it
        (the down bias is the device part's)."""
        if not self._keeps_wide(w, h, kernel):
            return self._linear(h, w, self._down, kernel)
        packed = isinstance(w, PackedWeights)
        weight = w.decoded(self._down) if packed else w[self._down]
        return wide_linear(h.to(weight.dtype) if kernel else h, weight, self._down_transposed)

    def _keeps_wide(self, w, x: torch.Tensor, kernel: bool) -> bool:
        """Whether a split expert with weights `w` keeps its down projection's product of rows `x` (its input, or
        its activations: the same dtype) in fp32 (`_part_down`)."""
        packed = isinstance(w, PackedWeights)
        if packed and not self._kept_packed and not w.exact:  # a lossy codec's own matmul gives its own product
            return False
        dtype = w.dtype if packed else w[self._down].dtype
        return self._wide(dtype if kernel else x.dtype, x.device)  # the grouped kernel casts rows to weights

    # The whole expert adds its down bias to its product rounded to 16 bits (a second rounding); a split expert's
    # device part leaves it out of its fp32 product, and the block adds it to the two parts' sum once that is rounded
    # (`_parts_summed`): the same two roundings. Each path puts its experts' biases by output row (`_BiasRows`).
    def _down_bias(self, w, x: torch.Tensor, kernel: bool) -> torch.Tensor | None:
        """The down bias that `_part_down` left out of a split expert's product of rows `x` (weights `w`), else None."""
        if not (self._split and self._has_bias) or not self._keeps_wide(w, x, kernel):
            return None
        return w.raw(self._down + "_bias") if isinstance(w, PackedWeights) else w.get(self._down + "_bias")

    def _wide(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a split expert's down projection of rows in `dtype` on `device` keeps its product in fp32
        (`_part_down`): rows in 16 bits, outside autocast (whose dtype the unwrapped model's matmuls take)."""
        return self._split and dtype in NARROW and not torch.is_autocast_enabled(device.type)

    def _part_dtype(self, x_dtype: torch.dtype, kernel: bool) -> torch.dtype:
        """The dtype of an expert's output on rows of `x_dtype`: the weights' where the rows are cast to them (the
        grouped and batched kernels), else the rows' (a weight of another dtype is cast to them)."""
        return self.manager.store.dtype(self.layer) if kernel else x_dtype

    def _parts_summed(self, y: torch.Tensor | None, x_dtype: torch.dtype, kernel: bool, biases=None) -> torch.Tensor | None:
        """A block's expert outputs y on rows of `x_dtype`, each the sum of a split expert's two parts kept in fp32
        (`_part_down`), rounded once to the whole expert's output dtype (`_part_dtype`), then the down biases the
        parts left out added (`biases`: `_BiasRows`). Others are returned as they are (without the split, nothing
        is looked up)."""
        if y is None or not self._split:
            return y
        dtype = self._part_dtype(x_dtype, kernel)
        y = y if y.dtype == dtype or dtype not in NARROW else y.to(dtype)
        return y if biases is None or biases.rows is None else y.add_(biases.rows)

    def _post(self, y: torch.Tensor) -> torch.Tensor:
        return self.base.post_expert_norm(y) if self._post_norm else y

    def _up_of(self, e: int, x: torch.Tensor, w) -> torch.Tensor:
        """Expert e's up projection and gate function, x [n, H] -> [n, I] (with its own activation where each expert
        keeps one: `MiraModuleExperts`)."""
        return self._up_proj(x, w)

    def _host_part(self, e: int, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Expert e's host part (`neuron_split`, host_compute="split") on rows x [n, H] -> [n, H]: its neurons'
        up projection (with their share of its bias) and gate function, and their columns of the down projection,
        whose bias the device part adds."""
        return self._down_proj(self._up_of(e, x, w), w)  # [n, H]; the host part has no down bias

    def _host_expert(self, e: int, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Expert e on the host (`host_compute`): x [n, H] and `w` (views of its host record) -> [n, H],
        the same math as `_expert` except the post-expert norm, which the device applies to the result."""
        return self._linear(self._up_of(e, x, w), w, self._down, False)

    # -- the experts as this module's parameters (`mira_hf.state`): state dict, load, casts, moves --------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        state = getattr(self, "_mira_state", None)
        if state is None or not state.save(self, destination, prefix, keep_vars):
            super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        state = getattr(self, "_mira_state", None)
        if state is None:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        else:
            state.load(self, state_dict, prefix, missing_keys, unexpected_keys, error_msgs, local_metadata)

    def _apply(self, fn, recurse=True):
        return proxy_apply(self, fn, recurse)

    def apply(self, fn):
        """`Module.apply`, as on the unwrapped model: `fn` meets the experts module's members, then the experts module,
        each once. The experts module it meets is `base` standing in for this module (`_stand_in`): of the class code
        typed on it looks for (transformers' `_init_weights`), holding the expert parameters. `fn` does not meet this
        module as well, which would give it each expert parameter a second time."""
        base = self.base
        own = {name: getattr(base, name) for name in (*CALL_HOOK_TABLES, "_is_full_backward_hook")}
        give_back_hooks(self, base)  # hooks `fn` registers on it are this module's, the one called in its place
        self._stand_in()
        try:
            for child in self.children():
                if child is not base:  # its members are this module's too (`__init__`)
                    child.apply(fn)
            fn(base)
        finally:
            self._is_full_backward_hook = base._is_full_backward_hook
            for name, value in own.items():
                object.__setattr__(base, name, value)
            self.training = base.training  # (as `fn` left the module's mode)
            self._stand_down()
        return self

    def _stand_in(self) -> None:
        """`base` as the experts module this proxy replaced: holding the expert parameters (this module's: views of the
        store, where changes in place such as `_init_weights`' reach the experts), a cast or move of it this module's,
        which the store follows (`_cast_standing_in`)."""
        self._bound = self._bind_experts()
        object.__setattr__(self.base, "_apply", self._cast_standing_in)

    def _stand_down(self) -> None:
        """Undo `_stand_in`. An expert parameter `fn` replaced there (`m.gate_up_proj = nn.Parameter(...)`) gives the
        experts its values, written into the store as `load_state_dict` writes them: the unwrapped model would compute
        with the new parameter."""
        bound = self.__dict__.pop("_bound", None)
        if bound is None:  # down already: a cast `fn` made there stood it down and raised (`_cast_standing_in`)
            return
        del self.base.__dict__["_apply"]
        given = self._unbind_experts(bound)
        if given:
            self._mira_state.assign(self.layer, given)

    def _bind_experts(self) -> dict[str, nn.Parameter]:
        """Put the expert parameters on `base`, where the unwrapped model keeps them; returns them by path."""
        bound = {n: p for n, p in self._parameters.items() if p is not None and n in self.base._parameters}
        for name, param in bound.items():
            self.experts_layout.set(self.base, name, param)
        return bound

    def _unbind_experts(self, bound: dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
        """Take the expert parameters `_bind_experts` put on `base` off it again; returns those found replaced there,
        by path."""
        layout = self.experts_layout
        given = _replaced(bound, lambda name: layout.get(self.base, name))
        for name in bound:
            layout.set(self.base, name, None)
        for name, child in self.base._modules.items():  # a member `fn` replaced there (an activation): this one's too
            if self._modules.get(name) is not child:
                self._modules[name] = child
        return given

    def _cast_standing_in(self, fn, recurse: bool = True) -> nn.Module:
        """`base._apply` while it stands in for this module (`_stand_in`): this module's cast or move, made with the
        modules as they are between calls (the store follows it, and `base` is this module's member)."""
        self._stand_down()
        try:
            self._apply(fn, recurse)
        finally:
            self._stand_in()
        return self.base


class MiraRouteNormExperts(MiraExperts):
    """Routed experts whose module normalises each route's output with its expert's own learned norm before the
    weighted sum (Ergo; `MoEAdapter.route_norm` names the norm on the module, called as `norm(rows, expert_ids)`).
    The module's forward gives each (token, expert) route a row of its own, runs the experts interface on the rows
    with unit weights (one expert per row), normalises each row, then weights the rows and sums each token's K
    in the weights' dtype, cast to the hidden dtype. The proxy does the same around the served experts, the norm
    read from the module it replaced (`base`)."""

    def _experts(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, impl: str
    ) -> torch.Tensor:
        # `serve` observed the block's routing as [T, K]; the routes are computed as T*K rows of one expert each
        T, K = top_k_index.shape
        rows = hidden_states.repeat_interleave(K, dim=0) if K > 1 else hidden_states  # [T*K, H]: row t*K + k
        routes = top_k_index.reshape(-1, 1)  # [T*K, 1]
        y = super()._experts(rows, routes, rows.new_ones(routes.shape), impl)  # [T*K, H]: each route's expert
        y = getattr(self.base, self._route_norm)(y, routes.flatten().clamp_max(self.num_experts - 1))
        return (y.view(T, K, -1) * top_k_weights.unsqueeze(-1)).sum(1).to(hidden_states.dtype)  # [T, H]


class MiraScaledExperts(MiraExperts):
    """Routed experts of a block that scales each expert's input by its routing weight (Llama 4): the
    forward takes `[E·T, H]` rows, token t of expert e at row e·T + t, zero where the router did not
    choose e for t, and returns `[E·T, H]`; the block sums over experts. An expert applied to a zero row
    gives a zero row (these experts have no biases), so only the chosen experts are computed, each on
    its T rows as the module's own batched matmul does, and the other rows stay zero."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # as MiraExperts.forward
            return self._refusing(torch.ops.mira.scaled_experts(self._handle, hidden_states, _autocast_dtype(hidden_states)))
        return self._served(hidden_states)

    def _linear(self, x: torch.Tensor, w, name: str, kernel: bool) -> torch.Tensor:
        # Llama4TextExperts multiplies every expert in one `bmm`. On a CPU, torch's batched kernel rounds a batch
        # of one as `mm` does, unlike a batch of several, so one expert goes through a batch of two views of itself.
        # An expert kept packed ("mixed") goes the same way with its decoded weight: it computes what its decoded
        # slot would at a larger budget.
        if x.device.type == "cpu" and (self._kept_packed or not isinstance(w, PackedWeights)):
            t = w.decoded(name) if isinstance(w, PackedWeights) else w[name]  # [in, out]: transposed, no biases
            return torch.bmm(x.expand(2, *x.shape), t.expand(2, *t.shape))[0]
        return super()._linear(x, w, name, kernel)

    def serve(self, hidden_states: torch.Tensor) -> torch.Tensor:
        E = self.num_experts
        x = hidden_states.view(E, -1, hidden_states.shape[-1])  # [E, T, H]
        chosen = x.ne(0).any(dim=2)  # [E, T]
        K = self.manager.layers[self.layer].top_k
        top_k_index = chosen.t().float().topk(K, dim=1).indices  # [T, K] for the predictor and traces
        hidden = x.sum(dim=0)  # [T, H]: each token's hidden state times the sum of its weights (> 0)
        self.manager.observe(self.layer, hidden, top_k_index)  # the predictor's copy is finished by the sync below
        needed = [e for e, n in enumerate(chosen.sum(dim=1).tolist()) if n]  # one host sync per block
        out = None  # [E, T, H], in the experts' output dtype (under autocast, the module's `bmm` gives autocast's)

        def compute(plan, e: int, w) -> None:
            nonlocal out
            y = self._expert(plan, e, w, x[e])  # [T, H]
            out = x.new_zeros(x.shape, dtype=y.dtype) if out is None else out
            out[e] = y

        for e, y, adds in self._serve(needed, compute, [x.shape[1]] * len(needed), x.__getitem__):  # host_compute
            out = x.new_zeros(x.shape, dtype=y.dtype) if out is None else out
            _put(out, e, y, adds)
        out = self._parts_summed(out, x.dtype, False)
        out = torch.zeros_like(x) if out is None else out  # no token chose an expert
        return out.view(hidden_states.shape)


class _HeldExperts(MiraExperts):
    """Routed experts of a module outside transformers' experts interface that keeps them on child modules (a
    `model_adapters` layout with `nested` set). While wrapped, the module's children are this module's alone (`base`
    holds none, so code that walks children without skipping repeats, as transformers' output recorders do, meets
    each once) and a holder (`_ExpertsHolder`) stands in for each child that keeps experts: it holds the expert
    parameters under their unwrapped names and shapes, and the child's own members (an activation), so the module
    tree and the parameter names are the unwrapped model's. The module's own parameters besides its experts (a bias)
    stay on `base` and are this module's too. `restore_owners` gives `base` its children back (`unload`)."""

    def __init__(self, base, manager, layer, flags, block_tokens, layout) -> None:
        object.__setattr__(self, "experts_layout", layout)  # read by `_tensor_names`, during the base's __init__
        super().__init__(base, manager, layer, flags, block_tokens)
        for name, param in base.named_parameters(recurse=False):
            self.register_parameter(name, param)  # the same parameter: casts, loads and edits reach both
        # the descendants the holders stand in for: children of `base`, or their children (`ExpertModules`)
        self._owners = {path: base.get_submodule(path) for path in layout.owners(self.num_experts)}
        self._holders = {path: _ExpertsHolder(owner) for path, owner in self._owners.items()}
        self._children = dict(base._modules)  # given back by `restore_owners`
        base._modules.clear()
        for path, holder in self._holders.items():
            self.set_submodule(path, holder)

    def _reaches_base(self, name: str) -> bool:
        return super()._reaches_base(name) and name not in self._holders  # (a holder stands in for a member of `base`)

    def _base_members(self) -> dict[str, nn.Module | None]:
        return self._children  # given back to `base` by `restore_owners`

    @property
    def _act(self) -> nn.Module:
        """The activation the experts compute with, where the module tree holds it now (`set_submodule` may replace it)."""
        return self.get_submodule(self.experts_layout.activation)

    def restore_owners(self) -> None:
        self.base._modules.update(self._children)
        for path, owner in self._owners.items():
            parent, _, leaf = path.rpartition(".")
            if parent:  # a holder inside one of the children given back
                self.base.get_submodule(parent).set_submodule(leaf, owner)

    def _linear(self, x: torch.Tensor, w, name: str, kernel: bool) -> torch.Tensor:
        transposed = self._down_transposed and name == self._down  # the up projections' rows are [out, in]
        if isinstance(w, PackedWeights) and not self._kept_packed:
            return w.linear(x, name, transposed)
        weight = w.decoded(name) if isinstance(w, PackedWeights) else w[name]  # kept packed: as its decoded slot holds it
        return plain_linear(x, weight, transposed)  # F.linear(x, W) is x.matmul(W.t()), as the module computes

    def _bind_experts(self) -> dict[str, nn.Parameter]:
        """Put the unwrapped modules back where holders stand (nested ones too), with the expert parameters, and give
        `base` its children, so that `apply`'s fn meets the module and its children as the unwrapped model has them."""
        layout = self.experts_layout
        bound = {path: layout.get(self, path) for name in layout.names for path in layout.paths(name, self.num_experts)}
        for path, owner in self._owners.items():
            self.set_submodule(path, owner)
        for path, param in bound.items():
            self._bind(path, param)
        self.base._modules.update(self._children)
        return bound

    def _unbind_experts(self, bound: dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
        given = _replaced(bound, lambda path: self.experts_layout.get(self, path))
        for name, child in self.base._modules.items():  # a member `fn` replaced on the module (its activation)
            if name not in self._holders and self._children.get(name) is not child:
                self._children[name] = self._modules[name] = child
        self.base._modules.clear()
        for path in bound:
            self._bind(path, None)
        for path, holder in self._holders.items():
            holder._modules.update(self._owners[path]._modules)  # members `fn` replaced on the module it met
            self.set_submodule(path, holder)
        for name, param in self.base.named_parameters(recurse=False):  # a parameter of its own `fn` replaced (a bias)
            if self._parameters.get(name) is not param:
                self.register_parameter(name, param)
        # A cast `fn` made of an unwrapped module itself (torch's `_apply`, which sets its parameters' data) is undone:
        # the store follows a cast of this module or `base` (`_cast_standing_in`); changes in place stay (the store's).
        self._mira_state.store_views_again(self.layer)
        return given

    def _bind(self, path: str, param) -> None:
        """Put the expert tensor at `path` (None: an empty entry) on the module that keeps it in the unwrapped model."""
        owner, _, leaf = path.rpartition(".")
        self._owners[owner].register_parameter(leaf, param)


class MiraGluExperts(_HeldExperts):
    """`_HeldExperts` whose experts are gated MLPs over separate tensors (`model_adapters.SeparateGluExperts`: DBRX's
    `mlp.w1`, `mlp.v1`, `mlp.w2`, each `[E * I, H]`). Computes as that module's loop does: the gate and the up
    projection one matmul each, the activation of the gate times the up, the down matmul (`h @ down_e` where its
    rows are `[I, H]`), each expert's rows weighted and added in ascending expert order (the eager sum)."""

    def _tensor_names(self) -> None:
        layout = self.experts_layout
        self._gate, self._up, self._down = layout.names
        self._down_transposed = layout.down_transposed

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        H = hidden_states.shape[-1]
        out = super().forward(hidden_states.reshape(-1, H), top_k_index, top_k_weights)  # [T, H]
        return out.view(hidden_states.shape[0], -1, H) if self.experts_layout.batch_output else out

    def _up_proj(self, x: torch.Tensor, w, kernel: bool = False) -> torch.Tensor:
        # x [n, H] -> [n, I]
        return self._act(self._linear(x, w, self._gate, kernel)) * self._linear(x, w, self._up, kernel)


class MiraRoutedExperts(_HeldExperts):
    """`_HeldExperts` for a sparse block that routes and combines in its own forward (`model_adapters.RoutedBlockExperts`:
    JetMoE's `mlp`). Called as the block is (`hidden [B, S, H] -> [B, S, H]`): the block's own router sorts the rows
    by expert and weighs them; its (token, slot) picks and weights go to the served experts, which compute each
    expert's rows in the router's sorted order (`F.linear` on the gate-and-up rows, the activation of the first half
    times the second, `F.linear` on the down rows), weight them and add them per token in ascending expert order, as
    the block's `index_add` does; then the block's bias."""

    def _tensor_names(self) -> None:
        layout = self.experts_layout
        self._up, self._down = layout.names
        self._down_transposed = False

    @property
    def _router(self) -> nn.Module:
        """The block's router, where the module tree holds it now."""
        return self.get_submodule(self.experts_layout.router)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # B batch, S positions, T = B*S tokens, K experts per token, E experts, H hidden
        B, S, H = hidden_states.shape
        x = hidden_states.reshape(-1, H)  # [T, H]
        order, _, gates, counts, _ = self._router(x)  # [T*K] rows sorted by expert, [T*K] their weights, [E] counts
        T, K = x.shape[0], order.numel() // max(x.shape[0], 1)
        sorted_experts = torch.arange(self.num_experts, device=x.device).repeat_interleave(_to(x.device, torch.tensor(counts)))
        top_k_index = torch.empty_like(sorted_experts)
        top_k_index[order] = sorted_experts  # [T*K] each (token, slot)'s expert, as the router picked it
        top_k_weights = torch.empty_like(gates)
        top_k_weights[order] = gates
        out = super().forward(x, top_k_index.view(T, K), top_k_weights.view(T, K))  # [T, H]
        return out.view(B, S, H) + self.base.get_parameter(self.experts_layout.bias)

    @staticmethod
    def _row_order(top_k_index: torch.Tensor, impl: str) -> torch.Tensor:
        return torch.sort(top_k_index.reshape(-1)).indices  # the router's own sort of the same picks: its order

    _fresh_gather = False  # the block's linear layers take each expert's rows as slices of one gather

    def _expert(self, plan, e: int, w, x: torch.Tensor, kernel: bool = False, at: int = 0) -> torch.Tensor:
        h = self._up_proj(x, w, kernel)  # [n, I]
        if h.device.type == "cpu":
            # The block activates every routed row into one [routed, I] tensor and its down layer takes each expert's
            # rows as a slice of it; a CPU matmul can round by where its input starts, so these rows start as far
            # past an allocation's alignment as that slice does (I not a multiple of the alignment's elements).
            h = _placed(h, at * h.shape[1])
        self.manager.acquire_rest(plan, e)
        return self._down_proj(h, w, kernel)

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)  # [n, I] each: gate rows first
        return self._act(gate) * up

    def _combine(self, y, order, hidden_states, top_k_index, top_k_weights, impl: str, sentinel) -> torch.Tensor:
        """As the block: the rows in the router's sorted order, each times its weight, added per token by one
        `index_add` (on a CPU it sums a token's rows in fp32 for bf16 and rounds once, unlike adds one at a time).
        `y`: [routed, H] in that order (`order`), or [T*K, H] in (token, slot) order (None: a decode step)."""
        T, H = hidden_states.shape
        if y is None:
            return hidden_states.new_zeros((T, H))
        if order is None:
            order = self._row_order(top_k_index, impl)
            y = y[order]
        K = top_k_index.shape[1]
        rows = y * top_k_weights.reshape(-1)[order].unsqueeze(-1)  # [routed, H], as `expert_outputs * batch_gates`
        return rows.new_zeros((T, H)).index_add(0, order // K, rows)


class MiraModuleExperts(_HeldExperts):
    """`_HeldExperts` whose experts are one module each (`model_adapters.ExpertModules`: Switch Transformers'
    `expert_{e}`). Called as that experts module is, with a one-hot dispatch mask: each route's expert is the one its
    row marks, or none (the expert-parallel sentinel E, whose rows stay zero) where the router dropped the token over
    an expert's capacity. Each expert computes as its module does (`F.linear` up, the activation, its dropout, the
    hidden rows cast to the down weight's dtype where they differ, `F.linear` down) and the weighted rows are added
    per token in ascending expert order, as the module's loop does.

    The dropout does nothing in eval mode. In training mode it draws a mask per expert from torch's generator; the
    unwrapped module draws them in ascending expert order, one per expert over all its rows, so the proxy draws the
    same masks in the same order before it computes (in whatever order its cache serves the experts) and applies each
    to its expert's rows: the same random numbers, and on the CPU the same bits (there the dropout of `h` is `h` times
    the dropout of ones)."""

    def _tensor_names(self) -> None:
        layout = self.experts_layout
        self._up, self._down = layout.names
        self._down_transposed = False
        self._masks: dict[int, list] | None = None  # training mode: expert -> [its dropout mask [n, I], rows used]

    def _member_of(self, e: int, path: str) -> nn.Module:
        """The module at `path` on expert e's module, where the module tree holds it now (`set_submodule` may replace
        it)."""
        return self.get_submodule(f"{self.experts_layout.child.format(e)}.{path}")

    @property
    def _dropout(self) -> nn.Module | None:
        layout = self.experts_layout
        return self._member_of(0, layout.dropout) if layout.dropout else None

    def forward(self, hidden_states: torch.Tensor, dispatch: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # hidden [T, H], dispatch [T, K, E] one-hot (or zero), weights [T, K]
        top_k_index = torch.where(dispatch.ne(0).any(dim=-1), dispatch.argmax(dim=-1), self.num_experts)  # [T, K]
        dropout = self._dropout
        if dropout is None or not dropout.training or dropout.p == 0:
            return super().forward(hidden_states, top_k_index, weights)
        if self.manager.host.active:
            raise UnsupportedOperationError(
                f"a training-mode forward of {type(self.base).__name__} with host_compute={self.manager.host.mode!r}: "
                f"its experts apply dropout (p={dropout.p}), whose masks mira-hf draws for the device's computations "
                "only. Call model.eval() (inference is what mira-hf serves), or wrap without host_compute."
            )
        rows = dispatch.ne(0).sum(dim=(0, 1)).tolist()  # [E] each expert's rows, as its module gets them
        width = self.manager.store.expert_specs(self.layer)[self._up][0][0]  # I: the up projection's rows
        ones = lambda n: hidden_states.new_ones((n, width))  # noqa: E731
        self._masks = {e: [dropout(ones(n)), 0] for e, n in enumerate(rows) if n}  # ascending, as the module's loop
        try:
            return super().forward(hidden_states, top_k_index, weights)
        finally:
            self._masks = None

    # The container the proxy replaces (an `nn.ModuleDict` keyed `expert_{e}`, or an `nn.ModuleList`) is indexed by
    # code around it, as transformers' `_init_weights` does: its entries are the proxy's children of those names.
    def _entry_names(self) -> list[str]:
        return [self.experts_layout.child.format(e) for e in range(self.num_experts)]

    def __getitem__(self, key):
        names = self._entry_names()
        if isinstance(self.base, nn.ModuleDict):
            if key not in names:
                raise KeyError(key)
            return self._modules[key]
        return self._modules[names[key]]  # a list's index (negative ones too)

    def __len__(self) -> int:
        return self.num_experts

    def __iter__(self):
        return iter(self.keys() if isinstance(self.base, nn.ModuleDict) else self.values())

    def __contains__(self, key) -> bool:
        return key in list(self)

    def keys(self) -> list[str]:
        return self._entry_names()

    def values(self) -> list[nn.Module]:
        return [self._modules[n] for n in self._entry_names()]

    def items(self) -> list[tuple[str, nn.Module]]:
        return [(n, self._modules[n]) for n in self._entry_names()]

    def _up_of(self, e: int, x: torch.Tensor, w, kernel: bool = False) -> torch.Tensor:
        return self._member_of(e, self.experts_layout.activation)(self._linear(x, w, self._up, kernel))  # [n, I]: its own

    def _expert(self, plan, e: int, w, x: torch.Tensor, kernel: bool = False, at: int = 0) -> torch.Tensor:
        h = self._up_of(e, x, w, kernel)
        if self._masks is not None:  # training mode: the next rows of the mask drawn for expert e
            mask = self._masks[e]
            h = h * mask[0][mask[1] : mask[1] + len(h)]
            mask[1] += len(h)
        self.manager.acquire_rest(plan, e)
        return self._down_proj(h, w, kernel)

    def _down_proj(self, h: torch.Tensor, w, kernel: bool = False) -> torch.Tensor:
        dtype = self.manager.store.dtype(self.layer)  # the down weight's, as the store holds every expert tensor
        return super()._down_proj(h if h.dtype == dtype else h.to(dtype), w, kernel)

    def _part_dtype(self, x_dtype: torch.dtype, kernel: bool) -> torch.dtype:
        return self.manager.store.dtype(self.layer)  # the hidden rows are cast to the down weight's dtype


class _ExpertsHolder(nn.Module):
    """Stands in for the child of an experts module that keeps its expert tensors (`_HeldExperts`): holds them
    under their unwrapped names, and the child's own members. The proxy writes and reads the expert tensors in state
    dicts and the store follows casts and moves, so the holder's own state-dict hooks do nothing and a cast or move
    reaches only its members."""

    def __init__(self, owner: nn.Module) -> None:
        super().__init__()
        for name, child in owner.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "_owner", owner)  # (not a member: the module this one stands in for)

    def __setattr__(self, name: str, value) -> None:
        """nn.Module's; a member of the module this one stands in for (an activation) is replaced there too, where the
        experts read it and which `unload` gives back."""
        super().__setattr__(name, value)
        owner = self.__dict__.get("_owner")
        if owner is not None and name in owner._modules:
            owner._modules[name] = value

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for key in state_dict:  # the expert tensors' keys are the proxy's to read; any other is unexpected
            head = key[len(prefix) :].split(".", 1)[0]
            if key.startswith(prefix) and head not in self._parameters and head not in self._modules:
                unexpected_keys.append(key)

    def _apply(self, fn, recurse=True):
        if recurse:
            for child in self.children():
                child._apply(fn)
        return self


# The proxy of each layout of experts kept on child modules (`model_adapters`).
HELD_PROXIES = {SeparateGluExperts: MiraGluExperts, RoutedBlockExperts: MiraRoutedExperts, ExpertModules: MiraModuleExperts}


# nn.Module's tables of the hooks that run around a call (forward and backward), shared by a proxy and its `base`
CALL_HOOK_TABLES = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def give_back_hooks(proxy: nn.Module, module: nn.Module) -> None:
    """The hook tables the proxy took from `module` at wrapping, with the hooks registered on the proxy since."""
    for name in CALL_HOOK_TABLES:
        object.__setattr__(module, name, getattr(proxy, name))
    module._is_full_backward_hook = proxy._is_full_backward_hook


def proxy_for(adapter, base: nn.Module, manager: ExpertManager, layer: int, block_tokens: int | None) -> MiraExperts:
    """The proxy of experts module `base` (MoE layer `layer`): by how its block calls it (input-scaled rows,
    `MoEAdapter.input_scaled`), what its module computes around the experts (`MoEAdapter.route_norm`) and where it
    keeps them (`MoEAdapter.experts_layout`)."""
    flags = layout_flags(adapter, base)
    layout = adapter.experts_layout
    if layout.nested:
        proxy = next(proxy for kind, proxy in HELD_PROXIES.items() if isinstance(layout, kind))
        return proxy(base, manager, layer, flags, block_tokens, layout)
    if adapter.input_scaled:
        return MiraScaledExperts(base, manager, layer, flags, block_tokens)
    if adapter.route_norm:
        return MiraRouteNormExperts(base, manager, layer, flags, block_tokens, adapter.route_norm)
    return MiraExperts(base, manager, layer, flags, block_tokens)


def _replaced(bound: dict[str, nn.Parameter], now) -> dict[str, nn.Parameter]:
    """The parameters found at paths of `bound` (`now(path)`) other than those put there, by path."""
    found = {path: now(path) for path in bound}
    return {path: p for path, p in found.items() if p is not None and p is not bound[path]}


def _placed(t: torch.Tensor, elements: int) -> torch.Tensor:
    """A copy of contiguous `t` that starts as far past CPU_ALIGNMENT as `elements` of its dtype past a fresh
    tensor's start (no copy where that is the alignment itself)."""
    pad = elements * t.element_size() % CPU_ALIGNMENT // t.element_size()
    if not pad and t.data_ptr() % CPU_ALIGNMENT == 0:
        return t
    return t.new_empty(pad + t.numel())[pad:].view_as(t).copy_(t)


class _BiasRows:
    """A block's split experts' down biases by output row ([rows, H], zeros where none was put), made at the first
    `put` of one; `rows` stays None where no part left its bias out (`MiraExperts._down_bias`)."""

    def __init__(self, shape: tuple[int, int]) -> None:
        self.shape = shape
        self.rows: torch.Tensor | None = None

    def put(self, at, bias: torch.Tensor | None) -> None:
        if bias is None:
            return
        if self.rows is None:
            self.rows = bias.new_zeros(self.shape)
        self.rows[at] = bias


def _put(y: torch.Tensor, rows, out: torch.Tensor, adds: bool) -> None:
    """Host outputs into rows `rows` of y: added to the device part's (a host part), or in their place."""
    if adds:
        y[rows] += out
    else:
        y[rows] = out


def plain_linear(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """x [n, in] times an expert weight ([in, out] when `transposed`, else [out, in]) -> [n, out], as transformers'
    experts modules multiply one expert's rows."""
    return x @ weight if transposed else F.linear(x, weight)


def activate(base: nn.Module, has_gate: bool, apply_gate, h: torch.Tensor) -> torch.Tensor:
    """The gate function of experts module `base` on h [n, 2I] (gated) or [n, I] -> [n, I]: `apply_gate` where
    transformers' decorator gives one, else gate columns first, then up (Llama 4's experts)."""
    if not has_gate:
        return base.act_fn(h)  # [n, I]
    if apply_gate is not None:
        return apply_gate(h)
    gate, up = h.chunk(2, dim=-1)
    return base.act_fn(gate) * up  # [n, I]


def _to(device: torch.device, t: torch.Tensor) -> torch.Tensor:
    """A small host tensor (indices, offsets) on `device` without waiting for the device's queued work: torch's
    blocking host-to-device copy synchronises the stream; from pageable memory the non-blocking one has read its
    source when it returns."""
    return t.to(device, non_blocking=True)


def _ranges(starts: list[int], sizes: list[int]) -> np.ndarray:
    """The ranges [starts[i], starts[i] + sizes[i]) one after another, as one int64 array."""
    sizes_ = np.asarray(sizes, dtype=np.int64)
    ends = np.cumsum(sizes_)
    return np.arange(ends[-1] if len(ends) else 0, dtype=np.int64) + np.repeat(
        np.asarray(starts, dtype=np.int64) - ends + sizes_, sizes_
    )
