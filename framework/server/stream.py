"""Streaming text deltas: what of a request's decoded output may be sent to the client so far.

The request's text grows with each step (its :class:`~framework.detokenizer.IncrementalDetokenizer`); what lies
beyond the text already sent is the delta. Two kinds of tail are held back until more tokens arrive: trailing
U+FFFD characters (a multi-byte UTF-8 character whose remaining bytes are in tokens not generated yet) and any tail
that could be the start of a stop string (if the stop string completes, the final text is cut before it, and text
already sent cannot be taken back). Only the tail is examined: the work per step does not grow with the text.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``stops`` (0 if none)."""
    longest = min(len(text), max((len(s) - 1 for s in stops), default=0))
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0


class TextDeltas:
    """Tracks the text sent for one streaming request; :meth:`update` and :meth:`finish` return the new part."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = list(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self._text = ""  # the text of the last call, whose first ``_sent`` characters have been sent
        self._sent = 0

    @property
    def sent(self) -> str:
        """The text sent so far."""
        return self._text[:self._sent]

    def update(self, text: str) -> str:
        """The part of ``text`` (the output's text so far, which extends the text of earlier calls) that is safe
        to send now."""
        end = len(text)
        while end > self._sent and text[end - 1] == REPLACEMENT_CHAR:
            end -= 1
        if self.stops:
            end -= stop_prefix_len(text[max(0, end - self.longest):end], self.stops)
        if end <= self._sent:
            return ""
        delta = text[self._sent:end]
        self._text, self._sent = text, end
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the request's final text (stop strings already cut by the engine)."""
        sent = self.sent
        if not final_text.startswith(sent):  # cannot take text back: send what lies beyond it
            log.warning("streamed text %r is not a prefix of the final text %r", sent[-20:], final_text[-20:])
        delta = final_text[self._sent:]
        self._text, self._sent = final_text, len(final_text)
        return delta
