"""``tfs::rope_store_kv``: RoPE on q and k plus the KV-cache store of one decoder layer, in one kernel.

Replaces three launches per layer (RoPE on q, RoPE on k, ``tfs::store_kv``) and the per-layer gathers of cos / sin
(the kernel reads the rope tables at each token's position itself: given gathered cos / sin, inductor recomputes the
gather next to each layer's call, two small kernels per layer). Each program takes one token and one
head of the fused qkv projection: a q head is rotated into the returned ``q``, a k head is rotated and written to
its slot of ``k_cache``, a v head is copied to its slot of ``v_cache``. The rounding follows the unfused torch code:
rotation in float32, rounded to qkv's dtype, and only then (k) cast to the cache's dtype.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from tfs_kernels.dispatch import register_cpu_reference, use_triton
from tfs_kernels.pdl import HAS_GDC, gdc_launch_dependents, gdc_wait


@triton.jit
def _rope_store_kv_kernel(
    QKV, Cos, Sin, Positions, K_cache, V_cache, Slots, Q_out,
    stride_qkv, stride_cos, stride_sin, stride_kcs, stride_kch, stride_vcs, stride_vch,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # grid: (n, heads + 2 * kv_heads); program (i, h): token i, column head h of qkv (q heads, then k, then v)
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    ok = d < HALF
    if USE_PDL:  # launched early (tfs_kernels/pdl.py): qkv comes from the kernel before
        gdc_wait()
        gdc_launch_dependents()
    src = QKV + i * stride_qkv + h * HEAD_DIM + d
    x1 = tl.load(src, mask=ok)  # [BLOCK] first half of the head
    x2 = tl.load(src + HALF, mask=ok)  # [BLOCK] second half
    if h < HEADS + KV_HEADS:  # q or k: rotate-half RoPE in float32, rounded to qkv's dtype
        pos = tl.load(Positions + i).to(tl.int64)
        c = tl.load(Cos + pos * stride_cos + d, mask=ok).to(tl.float32)
        s = tl.load(Sin + pos * stride_sin + d, mask=ok).to(tl.float32)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        r1 = (a * c - b * s).to(QKV.dtype.element_ty)
        r2 = (b * c + a * s).to(QKV.dtype.element_ty)
        if h < HEADS:
            dst = Q_out + (i * HEADS + h) * HEAD_DIM + d
            tl.store(dst, r1, mask=ok)
            tl.store(dst + HALF, r2, mask=ok)
        else:
            slot = tl.load(Slots + i).to(tl.int64)
            dst = K_cache + slot * stride_kcs + (h - HEADS) * stride_kch + d
            tl.store(dst, r1.to(K_cache.dtype.element_ty), mask=ok)
            tl.store(dst + HALF, r2.to(K_cache.dtype.element_ty), mask=ok)
    else:  # v: a plain copy into the cache
        slot = tl.load(Slots + i).to(tl.int64)
        dst = V_cache + slot * stride_vcs + (h - HEADS - KV_HEADS) * stride_vch + d
        tl.store(dst, x1.to(V_cache.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, x2.to(V_cache.dtype.element_ty), mask=ok)


def check_inputs(qkv_shape: Sequence[int], qkv_inner_stride: int, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """The argument checks of ``tfs::rope_store_kv`` (shapes, strides; the projection's by its shape and inner
    stride); each failure is one line naming the argument."""
    n, width = qkv_shape
    half = head_dim // 2
    torch._check(head_dim % 2 == 0, lambda: f"tfs::rope_store_kv: head_dim {head_dim} must be even")
    torch._check(width == (num_heads + 2 * num_kv_heads) * head_dim and qkv_inner_stride == 1,
                 lambda: f"tfs::rope_store_kv: qkv {tuple(qkv_shape)} vs heads {num_heads}+2*{num_kv_heads} "
                         f"of {head_dim}, unit inner stride")
    for name, t in (("cos", cos), ("sin", sin)):
        torch._check(t.dim() == 2 and t.shape[1] == half and t.stride(-1) == 1,
                     lambda: f"tfs::rope_store_kv: {name} table {tuple(t.shape)} must be [max_pos, head_dim // 2 = "
                             f"{half}], unit inner stride")
    torch._check(positions.shape == (n,), lambda: f"tfs::rope_store_kv: positions {tuple(positions.shape)} must be "
                                                  f"[{n}]")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        torch._check(t.dim() == 3 and t.shape[1:] == (num_kv_heads, head_dim) and t.stride(-1) == 1,
                     lambda: f"tfs::rope_store_kv: {name} {tuple(t.shape)} must be [slots, {num_kv_heads}, "
                             f"{head_dim}], unit inner stride")
    torch._check(slots.shape == (n,), lambda: f"tfs::rope_store_kv: slots {tuple(slots.shape)} must be [{n}]")


def launch_rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int,
                         num_kv_heads: int, head_dim: int, pdl: bool = False) -> torch.Tensor:
    """Check and launch (``pdl``: with programmatic dependent launch, from the opaque op; tfs_kernels/pdl.py)."""
    check_inputs(qkv.shape, qkv.stride(-1), cos, sin, positions, k_cache, v_cache, slots, num_heads, num_kv_heads,
                 head_dim)
    torch._check(not pdl or HAS_GDC, lambda: "tfs::rope_store_kv: pdl needs a Triton with grid dependency control")
    n = qkv.shape[0]
    q = torch.empty(n, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    half = head_dim // 2
    block = triton.next_power_of_2(half)
    wrap_triton(_rope_store_kv_kernel)[(n, num_heads + 2 * num_kv_heads)](
        qkv, cos, sin, positions, k_cache, v_cache, slots, q,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HEADS=num_heads, KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half, BLOCK=block, USE_PDL=pdl,
        num_warps=1 if block <= 64 else 2, **({"launch_pdl": True} if pdl else {}),
    )
    return q


@triton_op("tfs::rope_store_kv", mutates_args=("k_cache", "v_cache"))
def rope_store_kv_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int,
                     num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """qkv ``[n, (heads + 2 * kv_heads) * head_dim]`` (unit inner stride, any row stride); cos / sin: the rope
    tables ``[max_pos, head_dim // 2]`` (unit inner stride), read at ``positions`` ``[n]``; k_cache / v_cache
    ``[num_slots, kv_heads, head_dim]`` (written at ``slots``); slots ``[n]`` int64 -> q ``[n, heads, head_dim]``
    in qkv's dtype."""
    return launch_rope_store_kv(qkv, cos, sin, positions, k_cache, v_cache, slots, num_heads, num_kv_heads,
                                head_dim)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[num_tokens, heads, head_dim]``; cos/sin ``[num_tokens, 1, head_dim // 2]`` (rotate-half layout): float32
    math, rounded to x's dtype. The model's RoPE (framework/models/llama.py) and this op's reference."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_store_kv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int,
                            num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Plain torch, as the unfused layer computes it: split, RoPE q and k, ``index_copy_`` k and v."""
    n = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    cos, sin = cos[positions][:, None], sin[positions][:, None]  # [n, 1, head_dim // 2]
    q = apply_rope(q.view(n, num_heads, head_dim), cos, sin)  # [n, heads, head_dim]
    k = apply_rope(k.view(n, num_kv_heads, head_dim), cos, sin)  # [n, kv_heads, head_dim]
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.view(n, num_kv_heads, head_dim).to(v_cache.dtype))
    return q.contiguous()


register_cpu_reference(rope_store_kv_op, rope_store_kv_reference)


@torch.library.custom_op("tfs::rope_store_kv_pdl", mutates_args=("k_cache", "v_cache"))
def rope_store_kv_pdl_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int,
                         num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """``tfs::rope_store_kv`` with programmatic dependent launch (CUDA, tfs_kernels/pdl.py): an opaque op, which
    inductor calls as it is, so that the launch keeps its PDL attribute inside captured graphs."""
    return launch_rope_store_kv(qkv, cos, sin, positions, k_cache, v_cache, slots, num_heads, num_kv_heads,
                                head_dim, pdl=True)


@rope_store_kv_pdl_op.register_fake
def _rope_store_kv_pdl_fake(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int,
                            num_kv_heads: int, head_dim: int) -> torch.Tensor:
    return qkv.new_empty(qkv.shape[0], num_heads, head_dim)


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int,
                  num_kv_heads: int, head_dim: int, pdl: bool = False) -> torch.Tensor:
    """The op where Triton runs (see :mod:`tfs_kernels.dispatch`; ``pdl``: its PDL variant on CUDA), the reference
    elsewhere."""
    fn = torch.ops.tfs.rope_store_kv if use_triton(qkv) else rope_store_kv_reference
    if pdl and qkv.is_cuda:
        fn = torch.ops.tfs.rope_store_kv_pdl
    return fn(qkv, cos, sin, positions, k_cache, v_cache, slots, num_heads, num_kv_heads, head_dim)


class Rope(NamedTuple):
    """One forward's RoPE inputs: ``cos`` / ``sin`` ``[n, 1, head_dim // 2]`` at each token's position (what
    :func:`apply_rope` takes) and the float32 tables ``[max_pos, head_dim // 2]`` with ``positions`` ``[n]`` (what
    ``tfs::rope_store_kv`` takes: it gathers inside the kernel)."""

    cos: torch.Tensor
    sin: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor
    positions: torch.Tensor


def rope_at(cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor) -> Rope:
    """The :class:`Rope` of tokens at ``positions`` from the model's tables."""
    return Rope(cos_table[positions][:, None, :], sin_table[positions][:, None, :], cos_table, sin_table, positions)
