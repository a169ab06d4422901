"""The top-k selection of ``tfs::indexer_topk``: an exact radix select over float32 scores, no sort, on the GPU.

Each score maps to a 32-bit key that orders descending (:func:`_ikey`: the best score has the smallest key); the
``k``-th smallest key ``T`` is found 11 + 11 + 10 bits at a time from three histograms per row (``hist``
``[n, 5120]`` int32, zeroed by the caller). The score kernel (:mod:`tfs_kernels.indexer_topk`) fills the first
histogram as it writes the scores; then, every kernel a grid of ``(row, chunk of CHUNK positions)`` programs over the
row's visible positions only:

1. ``_refine_kernel`` (twice): the next level's histogram, over the keys that share the bits resolved so far;
2. ``_count_kernel``: per chunk, how many keys are ``< T`` and ``== T``;
3. ``_write_kernel``: each chunk writes its selected positions at the offset its earlier chunks' counts give, in
   position order: the output is ascending, every key ``< T`` is selected, and of the keys ``== T`` (exact ties at
   the cut) the lowest positions fill the remaining places (the tie rule the reference follows).

Rows that see at most ``topk`` keys select all of them (``0 .. vis - 1``, then ``-1``) and skip every other step.
Static grids and shapes, no host sync: the op runs inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

BINS1, BINS2, BINS3 = tl.constexpr(2048), tl.constexpr(2048), tl.constexpr(1024)  # key bits [31:21], [20:10], [9:0]
HIST_WIDTH = 2048 + 2048 + 1024  # int32 per row
# positions per program of the selection kernels, and their warps: on CUDA (not yet timed), in the interpreter
# (small, so that the tests' rows span several chunks)
CUDA_CHUNK, INTERPRET_CHUNK = (2048, 4), (16, 1)


@triton.jit
def _ikey(score):
    """float32 -> uint32 key, ascending as the score descends (-0.0 counts as 0.0)."""
    bits = (score + 0.0).to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _pick(hist_row, BINS: tl.constexpr, need):
    """The bin holding the ``need``-th smallest key of a histogram, and how many of that bin's keys are needed."""
    b = tl.arange(0, BINS)
    h = tl.load(hist_row + b)
    below = tl.cumsum(h, 0) - h  # [BINS] keys in earlier bins
    in_range = (below < need) & (below + h >= need)  # exactly one bin when 1 <= need <= total
    bin = tl.sum(tl.where(in_range, b, 0), 0)
    return bin, need - tl.sum(tl.where(in_range, below, 0), 0)


@triton.jit
def _threshold(hist_row, topk, LEVELS: tl.constexpr):
    """The top bits of the threshold key ``T`` that ``LEVELS`` histograms resolve, and how many keys sharing them
    the selection still needs (``LEVELS == 3``: the keys equal to ``T`` to take)."""
    b1, need = _pick(hist_row, BINS1, topk)
    prefix = b1.to(tl.uint32)
    if LEVELS >= 2:
        b2, need = _pick(hist_row + BINS1, BINS2, need)
        prefix = (prefix << 11) | b2.to(tl.uint32)
    if LEVELS >= 3:
        b3, need = _pick(hist_row + BINS1 + BINS2, BINS3, need)
        prefix = (prefix << 10) | b3.to(tl.uint32)
    return prefix, need


@triton.jit
def _chunk_keys(Scores, Vis_lens, t, c, stride_st, CHUNK: tl.constexpr):
    """The keys of chunk ``c`` of row ``t`` (masked past its visible positions)."""
    j = c * CHUNK + tl.arange(0, CHUNK)
    ok = j < tl.load(Vis_lens + t)
    score = tl.load(Scores + t * stride_st + j, mask=ok, other=0.0)
    return j, ok, _ikey(score)


@triton.jit
def _refine_kernel(Scores, Vis_lens, Hist, topk, stride_st, stride_ht, LEVEL: tl.constexpr, CHUNK: tl.constexpr):
    # grid: (n, chunks); LEVEL 2 or 3: the histogram of key bits [20:10] (or [9:0]) of the keys sharing T's top bits
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    vis = tl.load(Vis_lens + t)
    if (vis <= topk) | (c * CHUNK >= vis):
        return
    prefix, _ = _threshold(Hist + t * stride_ht, topk, LEVEL - 1)
    j, ok, key = _chunk_keys(Scores, Vis_lens, t, c, stride_st, CHUNK)
    if LEVEL == 2:
        match = ok & ((key >> 21) == prefix)
        bin = BINS1 + ((key >> 10) & 0x7FF).to(tl.int32)
    else:
        match = ok & ((key >> 10) == prefix)
        bin = BINS1 + BINS2 + (key & 0x3FF).to(tl.int32)
    tl.atomic_add(Hist + t * stride_ht + bin, tl.full([CHUNK], 1, tl.int32), mask=match, sem="relaxed")


@triton.jit
def _count_kernel(Scores, Vis_lens, Hist, Counts, topk, stride_st, stride_ht, stride_ct, CHUNK: tl.constexpr):
    # grid: (n, chunks); Counts[t, 2 c] = keys < T in chunk c, Counts[t, 2 c + 1] = keys == T
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    vis = tl.load(Vis_lens + t)
    if (vis <= topk) | (c * CHUNK >= vis):
        return
    thr, _ = _threshold(Hist + t * stride_ht, topk, 3)
    j, ok, key = _chunk_keys(Scores, Vis_lens, t, c, stride_st, CHUNK)
    tl.store(Counts + t * stride_ct + 2 * c, tl.sum((ok & (key < thr)).to(tl.int32), 0))
    tl.store(Counts + t * stride_ct + 2 * c + 1, tl.sum((ok & (key == thr)).to(tl.int32), 0))


@triton.jit
def _write_kernel(Scores, Vis_lens, Hist, Counts, Out, topk, stride_st, stride_ht, stride_ct, stride_ot,
                  CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    # grid: (n, max(chunks, cdiv(topk, CHUNK))); chunk c writes its selected positions, ascending
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    vis = tl.load(Vis_lens + t)
    if vis <= topk:  # every visible key, then -1: output columns [c * CHUNK, (c + 1) * CHUNK)
        col = c * CHUNK + tl.arange(0, CHUNK)
        tl.store(Out + t * stride_ot + col, tl.where(col < vis, col, -1).to(tl.int64), mask=col < topk)
        return
    if c * CHUNK >= vis:
        return
    thr, need_eq = _threshold(Hist + t * stride_ht, topk, 3)
    # the earlier chunks: selected count (all their keys < T, their share of the keys == T) and keys == T
    prev = tl.arange(0, BLOCK_C)
    prev_ok = prev < c
    lt = tl.load(Counts + t * stride_ct + 2 * prev, mask=prev_ok, other=0)
    eq = tl.load(Counts + t * stride_ct + 2 * prev + 1, mask=prev_ok, other=0)
    eq_before = tl.cumsum(eq, 0) - eq
    taken = tl.minimum(tl.maximum(need_eq - eq_before, 0), eq)
    offset = tl.sum(lt + taken, 0)
    eq_prev = tl.sum(eq, 0)
    j, ok, key = _chunk_keys(Scores, Vis_lens, t, c, stride_st, CHUNK)
    tie = ok & (key == thr)
    tie_rank = eq_prev + tl.cumsum(tie.to(tl.int32), 0) - tie.to(tl.int32)
    sel = (ok & (key < thr)) | (tie & (tie_rank < need_eq))
    slot = offset + tl.cumsum(sel.to(tl.int32), 0) - sel.to(tl.int32)
    tl.store(Out + t * stride_ot + slot, j.to(tl.int64), mask=sel)


def launch_select(scores: torch.Tensor, vis_lens: torch.Tensor, hist: torch.Tensor, topk: int) -> torch.Tensor:
    """scores ``[n, width]`` float32 (valid below ``vis_lens``), ``hist`` ``[n, HIST_WIDTH]`` int32 with the first
    level filled -> ``[n, topk]`` int64 positions, ascending, then ``-1`` (inside a triton_op body)."""
    n, width = scores.shape
    chunk, num_warps = CUDA_CHUNK if scores.is_cuda else INTERPRET_CHUNK
    chunks = triton.cdiv(width, chunk)
    counts = torch.empty(n, 2 * chunks, dtype=torch.int32, device=scores.device)
    out = torch.empty(n, topk, dtype=torch.int64, device=scores.device)
    for level in (2, 3):
        wrap_triton(_refine_kernel)[(n, chunks)](scores, vis_lens, hist, topk, scores.stride(0), hist.stride(0),
                                                 LEVEL=level, CHUNK=chunk, num_warps=num_warps)
    wrap_triton(_count_kernel)[(n, chunks)](scores, vis_lens, hist, counts, topk, scores.stride(0), hist.stride(0),
                                            counts.stride(0), CHUNK=chunk, num_warps=num_warps)
    wrap_triton(_write_kernel)[(n, max(chunks, triton.cdiv(topk, chunk)))](
        scores, vis_lens, hist, counts, out, topk, scores.stride(0), hist.stride(0), counts.stride(0),
        out.stride(0), CHUNK=chunk, BLOCK_C=max(16, triton.next_power_of_2(chunks)), num_warps=num_warps)
    return out
