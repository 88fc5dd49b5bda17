"""Where each routed-expert tensor is in a checkpoint: key templates per fused tensor, from the adapter's
tables, transformers' conversion mapping or the fused in-memory names (`plan_keys`), checked against the
shard headers; and for a pre-quantized checkpoint, the keys of its quantized weights and their scales
(`plan_native_keys`, `native_codec_name`).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model_adapters import MoEAdapter

from .errors import CheckpointError
from .shards import NotStreamable, ShardIndex

KeysFn = Callable[[str, str], "tuple[str, ...] | None"]  # (module path, fused tensor name) -> key templates


def key_candidates(
    adapter: MoEAdapter,
    model: torch.nn.Module,
    index: ShardIndex,
    modules: dict[str, dict[str, torch.Tensor]],
    key_mapping: dict[str, str] | None = None,
) -> list[tuple[str, KeysFn]]:
    """Checkpoint layouts to try, in order: the adapter's tables (or, without any, the keys transformers' own
    renaming gives the fused expert tensors of `modules`, `name -> {tensor: meta tensor [E, ...]}`), then the
    fused in-memory names; where the checkpoint names the base model otherwise than the model (`across_prefix`), each
    of those again with the modules' paths as the checkpoint names them. With from_pretrained's `key_mapping` (regex -> replacement, applied to the checkpoint's
    keys), the keys transformers' renaming gives with it come first: the tables name keys as the family stores them.
    Raises `CheckpointError` where a layout finds more experts in the checkpoint than the config gives a module
    (`_refuse_extra_experts`): before any module's keys are planned, so before any expert is read."""
    found: list[tuple[str, KeysFn]] = [(f"{adapter.name} table", k.keys) for k in adapter.checkpoint_keys]
    if not found or key_mapping:
        targets = {f"{name}.{tensor}": t for name, tensors in modules.items() for tensor, t in tensors.items()}
        derived = transformers_keys(model, index, targets, key_mapping)
        if derived is not None:
            found.insert(0, ("transformers' key renaming" + (" with key_mapping" if key_mapping else ""), derived))
    found.append(("fused in-memory names", lambda path, tensor: (f"{path}.{tensor}",)))
    across = across_prefix(model, index)
    if across is not None:  # a base model's checkpoint in a model with a head, or the other way round
        found += [(f"{label}, {across.what}", across.keys(keys)) for label, keys in found]
    for _, keys in found:
        _refuse_extra_experts(index, modules, keys)
    return found


@dataclass(frozen=True)
class AcrossPrefix:
    """A checkpoint that names the base model otherwise than the model does: saved from a base model (no
    `<prefix>.` before its keys) and loaded into a model with a head, or the other way round, as transformers loads
    them (`base_model_prefix`). `path(module)`: the module's path as the checkpoint names it, None if it has none."""

    prefix: str
    strip: bool  # the model holds its base model under `prefix`; the checkpoint's keys do not start with it
    what: str

    def path(self, module: str) -> str | None:
        if not self.strip:
            return f"{self.prefix}.{module}"
        return module[len(self.prefix) + 1 :] if module.startswith(self.prefix + ".") else None

    def keys(self, keys: KeysFn) -> KeysFn:
        """`keys` for modules named as the checkpoint names them."""

        def across(module: str, tensor: str):
            path = self.path(module)
            return None if path is None else keys(path, tensor)

        return across


def across_prefix(model: torch.nn.Module, index: ShardIndex) -> AcrossPrefix | None:
    """How the checkpoint names the base model where that differs from the model (`AcrossPrefix`), else None."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix:
        return None
    in_checkpoint = any(key.startswith(prefix + ".") for key in index.entries)
    in_model = isinstance(getattr(model, prefix, None), torch.nn.Module)  # a head model holds its base model there
    if in_model and not in_checkpoint:
        return AcrossPrefix(prefix, True, f"keys without '{prefix}.' (a base model's checkpoint)")
    if not in_model and in_checkpoint:
        return AcrossPrefix(prefix, False, f"keys under '{prefix}.' (the checkpoint of a model with a head)")
    return None


def _refuse_extra_experts(index: ShardIndex, modules: dict[str, dict[str, torch.Tensor]], keys: KeysFn) -> None:
    """Raise `CheckpointError` where the checkpoint holds, under the per-expert key templates `keys` gives, expert E
    of a module whose config gives it E experts (`modules`: name -> {tensor: meta tensor [E, ...]}): transformers
    refuses such a checkpoint (the stacked tensor does not fit), and reading experts 0..E-1 alone would serve
    another model than the checkpoint's. Looks at the keys alone: no shard needs to have arrived."""
    for name, tensors in modules.items():
        for tensor, meta in tensors.items():
            templates, E = keys(name, tensor) or (), meta.shape[0]
            if isinstance(templates, Offset):  # one list dealt out to several modules: the next keys are another's
                continue
            extra = next((t.format(e=E) for t in templates if "{e}" in t and t.format(e=E) in index.entries), None)
            if extra is not None:
                raise CheckpointError(
                    f"{index.where}: the checkpoint holds expert {E} of {name} ({extra}), but its config gives that "
                    f"layer {E} experts (0..{E - 1}); transformers refuses it too. Give the config.json these weights "
                    "were saved with, or remove the extra experts' tensors (nothing was loaded)."
                )


class Rearranged(tuple):
    """Key templates of a fused tensor whose stored expert tensors transformers rearranges as it loads them:
    `undo` does the same to each expert's tensor as read (a permutation of its elements: the same bits), and
    `stored(shape)` is the shape an expert's tensor of loaded `shape` has in the checkpoint."""

    def __new__(cls, templates: tuple[str, ...], *dims: int):
        out = super().__new__(cls, templates)
        out.dims = dims
        return out

    def __reduce__(self):
        return type(self), (tuple(self), *self.dims)


class Interleaved(Rearranged):
    """Two halves stored interleaved along dim `dims[0]` (gate and up rows alternating: transformers' `Interleave`),
    put one after the other."""

    def undo(self, tensor: torch.Tensor) -> torch.Tensor:
        (d,) = self.dims
        return tensor.unflatten(d, (-1, 2)).transpose(d, d + 1).flatten(d, d + 1)

    def stored(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape)


class Transposed(Rearranged):
    """Stored with dims `dims` swapped (transformers' `Transpose`: Qwen3-VL-MoE's checkpoints keep `[H, 2I]`
    experts where the model computes with `[2I, H]`)."""

    def undo(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.transpose(*self.dims).contiguous()

    def stored(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        out, (a, b) = list(shape), self.dims
        out[a], out[b] = shape[b], shape[a]
        return tuple(out)


class Offset(tuple):
    """Key templates whose `{e}` counts from `first`: one module's experts stored after another's in one list of
    per-expert keys (ERNIE-4.5-VL keeps its text experts, then its vision experts, as `mlp.experts.{0..2E-1}`)."""

    def __new__(cls, templates: tuple[str, ...], first: int):
        out = super().__new__(cls, templates)
        out.first = first
        return out

    def __reduce__(self):
        return type(self), (tuple(self), self.first)

    def __eq__(self, other) -> bool:
        return tuple.__eq__(self, other) and getattr(other, "first", 0) == self.first

    def __ne__(self, other) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((tuple(self), self.first))


def expert_key(template: str, templates: tuple[str, ...], e: int) -> str:
    """The checkpoint key of expert e in `template`, one of `templates` (an `Offset` shifts its index)."""
    return template.format(e=e + getattr(templates, "first", 0))


class PerExpert(tuple):
    """Key templates of a fused tensor that transformers makes with operations this module does not know (a
    format it dequantizes while loading, say) from sources stored stacked, one `[E, ...]` tensor per source:
    each expert's slices of the sources, cast to the tensor's dtype as transformers' loader casts what it
    reads, go through the converter's own operations (`convert`). That holds where the operations treat each
    expert on its own, which `plan_keys` checks once per tensor name and load (`check_per_expert`: the whole
    stacks of the first module converted against its experts one by one)."""

    def __new__(cls, templates: tuple[str, ...], patterns: tuple[str, ...], converter, target: str, meta, config, seen):
        out = super().__new__(cls, templates)
        out.patterns, out.converter, out.target = patterns, converter, target
        out.meta, out.config, out.seen = meta, config, seen  # seen: the tensor names checked in this load
        return out

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def convert(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """The tensor the converter makes from `sources` (in template order, each `[n, ...]`: n experts' slices)."""
        conv, tensors = self.converter, {p: [t.to(self.meta.dtype)] for p, t in zip(self.patterns, sources)}
        for op in conv.operations:
            tensors = op.convert(
                tensors,
                source_patterns=conv.source_patterns,
                target_patterns=conv.target_patterns,
                full_layer_name=self.target,
                model=_ParamsOf({self.target: self.meta}),
                config=self.config,
                missing_keys=None,
            )
        (out,) = tensors.values()
        return out


class _ParamsOf:
    """What a conversion operation may ask of the model: its parameter's meta tensor (dtype and shape)."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params

    def get_parameter(self, name: str) -> torch.Tensor:
        return self.params[name]


def check_per_expert(index: ShardIndex, templates: PerExpert, meta: torch.Tensor) -> str | None:
    """None if converting one module's whole source stacks gives `meta`'s shape and, bit for bit, the experts
    converted one at a time; else what differs. Checked once per tensor name and load."""
    from safetensors import safe_open

    name = templates.target.rsplit(".", 1)[-1]
    if name in templates.seen:  # (two reader threads may both check it: the same answer)
        return None
    whole = []
    for t in templates:
        entry = index.entries[t]
        with safe_open(entry.file, "pt") as f:
            whole.append(f.get_tensor(t))
    try:
        converted = templates.convert(whole)
        each = torch.cat([templates.convert([w[e : e + 1] for w in whole]) for e in range(meta.shape[0])])
    except Exception as exc:  # an operation that needs more than one expert's slices
        return f"its conversion ({_ops(templates.converter)}) fails on one expert's slices: {exc}"
    if tuple(converted.shape) != tuple(meta.shape):
        return f"its conversion ({_ops(templates.converter)}) makes {list(converted.shape)}, not {list(meta.shape)}"
    if not torch.equal(converted, each):
        return f"its conversion ({_ops(templates.converter)}) does not treat each expert on its own"
    templates.seen.add(name)
    return None


def _ops(converter) -> str:
    return ", ".join(type(op).__name__ for op in converter.operations)


def transformers_keys(
    model: torch.nn.Module, index: ShardIndex, targets: dict[str, torch.Tensor], key_mapping: dict[str, str] | None = None
) -> KeysFn | None:
    """Checkpoint keys of the fused expert tensors `targets` (name -> its tensor, meta or not), found as transformers finds them when it loads:
    every checkpoint key renamed by its `rename_source_key` (the model's renamings, at most one converter, the
    base-model prefix), in the order it reads them. A target renamed from one key is read as stored; one
    converted from per-expert keys is read expert by expert when its converter only stacks them (and joins
    the stacks in its sources' order); one stored rearranged within each expert's tensor is read as
    `Rearranged` (`_converted`); one that other operations make from sources stored stacked, as `PerExpert`.
    Any other conversion gives no keys. `key_mapping`: from_pretrained's, renaming checkpoint keys first, as
    transformers applies it. Computed once, at the first lookup; None when this transformers has no such renaming."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        conversions = get_model_conversion_mapping(model, key_mapping)
    except Exception:  # not in this transformers version, or a model it cannot map
        return None
    targets = dict(targets)
    found: dict[str, tuple[str, ...]] = {}
    collected, lock = [], threading.Lock()  # modules may be planned from several reader threads
    seen: set[str] = set()  # the tensor names whose PerExpert conversion was checked in this load

    def collect() -> None:
        renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
        converters = [c for c in conversions if isinstance(c, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        state = dict.fromkeys(model.state_dict(), True) | dict.fromkeys(targets, True)
        prefix = getattr(model, "base_model_prefix", None)
        sources: dict[str, dict[str | None, list[str]]] = {}  # target -> converter source pattern -> keys
        for key in sorted(index.entries, key=dot_natural_key):
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, state)
            if renamed not in state and key in state:
                renamed, pattern = rename_source_key(key, [], [], prefix, state)
            if renamed in targets:
                sources.setdefault(renamed, {}).setdefault(pattern, []).append(key)
        for target, by_source in sources.items():
            if list(by_source) == [None] and len(by_source[None]) == 1:
                found[target] = (by_source[None][0],)
                continue
            converter = by_pattern.get(next(iter(by_source)))
            if converter is None or not set(by_source) <= set(converter.source_patterns):
                continue
            templates = None
            if set(by_source) == set(converter.source_patterns):
                sources = [by_source[p] for p in converter.source_patterns]
                if len(converter.target_patterns) > 1:  # one list of experts dealt out to several modules
                    for name, part in _split_targets(converter, target, sources).items():
                        if name in targets:
                            templates = _converted(part.ops, part.keys, index, tuple(targets[name].shape), part.first)
                            if templates is not None:
                                found[name] = Offset(templates, part.first)
                    continue
                templates = _converted(converter.operations, sources, index, tuple(targets[target].shape))
            if templates is None and all(len(keys) == 1 for keys in by_source.values()):  # sources stored stacked
                # the sources in the order transformers collects them (checkpoint order)
                keys = tuple(keys[0] for keys in by_source.values())
                templates = PerExpert(keys, tuple(by_source), converter, target, targets[target], model.config, seen)
            if templates is not None:
                found[target] = templates

    def keys(path: str, tensor: str) -> tuple[str, ...]:
        with lock:
            if not collected:
                collect()
                collected.append(True)
        return found.get(f"{path}.{tensor}", ())

    return keys


def _converted(
    operations, keys: list[list[str]], index: ShardIndex, shape: tuple[int, ...], first: int = 0
) -> tuple[str, ...] | None:
    """Key templates of the tensor a converter's `operations` make from `keys` (the checkpoint keys of each of its
    sources, in order) for a target of `shape`, or None where they do more than these: stack per-expert tensors
    (`MergeModulelist` on dim 0), then join the sources' stacks along each expert's rows (`Concatenate` on dim
    1), then rearrange each expert's tensor (`Interleave`, `Transpose` of dims past the experts'). `first`: the
    index the keys of expert 0 carry."""
    ops = list(operations)
    name = [type(op).__name__ for op in ops]
    stacks = name[:1] == ["MergeModulelist"] and ops[0].dim == 0
    ops, name = (ops[1:], name[1:]) if stacks else (ops, name)
    joined = name[:1] == ["Concatenate"] and ops[0].dim == 1
    ops, name = (ops[1:], name[1:]) if joined else (ops, name)
    if len(ops) > 1 or (len(keys) > 1 and not joined):
        return None
    templates = tuple(_template(k, first) if stacks else (k[0] if len(k) == 1 else None) for k in keys)
    if None in templates:
        return None
    if not ops:
        return templates
    op = ops[0]
    if name == ["Interleave"] and op.dim >= 1 and not op.inverse:
        return Interleaved(templates, op.dim - 1)
    if name == ["Transpose"] and min(op.dim0, op.dim1) >= 1 and len(templates) == 1 and "{e}" not in templates[0]:
        stored = index.entries[templates[0]].shape
        if op.check_dims and tuple(stored) == tuple(shape):  # transformers transposes only what does not fit
            return templates
        return Transposed(templates, op.dim0 - 1, op.dim1 - 1)
    return None


@dataclass(frozen=True)
class _TargetPart:
    """One target's share of a converter's sources: its keys of each source, the index its first expert's keys
    carry, and the operations that make it from them."""

    keys: list[list[str]]
    first: int
    ops: tuple


def _stack_and_join(op) -> tuple | None:
    """What transformers' `ErnieFuseAndSplitTextVisionExperts` does to each target's chunk of every source's list:
    stack it, then join the sources along each expert's rows (as `MergeModulelist` and `Concatenate` do)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    if op.stack_dim != 0 or op.concat_dim != 1:
        return None
    return (MergeModulelist(dim=0), Concatenate(dim=1))


# Operations that deal one list of per-expert keys out to several targets in equal chunks, in target order:
# operation class name -> the operations each target's chunk then goes through (None where it does more).
_LIST_SPLITS = {"ErnieFuseAndSplitTextVisionExperts": _stack_and_join}


def _split_targets(converter, target: str, sources: list[list[str]]) -> dict[str, _TargetPart]:
    """`target`'s converter makes several targets from one list per source (transformers names the keys after
    the first target pattern and deals the list out as it converts): each target's name and part, or nothing
    where the operation is not one of `_LIST_SPLITS`."""
    ops, patterns = list(converter.operations), list(converter.target_patterns)
    split = _LIST_SPLITS.get(type(ops[0]).__name__) if len(ops) == 1 else None
    each = split(ops[0]) if split is not None else None
    if each is None or patterns[0] not in target or len({len(k) for k in sources}) != 1:
        return {}
    size = -(-len(sources[0]) // len(patterns))  # transformers' chunks: ceil(n / targets) keys each
    return {
        target.replace(patterns[0], pattern, 1): _TargetPart([k[j * size : (j + 1) * size] for k in sources], j * size, each)
        for j, pattern in enumerate(patterns)
    }


def _template(keys: list[str], first: int = 0) -> str | None:
    """The template `t` with `t.format(e=first + i) == keys[i]` for every expert i (its index one dotted field
    of the key), or None."""
    fields = [k.split(".") for k in keys]
    if any("{" in k or "}" in k for k in keys) or len({len(f) for f in fields}) != 1:
        return None
    for at in reversed(range(len(fields[0]))):
        if all(
            f[at] == str(first + i) and f[:at] + f[at + 1 :] == fields[0][:at] + fields[0][at + 1 :] for i, f in enumerate(fields)
        ):
            return ".".join(fields[0][:at] + ["{e}"] + fields[0][at + 1 :])
    return None


def expert_rows(stored: tuple[int, ...], fused: tuple[int, ...] | None) -> tuple[int, ...]:
    """The shape of one expert's part of a tensor stored stacked with shape `stored`: row e of `[E, ...]`, or, where
    the tensor has as many dims as one expert's (`fused`: the `[E, ...]` shape it is read into), expert e's block of
    rows of `[E * n, ...]` (DBRX keeps its experts so)."""
    if fused is not None and len(stored) == len(fused) - 1 and stored and stored[0] % fused[0] == 0:
        return (stored[0] // fused[0], *stored[1:])
    return tuple(stored[1:])


def _match(index: ShardIndex, templates: tuple[str, ...], shape: tuple[int, ...], dtype: torch.dtype, E: int) -> str | None:
    """None if `templates` give every expert's tensor of per-expert `shape`, else what is wrong."""
    if isinstance(templates, PerExpert):  # the conversion's output is checked by `check_per_expert`
        for t in templates:
            if t not in index.entries:
                return f"no {t}"
            if not index.entries[t].shape or index.entries[t].shape[0] != E:
                return f"{t} has shape {list(index.entries[t].shape)}, expected [{E}, ...]"
        return None
    shape = templates.stored(shape) if isinstance(templates, Rearranged) else shape
    rows = 0
    for t in templates:
        keys = [expert_key(t, templates, e) for e in range(E)] if "{e}" in t else [t]
        missing = [k for k in keys if k not in index.entries]
        if missing and keys[0] in index.entries:  # this layout's tensors, some of them missing
            held = len(keys) - len(missing)
            if keys[held:] == missing:
                return Damage(f"its config gives it {E} experts, but the checkpoint holds {held} ({t}: no {missing[0]})")
            return Damage(f"no {missing[0]}, where the other experts' {t} tensors are there")
        if missing:
            return f"no {missing[0]}"
        shapes = Counter(index.entries[k].shape for k in keys)
        if len(shapes) != 1:
            usual = shapes.most_common(1)[0][0]
            odd = next(k for k in keys if index.entries[k].shape != usual)
            return Damage(
                f"{odd} in {index.entries[odd].file} has shape {list(index.entries[odd].shape)}, expected {list(usual)} "
                f"as the other experts' {t} tensors have"
            )
        for k in keys:
            entry = index.entries[k]
            piece = entry.shape if "{e}" in t else expert_rows(entry.shape, (E, *shape))
            blocks = len(piece) == len(entry.shape)  # [E * n, ...]
            if "{e}" not in t and (not entry.shape or not (blocks or entry.shape[0] == E)):
                return f"{k} has shape {list(entry.shape)}, expected [{E}, ...]"
            if entry.dtype is None or not (entry.dtype.is_floating_point and dtype.is_floating_point):
                return f"{k} has dtype {entry.dtype}, the model computes in {dtype}"
            if len(piece) != len(shape) or tuple(piece[1:]) != tuple(shape[1:]):
                return f"{k} has shape {list(entry.shape)}, which does not fit {list(shape)}"
        rows += piece[0]
    if rows != shape[0]:
        return f"{list(templates)} give {rows} rows, expected {shape[0]}"
    return None


class Damage(str):
    """What `_match` found wrong with tensors that are where a layout says, which no layout explains: experts of one
    tensor in different shapes (a damaged or mis-converted file), or fewer experts than the config gives. (Tensors
    that all have a shape the model does not expect may be another layout's, which a table may yet add.)"""


def plan_keys(
    adapter: MoEAdapter,
    model: torch.nn.Module,
    modules: dict[str, dict[str, torch.Tensor]],
    index: ShardIndex,
    candidates: list[tuple[str, KeysFn]] | None = None,
    key_mapping: dict[str, str] | None = None,
) -> dict[str, dict[str, tuple[str, ...]]]:
    """For every experts module (`name -> {tensor: meta tensor [E, ...]}`), the checkpoint key templates
    of each tensor. Raises `NotStreamable` naming what was looked for when no layout fits. `candidates`:
    the layouts to try (`key_candidates`, given `key_mapping`), for a caller that plans one module at a time."""
    if candidates is None:
        candidates = key_candidates(adapter, model, index, modules, key_mapping)
    plan = {}
    for name, tensors in modules.items():
        problems, damage = [], None
        for label, keys in candidates:
            found, problem = {}, None
            for tensor, meta in tensors.items():
                templates = keys(name, tensor)
                problem = f"{tensor}: no checkpoint key for it" if not templates else None
                problem = problem or _match(index, templates, tuple(meta.shape[1:]), meta.dtype, meta.shape[0])
                if problem is None and isinstance(templates, PerExpert):
                    problem = check_per_expert(index, templates, meta)
                if problem:
                    break
                found[tensor] = templates
            if problem is None:
                plan[name] = found
                break
            problems.append(f"{label}: {problem}")
            damage = damage or (problem if isinstance(problem, Damage) else None)
        else:
            if damage is not None:  # loading the whole checkpoint would not help: say what is wrong with it
                raise CheckpointError(
                    f"{index.where}: the experts of {name} do not fit the model its config.json builds: {damage}. A "
                    "damaged or mis-converted file, or another config.json than these weights were saved with: copy the "
                    "checkpoint again, or give the config.json they were saved with (nothing was loaded)."
                )
            raise NotStreamable(f"the experts of {name} are not where mira-hf looks for them ({'; '.join(problems)})")
    return plan


# -- pre-quantized checkpoints ---------------------------------------------------------------------------
@dataclass(frozen=True)
class NativeKeys:
    """Where one quantized fused tensor of a pre-quantized checkpoint is: key templates of its weights and
    of their scales, each concatenated along dim 0 when there are several (`gate_proj`, `up_proj`)."""

    weights: tuple[str, ...]
    scales: tuple[str, ...]


def quantization_dict(quantization) -> dict:
    return dict(quantization) if isinstance(quantization, dict) else quantization.to_dict()


def native_codec_name(quantization) -> str | None:
    """The codec serving a pre-quantized checkpoint's experts in the bytes it stores them in ("fp8_block",
    "mxfp4"), from config.json's `quantization_config`; None for a checkpoint that is not quantized.
    Raises `NotStreamable` naming the format of a quantized checkpoint served otherwise."""
    if not quantization:
        return None
    qc = quantization_dict(quantization)
    method = qc.get("quant_method")
    if method == "fp8":
        unsupported = [
            f"{k}={qc.get(k)!r}"
            for k, ok in (
                ("weight_block_size", qc.get("weight_block_size") is not None),
                ("scale_fmt", qc.get("scale_fmt") in (None, "float")),
                ("expert_dtype", qc.get("expert_dtype") in (None, "fp8")),
                ("activation_scheme", qc.get("activation_scheme") in (None, "dynamic")),
            )
            if not ok
        ]
        if unsupported:
            raise NotStreamable(
                f"it is an FP8 checkpoint with {', '.join(unsupported)}; mira-hf reads the experts of FP8 checkpoints "
                "with block scales (weight_block_size), float scales and dynamic activations itself"
            )
        return "fp8_block"
    if method == "mxfp4":
        return "mxfp4"
    raise NotStreamable(
        f"it is pre-quantized with quant_method={method!r}, whose experts transformers' quantizer reads; mira-hf reads "
        "the experts of 'fp8' (block-wise) and 'mxfp4' checkpoints itself"
    )


def _fp8_keys(module: str, tensor: str, templates: tuple[str, ...]) -> NativeKeys:
    """FP8: the planned weight keys, each with its `weight_scale_inv` (a stacked `<fused>_scale_inv`)."""
    scales = tuple(t[: -len("weight")] + "weight_scale_inv" if t.endswith(".weight") else t + "_scale_inv" for t in templates)
    return NativeKeys(templates, scales)


def _mxfp4_keys(module: str, tensor: str, templates: tuple[str, ...]) -> NativeKeys:
    """MXFP4 (gpt-oss): `<fused>_blocks` and `<fused>_scales`, stacked over experts."""
    return NativeKeys((f"{module}.{tensor}_blocks",), (f"{module}.{tensor}_scales",))


# codec -> (NativeKeys of a quantized tensor, whether its weights are planned with the unquantized ones first)
_NATIVE_KEYS = {"fp8_block": (_fp8_keys, True), "mxfp4": (_mxfp4_keys, False)}


def _present(index: ShardIndex, templates: tuple[str, ...], E: int) -> str | None:
    """None if every expert's tensor of `templates` is in the checkpoint, else what is missing."""
    for t in templates:
        if "{e}" in t:
            missing = [t.format(e=e) for e in range(E) if t.format(e=e) not in index.entries]
            if missing:
                return f"no {missing[0]}"
        elif t not in index.entries:
            return f"no {t}"
        elif not index.entries[t].shape or index.entries[t].shape[0] != E:
            return f"{t} has shape {list(index.entries[t].shape)}, expected [{E}, ...]"
    return None


# codec -> (the dtype its weights are stored in, whether its scales are floating-point)
_STORED = {"fp8_block": (getattr(torch, "float8_e4m3fn", None), True), "mxfp4": (torch.uint8, False)}


def _stored_as(codec_name: str, index: ShardIndex, nk: NativeKeys) -> str | None:
    """None where `nk`'s tensors are stored in the dtypes the codec reads, else what differs (FP8 weights packed two
    FP4 values a byte, E8M0 scales stored as bytes: formats transformers' quantizer reads itself)."""
    weight_dtype, float_scales = _STORED[codec_name]
    weight, scale = nk.weights[0].format(e=0), nk.scales[0].format(e=0)
    found = index.entries[weight].dtype
    if found is not None and found != weight_dtype:
        return f"{weight} is stored as {found}, not {weight_dtype}"
    found = index.entries[scale].dtype
    if float_scales and found is not None and not found.is_floating_point:
        return f"{scale} is stored as {found}, not as floating-point scales"
    return None


def plan_native_keys(
    codec_name: str,
    quantization,
    adapter: MoEAdapter,
    model: torch.nn.Module,
    modules: dict[str, dict[str, torch.Tensor]],
    index: ShardIndex,
):
    """`plan_keys` for a pre-quantized checkpoint: (keys of the tensors it stores unquantized (biases), cast
    to the model dtype as usual; `NativeKeys` of the quantized ones, read as stored; the codec serving
    them). Raises `NotStreamable` naming what was looked for when the checkpoint does not fit."""
    from .quant import make_codec

    keys_of, plan_weights = _NATIVE_KEYS[codec_name]
    plain = {n: {t: m for t, m in ts.items() if plan_weights or t.endswith("_bias")} for n, ts in modules.items()}
    keys = plan_keys(adapter, model, plain, index)
    if any(isinstance(t, Rearranged) for per in keys.values() for t in per.values()):
        raise NotStreamable(f"its {codec_name} experts are stored rearranged (interleaved or transposed)")
    native: dict[str, dict[str, NativeKeys]] = {}
    for name, tensors in modules.items():
        native[name] = {}
        E = next(iter(tensors.values())).shape[0]
        for tensor in [t for t in tensors if not t.endswith("_bias")]:
            nk = keys_of(name, tensor, keys[name].pop(tensor, ()))
            problem = _present(index, nk.weights, E) or _present(index, nk.scales, E)
            if problem:
                raise NotStreamable(f"the {codec_name} experts of {name} are not where mira-hf looks for them ({problem})")
            problem = _stored_as(codec_name, index, nk)
            if problem:
                raise NotStreamable(f"the {codec_name} experts of {name} are stored in a form mira-hf does not read ({problem})")
            native[name][tensor] = nk
    pieces = {tensor: len(nk.weights) for per in native.values() for tensor, nk in per.items()}
    if any(len(nk.weights) != pieces[t] for per in native.values() for t, nk in per.items()):
        raise NotStreamable("its experts modules store their weights in different numbers of tensors")
    options = {"block_size": quantization_dict(quantization).get("weight_block_size")} if codec_name == "fp8_block" else {}
    return keys, native, make_codec(codec_name, pieces=pieces, **options)
