"""`mira serve`: an OpenAI-compatible HTTP server (pip install "mira-hf[serve]")."""

from __future__ import annotations

import argparse

from ..bundled import BUNDLED_NAME
from .options import MODEL_HELP, add_model_options, doc, load, mira_config, model_source, parse_budget


def register(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching", description=doc(cmd_serve))
    v.add_argument("model", nargs="?", default=BUNDLED_NAME, metavar="MODEL", help=MODEL_HELP)
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    v.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    v.add_argument("--served-model-name", metavar="NAME", help="the model id clients send (default: MODEL as given)")
    v.add_argument("--max-tokens", type=int, default=256, metavar="N", help="completion tokens when a request gives none (256)")
    v.add_argument(
        "--kv-cache-memory",
        metavar="B",
        help="bytes of the paged KV cache, e.g. 4GiB (default: a share of the device memory left after the weights and "
        "the expert cache; 64MiB on a CPU)",
    )
    v.add_argument("--memory-report", action="store_true", help="print how device memory is split, then exit")
    add_model_options(v, budget_default="0.25")
    v.set_defaults(run=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve MODEL over HTTP with an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics), many requests at once through transformers' continuous batching. Prints how the device
    memory is split between weights, expert cache and KV cache. Needs pip install "mira-hf[serve]"."""
    from ..serve.options import ServeConfig, require_serve

    serve_config = ServeConfig(  # validated before anything loads
        model_name=args.served_model_name or args.model,
        default_max_tokens=args.max_tokens,
        kv_cache_memory=parse_budget(args.kv_cache_memory),
    )
    require_serve()
    cfg = mira_config(args)
    model, tokenizer = load(model_source(args.model), cfg, args.dtype)

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
        print(f"serving {serve_config.model_name!r} on http://{args.host}:{args.port} (Ctrl-C stops)", flush=True)

    serve(model, tokenizer, serve_config, host=args.host, port=args.port, on_ready=ready)
    return 0
