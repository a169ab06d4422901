"""``tfs::det_rmsnorm``: RMSNorm with one program per row and a fixed reduction (model.deterministic).

The mean of squares of a row is one ``tl.sum`` over the whole row (``BLOCK_H``: the hidden size's power of two,
fixed per model) with constant warps, so a row's result is the same whatever the number of rows: inductor's
generated reductions choose their block and warp counts from the shapes they are compiled for, and the decode,
verify and prefill graphs are compiled for different ones. Same formula as :class:`framework.models.llama.RMSNorm`:
``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, in float32 inside.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfs_kernels.dispatch import register_cpu_reference, use_triton


@triton.jit(do_not_specialize=["eps"])
def _det_rmsnorm_kernel(X, Weight, Out, eps, stride_x, stride_o, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr):
    # grid: (rows,); one program normalises one row
    row = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    ok = h < HIDDEN
    x = tl.load(X + row * stride_x + h, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, 0) / HIDDEN
    normed = (xf * (1.0 / tl.sqrt(mean_sq + tl.cast(eps, tl.float32)))).to(X.dtype.element_ty)
    w = tl.load(Weight + h, mask=ok, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(Out + row * stride_o + h, out.to(Out.dtype.element_ty), mask=ok)


@torch.library.custom_op("tfs::det_rmsnorm", mutates_args=())
def det_rmsnorm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x ``[rows, hidden]`` (unit stride along hidden), weight ``[hidden]`` -> ``[rows, hidden]`` in the dtype
    torch's ``weight * x_normed`` has (the promotion of the two)."""
    rows, hidden = x.shape
    torch._check(x.stride(1) == 1, lambda: "det_rmsnorm: rows must have unit stride")
    out = torch.empty((rows, hidden), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    block_h = triton.next_power_of_2(hidden)
    _det_rmsnorm_kernel[(rows,)](
        x, weight, out, eps, x.stride(0), out.stride(0), HIDDEN=hidden, BLOCK_H=block_h,
        num_warps=8 if block_h >= 4096 else 4,
    )
    return out


@det_rmsnorm_op.register_fake
def _det_rmsnorm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


def det_rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain torch, :class:`framework.models.llama.RMSNorm`'s formula (a CPU row reduction over the contiguous last
    dim never splits a row between threads, so it is row-invariant there)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


register_cpu_reference(det_rmsnorm_op, det_rmsnorm_reference)


def det_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The op where Triton runs (see :mod:`tfs_kernels.dispatch`), the reference elsewhere."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    fn = torch.ops.tfs.det_rmsnorm if use_triton(x2) else det_rmsnorm_reference
    return fn(x2, weight, eps).view(x.shape)
