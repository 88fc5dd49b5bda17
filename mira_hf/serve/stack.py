"""transformers' serving stack (`transformers.cli.serving`) as the app uses it, whichever design is installed.

The app takes four things from it: the chat and completion handlers, wired to the model mira-hf loaded; a way to start
and stop continuous batching for that model; the error that means the batching worker has stopped; and the conversion
of OpenAI messages to the chat template's (`ServingStack.processor_inputs`). The stack has had two designs, each
served by one module here (its `Stack`, a `ServingStack`):

- in-process (transformers 5.17 to 5.24, `stack_in_process`): handlers get a model from a `ModelManager` and generate in
  this process through `GenerationState`'s managers; a stopped worker is `CBWorkerDeadError`.
- engines (5.25 on, `stack_engines`): handlers reach each model through an engine (`ModelManager.get_engine`) that runs
  it in a process of its own; a stopped engine is `EngineDeadError`.

`resolve()` recognises the design by the names `transformers.cli.serving.utils` has, not by version numbers, and no
other module of mira_hf.serve knows which one it is.
"""

from __future__ import annotations

import asyncio
import importlib
from dataclasses import dataclass

from ..errors import MissingDependencyError

SERVING_UTILS = "transformers.cli.serving.utils"
CANCEL_POLL_S = 0.02  # how often a cancelled request is looked for among the scheduled ones, until it has left them


class ServingStack:
    """transformers' chat and completion handlers serving one loaded model, through one design of its serving stack.

    Built once per app: `Stack(model, tokenizer, name, generation_config, cb_config, chat_template_kwargs)`, where
    `name` is the model id clients send, `generation_config` the one every request decodes with (greedy; a request
    sets only its `max_new_tokens`), `cb_config` the `ContinuousBatchingConfig` and `chat_template_kwargs` the chat
    template's arguments for every request.
    """

    model_manager: type  # the class of the handlers' `model_manager` (mira_hf.serve.LoadedModelManager)
    worker_dead_error: type[Exception]  # what a request raises once the batching worker has stopped
    chat_handler: object  # transformers' ChatCompletionHandler: `await handle_request(body, request_id)`
    completion_handler: object  # transformers' CompletionHandler, likewise

    def start(self):
        """Start continuous batching: returns transformers' `ContinuousBatchingManager`, running (its KV cache may
        not exist yet). Blocks while the manager is built."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop continuous batching. The model stays the caller's, in place."""
        raise NotImplementedError

    def cancel(self, request_id: str) -> None:
        """Stop decoding the request the app handed a handler as `request_id`, whose client left before its answer
        (the handler's task was cancelled, or its stream stopped), and let go of it (`forget_when_cancelled`); on the
        event loop. Nothing by default: a design whose handlers do both themselves."""

    def prepare_request(self, body: dict) -> None:
        """Fill in, in place, what this design's handlers need said to answer a checked request `body` as the server
        promises (docs/serving.md). Nothing by default."""

    @staticmethod
    def processor_inputs(messages: list[dict]) -> list[dict]:
        """OpenAI chat `messages` as the chat handler gives them to a text-only model's chat template."""
        from transformers.cli.serving.utils import BaseHandler, Modality

        return BaseHandler.get_processor_inputs_from_messages(messages, Modality.LLM)


def forget_when_cancelled(cb, request_id: str) -> None:
    """Drop the result handler of `request_id`, just cancelled on `cb` (transformers' `ContinuousBatchingManager`), once
    the batching worker has let go of the request; on the event loop. A cancelled request delivers no last output,
    which is what drops a handler otherwise, so each would stay in the manager's output router for good. Until the
    worker has taken the cancellation the handler stays, so the output of a step already under way reaches it (and
    is ignored) rather than the manager's shared output queue, which nothing here reads."""
    loop = asyncio.get_running_loop()

    def forget() -> None:
        scheduler = getattr(getattr(cb, "batch_processor", None), "scheduler", None)
        if cb.is_running() and scheduler is not None and not scheduler.request_is_cancelled(request_id):
            loop.call_later(CANCEL_POLL_S, forget)  # still scheduled: the worker takes the cancellation at its next step
            return
        with cb.output_router._lock:  # as register_result_handler adds it; transformers has no call that removes one
            cb.output_router.result_handlers.pop(request_id, None)

    forget()


@dataclass(frozen=True)
class Design:
    """A design of transformers' serving stack: the names of `transformers.cli.serving.utils` that tell it, and the
    module of mira_hf.serve whose `Stack` serves a loaded model through it."""

    name: str
    releases: str  # the transformers releases that have it, for messages
    names: tuple[str, ...]
    module: str


# Newest first: the first design whose names the installed transformers has is used.
DESIGNS = (
    Design("engines", "5.25 on", ("EngineDeadError", "Detokenizer", "GenerationState"), "stack_engines"),
    Design("in-process", "5.17 to 5.24", ("CBWorkerDeadError", "CBGenerateManager", "GenerationState"), "stack_in_process"),
)


def resolve() -> type[ServingStack]:
    """The `ServingStack` class for the installed transformers; `MissingDependencyError` if its serving stack is none
    of `DESIGNS`."""
    utils = importlib.import_module(SERVING_UTILS)
    for design in DESIGNS:
        if all(hasattr(utils, name) for name in design.names):
            return importlib.import_module(f"{__package__}.{design.module}").Stack
    import transformers

    known = "; ".join(f"{d.name} (transformers {d.releases}: {', '.join(d.names)})" for d in DESIGNS)
    raise MissingDependencyError(
        f"mira_hf.serve does not know the serving stack of transformers {transformers.__version__}: {SERVING_UTILS} "
        f"has the names of none of the designs it supports, {known}. Install a transformers release it supports, "
        'e.g. pip install "transformers>=5.17,<=5.25".'
    )
