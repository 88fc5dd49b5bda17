"""Which CPU kernel computes an expert on the host fastest: one expert's SwiGLU (`down @ silu(gate x) * (up x)`) at
1 and 8 rows for the Mixtral, gpt-oss and Qwen3 expert shapes, and a quarter of a Mixtral expert's neurons (the
split's host part), by several torch paths, against the host memory's read speed.

Paths (bf16 weights unless named):
- `onednn`: `F.linear` as torch runs it by default (oneDNN where the CPU has bf16 matrix instructions), the path
  `host_compute` uses;
- `native`: the same calls with oneDNN turned off (torch's own bf16 kernels: a GEMV with fp32 sums at one row);
- `native_mv`: one row as matrix-vector products, oneDNN off;
- `fp32`: weights and rows widened to fp32 (twice the bytes);
- `neuron_threads`: the expert cut into as many neuron ranges as threads, each range's whole SwiGLU computed by its
  own Python thread with one torch thread (no barrier between the projections), the partial outputs summed;
- `prepacked`: each weight laid out once in oneDNN's blocked format for one row (`pack_ms`: the laying out, per
  expert);
- `compiled`: each projection written as products summed in fp32 (`(w * x).sum(-1)`), compiled by torch's
  compiler into one loop over the bf16 weights per projection (`compile_s`: the compilation, once per shape).

Where oneDNN runs torch's bf16 matmuls, `ONEDNN_MAX_CPU_ISA` (read once, at its first use) caps the instructions it
may use: `AVX512_CORE_BF16` leaves out the AMX tiles.

Each timed call reads another expert (weights come from memory, as in use). Also: the memory's read speed (a sum
over a 2 GiB fp32 tensor) and the fastest path and `onednn` while the link copies at full speed (CUDA only).

    python benchmarks/host_kernel_probe.py     # writes $OUT/host_kernel_probe.json (else /tmp/host_kernel_probe.json)
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python benchmarks/host_kernel_probe.py --paths onednn,prepacked --name isa
        # oneDNN without AMX, some paths only: $OUT/host_kernel_probe_isa.json
    python benchmarks/host_kernel_probe.py --gaps --name gaps
        # host parts as decode runs them (jobs apart on a pinned worker, by cores left to the submitting thread)

Keys: `<shape>.<path>.rows<n>`: {"ms": median, "gbps": weight bytes read per second}, `<shape>.pack_ms`,
`<shape>.prepacked_rel_diff` (largest difference from `onednn`'s output over its largest); `memory_read_gbps`;
`during_link.<shape>.<path>`: the same under copies, and `link_gbps_alone` / `link_gbps_with_host`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F


def can_prepack() -> bool:
    """Whether this torch build and CPU lay bf16 weights out for oneDNN (AVX-512 or AVX-NE-CONVERT)."""
    try:
        PrepackedLinear(torch.ones(16, 16, dtype=torch.bfloat16))
    except (RuntimeError, AttributeError):
        return False
    return True


class PrepackedLinear:
    """A weight [out, in] laid out once in oneDNN's blocked format (as torch's compiler does for frozen CPU models):
    `self(x)` is `x @ weight.T`."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)  # laid out for one row

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


SHAPES = {  # name -> (hidden, neurons, experts to cycle through)
    "mixtral": (4096, 14336, 6),
    "mixtral_quarter": (4096, 3584, 16),
    "gpt_oss": (2880, 2880, 24),
    "qwen3": (2048, 768, 96),
}
THREADS = max(1, len(os.sched_getaffinity(0)) - 1)  # one core left to the thread that drives the GPU


def median_ms(fn, calls: int = 12) -> float:
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[2:])


class Experts:
    """`count` random experts of one shape: gate and up [I, H] and down [I, H] (down stored transposed, so every
    neuron range of every tensor is a contiguous block of rows)."""

    def __init__(self, hidden: int, neurons: int, count: int, dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(0)
        make = lambda: (torch.randn(count, neurons, hidden, generator=g) * 0.02).to(dtype)  # noqa: E731
        self.gate, self.up, self.down_t = make(), make(), make()
        self.count, self.nbytes = count, 3 * neurons * hidden * dtype.itemsize

    def full(self, i: int, x: torch.Tensor) -> torch.Tensor:
        e = i % self.count
        h = F.silu(F.linear(x, self.gate[e])) * F.linear(x, self.up[e])  # [n, I]
        return h @ self.down_t[e]  # [n, H]

    def prepack(self) -> None:
        """Lay every weight out once (down from its [I, H] storage to the [H, I] a linear takes)."""
        self.packed = [
            (PrepackedLinear(self.gate[e]), PrepackedLinear(self.up[e]), PrepackedLinear(self.down_t[e].t()))
            for e in range(self.count)
        ]

    def prepacked(self, i: int, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.packed[i % self.count]
        return down(F.silu(gate(x)) * up(x))

    def compiled(self, i: int, x: torch.Tensor) -> torch.Tensor:
        e = i % self.count
        return _compiled_swiglu(self.gate[e], self.up[e], self.down_t[e], x)

    def mv(self, i: int, x: torch.Tensor) -> torch.Tensor:
        e = i % self.count
        h = F.silu(torch.mv(self.gate[e], x[0])) * torch.mv(self.up[e], x[0])  # [I]
        return (h @ self.down_t[e])[None]  # [1, H]


def _swiglu_sums(gate: torch.Tensor, up: torch.Tensor, down_t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU as products summed in fp32: gate, up [I, H], down_t [I, H], x [n, H] -> [n, H]."""
    xf = x.float()[:, None, :]  # [n, 1, H]
    g = (gate[None] * xf).sum(-1)  # [n, I]
    u = (up[None] * xf).sum(-1)
    h = F.silu(g) * u  # [n, I] fp32
    return (down_t[None] * h[:, :, None]).sum(1).to(x.dtype)  # [n, H]


_compiled_swiglu = torch.compile(_swiglu_sums, dynamic=False)


def neuron_threads(experts: Experts, pool: ThreadPoolExecutor, ranges: list[tuple[int, int]]):
    def one(e: int, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
        h = F.silu(F.linear(x, experts.gate[e, a:b])) * F.linear(x, experts.up[e, a:b])
        return (h @ experts.down_t[e, a:b]).float()

    def run(i: int, x: torch.Tensor) -> torch.Tensor:
        e = i % experts.count
        parts = [pool.submit(one, e, x, a, b) for a, b in ranges]
        return torch.stack([p.result() for p in parts]).sum(0).to(x.dtype)

    return run


def gaps(out: dict) -> None:
    """Host parts as decode runs them: two quarters of a Mixtral expert per job, on a worker thread set up as
    `host_compute`'s (pinned away from the first `reserved` cores, its torch threads there), jobs `gap` ms apart
    while the submitting thread spins (as the thread that drives the GPU does), unpinned or pinned to the cores
    the worker leaves. Each job's compute is timed inside it. Keys: `gaps.<setup>.gap<n>ms`, ms per quarter."""
    from mira_hf.host_compute import _init_worker, worker_cpus

    hidden, neurons, count = SHAPES["mixtral_quarter"]
    experts = Experts(hidden, neurons, count, torch.bfloat16)
    x = torch.randn(1, hidden).bfloat16()
    everything = os.sched_getaffinity(0)

    def job(i: int) -> float:
        t0 = time.perf_counter()
        experts.full(2 * i, x)
        experts.full(2 * i + 1, x)
        return time.perf_counter() - t0

    for reserved in (1, 2, 4, 8):
        for pin_main in (False, True):
            os.sched_setaffinity(0, everything)  # the cores `worker_cpus` leaves are counted from all of them
            cpus = worker_cpus(reserved)
            if cpus is None:
                continue
            left = everything - cpus
            os.sched_setaffinity(0, left if pin_main else everything)
            worker = ThreadPoolExecutor(1, initializer=_init_worker, initargs=(cpus, len(cpus)))
            setup = f"reserved{reserved}" + ("_main_pinned" if pin_main else "")
            for gap_ms in (0, 1, 3):
                times = []
                for i in range(40):
                    times.append(worker.submit(job, i).result())
                    stop = time.perf_counter() + gap_ms / 1e3
                    while time.perf_counter() < stop:
                        pass
                ms = 1e3 * statistics.median(times[4:]) / 2  # per quarter
                out.setdefault("gaps", {}).setdefault(setup, {})[f"gap{gap_ms}ms"] = ms
                print(f"{setup:22s} jobs {gap_ms} ms apart: {ms:.3f} ms per quarter", flush=True)
            worker.shutdown()
    os.sched_setaffinity(0, everything)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default=None, help="comma-separated paths to time (default: all)")
    ap.add_argument("--name", default=None, help="suffix of the result file's name")
    ap.add_argument("--gaps", action="store_true", help="only host parts as decode runs them (`gaps`)")
    args = ap.parse_args()
    out = {"threads": THREADS, "torch": torch.__version__, "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA")}
    out["lscpu"] = subprocess.run(
        [
            "bash",
            "-c",
            "lscpu | egrep 'Model name|Socket|NUMA node\\(s\\)'; lscpu | egrep -o 'amx[a-z_0-9]*|avx512_bf16' | sort -u",
        ],
        capture_output=True,
        text=True,
    ).stdout
    out["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    if args.gaps:
        gaps(out)
        return write(out, args.name or "gaps")
    torch.set_num_threads(THREADS)
    big = torch.ones(512 * 2**20)  # 2 GiB fp32
    out["memory_read_gbps"] = big.nbytes / median_ms(lambda i, t=big: t.sum(), 6) / 1e6
    del big

    pool = ThreadPoolExecutor(THREADS, initializer=torch.set_num_threads, initargs=(1,))
    paths = {}
    for name, (hidden, neurons, count) in SHAPES.items():
        bf16 = Experts(hidden, neurons, count, torch.bfloat16)
        f32 = Experts(hidden, neurons, count, torch.float32)
        step = -(-neurons // THREADS)
        ranges = [(a, min(a + step, neurons)) for a in range(0, neurons, step)]
        paths[name] = {
            "onednn": (bf16, bf16.full, torch.bfloat16, True),
            "native": (bf16, bf16.full, torch.bfloat16, False),
            "native_mv": (bf16, bf16.mv, torch.bfloat16, False),
            "fp32": (f32, f32.full, torch.float32, True),
            "neuron_threads": (bf16, neuron_threads(bf16, pool, ranges), torch.bfloat16, True),
        }
        try:
            t0 = time.perf_counter()
            x = torch.randn(1, hidden).bfloat16()
            ref = bf16.full(0, x).float()
            got = bf16.compiled(0, x).float()
            out.setdefault(name, {})["compile_s"] = time.perf_counter() - t0
            out[name]["compiled_rel_diff"] = float((got - ref).abs().max() / ref.abs().max())
            paths[name]["compiled"] = (bf16, bf16.compiled, torch.bfloat16, True)
        except Exception as exc:  # no C++ compiler, or the compiler refuses the shape
            out.setdefault(name, {})["compiled_error"] = repr(exc)[:400]
            print(f"{name}: compiled path unavailable: {exc!r}"[:300], flush=True)
        if can_prepack():
            t0 = time.perf_counter()
            bf16.prepack()
            out.setdefault(name, {})["pack_ms"] = 1e3 * (time.perf_counter() - t0) / count
            paths[name]["prepacked"] = (bf16, bf16.prepacked, torch.bfloat16, True)
            x = torch.randn(1, hidden).bfloat16()
            ref = bf16.full(0, x).float()
            out[name]["prepacked_rel_diff"] = float((bf16.prepacked(0, x).float() - ref).abs().max() / ref.abs().max())
        if args.paths:
            paths[name] = {p: v for p, v in paths[name].items() if p in args.paths.split(",")}
        for path, (experts, fn, dtype, mkldnn) in paths[name].items():
            for rows in (1,) if path == "native_mv" else (1, 8):
                x = torch.randn(rows, hidden).to(dtype)
                torch.set_num_threads(THREADS)
                with torch.backends.mkldnn.flags(enabled=mkldnn):
                    ms = median_ms(lambda i, f=fn, x=x: f(i, x))
                out.setdefault(name, {}).setdefault(path, {})[f"rows{rows}"] = {
                    "ms": ms,
                    "gbps": experts.nbytes / ms / 1e6,
                }
                print(f"{name:16s} {path:15s} rows {rows}: {ms:8.3f} ms  {experts.nbytes / ms / 1e6:6.1f} GB/s", flush=True)

    if torch.cuda.is_available():
        during_link(out, paths)
    write(out, args.name)


def write(out: dict, name: str | None) -> None:
    path = os.path.join(os.environ.get("OUT", "/tmp"), "host_kernel_probe" + (f"_{name}" if name else "") + ".json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)


def during_link(out: dict, paths: dict) -> None:
    """The fastest path of each large shape and `onednn`, at one row, while a stream copies pinned memory to the GPU."""
    src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()

    def link_gbps(seconds: float) -> float:
        stop, n = time.perf_counter() + seconds, 0
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            while time.perf_counter() < stop:
                dst.copy_(src, non_blocking=True)
                stream.synchronize()
                n += 1
        return n * src.nbytes / (time.perf_counter() - t0) / 1e9

    out["link_gbps_alone"] = link_gbps(1.0)
    for name in ("mixtral", "mixtral_quarter", "gpt_oss"):
        timed = [p for p in paths[name] if p in out[name]]
        best = min(timed, key=lambda p: out[name][p]["rows1"]["ms"])
        for path in sorted({best, "onednn"}):
            experts, fn, dtype, mkldnn = paths[name][path]
            x = torch.randn(1, experts.gate.shape[-1]).to(dtype)
            result = {}
            copier = threading.Thread(target=lambda r=result: r.setdefault("gbps", link_gbps(2.0)))
            copier.start()
            time.sleep(0.1)
            torch.set_num_threads(THREADS)
            with torch.backends.mkldnn.flags(enabled=mkldnn):
                ms = median_ms(lambda i, f=fn, x=x: f(i, x), 16)
            copier.join()
            out.setdefault("during_link", {}).setdefault(name, {})[path] = {"ms": ms, "gbps": experts.nbytes / ms / 1e6}
            out["link_gbps_with_host"] = result["gbps"]
            print(f"during link: {name:16s} {path:15s} {ms:8.3f} ms  (link {result['gbps']:.1f} GB/s)", flush=True)


if __name__ == "__main__":
    main()
