"""``attention=nsa``: DeepSeek sparse attention for the DeepSeek-V3.2 family (MLA models only) over the paged latent
and index-key caches (:class:`framework.kv.MLAPool`): ``tfs::indexer_topk`` selects each query token's
``index_topk`` keys and ``tfs::sparse_mla_attention`` attends only those, so a decode step reads the selected 2,048
latents whatever the context length.

Every batch whose tokens see their request's keys causally (prefill, decode, speculation v2's chain verify, draft
steps and draft extends) runs the sparse kernels, straight over the allocator's ``req_to_token`` table at its full,
static width (no per-step gather of slots, no host-derived length: what a CUDA graph needs). Batches with a tree
mask (v1 verification and tree drafting) run the dense-masked reference of ``attention=sdpa``, which is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from framework.attention import ATTENTION_BACKENDS
from framework.attention.sdpa import SdpaBackend, SdpaMetadata
from framework.batch import ForwardBatch
from tfs_kernels.indexer_topk import indexer_topk
from tfs_kernels.sparse_mla import sparse_mla_attention


@dataclass
class NsaMetadata:
    out_cache_loc: torch.Tensor  # [n] slots that receive this forward's latents and index keys
    table: torch.Tensor  # [rows, max_context] the allocator's req_to_token (static)
    token_rows: torch.Tensor  # [n] req_to_token row of each token's request
    vis_lens: torch.Tensor  # [n] keys each token sees: positions 0 .. its own


@ATTENTION_BACKENDS.register("nsa")
class NsaBackend(SdpaBackend):
    name = "nsa"
    mla_only = True

    def init_metadata(self, batch: ForwardBatch) -> Any:
        if batch.custom_mask is not None:  # a tree: the dense-masked reference
            return super().init_metadata(batch)
        dev = batch.input_ids.device
        if batch.mode.uniform:
            rows = batch.req_pool_indices.repeat_interleave(batch.q_len)
        else:
            counts = torch.from_numpy(np.asarray(batch.extend_lens_cpu, dtype=np.int64)).to(dev)
            rows = batch.req_pool_indices.repeat_interleave(counts)
        return NsaMetadata(batch.out_cache_loc, self.allocator.req_to_token, rows, batch.positions + 1)

    def dynamic_dims(self, meta: Any) -> list[tuple[torch.Tensor, int]]:
        if isinstance(meta, SdpaMetadata):
            return super().dynamic_dims(meta)
        return [(meta.out_cache_loc, 0), (meta.token_rows, 0), (meta.vis_lens, 0)]

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, layer: int, meta: Any,
                     topk: int, scale: float) -> torch.Tensor:
        if isinstance(meta, SdpaMetadata):
            return super().indexer_topk(q, weights, k, layer, meta, topk, scale)
        self.pool.store_index(layer, meta.out_cache_loc, k)
        return indexer_topk(q, weights, self.pool.index_k[layer], meta.table, meta.token_rows, meta.vis_lens, topk,
                            scale)

    def forward_mla(self, q: torch.Tensor, latent: torch.Tensor, topk_pos: Optional[torch.Tensor], layer: int,
                    meta: Any, scale: float, dv: int) -> torch.Tensor:
        if isinstance(meta, SdpaMetadata):
            return super().forward_mla(q, latent, topk_pos, layer, meta, scale, dv)
        self.pool.store_latent(layer, meta.out_cache_loc, latent)
        return sparse_mla_attention(q, self.pool.latent[layer], meta.table, meta.token_rows, topk_pos, scale, dv)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("attention=nsa serves MLA models only (forward_mla)")
