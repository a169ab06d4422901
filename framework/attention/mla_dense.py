"""MLA attention and the DSA indexer's top-k as dense masked torch over the padded ``[bs, q_len]`` layout of
``attention=sdpa`` (and of ``attention=nsa`` for tree-masked batches): the reference the sparse kernels are held
to. The selection becomes a mask over each request's key positions, combined with the causal / tree mask."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F


def to_grid(x: torch.Tensor, meta: Any, bs: int, q_len: int) -> torch.Tensor:
    """Flat token rows ``[n, ...]`` -> ``[bs, q_len, ...]`` (EXTEND: through ``meta.token_index``)."""
    if meta.token_index is None:
        return x.view(bs, q_len, *x.shape[1:])
    return x[meta.token_index]


def from_grid(x: torch.Tensor, meta: Any) -> torch.Tensor:
    """``[bs, q_len, ...]`` -> flat token rows ``[n, ...]``."""
    flat = x.reshape(-1, *x.shape[2:])
    return flat if meta.flat_index is None else flat[meta.flat_index]


def selection_mask(topk_pos: torch.Tensor, width: int) -> torch.Tensor:
    """``[..., k]`` key positions (-1: none) -> ``[..., width]`` bool, True at the selected positions."""
    idx = torch.where(topk_pos < 0, width, topk_pos)  # -1 -> a spare column, dropped below
    sel = torch.zeros(*topk_pos.shape[:-1], width + 1, dtype=torch.bool, device=topk_pos.device)
    return sel.scatter(-1, idx, True)[..., :width]


def dense_indexer_topk(index_cache: torch.Tensor, q: torch.Tensor, weights: torch.Tensor, meta: Any, topk: int,
                       scale: float) -> torch.Tensor:
    """q ``[n, H, D]``, weights ``[n, H]`` float32 -> ``[n, topk]`` positions of the best visible keys of each
    token's request (score ``sum_h w_h relu(scale q_h . k)``), -1 where fewer keys are visible."""
    bs, _, q_len, width = meta.mask.shape
    keys = index_cache[meta.kv_slots].float()  # [bs, width, D]
    qb = to_grid(q, meta, bs, q_len).float()  # [bs, q_len, H, D]
    wb = to_grid(weights, meta, bs, q_len)  # [bs, q_len, H]
    scores = torch.relu(torch.einsum("bthd,bjd->bthj", qb, keys) * scale)  # [bs, q_len, H, width]
    index = torch.einsum("bth,bthj->btj", wb, scores).masked_fill(~meta.mask[:, 0], float("-inf"))
    if width < topk:  # a fixed output width: the positions past the keys are never visible
        index = F.pad(index, (0, topk - width), value=float("-inf"))
    top = index.topk(topk, dim=-1)  # [bs, q_len, topk]
    pos = torch.where(top.values > float("-inf"), top.indices, -1)
    return from_grid(pos, meta)


def dense_mla(latent_cache: torch.Tensor, q: torch.Tensor, topk_pos: Optional[torch.Tensor], meta: Any,
              scale: float, dv: int) -> torch.Tensor:
    """q ``[n, h, dk]`` against each request's cached latents ``[width, dk]`` (values: their first ``dv`` dims),
    restricted to the selected positions ``topk_pos`` ``[n, k]`` (None: all visible) -> ``[n, h, dv]``."""
    bs, _, q_len, width = meta.mask.shape
    h, dk = q.shape[1], q.shape[2]
    kv = latent_cache[meta.kv_slots]  # [bs, width, dk]
    mask = meta.mask[:, 0]  # [bs, q_len, width]
    if topk_pos is not None:
        mask = mask & selection_mask(to_grid(topk_pos, meta, bs, q_len), width)
    # one latent head for every query head: fold the heads into the query length
    qb = to_grid(q, meta, bs, q_len).reshape(bs, 1, q_len * h, dk)
    m = mask[:, None, :, None, :].expand(bs, 1, q_len, h, width).reshape(bs, 1, q_len * h, width)
    out = F.scaled_dot_product_attention(qb.to(kv.dtype), kv[:, None], kv[:, None, :, :dv], attn_mask=m,
                                         scale=scale)  # [bs, 1, q_len * h, dv]
    return from_grid(out.view(bs, q_len, h, dv), meta)


class DenseMLA:
    """The MLA half of a backend whose metadata is :class:`framework.attention.sdpa.SdpaMetadata`."""

    supports_mla = True

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, layer: int, meta: Any,
                     topk: int, scale: float) -> torch.Tensor:
        """Cache this forward's index keys ``k`` ``[n, D]`` and select: ``[n, topk]`` key positions (-1: none)."""
        self.pool.store_index(layer, meta.out_cache_loc, k)
        return dense_indexer_topk(self.pool.index_k[layer], q, weights, meta, topk, scale)

    def forward_mla(self, q: torch.Tensor, latent: torch.Tensor, topk_pos: Optional[torch.Tensor], layer: int,
                    meta: Any, scale: float, dv: int) -> torch.Tensor:
        """Cache this forward's latents ``[n, dk]`` and attend: q ``[n, h, dk]`` -> ``[n, h, dv]``."""
        self.pool.store_latent(layer, meta.out_cache_loc, latent)
        return dense_mla(self.pool.latent[layer], q, topk_pos, meta, scale, dv)
