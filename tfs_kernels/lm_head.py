"""``tfs::lm_head``: the model's final RMSNorm and its float32 logits in one kernel, for a decode-sized batch.

The unfused tail of a decode step is three kernels after the last layer: the final norm of every row (and the pick
of the logits' rows), the lm_head's product, and the conversion of the logits to float32. This kernel is
``tfs::gemv``'s (:func:`tfs_kernels.gemv_tile.gemv_tile`) over every row of x (the logits of every token: what a uniform
batch asks for) with the RMSNorm fused in (after the product on the CUDA-core tiles, as ``LATE_NORM`` does everywhere),
storing float32 logits rounded to the weight's dtype first, as ``.float()`` of the unfused product gives them;
programs ``p < m`` also write row ``p`` of the hidden states, ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``
as ``RMSNorm.forward`` computes it. With PDL (``tfs::lm_head_pdl``) the lm_head then launches while the last layer
finishes and streams its weight from the start, where the unfused tail had it wait for a norm kernel that could not
let it launch early.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from tfs_kernels.dispatch import register_cpu_reference, use_triton
from tfs_kernels.gemv import MAX_ROWS, block_rows, late_norm, launch_params, pdl_options, stream_hints
from tfs_kernels.gemv_tile import gemv_prologue, gemv_tile
from tfs_kernels.pdl import HAS_GDC


@triton.jit
def _lm_head_kernel(
    X, W, NW, Logits, Hidden, M, N, K, eps, stride_xm, stride_wn, stride_lm, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    IEEE_DOT: tl.constexpr, LATE_NORM: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr,
    W_EF: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N),); program p: logits[:, p * BLOCK_N:][:BLOCK_N], and hidden row p when p < M
    # NOTE: every row of x, not rows picked by an index: a gathered row's offset is one more round trip before each
    # program's first x load (the loop does not pipeline across iterations), and the lm_head took 260 us, not 238
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    w_first = gemv_prologue(W, N, K, stride_wn, offs_n, USE_PDL, PREFETCH_K, BLOCK_N, BLOCK_K, False, W_EF)
    if pid < M:  # the hidden states, one row per early program (x came from the kernel before: after the wait),
        # in BLOCK_K chunks: two passes over the row, from L2
        offs_c = tl.arange(0, BLOCK_K)
        ss = tl.zeros((BLOCK_K,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xf = tl.load(X + pid * stride_xm + k0 + offs_c, mask=k0 + offs_c < K, other=0.0).to(tl.float32)
            ss += xf * xf
        rstd = tl.rsqrt(tl.sum(ss, axis=0) / K + tl.cast(eps, tl.float32))
        for k0 in range(0, K, BLOCK_K):
            c_ok = k0 + offs_c < K
            xf = tl.load(X + pid * stride_xm + k0 + offs_c, mask=c_ok, other=0.0).to(tl.float32)
            xn = (xf * rstd).to(X.dtype.element_ty)  # rounded to x's dtype before the weight, as RMSNorm.forward does
            nw = tl.load(NW + k0 + offs_c, mask=c_ok, other=0.0).to(tl.float32)
            tl.store(Hidden + pid * stride_hm + k0 + offs_c, (nw * xn.to(tl.float32)).to(Hidden.dtype.element_ty),
                     mask=c_ok)
    out = gemv_tile(X, W, NW, M, N, K, eps, offs_m * stride_xm, stride_wn, offs_n, w_first, True, False, BLOCK_M,
                    BLOCK_N, BLOCK_K, EVEN_K, IEEE_DOT, LATE_NORM, False, W_EF)
    ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    # float32 logits, rounded to the weight's dtype first (what .float() of the unfused bf16 product gives)
    tl.store(Logits + offs_m[:, None] * stride_lm + offs_n[None, :], out.to(W.dtype.element_ty).to(tl.float32),
             mask=ok)


def lm_head_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when the kernel serves this call: Triton runs, at most ``MAX_ROWS`` rows, x with a unit inner stride, w
    contiguous and with enough rows for a program per hidden row."""
    return (use_triton(x) and x.shape[0] <= MAX_ROWS and x.stride(-1) == 1 and w.is_contiguous()
            and w.shape[0] >= 16 * x.shape[0])  # BLOCK_N <= 16


def launch_lm_head(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
                   pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Check and launch (``pdl``: with programmatic dependent launch, from the opaque op)."""
    m, k = x.shape
    v = w.shape[0]
    torch._check(m <= MAX_ROWS and x.stride(-1) == 1 and w.is_contiguous() and w.shape[1] == k,
                 lambda: f"tfs::lm_head: x {tuple(x.shape)} (at most {MAX_ROWS} rows, unit inner stride) vs w "
                         f"{tuple(w.shape)} (contiguous)")
    torch._check(norm_weight.shape == (k,) and norm_weight.is_contiguous(), lambda: "tfs::lm_head: norm_weight [k]")
    torch._check(not pdl or HAS_GDC, lambda: "tfs::lm_head: pdl needs a Triton with grid dependency control")
    block_n, block_k, warps, stages = launch_params(m, v, k)
    if not x.is_cuda:  # the interpreter: small shapes, small tiles
        block_n, block_k = min(block_n, 16), min(block_k, 64)
    prefetch_k, _ = pdl_options(m, v, k, w.element_size(), pdl)  # (this kernel never preloads a weight chunk)
    logits = torch.empty(m, v, dtype=torch.float32, device=x.device)
    hidden = torch.empty(m, k, dtype=torch.promote_types(x.dtype, norm_weight.dtype), device=x.device)
    grid = triton.cdiv(v, block_n)
    torch._check(m <= grid, lambda: f"tfs::lm_head: {m} hidden rows need as many programs, the grid has {grid}")
    wrap_triton(_lm_head_kernel)[(grid,)](
        x, w, norm_weight, logits, hidden, m, v, k, eps, x.stride(0), w.stride(0), logits.stride(0), hidden.stride(0),
        BLOCK_M=block_rows(m), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        IEEE_DOT=w.dtype == torch.float32, LATE_NORM=late_norm(m, True), USE_PDL=pdl, PREFETCH_K=prefetch_k,
        **stream_hints(), num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}),
    )
    return logits, hidden


@triton_op("tfs::lm_head", mutates_args=())
def lm_head_op(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
               w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[m <= 16, hidden]`` (the last layer's output), norm_weight ``[hidden]``, w ``[vocab, hidden]`` ->
    (logits ``[m, vocab]`` float32, hidden ``[m, hidden]``: the final norm of every row, in the promoted dtype of x
    and norm_weight)."""
    return launch_lm_head(x, norm_weight, eps, w)


def lm_head_reference(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, as the unfused model: ``RMSNorm.forward``, the product, ``.float()``."""
    xf = x.float()
    hidden = norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return F.linear(hidden.to(w.dtype), w).float(), hidden


register_cpu_reference(lm_head_op, lm_head_reference)


@torch.library.custom_op("tfs::lm_head_pdl", mutates_args=())
def lm_head_pdl_op(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tfs::lm_head`` with programmatic dependent launch (CUDA, tfs_kernels/pdl.py): an opaque op, which inductor
    calls as it is, so that the launch keeps its PDL attribute inside captured graphs."""
    return launch_lm_head(x, norm_weight, eps, w, pdl=True)


@lm_head_pdl_op.register_fake
def _lm_head_pdl_fake(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(x.dtype, norm_weight.dtype)
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32), x.new_empty(x.shape, dtype=dtype)


def lm_head(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
            pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of every row, hidden): the op where it applies (:func:`lm_head_applies`; ``pdl``: its PDL variant on
    CUDA), the reference elsewhere."""
    if not lm_head_applies(x, w):
        return lm_head_reference(x, norm_weight, eps, w)
    fn = torch.ops.tfs.lm_head_pdl if pdl and x.is_cuda else torch.ops.tfs.lm_head
    return fn(x, norm_weight, eps, w)
