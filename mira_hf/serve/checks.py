"""Request checks before a request reaches transformers' handlers, with OpenAI-style errors.

Continuous batching in transformers decodes every request with one shared generation config and takes only
`max_new_tokens` per request, so a parameter that would be silently ignored is refused here instead; the
prompt is tokenised the way the handler will tokenise it, so a request that cannot fit the model's context
or the KV cache is refused before it is queued.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_ROLES = ("system", "developer", "user", "assistant", "tool")
# parameter -> values that change nothing; anything else would be ignored by continuous batching
_ONLY_DEFAULTS = {
    "n": (None, 1),
    "best_of": (None, 1),
    "stop": (None, [], ""),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "echo": (None, False),
    "suffix": (None, ""),
    "generation_config": (None,),
    "response_format": (None, {"type": "text"}),  # JSON mode and schemas would need constrained decoding
}


# Arguments of `apply_chat_template` that transformers' chat handler passes itself for every request (to tokenise the
# chat for continuous batching): a request's `chat_template_kwargs` cannot set them
SERVER_TEMPLATE_ARGUMENTS = (
    "add_generation_prompt",
    "tokenize",
    "return_dict",
    "return_tensors",
    "tools",
    "load_audio_from_video",
)


def _neutral(value, allowed: tuple) -> bool:
    """Whether `value` is one of `allowed`, of the same type (`logprobs: 0` asks for the chosen tokens' logprobs:
    not `False`)."""
    return any(value == a and type(value) is type(a) for a in allowed)


class RequestError(Exception):
    """A request the server refuses; becomes `{"error": {...}}` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What a request may ask for. Tokens; `max_total_tokens` = prompt + completion (the smaller of the
    model's context and the KV cache)."""

    model_name: str
    max_total_tokens: int
    default_max_tokens: int
    greedy: bool  # the shared decoding setting; sampling settings must match it


def parse_body(raw: bytes) -> dict:
    """The request's JSON object, or a 400."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(400, f"the request body is not valid JSON ({exc}). Send a JSON object.") from None
    except RecursionError:  # nested deeper than the JSON parser recurses
        raise RequestError(400, "the request body nests too deeply to parse. Send a JSON object.") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body is a JSON {type(body).__name__}; send a JSON object.")
    return body


def check_common(body: dict, limits: Limits) -> None:
    """Model name, refused parameters and sampling settings (the parts both endpoints share)."""
    model = body.get("model")
    if model is not None and model != limits.model_name:
        raise RequestError(
            404,
            f"The model {model!r} does not exist on this server; it serves {limits.model_name!r} (see /v1/models).",
            param="model",
            code="model_not_found",
        )
    for name, allowed in _ONLY_DEFAULTS.items():
        if name in body and not _neutral(body[name], allowed):
            raise RequestError(
                400,
                f"{name}={body[name]!r} is not supported: continuous batching decodes every request with one shared "
                "setting and would ignore it. Leave it out.",
                param=name,
                code="unsupported_parameter",
            )
    if limits.greedy:
        for name, neutral in (("temperature", 0), ("top_p", 1)):
            value = body.get(name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value != neutral):
                raise RequestError(
                    400,
                    f"{name}={value!r} is not supported: this server decodes every request greedily (one shared "
                    f"setting under continuous batching). Leave {name} out or set it to {neutral}.",
                    param=name,
                    code="unsupported_parameter",
                )
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RequestError(400, f"seed={seed!r}: must be an integer (or left out).", param="seed")
    if "stream" in body and body["stream"] is None:  # null: left out (not streamed), as the handlers then read it
        del body["stream"]
    if "stream" in body and not isinstance(body["stream"], bool):
        raise RequestError(400, f"stream={body['stream']!r}: must be true or false.", param="stream")
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise RequestError(400, 'stream_options must be a JSON object, e.g. {"include_usage": true}.', param="stream_options")


def check_messages(body: dict) -> list[dict]:
    """`messages` of a chat request: a non-empty list of {role, content} with text content."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        got = "missing" if messages is None else f"{type(messages).__name__} {messages!r}"[:80]
        raise RequestError(400, f"'messages' is {got}: give a non-empty list of {{'role', 'content'}} objects.", param="messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise RequestError(400, f"{where} needs a 'role', one of {', '.join(_ROLES)}.", param=where)
        content = message.get("content")
        if message.get("tool_calls") is not None:
            _check_tool_calls(message["tool_calls"], where)
            if content is None:  # an assistant message that only calls tools
                continue
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list) or not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts
        ):
            raise RequestError(
                400, f"{where}.content must be a string or a list of text parts (this model reads text only).", param=where
            )
    return messages


def check_template_kwargs(body: dict) -> dict:
    """A chat request's `chat_template_kwargs`: arguments for the chat template, none of those the server sets."""
    extra = body.get("chat_template_kwargs")
    if extra is None:  # absent or null: none (left out, as the handlers then read it)
        body.pop("chat_template_kwargs", None)
        return {}
    if not isinstance(extra, dict):
        raise RequestError(400, "chat_template_kwargs must be a JSON object.", param="chat_template_kwargs")
    taken = [name for name in extra if name in SERVER_TEMPLATE_ARGUMENTS]
    if taken:
        raise RequestError(
            400,
            f"chat_template_kwargs sets {', '.join(taken)}, which the server sets itself for every chat (it sets "
            f"{', '.join(SERVER_TEMPLATE_ARGUMENTS)}). Leave {'it' if len(taken) == 1 else 'them'} out"
            + ("; give tools as the request's 'tools'." if "tools" in taken else "."),
            param="chat_template_kwargs",
        )
    return extra


def _check_tool_calls(tool_calls, where: str) -> None:
    """An assistant message's `tool_calls`: a list of {"function": {"name": str, "arguments": JSON text or object}},
    as OpenAI's chat completions send them (the chat template reads each call's arguments as an object)."""
    shape = '{"id": ..., "type": "function", "function": {"name": "<tool>", "arguments": "<JSON object as text>"}}'
    if not isinstance(tool_calls, list):
        raise RequestError(
            400,
            f"{where}.tool_calls is a {type(tool_calls).__name__}: give a list of calls, each {shape}.",
            param=f"{where}.tool_calls",
        )
    for j, call in enumerate(tool_calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        problem = None
        if not isinstance(name, str) or not isinstance(arguments, (str, dict)):
            problem = "has no function with a string 'name' and 'arguments'"
        elif isinstance(arguments, str):
            try:
                json.loads(arguments)
            except ValueError as exc:
                problem = f"has arguments that are not JSON ({exc})"
        if problem is not None:
            raise RequestError(400, f"{at} {problem}: got {json.dumps(call)[:120]}. Give each call as {shape}.", param=at)


def check_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = body["prompt"] = prompt[0]
    if not isinstance(prompt, str):
        got = "missing" if prompt is None else type(prompt).__name__
        raise RequestError(400, f"'prompt' is {got}: give one string.", param="prompt")
    return prompt


def settle_max_tokens(body: dict, prompt_tokens: int, limits: Limits, names: tuple[str, ...], prompt_param: str) -> int:
    """Check the requested completion length against the room left; fill in the default when none is given.
    Returns the completion length the request will be run with."""
    if prompt_tokens < 1:
        raise RequestError(400, "the prompt is empty after tokenisation: give some text.", param=prompt_param)
    given = next((name for name in names if body.get(name) is not None), None)
    room = limits.max_total_tokens - prompt_tokens
    if given is None:
        wanted = min(limits.default_max_tokens, room)
        if wanted < 1:
            raise _too_long(limits, prompt_tokens, 1)
        body[names[-1]] = wanted
        return wanted
    wanted = body[given]
    if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 1:
        raise RequestError(400, f"{given}={wanted!r}: must be an integer ≥ 1.", param=given)
    if wanted > room:
        raise _too_long(limits, prompt_tokens, wanted)
    return wanted


def _too_long(limits: Limits, prompt_tokens: int, completion: int) -> RequestError:
    return RequestError(
        400,
        f"This server's maximum context length is {limits.max_total_tokens} tokens. However, you requested "
        f"{prompt_tokens + completion} tokens ({prompt_tokens} in the prompt, {completion} in the completion). "
        "Please reduce the length of the prompt or of the completion.",
        param="max_tokens",
        code="context_length_exceeded",
    )
