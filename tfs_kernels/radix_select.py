"""The top-k selection of ``tfs::indexer_topk``: an exact radix select over float32 scores, no sort, on the GPU.

Each score maps to a 32-bit key that orders descending (:func:`_ikey`: the best score has the smallest key); the
``k``-th smallest key ``T`` is found 11 + 11 + 10 bits at a time from three histograms per row (``hist``
in ``state``, a zeroed int64 ``[n, state_width(width)]`` per call: the histograms as int32, then per chunk
its published counts, then the row's chunk ticket). The score kernel (:mod:`tfs_kernels.indexer_topk`) fills the first
histogram as it writes the scores; then, each kernel a grid of ``(row, chunk of CHUNK positions)`` programs over the
row's visible positions only:

1. ``_refine_kernel`` (twice): the next level's histogram, over the keys that share the bits resolved so far;
2. ``_write_kernel``: each chunk counts its keys ``< T`` and ``== T`` and publishes the counts, adds up those of
   the row's earlier chunks (waiting for any not yet published: chunk indices are handed out in start order, so
   every earlier chunk's program is already running), and writes its selected positions at that offset, in position
   order: the output is ascending, every key ``< T`` is selected, and of the keys ``== T`` (exact ties at the cut)
   the lowest positions fill the remaining places (the tie rule the reference follows).

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
HIST_WORDS = HIST_WIDTH // 2  # int64 words of state the histograms take
_HIST_WORDS = tl.constexpr(HIST_WORDS)  # the same, for the kernels
# positions per program of the selection kernels, and their warps: on CUDA (not yet timed), in the interpreter
# (small, so that the tests' rows span several chunks)
CUDA_CHUNK, INTERPRET_CHUNK = (2048, 4), (16, 1)


@triton.jit
def _ikey(score):
    """float32 -> uint32 key, ascending as the score descends (-0.0 counts as 0.0)."""
    bits = (score + 0.0).to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _hist_row(State, t, stride_s):
    """Row ``t``'s histograms: int32 ``[HIST_WIDTH]`` at the start of its state."""
    return State.to(tl.pointer_type(tl.int32)) + t * stride_s * 2


@triton.jit
def _pick(h, BINS: tl.constexpr, need):
    """The bin of histogram ``h`` ``[BINS]`` holding the ``need``-th smallest key, and how many of that bin's keys
    are needed."""
    b = tl.arange(0, BINS)
    below = tl.cumsum(h, 0) - h  # [BINS] keys in earlier bins
    in_range = (below < need) & (below + h >= need)  # exactly one bin when 1 <= need <= total
    bin = tl.sum(tl.where(in_range, b, 0), 0)
    return bin, need - tl.sum(tl.where(in_range, below, 0), 0)


@triton.jit
def _load_hists(hist_row):
    """The row's three histogram levels (issued together, ahead of their use)."""
    h1 = tl.load(hist_row + tl.arange(0, BINS1))
    h2 = tl.load(hist_row + BINS1 + tl.arange(0, BINS2))
    h3 = tl.load(hist_row + BINS1 + BINS2 + tl.arange(0, BINS3))
    return h1, h2, h3


@triton.jit
def _threshold(h1, h2, h3, topk, LEVELS: tl.constexpr):
    """The top bits of the threshold key ``T`` that ``LEVELS`` histogram levels resolve, and how many keys sharing
    them the selection still needs (``LEVELS == 3``: the keys equal to ``T`` to take)."""
    b1, need = _pick(h1, BINS1, topk)
    prefix = b1.to(tl.uint32)
    if LEVELS >= 2:
        b2, need = _pick(h2, BINS2, need)
        prefix = (prefix << 11) | b2.to(tl.uint32)
    if LEVELS >= 3:
        b3, need = _pick(h3, BINS3, need)
        prefix = (prefix << 10) | b3.to(tl.uint32)
    return prefix, need


@triton.jit
def _chunk_keys(Scores, t, c, vis, stride_st, CHUNK: tl.constexpr):
    """The positions and keys of chunk ``c`` of row ``t`` (masked past its visible positions)."""
    j = c * CHUNK + tl.arange(0, CHUNK)
    ok = j < vis
    score = tl.load(Scores + t * stride_st + j, mask=ok, other=0.0)
    return j, ok, _ikey(score)


@triton.jit
def _refine_kernel(Scores, Vis_lens, State, topk, stride_st, stride_s, LEVEL: tl.constexpr, CHUNK: tl.constexpr):
    # grid: (n, chunks); LEVEL 2 or 3: the histogram of key bits [20:10] (or [9:0]) of the keys sharing T's top bits
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    vis = tl.load(Vis_lens + t)
    if (vis <= topk) | (c * CHUNK >= vis):
        return
    hist_row = _hist_row(State, t, stride_s)
    h1, h2, h3 = _load_hists(hist_row)
    j, ok, key = _chunk_keys(Scores, t, c, vis, stride_st, CHUNK)
    prefix, _ = _threshold(h1, h2, h3, topk, LEVEL - 1)
    if LEVEL == 2:
        match = ok & ((key >> 21) == prefix)
        bin = BINS1 + ((key >> 10) & 0x7FF).to(tl.int32)
    else:
        match = ok & ((key >> 10) == prefix)
        bin = BINS1 + BINS2 + (key & 0x3FF).to(tl.int32)
    tl.atomic_add(hist_row + bin, tl.full([CHUNK], 1, tl.int32), mask=match, sem="relaxed")


@triton.jit
def _write_kernel(Scores, Vis_lens, State, Out, topk, n_chunks, stride_st, stride_s, stride_ot,
                  CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    # grid: (n, max(chunks, cdiv(topk, CHUNK))): a row that sees more than topk keys, one program per chunk of its
    # visible positions (chunk index from the row's ticket); otherwise output columns [p * CHUNK, (p + 1) * CHUNK)
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    vis = tl.load(Vis_lens + t)
    if vis <= topk:  # every visible key, then -1
        col = p * CHUNK + tl.arange(0, CHUNK)
        tl.store(Out + t * stride_ot + col, tl.where(col < vis, col, -1).to(tl.int64), mask=col < topk)
        return
    if p * CHUNK >= vis:
        return
    published = State + t * stride_s + _HIST_WORDS  # [n_chunks] int64: (lt << 32) | (eq << 1) | 1, 0 until set
    c = tl.atomic_add(published + n_chunks, 1, sem="relaxed").to(tl.int32)  # this program's chunk: start order
    h1, h2, h3 = _load_hists(_hist_row(State, t, stride_s))
    j, ok, key = _chunk_keys(Scores, t, c, vis, stride_st, CHUNK)
    thr, need_eq = _threshold(h1, h2, h3, topk, 3)
    tie = ok & (key == thr)
    lt = (ok & (key < thr)).to(tl.int32)
    word = (tl.sum(lt, 0).to(tl.int64) << 32) | (tl.sum(tie.to(tl.int64), 0) << 1) | 1
    tl.atomic_xchg(published + c, word, sem="release")
    # the earlier chunks' counts: each was published by a program that started before this one
    prev = tl.arange(0, BLOCK_C)
    prev_ok = prev < c
    words = tl.load(published + prev, mask=prev_ok, other=1, volatile=True)
    while tl.min(words, 0) == 0:
        words = tl.load(published + prev, mask=prev_ok, other=1, volatile=True)
    lt_before = tl.sum(tl.where(prev_ok, words >> 32, 0), 0)
    eq_before = tl.sum(tl.where(prev_ok, (words >> 1) & 0x7FFFFFFF, 0), 0)
    tie_rank = eq_before + tl.cumsum(tie.to(tl.int64), 0) - tie.to(tl.int64)
    sel = (lt != 0) | (tie & (tie_rank < need_eq))
    offset = lt_before + tl.minimum(eq_before, need_eq)  # earlier chunks' selected keys
    slot = offset + tl.cumsum(sel.to(tl.int64), 0) - sel.to(tl.int64)
    tl.store(Out + t * stride_ot + slot, j.to(tl.int64), mask=sel)


def state_width(width: int, chunk: int) -> int:
    """int64 words of selection state per row: the histograms, the chunks' published counts, the chunk ticket."""
    return HIST_WORDS + triton.cdiv(width, chunk) + 1


def chunk_launch(device: torch.device) -> tuple[int, int]:
    """(positions per selection program, warps) on ``device``."""
    return CUDA_CHUNK if device.type == "cuda" else INTERPRET_CHUNK


def new_state(n: int, width: int, device: torch.device) -> torch.Tensor:
    """A zeroed selection state for ``n`` rows of ``width`` positions."""
    return torch.zeros(n, state_width(width, chunk_launch(device)[0]), dtype=torch.int64, device=device)


def hist_view(state: torch.Tensor) -> torch.Tensor:
    """The histograms of ``state`` as int32 ``[n, HIST_WIDTH]`` (a view)."""
    return state[:, :HIST_WORDS].view(torch.int32)


def launch_select(scores: torch.Tensor, vis_lens: torch.Tensor, state: torch.Tensor, topk: int) -> torch.Tensor:
    """scores ``[n, width]`` float32 (valid below ``vis_lens``), ``state`` from :func:`new_state` with the first
    histogram level filled -> ``[n, topk]`` int64 positions, ascending, then ``-1`` (inside a triton_op body)."""
    n, width = scores.shape
    chunk, num_warps = chunk_launch(scores.device)
    chunks = triton.cdiv(width, chunk)
    out = torch.empty(n, topk, dtype=torch.int64, device=scores.device)
    for level in (2, 3):
        wrap_triton(_refine_kernel)[(n, chunks)](scores, vis_lens, state, topk, scores.stride(0), state.stride(0),
                                                 LEVEL=level, CHUNK=chunk, num_warps=num_warps)
    wrap_triton(_write_kernel)[(n, max(chunks, triton.cdiv(topk, chunk)))](
        scores, vis_lens, state, out, topk, chunks, scores.stride(0), state.stride(0), out.stride(0), CHUNK=chunk,
        BLOCK_C=max(16, triton.next_power_of_2(chunks)), num_warps=num_warps)
    return out
