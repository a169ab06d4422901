"""``tfs::indexer_topk``: the lightning indexer of DeepSeek-V3.2 sparse attention (DSA), scores and top-k.

Each query token ``t`` scores every key position ``j`` its request has cached (``j < vis_lens[t]``) with its
``H`` index heads,

    score[t, j] = sum_h weights[t, h] * relu(scale * q[t, h] . k_cache[kv_slots[req_of_token[t], j]]),

in float32, and keeps the positions (not slots) of the ``topk`` best; the sparse MLA attention
(:mod:`tfs_kernels.sparse_mla`) then reads only those. Work is bounded by each token's ``vis_lens``, not the
table's static width: a token that sees at most ``topk`` keys selects them all and scores nothing; otherwise the
score kernel (one program per token and block of key positions: the block's keys are loaded once for all heads,
which loop in blocks of ``BLOCK_H``) reads each visible key once, writes its float32 score and counts it in the
row's first radix histogram, and :mod:`tfs_kernels.radix_select` finds the exact top ``topk`` in a few passes over
the scores (no sort). Output: positions ascending, then ``-1``; exact ties at the cut go to the lower positions
(:func:`select_topk`, the reference, defines the same). Every shape is static given ``(n, H, D, width, topk)``,
with no host sync: the op runs inside CUDA graphs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from tfs_kernels.dispatch import register_cpu_reference, use_triton
from tfs_kernels.online_softmax import dot
from tfs_kernels.radix_select import _hist_row, _ikey, launch_select, new_state


@triton.jit
def _indexer_scores_kernel(
    Q, W, K_cache, Kv_slots, Req_of_token, Vis_lens, Scores, State, scale, topk,
    stride_qt, stride_qh, stride_wt, stride_ks, stride_req, stride_st, stride_s,
    HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr, SELECT: tl.constexpr,
):
    # grid: (n, cdiv(width, BLOCK_N)); program (t, nb): token t, key positions [nb * BLOCK_N, (nb + 1) * BLOCK_N).
    # Only visible positions are read and written. SELECT: a row that sees at most topk keys selects them all
    # (nothing to score), and each score's key adds to the row's first-level histogram (tfs_kernels.radix_select).
    t = tl.program_id(0).to(tl.int64)
    vis = tl.load(Vis_lens + t)
    if SELECT:
        if vis <= topk:
            return
    if tl.program_id(1) * BLOCK_N >= vis:
        return
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    scale = tl.cast(scale, tl.float32)  # inductor passes float scalars as fp64
    row = tl.load(Req_of_token + t)
    j_ok = j < vis
    slot = tl.load(Kv_slots + row * stride_req + j, mask=j_ok, other=0)  # [BLOCK_N] int64
    d = tl.arange(0, BLOCK_D)
    d_ok = d < DIM
    k = tl.load(K_cache + slot[:, None] * stride_ks + d[None, :], mask=j_ok[:, None] & d_ok[None, :],
                other=0.0)  # [BLOCK_N, BLOCK_D], read once for every head
    if UPCAST:
        k = k.to(tl.float32)
    score = tl.zeros([BLOCK_N], tl.float32)
    for h0 in tl.static_range(0, HEADS, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_ok = h < HEADS
        q = tl.load(Q + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                    other=0.0).to(k.dtype)  # [BLOCK_H, BLOCK_D]
        w = tl.load(W + t * stride_wt + h, mask=h_ok, other=0.0).to(tl.float32)  # [BLOCK_H]; 0 for padding heads
        logits = dot(q, tl.trans(k), IEEE_DOT) * scale  # [BLOCK_H, BLOCK_N] float32
        score += tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0)
    tl.store(Scores + t * stride_st + j, score, mask=j_ok)
    if SELECT:  # one atomic per distinct bin of the block (scores crowd into few first-level bins)
        bin = tl.where(j_ok, (_ikey(score) >> 21).to(tl.int32), -1)  # [BLOCK_N] first-level bins
        same = bin[:, None] == bin[None, :]  # [BLOCK_N, BLOCK_N]
        r = tl.arange(0, BLOCK_N)
        count = tl.sum(same.to(tl.int32), 1)
        first = tl.sum((same & (r[None, :] < r[:, None])).to(tl.int32), 1) == 0  # no earlier key in its bin
        tl.atomic_add(_hist_row(State, t, stride_s) + bin, count, mask=first & j_ok, sem="relaxed")


# (BLOCK_N, BLOCK_H cap, num_warps): on CUDA, 64 keys a program and all 64 DeepSeek heads in one block (ptxas,
# sm_90a, bf16: 154 registers, no spills; not yet timed on a GPU); the interpreter, small tiles
CUDA_LAUNCH = (64, 64, 4)
INTERPRET_LAUNCH = (32, 16, 1)


def check_inputs(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, kv_slots: torch.Tensor,
                 req_of_token: torch.Tensor, vis_lens: torch.Tensor, topk: int) -> None:
    """The argument checks of ``tfs::indexer_topk``; each failure is one line naming the argument."""
    n, heads, dim = q.shape
    torch._check(q.stride(-1) == 1, lambda: "tfs::indexer_topk: q needs a unit inner stride")
    torch._check(weights.shape == (n, heads) and weights.stride(-1) == 1,
                 lambda: f"tfs::indexer_topk: weights {tuple(weights.shape)} must be [{n}, {heads}], unit inner "
                         f"stride")
    torch._check(k_cache.dim() == 2 and k_cache.shape[1] == dim and k_cache.stride(-1) == 1,
                 lambda: f"tfs::indexer_topk: k_cache {tuple(k_cache.shape)} must be [slots, {dim}], unit inner "
                         f"stride")
    torch._check(kv_slots.dim() == 2 and kv_slots.stride(-1) == 1,
                 lambda: f"tfs::indexer_topk: kv_slots {tuple(kv_slots.shape)} must be [rows, width], unit inner "
                         f"stride")
    for name, x in (("req_of_token", req_of_token), ("vis_lens", vis_lens)):
        torch._check(x.shape == (n,), lambda: f"tfs::indexer_topk: {name} {tuple(x.shape)} must be [{n}]")
    torch._check(topk >= 1, lambda: f"tfs::indexer_topk: topk {topk} must be positive")


def select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores ``[n, width]`` float32 (``-inf``: invisible) -> ``[n, topk]`` int64: the positions of the ``topk``
    best visible scores of each row (all visible positions when fewer), ascending, then ``-1`` for unused
    entries. Ties at the cut (exactly equal scores) go to the lower positions, as in the kernel. Static shapes, no
    host sync."""
    n, width = scores.shape
    k = min(topk, width)
    order = scores.sort(dim=1, descending=True, stable=True)  # equal scores keep position order
    picked = torch.where(order.values[:, :k] == float("-inf"), width, order.indices[:, :k])  # unused: sort last
    picked = picked.sort(dim=1).values
    picked = torch.where(picked == width, -1, picked)
    if k < topk:
        picked = torch.cat([picked, picked.new_full((n, topk - k), -1)], dim=1)
    return picked


def launch_indexer_scores(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, kv_slots: torch.Tensor,
                          req_of_token: torch.Tensor, vis_lens: torch.Tensor, scale: float,
                          state: Optional[torch.Tensor] = None, topk: int = 0) -> torch.Tensor:
    """The score kernel (inside a triton_op body: through ``wrap_triton``) -> ``[n, width]`` float32. Without
    ``state``: every row scored, ``-inf`` past its visible keys. With ``state`` (:func:`radix_select.new_state`):
    the selection's first pass, rows that see more than ``topk`` keys only, nothing written past the visible keys."""
    n, heads, dim = q.shape
    width = kv_slots.shape[1]
    select = state is not None
    if select:
        scores = torch.empty(n, width, dtype=torch.float32, device=q.device)
    else:
        scores = torch.full((n, width), float("-inf"), dtype=torch.float32, device=q.device)
        state = scores  # unused
    block_n, max_block_h, num_warps = CUDA_LAUNCH if q.is_cuda else INTERPRET_LAUNCH
    upcast = q.dtype != k_cache.dtype or k_cache.dtype == torch.float32  # mixed dtypes: float32 products
    wrap_triton(_indexer_scores_kernel)[(n, triton.cdiv(width, block_n))](
        q, weights, k_cache, kv_slots, req_of_token, vis_lens, scores, state, scale, topk,
        q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), kv_slots.stride(0), scores.stride(0),
        state.stride(0), HEADS=heads, DIM=dim, BLOCK_H=min(max_block_h, max(16, triton.next_power_of_2(heads))),
        BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(dim)), UPCAST=upcast, IEEE_DOT=upcast, SELECT=select,
        num_warps=num_warps,
    )
    return scores


@triton_op("tfs::indexer_topk", mutates_args=())
def indexer_topk_op(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, kv_slots: torch.Tensor,
                    req_of_token: torch.Tensor, vis_lens: torch.Tensor, topk: int, scale: float) -> torch.Tensor:
    """q ``[n, H, D]``; weights ``[n, H]`` float32; k_cache ``[num_slots, D]``; kv_slots ``[rows, width]`` int64;
    req_of_token / vis_lens ``[n]`` int64 -> ``[n, topk]`` int64 key positions (``-1``: unused)."""
    check_inputs(q, weights, k_cache, kv_slots, req_of_token, vis_lens, topk)
    state = new_state(q.shape[0], kv_slots.shape[1], q.device)
    scores = launch_indexer_scores(q, weights, k_cache, kv_slots, req_of_token, vis_lens, scale, state, topk)
    return launch_select(scores, vis_lens, state, topk)


def indexer_scores_reference(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, kv_slots: torch.Tensor,
                             req_of_token: torch.Tensor, vis_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain torch (float32 math): the score matrix ``[n, width]``, ``-inf`` where ``j >= vis_lens[t]``. Slots
    past a token's visible keys are not read (they may hold anything)."""
    width = kv_slots.shape[1]
    visible = torch.arange(width, device=q.device)[None, :] < vis_lens[:, None]  # [n, width]
    slots = torch.where(visible, kv_slots[req_of_token], 0)  # [n, width]
    keys = k_cache[slots].float()  # [n, width, D]
    logits = torch.bmm(q.float(), keys.transpose(1, 2)) * scale  # [n, H, width]
    scores = (weights.float()[:, :, None] * logits.relu()).sum(1)  # [n, width]
    return scores.masked_fill(~visible, float("-inf"))


def indexer_topk_reference(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, kv_slots: torch.Tensor,
                           req_of_token: torch.Tensor, vis_lens: torch.Tensor, topk: int,
                           scale: float) -> torch.Tensor:
    """Plain torch: :func:`indexer_scores_reference`, then :func:`select_topk`."""
    return select_topk(indexer_scores_reference(q, weights, k_cache, kv_slots, req_of_token, vis_lens, scale), topk)


register_cpu_reference(indexer_topk_op, indexer_topk_reference)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, kv_slots: torch.Tensor,
                 req_of_token: torch.Tensor, vis_lens: torch.Tensor, topk: int, scale: float) -> torch.Tensor:
    """The op where Triton runs (see :mod:`tfs_kernels.dispatch`), the reference elsewhere."""
    fn = torch.ops.tfs.indexer_topk if use_triton(q) else indexer_topk_reference
    return fn(q, weights, k_cache, kv_slots, req_of_token, vis_lens, topk, scale)
