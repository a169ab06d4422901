"""The target's hidden state at the last position of every KV page, for head drafters under the prefix cache.

An EAGLE / MTP head pairs token p with the target's hidden state of position p - 1. A request that takes a cached
prefix of ``c`` positions starts prefilling at ``c`` and so needs the hidden state of position ``c - 1``, which was
computed by whichever request wrote that page. The head's K/V of the cached pages are reused from its own pool (the
tree takes pages only below the head's valid length); this table keeps the one hidden state per page that the
first new token needs, so the head's state equals what a full prefill gives.

NOTE: a page's entry is written whenever the target computes the page's last position for a request (a prefill
chunk, an accepted verify node) and read only while the page is in the tree, i.e. after it was written.
"""

from __future__ import annotations

import numpy as np
import torch

from framework.transfer import upload


class PageCarry:
    """``states`` ``[num_pages + 1, hidden]``: the target's hidden state at each page's last position."""

    def __init__(self, allocator, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.device = device
        self.states = torch.zeros(allocator.num_pages + 1, hidden_size, dtype=dtype, device=device)
        if device.type == "cuda":
            torch._dynamo.mark_static_address(self.states)

    def page_of(self, row: int, position: int) -> int:
        """The KV page that holds ``position`` of request ``row``."""
        return int(self.allocator.req_to_token_host[row, position]) // self.page_size

    def page_ends(self, row: int, start: int, end: int) -> tuple[list[int], list[int]]:
        """The positions in ``[start, end)`` of ``row`` that end a page, as (pages, offsets from ``start``)."""
        ps = self.page_size
        first = start + (-(start + 1)) % ps  # the first position p >= start with (p + 1) % ps == 0
        offsets = list(range(first - start, end - start, ps))
        return [self.page_of(row, start + o) for o in offsets], offsets

    def store(self, pages: list[int], hidden_rows: list[int], hidden: torch.Tensor) -> None:
        """``states[pages[i]] = hidden[hidden_rows[i]]`` (``hidden`` ``[num_tokens, hidden]``)."""
        if pages:
            index = upload(np.asarray([pages, hidden_rows], dtype=np.int64), self.device)
            self.states[index[0]] = hidden[index[1]].to(self.states.dtype)

    def store_verified(self, rows: torch.Tensor, committed: torch.Tensor, accept_lens: torch.Tensor,
                       hidden: torch.Tensor) -> None:
        """v2, on the device: the accepted verify nodes that end a page. ``rows``, ``committed`` (the root's
        position), ``accept_lens`` ``[bs]``; ``hidden`` ``[bs * q, hidden]`` the target's states over the chain."""
        bs = rows.shape[0]
        q = hidden.shape[0] // bs
        table = self.allocator.req_to_token
        steps = torch.arange(q, device=rows.device)[None, :]
        positions = committed[:, None] + steps  # [bs, q]
        ends = ((positions + 1) % self.page_size == 0) & (steps < accept_lens[:, None]) & (rows[:, None] != 0)
        slots = table[rows[:, None], positions.clamp(max=table.shape[1] - 1)]
        pages = torch.where(ends, slots // self.page_size, 0)  # NOTE: page 0 (the dummy's) takes the rest
        self.states.index_copy_(0, pages.reshape(-1), hidden.to(self.states.dtype))
