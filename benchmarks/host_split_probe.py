"""What a neuron split of a Mixtral-size expert costs on the host, measured before building `host_compute="split"`:
torch CPU time of a share of one expert's neurons at one token (bf16 and fp32; 4, 8 and 15 threads), the same while
the link copies at full speed (and the link's speed meanwhile), and a host job's round trip (one row to the host,
through a worker thread, back to the GPU). Random bf16 weights in page-locked memory, laid out as transformers' fused
`gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`; each timed call reads another expert, so weights come from memory.

    python benchmarks/host_split_probe.py          # a GPU machine; writes $OUT/probe.json (else /tmp/probe.json)
    python benchmarks/host_split_probe.py --rows   # host time against rows only (no GPU needed): $OUT/rows.json

Keys: host.bf16_last_<share> (seconds for the expert's last neurons, sliced in place), host.<dtype>_contig_<share>
[_threads<n>] (the same neurons copied contiguous, as the split stores them; 15 threads unless named),
link_gbps_alone, link_gbps_with_host, host_part_ms_during_link (a quarter share, while the link copies),
roundtrip_ms_median and roundtrip_ms_p90. Committed as results/2026-12-03-nvidia-h200-host-split-probe.json.
With --rows: rows.<dtype>_<share>_rows<n>, seconds of a contiguous share on n rows (bf16 weights, and the same
weights widened to fp32 with fp32 rows), for the row counts of batched decoding and beam search.
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

HIDDEN, NEURONS, EXPERTS = 4096, 14336, 8  # Mixtral-8x7B's expert
THREADS = 15  # one core of 16 left to the thread that drives the GPU


def median_s(fn, calls: int = 6) -> float:
    """Median seconds of `fn(i)` over `calls` calls after the first (a warm-up)."""
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def part(x, gate, up, down):
    """One expert's neurons on rows x: silu(x gate^T) * (x up^T), times down's columns."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", action="store_true", help="host time against rows only")
    args = parser.parse_args()
    out = {}
    out["lscpu"] = subprocess.run(
        ["bash", "-c", "lscpu | egrep 'Model name' ; lscpu | egrep -o 'avx512[a-z_0-9]*|amx[a-z_0-9]*' | sort -u; nproc"],
        capture_output=True,
        text=True,
    ).stdout
    if args.rows:
        return rows_only(out)
    torch.manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * NEURONS, HIDDEN, dtype=torch.bfloat16).pin_memory()
    down = torch.randn(EXPERTS, HIDDEN, NEURONS, dtype=torch.bfloat16).pin_memory()
    torch.set_num_threads(THREADS)
    try:
        os.sched_setaffinity(0, set(range(1, os.cpu_count())))
    except OSError as exc:
        out["affinity"] = str(exc)
    x = torch.randn(1, HIDDEN, dtype=torch.bfloat16)
    xf = x.float()

    def last(e: int, n: int):  # the last n neurons of expert e, sliced in place
        return gate_up[e, NEURONS - n : NEURONS], gate_up[e, 2 * NEURONS - n :], down[e, :, NEURONS - n :]

    host = out["host"] = {}
    for share in (0.125, 0.25, 0.33, 0.5, 1.0):
        n = int(NEURONS * share)
        host[f"bf16_last_{share}"] = median_s(lambda i, n=n: part(x, *last(i % EXPERTS, n)))
    for share in (0.25, 0.33):
        n = int(NEURONS * share)
        parts = [tuple(t.contiguous() for t in last(e, n)) for e in range(EXPERTS)]
        host[f"bf16_contig_{share}"] = median_s(lambda i, p=parts: part(x, *p[i % EXPERTS]))
        wide = [tuple(t.float() for t in p) for p in parts[:4]]
        host[f"fp32_contig_{share}"] = median_s(lambda i, w=wide: part(xf, *w[i % 4]))
        for threads in (4, 8, THREADS):
            torch.set_num_threads(threads)
            host[f"bf16_contig_{share}_threads{threads}"] = median_s(lambda i, p=parts: part(x, *p[i % EXPERTS]))
        torch.set_num_threads(THREADS)

    device = torch.device("cuda")
    src = gate_up[0].view(-1).view(torch.uint8)
    dst = torch.empty_like(src, device=device)

    def copy_s(copies: int = 10) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(copies):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / copies

    copy_s(2)
    out["link_gbps_alone"] = src.numel() / copy_s() / 1e9
    stop, count = threading.Event(), [0]

    def host_loop() -> None:  # a quarter share of each expert in turn, until stopped
        while not stop.is_set():
            part(x, *last(count[0] % EXPERTS, int(NEURONS * 0.25)))
            count[0] += 1

    worker = threading.Thread(target=host_loop)
    worker.start()
    time.sleep(0.2)
    c0, t0 = count[0], time.perf_counter()
    out["link_gbps_with_host"] = src.numel() / copy_s(20) / 1e9
    out["host_part_ms_during_link"] = (time.perf_counter() - t0) / max(count[0] - c0, 1) * 1e3
    stop.set()
    worker.join()

    pool = ThreadPoolExecutor(1)
    row = torch.randn(1, HIDDEN, dtype=torch.bfloat16, device=device)
    staged = torch.empty(1, HIDDEN, dtype=torch.bfloat16).pin_memory()

    def round_trip(_: int) -> None:
        staged.copy_(row, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        back = pool.submit(lambda: (ready.synchronize(), staged.clone())[1]).result()
        back.pin_memory().to(device, non_blocking=True)
        torch.cuda.synchronize()

    times = []
    for i in range(50):
        t0 = time.perf_counter()
        round_trip(i)
        times.append(time.perf_counter() - t0)
    out["roundtrip_ms_median"] = statistics.median(times) * 1e3
    out["roundtrip_ms_p90"] = sorted(times)[45] * 1e3
    path = os.path.join(os.environ.get("OUT", "/tmp"), "probe.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "lscpu"}, indent=1))


def rows_only(out: dict) -> None:
    """Host seconds of a share of Mixtral-size experts against the rows of a block, bf16 and fp32."""
    torch.manual_seed(0)
    torch.set_num_threads(THREADS)
    try:
        os.sched_setaffinity(0, set(range(1, os.cpu_count())))
    except OSError as exc:
        out["affinity"] = str(exc)
    rows = out["rows"] = {}
    for share in (0.2, 0.25):
        n = int(NEURONS * share)
        parts = [
            (
                torch.randn(n, HIDDEN, dtype=torch.bfloat16),
                torch.randn(n, HIDDEN, dtype=torch.bfloat16),
                torch.randn(HIDDEN, n, dtype=torch.bfloat16),
            )
            for _ in range(EXPERTS)
        ]
        for dtype in (torch.bfloat16, torch.float32):
            weights = parts if dtype == torch.bfloat16 else [tuple(t.float() for t in p) for p in parts]
            for r in (1, 2, 4, 8, 16):
                x = torch.randn(r, HIDDEN, dtype=dtype)
                key = f"{str(dtype).removeprefix('torch.')}_{share}_rows{r}"
                rows[key] = median_s(lambda i, w=weights, x=x: part(x, *w[i % EXPERTS]))
    path = os.path.join(os.environ.get("OUT", "/tmp"), "rows.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
