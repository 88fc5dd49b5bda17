"""The OpenAI-compatible app over one loaded model, on transformers' serving stack.

transformers' `ChatCompletionHandler` and `CompletionHandler` do the work (chat template, continuous batching,
OpenAI response and SSE chunk schemas); `stack` wires them to the model mira-hf already loaded, whichever design of
transformers' serving stack is installed. transformers' own app factory is not used: it also routes endpoints that
load, list or unload other models, and its errors are not OpenAI-shaped. This app routes /v1/chat/completions, /v1/completions, /v1/models,
/health and /metrics, checks each request first (`checks`) and answers every error as `{"error": {...}}`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import threading
import time
import uuid
from contextlib import asynccontextmanager

from .options import PLAIN_CHAT_TEMPLATE, ServeConfig, require_serve, served_name

require_serve("mira_hf.serve")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.exceptions import HTTPException, RequestValidationError  # noqa: E402
from fastapi.responses import JSONResponse, Response, StreamingResponse  # noqa: E402
from starlette.exceptions import HTTPException as StarletteHTTPException  # noqa: E402

from ..batching import enable as enable_batch_aware  # noqa: E402
from ..errors import ConfigError, require_decoder_only  # noqa: E402
from . import checks, generation, memory, planning  # noqa: E402
from .metrics import build_registry  # noqa: E402
from .stack import ServingStack, resolve  # noqa: E402

logger = logging.getLogger("mira_hf.serve")
READY_TIMEOUT_S = 300.0  # the batching thread builds its KV cache on start; a failure there surfaces sooner

Stack: type[ServingStack] = resolve()  # for the design of transformers' serving stack that is installed
# transformers' model manager holding the one loaded model, as the handlers of that design take it
LoadedModelManager = Stack.model_manager


class _Runtime:
    """What the app holds between start-up and shutdown."""

    def __init__(self) -> None:
        self.cb = None  # transformers' ContinuousBatchingManager, once started
        self.limits: checks.Limits | None = None
        self.split: dict | None = None
        self.plan = None  # mira_hf.planner.MemoryPlan with ServeConfig.device_memory


def build_app(model, tokenizer, config: ServeConfig | None = None, on_ready=None) -> FastAPI:
    """A FastAPI app serving `model` (a transformers causal LM, usually wrapped by mira-hf) with `tokenizer`.

    Continuous batching starts with the app (its lifespan) and stops with it; the model's attention
    implementation is kept, and every request is decoded greedily, so a request's tokens are those of
    `model.generate(ids, do_sample=False, max_new_tokens=...)`, less the generation-config fields continuous batching
    does not apply (`generation.UNAPPLIED_FIELDS`: cleared, with a warning naming them). Exactly so in float32; in half
    precision requests decoded together may differ by the batched attention's rounding (docs/serving.md).
    `on_ready(split)` is called once the KV cache exists, with `memory.memory_split(...)`. Run it with uvicorn,
    `serve(...)` or `BackgroundServer`.

    With `config.device_memory` the split between expert cache and KV cache is planned here (`planning`) and
    the expert cache resized to its part before the app is returned. From then on a wrapped model's cache ranks
    experts by batch-aware use estimates (`mira_hf.batching`; the same as before at one token per step).
    """
    require_decoder_only(model, "the server (continuous batching)")
    config = config or ServeConfig()
    if config.model_name is None:
        config = dataclasses.replace(config, model_name=served_name(model))
    name = config.model_name
    runtime = _Runtime()
    manager = getattr(model, "mira", None)
    kv_memory, max_batch_tokens = config.kv_cache_memory, config.max_batch_tokens
    if config.device_memory is not None:
        if manager is None:
            raise ConfigError(
                "ServeConfig.device_memory plans the split between a mira-hf expert cache and the KV cache, and this "
                "model is not wrapped by mira-hf. Load it with MiraMoEModel.from_pretrained, or set kv_cache_memory."
            )
        runtime.plan = planning.plan(model, config)
        kv_memory = planning.apply(model, runtime.plan)
        max_batch_tokens = planning.batch_tokens(model, config)
    if manager is not None:
        enable_batch_aware(manager)
        if manager.arena.placement == "packed" and manager.quantization == "lossless":
            logger.warning(
                "this model keeps its lossless expert records packed and decodes them at every use: a batch uses "
                "nearly every expert of a layer at each step, so serving is faster with each record decoded once per "
                "copy. Load it with mira_hf.serve.serving_mira_config(MiraConfig(...)) (what `mira serve` does)."
            )
    app = FastAPI(title=f"mira-hf: {name}", lifespan=_lifespan)
    app.state.mira_runtime = runtime
    app.state.mira_service = _Service(model, tokenizer, config, runtime, kv_memory, max_batch_tokens, on_ready)
    # The routes reach the model through `request.app.state` only: fastapi caches facts about endpoint functions
    # in module-level caches, so an endpoint that closed over the model would keep it (and its device memory)
    # alive after the app is gone.

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException):
        status = 400 if exc.status_code == 422 else exc.status_code  # OpenAI answers a bad field with 400
        return _error(status, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError):
        return _error(400, f"invalid request: {exc.errors()}")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        service = request.app.state.mira_service
        return await service.answer("chat", request, service.check_chat, service.chat_handler, "chatcmpl")

    @app.post("/v1/completions")
    async def completions(request: Request):
        service = request.app.state.mira_service
        return await service.answer("completions", request, service.check_completion, service.completion_handler, "cmpl")

    @app.get("/v1/models")
    async def list_models(request: Request):
        return request.app.state.mira_service.models()

    @app.get("/health")
    async def health(request: Request):
        return request.app.state.mira_service.health()

    @app.get("/metrics")
    async def metrics(request: Request):
        return request.app.state.mira_service.metrics()

    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    service = app.state.mira_service
    service.checking = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mira-serve-checks")
    await asyncio.to_thread(_start_batching, service.model, service.config, service.stack, service.runtime)
    if service.on_ready is not None:
        service.on_ready(service.runtime.split)
    try:
        yield
    finally:
        service.checking.shutdown(wait=False)
        await asyncio.to_thread(service.stack.stop)


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(checks.RequestError(status, message, param, code).body(), status_code=status)


class _Service:
    """What the app's routes answer with: the model, its tokenizer, transformers' handlers over one batching
    state, the request checks and the metrics."""

    def __init__(self, model, tokenizer, config: ServeConfig, runtime: _Runtime, kv_memory, max_batch_tokens, on_ready):
        self.model, self.tokenizer, self.config, self.runtime, self.on_ready = model, tokenizer, config, runtime, on_ready
        self.name = config.model_name
        self.created = int(time.time())
        # A request's checks tokenise its prompt: on a thread of their own (one per start of the app), so a long
        # prompt does not hold up the event loop, which serves every other client's stream
        self.checking: concurrent.futures.ThreadPoolExecutor | None = None
        self.template_kwargs = (
            {} if getattr(tokenizer, "chat_template", None) else {"chat_template": config.chat_template or PLAIN_CHAT_TEMPLATE}
        )
        cb_config = memory.batching_config(model, kv_memory, max_batch_tokens)
        generation_config, cleared = generation.greedy_generation_config(model, config.default_max_tokens)
        if cleared:
            logger.warning(generation.unapplied_warning(cleared))
        self.stack = Stack(model, tokenizer, self.name, generation_config, cb_config, self.template_kwargs)
        self.chat_handler, self.completion_handler = self.stack.chat_handler, self.stack.completion_handler
        self.registry, self.mira_collector, self.serve_collector = build_registry(
            model, self.name, lambda: runtime.cb, lambda: runtime.plan
        )

    def check_chat(self, body: dict) -> None:
        limits = self.runtime.limits
        checks.check_common(body, limits)
        messages = checks.check_messages(body)
        extra = checks.check_template_kwargs(body)
        try:  # as the handler will tokenise it (same conversion, template and arguments)
            ids = self.tokenizer.apply_chat_template(
                self.stack.processor_inputs(messages),
                add_generation_prompt=True,
                tools=body.get("tools"),
                tokenize=True,
                return_dict=True,
                **{**self.template_kwargs, **extra},
            )["input_ids"]
        except Exception as exc:  # a conversion or template error is the request's: its messages do not fit the template
            raise checks.RequestError(400, f"the chat template cannot render these messages: {exc}", param="messages") from None
        checks.settle_max_tokens(body, len(ids), limits, ("max_completion_tokens", "max_tokens"), "messages")

    def check_completion(self, body: dict) -> None:
        limits = self.runtime.limits
        checks.check_common(body, limits)
        prompt = checks.check_prompt(body)
        checks.settle_max_tokens(body, len(self.tokenizer(prompt)["input_ids"]), limits, ("max_tokens",), "prompt")

    async def answer(self, endpoint: str, request: Request, check, handler, id_prefix: str) -> Response:
        start = time.perf_counter()
        serve_collector, mira_collector = self.serve_collector, self.mira_collector
        serve_collector.started()
        outcome = {"status": 500, "streaming": False}

        def finish(tokens: int | None, cut: int | None = None) -> None:  # cut: the status of a stream cut short
            seconds = time.perf_counter() - start
            if outcome["streaming"]:
                serve_collector.finished(endpoint, cut or outcome["status"], seconds)
            if cut == CLIENT_CLOSED:  # the stream stopped with its client: so does its decoding
                self.stack.cancel(request_id)
            if tokens and mira_collector is not None:
                mira_collector.record_tokens(tokens, seconds)

        try:
            body = checks.parse_body(await request.body())
            await asyncio.get_running_loop().run_in_executor(self.checking, check, body)
            options = body.get("stream_options")
            hide_usage = bool(body.get("stream")) and isinstance(options, dict) and not options.get("include_usage")
            self.stack.prepare_request(body)
            request_id = f"{id_prefix}-{uuid.uuid4().hex}"
            response = await _unless_disconnected(request, handler.handle_request(body, request_id))
            if response is None:  # the client left before its answer: its decoding stops
                self.stack.cancel(request_id)
                outcome["status"] = CLIENT_CLOSED
                return _error(CLIENT_CLOSED, "the client closed the connection before the answer was ready")
            outcome["status"] = response.status_code
            if isinstance(response, StreamingResponse):
                outcome["streaming"] = True
                # Starlette's own streaming response: it stops the stream when the client disconnects, whatever
                # response class the handler chose
                return StreamingResponse(
                    _observed_stream(response.body_iterator, finish, hide_usage),
                    status_code=response.status_code,
                    headers=dict(response.headers),
                )
            else:
                finish(_completion_tokens(_json(response.body)))
            return response
        except checks.RequestError as exc:
            outcome["status"] = exc.status
            return JSONResponse(exc.body(), status_code=exc.status)
        except HTTPException as exc:
            outcome["status"] = 400 if exc.status_code == 422 else exc.status_code
            return _error(outcome["status"], str(exc.detail))
        except self.stack.worker_dead_error as exc:
            outcome["status"] = 503
            return _error(503, f"the batching worker stopped: {exc}. Restart the server.", code="service_unavailable")
        except Exception as exc:
            logger.exception("request to %s failed", endpoint)
            return _error(500, f"the server failed on this request: {type(exc).__name__}: {exc}")
        finally:
            if not outcome["streaming"]:
                serve_collector.finished(endpoint, outcome["status"], time.perf_counter() - start)

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created, "owned_by": "mira-hf"}]}

    def health(self):
        if self.runtime.cb is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        if self.runtime.cb.background_thread_status.fatal_error is not None:
            return JSONResponse({"status": "unhealthy", "reason": "the batching worker stopped"}, status_code=503)
        return {"status": "ok", "model": self.name}

    def metrics(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


def _start_batching(model, config: ServeConfig, stack: ServingStack, runtime: _Runtime) -> None:
    """Start transformers' continuous batching and wait until its KV cache exists, so the request limits and the
    memory split are known before the first request."""
    cb = stack.start()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while getattr(cb, "batch_processor", None) is None:
        fatal = cb.background_thread_status.fatal_error
        if fatal is not None or not cb.is_running():
            raise RuntimeError(f"continuous batching failed to start: {fatal or 'its thread stopped'}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"continuous batching built no KV cache within {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.01)
    kv = memory.kv_usage(cb)
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    kv_tokens = kv["blocks_total"] * kv["tokens_per_block"]
    runtime.limits = checks.Limits(
        model_name=config.model_name,
        max_total_tokens=min(kv_tokens, context) if context else kv_tokens,
        default_max_tokens=config.default_max_tokens,
        greedy=True,
    )
    runtime.split = memory.memory_split(model, cb)
    if runtime.plan is not None:
        runtime.split["plan"] = {k: v for k, v in runtime.plan.as_dict().items() if k != "candidates"}
    runtime.cb = cb


CLIENT_CLOSED = 499  # the status nginx and others log for a request whose client left first
DISCONNECT_POLL_S = 0.1


async def _unless_disconnected(request: Request, answer):
    """The result of awaiting `answer`, or None once the client has disconnected: `answer` is then cancelled (the
    caller stops its decoding: `ServingStack.cancel`). Starlette does not cancel an endpoint whose client leaves; a
    stream stops when its response can no longer be sent, an answer given whole would decode to its end for nobody."""
    task = asyncio.ensure_future(answer)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
    except asyncio.CancelledError:
        task.cancel()
        raise


async def _observed_stream(chunks, finish, hide_usage: bool = False):
    """Pass the SSE chunks through; at the end, report the completion tokens of the final `usage` chunk, which is
    left out where the request asked for none (`hide_usage`: the server asks for it to count the tokens), and end
    the stream with `data: [DONE]`, as OpenAI's streams end. `finish(tokens, cut)`: `cut` is None for a stream sent
    to its end, `CLIENT_CLOSED` for one whose client left first (Starlette stops it), 500 for one that failed."""
    tokens, done, cut = None, False, None
    try:
        async for chunk in chunks:
            text = chunk if isinstance(chunk, str) else chunk.decode()
            if '"usage"' in text:
                before, _, last = text.rpartition("data: ")
                event = _json(last)
                tokens = _completion_tokens(event) or tokens
                if hide_usage and _usage_only(event):
                    continue
                if hide_usage and isinstance(event, dict) and event.get("usage"):
                    # older transformers put the usage in the last choice chunk: sent without it
                    chunk = f"{before}data: {json.dumps({**event, 'usage': None})}\n\n"
            done = done or any(line.strip() == "data: [DONE]" for line in text.splitlines())
            yield chunk
        if not done:
            yield "data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):  # the client left: Starlette cancels or drops the stream
        cut = CLIENT_CLOSED
        raise
    except Exception:
        cut = 500
        raise
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:  # on a client disconnect: transformers' generator then cancels the request's decoding
            await close()
        finish(tokens, cut)


def _json(body: bytes | str) -> object:
    """A body's JSON, or None where it is none."""
    try:
        return json.loads(body)
    except ValueError:
        return None


def _usage_only(event: object) -> bool:
    """Whether an SSE event is a usage chunk with no choices (what `stream_options.include_usage` adds)."""
    return isinstance(event, dict) and not event.get("choices") and "usage" in event


def _completion_tokens(event: object) -> int | None:
    try:
        return event["usage"]["completion_tokens"]
    except (KeyError, TypeError):
        return None


def serve(
    model, tokenizer, config: ServeConfig | None = None, host: str = "127.0.0.1", port: int = 8000, on_ready=None, sock=None
) -> None:
    """Serve until interrupted (Ctrl-C). `host="0.0.0.0"` listens on every interface; `sock`: a socket already bound
    (to host and port), listened on instead."""
    import uvicorn

    app = build_app(model, tokenizer, config, on_ready=on_ready)
    if sock is None:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    else:
        uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).run(sockets=[sock])


class BackgroundServer:
    """The app on a uvicorn server in a background thread (tests, notebooks, load tests):

        with BackgroundServer(build_app(model, tokenizer)) as server:
            requests.post(server.url + "/v1/completions", json={...})

    `port=0` takes a free port; `server.port` tells which. `stop()` (or leaving the block) shuts it down.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = READY_TIMEOUT_S) -> None:
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, name="mira-serve", daemon=True)
        self._start_timeout_s = start_timeout_s
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server stopped while starting (see the log above)")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the server did not start within {self._start_timeout_s:.0f} s")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
