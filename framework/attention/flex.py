"""``attention=flex``: torch FlexAttention over K/V read from the paged pool through ``req_to_token``.

Each request's keys are gathered through its ``req_to_token`` row (``[bs, kv_width]`` slots, ``kv_width`` a
power-of-two bucket as in sdpa) and attended with ``flex_attention`` under a block-sparse mask: key tiles past a
request's length (or past the causal diagonal) are skipped, tiles that every query row sees are "full" (no mask
evaluation), and the ``mask_mod`` decides the rest: causal over the new tokens with the prefix visible, or
``batch.custom_mask`` over the last ``mask_width`` keys (tree / draft masks). The tile lists are computed in
``init_metadata`` from ``seq_lens`` (static shapes per (mode, padded_bs, q_len, kv bucket)); the BlockMask and its
``mask_mod`` are built inside ``forward`` so that they trace into compiled graphs.

NOTE: outside compiled graphs (EXTEND, compile=eager) the attention call is compiled on its own on CUDA (dynamic
shapes, one compile per shape family). On the CPU it runs flex's unfused eager path instead (the score matrix is
materialised, as sdpa does): inductor's CPU flex template miscompiles a second dynamic-shape compile in one process
(torch 2.13: C++ "cur_kvSplitSize9 was not declared"). Inside the runner's compiled CPU graph it is fused.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from framework.attention import ATTENTION_BACKENDS
from framework.attention.base import AttentionBackend
from framework.attention.sdpa import padded_layout
from framework.batch import ForwardBatch

Q_BLOCK = 128  # query rows per block-mask tile
KV_BLOCK = 128  # keys per block-mask tile (flex's default sparse block size: every kernel config divides it)
# torch >= 2.7 can skip the transposed (backward-only) tile lists
_NO_Q_BLOCKS = ({"compute_q_blocks": False}
                if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters else {})


@dataclass
class FlexMetadata:
    out_cache_loc: torch.Tensor  # [num_tokens] slots that receive the new K/V
    kv_slots: torch.Tensor  # [bs, kv_width] slot of every key position (req_to_token rows)
    seq_lens: torch.Tensor  # [bs] keys after this forward
    q_lens: torch.Tensor  # [bs] new tokens of each request
    q_len: int  # query rows per request (uniform: tokens per request; EXTEND: the longest request)
    kv_num_blocks: torch.Tensor  # [bs, 1, q_blocks] int32: partial key tiles of each query tile
    kv_indices: torch.Tensor  # [bs, 1, q_blocks, kv_blocks] int32
    full_kv_num_blocks: torch.Tensor  # [bs, 1, q_blocks] int32: key tiles every row of the query tile sees
    full_kv_indices: torch.Tensor  # [bs, 1, q_blocks, kv_blocks] int32
    custom_mask: Optional[torch.Tensor] = None  # [bs, q_len, mask_width] bool over each request's last keys
    token_index: Optional[torch.Tensor] = None  # EXTEND: [bs, q_len] flat token of each (b, t)
    flat_index: Optional[torch.Tensor] = None  # EXTEND: [num_tokens] position of each token in [bs * q_len]


def block_tiles(seq_lens: torch.Tensor, q_lens: torch.Tensor, q_len: int, kv_width: int,
                mask_width: Optional[int]) -> tuple[torch.Tensor, ...]:
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) of the block mask, int32.

    Per query tile, keys ``[0, lo)`` are visible to every row (full tiles) and keys ``[lo, hi)`` to some rows
    (partial tiles, decided by the mask_mod). Causal: row t of request b sees keys ``<= seq_len - q_len_b + t``
    (padding rows of EXTEND see every key). Custom mask: keys before the masked region are visible to all rows.
    """
    device = seq_lens.device
    q_blocks, kv_blocks = -(-q_len // Q_BLOCK), -(-kv_width // KV_BLOCK)
    first_row = torch.arange(q_blocks, device=device) * Q_BLOCK  # [q_blocks]
    seq = seq_lens[:, None]  # [bs, 1]
    if mask_width is None:
        prefix = (seq_lens - q_lens)[:, None]
        last_row = (first_row + Q_BLOCK).clamp(max=q_len) - 1
        lo = torch.minimum(prefix + first_row + 1, seq)  # [bs, q_blocks]
        hi = torch.minimum(prefix + last_row + 1, seq)
    else:
        lo = (seq - mask_width).clamp(min=0).expand(-1, q_blocks)
        hi = seq.expand(-1, q_blocks)
    full = lo // KV_BLOCK  # [bs, q_blocks]
    partial = (hi + KV_BLOCK - 1) // KV_BLOCK - full
    cols = torch.arange(kv_blocks, device=device)
    kv_indices = (full[..., None] + cols).clamp(max=kv_blocks - 1)  # [bs, q_blocks, kv_blocks]
    full_indices = cols.expand(seq_lens.shape[0], q_blocks, kv_blocks)
    return tuple(x[:, None].to(torch.int32).contiguous() for x in (partial, kv_indices, full, full_indices))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor,
           custom_mask: Optional[torch.Tensor], kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor,
           full_kv_num_blocks: torch.Tensor, full_kv_indices: torch.Tensor, scale: float) -> torch.Tensor:
    """q ``[bs, heads, q_len, dim]``, k/v ``[bs, kv_heads, kv_width, dim]`` -> ``[bs, heads, q_len, dim]``."""
    # NOTE: the mask_mods read only graph inputs: a captured intermediate (say seq_lens - q_lens) leaves inductor's
    # CPU flex template with no valid choice under dynamic shapes
    if custom_mask is None:

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return (kv_idx <= seq_lens[b] - q_lens[b] + q_idx) & (kv_idx < seq_lens[b])
    else:
        width = custom_mask.shape[2]

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            rel = kv_idx - (seq_lens[b] - width)  # position in the masked region (the last `width` keys)
            inside = custom_mask[b, q_idx, rel.clamp(0, width - 1)]
            return (kv_idx < seq_lens[b]) & ((rel < 0) | inside)

    block_mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                                          BLOCK_SIZE=(Q_BLOCK, KV_BLOCK), mask_mod=mask_mod,
                                          seq_lengths=(q.shape[2], k.shape[2]), **_NO_Q_BLOCKS)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


_compiled_attend: Optional[Callable[..., Any]] = None


def attend_compiled(*args: Any) -> torch.Tensor:
    """:func:`attend` inlined into an enclosing compiled graph; called eagerly: compiled on its own on CUDA, flex's
    unfused eager path on the CPU (see the module note)."""
    global _compiled_attend
    if torch.compiler.is_compiling():
        return attend(*args)
    from framework.compile_guards import guarded_if_skipping  # flex compiles internally: never without guards

    with guarded_if_skipping():
        if not args[0].is_cuda:
            with warnings.catch_warnings():  # the unfused CPU path is deliberate; flex would warn about it
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                return attend(*args)
        if _compiled_attend is None:
            _compiled_attend = torch.compile(attend, fullgraph=True, dynamic=True)
        return _compiled_attend(*args)


@ATTENTION_BACKENDS.register("flex")
class FlexBackend(AttentionBackend):
    """FlexAttention with block-sparse masks; works wherever torch.compile does (CPU and CUDA)."""

    name = "flex"

    def init_metadata(self, batch: ForwardBatch) -> FlexMetadata:
        lay = padded_layout(batch, self.allocator.max_context, self.allocator.req_to_token)
        mask = batch.custom_mask
        tiles = block_tiles(batch.seq_lens, lay.q_lens, lay.q_len, lay.width, None if mask is None else mask.shape[2])
        return FlexMetadata(batch.out_cache_loc, lay.kv_slots, batch.seq_lens, lay.q_lens, lay.q_len, *tiles, mask,
                            lay.token_index, lay.flat_index)

    def dynamic_dims(self, meta: FlexMetadata) -> list[tuple[torch.Tensor, int]]:
        dims = [(meta.out_cache_loc, 0), (meta.kv_slots, 0), (meta.kv_slots, 1), (meta.seq_lens, 0),
                (meta.q_lens, 0), (meta.kv_num_blocks, 0), (meta.kv_indices, 0), (meta.kv_indices, 3),
                (meta.full_kv_num_blocks, 0), (meta.full_kv_indices, 0), (meta.full_kv_indices, 3)]
        if meta.custom_mask is not None:
            dims += [(meta.custom_mask, 0), (meta.custom_mask, 2)]
        return dims

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                meta: FlexMetadata) -> torch.Tensor:
        self.pool.store(layer, meta.out_cache_loc, k, v)
        bs, q_len = meta.kv_slots.shape[0], meta.q_len
        heads, dim = self.num_heads, self.head_dim
        if meta.token_index is None:
            qb = q.view(bs, q_len, heads, dim)
        else:
            qb = q[meta.token_index]  # [bs, q_len, heads, dim]
        kb = self.pool.k[layer][meta.kv_slots].transpose(1, 2)  # [bs, kv_heads, kv_width, dim]
        vb = self.pool.v[layer][meta.kv_slots].transpose(1, 2)
        # NOTE: the scale is folded into the query so that the query is a computed 4-d buffer: inductor's CPU flex
        # template reads the sizes of the query's underlying buffer (a view of the 3-d q would fail to lower)
        qb = (qb.transpose(1, 2) * self.scale).to(kb.dtype)  # [bs, heads, q_len, dim]
        out = attend_compiled(qb, kb, vb, meta.seq_lens, meta.q_lens, meta.custom_mask,
                              meta.kv_num_blocks, meta.kv_indices, meta.full_kv_num_blocks, meta.full_kv_indices,
                              1.0)  # [bs, heads, q_len, dim]
        out = out.transpose(1, 2).reshape(bs * q_len, heads * dim).to(q.dtype)
        if meta.flat_index is not None:
            out = out[meta.flat_index]
        return out
