"""OpenAI request bodies: parsing and validation into the engine's request dict, and OpenAI-style errors.

Everything here runs on the HTTP side and needs no engine: sampling fields are checked with the same
:class:`~framework.sampling.SamplingParams` validation that ``Engine.make_request`` applies (so the messages are
the same), and the checks that need the tokenized prompt (context window) run in :func:`prepare_request`, on the
server's tokenizer thread.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from framework.config import SamplingConfig
from framework.request import Request
from framework.sampling import RequestError, SamplingParams


class APIError(Exception):
    """An error for the client: HTTP ``status`` and an OpenAI-style body naming the bad ``param``."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 type: str = "invalid_request_error", code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# sampling fields a request may set; top_k, ignore_eos and stop_token_ids are extensions to the OpenAI API
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "stop_token_ids")

# OpenAI fields this server does not implement: accepted only with a value that asks for nothing
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False), "suffix": (None, ""), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "best_of": (None, 1), "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
}


@dataclass
class ParsedRequest:
    """A validated request: ``item`` goes to ``Engine.make_request``; the rest shapes the response."""

    kind: str  # "completion" | "chat"
    item: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool
    max_tokens: Optional[int]  # as the client gave it (None: the config's default, clamped to the context)
    max_tokens_field: str = "max_tokens"  # the name the client used for it (chat: or "max_completion_tokens")

    @property
    def prompt_field(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"


def parse_json(raw: bytes, content_type: str = "") -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says what is wrong with it (and names a Content-Type
    that is not JSON, the usual cause: a form post)."""
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as err:
        where = f"{err.msg} at line {err.lineno} column {err.colno}"
        hint = f"; the Content-Type was {content_type!r}, send application/json" \
            if content_type and "json" not in content_type.lower() else ""
        raise APIError(f"the request body is not valid JSON ({where}){hint}") from None
    except UnicodeDecodeError:
        raise APIError("the request body is not valid UTF-8 JSON") from None
    except RecursionError:
        raise APIError("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {_json_type(body)}")
    return body


def param_of(message: str, prompt_field: str) -> Optional[str]:
    """The request field a :class:`RequestError` message is about (its messages start with the field's name)."""
    match = re.match(r"(\w+)=", message)
    if match and match.group(1) in SAMPLING_FIELDS:
        return match.group(1)
    if message.startswith(("prompt", "messages")):
        return prompt_field
    return None


def parse_completion(body: dict[str, Any], served_model: str, defaults: SamplingConfig) -> ParsedRequest:
    """Validate a /v1/completions body."""
    if "prompt" not in body or body["prompt"] is None:
        raise APIError("prompt is required: a string", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise APIError("prompt must be one string; lists of prompts and token-id prompts are not supported "
                       "(send one request per prompt)", param="prompt")
    if not isinstance(prompt, str):
        raise APIError(f"prompt must be a string, got {_json_type(prompt)}", param="prompt")
    if not prompt:
        raise APIError("prompt is empty", param="prompt")
    return _parse_common(body, "completion", {"prompt": prompt}, served_model, defaults)


def parse_chat(body: dict[str, Any], served_model: str, defaults: SamplingConfig) -> ParsedRequest:
    """Validate a /v1/chat/completions body; message content may be a string or a list of text parts."""
    messages = body.get("messages")
    if messages is None:
        raise APIError("messages is required: a non-empty list of {\"role\": str, \"content\": str}",
                       param="messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(f"messages must be a non-empty list of {{\"role\": str, \"content\": str}}, got "
                       f"{_json_type(messages)}", param="messages")
    plain = [_plain_message(m, i) for i, m in enumerate(messages)]
    field = "max_tokens"
    if body.get("max_completion_tokens") is not None:  # the newer name of max_tokens
        field, body = "max_completion_tokens", dict(body, max_tokens=body["max_completion_tokens"])
    return _parse_common(body, "chat", {"messages": plain}, served_model, defaults, field)


def _plain_message(message: Any, index: int) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise APIError(f"{where} must be an object with \"role\" and \"content\", got {_json_type(message)}",
                       param="messages")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise APIError(f"{where}.role must be a non-empty string, got {_json_type(role)}", param="messages")
    if isinstance(content, list):  # [{"type": "text", "text": "..."}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise APIError(f"{where}.content: only text parts ({{\"type\": \"text\", \"text\": str}}) are "
                           f"supported", param="messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(f"{where}.content must be a string or a list of text parts, got {_json_type(content)}",
                       param="messages")
    return {"role": role, "content": content}


def _parse_common(body: dict[str, Any], kind: str, item: dict[str, Any], served_model: str,
                  defaults: SamplingConfig, max_tokens_field: str = "max_tokens") -> ParsedRequest:
    model = body.get("model")
    if model is not None and model != served_model:
        shown = model if isinstance(model, str) else _json_type(model)
        raise APIError(f"model={shown!r} is not served here; the model is {served_model!r}", param="model")
    n = body.get("n")
    if n is not None and n != 1:
        if isinstance(n, bool) or not isinstance(n, int):
            raise APIError(f"n={n!r} is not allowed; expected 1", param="n")
        raise APIError(f"n={n} is not supported; this server returns one choice per request (n=1)", param="n")
    for name, allowed in _UNSUPPORTED.items():
        value = body.get(name)
        if value not in allowed:  # NOTE: == comparison, so 0.0 counts as 0 and False as 0
            raise APIError(f"{name}={value!r} is not supported by this server", param=name)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise APIError(f"stream={stream!r} is not allowed; expected true or false", param="stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict)
                                or not isinstance(options.get("include_usage", False), bool)):
        raise APIError(f"stream_options={options!r} is not allowed; expected {{\"include_usage\": bool}}",
                       param="stream_options")
    item.update({k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None})
    try:
        SamplingParams.from_request(defaults, dict(item))
    except RequestError as err:
        message, param = str(err), param_of(str(err), "messages" if kind == "chat" else "prompt")
        if param == "max_tokens":
            message, param = max_tokens_field + message[len("max_tokens"):], max_tokens_field
        raise APIError(message, param=param) from None
    return ParsedRequest(kind=kind, item=item, model=served_model, stream=bool(stream),
                         include_usage=bool(options and options.get("include_usage")),
                         max_tokens=item.get("max_tokens"), max_tokens_field=max_tokens_field)


def _json_type(value: Any) -> str:
    """The JSON name of a value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


def prepare_request(make_request: Callable[..., Request], max_context: int, rid: str,
                    parsed: ParsedRequest) -> Request:
    """Tokenize and validate ``parsed`` with ``make_request`` (``Engine.make_request``'s signature); raises
    :class:`APIError` (400) naming the bad field."""
    try:
        req = make_request(parsed.item, rid=rid)
    except RequestError as err:
        raise APIError(str(err), param=param_of(str(err), parsed.prompt_field)) from None
    except Exception as err:  # noqa: BLE001 - e.g. a chat template that refuses the messages
        logging.getLogger(__name__).exception("could not prepare request %s", rid)
        raise APIError(f"could not prepare the request: {err}", param=parsed.prompt_field) from None
    limit, num_prompt = parsed.max_tokens, len(req.prompt_ids)
    if limit is not None and num_prompt + limit > max_context:
        name = parsed.max_tokens_field
        raise APIError(f"{name}={limit} is too large: the prompt has {num_prompt} tokens and the context "
                       f"window is {max_context} tokens, so {name} can be at most {max_context - num_prompt}",
                       param=name)
    return req
