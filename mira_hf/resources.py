"""What a load needs of the machine, checked before anything changes: device memory for the expert arena
and the weights that move there, host memory for the store, disk space for its offloaded part; and the
slot plan of a wrapped model whose records or device change (`replan`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import offload_files
from .budget import LayerInfo, plan_records, resolve_budget_bytes
from .config import MiraConfig
from .errors import BudgetError, ConfigError
from .proxy import MiraExperts
from .store import over_host_budget

if TYPE_CHECKING:
    from .manager import ExpertManager
    from .targets import Target


_PROC_CGROUP = "/proc/self/cgroup"
_CGROUP_ROOT = "/sys/fs/cgroup"
_UNLIMITED = 2**62  # cgroup v1 writes "no limit" as the largest page-aligned int64


def available_host_bytes() -> int | None:
    """Host memory this process can still take: MemAvailable from /proc/meminfo (Linux), or what its memory cgroup
    leaves where that is less (a container's limit: `cgroup_room`); None where neither is known."""
    known = [n for n in (_mem_available(), cgroup_room()) if n is not None]
    return min(known) if known else None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cgroup_room() -> int | None:
    """Bytes the memory cgroups of this process (its own and each above it) still allow, the least of them: each
    limit less its usage, with the inactive file pages counted as room (page cache the kernel reclaims before it
    kills); None where no limit is set. cgroup v2: `memory.max`, `memory.current`; v1: `memory.limit_in_bytes`,
    `memory.usage_in_bytes`."""
    try:
        with open(_PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            rooms += _rooms(_CGROUP_ROOT, path, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base = os.path.join(_CGROUP_ROOT, "memory")
            rooms += _rooms(base, path, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    return min(rooms) if rooms else None


def _rooms(base: str, path: str, limit_file: str, usage_file: str, inactive: str) -> list[int]:
    """The room under each limit set from the group at `path` of the hierarchy mounted at `base` up to its root. (In
    a container the hierarchy's root is the container's own group, whatever `path` says: a group not there is
    skipped.)"""
    rooms, directory = [], os.path.normpath(os.path.join(base, path.strip("/")))
    while True:
        limit = _read_int(os.path.join(directory, limit_file))
        usage = _read_int(os.path.join(directory, usage_file))
        if limit is not None and limit < _UNLIMITED and usage is not None:
            rooms.append(max(0, limit - usage + _stat(os.path.join(directory, "memory.stat"), inactive)))
        if len(directory) <= len(base):
            return rooms
        directory = os.path.dirname(directory)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):  # not there, or "max" (v2's no limit)
        return None


def _stat(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def budget_fraction(budget) -> float | None:
    """The budget if it is a fraction of the experts' bytes (raised to the minimum working set when below it)."""
    return budget if isinstance(budget, float) else None


def bytes_to_move(model: nn.Module, targets: list[Target], device: torch.device) -> int:
    """Bytes of non-expert weights and buffers that `model.to(device)` will still copy there (the experts,
    before wrapping the modules' tensors, after it the proxies' parameters, stay in the store). Weights on
    the meta device (a skeleton's, not loaded yet) all count: they will be loaded, then moved."""
    experts = {p.data_ptr() for t in targets for n in t.tensors for p in t.layout.held(t.module, n) if not p.is_meta}
    served = {id(p) for m in model.modules() if isinstance(m, MiraExperts) for p in m.parameters(recurse=False)}
    tensors = [x for x in [*model.parameters(), *model.buffers()] if id(x) not in served]
    return sum(x.numel() * x.element_size() for x in tensors if x.device != device and (x.is_meta or x.data_ptr() not in experts))


def check_device_memory(
    capacity: int, device: torch.device, model: nn.Module | None, targets: list[Target], reclaim_bytes: int = 0
) -> None:
    """`reclaim_bytes`: device memory freed before the arena is allocated (the arena a new plan replaces)."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    free += reclaim_bytes
    need = capacity + _other_bytes(model, targets, device)
    if need > free:
        raise BudgetError(
            f"the expert arena ({capacity:,} bytes) plus the weights that move to {device} need {need:,} bytes, but "
            f"only {free:,} are free there. Lower MiraConfig(gpu_budget=...) (e.g. a fraction such as 0.25)."
        )


def check_offload_space(cfg: MiraConfig, layer_bytes: list[int]) -> None:
    """Experts beyond `host_budget` go to `offload_dir`: refuse a load that cannot fit there. The files of loads
    whose process was killed are removed first (`offload_files.remove_orphans`)."""
    if cfg.host_budget_bytes is None:
        return
    _, disk = _host_and_disk_bytes(layer_bytes, cfg.host_budget_bytes)
    path = offload_files.existing(cfg.offload_dir)  # where a directory not made yet will be
    if not os.path.isdir(path):
        raise ConfigError(
            f"offload_dir={cfg.offload_dir!r}: {path} is a file, not a directory. Give offload_dir a directory (it is "
            "created if missing) where the experts beyond host_budget are written."
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(
            f"offload_dir={cfg.offload_dir!r}: {path} cannot be written (a read-only disk, or no permission), and the "
            "experts beyond host_budget are written there. Give offload_dir a directory you can write to."
        )
    remedy = "give offload_dir a disk with more space, or raise host_budget"
    offload_files.check_room(os.path.abspath(cfg.offload_dir), disk, f"with host_budget={cfg.host_budget!r}, this load", remedy)


def _host_and_disk_bytes(layer_bytes: list[int], host_budget: int | None) -> tuple[int, int]:
    """Bytes of the store in host memory and on disk, layer by layer as `ExpertStore` places them."""
    host = disk = 0
    for n in layer_bytes:
        if over_host_budget(host, n, host_budget):
            disk += n
        else:
            host += n
    return host, disk


def host_has_room(nbytes: int) -> bool:
    """Whether `nbytes` of host memory are available now (unknown: no)."""
    available = available_host_bytes()
    return available is not None and nbytes <= available


def unloaded_bytes(model: nn.Module) -> int:
    """Bytes of the weights and buffers still on the meta device (a skeleton's): host memory their load will take."""
    return sum(x.numel() * x.element_size() for x in [*model.parameters(), *model.buffers()] if x.is_meta)


def check_host_memory(
    cfg: MiraConfig, layer_bytes: list[int], targets: list[Target], streamed: bool, exact: bool, loading_bytes: int = 0
) -> None:
    """Refuse a store that cannot fit in host memory, before anything changes (instead of the kernel's
    OOM killer halfway through). Experts already in host memory with an exact format are freed layer by
    layer as the store takes them, so only one layer is new memory; otherwise (streamed from the
    checkpoint, on a GPU, or kept until the end because a lossy format cannot give them back) the whole
    host tier is. `loading_bytes`: what the model's other weights, not loaded yet, will take besides."""
    available = available_host_bytes()
    if available is None:
        return
    available -= loading_bytes
    host, _ = _host_and_disk_bytes(layer_bytes, cfg.host_budget_bytes)
    in_host = not streamed and all(p.device.type == "cpu" for t in targets for n in t.tensors for p in t.layout.held(t.module, n))
    need = max(layer_bytes, default=0) if in_host and exact else host
    if need > available:
        besides = f" besides the {loading_bytes:,} bytes of the model's other weights" if loading_bytes else ""
        raise BudgetError(
            f"the expert store needs {need:,} more bytes of host memory ({host:,} in all, {len(layer_bytes)} layers), "
            f"but only {available:,} are available{besides}. Keep part of the experts on disk: MiraConfig(host_budget=..., "
            "offload_dir=...) (e.g. host_budget='16GiB'), or use a smaller transfer format (quantization='int4'), "
            "or free host memory."
        )


def replan(
    manager: ExpertManager,
    model: nn.Module | None,
    cfg: MiraConfig,
    layers: list[LayerInfo],
    targets: list[Target],
    layouts,
    raw_bytes,
    device: torch.device,
    expert_bytes=None,
):
    """The slot plan of a wrapped model whose records changed (`layouts`, `raw_bytes`: per layer, after a
    cast or a load) or that moves to `device`, from the budget it was wrapped with; raises `BudgetError`
    before anything changes. A fraction budget is a share of the experts' bytes in their new dtype: `expert_bytes`
    per layer, one whole expert uncompressed, where the slots hold less (`host_compute="split"`), else `raw_bytes`.
    `model` None: the model was dropped and a part of it kept (`model.model`) is cast; its other weights are not
    counted in the device's room."""
    all_bytes = sum((expert_bytes or raw_bytes)[li.ordinal] * li.num_experts for li in layers)
    same = device == manager.device
    if cfg.gpu_budget is None and device.type == "cuda" and same:
        budget_bytes = manager.budget.budget_bytes  # what free memory gave at wrap; it now excludes the arena
    else:
        budget_bytes = resolve_budget_bytes(cfg, all_bytes, device, lambda: _other_bytes(model, targets, device))
    budget = plan_records(
        layers,
        budget_bytes,
        manager.placement,
        manager.store.codec,
        layouts,
        raw_bytes,
        budget_fraction(cfg.gpu_budget),
        all_bytes,
    )
    check_device_memory(budget.device_bytes, device, model, targets, reclaim_bytes=manager.device_bytes if same else 0)
    return budget


def _other_bytes(model: nn.Module | None, targets: list[Target], device: torch.device) -> int:
    return 0 if model is None else bytes_to_move(model, targets, device)
