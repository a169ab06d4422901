"""``tfs::qkv_rope_store``: a decoder layer's qkv projection (RMSNorm fused in), RoPE and the K/V store, in one
kernel for a decode-sized batch: ``tfs::gemv`` followed by ``tfs::rope_store_kv`` without the second launch.

Each program computes ``BLOCK_N`` columns of the projection for all rows (the gemv's main loop,
:func:`tfs_kernels.gemv_tile.gemv_tile`), chosen so that rotate-half RoPE needs nothing from other programs: ``BLOCK_N / 2``
columns of one head's first half and their partners ``HALF`` columns later. The epilogue rounds the projection to
the weight's dtype (as ``tfs::gemv`` stores it), rotates q and k heads in float32 at each row's position, and writes
q to the returned tensor, k and v to their slots of the caches: the roundings of the two kernels (the compiler may
contract the rotation's multiply-adds differently, a last-bit difference in q and k).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from tfs_kernels.dispatch import register_cpu_reference, use_triton
from tfs_kernels.gemv import MAX_ROWS, block_rows, gemv_reference, late_norm, launch_params, pdl_options, stream_hints
from tfs_kernels.gemv_tile import gemv_prologue, gemv_tile
from tfs_kernels.pdl import HAS_GDC
from tfs_kernels.rope_store import check_inputs, rope_store_kv_reference


@triton.jit
def rope_rows(Cos, Sin, Positions, Slots, rows, row_ok, c, stride_cos, stride_sin):
    """The epilogue's inputs of ``rows`` ``[BLOCK_M]``: the rotary rows at their positions for the columns ``c``
    ``[PAIRS]`` of a head's first half (float32 ``[BLOCK_M, PAIRS]`` each) and their cache slots (int64)."""
    pos = tl.load(Positions + rows, mask=row_ok, other=0).to(tl.int64)
    ok = row_ok[:, None]
    cs = tl.load(Cos + pos[:, None] * stride_cos + c[None, :], mask=ok, other=0.0).to(tl.float32)  # [BLOCK_M, PAIRS]
    sn = tl.load(Sin + pos[:, None] * stride_sin + c[None, :], mask=ok, other=0.0).to(tl.float32)
    slot = tl.load(Slots + rows, mask=row_ok, other=0).to(tl.int64)
    return cs, sn, slot


@triton.jit
def rope_store_epilogue(y, cs, sn, slot, rows, ok, c, h, Q_out, K_cache, V_cache, stride_kcs, stride_kch, stride_vcs,
                        stride_vch, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        HALF: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr):
    """Head ``h``'s columns ``c`` and ``c + HALF`` of the projection ``y`` ``[BLOCK_M, 2 * PAIRS]`` (x1s, then x2s;
    rounded to the weight's dtype): q and k rotated (rotate-half RoPE in float32, rounded to ``y``'s dtype), q into
    ``Q_out`` ``[M, HEADS, HEAD_DIM]``, k and v into their cache ``slot``s."""
    x1, x2 = tl.split(tl.permute(tl.reshape(y, [BLOCK_M, 2, PAIRS]), [0, 2, 1]))  # [BLOCK_M, PAIRS] each
    if h < HEADS + KV_HEADS:  # q or k
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        r1 = (a * cs - b * sn).to(y.dtype)
        r2 = (b * cs + a * sn).to(y.dtype)
        if h < HEADS:
            dst = Q_out + (rows[:, None].to(tl.int64) * HEADS + h) * HEAD_DIM + c[None, :]
            tl.store(dst, r1, mask=ok)
            tl.store(dst + HALF, r2, mask=ok)
        else:
            dst = K_cache + slot[:, None] * stride_kcs + (h - HEADS) * stride_kch + c[None, :]
            tl.store(dst, r1.to(K_cache.dtype.element_ty), mask=ok)
            tl.store(dst + HALF, r2.to(K_cache.dtype.element_ty), mask=ok)
    else:  # v: into the cache as it is
        dst = V_cache + slot[:, None] * stride_vcs + (h - HEADS - KV_HEADS) * stride_vch + c[None, :]
        tl.store(dst, x1.to(V_cache.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, x2.to(V_cache.dtype.element_ty), mask=ok)


@triton.jit
def _qkv_rope_store_kernel(
    X, W, NW, Cos, Sin, Positions, K_cache, V_cache, Slots, Q_out, M, N, K, eps,
    stride_xm, stride_wn, stride_cos, stride_sin, stride_kcs, stride_kch, stride_vcs, stride_vch,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    IEEE_DOT: tl.constexpr, LATE_NORM: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr,
    PRELOAD: tl.constexpr, W_EF: tl.constexpr,
):
    # grid: ((heads + 2 * kv_heads) * HALF / PAIRS,); program p: PAIRS columns c of head h's first half, and c + HALF
    PAIRS: tl.constexpr = BLOCK_N // 2
    h = tl.program_id(0) // (HALF // PAIRS)
    c = tl.program_id(0) % (HALF // PAIRS) * PAIRS + tl.arange(0, PAIRS)  # [PAIRS] columns within the head
    i = tl.arange(0, BLOCK_N)
    offs_n = h * HEAD_DIM + i // PAIRS * HALF + tl.program_id(0) % (HALF // PAIRS) * PAIRS + i % PAIRS  # x1s, x2s
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    ok = m_ok[:, None]
    w_first = gemv_prologue(W, N, K, stride_wn, offs_n, USE_PDL, PREFETCH_K, BLOCK_N, BLOCK_K, PRELOAD, W_EF)
    # the epilogue's positions, rotary rows and slots, loaded before the weight loop (after the wait: the batch's
    # metadata may come from a kernel of the step) so that they arrive during it: after it they were two dependent
    # round trips (position, then its cos / sin row) at the end of every program
    cs, sn, slot = rope_rows(Cos, Sin, Positions, Slots, offs_m, m_ok, c, stride_cos, stride_sin)
    y = gemv_tile(X, W, NW, M, N, K, eps, offs_m * stride_xm, stride_wn, offs_n, w_first, NORM, False,
                  BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, IEEE_DOT, LATE_NORM, PRELOAD, W_EF)
    y = y.to(W.dtype.element_ty)  # [BLOCK_M, BLOCK_N], rounded as tfs::gemv stores the projection
    rope_store_epilogue(y, cs, sn, slot, offs_m, ok, c, h, Q_out, K_cache, V_cache, stride_kcs, stride_kch,
                        stride_vcs, stride_vch, HEADS, KV_HEADS, HEAD_DIM, HALF, BLOCK_M, PAIRS)


def _launch(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int, int]:
    block_n, block_k, warps, stages = launch_params(x.shape[0], *w.shape)
    if not x.is_cuda:  # the interpreter: small shapes, small tiles
        block_n, block_k = min(block_n, 16), min(block_k, 64)
    return block_n, block_k, warps, stages


def qkv_rope_store_applies(x: torch.Tensor, w: torch.Tensor, head_dim: int) -> bool:
    """True when the fused kernel serves this layer: a decode-sized batch where Triton runs, and whole column
    pairs per program (``head_dim / 2`` a multiple of half the tile)."""
    return (use_triton(x) and x.shape[0] <= MAX_ROWS and x.stride(-1) == 1 and w.is_contiguous()
            and head_dim % 2 == 0 and (head_dim // 2) % (_launch(x, w)[0] // 2) == 0)


def launch_qkv_rope_store(x: torch.Tensor, w: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float,
                          cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
                          head_dim: int, pdl: bool = False) -> torch.Tensor:
    """Check and launch (``pdl``: with programmatic dependent launch, from the opaque op)."""
    m, k = x.shape
    n = w.shape[0]
    torch._check(m <= MAX_ROWS and x.stride(-1) == 1 and w.is_contiguous() and w.shape[1] == k,
                 lambda: f"tfs::qkv_rope_store: x {tuple(x.shape)} (at most {MAX_ROWS} rows, unit inner stride) "
                         f"vs w {tuple(w.shape)} (contiguous)")
    if norm_weight is not None:
        torch._check(norm_weight.shape == (k,) and norm_weight.is_contiguous(),
                     lambda: "tfs::qkv_rope_store: norm_weight [k]")
    # the checks of tfs::rope_store_kv, on the projection's shape
    check_inputs((m, n), 1, cos, sin, positions, k_cache, v_cache, slots, num_heads, num_kv_heads, head_dim)
    torch._check(not pdl or HAS_GDC, lambda: "tfs::qkv_rope_store: pdl needs a Triton with grid dependency control")
    block_n, block_k, warps, stages = _launch(x, w)
    half = head_dim // 2
    torch._check(half % (block_n // 2) == 0,
                 lambda: f"tfs::qkv_rope_store: head_dim {head_dim} needs half a multiple of {block_n // 2}")
    q = torch.empty(m, num_heads, head_dim, dtype=w.dtype, device=x.device)
    prefetch_k, preload = pdl_options(m, n, k, w.element_size(), pdl)  # by launch class, as tfs::gemv_pdl
    nw = norm_weight if norm_weight is not None else w
    wrap_triton(_qkv_rope_store_kernel)[(n // head_dim * (half // (block_n // 2)),)](
        x, w, nw, cos, sin, positions, k_cache, v_cache, slots, q, m, n, k, eps,
        x.stride(0), w.stride(0), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HEADS=num_heads, KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half, NORM=norm_weight is not None,
        BLOCK_M=block_rows(m), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        IEEE_DOT=w.dtype == torch.float32, LATE_NORM=late_norm(m, norm_weight is not None),
        USE_PDL=pdl, PREFETCH_K=prefetch_k, PRELOAD=preload, **stream_hints(), num_warps=warps, num_stages=stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return q


@triton_op("tfs::qkv_rope_store", mutates_args=("k_cache", "v_cache"))
def qkv_rope_store_op(x: torch.Tensor, w: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float,
                      cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> torch.Tensor:
    """x ``[m <= 16, hidden]``; w ``[(heads + 2 * kv_heads) * head_dim, hidden]``; norm_weight ``[hidden]`` or
    None; cos / sin / positions / caches / slots as ``tfs::rope_store_kv`` -> q ``[m, heads, head_dim]`` in w's
    dtype (k, v written to the caches)."""
    return launch_qkv_rope_store(x, w, norm_weight, eps, cos, sin, positions, k_cache, v_cache, slots, num_heads,
                                 num_kv_heads, head_dim)


def qkv_rope_store_reference(x: torch.Tensor, w: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float,
                             cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
                             head_dim: int) -> torch.Tensor:
    """Plain torch: the projection as ``tfs::gemv``'s reference, then ``tfs::rope_store_kv``'s."""
    qkv = gemv_reference(x, w, None, norm_weight, eps, False)
    return rope_store_kv_reference(qkv, cos, sin, positions, k_cache, v_cache, slots, num_heads, num_kv_heads,
                                   head_dim)


register_cpu_reference(qkv_rope_store_op, qkv_rope_store_reference)


@torch.library.custom_op("tfs::qkv_rope_store_pdl", mutates_args=("k_cache", "v_cache"))
def qkv_rope_store_pdl_op(x: torch.Tensor, w: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float,
                          cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
                          head_dim: int) -> torch.Tensor:
    """``tfs::qkv_rope_store`` with programmatic dependent launch (CUDA, tfs_kernels/pdl.py): an opaque op, which
    inductor calls as it is, so that the launch keeps its PDL attribute inside captured graphs."""
    return launch_qkv_rope_store(x, w, norm_weight, eps, cos, sin, positions, k_cache, v_cache, slots, num_heads,
                                 num_kv_heads, head_dim, pdl=True)


@qkv_rope_store_pdl_op.register_fake
def qkv_rope_store_fake(x: torch.Tensor, w: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float,
                        cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
                        head_dim: int) -> torch.Tensor:
    """q ``[m, heads, head_dim]`` in w's dtype (the fake kernel of the PDL variants, which are opaque ops)."""
    return x.new_empty(x.shape[0], num_heads, head_dim, dtype=w.dtype)


def qkv_rope_store(x: torch.Tensor, w: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float,
                   cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                   pdl: bool = False) -> torch.Tensor:
    """The op where it applies (:func:`qkv_rope_store_applies`; ``pdl``: its PDL variant on CUDA), the reference
    elsewhere."""
    fn = torch.ops.tfs.qkv_rope_store if qkv_rope_store_applies(x, w, head_dim) else qkv_rope_store_reference
    if pdl and x.is_cuda and fn is not qkv_rope_store_reference:
        fn = torch.ops.tfs.qkv_rope_store_pdl
    return fn(x, w, norm_weight, eps, cos, sin, positions, k_cache, v_cache, slots, num_heads, num_kv_heads,
              head_dim)
