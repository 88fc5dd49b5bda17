"""Decode speed with the experts' host copies page-locked, pageable, or partly on disk, on GPU shapes.

A pinned (page-locked) store is copied to the GPU by the copy engine straight from its slabs. A pageable store
(`MiraConfig(host_memory="pageable")`: nothing to pin at load) and the disk tier (`host_budget` with `offload_dir`:
the layers beyond the budget memory-mapped from files) are copied through the pinned staging ring: the host's cores
move each record into a ring buffer, the copy engine moves it on. This measures what the ring costs in decode.

For each workload (`host_compute.py`'s: the expert dimensions of Mixtral-8x7B, Qwen3-30B-A3B and gpt-oss-20b cut
to a few layers, random bf16 weights, routers spread as trained ones are) and expert budget, the same model is
wrapped once per system, one after the other in the same process:

    lru        LRU eviction, no prediction, whole experts uncompressed (batch 1 only: its routing gives the floor)
    default    MiraConfig's defaults: a pinned store
    pageable   the same, host_memory="pageable"
    disk-X     the same, with host_budget = X of the expert bytes: the later layers' experts on disk
               (files in a temporary directory; the operating system's page cache may hold them, as it would
               for any model whose files fit in free host memory)

Metrics as `host_split.py`'s: decode tokens/s at batch 1 (median of `--rounds`), batch 8 and beam search, time per
token over the PCIe floor, bytes per token, hit rate, and the largest logit difference against `default` (all
exact: 0). Also the disk's own read speed (a file of `--disk-probe-gb` written, flushed, dropped from the page
cache and read back), which bounds the disk tier where the page cache cannot hold its files.

    python benchmarks/store_tiers.py --models mixtral --out benchmarks/results/    # H200: ~5 minutes
    python benchmarks/store_tiers.py --smoke --out /tmp                            # CPU, tiny shapes: checks the script

Writes OUT/<date>-<device>-store-tiers.json and .md.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import host_split  # noqa: E402  (sets up the path, the clock and the offline environment)
from bench.clock import log  # noqa: E402

from mira_hf import MiraConfig  # noqa: E402

TITLE = "Decode from a pinned store, a pageable store and the disk tier"
SYSTEMS = "lru,default,pageable,disk-0.5"


def configs_of(offload_dir: str):
    """`host_split.configs` with two more systems, the disk tier's files in `offload_dir`: "pageable" and
    "disk-<share>"; every other name is `host_split`'s (lru, default, ...)."""

    def configs(args, gpu_budget, device: str, facts: dict) -> list[tuple[str, MiraConfig]]:
        base = dict(gpu_budget=gpu_budget, device=device)
        out = []
        for system in args.systems:
            if system == "pageable":
                out.append((system, MiraConfig(**base, host_memory="pageable")))
            elif system.startswith("disk-"):
                host_budget = int(float(system[len("disk-") :]) * facts["expert_bytes"])
                out.append((system, MiraConfig(**base, host_budget=host_budget, offload_dir=offload_dir)))
            else:
                try:
                    out += host_split.configs(argparse.Namespace(**{**vars(args), "systems": [system]}), gpu_budget, device)
                except SystemExit as exc:
                    raise SystemExit(f"{exc} (or pageable, disk-<share of the experts' bytes in host memory>)") from None
        return out

    return configs


def disk_read_gbps(directory: str, nbytes: int) -> float | None:
    """GB/s of reading back a file of `nbytes` written to `directory`, flushed and dropped from the page cache
    (`posix_fadvise` DONTNEED); None where the page cache cannot be dropped (it would measure memory)."""
    if not hasattr(os, "posix_fadvise") or nbytes <= 0:
        return None
    path = os.path.join(directory, "read_probe.bin")
    block = os.urandom(1 << 20) * 64  # 64 MiB
    try:
        with open(path, "wb") as f:
            for _ in range(max(1, nbytes // len(block))):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0, total = time.perf_counter(), 0
            while chunk := os.read(fd, 16 << 20):
                total += len(chunk)
            return total / (time.perf_counter() - t0) / 1e9
        finally:
            os.close(fd)
    finally:
        if os.path.exists(path):
            os.remove(path)


def main(argv=None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--disk-probe-gb", type=float, default=4.0, help="size of the disk read probe's file (0: skip)")
    pre.add_argument("--offload-dir", default=None, help="where the disk tier's files go (default: a temporary directory)")
    extra, rest = pre.parse_known_args(argv)
    args = host_split.parse_args(rest, doc=__doc__, systems=SYSTEMS)
    offload_dir = tempfile.mkdtemp(prefix="mira_store_tiers_", dir=extra.offload_dir)
    try:
        probe = disk_read_gbps(offload_dir, int((0.05 if args.smoke else extra.disk_probe_gb) * 1e9))
        log(f"disk read speed (page cache dropped): {probe} GB/s")
        return host_split.main(
            configs_of=configs_of(offload_dir), slug="store-tiers", title=TITLE, args=args, extra={"disk_read_gbps": probe}
        )
    finally:
        shutil.rmtree(offload_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
