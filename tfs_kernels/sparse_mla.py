"""``tfs::sparse_mla_attention``: MLA attention (absorbed form) over the key positions the indexer selected.

DeepSeek-V3.2 sparse attention: each query token ``t`` attends, with all of its ``h`` heads, to the ``k`` key
positions ``topk_pos[t]`` (``-1``: unused) that :mod:`tfs_kernels.indexer_topk` picked, among its request's keys
in the latent cache. MLA in absorbed form is multi-query attention over one latent "head" of ``dk`` dims (DeepSeek:
512 + 64 rope dims = 576) whose first ``dv`` dims (512) are also the value:

    out[t, h] = softmax_j(scale * q[t, h] . key_j) @ key_j[:dv],  key_j = kv_cache[kv_slots[req_of_token[t], pos_j]].

One program per (token, block of ``BLOCK_H`` heads): every key block is loaded once for all the block's heads, in
two parts, the value dims ``[0, dv)`` (a power-of-two block, masked) and the tail ``[dv, dk)`` (its own small
block), so that 576 does not round up to 1024. Flash-style online softmax over blocks of ``BLOCK_N`` selected
positions, float32 accumulation; the loop stops after the last valid entry of the row (short requests select far
fewer than ``k`` positions). Rows without a valid entry (padding) give zeros. Static shapes, no host sync: the op
runs inside CUDA graphs.
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
def _sparse_mla_kernel(
    Q, Kv_cache, Kv_slots, Req_of_token, Topk_pos, Out, scale_log2e, topk,
    stride_qt, stride_qh, stride_ks, stride_req, stride_pt, stride_ot, stride_oh,
    HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_TAIL: tl.constexpr, SCAN_BLOCK: tl.constexpr, UPCAST: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    # grid: (n, cdiv(HEADS, BLOCK_H)); program (t, hb): token t, heads [hb * BLOCK_H, (hb + 1) * BLOCK_H)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    h_ok = h < HEADS
    scale_log2e = tl.cast(scale_log2e, tl.float32)  # inductor passes float scalars as fp64
    pos_row = Topk_pos + t * stride_pt
    slot_row = Kv_slots + tl.load(Req_of_token + t) * stride_req
    # the loop's bound: one past the row's last valid entry (0 for a padding row: zeros out)
    end = 0
    for s0 in range(0, topk, SCAN_BLOCK):
        i = s0 + tl.arange(0, SCAN_BLOCK)
        pos = tl.load(pos_row + i, mask=i < topk, other=-1)
        end = tl.maximum(end, tl.max(tl.where(pos >= 0, i + 1, 0), 0))
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < DV
    q_v = tl.load(Q + t * stride_qt + h[:, None] * stride_qh + dv[None, :], mask=h_ok[:, None] & dv_ok[None, :],
                  other=0.0)  # [BLOCK_H, BLOCK_DV]: the value dims of q
    compute = tl.float32 if UPCAST else Kv_cache.dtype.element_ty  # the dtype of the products' inputs
    q_v = q_v.to(compute)
    if BLOCK_TAIL > 0:
        dt = DV + tl.arange(0, BLOCK_TAIL)
        dt_ok = dt < DK
        q_t = tl.load(Q + t * stride_qt + h[:, None] * stride_qh + dt[None, :], mask=h_ok[:, None] & dt_ok[None, :],
                      other=0.0)  # [BLOCK_H, BLOCK_TAIL]: the rest (the rope dims)
        q_t = q_t.to(compute)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for n0 in range(0, end, BLOCK_N):
        i = n0 + tl.arange(0, BLOCK_N)
        pos = tl.load(pos_row + i, mask=i < end, other=-1)  # [BLOCK_N]
        ok = pos >= 0
        slot = tl.load(slot_row + pos, mask=ok, other=0)  # [BLOCK_N] int64
        kv = tl.load(Kv_cache + slot[:, None] * stride_ks + dv[None, :], mask=ok[:, None] & dv_ok[None, :],
                     other=0.0)  # [BLOCK_N, BLOCK_DV]: key dims [0, dv), the value
        kv = kv.to(compute)
        s = dot(q_v, tl.trans(kv), IEEE_DOT)  # [BLOCK_H, BLOCK_N] float32
        if BLOCK_TAIL > 0:
            kt = tl.load(Kv_cache + slot[:, None] * stride_ks + dt[None, :], mask=ok[:, None] & dt_ok[None, :],
                         other=0.0)  # [BLOCK_N, BLOCK_TAIL]
            kt = kt.to(compute)
            s += dot(q_t, tl.trans(kt), IEEE_DOT)
        s = tl.where(ok[None, :], s * scale_log2e, float("-inf"))  # base-2 units
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, kv, IEEE_DOT)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a padding row: acc is 0
    tl.store(Out + t * stride_ot + h[:, None] * stride_oh + dv[None, :], (acc / l_safe[:, None]).to(
        Out.dtype.element_ty), mask=h_ok[:, None] & dv_ok[None, :])


# (BLOCK_H cap, BLOCK_N, num_warps, num_stages) on CUDA and in the interpreter. On CUDA, sglang's grouped MLA decode
# tiles with 8 warps: ptxas (sm_90a, bf16, dk 576) gives 146 registers and no spills, where 4 warps spill; a
# BLOCK_H of 32 (192 registers) would halve the key reads at 128 heads but halve the programs of a small batch.
# Not yet timed on a GPU.
CUDA_LAUNCH = (16, 32, 8, 2)
INTERPRET_LAUNCH = (16, 16, 1, 1)
SCAN_BLOCK = 1024  # entries of topk_pos per step of the loop that finds the row's last valid one


def check_inputs(q: torch.Tensor, kv_cache: torch.Tensor, kv_slots: torch.Tensor, req_of_token: torch.Tensor,
                 topk_pos: torch.Tensor, dv: int) -> None:
    """The argument checks of ``tfs::sparse_mla_attention``; each failure is one line naming the argument."""
    n, heads, dk = q.shape
    torch._check(q.stride(-1) == 1, lambda: "tfs::sparse_mla_attention: q needs a unit inner stride")
    torch._check(0 < dv <= dk, lambda: f"tfs::sparse_mla_attention: dv {dv} must be in [1, dk = {dk}]")
    torch._check(kv_cache.dim() == 2 and kv_cache.shape[1] == dk and kv_cache.stride(-1) == 1,
                 lambda: f"tfs::sparse_mla_attention: kv_cache {tuple(kv_cache.shape)} must be [slots, {dk}], unit "
                         f"inner stride")
    torch._check(kv_slots.dim() == 2 and kv_slots.stride(-1) == 1,
                 lambda: f"tfs::sparse_mla_attention: kv_slots {tuple(kv_slots.shape)} must be [rows, width], unit "
                         f"inner stride")
    torch._check(req_of_token.shape == (n,),
                 lambda: f"tfs::sparse_mla_attention: req_of_token {tuple(req_of_token.shape)} must be [{n}]")
    torch._check(topk_pos.dim() == 2 and topk_pos.shape[0] == n and topk_pos.stride(-1) == 1,
                 lambda: f"tfs::sparse_mla_attention: topk_pos {tuple(topk_pos.shape)} must be [{n}, k], unit "
                         f"inner stride")


@triton_op("tfs::sparse_mla_attention", mutates_args=())
def sparse_mla_attention_op(q: torch.Tensor, kv_cache: torch.Tensor, kv_slots: torch.Tensor,
                            req_of_token: torch.Tensor, topk_pos: torch.Tensor, scale: float,
                            dv: int) -> torch.Tensor:
    """q ``[n, h, dk]``; kv_cache ``[num_slots, dk]``; kv_slots ``[rows, width]`` int64; req_of_token ``[n]``
    int64; topk_pos ``[n, k]`` int64 (``-1``: unused) -> ``[n, h, dv]`` (q's dtype)."""
    check_inputs(q, kv_cache, kv_slots, req_of_token, topk_pos, dv)
    n, heads, dk = q.shape
    out = torch.empty(n, heads, dv, dtype=q.dtype, device=q.device)
    max_block_h, block_n, num_warps, num_stages = CUDA_LAUNCH if q.is_cuda else INTERPRET_LAUNCH
    block_h = min(max_block_h, max(16, triton.next_power_of_2(heads)))
    upcast = q.dtype != kv_cache.dtype or kv_cache.dtype == torch.float32  # mixed dtypes: float32 products
    k = topk_pos.shape[1]
    block_tail = 0 if dk == dv else max(16, triton.next_power_of_2(dk - dv))
    wrap_triton(_sparse_mla_kernel)[(n, triton.cdiv(heads, block_h))](
        q, kv_cache, kv_slots, req_of_token, topk_pos, out, scale * LOG2E, k,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_slots.stride(0), topk_pos.stride(0), out.stride(0),
        out.stride(1), HEADS=heads, DK=dk, DV=dv, BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_DV=max(16, triton.next_power_of_2(dv)), BLOCK_TAIL=block_tail,
        SCAN_BLOCK=min(SCAN_BLOCK, max(16, triton.next_power_of_2(k))), UPCAST=upcast, IEEE_DOT=upcast,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def sparse_mla_attention_reference(q: torch.Tensor, kv_cache: torch.Tensor, kv_slots: torch.Tensor,
                                   req_of_token: torch.Tensor, topk_pos: torch.Tensor, scale: float,
                                   dv: int) -> torch.Tensor:
    """Plain torch (float32 math): gather each token's selected keys, masked softmax, weighted sum of their first
    ``dv`` dims. Rows without a valid entry give zeros."""
    valid = topk_pos >= 0  # [n, k]
    slots = kv_slots[req_of_token[:, None], topk_pos.clamp(min=0)]  # [n, k]
    keys = kv_cache[torch.where(valid, slots, 0)].float()  # [n, k, dk]
    scores = torch.bmm(q.float(), keys.transpose(1, 2)) * scale  # [n, h, k]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0)  # an all -inf row (padding): zeros
    return torch.bmm(probs, keys[:, :, :dv]).to(q.dtype)


register_cpu_reference(sparse_mla_attention_op, sparse_mla_attention_reference)


def sparse_mla_attention(q: torch.Tensor, kv_cache: torch.Tensor, kv_slots: torch.Tensor, req_of_token: torch.Tensor,
                         topk_pos: torch.Tensor, scale: float, dv: int) -> torch.Tensor:
    """The op where Triton runs (see :mod:`tfs_kernels.dispatch`), the reference elsewhere."""
    fn = torch.ops.tfs.sparse_mla_attention if use_triton(q) else sparse_mla_attention_reference
    return fn(q, kv_cache, kv_slots, req_of_token, topk_pos, scale, dv)
