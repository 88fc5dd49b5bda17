"""The engines design of transformers' serving stack (transformers 5.25 on; see `stack`).

transformers' handlers reach a model through an engine (`ModelManager.get_engine`), whose `EngineClient` runs the model
in a process of its own and loads it there. A model mira-hf has already loaded cannot move to another process (its
experts live in this process's host store and device cache), so `LoadedEngine` stands in for the engine: the same
attributes and generate methods, generating in this process through a continuous batching manager it starts itself,
as transformers' in-process managers did before 5.25.
"""

from __future__ import annotations

import asyncio
import copy
import itertools

from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.utils import (
    Detokenizer,
    EngineDeadError,
    GenerationState,
    Modality,
    ModelNotServedError,
    _StreamError,
)

from .stack import ServingStack, forget_when_cancelled


class LoadedEngine:
    """The loaded model as transformers' handlers use an engine (`EngineClient`): its id, config, generation config
    and tokenizer, and `generate_non_streaming` / `generate_streaming`. Requests run on the continuous batching
    manager `start` creates, all with `generation_config`; a request sets only its `max_new_tokens` and
    `eos_token_id`, as with transformers' continuous batching before 5.25."""

    use_cb = True  # prompts are tokenised as lists, for continuous batching
    modality = Modality.LLM

    def __init__(self, model, tokenizer, name: str, generation_config, own_template: bool = False) -> None:
        self.model_id, self.processor = name, tokenizer
        self.model_config, self.generation_config = model.config, generation_config
        if own_template:
            # The server renders chats with a template of its own (the tokenizer has none): the answer is the
            # generated text. transformers would parse it with a response template it picks by model type for
            # tokenizers without one (ChatML for the Qwen families), whose anchor that rendering never has, and
            # would keep the prompt in the answer; a config of no known type gives it none.
            self.model_config = copy.copy(model.config)
            self.model_config.model_type = ""
        self._model = model
        self._request_numbers = itertools.count()
        self.cb = None  # the ContinuousBatchingManager, once started

    def start(self, cb_config):
        """Create and start the continuous batching manager (public API: `init_continuous_batching`)."""
        cb = self._model.init_continuous_batching(generation_config=self.generation_config, continuous_batching_config=cb_config)
        cb.start()
        self.cb = cb
        return cb

    def stop(self) -> None:
        if self.cb is not None:
            self.cb.stop(block=True, timeout=2)  # as transformers' own in-process manager stopped it

    async def generate_non_streaming(self, inputs: dict, generation_kwargs: dict) -> tuple[str, int, list[int]]:
        """Generate for `inputs`: the text, the prompt's length and the generated tokens."""
        ended = asyncio.get_running_loop().create_future()

        def on_output(output) -> None:  # on the event loop, once: the request has ended
            if not ended.done():
                ended.set_result(output)

        request_id = self._submit(inputs, generation_kwargs, False, on_output)
        try:
            output = await ended
        except asyncio.CancelledError:  # the client left: its decoding stops
            self._cancel(request_id)
            raise
        self._raise_if_failed(output)
        generated = list(output.generated_tokens)
        return self._text(generated), len(inputs["input_ids"]), generated

    def _text(self, tokens: list[int]) -> str:
        """The text a stream of `tokens` sends (the streamed answer's `Detokenizer`), joined: an answer given whole is the
        text of the same answer streamed. A character the last token leaves unfinished is not in either (decoding all
        tokens at once would end with U+FFFD for it)."""
        queue: asyncio.Queue = asyncio.Queue()
        detokenizer = Detokenizer(self._rust_tokenizer(), queue)
        for token in tokens:
            detokenizer.put_token(token)
        detokenizer.end()
        return "".join(iter(queue.get_nowait, None))

    def _rust_tokenizer(self):
        return getattr(self.processor, "tokenizer", self.processor)._tokenizer

    def generate_streaming(
        self, inputs: dict, generation_kwargs: dict, response_parser=None
    ) -> tuple[asyncio.Queue, Detokenizer]:
        """Generate for `inputs`, streaming: the queue of decoded text (ended by None, or a `_StreamError`) and its
        `Detokenizer`, whose `cancel()` stops the decoding (the handler calls it when the stream closes)."""
        queue: asyncio.Queue = asyncio.Queue()
        streamer = Detokenizer(self._rust_tokenizer(), queue, response_parser=response_parser)
        ended = asyncio.get_running_loop().create_future()
        sent = 0  # tokens handed to the streamer; each output holds all the tokens generated so far

        def on_output(output) -> None:  # on the event loop, at every step of the request
            nonlocal sent
            if ended.done():
                return
            try:
                self._raise_if_failed(output)
                for token in output.generated_tokens[sent:]:
                    streamer.put_token(token)
                sent = len(output.generated_tokens)
            except Exception as exc:  # a failed request, or tokens the response parser refuses
                queue.put_nowait(_StreamError(str(exc)))
                ended.set_result(None)
                if not output.is_finished():
                    self._cancel(output.request_id)
                return
            if output.is_finished():
                streamer.end()
                ended.set_result(None)

        request_id = self._submit(inputs, generation_kwargs, True, on_output)

        async def until_the_end() -> None:
            try:
                await ended
            except asyncio.CancelledError:  # the stream closed first (the client left): the decoding stops
                self._cancel(request_id)

        streamer.task = asyncio.create_task(until_the_end())
        return queue, streamer

    def _submit(self, inputs: dict, generation_kwargs: dict, streaming: bool, on_output) -> str:
        self._raise_if_dead()
        request_id = f"mira-{next(self._request_numbers)}"
        self.cb.register_result_handler(request_id, on_output)  # before the request: it may end at once
        added = self.cb.add_request(
            inputs["input_ids"],
            request_id=request_id,
            streaming=streaming,
            max_new_tokens=generation_kwargs["max_new_tokens"],
            eos_token_id=generation_kwargs["eos_token_id"],
        )
        if added is None:  # the manager takes no more requests: it is stopping
            raise EngineDeadError("The continuous batching manager is stopping and takes no new requests.")
        return request_id

    def _cancel(self, request_id: str) -> None:
        """Stop decoding `request_id` and let go of it (on the event loop)."""
        self.cb.cancel_request(request_id)
        forget_when_cancelled(self.cb, request_id)

    def _raise_if_dead(self) -> None:
        fatal_error = self.cb.background_thread_status.fatal_error
        if fatal_error is not None:
            raise EngineDeadError(f"The continuous batching worker is dead: {fatal_error}")

    def _raise_if_failed(self, output) -> None:
        if output.error is not None:
            self._raise_if_dead()
            raise RuntimeError(f"Continuous batching failed for the request: {output.error}")


class LoadedModelManager:
    """What transformers' handlers (5.25 on) ask for a model (`get_engine`): the one loaded model's `LoadedEngine`,
    for a request that names it or no model. The model stays the caller's: `shutdown()` stops its batching only."""

    def __init__(self, model, tokenizer, name: str, generation_config, own_template: bool = False) -> None:
        self.force_model = name
        self.engine = LoadedEngine(model, tokenizer, name, generation_config, own_template)

    def get_engine(self, model: str | None) -> LoadedEngine:
        if model is not None and model != self.force_model:
            raise ModelNotServedError(f"This server serves {self.force_model!r}; requested {model!r}.")
        return self.engine

    def shutdown(self) -> None:
        self.engine.stop()


class Stack(ServingStack):
    model_manager = LoadedModelManager
    worker_dead_error = EngineDeadError

    def __init__(self, model, tokenizer, name: str, generation_config, cb_config, chat_template_kwargs: dict) -> None:
        self._models = LoadedModelManager(model, tokenizer, name, generation_config, bool(chat_template_kwargs))
        self._cb_config = cb_config
        state = GenerationState(continuous_batching=True, cb_config=cb_config)
        self.chat_handler = ChatCompletionHandler(
            model_manager=self._models, generation_state=state, chat_template_kwargs=chat_template_kwargs
        )
        self.completion_handler = CompletionHandler(model_manager=self._models, generation_state=state)

    def start(self):
        return self._models.engine.start(self._cb_config)

    def stop(self) -> None:
        self._models.shutdown()

    def prepare_request(self, body: dict) -> None:
        # These handlers end a stream with its usage only when asked (OpenAI's stream_options.include_usage); before
        # 5.25 every stream ended with it. Every stream asks here, as /metrics counts its tokens from it; a stream
        # whose request does not say gets it, and the app leaves it out of one whose request declined it.
        if body.get("stream"):
            options = body.get("stream_options")
            body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
