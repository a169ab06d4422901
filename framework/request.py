"""A request's life on the host: prompt, sampling parameters, generated tokens, KV ownership, outcome."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from framework.sampling import SamplingParams


@dataclass(eq=False)  # identity: the scheduler finds a request in its queues by the object itself
class Request:
    rid: Any  # the caller's id (JSONL "id", HTTP request id)
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_new_tokens: int  # max_tokens clamped so that prompt + output fits the context window
    output_ids: list[int] = field(default_factory=list)  # generated tokens the host has
    # tokens sampled by launched forwards that the host does not have yet (the overlapped loop runs one step ahead)
    num_pending: int = 0
    spec_inflight: int = 0  # speculation v2: iterations launched whose accepted tokens the host does not have yet
    row: int = -1  # req_to_token row while the request holds KV
    kv_len: int = 0  # positions whose K/V are in the pool or written by a launched forward
    prefix_len: int = 0  # positions of the current admission whose K/V came from the prefix cache
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at the first admission
    num_admissions: int = 0  # 1 + preemptions so far, once admitted
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_text_len: Optional[int] = None  # text is cut here when a stop string matched
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: Optional[float] = None
    finish_s: Optional[float] = None
    spec_verify_steps: int = 0
    spec_accepted_tokens: int = 0  # tokens emitted by verify steps, bonus included
    drafter_state: Any = None  # the drafter's per-request state (n-gram index, draft KV length, ...)
    detokenizer: Any = None  # IncrementalDetokenizer while the text is needed as it grows (stop strings, streaming)

    @property
    def num_generated(self) -> int:
        """Generated tokens, those still on their way to the host included."""
        return len(self.output_ids) + self.num_pending

    @property
    def prefill_target(self) -> int:
        """Tokens whose K/V must be in the pool before decoding: the prompt, plus, after a preemption, every
        generated token but the last (which is the next decode input)."""
        return len(self.prompt_ids) + max(0, self.num_generated - 1)

    @property
    def prefilled(self) -> bool:
        return self.kv_len >= self.prefill_target

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(0, start - n): end - n]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What a caller gets back: one per submitted request, in submission order."""

    id: Any
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    error: Optional[str] = None
    spec: Optional[dict] = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache

    def to_json(self) -> dict:
        out = {"id": self.id, "text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
               "num_prompt_tokens": self.num_prompt_tokens, "num_cached_tokens": self.num_cached_tokens}
        if self.error is not None:
            out["error"] = self.error
        if self.spec is not None:
            out["spec"] = self.spec
        return out
