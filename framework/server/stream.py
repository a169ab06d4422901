"""Streaming text deltas: what of a request's decoded output may be sent to the client so far.

The whole output is decoded after each step and diffed against what was already sent. Two kinds of tail are held
back until more tokens arrive: trailing U+FFFD characters (a multi-byte UTF-8 character whose remaining bytes are
in tokens not generated yet) and any tail that could be the start of a stop string (if the stop string completes,
the final text is cut before it, and text already sent cannot be taken back).
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
        self.sent = ""

    def update(self, text: str) -> str:
        """The part of ``text`` (the decoded output so far) that is safe to send now."""
        safe = text.rstrip(REPLACEMENT_CHAR)
        safe = safe[: len(safe) - stop_prefix_len(safe, self.stops)]
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            # NOTE: nothing new, or decoding changed text already sent (it can when a later token merges with
            # an earlier one); wait: the final text settles it.
            return ""
        delta = safe[len(self.sent):]
        self.sent = safe
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the request's final text (stop strings already cut by the engine)."""
        if not final_text.startswith(self.sent):  # cannot take text back: send what lies beyond it
            log.warning("streamed text %r is not a prefix of the final text %r", self.sent[-20:], final_text[-20:])
        delta = final_text[len(self.sent):]
        self.sent = final_text
        return delta
