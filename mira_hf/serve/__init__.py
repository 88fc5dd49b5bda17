"""An OpenAI-compatible HTTP server for a mira-hf model (optional: `pip install "mira-hf[serve]"`).

    from mira_hf import MiraMoEModel, MiraConfig
    from mira_hf.serve import ServeConfig, serve, serving_mira_config

    model = MiraMoEModel.from_pretrained(path, serving_mira_config(MiraConfig(gpu_budget="12GiB")))
    serve(model, tokenizer, ServeConfig(model_name="mixtral"), port=8000)     # or: mira serve PATH

Built on transformers' serving stack and its continuous batching (paged attention): /v1/chat/completions and
/v1/completions (streamed as server-sent events or not), /v1/models, /health and /metrics (Prometheus).
`build_app` gives the FastAPI app, `BackgroundServer` runs it in a thread. See docs/serving.md.
"""

from __future__ import annotations

from .options import SERVE_PACKAGES, ServeConfig, is_serve_available, missing_serve_packages, serving_mira_config

_APP_NAMES = ("BackgroundServer", "LoadedModelManager", "build_app", "serve")

__all__ = [
    "SERVE_PACKAGES",
    "ServeConfig",
    "is_serve_available",
    "missing_serve_packages",
    "serving_mira_config",
    *_APP_NAMES,
]


def __getattr__(name: str):
    # fastapi, uvicorn and transformers' serving stack are imported on first use, with an install hint if missing
    if name in _APP_NAMES:
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
