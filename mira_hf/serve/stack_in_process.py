"""The in-process design of transformers' serving stack (transformers 5.17 to 5.24; see `stack`).

transformers' handlers get a model from a `ModelManager` and generate through `GenerationState`, whose
`CBGenerateManager` owns the continuous batching manager. A small `ModelManager` subclass hands them the model mira-hf
already loaded instead of loading one by name.
"""

from __future__ import annotations

from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelManager
from transformers.cli.serving.utils import CBWorkerDeadError, GenerationState

from .stack import ServingStack, forget_when_cancelled


class LoadedModelManager(ModelManager):
    """transformers' model manager holding one model that is already loaded (by `MiraMoEModel.from_pretrained`
    or `wrap`): every request resolves to it; it never loads, lists or unloads another. The model stays the
    caller's: `shutdown()` leaves it in place."""

    def __init__(self, model, tokenizer, name: str) -> None:
        super().__init__(device=str(model.device), dtype="auto", model_timeout=-1)
        self.force_model = name  # handlers refuse any other name and use this one when none is given
        self._model, self._tokenizer = model, tokenizer

    def process_model_name(self, model_id: str) -> str:
        return model_id

    def load_model_and_processor(self, model_id_and_revision: str, *args, **kwargs):
        return self._model, self._tokenizer

    def shutdown(self) -> None:
        pass


class Stack(ServingStack):
    model_manager = LoadedModelManager
    worker_dead_error = CBWorkerDeadError

    def __init__(self, model, tokenizer, name: str, generation_config, cb_config, chat_template_kwargs: dict) -> None:
        self._model, self._name, self._generation_config = model, name, generation_config
        self._cb = None  # the ContinuousBatchingManager, once started
        self._state = GenerationState(continuous_batching=True, cb_config=cb_config)
        models = LoadedModelManager(model, tokenizer, name)
        self.chat_handler = ChatCompletionHandler(
            model_manager=models, generation_state=self._state, chat_template_kwargs=chat_template_kwargs
        )
        self.completion_handler = CompletionHandler(model_manager=models, generation_state=self._state)

    def start(self):
        manager = self._state.get_manager(self._name, use_cb=True)
        manager.init_cb(self._model, self._generation_config)
        self._cb = manager._cb  # the ContinuousBatchingManager init_cb started (transformers keeps it on this attribute)
        return self._cb

    def cancel(self, request_id: str) -> None:
        # These handlers leave a request whose client left decoding (a stream's they cancel), and its result handler
        # registered: its batching request has the handler's id.
        if self._cb is not None:
            self._cb.cancel_request(request_id)
            forget_when_cancelled(self._cb, request_id)

    def stop(self) -> None:
        self._state.shutdown()
