"""Multi-head latent attention (DeepSeek-V3 MLA) with the DeepSeek sparse attention (DSA) lightning indexer.

MLA compresses each token's keys and values into one latent ``c`` (``kv_lora_rank`` dims, RMS-normalised) plus a
shared roped key part (``qk_rope_head_dim`` dims): the KV cache holds ``[c | k_rope]`` per token, one "head" for all
query heads. Attention runs in the absorbed form everywhere (prefill, decode, verify, draft): each head's no-RoPE
query is multiplied into the latent space by the key half of ``kv_b_proj`` (``q_lat = q_nope @ W_UK``), so the
scores are ``[q_lat | q_rope] . [c | k_rope]``, and the value half maps the attended latent back (``o = (p @ c) @
W_UV``): mathematically the expanded form transformers computes, with a cache of ``kv_lora_rank +
qk_rope_head_dim`` values per token instead of ``heads * (qk_head_dim + v_head_dim)``.

The indexer scores every visible earlier key of the request with its own small projections (``wq_b`` over the q
LoRA state, ``wk`` + LayerNorm over the layer input, a per-head weight from ``weights_proj``):
``score = sum_h w_h * relu(scale * q_h . k)``; each query attends only its ``index_topk`` best keys. Both the
selection and the sparse attention are the attention backend's (``indexer_topk`` and ``forward_mla``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from framework.models.llama import RMSNorm
from tfs_kernels.rope_store import Rope, apply_rope


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[n, heads, 2 * half]`` with rotary pairs interleaved ``(x0, x1), (x2, x3), ...`` -> the rotated pairs in
    rotate-half layout (evens then odds), as DeepSeek's MLA (and transformers) apply it; cos / sin ``[n, 1, half]``."""
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@dataclass
class IndexReuse:
    """Top-k index reuse across the MTP layer's draft steps of one draft forward (the seeds' contract).

    ``mode``: None (compute, keep nothing), "store" (compute and write the selection into ``buffer``) or "reuse"
    (read the selection of the first step from ``buffer``, skip the indexer). ``buffer`` ``[rows, index_topk]``
    int64 is a fixed device tensor, so a stored selection survives between the CUDA graphs of consecutive steps.
    """

    buffer: torch.Tensor
    mode: Optional[str] = None
    stored: bool = False  # the buffer holds this draft forward's selection


class Indexer(nn.Module):
    """``forward(x [n, hidden], q_resid [n, q_lora_rank], rope, meta) -> [n, index_topk]`` key positions (-1:
    none), computed by the attention backend over the index-key cache, which this forward extends."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, rope_dim: int, topk: int,
                 layer_id: int, interleaved_rope: bool) -> None:
        super().__init__()
        self.heads, self.head_dim, self.rope_dim, self.topk = heads, head_dim, rope_dim, topk
        self.layer_id, self.interleaved_rope = layer_id, interleaved_rope
        self.wq_b = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, heads, bias=False)  # float32, as transformers keeps it
        self.scale = head_dim ** -0.5
        self.backend: Any = None

    def _rope(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        rot = (apply_rope_interleaved if self.interleaved_rope else apply_rope)(rot, rope.cos, rope.sin)
        return torch.cat([rot, rest], dim=-1)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, rope: Rope, meta: Any) -> torch.Tensor:
        n = x.shape[0]
        q = self._rope(self.wq_b(q_resid).view(n, self.heads, self.head_dim), rope)  # [n, H, D]
        k = self._rope(self.k_norm(self.wk(x))[:, None, :], rope)[:, 0]  # [n, D]
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.heads ** -0.5  # [n, H]
        return self.backend.indexer_topk(q, weights, k, self.layer_id, meta, self.topk, self.scale)


class MLAttention(nn.Module):
    """``forward(x [n, hidden], rope, meta, reuse) -> (out [n, hidden], topk [n, index_topk] or None)``.

    ``shared_topk``: GLM-MoE-DSA's "shared" layers have no indexer and attend the selection of the previous layer
    that has one (passed in as ``prev_topk``)."""

    def __init__(self, hidden: int, heads: int, q_lora_rank: int, kv_lora_rank: int, nope_dim: int, rope_dim: int,
                 v_dim: int, softmax_scale: float, index_heads: int, index_dim: int, index_topk: int,
                 layer_id: int, has_indexer: bool = True, indexer_interleaved_rope: bool = False,
                 eps: float = 1e-6) -> None:
        super().__init__()
        self.heads, self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim = (heads, kv_lora_rank, nope_dim,
                                                                                   rope_dim, v_dim)
        self.layer_id, self.scale = layer_id, softmax_scale
        self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
        self.q_b_proj = nn.Linear(q_lora_rank, heads * (nope_dim + rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, heads * (nope_dim + v_dim), bias=False)
        self.o_proj = nn.Linear(heads * v_dim, hidden, bias=False)
        self.indexer = Indexer(hidden, q_lora_rank, index_heads, index_dim, rope_dim, index_topk, layer_id,
                               indexer_interleaved_rope) if has_indexer else None
        self.backend: Any = None

    def forward(self, x: torch.Tensor, rope: Rope, meta: Any, prev_topk: Optional[torch.Tensor] = None,
                reuse: Optional[IndexReuse] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        n, h = x.shape[0], self.heads
        q_resid = self.q_a_layernorm(self.q_a_proj(x))  # [n, q_lora_rank]
        q = self.q_b_proj(q_resid).view(n, h, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c)  # [n, kv_lora_rank]
        q_rope = apply_rope_interleaved(q_rope, rope.cos, rope.sin)  # [n, h, rope_dim]
        k_rope = apply_rope_interleaved(k_rope[:, None, :], rope.cos, rope.sin)[:, 0]  # [n, rope_dim]
        w = self.kv_b_proj.weight.view(h, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w.split([self.nope_dim, self.v_dim], dim=1)  # [h, nope, rank], [h, v, rank]
        q_lat = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)  # [n, h, rank]
        if self.indexer is None:
            topk = prev_topk
        elif reuse is not None and reuse.mode == "reuse":
            topk = reuse.buffer[:n]
        else:
            topk = self.indexer(x, q_resid, rope, meta)  # [n, index_topk]
            if reuse is not None and reuse.mode == "store":
                reuse.buffer[:n].copy_(topk)
        # NOTE: a reusing step does not cache its index key either: nothing reads it before the draft extend after
        # verification rewrites those positions
        latent = torch.cat([c, k_rope], dim=-1)  # [n, rank + rope_dim]: this token's cache entry
        out = self.backend.forward_mla(torch.cat([q_lat, q_rope], dim=-1), latent, topk, self.layer_id, meta,
                                       self.scale, self.kv_lora_rank)  # [n, h, rank]
        out = torch.einsum("nhr,hvr->nhv", out, w_uv).reshape(n, h * self.v_dim)
        return self.o_proj(out), topk
