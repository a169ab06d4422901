"""``tfs::det_attention``: paged attention whose result for a query token does not depend on the forward it is in
(model.deterministic): a decode step, a verify of draft tokens and a prefill reduce a token's keys in one order.

Each token is processed on its own (its query heads of one KV head are the rows of a tile): grid
``(num_tokens, kv_heads, split slots)``. Its keys are split by a length that depends on the token's own position
only, never on the batch, the forward or the request's length: a token at position p (keys ``[0, p]`` causally
visible) splits them into pieces of one length for that p (a multiple of ``BLOCK_N``, at least the op's ``split``
keys, long enough that at most ``MAX_SPLITS`` pieces cover ``p + 1`` keys; split ``s`` covers key indices
``[s * len, (s + 1) * len)``). Within a split, tiles of ``BLOCK_N`` keys from the split's start are folded by the
online softmax, every tile masked the same way (keys past the token's last visible key score ``-inf`` and add exact
zeros). Stage 2 merges a token's splits in index order with one global max. A verify row at position p may see
more keys after it than the decode row at p had (with a custom mask), but those fall in masked tiles and in splits
whose keys are all masked, which add exact zeros, so both give the same bits. Short contexts get many short splits
(a decode step at batch 1 fills the GPU), long ones at most ``MAX_SPLITS`` per token (the partials' memory).

Modes: uniform (``q_len`` tokens per request: DECODE, TARGET_VERIFY, DRAFT_*), causal or with a custom mask over the
last ``mask_width`` keys (bytes, or one int64 word per row); ragged EXTEND (``q_starts`` / ``q_lens`` per request,
causal over the new tokens). A chain's mask is causal: its rows reduce like decode rows. A tree's node sees its
ancestors at other key indices than plain decoding would put them, so trees are not covered.

The plain-torch reference is :func:`det_attention_reference` (float32 softmax over the visible keys).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from tfs_kernels.dispatch import register_cpu_reference, use_triton
from tfs_kernels.extend_attention import extend_attention_reference
from tfs_kernels.online_softmax import dot, online_softmax_step
from tfs_kernels.pdl import HAS_GDC, gdc_launch_dependents, gdc_wait
from tfs_kernels.split_kv_attention import split_kv_attention_reference

LOG2E = 1.4426950408889634
# splits per token's causally visible keys (the split length grows with the position beyond MAX_SPLITS *
# MIN_SPLIT keys); "cpu": the interpreter's small shapes, which then also cover the growth
MAX_SPLITS = {"cuda": 16, "cpu": 2}
MIN_SPLIT = {"cuda": 64, "cpu": 32}  # keys per split at least (a multiple of BLOCK_N)
BLOCK_N = {"cuda": 64, "cpu": 16}
NUM_WARPS = {"cuda": 4, "cpu": 1}


def min_split(device_type: str) -> int:
    """The op's ``split`` for a device: the fewest keys a split covers."""
    return MIN_SPLIT["cuda" if device_type == "cuda" else "cpu"]


@triton.jit
def _token_row(token, Seq_lens, Q_starts, Q_lens, bs, Q_LEN: tl.constexpr, RAGGED: tl.constexpr,
               HAS_MASK: tl.constexpr, MIN_BLOCKS: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Request ``b`` of a token, its index ``t`` among the request's new tokens, the request's length, its last
    causally visible key, the keys ``[0, limit)`` its splits cover, their length (by the token's position only:
    whole ``BLOCK_N`` tiles, at least ``MIN_BLOCKS``, at most ``MAX_SPLITS`` splits up to the last visible key) and
    their number."""
    if RAGGED:  # requests back to back from q_starts (ascending; empty requests share the next one's start)
        b = token * 0
        for i in range(1, bs):
            b += (tl.load(Q_starts + i) <= token).to(b.dtype)
        t = token - tl.load(Q_starts + b)
        q_len = tl.load(Q_lens + b)
    else:
        b = token // Q_LEN
        t = token % Q_LEN
        q_len = Q_LEN
    seq_len = tl.load(Seq_lens + b)
    last_key = seq_len - q_len + t
    limit = seq_len if HAS_MASK else last_key + 1
    split = tl.maximum(tl.cdiv(tl.cdiv(last_key + 1, BLOCK_N), MAX_SPLITS), MIN_BLOCKS) * BLOCK_N
    return b, t, seq_len, last_key, limit, split, tl.cdiv(limit, split)


@triton.jit
def _det_partial_kernel(
    Q, K_cache, V_cache, Req_to_token, Req_pool_indices, Seq_lens, Q_starts, Q_lens, Mask, Mid_o, Mid_lse,
    scale_log2e, mask_width, bs,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_req, stride_mb, stride_mt,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    Q_LEN: tl.constexpr, RAGGED: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MIN_BLOCKS: tl.constexpr, MAX_SPLITS: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_BITS: tl.constexpr, IEEE_DOT: tl.constexpr, USE_PDL: tl.constexpr,
):
    # grid: (num_tokens, kv_heads, split slots)
    if USE_PDL:  # launched early: wait for the kernel that wrote q and the step's keys, then let the merge launch
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    scale_log2e = tl.cast(scale_log2e, tl.float32)
    b, t, seq_len, last_key, limit, split_len, n_splits = _token_row(
        token, Seq_lens, Q_starts, Q_lens, bs, Q_LEN, RAGGED, HAS_MASK, MIN_BLOCKS, MAX_SPLITS, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, limit)
    end = tl.where(split < n_splits, end, start)  # splits past the token's keys do nothing
    g = tl.arange(0, BLOCK_M)
    g_ok = g < GROUP
    head = kv_head * GROUP + g  # [BLOCK_M]
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + token * stride_qt + head[:, None] * stride_qh + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                other=0.0).to(K_cache.dtype.element_ty)  # [BLOCK_M, BLOCK_D]
    slot_row = Req_to_token + tl.load(Req_pool_indices + b) * stride_req
    region = seq_len - mask_width
    if HAS_MASK and MASK_BITS:
        word = tl.load(Mask + b * stride_mb + t * stride_mt)  # int64: bit i = key region + i
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        j_ok = j < end
        slot = tl.load(slot_row + j, mask=j_ok, other=0)
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = tl.load(K_cache + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_ok, other=0.0)
        s = (dot(q, tl.trans(k), IEEE_DOT) * scale_log2e).to(tl.float32)  # [BLOCK_M, BLOCK_N]
        if HAS_MASK:
            rel = j - region  # [BLOCK_N]
            if MASK_BITS:
                bit = (word >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)) & 1
            else:
                bit = tl.load(Mask + b * stride_mb + t * stride_mt + rel, mask=j_ok & (rel >= 0), other=0)
            visible = j_ok & ((rel < 0) | (bit != 0))
        else:
            visible = j_ok & (j <= last_key)
        s = tl.where(visible[None, :], s, float("-inf"))
        v = tl.load(V_cache + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=kv_ok, other=0.0)
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, IEEE_DOT)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # an empty split weighs nothing
    store_ok = g < tl.where(split < n_splits, GROUP, 0)
    tl.store(Mid_o + token * stride_ot + head[:, None] * stride_oh + split * stride_os + d[None, :],
             acc / l_safe[:, None], mask=store_ok[:, None] & d_ok[None, :])
    tl.store(Mid_lse + token * stride_lt + head * stride_lh + split, lse, mask=store_ok)


@triton.jit
def _det_merge_kernel(
    Mid_o, Mid_lse, Out, Seq_lens, Q_starts, Q_lens, bs,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_outt, stride_outh,
    Q_LEN: tl.constexpr, RAGGED: tl.constexpr, HAS_MASK: tl.constexpr, MIN_BLOCKS: tl.constexpr,
    MAX_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # grid: (num_tokens, heads); the token's splits in index order, weighted by exp2(lse - global max)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0)
    head = tl.program_id(1)
    n_splits = _token_row(token, Seq_lens, Q_starts, Q_lens, bs, Q_LEN, RAGGED, HAS_MASK, MIN_BLOCKS, MAX_SPLITS,
                          BLOCK_N)[6]
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse_row = Mid_lse + token * stride_lt + head * stride_lh
    o_row = Mid_o + token * stride_ot + head * stride_oh
    m = tl.full([], float("-inf"), tl.float32)
    for s in range(0, n_splits):
        m = tl.maximum(m, tl.load(lse_row + s))
    m = tl.where(m == float("-inf"), 0.0, m)
    num = tl.zeros([BLOCK_D], tl.float32)
    den = tl.zeros([], tl.float32)
    for s in range(0, n_splits):
        w = tl.exp2(tl.load(lse_row + s) - m)
        num += w * tl.load(o_row + s * stride_os + d, mask=d_ok, other=0.0)
        den += w
    out = num / tl.maximum(den, 1e-30)
    tl.store(Out + token * stride_outt + head * stride_outh + d, out.to(Out.dtype.element_ty), mask=d_ok)


@torch.library.custom_op("tfs::det_attention", mutates_args=())
def det_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, q_starts: Optional[torch.Tensor],
                     q_lens: Optional[torch.Tensor], custom_mask: Optional[torch.Tensor],
                     mask_bits: Optional[torch.Tensor], q_len: int, scale: float, split: int,
                     pdl: bool = False) -> torch.Tensor:
    """q ``[n, heads, dim]``; k/v_cache ``[num_slots, kv_heads, dim]``; req_to_token ``[rows, width]``;
    req_pool_indices / seq_lens ``[bs]`` (keys after this forward). Uniform (``q_starts`` None): ``n = bs * q_len``,
    request-major, causal or ``custom_mask`` ``[bs, q_len, mask_width]`` (uint8 / bool; ``mask_bits`` ``[bs, q_len]``
    int64, its packed copy, read instead when given). Ragged EXTEND: ``q_starts`` / ``q_lens`` ``[bs]``, causal.
    ``split``: the fewest keys per split (:func:`min_split`), a multiple of the kernel's key tile. ``pdl``: both
    stages launched with programmatic dependent launch (CUDA, tfs_kernels/pdl.py). -> ``[n, heads, dim]`` in q's
    dtype."""
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    bs = req_pool_indices.shape[0]
    dev = "cuda" if q.is_cuda else "cpu"
    block_n = BLOCK_N[dev]
    torch._check(split % block_n == 0, lambda: f"det_attention: split {split} is not a multiple of {block_n}")
    torch._check(not pdl or (HAS_GDC and q.is_cuda),
                 lambda: "det_attention: pdl needs CUDA and grid dependency control")
    launch_pdl = {"launch_pdl": True} if pdl else {}
    ragged = q_starts is not None
    has_mask = custom_mask is not None
    # a token's splits up to its last visible key, and with a mask those over the request's later new tokens
    max_splits = MAX_SPLITS[dev] + (triton.cdiv(q_len - 1, split) if has_mask else 0)
    use_bits = has_mask and mask_bits is not None
    mask = seq_lens  # an unused stand-in without a mask
    if use_bits:
        mask = mask_bits
    elif has_mask:
        u8 = custom_mask.dtype == torch.uint8 and custom_mask.is_contiguous()
        mask = custom_mask if u8 else custom_mask.to(torch.uint8).contiguous()
    stride_mb, stride_mt = (mask.stride(0), mask.stride(1)) if has_mask else (0, 0)
    starts = q_starts if ragged else seq_lens
    lens = q_lens if ragged else seq_lens
    mid_o = torch.empty((n, heads, max_splits, dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((n, heads, max_splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    block_d = max(16, triton.next_power_of_2(dim))
    _det_partial_kernel[(n, kv_heads, max_splits)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, starts, lens, mask, mid_o, mid_lse,
        scale * LOG2E, custom_mask.shape[2] if has_mask else 0, bs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0), stride_mb, stride_mt,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        Q_LEN=1 if ragged else q_len, RAGGED=ragged, GROUP=group, HEAD_DIM=dim,
        BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        MIN_BLOCKS=split // block_n, MAX_SPLITS=MAX_SPLITS[dev], HAS_MASK=has_mask, MASK_BITS=use_bits,
        IEEE_DOT=k_cache.dtype == torch.float32, USE_PDL=pdl,
        num_warps=NUM_WARPS[dev], num_stages=1, **launch_pdl,
    )
    _det_merge_kernel[(n, heads)](
        mid_o, mid_lse, out, seq_lens, starts, lens, bs,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        Q_LEN=1 if ragged else q_len, RAGGED=ragged, HAS_MASK=has_mask, MIN_BLOCKS=split // block_n,
        MAX_SPLITS=MAX_SPLITS[dev], BLOCK_N=block_n, HEAD_DIM=dim, BLOCK_D=block_d, USE_PDL=pdl, num_warps=1,
        **launch_pdl,
    )
    return out


@det_attention_op.register_fake
def _det_attention_fake(q: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(q)


def det_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                            q_starts: Optional[torch.Tensor], q_lens: Optional[torch.Tensor],
                            custom_mask: Optional[torch.Tensor], mask_bits: Optional[torch.Tensor], q_len: int,
                            scale: float, split: int, pdl: bool = False) -> torch.Tensor:
    """Plain torch (float32 softmax over each token's visible keys); ``split``, ``mask_bits`` and ``pdl`` do not
    change the result."""
    if q_starts is not None:
        max_q_len = req_to_token.shape[1]  # an upper bound: no host read of q_lens
        return extend_attention_reference(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, q_starts,
                                          q_lens, min(max_q_len, q.shape[0]), scale)
    return split_kv_attention_reference(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, custom_mask,
                                        q_len, scale)


register_cpu_reference(det_attention_op, det_attention_reference)


def det_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                  req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, q_starts: Optional[torch.Tensor],
                  q_lens: Optional[torch.Tensor], custom_mask: Optional[torch.Tensor],
                  mask_bits: Optional[torch.Tensor], q_len: int, scale: float, split: int,
                  pdl: bool = False) -> torch.Tensor:
    """The op where Triton runs (see :mod:`tfs_kernels.dispatch`), the reference elsewhere (``pdl`` on CUDA only)."""
    fn = torch.ops.tfs.det_attention if use_triton(q) else det_attention_reference
    return fn(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, q_starts, q_lens, custom_mask,
              mask_bits, q_len, scale, split, pdl and q.is_cuda)
