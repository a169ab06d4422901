"""A user's request dict (``prompt`` or ``messages`` plus sampling fields) checked and tokenized into a
:class:`Request`; every problem a user can cause is one :class:`RequestError` line."""

from __future__ import annotations

from typing import Any

from framework.config import SamplingConfig
from framework.request import Request
from framework.sampling import RequestError, SamplingParams
from framework.tokenizer import encode_prompt


def parse_request(item: dict[str, Any], rid: Any, tokenizer: Any, vocab_size: int, max_context: int,
                  sampling: SamplingConfig) -> Request:
    """Validate and tokenize one request dict (``prompt`` or ``messages`` plus sampling fields) for a model of
    ``vocab_size`` tokens and a ``max_context``-token window. Raises :class:`RequestError` with a one-line reason."""
    if not isinstance(item, dict):
        raise RequestError(f"a request must be a JSON object, got {type(item).__name__}")
    prompt, messages = item.get("prompt"), item.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
                for m in messages):
            raise RequestError("messages must be a non-empty list of {\"role\": str, \"content\": str}")
        ids = encode_checked(tokenizer, "messages", messages=messages)
    elif prompt is not None:
        if not isinstance(prompt, str):
            raise RequestError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise RequestError("prompt is empty")
        ids = encode_checked(tokenizer, "prompt", prompt=prompt)
    else:
        raise RequestError("request has neither 'prompt' nor 'messages'")
    if not ids:
        raise RequestError("prompt is empty after tokenization")
    if max(ids) >= vocab_size:  # a tokenizer larger than the model's vocabulary
        raise RequestError(f"prompt token id {max(ids)} is outside the model's vocabulary of "
                           f"{vocab_size} (model.tokenizer does not match the model)")
    if len(ids) >= max_context:
        raise RequestError(f"prompt has {len(ids)} tokens; the context window is {max_context} tokens "
                           f"(prompt + at least one generated token must fit)")
    params = SamplingParams.from_request(sampling, item)
    max_new = min(params.max_tokens, max_context - len(ids))
    return Request(rid=item.get("id", rid) if rid is None else rid, prompt_ids=ids, params=params,
                   seed=params.resolved_seed(), max_new_tokens=max_new)

def encode_checked(tokenizer: Any, field: str, **text: Any) -> list[int]:
    """encode_prompt, with any failure (text that is not valid Unicode, a chat template that refuses the
    messages) as a one-line :class:`RequestError` naming ``field``."""
    strings = [text["prompt"]] if "prompt" in text else [v for m in text["messages"] for v in m.values()
                                                          if isinstance(v, str)]
    for value in strings:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise RequestError(f"{field} is not valid Unicode text: {value[err.start]!r} (a lone surrogate) at "
                               f"character {err.start}") from None
    try:
        return encode_prompt(tokenizer, **text)
    except Exception as err:  # noqa: BLE001 - the tokenizer's and template's errors have no common type
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        raise RequestError(f"{field} cannot be tokenized: {reason}") from None
