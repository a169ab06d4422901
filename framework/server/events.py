"""What the engine loop tells the HTTP side: a request's events, and the sinks that carry them to its handler."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from framework.server.protocol import APIError

log = logging.getLogger(__name__)


@dataclass
class Event:
    """What the loop tells a request's handler: "accepted", "delta" (streaming text), "finish" or "error"."""

    kind: str
    text: str = ""  # delta: the new text; finish: the rest of the text (streaming) or all of it
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: Optional[APIError] = None

    def wire(self) -> tuple:
        """The event as a plain tuple, for the engine process's pipe (a tuple pickles several times faster than a
        dataclass instance, and an event crosses the pipe for every streamed token); :meth:`from_wire` inverts it."""
        return self.kind, self.text, self.finish_reason, self.prompt_tokens, self.completion_tokens, self.error

    @classmethod
    def from_wire(cls, fields: tuple) -> "Event":
        return cls(*fields)


@dataclass
class AbortRecord:
    """A client-side abort: the loop's step count when it was asked for and when the KV was freed."""

    rid: str
    requested_at_step: int
    freed_at_step: int
    num_output_tokens: int


class Sink(Protocol):
    """Where a request's events go: ``deliver`` gets one iteration's (target, event) pairs of the requests that
    share this sink, in order (called on the engine thread)."""

    def deliver(self, items: list[tuple[Any, Event]]) -> None: ...


@dataclass(frozen=True)
class AsyncioSink:
    """Events of requests whose handlers run on ``aloop``: each target is the handler's ``asyncio.Queue``."""

    aloop: asyncio.AbstractEventLoop

    def deliver(self, items: list[tuple[Any, Event]]) -> None:
        try:
            self.aloop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # that event loop is closed: its clients are gone
            log.warning("dropping %d events for a closed event loop", len(items))


def _deliver(items: list[tuple[asyncio.Queue, Event]]) -> None:
    for events, event in items:
        events.put_nowait(event)
