"""OpenAI response shapes: whole responses, streaming chunks (Server-Sent Events) and usage."""

from __future__ import annotations

import json
import time
from typing import Any, Optional


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, model: str, text: str, finish_reason: str, prompt_tokens: int,
               completion_tokens: int) -> dict[str, Any]:
    """A /v1/completions response."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chat_completion(rid: str, model: str, text: str, finish_reason: str, prompt_tokens: int,
                    completion_tokens: int) -> dict[str, Any]:
    """A /v1/chat/completions response."""
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens)}


class ChunkWriter:
    """Builds the SSE chunks of one streaming response (completion or chat), all with the same id and time."""

    def __init__(self, kind: str, rid: str, model: str) -> None:
        self.kind, self.rid, self.model = kind, rid, model
        self.created = int(time.time())

    def _chunk(self, choices: list[dict[str, Any]], extra: Optional[dict[str, Any]] = None) -> str:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        return sse(dict(body, **(extra or {})))

    def start(self) -> Optional[str]:
        """The chat stream's first chunk announces the role; completions have none."""
        if self.kind != "chat":
            return None
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def text(self, delta: str, finish_reason: Optional[str] = None) -> str:
        if self.kind == "chat":
            choice = {"index": 0, "delta": {"content": delta} if delta else {}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._chunk([choice])

    def usage(self, prompt_tokens: int, completion_tokens: int) -> str:
        """The extra last chunk of ``stream_options: {"include_usage": true}``: no choices, only usage."""
        return self._chunk([], {"usage": usage(prompt_tokens, completion_tokens)})


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
