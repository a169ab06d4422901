"""The building blocks of the few-row products that stream a weight once (``tfs::gemv``, ``tfs::qkv_rope_store``,
``tfs::lm_head``): a program's prologue (:func:`gemv_prologue`: the first weight chunk preloaded, an L2 prefetch and
the PDL wait) and its ``[BLOCK_M, BLOCK_N]`` product over whole weight rows with RMSNorm or SiLU-mul applied to x
(:func:`gemv_tile`). The ops, their launches and references: :mod:`tfs_kernels.gemv`, :mod:`tfs_kernels.qkv_rope_store`,
:mod:`tfs_kernels.lm_head`."""

from __future__ import annotations

import triton
import triton.language as tl

from tfs_kernels.online_softmax import dot
from tfs_kernels.pdl import gdc_launch_dependents, gdc_wait, prefetch_l2


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
    elif BLOCK_M < 16:  # a few rows on the CUDA cores: products kept per column, summed once after the loop
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [BLOCK_M, BLOCK_N, BLOCK_K]
    else:
        acc += dot(x, tl.trans(w), IEEE_DOT)
    return acc, ss_late


@triton.jit
def gemv_prologue(W, N, K, stride_wn, offs_n, USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRELOAD: tl.constexpr = False,
                  W_EF: tl.constexpr = False):
    """What a program does before its product: with ``USE_PDL``, the launch's wait (after an L2 prefetch of the
    weight rows ``offs_n``' first ``PREFETCH_K`` columns; with ``PRELOAD``, the first ``BLOCK_K`` columns are loaded
    into registers before the wait and the prefetch takes the ``PREFETCH_K`` after them). Returns the preloaded
    chunk ``[BLOCK_N, BLOCK_K]`` (zeros without ``PRELOAD``) for :func:`gemv_tile`. A kernel loads what its
    epilogue needs from earlier kernels (a residual, RoPE's positions) between the two, so that the loads complete
    during the weight loop instead of adding a round trip after it. ``W_EF``: the weight loads at L2's
    evict-first priority (:func:`tfs_kernels.gemv.stream_hints`)."""
    tl.static_assert(not PRELOAD or USE_PDL, "PRELOAD: only before a PDL launch's wait")
    n_ok = offs_n < N
    offs_k0 = tl.arange(0, BLOCK_K)
    w_first = tl.zeros((BLOCK_N, BLOCK_K), W.dtype.element_ty)
    if PRELOAD:  # the first chunk of the weight rows, held in registers across the wait
        w_first = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k0[None, :],
                          mask=n_ok[:, None] & (offs_k0 < K)[None, :], other=0.0,
                          eviction_policy="evict_first" if W_EF else "")
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
              EVEN_K: tl.constexpr, IEEE_DOT: tl.constexpr, LATE_NORM: tl.constexpr, PRELOAD: tl.constexpr = False,
              W_EF: tl.constexpr = False):
    """``(x @ w[offs_n].T)`` ``[BLOCK_M, BLOCK_N]`` in float32 with the prologue (RMSNorm or SiLU-mul) applied,
    rows of w ``offs_n`` ``[BLOCK_N]`` (any order), after :func:`gemv_prologue` (``w_first``: its preloaded chunk,
    used with ``PRELOAD``). Row ``m`` of x starts at ``X + x_rows[m]`` (``[BLOCK_M]`` element offsets; every
    caller passes ``m * stride``: a gathered row costs each program a round trip before its first x load,
    docs/PERFORMANCE.md, 8B decode step). Shared by ``tfs::gemv``, ``tfs::qkv_rope_store`` and
    ``tfs::lm_head``."""
    tl.static_assert(not LATE_NORM or (BLOCK_M < 16 and NORM and not SILU_MUL),
                     "LATE_NORM: RMSNorm only, not on the tl.dot tile")
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
    # the CUDA-core tiles sum over K once, after the loop (summed per chunk, the tile made SmolLM2's batch-8 forward
    # 2.9x slower than the default path's on an H100; in this form 1.6x, docs/PERFORMANCE.md)
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    elif BLOCK_M < 16:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if PRELOAD:  # the first chunk's product, from the registers
        acc, ss_late = _accumulate(acc, ss_late, w_first, X, NW, x_rows, m_ok, offs_k0, offs_k0 < K, K, rstd, NORM,
                                   SILU_MUL, LATE_NORM, BLOCK_M, IEEE_DOT)
    for k0 in range(BLOCK_K if PRELOAD else 0, K, BLOCK_K):
        offs_k = k0 + offs_k0
        k_ok = offs_k < K
        if EVEN_K:  # no K mask on the weight (the x loads keep theirs: always true here)
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0,
                        eviction_policy="evict_first" if W_EF else "")  # [BLOCK_N, BLOCK_K]
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                        eviction_policy="evict_first" if W_EF else "")
        acc, ss_late = _accumulate(acc, ss_late, w, X, NW, x_rows, m_ok, offs_k, k_ok, K, rstd, NORM, SILU_MUL,
                                   LATE_NORM, BLOCK_M, IEEE_DOT)
    if BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
    elif BLOCK_M < 16:
        out = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    else:
        out = acc  # [BLOCK_M, BLOCK_N]
    if LATE_NORM:
        out = out * tl.rsqrt(tl.sum(ss_late, axis=1) / K + eps)[:, None]
    return out
