"""`mira env`: the GPU, its link, host memory and library versions; with --model, a gpu_budget to start from."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import time

from .. import report
from ..bundled import resolve_model_name
from .options import doc


def register(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("env", help="GPU, PCIe, copy bandwidth, host memory and library versions", description=doc(cmd_env))
    e.add_argument("--model", metavar="PATH", help="also suggest a gpu_budget for this model directory (or mira-tiny)")
    e.set_defaults(run=cmd_env)


def cmd_env(args: argparse.Namespace) -> int:
    """Print the GPU(s) and their PCIe links, measured host-to-device copy bandwidth (pinned and pageable),
    host memory and library versions; with --model, the model's expert and non-expert bytes (read from the
    safetensors headers, no weights loaded) and a suggested gpu_budget."""
    import torch

    from .. import __version__

    sections: list[tuple[str, list[tuple[str, str]]]] = []
    versions = [("python", platform.python_version()), ("mira-hf", __version__)]
    for package in ("torch", "transformers", "accelerate", "safetensors", "tokenizers", "bitsandbytes", "triton"):
        try:
            versions.append((package, importlib.metadata.version(package)))
        except importlib.metadata.PackageNotFoundError:
            versions.append((package, "not installed"))
    total, available = _host_memory()
    host = [
        ("platform", platform.platform()),
        ("CPU cores", str(os.cpu_count())),
        ("memory", f"{report.format_bytes(total)} total, {report.format_bytes(available)} available"),
    ]
    sections += [("host", host), ("libraries", versions)]

    gpus: list[tuple[str, str]] = []
    if torch.cuda.is_available():
        links = _pcie_links()
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, total_gpu = torch.cuda.mem_get_info(i)
            gpus.append(
                (
                    f"cuda:{i}",
                    f"{props.name}, {report.format_bytes(total_gpu)} ({report.format_bytes(free)} free), "
                    f"compute {props.major}.{props.minor}",
                )
            )
            gpus.append(("  PCIe", _pcie_text(props, i, links)))
        device = torch.device("cuda", torch.cuda.current_device())
        for pinned in (True, False):
            label = f"  {'pinned' if pinned else 'pageable'} host→device"
            gpus.append((label, f"{_h2d_bandwidth(device, pinned) / 1e9:.1f} GB/s (256 MiB copy, cuda:{device.index})"))
    else:
        gpus.append(("CUDA", f"not available (torch {torch.__version__}); the device is the CPU"))
    sections.append(("GPU", gpus))
    if args.model:
        sections.append(("model", _budget_suggestion(args.model)))

    for title, rows in sections:
        print(f"{title}:")
        print("\n".join("  " + line for line in report.aligned_rows(rows)))
    return 0


def _host_memory() -> tuple[int | None, int | None]:
    try:
        import psutil

        vm = psutil.virtual_memory()
        return vm.total, vm.available
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        return info.get("MemTotal"), info.get("MemAvailable")
    except OSError:
        return None, None


def _pcie_links() -> dict[str, str]:
    """PCI bus id (lowercase, "0000:19:00.0") -> "gen 5 x16 (max gen 5 x16)", from nvidia-smi; {} without it."""
    query = "pci.bus_id,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=15,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    links = {}
    for line in out.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 5:
            bus, gen, width, gen_max, width_max = fields
            links[_normal_bus_id(bus)] = f"gen {gen} x{width} (max gen {gen_max} x{width_max}; an idle link may run slower)"
    return links


def _normal_bus_id(bus_id: str) -> str:
    """nvidia-smi writes an 8-digit PCI domain ("00000000:19:00.0"), torch a 4-digit one: compare the last 12 characters."""
    return bus_id.lower()[-12:]


def _pcie_text(props, index: int, links: dict[str, str]) -> str:
    domain, bus, dev = (getattr(props, a, None) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    if None not in (domain, bus, dev):
        key = _normal_bus_id(f"{domain:04x}:{bus:02x}:{dev:02x}.0")
        if key in links:
            return links[key]
    ordered = list(links.values())
    if len(ordered) == 1 or ("CUDA_VISIBLE_DEVICES" not in os.environ and index < len(ordered)):
        return ordered[index if len(ordered) > 1 else 0]
    return "unknown (nvidia-smi not available)"


def _h2d_bandwidth(device, pinned: bool, nbytes: int = 256 * 2**20) -> float:
    """Bytes per second of one host-to-device copy of `nbytes`, best of 3 after a warm-up copy."""
    import torch

    from ..pinned import pinned_empty

    src = pinned_empty(nbytes) if pinned else torch.empty(nbytes, dtype=torch.uint8)  # the memory the store copies from
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for i in range(4):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize(device)
        if i:  # the first copy warms up the allocator and the DMA path
            best = min(best, time.perf_counter() - start)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / best


def _budget_suggestion(model: str) -> list[tuple[str, str]]:
    """Rows of `mira env --model`: the model's shape and bytes, and a gpu_budget to start from."""
    import torch

    from ..budget import FREE_MEMORY_SHARE, default_budget_bytes

    path = resolve_model_name(model)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--model {model}: no such directory (env reads config.json and the safetensors headers).")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path} has no config.json: expected a transformers model directory.")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path} is not valid JSON ({exc}): expected a transformers config.json.") from exc
    text = config.get("text_config") or config
    num_experts = next((text[k] for k in ("num_local_experts", "num_experts", "n_routed_experts") if k in text), None)
    top_k = text.get("num_experts_per_tok") or text.get("moe_top_k")
    expert_bytes, other_bytes, moe_layers, files = _checkpoint_bytes(path)
    rows = [
        ("path", path),
        (
            "architecture",
            f"{config.get('model_type', '?')}: {text.get('num_hidden_layers', '?')} layers, {len(moe_layers)} with routed "
            f"experts, {num_experts or '?'} experts per layer, top-{top_k or '?'}",
        ),
        (
            "weights",
            f"{report.format_bytes(expert_bytes)} routed experts + {report.format_bytes(other_bytes)} other, "
            f"in {len(files)} safetensors file(s), at the checkpoint's dtype",
        ),
    ]
    if not expert_bytes:
        rows.append(("gpu_budget", 'no tensor named "*.experts.*": not an MoE checkpoint mira-hf can offload'))
        return rows
    if num_experts and top_k and moe_layers:
        per_expert = expert_bytes / (len(moe_layers) * num_experts)
        rows.append(("minimum budget", f"{report.format_bytes(top_k * per_expert)} (the top-{top_k} experts of one layer)"))
    if not torch.cuda.is_available():
        rows.append(
            (
                "gpu_budget",
                "no CUDA GPU: the device is host memory, so gpu_budget only bounds the expert cache; "
                "--budget 0.25 makes the caching visible",
            )
        )
        return rows
    free, _ = torch.cuda.mem_get_info()
    if other_bytes >= int(FREE_MEMORY_SHARE * free):
        rows.append(
            (
                "gpu_budget",
                f"the non-expert weights ({report.format_bytes(other_bytes)}) do not fit in {FREE_MEMORY_SHARE:.0%} of the "
                f"{report.format_bytes(free)} free on the GPU",
            )
        )
        return rows
    budget = default_budget_bytes(free, expert_bytes, other_bytes)  # what gpu_budget=None gives on this GPU now
    note = "every expert fits" if budget == expert_bytes else f"{budget / expert_bytes:.0%} of the experts"
    rows.append(
        (
            "gpu_budget",
            f'"{report.format_bytes(budget).replace(" ", "")}" ({note}; min(all experts, {FREE_MEMORY_SHARE:g} × free GPU '
            "memory − non-expert weights), the default of gpu_budget=None)",
        )
    )
    return rows


def _checkpoint_bytes(path: str) -> tuple[int, int, set[str], list[str]]:
    """(routed-expert bytes, other bytes, MoE layer ids, files) from the safetensors headers (`ShardIndex`); no tensor
    is read. Expert tensors are those whose name contains ".experts." (shared experts are "shared_expert(s)", not
    counted). A dtype torch cannot name (F8_E8M0 scales, ...) is counted at one byte per element."""
    import torch

    from ..shards import NotStreamable, ShardIndex

    try:
        index = ShardIndex.find(path, {})
    except NotStreamable as exc:
        raise FileNotFoundError(f"{path}: {exc}; mira env reads the safetensors headers.") from None
    expert, other, layers = 0, 0, set()
    for key, entry in index.entries.items():
        itemsize = torch.empty((), dtype=entry.dtype).element_size() if entry.dtype is not None else 1
        nbytes = itemsize * math.prod(entry.shape)
        if ".experts." in key:
            expert += nbytes
            match = re.search(r"layers\.(\d+)\.", key)
            layers.add(match.group(1) if match else key.rsplit(".experts.", 1)[0])
        else:
            other += nbytes
    return expert, other, layers, [os.path.basename(f) for f in index.files]
