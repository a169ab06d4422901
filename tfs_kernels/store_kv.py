"""``tfs::store_kv``: write this forward's K/V into the paged pool at their slots (in place)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from tfs_kernels.dispatch import register_cpu_reference, use_triton


@triton.jit
def _store_kv_kernel(
    K, V, K_cache, V_cache, Slots,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_kcs, stride_kch, stride_vcs, stride_vch,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # grid: (num_tokens,); one program copies one token's [kv_heads, head_dim] K and V
    i = tl.program_id(0)
    slot = tl.load(Slots + i)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (h < KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(K + i * stride_kt + h * stride_kh + d, mask=ok)
    tl.store(K_cache + slot * stride_kcs + h * stride_kch + d, k.to(K_cache.dtype.element_ty), mask=ok)
    v = tl.load(V + i * stride_vt + h * stride_vh + d, mask=ok)
    tl.store(V_cache + slot * stride_vcs + h * stride_vch + d, v.to(V_cache.dtype.element_ty), mask=ok)


@triton_op("tfs::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv_op(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> None:
    """k_cache / v_cache ``[num_slots, kv_heads, dim]`` (written); slots ``[n]`` int64; k / v ``[n, kv_heads, dim]``
    (any dtype, any row stride; cast to the cache dtype)."""
    n, kv_heads, dim = k.shape
    wrap_triton(_store_kv_kernel)[(n,)](
        k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        KV_HEADS=kv_heads, HEAD_DIM=dim, BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(dim), num_warps=4 if kv_heads * dim >= 1024 else 1,
    )


def store_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> None:
    """Plain torch: ``index_copy_`` along the slot axis."""
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


register_cpu_reference(store_kv_op, store_kv_reference)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """The op where Triton runs (see :mod:`tfs_kernels.dispatch`), the reference elsewhere."""
    fn = torch.ops.tfs.store_kv if use_triton(k) else store_kv_reference
    fn(k_cache, v_cache, slots, k, v)
