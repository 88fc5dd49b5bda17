"""`mira serve`: an OpenAI-compatible HTTP server (pip install "mira-hf[serve]")."""

from __future__ import annotations

import argparse
import socket

from ..bundled import BUNDLED_NAME
from ..config import parse_bytes
from ..errors import ConfigError
from .options import (
    MODEL_HELP,
    add_model_options,
    doc,
    load,
    mira_config,
    model_source,
    parse_budget,
    port_number,
    torch_dtype,
)


def register(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching", description=doc(cmd_serve))
    v.add_argument("model", nargs="?", default=BUNDLED_NAME, metavar="MODEL", help=MODEL_HELP)
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    v.add_argument("--port", type=port_number, default=8000, help="port (default 8000)")
    v.add_argument("--served-model-name", metavar="NAME", help="the model id clients send (default: MODEL as given)")
    v.add_argument("--max-tokens", type=int, default=256, metavar="N", help="completion tokens when a request gives none (256)")
    v.add_argument(
        "--kv-cache-memory",
        metavar="B",
        help="bytes of the paged KV cache, e.g. 4GiB (default: a share of the device memory left after the weights and "
        "the expert cache; 64MiB on a CPU)",
    )
    v.add_argument("--memory-report", action="store_true", help="print how device memory is split, then exit")
    v.add_argument(
        "--device-memory",
        metavar="B",
        help="device bytes to use in all, e.g. 24GiB: the split between expert cache and KV cache is planned (--budget "
        "or --kv-cache-memory fix a part)",
    )
    v.add_argument("--concurrency", type=int, metavar="N", help="with --device-memory: sequences at once at most (32)")
    v.add_argument("--prompt-tokens", type=int, metavar="N", help="with --device-memory: tokens per prompt (512)")
    v.add_argument(
        "--routing-trace",
        metavar="FILE",
        help="with --device-memory: routing of MODEL for the plan's hit rates (a trace file, or a mira calibrate DIR)",
    )
    add_model_options(v, budget_default="0.25", host=False)  # host compute is not measured under serving's batches
    v.set_defaults(run=cmd_serve, budget=None)  # None: 0.25, or planned with --device-memory


PROVISIONAL_SERVE_BUDGET = "0.05"  # share of the experts loaded before --device-memory's plan resizes the cache


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve MODEL over HTTP with an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics), many requests at once through transformers' continuous batching. Prints how the device
    memory is split between weights, expert cache and KV cache. Needs pip install "mira-hf[serve]"."""
    from ..serve.options import ServeConfig, require_serve, serving_mira_config

    mix = {"concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens}  # the plan's request mix
    for name, value in (("max_tokens", args.max_tokens), *mix.items()):  # named as typed, before ServeConfig would
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be ≥ 1.")
    planned = {**mix, "routing_trace": args.routing_trace}  # what only a --device-memory plan reads
    unplanned = ["--" + k.replace("_", "-") for k, v in planned.items() if v is not None]
    if unplanned and args.device_memory is None:
        raise ConfigError(
            f"{' and '.join(unplanned)} {'shapes' if len(unplanned) == 1 else 'shape'} the device-memory plan, "
            "which --device-memory asks for; without it they change nothing. Give --device-memory (e.g. 24GiB), or "
            "leave them out."
        )
    fixed_experts = args.budget is not None and args.device_memory is not None
    if args.budget is None:  # with a plan, load with a small cache: the plan resizes it before serving
        args.budget = PROVISIONAL_SERVE_BUDGET if args.device_memory else "0.25"
    serve_config = ServeConfig(  # validated before anything loads
        model_name=args.served_model_name or args.model,
        default_max_tokens=args.max_tokens,
        kv_cache_memory=parse_budget(args.kv_cache_memory),
        device_memory=parse_budget(args.device_memory),
        expert_cache_memory=parse_budget(args.budget) if fixed_experts else None,
        **{k: v for k, v in mix.items() if v is not None},
        routing_trace=args.routing_trace,
    )
    require_serve()
    cfg = serving_mira_config(mira_config(args))
    source = model_source(args.model)
    refuse_before_loading(args, source, torch_dtype(args.dtype, cfg.device))
    sock = None if args.memory_report else listening_socket(args.host, args.port)  # before the load, which takes a while
    model, tokenizer = load(source, cfg, args.dtype)

    import logging

    from ..serve.app import BackgroundServer, build_app, serve
    from ..serve.memory import format_split

    logging.getLogger("transformers.cli.serving").setLevel(logging.ERROR)  # one warning per request otherwise
    if args.memory_report:
        with BackgroundServer(build_app(model, tokenizer, serve_config, on_ready=lambda split: print(format_split(split)))):
            pass
        return 0

    def ready(split: dict) -> None:
        print(format_split(split))
        host = f"[{args.host}]" if ":" in args.host else args.host
        port = sock.getsockname()[1]  # the one given, or the one the system chose for --port 0
        print(f"serving {serve_config.model_name!r} on http://{host}:{port} (Ctrl-C stops)", flush=True)

    serve(model, tokenizer, serve_config, host=args.host, port=args.port, on_ready=ready, sock=sock)
    return 0


def refuse_before_loading(args: argparse.Namespace, source: str, dtype) -> None:
    """Refuse, naming the flag, what the server would refuse only once the model has loaded (minutes for a large
    checkpoint) though it needs none of its weights: a --routing-trace whose files are not there, and a
    --kv-cache-memory below one KV block (its bytes per token come from the checkpoint's config.json and `dtype`, the
    dtype the model loads in)."""
    from ..serve import memory, planning

    if args.routing_trace is not None:
        missing = planning.missing_trace_files(args.routing_trace)
        if missing:
            raise ConfigError(
                f"--routing-trace {args.routing_trace}: {' and '.join(missing)} not found. Give a routing trace saved by "
                "RoutingTrace.save (FILE for FILE.safetensors and FILE.json), or the directory that mira calibrate "
                "MODEL --data FILE --out DIR --traces-only wrote."
            )
    if args.kv_cache_memory is not None:
        per_token = _kv_bytes_per_token(source, dtype)
        if per_token is not None:
            nbytes = parse_bytes(parse_budget(args.kv_cache_memory), "kv_cache_memory")
            memory.kv_blocks(nbytes, per_token, memory.default_page_tokens(), f"--kv-cache-memory {args.kv_cache_memory}")


def _kv_bytes_per_token(source: str, dtype) -> int | None:
    """What one cached token of the model `source` loaded in `dtype` ("auto": the checkpoint's own) costs, from its
    config.json; None where that cannot be told before the load (a config not readable offline or of a type
    transformers does not know: the load then says what is wrong; the server checks once the model has loaded)."""
    from transformers import AutoConfig

    from ..serve import memory

    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError):
        return None
    if dtype == "auto":
        dtype = config.get_text_config().dtype  # what from_pretrained loads "auto" in
    itemsize = getattr(dtype, "itemsize", None)
    return None if itemsize is None else memory.config_kv_bytes_per_token(config, itemsize)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), for the server to listen on; a ConfigError if it cannot be."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a port in TIME_WAIT is free
    try:
        sock.bind((host, port))
        sock.listen(2048)  # held from now: another server cannot bind it meanwhile (uvicorn's own backlog)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc}). Give an address of this "
            "machine as --host (0.0.0.0: all of them), and a port no other server holds as --port."
        ) from None
    return sock
