"""Each request's tokens on the device (prompt + generated), for speculation that never asks the host (v2).

Row ``r`` of :attr:`TokenHistory.tokens` is request row ``r``'s sequence; ``lens[r]`` tokens are known, the last of
them the next root (its K/V not yet written); ``prompt_lens[r]`` of them are the prompt. Rows are filled when a
request's prefill completes (:meth:`TokenHistory.start`) and grow on the device after every verification
(:meth:`TokenHistory.append`). Row 0 (the dummy request that pads batches) keeps one token and never grows.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from framework.kv import DUMMY_ROW
from framework.transfer import upload


class TokenHistory:
    def __init__(self, num_rows: int, width: int, device: torch.device) -> None:
        self.width = width
        self.tokens = torch.zeros(num_rows, width, dtype=torch.int64, device=device)  # [rows, width]
        self.lens = torch.ones(num_rows, dtype=torch.int64, device=device)  # [rows]
        self.prompt_lens = torch.zeros(num_rows, dtype=torch.int64, device=device)  # [rows]
        self.device = device
        if device.type == "cuda":  # read and written inside captured graphs, written outside them too
            for t in (self.tokens, self.lens, self.prompt_lens):
                torch._dynamo.mark_static_address(t)

    def start(self, rows: list[int], sequences: list[list[int]], prompt_lens: list[int], sampled: torch.Tensor,
              index: list[int], samples: list[bool]) -> None:
        """Fill rows whose prefill completes: ``sequences[i]`` the tokens the host has; where ``samples[i]``, the
        token the prefill sampled, ``sampled[index[i]]`` (on the device, not yet on the host), follows them."""
        sizes = [len(s) for s in sequences]
        lens = [n + int(g) for n, g in zip(sizes, samples)]
        cols = np.concatenate([np.arange(n, dtype=np.int64) for n in sizes])
        parts = [np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences]), cols,
                 np.repeat(np.asarray(rows, dtype=np.int64), sizes), rows, lens, prompt_lens, index, samples]
        packed = upload(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]), self.device)  # one upload
        views, at = [], 0
        for p in parts:
            views.append(packed[at: at + len(p)])
            at += len(p)
        flat, cols_t, where, rows_t, lens_t, prompt_t, index_t, samples_t = views
        self.tokens[where, cols_t] = flat
        self.lens[rows_t] = lens_t
        self.prompt_lens[rows_t] = prompt_t
        if any(samples):  # a request without a sampled token rewrites its own last token
            last = self.tokens[rows_t, lens_t - 1]
            self.tokens[rows_t, lens_t - 1] = torch.where(samples_t.bool(), sampled[index_t].to(torch.int64), last)

    def append(self, rows: torch.Tensor, accept_tokens: torch.Tensor, accept_lens: torch.Tensor,
               bonus: torch.Tensor, enabled: Optional[torch.Tensor] = None) -> None:
        """After a verification (on the device, in the graph): row ``rows[i]`` gains ``accept_tokens[i,
        :accept_lens[i]]``, the last of them ``bonus[i]`` the next root. rows ``[bs]``, accept_tokens ``[bs, q]``;
        ``enabled`` (a bool scalar on the device; None: true) false leaves every row as it was."""
        q = accept_tokens.shape[1]
        lens = self.lens[rows]  # [bs]
        real = rows != DUMMY_ROW if enabled is None else (rows != DUMMY_ROW) & enabled
        cols = (lens[:, None] + torch.arange(q, device=rows.device)[None, :]).clamp(max=self.width - 1)
        # tokens past accept_lens land beyond the new length, where nothing reads them before they are rewritten
        self.tokens[rows[:, None].expand(-1, q), cols] = torch.where(real[:, None], accept_tokens,
                                                                     self.tokens[rows[:, None], cols])
        root = (lens + accept_lens - 1).clamp(max=self.width - 1)
        self.tokens[rows, root] = torch.where(real, bonus, self.tokens[rows, root])
        self.lens[rows] = torch.where(real, lens + accept_lens, lens)
