"""Stage 2 of split-K attention (:mod:`kernels.split_kv_attention`): merge each query row's per-split partial
outputs by their log-sum-exps.

Two ways to run it:
- a kernel of its own (``_split_kv_reduce_kernel``, one program per (token, head)), after the partial kernel;
- inside the partial kernel (decode, ``merge counters`` given): every program of a (request, KV head) counts its
  arrival on a counter after it stored its partial, and the last one to arrive merges the KV head's query rows and
  sets the counter back to 0. One kernel per call instead of two; the counters are left as they were found (all
  zero), so a caller allocates them once.

Both use :func:`merge_partials`. The split count of a request is decided on the device by :func:`num_kv_splits`
(shared with the partial kernel, so that both agree).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.pdl import gdc_launch_dependents, gdc_wait

# float32 elements of partial outputs one merging program holds at a time (rows x splits x head_dim): 64 registers
# per thread at 4 warps; more splits are merged in several passes
MERGE_TILE = 8192


@triton.jit
def num_kv_splits(seq_len, programs_per_split, max_splits, target_programs, min_split_len):
    """Splits for one request: enough programs to fill the device, none shorter than ``min_split_len`` keys."""
    by_length = tl.cdiv(seq_len, min_split_len)
    by_occupancy = tl.cdiv(target_programs, programs_per_split)
    return tl.maximum(tl.minimum(tl.minimum(by_length, by_occupancy), max_splits), 1)


@triton.jit
def merge_partials(Mid_o, Mid_lse, Out, token, head, row_ok, n_splits, bound,
                   stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_outt, stride_outh,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Out[token, head] = the merge of splits ``[0, n_splits)`` for the rows ``token``, ``head`` ``[R]``.

    Loads cover splits ``< bound`` (``bound >= n_splits``; a bound known before ``n_splits`` lets the first pass's
    loads start before the request's length arrives); slots of splits the request did not use may hold stale values
    and are dropped. ``BLOCK_S`` splits per pass, combined online (one pass when ``BLOCK_S >= bound``). The partial
    buffers are read through L2 (``.cg``): other programs of this launch may have written them.
    """
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse_rows = Mid_lse + token * stride_lt + head * stride_lh  # [R] pointers
    o_rows = Mid_o + token * stride_ot + head * stride_oh
    m = tl.full(head.shape, float("-inf"), tl.float32)  # [R] running max (base 2)
    w_sum = tl.zeros(head.shape, tl.float32)
    acc = tl.zeros([head.shape[0], BLOCK_D], tl.float32)
    for s0 in range(0, bound, BLOCK_S):
        sp = s0 + s
        ok = row_ok[:, None] & (sp < bound)[None, :]  # [R, BLOCK_S]
        lse = tl.load(lse_rows[:, None] + sp[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(o_rows[:, None, None] + sp[None, :, None] * stride_os + d[None, None, :],
                    mask=ok[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg")  # [R, BLOCK_S, D]
        used = (sp < n_splits)[None, :]
        lse = tl.where(used, lse, float("-inf"))
        o = tl.where(used[:, :, None], o, 0.0)
        m_new = tl.maximum(m, tl.max(lse, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: weights 0, no NaN
        alpha = tl.exp2(m - m_safe)  # [R] rescales what was merged before
        w = tl.exp2(lse - m_safe[:, None])  # [R, BLOCK_S]
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)
        w_sum = w_sum * alpha + tl.sum(w, 1)
        m = m_new
    out = acc / tl.maximum(w_sum, 1e-30)[:, None]
    tl.store(Out + token[:, None] * stride_outt + head[:, None] * stride_outh + d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _split_kv_reduce_kernel(
    Mid_o, Mid_lse, Out, Seq_lens,
    programs_per_split, max_splits, target_programs, min_split_len,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_outt, stride_outh,
    Q_LEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # grid: (num_tokens, heads); BLOCK_S >= max_splits: every split's slot is loaded in one pass, with the
    # request's length (one memory round trip, not two)
    token = tl.program_id(0) + tl.zeros([1], tl.int32)  # [1]: one row
    head = tl.program_id(1) + tl.zeros([1], tl.int32)
    seq_len = tl.load(Seq_lens + tl.program_id(0) // Q_LEN)
    if USE_PDL:  # launched early (kernels/pdl.py): the partials come from the kernel before
        gdc_wait()
        gdc_launch_dependents()
    n_splits = num_kv_splits(seq_len, programs_per_split, max_splits, target_programs, min_split_len)
    merge_partials(Mid_o, Mid_lse, Out, token, head, head >= 0, n_splits, max_splits, stride_ot, stride_oh,
                   stride_os, stride_lt, stride_lh, stride_outt, stride_outh, HEAD_DIM, BLOCK_D, BLOCK_S)


def merge_block_s(rows: int, block_d: int, max_splits: int) -> int:
    """Splits per merge pass for ``rows`` query rows at once (see ``MERGE_TILE``)."""
    return max(1, min(triton.next_power_of_2(max_splits), MERGE_TILE // (triton.next_power_of_2(rows) * block_d)))


__all__ = ["merge_block_s", "merge_partials", "num_kv_splits"]
