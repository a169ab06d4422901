"""Paged KV slot allocator and the ``req_to_token`` table.

A request owns whole pages; the token at position ``p`` of request row ``r`` lives in slot
``pages[r][p // page_size] * page_size + p % page_size``. ``req_to_token[r, p]`` holds that slot on the device
(read by attention kernels) and in a host mirror (read by the scheduler, so nothing reads device memory back).

NOTE: row 0 of ``req_to_token`` and page 0 (slots ``0 .. page_size-1``) are reserved for the dummy request
that pads batches to a captured size; they are never handed out.

With the prefix cache (``kv.prefix_cache``) a page is in exactly one of three places: the free list, the radix tree
(:mod:`framework.kv.radix_cache`: shared, reference-counted by the running requests that hold it), or one request's
private pages. A row's first ``_shared[row]`` pages are tree pages (the path ending at ``_node[row]``, which the row
locks); the rest are its own. Tree pages nobody holds count as free (:attr:`KVAllocator.num_free_pages`) and are
evicted, least recently used first, when the free list runs short.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import numpy as np
import torch

from framework.kv.radix_cache import Node, RadixCache
from framework.transfer import upload

DUMMY_ROW = 0
DUMMY_SLOT = 0


class KVAllocator:
    """Hands out request rows and KV pages; every slot returns on :meth:`free_request`."""

    def __init__(self, num_tokens: int, page_size: int, max_requests: int, max_context: int,
                 device: torch.device, prefix_cache: bool = False) -> None:
        self.page_size = page_size
        self.num_pages = -(-num_tokens // page_size)  # usable pages, page 0 excluded
        self.num_slots = (self.num_pages + 1) * page_size  # pool size including the dummy page
        self.max_context = max_context
        self.device = device
        self._free_pages: list[int] = list(range(self.num_pages, 0, -1))  # pop() hands out low pages first
        self._free_rows: list[int] = list(range(max_requests, 0, -1))
        self._pages: dict[int, list[int]] = {}
        # [max_requests + 1, pages per row] the pages of each row in order (valid up to len(_pages[row]))
        self._page_table = np.zeros((max_requests + 1, -(-max_context // page_size)), dtype=np.int64)
        # [max_requests + 1, max_context] slot of each (request row, position); row 0 = the dummy request
        self.req_to_token = torch.zeros(max_requests + 1, max_context, dtype=torch.int64, device=device)
        self.req_to_token_host = np.zeros((max_requests + 1, max_context), dtype=np.int64)
        self.cache: Optional[RadixCache] = RadixCache(page_size) if prefix_cache else None
        self._shared: dict[int, int] = {}  # row -> its leading pages that are tree pages (prefix cache)
        self._node: dict[int, Node] = {}  # row -> the deepest tree node it holds (prefix cache)

    # ---- capacity -------------------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_free_pages(self) -> int:
        """Pages a request can get: the free list plus the cached pages no running request holds."""
        return len(self._free_pages) + (self.cache.num_evictable if self.cache is not None else 0)

    @property
    def num_used_slots(self) -> int:
        """Slots in pages that running requests hold (cached pages nobody holds are not counted)."""
        return (self.num_pages - self.num_free_pages) * self.page_size

    @property
    def num_cached_pages(self) -> int:
        return self.cache.num_pages if self.cache is not None else 0

    def num_pages_of(self, row: int) -> int:
        return len(self._pages[row])

    # ---- requests -------------------------------------------------------------------------------------
    def alloc_request(self, prefix: Optional[list[Node]] = None) -> int:
        """Take a ``req_to_token`` row for a new request; with ``prefix`` (a path from :meth:`match_prefix`) its
        first positions are the cached pages' slots, which the row holds until :meth:`free_request`."""
        if not self._free_rows:
            raise RuntimeError("no free request row (scheduler admitted more than max_running_requests)")
        row = self._free_rows.pop()
        pages = [node.page for node in prefix or []]
        self._pages[row] = pages
        if self.cache is not None:
            self._shared[row] = len(pages)
            self._node[row] = prefix[-1] if prefix else self.cache.root
            if pages:
                self.cache.lock(prefix[-1])
                self._page_table[row, : len(pages)] = pages
                ps = self.page_size
                slots = (np.asarray(pages, dtype=np.int64)[:, None] * ps + np.arange(ps)).reshape(-1)  # [n * ps]
                self.req_to_token_host[row, : slots.size] = slots
                self.req_to_token[row, : slots.size] = upload(slots, self.device)
        return row

    def match_prefix(self, tokens: list[int], max_tokens: int) -> list[Node]:
        """The cached pages of the longest prefix of ``tokens`` (at most ``max_tokens`` tokens, whole pages)."""
        if self.cache is None:
            return []
        return self.cache.match(tokens, max_tokens // self.page_size)

    def cache_prefix(self, row: int, tokens: list[int], num_tokens: int) -> None:
        """Share a running row's full pages of ``tokens[:num_tokens]`` (K/V written) through the tree, so that
        requests admitted later find them; a page whose tokens another page holds already stays the row's own."""
        cache, shared = self.cache, self._shared.get(row, 0)
        full = min(num_tokens // self.page_size, len(self._pages[row]))
        if cache is None or full <= shared:
            return
        old = self._node[row]
        node, n, _ = cache.insert(old, cache.keys(tokens, full, shared), self._pages[row][shared:full], True)
        if n:
            cache.lock(node)
            cache.unlock(old)
            self._node[row], self._shared[row] = node, shared + n

    def free_request(self, row: int, tokens: Optional[list[int]] = None, num_tokens: int = 0) -> None:
        """Return the row and its pages. With the prefix cache the full pages of ``tokens[:num_tokens]`` (whose
        K/V are written) go to the tree instead of the free list, and the row's hold on its tree pages ends."""
        pages = self._pages.pop(row)
        self._free_rows.append(row)
        if self.cache is None:
            self._free_pages.extend(reversed(pages))
            return
        shared, node = self._shared.pop(row), self._node.pop(row)
        full = min(num_tokens // self.page_size, len(pages)) if tokens is not None else 0
        free = pages[max(shared, full):]
        if full > shared:
            _, _, duplicates = self.cache.insert(node, self.cache.keys(tokens, full, shared), pages[shared:full], False)
            free += duplicates
        self.cache.unlock(node)
        self._free_pages.extend(reversed(free))

    def clear_cache(self) -> int:
        """Evict every cached page no request holds (after a failed step, whose K/V may not have been written);
        returns how many."""
        if self.cache is None:
            return 0
        freed = self.cache.evict(self.cache.num_evictable)
        self._free_pages.extend(freed)
        return len(freed)

    def truncate(self, row: int, num_tokens: int) -> None:
        """Keep only the pages that positions ``< num_tokens`` of ``row`` use; free the rest."""
        pages = self._pages[row]
        keep = max(self.pages_for(num_tokens), self._shared.get(row, 0))  # (tree pages stay)
        if keep < len(pages):
            self._free_pages.extend(reversed(pages[keep:]))
            del pages[keep:]

    def assign(self, rows: list[int], starts: list[int], ends: list[int]) -> torch.Tensor:
        """Give positions ``[start, end)`` of each row a slot, allocating pages as needed.

        Returns the slots in row order, ``[sum(end - start)]`` int64 on the device, and writes them into
        ``req_to_token`` (device and host mirror). Raises ``MemoryError`` (allocating nothing) if pages run out.
        """
        rows_np, cols_np, slots_np = self._assign(rows, starts, ends)
        # one host->device copy of (row, col, slot) triples, then one scatter into the table
        packed = upload(np.stack([rows_np, cols_np, slots_np]), self.device)
        self.req_to_token[packed[0], packed[1]] = packed[2]
        return packed[2]

    def assign_host(self, rows: list[int], starts: list[int], ends: list[int]) -> np.ndarray:
        """:meth:`assign` on the host only: the slots ``[sum(end - start)]`` go into the host mirror of
        ``req_to_token``, and the caller writes them into the device table before anything reads them there (a
        staged decode batch: its compiled forward does, see ``ForwardBatch.write_slots``)."""
        if any(e - s != 1 for s, e in zip(starts, ends)):
            return self._assign(rows, starts, ends)[2]
        # one position per row (a decode step): a few list operations, cheaper than the general path's array work
        self._take_pages(rows, ends)
        size = self.page_size
        slots = [self._pages[r][p // size] * size + p % size for r, p in zip(rows, starts)]
        self.req_to_token_host[rows, starts] = slots
        return np.asarray(slots, dtype=np.int64)

    def _assign(self, rows: list[int], starts: list[int],
                ends: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pages for positions ``[start, end)`` of each row; returns (row, column, slot) of every position, written
        into the host mirror of ``req_to_token``."""
        self._take_pages(rows, ends)
        # every position at once: row and column of each token, its page from the table, its slot
        lens = np.asarray(ends, dtype=np.int64) - np.asarray(starts, dtype=np.int64)
        rows_np = np.repeat(np.asarray(rows, dtype=np.int64), lens)
        firsts = np.cumsum(lens) - lens  # flat index of each row's first token
        cols_np = np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - firsts,
                                                                          lens)
        slots_np = self._page_table[rows_np, cols_np // self.page_size] * self.page_size + cols_np % self.page_size
        self.req_to_token_host[rows_np, cols_np] = slots_np
        return rows_np, cols_np, slots_np

    def _take_pages(self, rows: list[int], ends: list[int]) -> None:
        """Pages so that each row holds positions ``< end``; raises ``MemoryError`` (taking none) if they run out."""
        if ends and max(ends) > self.max_context:
            raise ValueError(f"position {max(ends) - 1} beyond max_context {self.max_context}")
        need = sum(max(0, self.pages_for(e) - len(self._pages[r])) for r, e in zip(rows, ends))
        if need > len(self._free_pages) and self.cache is not None:  # evict cached pages nobody holds
            self._free_pages.extend(self.cache.evict(need - len(self._free_pages)))
        if need > len(self._free_pages):
            raise MemoryError(f"KV pool exhausted: need {need} pages, {len(self._free_pages)} free")
        for row, end in zip(rows, ends):
            pages = self._pages[row]
            while len(pages) < self.pages_for(end):
                self._page_table[row, len(pages)] = page = self._free_pages.pop()
                pages.append(page)

    # ---- invariants -----------------------------------------------------------------------------------
    def assert_all_free(self) -> None:
        """Every request row is free and every page is back in the free list, or, with the prefix cache, cached
        in the tree with no request holding it (no leak, no double free)."""
        assert not self._pages, f"request rows still held: {sorted(self._pages)}"
        if self.cache is None:
            assert sorted(self._free_pages) == list(range(1, self.num_pages + 1)), "KV pages leaked or double-freed"
        else:
            self.check_invariants()

    def check_invariants(self) -> None:
        """The prefix cache's bookkeeping: each tree node's ref equals the number of rows holding it; every row's
        leading pages are its path's pages; no page is both free and cached (or held twice); free + cached + held
        = every page. Without the cache: held + free = every page, none twice."""
        held = [p for row, pages in self._pages.items() for p in pages[self._shared.get(row, 0):]]
        tree: list[int] = []
        if self.cache is not None:
            expected: Counter = Counter()
            for row, node in self._node.items():
                path = []
                while node is not self.cache.root:
                    expected[id(node)] += 1
                    path.append(node.page)
                    node = node.parent
                assert path[::-1] == self._pages[row][: self._shared[row]], f"row {row}: shared pages off its path"
            nodes = list(self.cache.nodes())
            for node in nodes:
                assert node.ref == expected[id(node)], f"page {node.page}: ref {node.ref}, held by {expected[id(node)]}"
            assert self.cache.num_pages == len(nodes), "prefix cache: page count off"
            assert self.cache.num_evictable == sum(n.ref == 0 for n in nodes), "prefix cache: evictable count off"
            tree = [node.page for node in nodes]
        everything = self._free_pages + tree + held
        assert len(set(everything)) == len(everything), "a KV page is in two places (free / cached / held)"
        assert sorted(everything) == list(range(1, self.num_pages + 1)), "KV pages leaked"
