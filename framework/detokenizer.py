"""Incremental detokenization and stop-string search: host work per generated token that does not grow with the
output's length.

Each request that needs its text while it runs (stop strings, streaming) gets an :class:`IncrementalDetokenizer`:
only the new token is decoded (the ``tokenizers`` library's ``DecodeStream`` for fast tokenizers; a bounded
window of tokens otherwise), a multi-byte character split across tokens is held back until it is complete, and a
stop string is searched for only in the text that a new token could have completed.
"""

from __future__ import annotations

from typing import Any, Optional

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """The text of a growing token sequence: :meth:`add` decodes only what is new.

    ``text`` only ever grows (a tail that is not yet valid text stays held back), so positions in it are stable:
    a stop string found at position ``p`` stays at ``p``, and ``text`` is a prefix of the full decode.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.text = ""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream: Any = DecodeStream(skip_special_tokens=True)
        else:  # a tokenizer without a Rust backend: decode a short window (the prefix/read offsets of vLLM)
            self._tokenizer = tokenizer
            self._ids: list[int] = []
            self._prefix = self._read = 0

    def add(self, token: int) -> str:
        """Feed one token; returns the text it completed (possibly empty) and appends it to ``text``."""
        if self._backend is not None:
            piece = self._stream.step(self._backend, token) or ""
        else:
            piece = self._add_window(token)
        self.text += piece
        return piece

    def _add_window(self, token: int) -> str:
        self._ids.append(token)
        decode = lambda ids: self._tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        before = decode(self._ids[self._prefix:self._read])
        after = decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or an incomplete character: wait for more tokens
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]


def find_stop(text: str, new_len: int, stops: list[str]) -> Optional[int]:
    """Where the first stop string in ``text`` starts, given that none occurred before its last ``new_len``
    characters were appended; None if there is none. Only the tail a new character could complete is searched."""
    if not stops or new_len <= 0:
        return None
    longest = max(len(s) for s in stops)
    start = max(0, len(text) - new_len - longest + 1)
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None
