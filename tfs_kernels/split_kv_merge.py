"""Stage 2 of split-K attention (tfs_kernels/split_kv_attention.py): merge each (token, head)'s partial outputs, one
per split of the request's keys, weighted by their log-sum-exps (base 2). The split count is
:func:`num_kv_splits` of the request's length, as in stage 1; the partial buffers hold ``max_splits`` slots per
(token, head), and the slots of splits a request did not use hold stale values that must not reach the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from tfs_kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def num_kv_splits(seq_len, programs_per_split, max_splits, target_programs, min_split_len):
    """Splits for one request: enough programs to fill the device, none shorter than ``min_split_len`` keys. Both
    stages derive it on the device from the request's length, so the host never reads it back."""
    by_length = tl.cdiv(seq_len, min_split_len)
    by_occupancy = tl.cdiv(target_programs, programs_per_split)
    return tl.maximum(tl.minimum(tl.minimum(by_length, by_occupancy), max_splits), 1)


@triton.jit
def split_kv_merge_kernel(
    Mid_o, Mid_lse, Out, Seq_lens,
    programs_per_split, max_splits, target_programs, min_split_len,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_outt, stride_outh,
    Q_LEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr, EARLY_TRIGGER: tl.constexpr,
):
    # grid: (num_tokens, heads)
    token = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    # every split's slot is loaded at once with the request's length (one memory round trip, not two);
    # the slots of splits this request did not use hold stale values and are dropped by the where's below (reading
    # only the used splits, a few at a time and merged online, took 3.8 us in the 8B step instead of 2.3, and a
    # 16-slot tile for requests of <= 16 splits 2.55: docs/PERFORMANCE.md, 8B decode step)
    in_buf = s < max_splits
    seq_len = tl.load(Seq_lens + token // Q_LEN)
    if USE_PDL:  # launched early (tfs_kernels/pdl.py): the partials come from the kernel before
        if EARLY_TRIGGER:  # the next kernel (o_proj) may launch before this one waits: see MERGE_EARLY_TRIGGER
            gdc_launch_dependents()
        gdc_wait()
        if not EARLY_TRIGGER:
            gdc_launch_dependents()
    lse_row = Mid_lse + token * stride_lt + head * stride_lh
    o_row = Mid_o + token * stride_ot + head * stride_oh
    lse = tl.load(lse_row + s, mask=in_buf, other=float("-inf"))
    o = tl.load(o_row + s[:, None] * stride_os + d[None, :], mask=in_buf[:, None] & d_ok[None, :],
                other=0.0).to(tl.float32)
    # the split count after the partials' loads are issued: computed before them, it made the plain (non-PDL)
    # launch wait for the length's round trip before loading (verify 1 x 4k 11.7 us instead of 10.9)
    s_ok = s < num_kv_splits(seq_len, programs_per_split, max_splits, target_programs, min_split_len)
    lse = tl.where(s_ok, lse, float("-inf"))
    o = tl.where(s_ok[:, None], o, 0.0)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # [BLOCK_S]
    out = tl.sum(w[:, None] * o, 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(Out + token * stride_outt + head * stride_outh + d, out.to(Out.dtype.element_ty), mask=d_ok)


REDUCE_NUM_WARPS = 2  # the merge kernel's (docs/PERFORMANCE.md, GPU attention kernels)
# PDL, one query token (batch-1 decode, where o_proj takes a one-row launch that preloads its weights): the merge
# lets the next kernel launch before its own wait, so that o_proj's programs are resident, and load their first
# weight chunk (tfs_kernels/gemv.py PDL_PRELOAD), while the partial kernel runs: 8B decode step 3.87 ms instead of 3.95
# (docs/PERFORMANCE.md, 8B decode step). Not measured at larger batches or for verify, hence off there. Sound
# by tfs_kernels/pdl.py's rules: the next kernel then starts after every program of the partial kernel has started
# (so after the kernel before the partial completed), reads before its wait nothing the partial writes, and its
# wait returns after the merge completes, which is after the partial completes.
MERGE_EARLY_TRIGGER = True


def launch_split_kv_merge(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, seq_lens: torch.Tensor,
                          q_len: int, programs_per_split: int, max_splits: int, target_programs: int,
                          min_split_len: int, pdl: bool) -> None:
    """Merge ``mid_o`` ``[n, heads, max_splits, dim]`` (their log-sum-exps ``mid_lse`` ``[n, heads, max_splits]``)
    into ``out`` ``[n, heads, dim]`` (inside a triton_op body: the kernel goes through ``wrap_triton``); the split
    policy arguments are stage 1's. ``pdl``: programmatic dependent launch (tfs_kernels/pdl.py)."""
    n, heads, dim = out.shape
    wrap_triton(split_kv_merge_kernel)[(n, heads)](
        mid_o, mid_lse, out, seq_lens, programs_per_split, max_splits, target_programs, min_split_len,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        Q_LEN=q_len, HEAD_DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_S=max(2, triton.next_power_of_2(max_splits)), USE_PDL=pdl,
        EARLY_TRIGGER=pdl and MERGE_EARLY_TRIGGER and n == 1, num_warps=REDUCE_NUM_WARPS,
        **({"launch_pdl": True} if pdl else {}),
    )
