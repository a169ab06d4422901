"""``tfs::gemv``: ``y = x @ w.T`` for the few rows of a decode step, streaming the weight once at HBM speed.

At batch 1-16 a linear layer is a matrix-vector product bound by reading the weight; cuBLAS reaches about 88% of
the copy bandwidth there and needs a separate split-K reduction for the tall-K shapes. This kernel gives each
program ``BLOCK_N`` whole rows of the weight (no split-K, no second kernel) and fuses what a decoder layer does
around its linears, so that a layer runs in fewer kernels:

- ``norm_weight``: RMSNorm of ``x`` (each program computes the rows' RMS from ``x`` itself: before the product,
  or for one row, while the weight streams and applied to the sums, ``LATE_NORM``),
- ``silu_mul``: ``x = [gate | up]`` and the product takes ``silu(gate) * up`` (the MLP's down projection),
- ``residual``: ``y = residual + x @ w.T`` (the layer's residual stream).

The rounding follows the unfused torch code (the normalised row and the activation are rounded to x's dtype, the
product to the output dtype before the residual add), except that one row's RMSNorm scales the product's float32
sums (``LATE_NORM``); the summation order differs from cuBLAS's. One row (``BLOCK_M = 1``) accumulates with FMAs;
2-16 rows use ``tl.dot`` on a 16-row tile (exact float32 products for float32 weights).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from kernels.dispatch import register_cpu_reference, use_triton
from kernels.online_softmax import dot
from kernels.pdl import HAS_GDC, gdc_launch_dependents, gdc_wait, prefetch_l2

MAX_ROWS = 16  # the op serves up to this many rows of x; larger batches go to the GEMM library
PREFETCH_CHOICES = (64, 128, 256, 512, 1024, 2048, 4096)  # the L2 prefetch windows a PDL launch may take

# (BLOCK_N, BLOCK_K, num_warps, num_stages) for one row, by the weight's shape class, from
# `python bench/tune_gemv.py --rows 1` on an H200 (docs/PERFORMANCE.md): the sweep's best for Llama-3-8B's qkv and
# lm_head (no fusion: the final norm runs before the logits rows are picked); gate_up (RMSNorm fused in,
# LATE_NORM) and down (SiLU-mul and residual fused in) from `--fused`. o_proj's from the 8B decode step with PDL
# (twelfth session): with its preload it needs programs light enough to be resident during the attention; the
# sweep alone preferred (16, 1024, 4, 4) (3160 GB/s against 3038 for (8, 512, 4, 3)). The plain (non-PDL) launch
# shares it, since the PDL and plain ops must agree bit for bit; the plain 8B step was not re-measured with it.
# Several rows ("rows", the tl.dot path): one untuned configuration (the 8-row sweep has not run yet).
CUDA_LAUNCH = {
    "tall": (8, 1024, 4, 3),  # k > n: the MLP's down projection
    "square": (8, 1024, 4, 3),  # n == k, small: o_proj (with PDL_PRELOAD and the merge's early trigger)
    "wide": (8, 512, 4, 3),  # k < n < 4k: qkv
    "very_wide": (8, 1024, 4, 3),  # 4k <= n < 16k: gate_up
    "vocab": (16, 256, 4, 3),  # n >= 16k: lm_head
    "rows": (16, 256, 4, 3),
}
# One row with RMSNorm: scale by 1/rms(x) after the product, y = ((x * nw) @ w.T) / rms(x), with the sum of squares
# accumulated in the weight loop, instead of a pass over x before the weight starts streaming. Faster on an H200
# (qkv 3186 -> 3327 GB/s, gate_up 3939 -> 4104, `bench/tune_gemv.py --fused [--norm-first]`, docs/PERFORMANCE.md);
# the normalised row is not rounded to x's dtype as the unfused code does.
LATE_NORM = True


@triton.jit
def _load_x(X, x_rows, offs_k, m_ok, k_ok, K, rstd, NW,
            NORM: tl.constexpr, SILU_MUL: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """The ``[BLOCK_M, BLOCK_K]`` chunk of the product's left operand, prologue applied, in ``OUT_DTYPE``."""
    ok = m_ok[:, None] & k_ok[None, :]
    ptr = X + x_rows[:, None] + offs_k[None, :]
    x = tl.load(ptr, mask=ok, other=0.0)
    if SILU_MUL:
        gate = x.to(tl.float32)
        up = tl.load(ptr + K, mask=ok, other=0.0)
        act = (gate * tl.sigmoid(gate)).to(up.dtype)  # F.silu rounds to the input dtype
        x = act * up
    if NORM:
        nw = tl.load(NW + offs_k, mask=k_ok, other=0.0)
        xn = (x.to(tl.float32) * rstd[:, None]).to(X.dtype.element_ty)  # RMSNorm: weight * (x * rstd).to(x.dtype)
        x = nw[None, :] * xn
    return x.to(OUT_DTYPE)


@triton.jit
def _accumulate(acc, ss_late, w, X, NW, x_rows, m_ok, offs_k, k_ok, K, rstd,
                NORM: tl.constexpr, SILU_MUL: tl.constexpr, LATE_NORM: tl.constexpr, BLOCK_M: tl.constexpr,
                IEEE_DOT: tl.constexpr):
    """One K chunk of the product: ``acc`` += x chunk (prologue applied) times the weight chunk ``w``
    ``[BLOCK_N, BLOCK_K]``; with ``LATE_NORM``, ``ss_late`` accumulates x's squares."""
    if LATE_NORM:  # the RMS of x accumulates with the product; 1/rms scales the sums at the end
        xr = tl.load(X + x_rows[:, None] + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        ss_late += xr * xr
        nw = tl.load(NW + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        x = xr * nw[None, :]
    else:
        x = _load_x(X, x_rows, offs_k, m_ok, k_ok, K, rstd, NW, NORM, SILU_MUL,
                    w.dtype)  # [BLOCK_M, BLOCK_K]
    if BLOCK_M == 1:
        acc += w.to(tl.float32) * x.to(tl.float32)
    else:
        acc += dot(x, tl.trans(w), IEEE_DOT)
    return acc, ss_late


@triton.jit
def gemv_prologue(W, N, K, stride_wn, offs_n, USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRELOAD: tl.constexpr = False):
    """What a program does before its product: with ``USE_PDL``, the launch's wait (after an L2 prefetch of the
    weight rows ``offs_n``' first ``PREFETCH_K`` columns; with ``PRELOAD``, the first ``BLOCK_K`` columns are loaded
    into registers before the wait and the prefetch takes the ``PREFETCH_K`` after them). Returns the preloaded
    chunk ``[BLOCK_N, BLOCK_K]`` (zeros without ``PRELOAD``) for :func:`gemv_tile`. A kernel loads what its
    epilogue needs from earlier kernels (a residual, RoPE's positions) between the two, so that the loads complete
    during the weight loop instead of adding a round trip after it."""
    tl.static_assert(not PRELOAD or USE_PDL, "PRELOAD: only before a PDL launch's wait")
    n_ok = offs_n < N
    offs_k0 = tl.arange(0, BLOCK_K)
    w_first = tl.zeros((BLOCK_N, BLOCK_K), W.dtype.element_ty)
    if PRELOAD:  # the first chunk of the weight rows, held in registers across the wait
        w_first = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k0[None, :],
                          mask=n_ok[:, None] & (offs_k0 < K)[None, :], other=0.0)
    if USE_PDL:  # launched early (programmatic dependent launch): wait for the kernel that wrote x
        if PREFETCH_K > 0:  # meanwhile, pull the start of this program's weight rows into L2
            # one prefetch per 128-byte line (64 bf16), clamped to the weight's last row and column
            lines = tl.minimum(tl.arange(0, PREFETCH_K // 64) * 64 + (BLOCK_K if PRELOAD else 0), K - 1)
            prefetch_l2(W + tl.minimum(offs_n, N - 1)[:, None].to(tl.int64) * stride_wn + lines[None, :])
        gdc_wait()
        # the next kernel may launch now: its programs wait too, and prefetch their weights meanwhile (letting it
        # launch after the weight loop instead made the 8B step 4.48 ms instead of 3.94: docs/PERFORMANCE.md)
        gdc_launch_dependents()
    return w_first


@triton.jit
def gemv_tile(X, W, NW, M, N, K, eps, x_rows, stride_wn, offs_n, w_first, NORM: tl.constexpr,
              SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, IEEE_DOT: tl.constexpr, LATE_NORM: tl.constexpr, PRELOAD: tl.constexpr = False):
    """``(x @ w[offs_n].T)`` ``[BLOCK_M, BLOCK_N]`` in float32 with the prologue (RMSNorm or SiLU-mul) applied,
    rows of w ``offs_n`` ``[BLOCK_N]`` (any order), after :func:`gemv_prologue` (``w_first``: its preloaded chunk,
    used with ``PRELOAD``). Row ``m`` of x starts at ``X + x_rows[m]`` (``[BLOCK_M]`` element offsets; every
    caller passes ``m * stride``: a gathered row costs each program a round trip before its first x load,
    docs/PERFORMANCE.md, nineteenth session). Shared by ``tfs::gemv``, ``tfs::qkv_rope_store`` and
    ``tfs::lm_head``."""
    tl.static_assert(not LATE_NORM or (BLOCK_M == 1 and NORM and not SILU_MUL), "LATE_NORM: one row, RMSNorm only")
    eps = tl.cast(eps, tl.float32)  # inductor passes float scalars as float64, a direct launch as float32: same math
    n_ok = offs_n < N
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    offs_k0 = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    rstd = tl.zeros((BLOCK_M,), tl.float32)
    ss_late = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)  # LATE_NORM: sum of squares of x, by column
    if NORM and not LATE_NORM:  # the RMS of each row of x, before its first use
        ss = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(X + x_rows[:, None] + offs_k[None, :],
                         mask=m_ok[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32)
            ss += xv * xv
        rstd = tl.rsqrt(tl.sum(ss, axis=1) / K + eps)
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if PRELOAD:  # the first chunk's product, from the registers
        acc, ss_late = _accumulate(acc, ss_late, w_first, X, NW, x_rows, m_ok, offs_k0, offs_k0 < K, K, rstd, NORM,
                                   SILU_MUL, LATE_NORM, BLOCK_M, IEEE_DOT)
    for k0 in range(BLOCK_K if PRELOAD else 0, K, BLOCK_K):
        offs_k = k0 + offs_k0
        k_ok = offs_k < K
        if EVEN_K:  # no K mask on the weight (the x loads keep theirs: always true here)
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)  # [BLOCK_N, BLOCK_K]
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc, ss_late = _accumulate(acc, ss_late, w, X, NW, x_rows, m_ok, offs_k, k_ok, K, rstd, NORM, SILU_MUL,
                                   LATE_NORM, BLOCK_M, IEEE_DOT)
    if BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
    else:
        out = acc  # [BLOCK_M, BLOCK_N]
    if LATE_NORM:
        out = out * tl.rsqrt(tl.sum(ss_late, axis=1) / K + eps)[:, None]
    return out


@triton.jit
def _gemv_kernel(
    X, W, Y, R, NW, M, N, K, eps, stride_xm, stride_wn, stride_ym, stride_rm,
    NORM: tl.constexpr, SILU_MUL: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    IEEE_DOT: tl.constexpr, LATE_NORM: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr,
    PRELOAD: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N),); one program computes y[:, n0:n0 + BLOCK_N] from whole rows of w
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    w_first = gemv_prologue(W, N, K, stride_wn, offs_n, USE_PDL, PREFETCH_K, BLOCK_N, BLOCK_K, PRELOAD)
    r = tl.zeros((BLOCK_M, BLOCK_N), R.dtype.element_ty)
    if HAS_RESIDUAL:  # loaded before the weight loop (after the wait: an earlier kernel wrote it), not after it
        r = tl.load(R + offs_m[:, None] * stride_rm + offs_n[None, :], mask=ok, other=0.0)
    out = gemv_tile(X, W, NW, M, N, K, eps, offs_m * stride_xm, stride_wn, offs_n, w_first, NORM, SILU_MUL, BLOCK_M,
                    BLOCK_N, BLOCK_K, EVEN_K, IEEE_DOT, LATE_NORM, PRELOAD).to(Y.dtype.element_ty)
    if HAS_RESIDUAL:
        out = (out.to(tl.float32) + r.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], out, mask=ok)


# columns of each program's weight rows pulled into L2 before a PDL launch waits (after the preloaded chunk, with
# PDL_PRELOAD), by launch class: 512, the 32-layer chain's best (`python bench/tune_gemv.py --rows 1 --chain-only`);
# gate_up (very_wide) 1024, the 8B decode step's best (its programs launch while o_proj streams from registers and
# L2: 3822-3825 us against 3827-3829 with 512, alternating; 2048 for gate_up, 1024-4096 for o_proj, 1024 for qkv
# or down were slower: docs/PERFORMANCE.md, thirteenth session). A power of two from 64 to 4096 (PREFETCH_CHOICES);
# a window past the row's end is clamped to its last line.
PDL_PREFETCH_K: dict[str, int] = {**dict.fromkeys(CUDA_LAUNCH, 512), "very_wide": 1024}
# launch classes whose PDL launches also load their first BLOCK_K weight columns into registers before the wait,
# so that the weight streams while the kernel before finishes: qkv (after down), down (after gate_up) and o_proj,
# which the split-K merge lets launch while the partial kernel runs (kernels/split_kv_merge.py
# MERGE_EARLY_TRIGGER). Not gate_up: its programs launch while o_proj streams and slowed it down (8B decode step:
# docs/PERFORMANCE.md, twelfth session).
PDL_PRELOAD: tuple[str, ...] = ("wide", "tall", "square")


def launch_class(m: int, n: int, k: int) -> str:
    """The :data:`CUDA_LAUNCH` class of an ``[m, k] x [n, k]^T`` product."""
    if m > 1:
        return "rows"
    if k > n:
        return "tall"
    if n == k:
        return "square"
    if n < 4 * k:
        return "wide"
    return "very_wide" if n < 16 * k else "vocab"


def launch_params(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an ``[m, k] x [n, k]^T`` product on CUDA."""
    return CUDA_LAUNCH[launch_class(m, n, k)]


def pdl_options(m: int, n: int, k: int, element_size: int, pdl: bool = True) -> tuple[int, bool]:
    """(prefetch_k, preload) of a launch of this product, as the model's PDL ops take them by launch class: the
    weight columns prefetched into L2 before the wait (:data:`PDL_PREFETCH_K`; 0 unless the weight is 16-bit, as
    the prefetch counts 128-byte lines of 64 elements) and whether the first weight chunk is loaded before it
    (:data:`PDL_PRELOAD`). Neither without ``pdl``."""
    if not pdl:
        return 0, False
    cls = launch_class(m, n, k)
    return (PDL_PREFETCH_K[cls] if element_size == 2 else 0), cls in PDL_PRELOAD


def launch_gemv(x: torch.Tensor, w: torch.Tensor, residual: Optional[torch.Tensor],
                norm_weight: Optional[torch.Tensor], eps: float, silu_mul: bool,
                launch: Optional[tuple[int, int, int, int]] = None, pdl: bool = False,
                prefetch_k: Optional[int] = 0, preload: Optional[bool] = False) -> torch.Tensor:
    """Launch the kernel (``launch`` overrides the tuned parameters; the tuner uses it).

    ``pdl``: programmatic dependent launch (Hopper+), after an L2 prefetch of the first ``prefetch_k`` columns of
    the program's weight rows; ``preload``: the first ``BLOCK_K`` columns loaded into registers before the wait
    (None for either: as ``tfs::gemv_pdl`` does, by launch class, :data:`PDL_PREFETCH_K` / :data:`PDL_PRELOAD`).
    Only for direct launches (``tfs::gemv_pdl``, bench/tune_gemv.py's chain): inside ``tfs::gemv`` under
    torch.compile, inductor launches the kernel and cannot pass ``launch_pdl``."""
    m = x.shape[0]
    n, k = w.shape
    torch._check(m <= MAX_ROWS, lambda: f"tfs::gemv serves at most {MAX_ROWS} rows, got {m}")
    torch._check(not (silu_mul and norm_weight is not None), lambda: "tfs::gemv: silu_mul with norm_weight")
    torch._check(x.shape[1] == (2 * k if silu_mul else k), lambda: f"tfs::gemv: x {tuple(x.shape)} vs w {(n, k)}")
    torch._check(x.stride(-1) == 1 and w.is_contiguous(), lambda: "tfs::gemv: x needs unit inner stride, w contiguous")
    if residual is not None:
        torch._check(residual.shape == (m, n) and residual.stride(-1) == 1, lambda: "tfs::gemv: residual [m, n]")
    if norm_weight is not None:
        torch._check(norm_weight.shape == (k,) and norm_weight.is_contiguous(), lambda: "tfs::gemv: norm_weight [k]")
    torch._check(not pdl or HAS_GDC, lambda: "tfs::gemv: pdl needs a Triton with grid dependency control")
    by_class = pdl_options(m, n, k, w.element_size(), pdl)  # as the model's PDL launches
    prefetch_k = by_class[0] if prefetch_k is None else prefetch_k
    preload = by_class[1] if preload is None else preload
    torch._check(not preload or pdl, lambda: "tfs::gemv: preload needs pdl")
    torch._check(prefetch_k == 0 or (pdl and w.element_size() == 2 and prefetch_k in PREFETCH_CHOICES),
                 lambda: "tfs::gemv: prefetch_k needs pdl, a 16-bit weight and a power of two from 64 to 4096")
    block_n, block_k, warps, stages = launch or launch_params(m, n, k)
    if not x.is_cuda:  # the interpreter: small shapes, small tiles
        block_n, block_k = min(block_n, 16), min(block_k, 64)
    block_m = 1 if m == 1 else 16
    y = torch.empty(m, n, dtype=w.dtype, device=x.device)
    res = residual if residual is not None else y
    nw = norm_weight if norm_weight is not None else w
    wrap_triton(_gemv_kernel)[(triton.cdiv(n, block_n),)](
        x, w, y, res, nw, m, n, k, eps, x.stride(0), w.stride(0), y.stride(0), res.stride(0),
        NORM=norm_weight is not None, SILU_MUL=silu_mul, HAS_RESIDUAL=residual is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        IEEE_DOT=w.dtype == torch.float32, LATE_NORM=LATE_NORM and norm_weight is not None and m == 1,
        USE_PDL=pdl, PREFETCH_K=prefetch_k, PRELOAD=preload, num_warps=warps, num_stages=stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return y


@triton_op("tfs::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, w: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: Optional[torch.Tensor],
            eps: float, silu_mul: bool) -> torch.Tensor:
    """x ``[m, k]`` (``[m, 2k]`` with ``silu_mul``), m <= MAX_ROWS, unit inner stride; w ``[n, k]`` contiguous;
    residual ``[m, n]`` or None; norm_weight ``[k]`` or None -> ``[m, n]`` in w's dtype."""
    return launch_gemv(x, w, residual, norm_weight, eps, silu_mul)


@torch.library.custom_op("tfs::gemv_pdl", mutates_args=())
def gemv_pdl_op(x: torch.Tensor, w: torch.Tensor, residual: Optional[torch.Tensor],
                norm_weight: Optional[torch.Tensor], eps: float, silu_mul: bool) -> torch.Tensor:
    """``tfs::gemv`` with programmatic dependent launch (CUDA, kernels/pdl.py) after an L2 prefetch of the first
    ``PDL_PREFETCH_K`` weight columns (16-bit weights) and with ``PDL_PRELOAD``, by launch class: an opaque op, which
    inductor calls as it is, so that the launch keeps its PDL attribute inside captured graphs."""
    return launch_gemv(x, w, residual, norm_weight, eps, silu_mul, pdl=True, prefetch_k=None, preload=None)


@gemv_pdl_op.register_fake
def _gemv_pdl_fake(x: torch.Tensor, w: torch.Tensor, *args: object) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0], dtype=w.dtype)


def gemv_reference(x: torch.Tensor, w: torch.Tensor, residual: Optional[torch.Tensor],
                   norm_weight: Optional[torch.Tensor], eps: float, silu_mul: bool) -> torch.Tensor:
    """Plain torch, in the order the unfused decoder layer computes it."""
    if silu_mul:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    if norm_weight is not None:
        xf = x.float()
        x = norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = F.linear(x.to(w.dtype), w)
    return y if residual is None else residual + y


register_cpu_reference(gemv_op, gemv_reference)


def gemv_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when :func:`gemv` runs the kernel for this product: a CUDA (or interpreted) decode-sized batch."""
    return use_triton(x) and x.shape[0] <= MAX_ROWS and x.stride(-1) == 1 and w.is_contiguous()


def gemv(x: torch.Tensor, w: torch.Tensor, residual: Optional[torch.Tensor] = None,
         norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6, silu_mul: bool = False,
         pdl: bool = False) -> torch.Tensor:
    """The op where Triton runs and the batch is small enough (see :func:`gemv_applies`; ``pdl``: its PDL variant
    on CUDA), the reference elsewhere."""
    if silu_mul and norm_weight is not None:
        raise ValueError("gemv: silu_mul and norm_weight cannot be combined")
    fn = torch.ops.tfs.gemv if gemv_applies(x, w) else gemv_reference
    if pdl and x.is_cuda and fn is not gemv_reference:
        fn = torch.ops.tfs.gemv_pdl
    return fn(x, w, residual, norm_weight, eps, silu_mul)
