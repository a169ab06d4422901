"""Stage 2 of split-K attention (tfs_kernels/split_kv_attention.py): merge each (token, head)'s partial outputs, one
per split of the request's keys, weighted by their log-sum-exps (base 2). The split count is
:func:`num_kv_splits` of the request's length, as in stage 1; the partial buffers hold ``max_splits`` slots per
(token, head), and the slots of splits a request did not use hold stale values that must not reach the output.

With ``FUSED_MERGE`` the partial kernel merges instead (:func:`merge_if_last`): the last split of each (request, row
block, KV head) to finish merges them all, so a layer's attention is one kernel; a request with one split writes
its output directly.
"""

from __future__ import annotations

from typing import Optional

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


@triton.jit
def merge_if_last(Mid_o, Mid_lse, Counters, split, n_splits, token, head, row_ok, d, d_ok, out_ptr,
                   stride_ot, stride_oh, stride_os, stride_lt, stride_lh, BLOCK_M: tl.constexpr,
                   BLOCK_D: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """The split merge in the partial kernel (``FUSED_MERGE``): every split of a (request, row block, KV head)
    counts its arrival on ``Counters`` after storing its partial; the last to arrive merges them all (as
    ``split_kv_merge_kernel`` does, online over the splits) and sets the counter back to 0 for the next launch. The
    barrier orders the program's partial stores before the release of the count; the merge's loads bypass L1 (another
    SM wrote them)."""
    group = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)  # (request, row block) x KV head
    tl.debug_barrier()
    if split < n_splits:
        arrived = tl.atomic_add(Counters + group, 1, sem="acq_rel")
        if arrived == n_splits - 1:
            tl.store(Counters + group, 0)
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            den = tl.zeros([BLOCK_M], tl.float32)
            num = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for s in range(0, n_splits):
                lse = tl.load(Mid_lse + token * stride_lt + head * stride_lh + s, mask=row_ok, other=float("-inf"),
                              cache_modifier=".cg")  # [BLOCK_M]
                o = tl.load(Mid_o + token[:, None] * stride_ot + head[:, None] * stride_oh + s * stride_os
                            + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0,
                            cache_modifier=".cg").to(tl.float32)  # [BLOCK_M, BLOCK_D]
                m_new = tl.maximum(m, lse)
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m - m_ref)
                w = tl.exp2(lse - m_ref)
                num = num * alpha[:, None] + o * w[:, None]
                den = den * alpha + w
                m = m_new
            tl.store(out_ptr, (num / tl.maximum(den, 1e-30)[:, None]).to(OUT_DTYPE),
                     mask=row_ok[:, None] & d_ok[None, :])


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


# The split merge inside the partial kernel (the last split of a (request, row block, KV head) merges, counted on a
# persistent int32 buffer that the kernel sets back to zero): one kernel a layer less. Needs the counters reserved
# ahead of any CUDA-graph capture (reserve_merge_counters), and an eager launch (the opaque PDL ops, or outside
# torch.compile): a traced triton_op would see the buffer as a constant. Off until timed on a GPU.
FUSED_MERGE = False
_COUNTERS: dict[str, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # smaller buffers replaced by larger ones: graphs captured earlier still use them


def _device_key(device: torch.device) -> str:
    """One key for a device however it is named: the engine's ``cuda`` and a tensor's ``cuda:0`` are one GPU."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def reserve_merge_counters(device: torch.device, size: int) -> None:
    """Allocate (zeroed) the fused merge's counters for up to ``size`` (request, row block, KV head) groups on
    ``device``; call before capturing graphs (an allocation during a capture would come from the graph's pool).
    Launches on one device share the buffer: they run one after another on the stream, and each leaves it zeroed."""
    key = _device_key(device)
    if key not in _COUNTERS or _COUNTERS[key].numel() < size:
        if key in _COUNTERS:
            _RETIRED.append(_COUNTERS[key])
        _COUNTERS[key] = torch.zeros(size, dtype=torch.int32, device=device)


def merge_counters(device: torch.device, groups: int) -> Optional[torch.Tensor]:
    """The reserved counters if the fused merge applies to a launch of ``groups`` groups, else None."""
    buf = _COUNTERS.get(_device_key(device))
    if not FUSED_MERGE or buf is None or torch.compiler.is_compiling():
        return None
    return buf if buf.numel() >= groups else None
