"""Finished requests' tokens on the device: the global source of ``speculative=suffix`` in speculation v2.

A ring of ``capacity`` slots (``speculative.suffix_cache_tokens``): each finished request takes its tokens (the last
``capacity - 1`` of prompt + output, as v1's global tree takes the last ``suffix_cache_tokens``) and one separator
(:data:`SEP`), so no match runs from one request into the next; free slots hold separators too. When a request does
not fit, the oldest requests are evicted whole (their slots become separators), as v1 evicts from its global tree.
The host keeps a copy of the ring and sends only the changed slots, in one upload that never waits for the device;
the device tensors keep their addresses (CUDA graphs read them)."""

from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np
import torch

from framework.speculative.suffix_device import SEP
from framework.transfer import upload


class SuffixCorpus:
    def __init__(self, capacity: int, device: torch.device) -> None:
        if capacity < 2:
            raise ValueError(f"a suffix corpus needs at least 2 slots (a token and a separator), got {capacity}")
        self.capacity = capacity
        self.device = device
        self.tokens = torch.full((capacity,), SEP, dtype=torch.int64, device=device)  # [capacity] the ring
        self.start = torch.zeros(1, dtype=torch.int64, device=device)  # [1] the oldest request's first slot
        if device.type == "cuda":  # read inside captured graphs, written between them
            for t in (self.tokens, self.start):
                torch._dynamo.mark_static_address(t)
        self._host = np.full(capacity, SEP, dtype=np.int64)  # the ring as the device will have it
        self._entries: deque[tuple[int, int]] = deque()  # (first slot, slots with the separator), oldest first
        self._head = 0  # the next free slot
        self._used = 0
        self._origin = torch.zeros(1, dtype=torch.int64, device=device)  # [1] a window's oldest slot

    @property
    def num_tokens(self) -> int:
        """Tokens held (separators not counted)."""
        return self._used - len(self._entries)

    def window(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """For drafting outside CUDA graphs: (the slots that hold requests, oldest first, each request followed by
        its separator; its oldest slot, 0), or None while no request is held. Drafting over it gives what drafting
        over the whole ring gives (the same occurrences in the same order), scanning only the filled slots."""
        if not self._entries:
            return None
        first = self._entries[0][0]
        end = first + self._used
        view = self.tokens[first:end] if end <= self.capacity else \
            torch.cat([self.tokens[first:], self.tokens[: end - self.capacity]])
        return view, self._origin

    def sequences(self) -> list[list[int]]:
        """The requests' tokens held, oldest first (from the host's copy)."""
        return [self._host[(first + np.arange(n - 1)) % self.capacity].tolist() for first, n in self._entries]

    def add(self, sequences: list[list[int]]) -> None:
        """Append finished requests' tokens (in order), evicting the oldest requests that do not leave room."""
        changed = []
        for seq in sequences:
            seq = list(seq[-(self.capacity - 1):])
            if not seq:
                continue
            n = len(seq) + 1
            while self.capacity - self._used < n:  # evict the oldest whole
                first, size = self._entries.popleft()
                slots = (first + np.arange(size)) % self.capacity
                self._host[slots] = SEP
                self._used -= size
                changed.append(slots)
            slots = (self._head + np.arange(n)) % self.capacity
            self._host[slots] = seq + [SEP]
            self._entries.append((self._head, n))
            self._head = (self._head + n) % self.capacity
            self._used += n
            changed.append(slots)
        if not changed:
            return
        where = np.unique(np.concatenate(changed))
        start = self._entries[0][0] if self._entries else self._head
        packed = upload(np.concatenate([where, self._host[where], [start]]).astype(np.int64), self.device)
        k = len(where)
        self.tokens[packed[:k]] = packed[k: 2 * k]
        self.start.copy_(packed[2 * k:])
