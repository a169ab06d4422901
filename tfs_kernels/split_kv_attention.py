"""Split-K (flash-decoding) attention over the paged KV pool for uniform modes: every request has ``q_len`` new
tokens (DECODE: 1; TARGET_VERIFY / DRAFT_*: the draft tokens) that attend to the request's keys ``[0, seq_len)``
read through ``req_to_token``, causally or through a custom mask over the last ``mask_width`` keys.

Stage 1 splits each request's keys across up to ``max_splits`` programs, so that one long request still fills the
GPU; each program writes a partial output and its log-sum-exp. Stage 2 merges the partials
(tfs_kernels/split_kv_merge.py). The number of splits is
decided on the device from the request's length and the batch size (never read back by the host), so one captured
graph serves every length. The query heads of one KV head (``h = kv * group + g``) and all ``q_len`` tokens of a
request are processed together as the rows of one tile: K/V are read once per KV head. Within a split, whole tiles
of keys that every row sees go through a loop without masking; only the tail (the last partial tile, and the keys
under the causal rule or the custom mask) pays for the checks.

Used by ``tfs::decode_attention`` and ``tfs::verify_attention``; the plain-torch reference is
:func:`split_kv_attention_reference`.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from tfs_kernels.mask_bits import MASK_WORD_BITS
from tfs_kernels.online_softmax import dot, online_softmax_step
from tfs_kernels.pdl import HAS_GDC, gdc_launch_dependents, gdc_wait, prefetch_l2
from tfs_kernels.split_kv_merge import launch_split_kv_merge, num_kv_splits

LOG2E = 1.4426950408889634


@triton.jit
def _program_tile(Seq_lens, programs_per_split, max_splits, target_programs, min_split_len, Q_LEN: tl.constexpr,
                  GROUP: tl.constexpr, M_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """What the partial kernel's program (grid ``(bs * M_BLOCKS, kv_heads, max_splits)``) works on: request ``b``,
    KV head and split; the request's length, its split count and this split's keys ``[start, end)`` (empty past the
    request's splits); its query rows (row ``r`` = token ``t * GROUP`` + member of the KV head; ``row_ok``: not
    padding), as tokens ``b * Q_LEN + t`` and query heads."""
    b = tl.program_id(0) // M_BLOCKS
    m_block = tl.program_id(0) % M_BLOCKS
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(Seq_lens + b)
    n_splits = num_kv_splits(seq_len, programs_per_split, max_splits, target_programs, min_split_len)
    split_len = tl.cdiv(tl.cdiv(seq_len, n_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    end = tl.where(split < n_splits, end, start)  # programs beyond this request's splits do nothing
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    t = rows // GROUP
    row_ok = rows < Q_LEN * GROUP
    return b, kv_head, split, seq_len, n_splits, start, end, t, row_ok, b * Q_LEN + t, kv_head * GROUP + rows % GROUP


@triton.jit
def _visibility(seq_len, start, end, t, mask_width, Q_LEN: tl.constexpr, HAS_MASK: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Which keys of ``[start, end)`` each query row sees: causally, row ``t`` sees keys ``<= last_key``; with a
    custom mask, keys ``>= region`` are decided by the mask and earlier ones are visible. Keys below ``mid`` (whole
    tiles of keys every row sees) need no check; ``[mid, end)`` is the checked tail (usually one tile)."""
    last_key = seq_len - Q_LEN + t  # [BLOCK_M]
    region = seq_len - mask_width
    shared = tl.minimum(tl.maximum(region if HAS_MASK else seq_len - Q_LEN + 1, start), end)
    return last_key, region, start + (shared - start) // BLOCK_N * BLOCK_N


@triton.jit
def _attend_range(acc, l_i, m_i, q, scale_log2e, lo, hi, K_cache, V_cache, slot_row, kv_k, kv_v, mask_row,
                  t, row_ok, region, last_key, d, d_ok, stride_ks, stride_vs, stride_mt,
                  BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BITS: tl.constexpr, CHECK: tl.constexpr,
                  IEEE_DOT: tl.constexpr):
    """Fold keys ``[lo, hi)`` into the running state. ``CHECK``: apply the causal rule or the custom mask (the few
    tiles near the end of a request); otherwise every key in range is visible to every row (the bulk of them).
    ``MASK_BITS``: the mask is one int64 word per row (bit ``i``: key ``region + i``), loaded once; otherwise a
    byte per (row, key), gathered per tile."""
    if CHECK and MASK_BITS:
        word = tl.load(mask_row + t * stride_mt, mask=row_ok, other=0)  # [BLOCK_M] int64
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        if CHECK and HAS_MASK:  # issued first: the mask's round trip overlaps the K load's
            rel = j[None, :] - region  # [1, BLOCK_N]; < mask_width <= 64 where keys exist
            if MASK_BITS:
                tree = (word[:, None] >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)) & 1
            else:
                tree = tl.load(mask_row + t[:, None] * stride_mt + rel,
                               mask=row_ok[:, None] & (rel >= 0) & j_ok[None, :], other=0)
        slot = tl.load(slot_row + j, mask=j_ok, other=0)  # [BLOCK_N] int64
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = tl.load(K_cache + slot[:, None] * stride_ks + kv_k + d[None, :], mask=kv_ok, other=0.0)
        # NOTE: .to(float32) keeps the loop state fp32 whatever the scalar's type
        s = (dot(q, tl.trans(k), IEEE_DOT) * scale_log2e).to(tl.float32)  # [BLOCK_M, BLOCK_N], base-2 units
        if CHECK:
            if HAS_MASK:
                allowed = j_ok[None, :] & ((rel < 0) | (tree != 0))
            else:
                allowed = j_ok[None, :] & (j[None, :] <= last_key[:, None])
            s = tl.where(allowed, s, float("-inf"))
        else:
            s = tl.where(j_ok[None, :], s, float("-inf"))
        v = tl.load(V_cache + slot[:, None] * stride_vs + kv_v + d[None, :], mask=kv_ok, other=0.0)
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, IEEE_DOT)
    return acc, l_i, m_i


@triton.jit
def _split_kv_partial_kernel(
    Q, K_cache, V_cache, Req_to_token, Req_pool_indices, Seq_lens, Mask, Mid_o, Mid_lse,
    scale_log2e, mask_width, programs_per_split, max_splits, target_programs, min_split_len,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_req, stride_mb, stride_mt,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, M_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_BITS: tl.constexpr, IEEE_DOT: tl.constexpr, USE_PDL: tl.constexpr, LINE: tl.constexpr,
):
    # grid: (bs * M_BLOCKS, kv_heads, max_splits)
    # inductor passes float scalars as fp64, a direct launch (the PDL ops) as fp32: round once, same products
    scale_log2e = tl.cast(scale_log2e, tl.float32)
    b, kv_head, split, seq_len, n_splits, start, end, t, row_ok, token, head = _program_tile(
        Seq_lens, programs_per_split, max_splits, target_programs, min_split_len, Q_LEN, GROUP, M_BLOCKS, BLOCK_M,
        BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    slot_row = Req_to_token + tl.load(Req_pool_indices + b) * stride_req
    if USE_PDL:  # launched early (tfs_kernels/pdl.py): q and the new keys come from the kernel before
        # meanwhile, pull the split's first tile of older keys (written by earlier steps) into L2, one pointer per
        # LINE elements of each K / V row
        j = start + tl.arange(0, BLOCK_N)
        old = tl.where(j < tl.minimum(end, seq_len - Q_LEN), tl.load(slot_row + j, mask=j < end, other=0), 0)
        lines = tl.minimum(tl.arange(0, BLOCK_D // LINE) * LINE, HEAD_DIM - 1)  # within the head's row
        prefetch_l2(K_cache + old[:, None] * stride_ks + kv_head * stride_kh + lines[None, :])
        prefetch_l2(V_cache + old[:, None] * stride_vs + kv_head * stride_vh + lines[None, :])
        gdc_wait()
        gdc_launch_dependents()
    q = tl.load(Q + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(K_cache.dtype.element_ty)  # [BLOCK_M, BLOCK_D]
    mask_row = Mask + b * stride_mb
    last_key, region, mid = _visibility(seq_len, start, end, t, mask_width, Q_LEN, HAS_MASK, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, scale_log2e, start, mid, K_cache, V_cache, slot_row,
                                  kv_head * stride_kh, kv_head * stride_vh, mask_row, t, row_ok, region,
                                  last_key, d, d_ok, stride_ks, stride_vs, stride_mt, BLOCK_N, HAS_MASK, MASK_BITS,
                                  False, IEEE_DOT)
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, scale_log2e, mid, end, K_cache, V_cache, slot_row,
                                  kv_head * stride_kh, kv_head * stride_vh, mask_row, t, row_ok, region,
                                  last_key, d, d_ok, stride_ks, stride_vs, stride_mt, BLOCK_N, HAS_MASK, MASK_BITS,
                                  True, IEEE_DOT)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # an empty split weighs nothing
    # NOTE: a block mask and'ed with a scalar condition breaks the Triton interpreter; fold the scalar into a bound
    store_ok = t < tl.where(split < n_splits, Q_LEN, 0)  # = row_ok, for the splits this request uses
    tl.store(Mid_o + token[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_os + d[None, :],
             (acc / l_safe[:, None]).to(Mid_o.dtype.element_ty), mask=store_ok[:, None] & d_ok[None, :])
    tl.store(Mid_lse + token * stride_lt + head * stride_lh + split, lse, mask=store_ok)


# Chosen with bench/tune_split_kv.py on an H200 (docs/PERFORMANCE.md): programs per SM that the split count aims at
# and the shortest split, in keys; a verify's 8 x group query rows make each program heavier, so fewer of them.
TARGET_PROGRAMS_PER_SM = {"decode": 4, "multi": 2}
MIN_SPLIT_LEN = 64
# dtype of the partial outputs between the two stages (their log-sum-exps stay float32); bf16 gained nothing
# consistent (docs/PERFORMANCE.md, GPU attention kernels)
PARTIAL_DTYPE = torch.float32
# (BLOCK_N, num_warps, num_stages) of the partial kernel on CUDA, by tokens per request (1: decode, more: verify /
# draft) and batch: up to SMALL_BATCH requests the grid is a few short splits whose time is latency (one key tile
# or a few per program), where a loop without software pipelining wins; a verify at larger batches streams K/V and
# wants the pipelined 128-key tiles. Decode takes 64-key tiles without pipelining at every batch since the split
# count became a power of two (2026-12-01: 134.5 us against 151.3 for (128, 4, 2) at 32 x 4k, 2059 against
# 1995 at 64 x 32k). From sweeps with bench/tune_split_kv.py (docs/PERFORMANCE.md). The interpreter uses small
# tiles.
SMALL_BATCH = 8
CUDA_LAUNCH = {"decode": (64, 4, 1), "multi": (128, 4, 2), "decode_small": (64, 4, 1), "multi_small": (128, 4, 1)}
INTERPRET_LAUNCH = (32, 4, 1)


def _launch_config(q: torch.Tensor, q_len: int, bs: int) -> tuple[int, int, int]:
    if not q.is_cuda:
        return INTERPRET_LAUNCH
    mode = "decode" if q_len == 1 else "multi"
    return CUDA_LAUNCH[f"{mode}_small" if bs <= SMALL_BATCH else mode]


ROW_BLOCK = 64  # at most this many query rows per program


def _tile_rows(rows: int) -> tuple[int, int]:
    """(BLOCK_M, M_BLOCKS) for ``rows = q_len * group`` query rows per (request, kv head)."""
    if rows <= ROW_BLOCK:
        return max(16, triton.next_power_of_2(rows)), 1
    return ROW_BLOCK, triton.cdiv(rows, ROW_BLOCK)


def split_slots(max_splits: int, target_programs: int, programs_per_split: int) -> int:
    """Split slots per (token, head) in the partial buffers, the most splits the kernel may use: no more than fill
    the device (``target_programs``), rounded down to a power of two. The merge loads a power-of-two block of slots
    (33 splits would cost it as much as 64), and a third split of a batch's requests adds a wave of programs more
    than it shortens each one. Under torch.compile ``programs_per_split`` is symbolic (the batch size): the doubling
    loop guards only on ranges of the bound (one graph serves every batch size with the same power of two; the
    merge's block size is specialised the same way), where ``1 << (n.bit_length() - 1)`` would pin its exact value
    and recompile for more batch sizes; the result is a plain int."""
    bound = max(1, min(max_splits, triton.cdiv(target_programs, programs_per_split)))
    slots = 1
    while slots * 2 <= bound:
        slots *= 2
    return slots


def launch_split_kv_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                              custom_mask: Optional[torch.Tensor], q_len: int, scale: float, max_splits: int,
                              target_programs: int, min_split_len: int, pdl: bool = False,
                              mask_bits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Launch both stages (inside a triton_op body: kernels go through ``wrap_triton``). Returns ``[n, heads, dim]``
    in q's dtype. q ``[n = bs * q_len, heads, dim]``; k/v_cache ``[num_slots, kv_heads, dim]``. ``pdl``: both
    with programmatic dependent launch (from an opaque op: tfs_kernels/pdl.py). ``mask_bits``: ``custom_mask`` packed
    by :func:`tfs_kernels.mask_bits.pack_mask_bits` (widths up to 64), which the kernel then reads instead (the mask's
    own bytes are not read: only its width)."""
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    bs = req_pool_indices.shape[0]
    block_m, m_blocks = _tile_rows(q_len * group)
    block_d = max(16, triton.next_power_of_2(dim))
    block_n, num_warps, num_stages = _launch_config(q, q_len, bs)
    programs_per_split = bs * m_blocks * kv_heads
    max_splits = split_slots(max_splits, target_programs, programs_per_split)
    mid_o = torch.empty((n, heads, max_splits, dim), dtype=PARTIAL_DTYPE, device=q.device)
    mid_lse = torch.empty((n, heads, max_splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    has_mask = custom_mask is not None
    use_bits = has_mask and mask_bits is not None
    mask_width = custom_mask.shape[2] if has_mask else 0
    mask = seq_lens  # an unused stand-in without a mask
    torch._check(mask_bits is None or has_mask, lambda: "split-K attention: mask_bits without its custom_mask")
    if use_bits:  # [bs, q_len] int64 words, packed once per step (TritonBackend.init_metadata)
        torch._check(mask_width <= MASK_WORD_BITS, lambda: f"mask_bits: a mask {mask_width} keys wide is over 64")
        torch._check(mask_bits.dtype == torch.int64 and mask_bits.dim() == 2,
                     lambda: f"mask_bits: [bs, q_len] int64 words, not {mask_bits.dtype} {tuple(mask_bits.shape)}")
        torch._check(mask_bits.shape[1] == custom_mask.shape[1], lambda: "mask_bits: one word per query row")
        mask = mask_bits
    elif has_mask:  # the kernel reads bytes; attention=triton converts once per step (TritonBackend.init_metadata)
        # NOTE: a converting copy, not .view(torch.uint8): inductor (torch 2.11) cannot lower a bool->uint8 bitcast
        u8 = custom_mask.dtype == torch.uint8 and custom_mask.is_contiguous()
        mask = custom_mask if u8 else custom_mask.to(torch.uint8).contiguous()
    stride_mb, stride_mt = (mask.stride(0), mask.stride(1)) if has_mask else (0, 0)
    torch._check(not pdl or HAS_GDC, lambda: "split-K attention: pdl needs a Triton with grid dependency control")
    pdl_launch = {"launch_pdl": True} if pdl else {}
    wrap_triton(_split_kv_partial_kernel)[(bs * m_blocks, kv_heads, max_splits)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, mask, mid_o, mid_lse,
        scale * LOG2E, mask_width, programs_per_split, max_splits, target_programs, min_split_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0), stride_mb, stride_mt,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        Q_LEN=q_len, GROUP=group, HEAD_DIM=dim, M_BLOCKS=m_blocks, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, HAS_MASK=has_mask, MASK_BITS=use_bits, IEEE_DOT=k_cache.dtype == torch.float32,
        USE_PDL=pdl, LINE=min(block_d, 128 // k_cache.element_size()), num_warps=num_warps, num_stages=num_stages,
        **pdl_launch,
    )
    launch_split_kv_merge(mid_o, mid_lse, out, seq_lens, q_len, programs_per_split, max_splits, target_programs,
                          min_split_len, pdl)
    return out


def split_kv_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                 seq_lens: torch.Tensor, custom_mask: Optional[torch.Tensor], q_len: int,
                                 scale: float) -> torch.Tensor:
    """Plain torch (float32 math, no host sync, compile-friendly): the definition the kernels are tested against.

    Keys are positions ``[0, req_to_token.shape[1])`` of each request, visible when ``< seq_len`` and allowed by
    the causal rule (no mask) or by ``custom_mask`` ``[bs, q_len, mask_width]`` (bool, or uint8 0 / 1) over the
    last ``mask_width`` keys.
    """
    n, heads, dim = q.shape
    bs = req_pool_indices.shape[0]
    kv_heads = k_cache.shape[1]
    width = req_to_token.shape[1]
    slots = req_to_token[req_pool_indices]  # [bs, width]
    k = k_cache[slots].float()  # [bs, width, kv_heads, dim]
    v = v_cache[slots].float()
    j = torch.arange(width, device=q.device)[None, None, :]  # [1, 1, width]
    t = torch.arange(q_len, device=q.device)[None, :, None]  # [1, q_len, 1]
    seq = seq_lens[:, None, None]  # [bs, 1, 1]
    if custom_mask is None:
        allowed = j <= seq - q_len + t  # [bs, q_len, width]
    else:
        mask_width = custom_mask.shape[2]
        rel = j - (seq - mask_width)  # [bs, 1, width]
        gathered = torch.gather(custom_mask, 2, rel.clamp(0, mask_width - 1).expand(bs, q_len, width)).bool()
        allowed = (rel < 0) | ((j < seq) & gathered)
    qf = q.float().view(bs, q_len, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("btkgd,bjkd->bkgtj", qf, k) * scale  # [bs, kv_heads, group, q_len, width]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    out = torch.einsum("bkgtj,bjkd->btkgd", scores.softmax(-1), v)
    return out.reshape(n, heads, dim).to(q.dtype)


def split_policy(device: torch.device, q_len: int) -> tuple[int, int, int]:
    """(max_splits, target_programs, min_split_len) for ``q_len`` query tokens per request on ``device``.

    The kernel picks, per request, enough splits for about ``target_programs`` programs on the device (a few per
    SM), each covering at least ``min_split_len`` keys, and at most ``max_splits``. The fp32 partial buffer
    (``num_tokens * heads * splits * head_dim``) is sized by the occupancy bound at launch, so it stays small at
    large batch sizes whatever ``q_len`` is: a verify over 8 tokens splits one long request as far as a decode does.
    On the CPU (Triton interpreter) there are few, short splits: enough to exercise the merge, cheap to interpret.
    """
    if device.type == "cuda":
        per_sm = TARGET_PROGRAMS_PER_SM["decode" if q_len == 1 else "multi"]
        return 64, per_sm * torch.cuda.get_device_properties(device).multi_processor_count, MIN_SPLIT_LEN
    return 4, 16, 32


__all__ = ["launch_split_kv_attention", "split_kv_attention_reference", "split_policy"]
