"""Paged KV slot allocator and the ``req_to_token`` table.

A request owns whole pages; the token at position ``p`` of request row ``r`` lives in slot
``pages[r][p // page_size] * page_size + p % page_size``. ``req_to_token[r, p]`` holds that slot on the device
(read by attention kernels) and in a host mirror (read by the scheduler, so nothing reads device memory back).

NOTE: row 0 of ``req_to_token`` and page 0 (slots ``0 .. page_size-1``) are reserved for the dummy request
that pads batches to a captured size; they are never handed out.
"""

from __future__ import annotations

import numpy as np
import torch

from framework.transfer import upload

DUMMY_ROW = 0
DUMMY_SLOT = 0


class KVAllocator:
    """Hands out request rows and KV pages; every slot returns on :meth:`free_request`."""

    def __init__(self, num_tokens: int, page_size: int, max_requests: int, max_context: int,
                 device: torch.device) -> None:
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

    # ---- capacity -------------------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_used_slots(self) -> int:
        return (self.num_pages - len(self._free_pages)) * self.page_size

    def num_pages_of(self, row: int) -> int:
        return len(self._pages[row])

    # ---- requests -------------------------------------------------------------------------------------
    def alloc_request(self) -> int:
        """Take a ``req_to_token`` row for a new request."""
        if not self._free_rows:
            raise RuntimeError("no free request row (scheduler admitted more than max_running_requests)")
        row = self._free_rows.pop()
        self._pages[row] = []
        return row

    def free_request(self, row: int) -> None:
        """Return the row and all its pages."""
        self._free_pages.extend(reversed(self._pages.pop(row)))
        self._free_rows.append(row)

    def truncate(self, row: int, num_tokens: int) -> None:
        """Keep only the pages that positions ``< num_tokens`` of ``row`` use; free the rest."""
        pages = self._pages[row]
        keep = self.pages_for(num_tokens)
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
        if need > len(self._free_pages):
            raise MemoryError(f"KV pool exhausted: need {need} pages, {len(self._free_pages)} free")
        for row, end in zip(rows, ends):
            pages = self._pages[row]
            while len(pages) < self.pages_for(end):
                self._page_table[row, len(pages)] = page = self._free_pages.pop()
                pages.append(page)

    # ---- invariants -----------------------------------------------------------------------------------
    def assert_all_free(self) -> None:
        """Every page and every request row is back in the free lists (no leak, no double free)."""
        assert not self._pages, f"request rows still held: {sorted(self._pages)}"
        assert sorted(self._free_pages) == list(range(1, self.num_pages + 1)), "KV pages leaked or double-freed"
