"""What `mira serve` needs installed, and its settings (no heavy import here: the CLI validates before loading)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass

from ..config import MiraConfig, parse_bytes
from ..errors import ConfigError, MissingDependencyError

SERVE_EXTRA = "serve"
# transformers' serving stack (its own `is_serve_available`) plus uvicorn to run it and prometheus_client for /metrics
SERVE_PACKAGES = ("fastapi", "uvicorn", "openai", "pydantic", "prometheus_client")
# For a tokenizer without a chat template: the messages' text, one per line, and nothing added for the reply, so a
# chat request to a base model continues the text as a completion would.
PLAIN_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% if not loop.last %}\n{% endif %}{% endfor %}"


def missing_serve_packages() -> list[str]:
    """The packages of the `serve` extra that are not installed."""
    return [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]


def is_serve_available() -> bool:
    """Whether `mira serve` / `mira_hf.serve.build_app` can run: fastapi, uvicorn, openai, pydantic, prometheus_client."""
    return not missing_serve_packages()


def require_serve(feature: str = "mira serve") -> None:
    missing = missing_serve_packages()
    if missing:
        raise MissingDependencyError(
            f"{feature} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed: "
            f'pip install "mira-hf[{SERVE_EXTRA}]".'
        )


def serving_mira_config(config: MiraConfig) -> MiraConfig:
    """`config` for a model loaded to serve batches: where the record placement is left to "auto", compressed
    records are decoded once per copy into a slot of the checkpoint's dtype, and where the budget holds every
    expert only if some stay packed, those few are kept packed on the device (`QuantConfig(placement="mixed")`).
    A batch uses nearly every expert of a layer at each step, so records kept packed in every slot would be decoded
    at every use of every step, and a budget short of every expert decoded copies the missing ones at every step
    (benchmarks/NOTES.md, "Transfer formats"). Every placement is exact."""
    if config.quant.placement != "auto":
        return config
    return config.replace(quant=dataclasses.replace(config.quant, placement="mixed"))


@dataclass(frozen=True)
class ServeConfig:
    """Settings of the OpenAI-compatible server.

    model_name: the id clients send as "model" and /v1/models lists; None: what the model was loaded from
        (`model.name_or_path`: the path or hub id given to from_pretrained; "mira-tiny" for the bundled model).
    default_max_tokens: completion tokens when a request gives no max_tokens (capped by the room left).
    kv_cache_memory: bytes (int or "2GiB") of the paged KV cache; None: transformers sizes it from the device
        memory left after the weights and the expert cache (on a CPU, 64 MiB).
    max_batch_tokens: tokens per forward step of the batch (None: transformers' default; on a CPU, 1024; with
        device_memory, 2048).
    chat_template: Jinja template for a tokenizer that has none (None: the messages' text, one per line).
    device_memory: bytes of device memory the server may use in all (weights, activations, expert cache, KV
        cache), e.g. "24GiB". The split between expert cache and KV cache is then planned (`mira_hf.planner`):
        the expert cache is resized when the app is built, and the KV cache gets the rest. None: no plan.
    expert_cache_memory: with device_memory, fixes the expert cache (bytes, or a float share of all expert
        bytes); the KV cache gets the rest. kv_cache_memory likewise fixes the KV part.
    concurrency, prompt_tokens: the request mix the plan is made for: sequences decoding at once at most, and
        tokens per prompt (completions: default_max_tokens).
    routing_trace: routing of this model, replayed for the plan's hit rates: a `RoutingTrace` file, or the
        directory `mira calibrate` wrote; None: hit rates estimated for evenly spread routing.
    """

    model_name: str | None = None
    default_max_tokens: int = 256
    kv_cache_memory: int | str | None = None
    max_batch_tokens: int | None = None
    chat_template: str | None = None
    device_memory: int | str | None = None
    expert_cache_memory: int | float | str | None = None
    concurrency: int = 32
    prompt_tokens: int = 512
    routing_trace: str | None = None

    def __post_init__(self) -> None:
        if self.model_name is not None and (not isinstance(self.model_name, str) or not self.model_name):
            raise ConfigError(
                f"ServeConfig.model_name={self.model_name!r}: give the non-empty name clients will send, or None for "
                "what the model was loaded from."
            )
        for name in ("default_max_tokens", "max_batch_tokens", "concurrency", "prompt_tokens"):
            value = getattr(self, name)
            if value is None and name == "max_batch_tokens":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ServeConfig.{name}={value!r}: must be an integer ≥ 1.")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        if self.device_memory is not None:
            parse_bytes(self.device_memory, "device_memory")
        elif self.expert_cache_memory is not None or self.routing_trace is not None:
            raise ConfigError(
                "ServeConfig.expert_cache_memory and routing_trace shape the device-memory plan: give device_memory "
                "(the bytes the server may use in all) too, or set the expert cache with MiraConfig(gpu_budget=...)."
            )
        e = self.expert_cache_memory
        if isinstance(e, float) and not isinstance(e, bool) and not 0 < e <= 1:
            raise ConfigError(f"ServeConfig.expert_cache_memory={e}: a float is a share of all expert bytes, in (0, 1].")
        if e is not None and not isinstance(e, float):
            parse_bytes(e, "expert_cache_memory")


def served_name(model) -> str:
    """The id `model` is served under when ServeConfig names none: what from_pretrained was given (its
    `name_or_path`; the bundled model's own name for its directory), else its class name."""
    from ..bundled import BUNDLED_NAME, bundled_model_path

    name = str(getattr(model, "name_or_path", "") or "")
    if name and os.path.realpath(name) == os.path.realpath(bundled_model_path()):
        return BUNDLED_NAME
    return name or type(model).__name__
