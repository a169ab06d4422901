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
product to the output dtype before the residual add), except that on the CUDA-core tiles the RMSNorm scales the
product's float32 sums (``LATE_NORM``); the summation order differs from cuBLAS's. One row (``BLOCK_M = 1``)
accumulates with FMAs; 2-16 rows use ``tl.dot`` on a 16-row tile (exact float32 products for float32 weights), or
with ``ROWS_DOT`` off the CUDA cores on a tile of the next power of two rows.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from tfs_kernels.dispatch import register_cpu_reference, use_triton
from tfs_kernels.gemv_tile import gemv_prologue, gemv_tile
from tfs_kernels.pdl import HAS_GDC

MAX_ROWS = 16  # the op serves up to this many rows of x; larger batches go to the GEMM library
PREFETCH_CHOICES = (64, 128, 256, 512, 1024, 2048, 4096)  # the L2 prefetch windows a PDL launch may take

# (BLOCK_N, BLOCK_K, num_warps, num_stages) for one row, by the weight's shape class, from
# `python bench/tune_gemv.py --rows 1` on an H200 (docs/PERFORMANCE.md): the sweep's best for Llama-3-8B's qkv and
# lm_head (no fusion: the final norm runs before the logits rows are picked); gate_up (RMSNorm fused in,
# LATE_NORM) and down (SiLU-mul and residual fused in) from `--fused`. o_proj's from the 8B decode step with PDL
# (2026-12-01): with its preload it needs programs light enough to be resident during the attention; the
# sweep alone preferred (16, 1024, 4, 4) (3160 GB/s against 3038 for (8, 512, 4, 3)). The plain (non-PDL) launch
# shares it, since the PDL and plain ops must agree bit for bit; the plain 8B step was not re-measured with it.
# Several rows ("rows", the tl.dot path): one configuration for every shape, the sweep's best worst case at 2 and 8
# rows (`python bench/tune_gemv.py --rows 2 8 --no-chain --block-n 8 16 32 --block-k 128 256 512 --warps 4 8
# --stages 3 4`, H200, 2026-12-04: within 1.07x / 1.09x of each shape's best, 0.91-1.17x cuBLAS's bandwidth per
# shape, docs/PERFORMANCE.md; the earlier (16, 256, 4, 3) was not among the top four).
CUDA_LAUNCH = {
    "tall": (8, 1024, 4, 3),  # k > n: the MLP's down projection
    "square": (8, 1024, 4, 3),  # n == k, small: o_proj (with PDL_PRELOAD and the merge's early trigger)
    "wide": (8, 512, 4, 3),  # k < n < 4k: qkv
    "very_wide": (8, 1024, 4, 3),  # 4k <= n < 16k: gate_up
    "vocab": (16, 256, 4, 3),  # n >= 16k: lm_head
    "rows": (32, 256, 4, 4),
    "few_rows": (8, 128, 4, 3),  # several rows on the CUDA cores (ROWS_DOT off); untuned
}
# Several rows (2-16): True, a 16-row tl.dot tile ("rows"); False, the rows on the CUDA cores in a tile of the next
# power of two rows ("few_rows", with the RMSNorm after the product as one row's, LATE_NORM). A constant so that
# bench/knobs.py --set can compare the two in one commit.
ROWS_DOT = True
# One row with RMSNorm: scale by 1/rms(x) after the product, y = ((x * nw) @ w.T) / rms(x), with the sum of squares
# accumulated in the weight loop, instead of a pass over x before the weight starts streaming. Faster on an H200
# (qkv 3186 -> 3327 GB/s, gate_up 3939 -> 4104, `bench/tune_gemv.py --fused [--norm-first]`, docs/PERFORMANCE.md);
# the normalised row is not rounded to x's dtype as the unfused code does.
LATE_NORM = True


@triton.jit
def _gemv_kernel(
    X, W, Y, R, NW, M, N, K, eps, stride_xm, stride_wn, stride_ym, stride_rm,
    NORM: tl.constexpr, SILU_MUL: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    IEEE_DOT: tl.constexpr, LATE_NORM: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr,
    PRELOAD: tl.constexpr, W_EF: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N),); one program computes y[:, n0:n0 + BLOCK_N] from whole rows of w
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    w_first = gemv_prologue(W, N, K, stride_wn, offs_n, USE_PDL, PREFETCH_K, BLOCK_N, BLOCK_K, PRELOAD, W_EF)
    r = tl.zeros((BLOCK_M, BLOCK_N), R.dtype.element_ty)
    if HAS_RESIDUAL:  # loaded before the weight loop (after the wait: an earlier kernel wrote it), not after it
        r = tl.load(R + offs_m[:, None] * stride_rm + offs_n[None, :], mask=ok, other=0.0)
    out = gemv_tile(X, W, NW, M, N, K, eps, offs_m * stride_xm, stride_wn, offs_n, w_first, NORM, SILU_MUL, BLOCK_M,
                    BLOCK_N, BLOCK_K, EVEN_K, IEEE_DOT, LATE_NORM, PRELOAD, W_EF).to(Y.dtype.element_ty)
    if HAS_RESIDUAL:
        out = (out.to(tl.float32) + r.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], out, mask=ok)


# columns of each program's weight rows pulled into L2 before a PDL launch waits (after the preloaded chunk, with
# PDL_PRELOAD), by launch class: 512, the 32-layer chain's best (`python bench/tune_gemv.py --rows 1 --chain-only`);
# gate_up (very_wide) 1024, the 8B decode step's best (its programs launch while o_proj streams from registers and
# L2: 3822-3825 us against 3827-3829 with 512, alternating; 2048 for gate_up, 1024-4096 for o_proj, 1024 for qkv
# or down were slower: docs/PERFORMANCE.md, 8B decode step, 2026-12-01). A power of two from 64 to 4096
# (PREFETCH_CHOICES); a window past the row's end is clamped to its last line.
PDL_PREFETCH_K: dict[str, int] = {**dict.fromkeys(CUDA_LAUNCH, 512), "very_wide": 1024}
# launch classes whose PDL launches also load their first BLOCK_K weight columns into registers before the wait,
# so that the weight streams while the kernel before finishes: qkv (after down), down (after gate_up) and o_proj,
# which the split-K merge lets launch while the partial kernel runs (tfs_kernels/split_kv_merge.py
# MERGE_EARLY_TRIGGER). Not gate_up: its programs launch while o_proj streams and slowed it down (8B decode step:
# docs/PERFORMANCE.md, 2026-12-01).
PDL_PRELOAD: tuple[str, ...] = ("wide", "tall", "square")
# The weight stream's loads (tfs::gemv, tfs::qkv_rope_store, tfs::lm_head) at L2's evict-first priority: a step
# reads each weight line once, so they leave room in L2 for what it reads again soon (the next kernel's prefetched
# first columns, activations). 8B decode step 3801-3803 us instead of 3808-3810 (docs/PERFORMANCE.md, 8B decode
# step, 9b2492e; the PDL prefetches at evict-last on top gained nothing, and with evict-first, wider prefetch windows
# were slower still)
WEIGHT_EVICT_FIRST = True


def stream_hints() -> dict[str, object]:
    """The weight stream's L2 hint as the kernels' constexpr ``W_EF``."""
    return {"W_EF": WEIGHT_EVICT_FIRST}


def block_rows(m: int) -> int:
    """The kernels' ``BLOCK_M`` for ``m`` rows of x: 1, a power of two below 16 (the CUDA-core tile) or 16 (the
    tl.dot tile), by :data:`ROWS_DOT`."""
    return 1 if m == 1 else 16 if ROWS_DOT else max(2, triton.next_power_of_2(m))


def late_norm(m: int, norm: bool) -> bool:
    """Whether a launch of ``m`` rows with (``norm``) a fused RMSNorm applies it after the product (``LATE_NORM``):
    on the CUDA-core tiles only."""
    return LATE_NORM and norm and block_rows(m) < 16


def launch_class(m: int, n: int, k: int) -> str:
    """The :data:`CUDA_LAUNCH` class of an ``[m, k] x [n, k]^T`` product."""
    if m > 1:
        return "rows" if ROWS_DOT else "few_rows"
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
    y = torch.empty(m, n, dtype=w.dtype, device=x.device)
    res = residual if residual is not None else y
    nw = norm_weight if norm_weight is not None else w
    wrap_triton(_gemv_kernel)[(triton.cdiv(n, block_n),)](
        x, w, y, res, nw, m, n, k, eps, x.stride(0), w.stride(0), y.stride(0), res.stride(0),
        NORM=norm_weight is not None, SILU_MUL=silu_mul, HAS_RESIDUAL=residual is not None,
        BLOCK_M=block_rows(m), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        IEEE_DOT=w.dtype == torch.float32, LATE_NORM=late_norm(m, norm_weight is not None),
        USE_PDL=pdl, PREFETCH_K=prefetch_k, PRELOAD=preload, **stream_hints(), num_warps=warps, num_stages=stages,
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
    """``tfs::gemv`` with programmatic dependent launch (CUDA, tfs_kernels/pdl.py) after an L2 prefetch of the first
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
