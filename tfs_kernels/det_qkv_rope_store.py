"""``tfs::det_qkv_rope_store``: a decoder layer's qkv projection (RMSNorm fused in) through ``tfs::det_matmul``'s
main loop, with RoPE and the K/V store as its epilogue: ``tfs::det_matmul`` followed by ``tfs::rope_store_kv``
without the second launch, for the several-row forwards (``DET_MAX_ROWS``: verifies, decode batches of 2-8).

Each program computes ``BLOCK_N`` weight rows of the projection for ``BLOCK_M`` token rows, with the tile
``tfs::det_matmul`` would use for that weight (same K steps, same sums), chosen so that rotate-half RoPE needs
nothing from other programs: ``BLOCK_N / 2`` columns of one head's first half and their partners ``HALF`` columns
later (as ``tfs::qkv_rope_store`` arranges them). The epilogue rounds the projection to the weight's dtype (as
``tfs::det_matmul`` stores it), rotates q and k heads in float32 at each row's position, and writes q to the
returned tensor, k and v to their slots of the caches: the roundings of the two kernels (the compiler may contract
the rotation's multiply-adds differently, a last-bit difference in q and k).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from tfs_kernels import det_matmul as det_matmul_module
from tfs_kernels.det_matmul import det_matmul_reference, det_tile, launch_tile, tile_shape
from tfs_kernels.dispatch import register_cpu_reference, use_triton
from tfs_kernels.pdl import HAS_GDC, gdc_launch_dependents, gdc_wait, prefetch_l2
from tfs_kernels.qkv_rope_store import qkv_rope_store_fake, rope_store_epilogue, rope_rows
from tfs_kernels.rope_store import check_inputs, rope_store_kv_reference


@triton.jit
def _det_qkv_rope_store_kernel(
    X, W, NW, Cos, Sin, Positions, K_cache, V_cache, Slots, Q_out, M, N, K, eps,
    stride_xm, stride_wn, stride_cos, stride_sin, stride_kcs, stride_kch, stride_vcs, stride_vch,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE_DOT: tl.constexpr,
    SWAP_AB: tl.constexpr, LATE_NORM: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr,
):
    # grid: (N / BLOCK_N * cdiv(M, BLOCK_M),); program p: row tile p % m_tiles, and of column tile t = p // m_tiles
    # the PAIRS columns c of head h's first half and their partners c + HALF
    PAIRS: tl.constexpr = BLOCK_N // 2
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    t = pid // m_tiles
    h = t // (HALF // PAIRS)
    c = t % (HALF // PAIRS) * PAIRS + tl.arange(0, PAIRS)  # [PAIRS] columns within the head
    i = tl.arange(0, BLOCK_N)
    cols = h * HEAD_DIM + i // PAIRS * HALF + t % (HALF // PAIRS) * PAIRS + i % PAIRS  # [BLOCK_N] x1s, then x2s
    rows = pid % m_tiles * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_ok = rows < M
    col_ok = cols < N
    ok = row_ok[:, None]
    if USE_PDL:  # launched early (programmatic dependent launch): the weight's first columns into L2, then the wait
        if PREFETCH_K > 0:
            lines = tl.minimum(tl.arange(0, PREFETCH_K // 64) * 64, K - 1)
            prefetch_l2(W + cols[:, None].to(tl.int64) * stride_wn + lines[None, :])
        gdc_wait()
        gdc_launch_dependents()
    # the epilogue's positions, rotary rows and slots, loaded before the weight loop so that they arrive during it
    cs, sn, slot = rope_rows(Cos, Sin, Positions, Slots, rows, row_ok, c, stride_cos, stride_sin)
    acc = det_tile(X, W, NW, rows, cols, row_ok, col_ok, K, 0, K, eps, stride_xm, stride_wn,
                   BLOCK_M, BLOCK_N, BLOCK_K, False, NORM, IEEE_DOT, SWAP_AB, LATE_NORM)  # [BLOCK_M, BLOCK_N]
    y = acc.to(W.dtype.element_ty)  # rounded as tfs::det_matmul stores the projection
    rope_store_epilogue(y, cs, sn, slot, rows, ok, c, h, Q_out, K_cache, V_cache, stride_kcs, stride_kch,
                        stride_vcs, stride_vch, HEADS, KV_HEADS, HEAD_DIM, HALF, BLOCK_M, PAIRS)


def det_qkv_rope_store_applies(x: torch.Tensor, w: torch.Tensor, head_dim: int) -> bool:
    """True when the fused kernel serves this layer: Triton runs, the weight's ``tfs::det_matmul`` tile does not
    split K, and each program holds whole column pairs (``head_dim / 2`` a multiple of half its ``BLOCK_N``)."""
    if not (use_triton(x) and x.stride(-1) == 1 and w.is_contiguous() and head_dim % 2 == 0):
        return False
    _, block_n, _, _, _, _, k_per_split = tile_shape(x, w)  # (traced model code: the device is not asked)
    return k_per_split >= w.shape[1] and block_n % 2 == 0 and (head_dim // 2) % (block_n // 2) == 0


def launch_det_qkv_rope_store(x: torch.Tensor, w: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float,
                              cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
                              head_dim: int, pdl: bool = False) -> torch.Tensor:
    """Check and launch (``pdl``: with programmatic dependent launch, from the opaque op)."""
    m, k = x.shape
    n = w.shape[0]
    torch._check(x.stride(-1) == 1 and w.is_contiguous() and w.shape[1] == k,
                 lambda: f"tfs::det_qkv_rope_store: x {tuple(x.shape)} (unit inner stride) vs w {tuple(w.shape)} "
                         f"(contiguous)")
    if norm_weight is not None:
        torch._check(norm_weight.shape == (k,) and norm_weight.is_contiguous(),
                     lambda: "tfs::det_qkv_rope_store: norm_weight [k]")
    check_inputs((m, n), 1, cos, sin, positions, k_cache, v_cache, slots, num_heads, num_kv_heads, head_dim)
    torch._check(not pdl or (HAS_GDC and x.is_cuda),
                 lambda: "tfs::det_qkv_rope_store: pdl needs CUDA and grid dependency control")
    block_m, block_n, block_k, warps, stages, swap, k_per_split = launch_tile(x, w)
    half = head_dim // 2
    torch._check(k_per_split >= k and half % (block_n // 2) == 0,
                 lambda: f"tfs::det_qkv_rope_store: the tile (BLOCK_N {block_n}, K ranges of {k_per_split}) must "
                         f"hold whole column pairs of head_dim {head_dim} and all of K {k}")
    q = torch.empty(m, num_heads, head_dim, dtype=w.dtype, device=x.device)
    nw = norm_weight if norm_weight is not None else w
    wrap_triton(_det_qkv_rope_store_kernel)[(n // block_n * triton.cdiv(m, block_m),)](
        x, w, nw, cos, sin, positions, k_cache, v_cache, slots, q, m, n, k, eps,
        x.stride(0), w.stride(0), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HEADS=num_heads, KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half, NORM=norm_weight is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE_DOT=w.dtype == torch.float32, SWAP_AB=swap,
        LATE_NORM=det_matmul_module.LATE_NORM, USE_PDL=pdl,  # (read here: bench/knobs.py --set changes both ops)
        PREFETCH_K=det_matmul_module.PDL_PREFETCH_K if pdl and w.element_size() == 2 else 0,
        num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}),
    )
    return q


@triton_op("tfs::det_qkv_rope_store", mutates_args=("k_cache", "v_cache"))
def det_qkv_rope_store_op(x: torch.Tensor, w: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float,
                          cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
                          head_dim: int) -> torch.Tensor:
    """x ``[m, hidden]``; w ``[(heads + 2 * kv_heads) * head_dim, hidden]``; norm_weight ``[hidden]`` or None;
    cos / sin / positions / caches / slots as ``tfs::rope_store_kv`` -> q ``[m, heads, head_dim]`` in w's dtype
    (k, v written to the caches)."""
    return launch_det_qkv_rope_store(x, w, norm_weight, eps, cos, sin, positions, k_cache, v_cache, slots,
                                     num_heads, num_kv_heads, head_dim)


def det_qkv_rope_store_reference(x: torch.Tensor, w: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float,
                                 cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                                 k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int,
                                 num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Plain torch: the projection as ``tfs::det_matmul``'s reference, then ``tfs::rope_store_kv``'s."""
    qkv = det_matmul_reference(x, w, norm_weight=norm_weight, eps=eps)
    return rope_store_kv_reference(qkv, cos, sin, positions, k_cache, v_cache, slots, num_heads, num_kv_heads,
                                   head_dim)


register_cpu_reference(det_qkv_rope_store_op, det_qkv_rope_store_reference)


@torch.library.custom_op("tfs::det_qkv_rope_store_pdl", mutates_args=("k_cache", "v_cache"))
def det_qkv_rope_store_pdl_op(x: torch.Tensor, w: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float,
                              cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
                              head_dim: int) -> torch.Tensor:
    """``tfs::det_qkv_rope_store`` with programmatic dependent launch (CUDA, tfs_kernels/pdl.py): an opaque op, which
    inductor calls as it is, so that the launch keeps its PDL attribute inside captured graphs."""
    return launch_det_qkv_rope_store(x, w, norm_weight, eps, cos, sin, positions, k_cache, v_cache, slots,
                                     num_heads, num_kv_heads, head_dim, pdl=True)


det_qkv_rope_store_pdl_op.register_fake(qkv_rope_store_fake)  # (the same arguments and result)


def det_qkv_rope_store(x: torch.Tensor, w: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                       pdl: bool = False) -> torch.Tensor:
    """The op where it applies (:func:`det_qkv_rope_store_applies`; ``pdl``: its PDL variant on CUDA), the
    reference elsewhere."""
    if not det_qkv_rope_store_applies(x, w, head_dim):
        fn = det_qkv_rope_store_reference
    else:
        fn = torch.ops.tfs.det_qkv_rope_store_pdl if pdl and x.is_cuda else torch.ops.tfs.det_qkv_rope_store
    return fn(x, w, norm_weight, eps, cos, sin, positions, k_cache, v_cache, slots, num_heads, num_kv_heads,
              head_dim)
