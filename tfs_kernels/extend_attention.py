"""``tfs::extend_attention``: ragged prefill (EXTEND) over a cached prefix, causal.

Request b contributes ``q_lens[b]`` new tokens, stored flat from ``q_starts[b]``; its keys are positions
``[0, seq_lens[b])`` read through ``req_to_token`` (the new tokens' K/V are already in the pool). New token t sees
the whole prefix (``seq_lens[b] - q_lens[b]`` keys) and new tokens ``<= t``. One program handles BLOCK_M tokens of
one request for one query head: first the keys every row of the tile sees (no masking), then the diagonal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from tfs_kernels.dispatch import register_cpu_reference, use_triton
from tfs_kernels.online_softmax import dot, online_softmax_step

LOG2E = 1.4426950408889634


@triton.jit
def _extend_attention_kernel(
    Q, K_cache, V_cache, Out, Req_to_token, Req_pool_indices, Seq_lens, Q_starts, Q_lens, scale_log2e,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_req,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, IEEE_DOT: tl.constexpr,
):
    # grid: (bs, cdiv(max_q_len, BLOCK_M), heads)
    b = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_len = tl.load(Q_lens + b)
    seq_len = tl.load(Seq_lens + b)
    prefix = seq_len - q_len
    q_start = tl.load(Q_starts + b)
    req_row = tl.load(Req_pool_indices + b)

    t = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = t < q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + (q_start + t)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(K_cache.dtype.element_ty)  # [BLOCK_M, BLOCK_D]

    active = m_block * BLOCK_M < q_len  # tiles past this request's tokens do nothing
    # keys [0, full_end) are visible to every row of the tile; keys [full_end, end) to some rows
    full_end = tl.where(active, (tl.minimum(prefix + m_block * BLOCK_M + 1, seq_len) // BLOCK_N) * BLOCK_N, 0)
    end = tl.where(active, tl.minimum(prefix + (m_block + 1) * BLOCK_M, seq_len), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, full_end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(Req_to_token + req_row * stride_req + j)
        k = tl.load(K_cache + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=d_ok[None, :],
                    other=0.0)
        s = (dot(q, tl.trans(k), IEEE_DOT) * scale_log2e).to(tl.float32)  # fp32 even if the scalar is fp64
        v = tl.load(V_cache + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=d_ok[None, :],
                    other=0.0)
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, IEEE_DOT)
    for n0 in range(full_end, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        j_ok = j < end
        slot = tl.load(Req_to_token + req_row * stride_req + j, mask=j_ok, other=0)
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = tl.load(K_cache + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_ok, other=0.0)
        s = (dot(q, tl.trans(k), IEEE_DOT) * scale_log2e).to(tl.float32)  # fp32 even if the scalar is fp64
        s = tl.where(j_ok[None, :] & (j[None, :] <= (prefix + t)[:, None]), s, float("-inf"))
        v = tl.load(V_cache + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=kv_ok, other=0.0)
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, IEEE_DOT)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(Out + (q_start + t)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton_op("tfs::extend_attention", mutates_args=())
def extend_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                        req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, q_starts: torch.Tensor,
                        q_lens: torch.Tensor, max_q_len: int, scale: float) -> torch.Tensor:
    """q ``[num_tokens, heads, dim]`` (requests back to back); k/v_cache ``[num_slots, kv_heads, dim]``;
    req_pool_indices / seq_lens / q_starts / q_lens ``[bs]`` int64; ``max_q_len >= max(q_lens)`` (host value)
    -> ``[num_tokens, heads, dim]`` (q's dtype)."""
    n, heads, dim = q.shape
    bs = req_pool_indices.shape[0]
    block_d = max(16, triton.next_power_of_2(dim))
    if q.is_cuda:
        block_m, block_n, warps = (64, 64, 4) if block_d <= 128 else (32, 32, 4)
    else:
        block_m, block_n, warps = 16, 32, 1
    out = torch.empty_like(q)
    wrap_triton(_extend_attention_kernel)[(bs, triton.cdiv(max_q_len, block_m), heads)](
        q, k_cache, v_cache, out, req_to_token, req_pool_indices, seq_lens, q_starts, q_lens, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0),
        GROUP=heads // k_cache.shape[1], HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        IEEE_DOT=k_cache.dtype == torch.float32, num_warps=warps, num_stages=2,
    )
    return out


def extend_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                               q_starts: torch.Tensor, q_lens: torch.Tensor, max_q_len: int,
                               scale: float) -> torch.Tensor:
    """Plain torch (float32 math, no host sync): requests padded to ``max_q_len`` rows and the
    ``req_to_token`` width of keys, causal over the new tokens, whole prefix visible."""
    n, heads, dim = q.shape
    bs = req_pool_indices.shape[0]
    kv_heads = k_cache.shape[1]
    width = req_to_token.shape[1]
    t = torch.arange(max_q_len, device=q.device)[None, :]  # [1, max_q_len]
    valid = t < q_lens[:, None]  # [bs, max_q_len]
    token = torch.where(valid, q_starts[:, None] + t, n)  # [bs, max_q_len] flat token of each row; padding: n
    slots = req_to_token[req_pool_indices]  # [bs, width]
    k = k_cache[slots].float()  # [bs, width, kv_heads, dim]
    v = v_cache[slots].float()
    j = torch.arange(width, device=q.device)[None, None, :]
    allowed = j <= (seq_lens - q_lens)[:, None, None] + t[:, :, None]  # [bs, max_q_len, width]
    qf = q.float()[token.clamp(max=n - 1)].view(bs, max_q_len, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("btkgd,bjkd->bkgtj", qf, k) * scale
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    rows = torch.einsum("bkgtj,bjkd->btkgd", scores.softmax(-1), v).reshape(bs * max_q_len, heads, dim)
    out = torch.zeros(n + 1, heads, dim, dtype=torch.float32, device=q.device)  # row n: a sink for padding rows
    out.index_copy_(0, token.reshape(-1), rows)
    return out[:n].to(q.dtype)


register_cpu_reference(extend_attention_op, extend_attention_reference)


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, q_starts: torch.Tensor,
                     q_lens: torch.Tensor, max_q_len: int, scale: float) -> torch.Tensor:
    """The op where Triton runs (see :mod:`tfs_kernels.dispatch`), the reference elsewhere."""
    fn = torch.ops.tfs.extend_attention if use_triton(q) else extend_attention_reference
    return fn(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, q_starts, q_lens, max_q_len, scale)
