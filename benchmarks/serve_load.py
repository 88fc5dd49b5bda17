"""Load test of `mira serve` on localhost: N requests from C concurrent clients, none lost, latency and tokens/s.

Starts `mira serve MODEL` on 127.0.0.1 (a free port), waits for /health, then sends --requests requests from
--clients threads (half streamed chat, half plain completions, prompts in turn from a fixed list), and a
one-client baseline of --baseline-requests requests for comparison. Every wait is bounded (--timeout-s per
request, --time-limit-s for the whole run; two warm-up requests go first, not counted); a request not answered 200 in full counts as lost. Prints a table,
writes benchmarks/results/<date>-<device>-serve-load.json, exits 1 if any request was lost.

    python benchmarks/serve_load.py                          # bundled mira-tiny, 200 requests, 32 clients
    python benchmarks/serve_load.py PATH --budget 12GiB --kv-cache-memory 8GiB --max-tokens 128
    python benchmarks/serve_load.py --url http://127.0.0.1:8000   # a server already running
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_slug, environment, print_table, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [
    "def fib(n):",
    "import numpy as np\n",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
    "# read a file line by line\n",
    "def quicksort(xs):",
    "with open(path) as f:",
    "try:\n    import torch\nexcept ImportError:",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="mira-tiny", help="model for `mira serve` (default: the bundled mira-tiny)")
    ap.add_argument("--url", help="load an already running server instead of starting one")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--baseline-requests", type=int, default=8, help="requests sent one at a time first (0: none)")
    ap.add_argument("--max-tokens", type=int, default=32, help="completion tokens per request")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    ap.add_argument("--time-limit-s", type=float, default=1800.0, help="whole run; requests not sent by then are lost")
    ap.add_argument("--device", default=None, help="cpu or cuda (passed to mira serve; default: cuda if available)")
    ap.add_argument("--budget", default=None, help="mira serve --budget")
    ap.add_argument("--kv-cache-memory", default=None, help="mira serve --kv-cache-memory")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    if args.requests < 1 or args.clients < 1 or args.max_tokens < 1:
        ap.error("--requests, --clients and --max-tokens must be ≥ 1")

    deadline = time.monotonic() + args.time_limit_s
    server = None
    url = args.url
    try:
        if url is None:
            server, url, startup_s = start_server(args, deadline)
        else:
            startup_s = None
        name = get_json(url + "/v1/models", args.timeout_s)["data"][0]["id"]
        warmup = run_load(url, name, 2, 1, args, deadline)  # first calls pay one-time costs; not counted
        baseline = run_load(url, name, args.baseline_requests, 1, args, deadline) if args.baseline_requests else None
        load = run_load(url, name, args.requests, args.clients, args, deadline)
        metrics = scrape(url, args.timeout_s)
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()

    rows = [dict(run="one client", **summary(baseline))] if baseline else []
    rows.append(dict(run=f"{args.clients} clients", **summary(load)))
    print_table(
        rows, ["run", "requests", "ok", "lost", "p50_s", "p95_s", "ttft_p50_s", "ttft_p95_s", "tokens", "wall_s", "tokens_per_s"]
    )
    env = environment()
    on_gpu = args.device != "cpu" and env["device"] != "cpu"
    record = dict(
        benchmark="serve-load",
        environment=env,
        settings=dict(
            model=args.model if args.url is None else name,
            requests=args.requests,
            clients=args.clients,
            baseline_requests=args.baseline_requests,
            max_tokens=args.max_tokens,
            mix="half streamed chat, half completions",
            device=args.device or ("cuda" if on_gpu else "cpu"),
            budget=args.budget,
            kv_cache_memory=args.kv_cache_memory,
            server_startup_s=startup_s,
            warmup_s=[r.get("seconds") for r in warmup],
        ),
        results=rows,
        server_metrics=metrics,
        per_request=dict(load=load, baseline=baseline),
    )
    path = os.path.join(args.out, f"{env['date']}-{device_slug(env, on_gpu)}-serve-load.json")
    write_json(path, record)
    print(f"\nwritten to {path}")
    lost = sum(r["lost"] for r in rows)
    if lost:
        print(f"{lost} request(s) lost", file=sys.stderr)
    return 1 if lost else 0


def start_server(args, deadline: float):
    with socket.socket() as s:  # a free port on loopback (released just before the server binds it)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "mira_hf.cli", "serve", args.model, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--max-tokens", str(args.max_tokens)]
    for flag, value in (("--device", args.device), ("--budget", args.budget), ("--kv-cache-memory", args.kv_cache_memory)):
        if value is not None:
            cmd += [flag, value]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    start = time.monotonic()
    server = subprocess.Popen(cmd, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"mira serve exited with status {server.returncode} before it was ready")
        try:
            if get_json(url + "/health", 5)["status"] == "ok":
                return server, url, time.monotonic() - start
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    server.terminate()
    raise TimeoutError("mira serve was not ready before --time-limit-s")


def run_load(url: str, name: str, n: int, clients: int, args, deadline: float) -> list[dict]:
    """One record per request: kind, ok, status, seconds, ttft_s (streamed), completion tokens, error."""
    lock = threading.Lock()
    started = []

    def one(i: int) -> dict:
        if time.monotonic() > deadline:
            return dict(i=i, kind=None, ok=False, status=None, error="not sent: --time-limit-s reached")
        with lock:
            started.append(i)
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            body = dict(model=name, messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens, stream=True)
            return dict(i=i, kind="chat-stream", **streamed(url + "/v1/chat/completions", body, args.timeout_s))
        body = dict(model=name, prompt=prompt, max_tokens=args.max_tokens)
        return dict(i=i, kind="completion", **plain(url + "/v1/completions", body, args.timeout_s))

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        records = list(pool.map(one, range(n)))
    wall = time.perf_counter() - start
    for r in records:
        r["wall_s"] = wall  # the run's wall time, kept on each record so `summary` needs nothing else
    return records


def plain(url: str, body: dict, timeout_s: float) -> dict:
    start = time.perf_counter()
    try:
        answer = post(url, body, timeout_s)
        return dict(ok=True, status=200, seconds=time.perf_counter() - start, tokens=answer["usage"]["completion_tokens"])
    except urllib.error.HTTPError as exc:
        return dict(ok=False, status=exc.code, seconds=time.perf_counter() - start, error=exc.read().decode()[:300])
    except (OSError, ValueError, KeyError) as exc:
        return dict(ok=False, status=None, seconds=time.perf_counter() - start, error=repr(exc)[:300])


def streamed(url: str, body: dict, timeout_s: float) -> dict:
    start = time.perf_counter()
    ttft, tokens, error = None, None, None
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            for line in response:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    error = str(event["error"])[:300]
                    break
                if ttft is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - start
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except urllib.error.HTTPError as exc:
        return dict(ok=False, status=exc.code, seconds=time.perf_counter() - start, error=exc.read().decode()[:300])
    except (OSError, ValueError, KeyError) as exc:
        error = repr(exc)[:300]
    ok = error is None and tokens is not None  # a stream that ends without its usage chunk is incomplete
    out = dict(ok=ok, status=200 if ok else None, seconds=time.perf_counter() - start, ttft_s=ttft, tokens=tokens)
    if not ok:
        out["error"] = error or "the stream ended before its final chunk"
    return out


def summary(records: list[dict]) -> dict:
    ok = [r for r in records if r["ok"]]
    seconds = sorted(r["seconds"] for r in ok)
    ttft = sorted(r["ttft_s"] for r in ok if r.get("ttft_s") is not None)
    tokens = sum(r["tokens"] for r in ok)
    wall = records[0]["wall_s"] if records else None
    return dict(
        requests=len(records),
        ok=len(ok),
        lost=len(records) - len(ok),
        p50_s=percentile(seconds, 0.50),
        p95_s=percentile(seconds, 0.95),
        max_s=seconds[-1] if seconds else None,
        ttft_p50_s=percentile(ttft, 0.50),
        ttft_p95_s=percentile(ttft, 0.95),
        tokens=tokens,
        wall_s=wall,
        tokens_per_s=tokens / wall if wall else None,
        requests_per_s=len(ok) / wall if wall else None,
    )


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return None
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def post(url: str, body: dict, timeout_s: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def get_json(url: str, timeout_s: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def scrape(url: str, timeout_s: float) -> dict:
    """The server's /metrics samples after the run (name{labels} -> value)."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as response:
        text = response.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and not line.startswith("#")
    }


if __name__ == "__main__":
    sys.exit(main())
