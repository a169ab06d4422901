"""The scheduler's side of the prefix cache (``kv.prefix_cache``): what a request takes from the cache when it is
admitted, and which of its pages the cache takes as they are written.

NOTE: K/V written by a launched forward are read only by forwards launched after it (one stream, or the CPU's
program order), so pages enter the tree as soon as the forward that writes them is launched.
"""

from __future__ import annotations

from typing import Callable, Optional

from framework.batch import ForwardMode
from framework.kv import KVAllocator
from framework.request import Request

# a waiting request that shares at least this many tokens past its cached prefix with a prefill chunk of the step
# being planned waits one step for them to be cached (fewer: it computes them itself; a shorter wait is not worth it)
IN_STEP_SHARE_TOKENS = 32


class PrefixSharing:
    """Matching at admission (memoised while a request waits), sharing written pages, releasing a request's pages."""

    def __init__(self, allocator: KVAllocator) -> None:
        self.allocator = allocator
        # the positions of a request whose K/V every pool holds (set by the engine when a drafter keeps a pool of
        # its own, which may lag behind the target's); the cache takes pages only below it
        self.kv_valid_len: Optional[Callable[[Request], int]] = None
        # False when such a drafter fills its pool only once the step's tokens are on the host (v1): pages are then
        # shared after the step is applied, not at its launch
        self.share_at_launch = True
        self._last: Optional[tuple[Request, tuple[int, int], list]] = None  # (request, (tree version, target), path)

    def match(self, req: Request, target: int) -> list:
        """The cached pages ``req`` can take: whole pages of its first ``target - 1`` tokens (the last prefill token
        is always computed, for its logits). A request left waiting is not matched again until the tree changes."""
        cache = self.allocator.cache
        if cache is None:
            return []
        if self._last is not None and self._last[0] is req and self._last[1] == (cache.version, target):
            return self._last[2]
        path = self.allocator.match_prefix(req.token_slice(0, target - 1), target - 1)
        self._last = (req, (cache.version, target), path)
        return path

    def computing(self, req: Request, cached: int, reqs: list[Request], lens: list[int]) -> bool:
        """Whether a prefill chunk of the step being planned (``reqs`` adding ``lens`` tokens from their ``kv_len``)
        computes the next ``IN_STEP_SHARE_TOKENS`` tokens of ``req`` past its cached prefix (the same tokens at the
        same positions); ``req`` then waits a step and takes them from the cache instead of computing them twice."""
        ps = self.allocator.page_size
        span = -(-IN_STEP_SHARE_TOKENS // ps) * ps
        if self.allocator.cache is None or not reqs or cached + span > req.prefill_target - 1:
            return False
        tokens = req.token_slice(cached, cached + span)
        return any(not r.prefilled and r.kv_len <= cached < r.kv_len + n
                   and r.token_slice(cached, cached + span) == tokens for r, n in zip(reqs, lens))

    def written(self, req: Request) -> tuple[list[int], int]:
        """Prompt + output and how many of them have K/V written in every pool: what the cache may take. (A
        launched position whose input token the host lacks yet, or past a rejected draft, is not counted.)"""
        tokens = req.prompt_ids + req.output_ids
        n = min(req.kv_len, len(tokens))
        return tokens, min(n, self.kv_valid_len(req)) if self.kv_valid_len is not None else n

    def share(self, mode: ForwardMode, reqs: list[Request], launched: bool) -> None:
        """After a prefill (EXTEND) step is launched (``launched``) or applied: its requests' full pages go into
        the tree, for the requests admitted next."""
        if mode is ForwardMode.EXTEND and self.allocator.cache is not None and (self.share_at_launch or not launched):
            for req in reqs:
                if req.row >= 0:
                    self.allocator.cache_prefix(req.row, *self.written(req))

    def release(self, req: Request) -> None:
        """The request's row and pages back (its written full pages into the tree)."""
        self.allocator.free_request(req.row, *self.written(req))
