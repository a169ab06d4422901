"""``attention=sdpa``: torch scaled_dot_product_attention over K/V gathered through req_to_token.

Every mode is the same computation: each request has ``q_len`` new tokens (EXTEND: ragged, padded to the
longest; DECODE: 1; TARGET_VERIFY / DRAFT_EXTEND: the draft tokens) that attend to the request's cached
prefix plus, among themselves, causally or through ``batch.custom_mask`` (a tree mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from framework.attention import ATTENTION_BACKENDS
from framework.attention.base import AttentionBackend
from framework.attention.mla_dense import DenseMLA
from framework.batch import ForwardBatch, ForwardMode
from framework.config import ConfigError

# the deterministic mode's row-by-row attention (SdpaBackend._rowwise): bytes of products made at a time
ROWWISE_BYTES = 64 << 20


@dataclass
class SdpaMetadata:
    out_cache_loc: torch.Tensor  # [num_tokens] slots that receive the new K/V
    kv_slots: torch.Tensor  # [bs, kv_width] slot of every key position (req_to_token rows)
    mask: torch.Tensor  # [bs, 1, q_len, kv_width] bool: query token t of request b may attend key j
    token_index: Optional[torch.Tensor] = None  # EXTEND: [bs, q_len] flat token of each (b, t)
    flat_index: Optional[torch.Tensor] = None  # EXTEND: [num_tokens] position of each token in [bs * q_len]


def kv_width_bucket(max_len: int, limit: int) -> int:
    """Key width for a batch whose longest request has ``max_len`` keys: the next power of two >= 64.

    Buckets keep the number of distinct shapes (compiled graphs) logarithmic in the context length.
    """
    width = 64
    while width < max_len:
        width *= 2
    return min(width, limit)


@dataclass
class PaddedLayout:
    """A batch laid out as ``[bs, q_len]`` new tokens against ``[bs, width]`` key positions (sdpa and flex)."""
    kv_slots: torch.Tensor  # [bs, width] slot of every key position (req_to_token rows)
    width: int
    q_len: int  # uniform modes: tokens per request; EXTEND: the longest request's new tokens
    q_lens: torch.Tensor  # [bs] new tokens of each request
    token_index: Optional[torch.Tensor] = None  # EXTEND: [bs, q_len] flat token of each (b, t)
    flat_index: Optional[torch.Tensor] = None  # EXTEND: [num_tokens] position of each token in [bs * q_len]


def padded_layout(batch: ForwardBatch, max_context: int, req_to_token: torch.Tensor,
                  full_width: bool = False) -> PaddedLayout:
    """Key width bucket and slots of the batch; for ragged EXTEND batches also the scatter / gather indices
    between the flat tokens and the padded ``[bs, q_len]`` grid (built on the host, one copy to the device).
    ``full_width``: every batch over the table's whole width (model.deterministic: one reduction length)."""
    # NOTE: v2's draft extend runs from a CUDA graph whose lengths the host does not know: the table's whole width
    whole = full_width or batch.mode is ForwardMode.DRAFT_EXTEND_V2
    width = max_context if whole else kv_width_bucket(max(batch.seq_lens_cpu), max_context)
    kv_slots = req_to_token[batch.req_pool_indices, :width]  # [bs, width]
    if batch.mode.uniform:
        return PaddedLayout(kv_slots, width, batch.q_len, torch.full_like(batch.seq_lens, batch.q_len))
    lens = np.asarray(batch.extend_lens_cpu, dtype=np.int64)
    q_len = int(lens.max())
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    t = np.arange(q_len)
    token_np = np.where(t[None, :] < lens[:, None], starts[:, None] + t[None, :], 0)  # [bs, q_len]
    flat_np = np.concatenate([b * q_len + np.arange(n) for b, n in enumerate(lens)])
    packed = torch.from_numpy(np.concatenate([token_np.reshape(-1), flat_np, lens])).to(batch.input_ids.device)
    return PaddedLayout(kv_slots, width, q_len, packed[token_np.size + flat_np.size:],
                        packed[: token_np.size].view(len(lens), q_len),
                        packed[token_np.size: token_np.size + flat_np.size])


def build_mask(seq_lens: torch.Tensor, q_lens: torch.Tensor, q_len: int, kv_width: int,
               custom_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``[bs, 1, q_len, kv_width]`` bool: which keys each query token of each request may attend.

    seq_lens, q_lens: ``[bs]`` int64 (KV length after this forward, new tokens). Without ``custom_mask`` the new
    tokens see the whole prefix and each other causally. ``custom_mask`` ``[bs, q_len, mask_width]`` (mask_width >=
    q_len) decides for the last ``mask_width`` keys of each request (the speculative region: a tree's nodes, or
    earlier draft steps' tokens plus this step's); keys before it are all visible. Query rows beyond a request's
    ``q_len`` (padding) attend key 0 only, so that no row is fully masked.
    """
    device = seq_lens.device
    t = torch.arange(q_len, device=device)[None, :, None]  # [1, q_len, 1]
    j = torch.arange(kv_width, device=device)[None, None, :]  # [1, 1, kv_width]
    if custom_mask is None:
        prefix = (seq_lens - q_lens)[:, None, None]  # [bs, 1, 1]
        allowed = j <= prefix + t  # [bs, q_len, kv_width]
    else:
        width = custom_mask.shape[-1]
        region = (seq_lens - width)[:, None, None]  # [bs, 1, 1] first key of the masked region
        rel = j - region  # [bs, 1, kv_width]
        in_region = (rel >= 0) & (rel < width)
        gathered = torch.gather(custom_mask, 2, rel.clamp(0, width - 1).expand(-1, q_len, -1))
        allowed = (j < region) | (in_region & gathered)
    valid_q = t < q_lens[:, None, None]  # [bs, q_len, 1]
    allowed = torch.where(valid_q, allowed, j == 0)
    return allowed[:, None]


@ATTENTION_BACKENDS.register("sdpa")
class SdpaBackend(DenseMLA, AttentionBackend):
    name = "sdpa"

    def set_deterministic(self) -> None:
        """The CPU's batch-invariant attention: every query row is its own sdpa problem (a head of one query)
        over the table's whole width, so its sums have one shape whatever the batch, the mode or the row."""
        if self.allocator.device.type != "cpu":
            raise ConfigError("model.deterministic=true: attention=sdpa is batch-invariant on the CPU only; use "
                              "attention=triton on CUDA")
        self.deterministic = True

    def init_metadata(self, batch: ForwardBatch) -> SdpaMetadata:
        lay = padded_layout(batch, self.allocator.max_context, self.allocator.req_to_token, self.deterministic)
        mask = build_mask(batch.seq_lens, lay.q_lens, lay.q_len, lay.width, batch.custom_mask)
        return SdpaMetadata(batch.out_cache_loc, lay.kv_slots, mask, lay.token_index, lay.flat_index)

    def dynamic_dims(self, meta: SdpaMetadata) -> list[tuple[torch.Tensor, int]]:
        return [(meta.out_cache_loc, 0), (meta.kv_slots, 0), (meta.kv_slots, 1), (meta.mask, 0), (meta.mask, 3)]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                meta: SdpaMetadata) -> torch.Tensor:
        self.pool.store(layer, meta.out_cache_loc, k, v)
        return self.attend(q, self.pool.k[layer][meta.kv_slots], self.pool.v[layer][meta.kv_slots], meta)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: SdpaMetadata) -> torch.Tensor:
        """q ``[num_tokens, heads, dim]`` over the gathered keys / values ``[bs, width, kv_heads, dim]``."""
        bs, _, q_len, width = meta.mask.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        group = heads // kv_heads
        if meta.token_index is None:
            qb = q.view(bs, q_len, heads, dim)
        else:
            qb = q[meta.token_index]  # [bs, q_len, heads, dim]
        # query heads h = kv * group + g share kv head `kv`: fold the group into the query length so that
        # sdpa sees plain multi-head attention and K/V are never repeated
        qb = qb.view(bs, q_len, kv_heads, group, dim).permute(0, 2, 1, 3, 4).reshape(bs, kv_heads, q_len * group, dim)
        kb = keys.transpose(1, 2)  # [bs, kv_heads, width, dim]
        vb = values.transpose(1, 2)
        mask = meta.mask[:, :, :, None, :].expand(bs, 1, q_len, group, width).reshape(bs, 1, q_len * group, width)
        if self.deterministic:
            out = self._rowwise(qb.to(kb.dtype), kb, vb, mask)
        else:
            out = F.scaled_dot_product_attention(qb.to(kb.dtype), kb, vb, attn_mask=mask, scale=self.scale)
        out = out.view(bs, kv_heads, q_len, group, dim).permute(0, 2, 1, 3, 4).reshape(bs * q_len, heads * dim)
        if meta.flat_index is not None:
            out = out[meta.flat_index]
        return out

    def _rowwise(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q ``[bs, kv_heads, rows, dim]``, k / v ``[bs, kv_heads, width, dim]``, mask ``[bs, 1, rows, width]`` ->
        ``[bs, kv_heads, rows, dim]``, every row's sums of one shape whatever the batch, the mode or the row: its
        scores and its weighted values as elementwise products summed over a contiguous last dimension (float32),
        not a BLAS product. CPU GEMMs block their products by the row count and batch count, and CPU sdpa splits a
        one-query problem's keys across threads by the number of problems, so a verify's or a prefill's rows
        would otherwise reduce differently from a decode's. The products are made for ``ROWWISE_BYTES`` of rows at
        a time; eager only (the CPU's deterministic mode, ``compile=eager``), and slower than sdpa (the table's
        whole width for every row)."""
        bs, kv_heads, rows, dim = q.shape
        width = k.shape[2]
        kf = k.float()[:, :, None]  # [bs, kv_heads, 1, width, dim]
        vt = v.float().transpose(-1, -2).contiguous()[:, :, None]  # [bs, kv_heads, 1, dim, width]
        qf = q.float()[:, :, :, None, :]  # [bs, kv_heads, rows, 1, dim]
        chunk = max(1, ROWWISE_BYTES // max(1, bs * kv_heads * width * dim * 4))
        outs = []
        for r0 in range(0, rows, chunk):
            scores = (qf[:, :, r0:r0 + chunk] * kf).sum(-1) * self.scale  # [bs, kv_heads, n, width]
            p = scores.masked_fill(~mask[:, :, r0:r0 + chunk], float("-inf")).softmax(-1)
            outs.append((p[:, :, :, None, :] * vt).sum(-1))  # [bs, kv_heads, n, dim]
        return (outs[0] if len(outs) == 1 else torch.cat(outs, 2)).to(q.dtype)
