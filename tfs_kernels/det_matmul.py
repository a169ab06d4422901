"""``tfs::det_matmul``: ``x @ w.T`` whose result for a row does not depend on how many rows the call has or where
the row sits (model.deterministic).

cuBLAS and inductor pick tile shapes, split-K and kernels by the row count M, so a token's projection differs in its
last bits between a decode forward (1 row per request), a verify forward (several) and a prefill. Here the tiling is
fixed (an RMSNorm or a SiLU-mul before the product and a residual add after it fold in): every program computes a
``[BLOCK_M, BLOCK_N]`` output tile, reducing over K (or over one of a fixed number of K ranges, whose float32 partials
a second kernel, or with ``SPLIT_FIXUP`` the tile's last range to finish, sums in range order) in ``BLOCK_K`` steps
upwards with one float32 accumulator, and the tile, its operand order, warps, stages and split are chosen by the
weight's shape alone (never by M, never autotuned; M is not specialised). A row's outputs are then the same sums in
the same order for any M: the tensor-core product of one row of the tile does not read the other rows.

Like ``tfs::det_rmsnorm`` and ``tfs::det_attention`` (and the ``*_pdl`` ops), this is an opaque custom op
(``torch.library.custom_op`` with a fake kernel), not a ``triton_op``: torch.compile calls it as it is. Inductor
traces into a ``triton_op`` and generates and analyses the kernel's TTIR at every call site of every graph it
compiles, and in deterministic mode every linear, norm and attention of every layer is such a call site.

The plain-torch reference, which is how the CPU runs this op, pads the rows to blocks of 16 and multiplies each
block on its own (one ``bmm``): one BLAS call shape whatever M is (row-invariant; slower than one GEMM).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from tfs_kernels.det_rmsnorm import det_rmsnorm_reference
from tfs_kernels.dispatch import register_cpu_reference, use_triton
from tfs_kernels.gemv import launch_class
from tfs_kernels.pdl import HAS_GDC, gdc_launch_dependents, gdc_wait, prefetch_l2

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, swap[, split_k]]) on CUDA. BLOCK_M 16: the smallest
# tensor-core tile, so that a decode forward of a few rows wastes little. ``swap`` True: the product's operands
# swapped (``w @ x.T``, then transposed), so that the weight tile is the tensor-core tile's M side (Hopper's wgmma),
# as small-M GEMMs do for their rows; ``split_k``: K cut into that many fixed ranges of whole BLOCK_K steps, reduced
# by a second kernel in range order (more programs for a narrow weight at few rows). Any choice that depends on the
# weight's shape only (never on M) is batch-invariant: CUDA_TILES holds one per shape class of
# tfs_kernels.gemv.launch_class, the best mean over 1 and 8 rows on Llama-3-8B's linears in `python3
# bench/tune_det_matmul.py --models llama3_8b --rows 1 8 --block-n 64 128 --block-k 128 256 --stages 3 4 --swap 1
# --split-k 1 2 4 8` (H100, 2026-12-06, docs/PERFORMANCE.md; the ratios below: x the default mode's time, tfs::gemv at
# 1 row, cuBLAS at 8, re-measured with LATE_NORM by `--tiles` at 3004919); a class without an entry takes CUDA_TILE.
CUDA_TILE = (16, 32, 256, 4, 4)
CUDA_TILES: dict[str, tuple] = {
    "wide": (16, 64, 256, 4, 4, True, 1),  # qkv [6144, 4096]: 1.06x at 1 row, 0.49x at 8 (with LATE_NORM)
    "square": (16, 64, 256, 4, 4, True, 1),  # o [4096, 4096]: 1.06x / 0.78x
    "very_wide": (16, 128, 256, 4, 3, True, 1),  # gate_up [28672, 4096]: 1.04x / 0.80x (with LATE_NORM)
    "tall": (16, 128, 128, 4, 4, True, 4),  # down [4096, 14336]: 1.09x / 0.85x
    "vocab": (16, 64, 256, 4, 4, True, 1),  # lm_head [128256, 4096]: 0.84x / 0.92x
}
# Small weights (SmolLM2's: N of 576-3072) get few programs from the class's tile (9-24 on a 132-SM H100 at 8 rows):
# with MIN_PROGRAMS > 0 a tile's BLOCK_N halves (down to 16) until ceil(N / BLOCK_N) * split_k reaches it. Still a
# choice by the weight's shape alone (batch-invariant); 48 leaves every Llama-3-8B tile as it is (SmolLM2's batch-8
# forward on an H100: 757 against 788 us; the BLOCK_N-16 tile passes tests/test_kernels_det.py's "narrow16"). 0: off.
MIN_PROGRAMS = 48
# A class's K split (a second, reducing kernel) is kept only while each of its ranges holds at least this many of K's
# columns: SmolLM2's down projection [576, 1536] is "tall" like Llama-3-8B's [4096, 14336], but its four ranges of
# 384 columns cost a reduce kernel a layer (about 5.8 us, 30 a forward at 8 rows on an H100) for little streaming.
# By the weight's shape alone (batch-invariant); 0 (the default until timed on a GPU): the class's split as it is.
MIN_SPLIT_K = 0
SPLIT_ROWS = 1024  # split-K products run over at most this many rows at a time (the float32 partials' size)
# A split tile's K ranges are summed by the last of its programs to finish (an atomic count per tile, reset by that
# program), in range order, in the same kernel: the same sums as the second, reducing kernel (False), one launch
# fewer per split product (SmolLM2's down projection: 30 a forward at 2-16 rows). Counts live in one buffer of
# FIXUP_TILES per device (one stream's kernels use it one after another: a PDL launch touches it only after its
# wait); a launch of more tiles, or a first launch inside a CUDA graph capture, takes the reducing kernel. Off until
# timed in an engine on a GPU: its kernel tests pass on the H100 (tests/test_kernels_det.py, 2026-12-07).
SPLIT_FIXUP = False
FIXUP_TILES = 1 << 16
# columns of each program's weight rows (from its K range's start) pulled into L2 before a PDL launch waits for the
# kernel before it (tfs_kernels/pdl.py); a multiple of 64
PDL_PREFETCH_K = 256
# With a fused RMSNorm and K whole in one program (no split): each program sums a row's squares in its weight loop
# and scales the product by 1 / rms after it, ((x * nw) @ w.T) / rms(x), as tfs::gemv's LATE_NORM does, instead of
# a pass over x before the weight starts streaming (with the split, every range needs the whole row's rms first).
# Either way a row's arithmetic does not depend on M; the two round differently.
LATE_NORM = True
INTERPRET_TILE = (16, 16, 32, 1, 1)  # small tiles: several programs and K steps on test shapes


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def det_tile(X, W, Norm_weight, rows, cols, row_ok, col_ok, K, k_lo, k_hi, eps, stride_xm, stride_wn,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr,
             NORM: tl.constexpr, IEEE_DOT: tl.constexpr, SWAP_AB: tl.constexpr, LATE_NORM: tl.constexpr):
    """The float32 sums ``[BLOCK_M, BLOCK_N]`` of rows ``rows`` of X (SiLU-mul / RMSNorm folded in) times weight
    rows ``cols`` over K's columns ``[k_lo, k_hi)`` in ``BLOCK_K`` steps: the main loop of ``tfs::det_matmul`` and of
    the kernels that fuse an epilogue into it (tfs_kernels/det_qkv_rope_store.py)."""
    kk = tl.arange(0, BLOCK_K)
    sum_sq = tl.zeros([BLOCK_M], tl.float32)  # a row's sum of squares, in the same BLOCK_K steps in every program
    if NORM and not LATE_NORM:  # RMSNorm of the rows first: a pass over x before the weight streams
        for k0 in range(0, K, BLOCK_K):
            xs = tl.load(X + rows[:, None] * stride_xm + (k0 + kk)[None, :],
                         mask=row_ok[:, None] & ((k0 + kk) < K)[None, :], other=0.0).to(tl.float32)
            sum_sq += tl.sum(xs * xs, 1)
        rstd = 1.0 / tl.sqrt(sum_sq / K + tl.cast(eps, tl.float32))  # [BLOCK_M]
    if SWAP_AB:  # the weight as the product's first operand: its output features fill the tensor-core tile's M
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k0 + kk) < K
        x_ok = row_ok[:, None] & k_ok[None, :]
        x_ptr = X + rows[:, None] * stride_xm + (k0 + kk)[None, :]
        x = tl.load(x_ptr, mask=x_ok, other=0.0)  # [BLOCK_M, BLOCK_K]
        if SILU_MUL:  # x holds gate | up (K columns each): silu(gate) * up, in float32, rounded once
            up = tl.load(x_ptr + K, mask=x_ok, other=0.0).to(tl.float32)
            gate = x.to(tl.float32)
            x = gate / (1.0 + tl.exp(-gate)) * up
        if NORM:
            nw = tl.load(Norm_weight + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
            if LATE_NORM:  # x times the norm's weight now, the row's 1 / rms after the loop
                xf = x.to(tl.float32)
                sum_sq += tl.sum(xf * xf, 1)
                x = xf * nw[None, :]
            else:  # as RMSNorm rounds: the normalised row in x's dtype, times the weight, in w's dtype
                x = (x.to(tl.float32) * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32) * nw[None, :]
        x = x.to(W.dtype.element_ty)
        w = tl.load(W + cols[:, None] * stride_wn + (k0 + kk)[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_N, BLOCK_K]
        if SWAP_AB:
            acc = _dot(w, tl.trans(x), acc, IEEE_DOT)  # [BLOCK_N, BLOCK_M]
        else:
            acc = _dot(x, tl.trans(w), acc, IEEE_DOT)  # [BLOCK_M, BLOCK_N]
    if SWAP_AB:
        acc = tl.trans(acc)
    if NORM and LATE_NORM:  # [BLOCK_M, BLOCK_N] sums scaled by each row's 1 / rms
        acc = acc * (1.0 / tl.sqrt(sum_sq / K + tl.cast(eps, tl.float32)))[:, None]
    return acc


@triton.jit(do_not_specialize=["M", "eps"])
def _det_matmul_kernel(
    X, W, Out, Residual, Norm_weight, Partial, Counts, M, N, K, k_per_split, eps, stride_xm, stride_wn, stride_om,
    stride_rm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr, IEEE_DOT: tl.constexpr, SWAP_AB: tl.constexpr,
    SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr, LATE_NORM: tl.constexpr,
    FIXUP: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N) * cdiv(M, BLOCK_M), SPLIT_K); consecutive programs share a weight tile (L2 reuse).
    # Program (., s) sums K's columns [s * k_per_split, (s + 1) * k_per_split) (k_per_split: whole BLOCK_K steps)
    # into Partial[s] ``[SPLIT_K, M, N]`` (float32) when SPLIT_K > 1; with FIXUP the tile's last program to finish
    # (Counts[tile] ``[FIXUP_TILES]`` int32, zero between launches) sums them, else _det_matmul_reduce_kernel.
    pid = tl.program_id(0)
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % m_tiles
    pid_n = pid // m_tiles
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_ok = rows < M
    col_ok = cols < N
    if USE_PDL:  # launched early (programmatic dependent launch): the weight's first columns into L2, then the wait
        if PREFETCH_K > 0:  # one prefetch per 128-byte line (64 16-bit values), clamped to the last row and column
            lines = tl.minimum(k_lo + tl.arange(0, PREFETCH_K // 64) * 64, K - 1)
            prefetch_l2(W + tl.minimum(cols, N - 1)[:, None].to(tl.int64) * stride_wn + lines[None, :])
        gdc_wait()
        gdc_launch_dependents()
    acc = det_tile(X, W, Norm_weight, rows, cols, row_ok, col_ok, K, k_lo, k_hi, eps, stride_xm, stride_wn,
                   BLOCK_M, BLOCK_N, BLOCK_K, SILU_MUL, NORM, IEEE_DOT, SWAP_AB, LATE_NORM)  # [BLOCK_M, BLOCK_N]
    out_ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K > 1:
        at = Partial + rows[:, None] * N + cols[None, :]  # [BLOCK_M, BLOCK_N] in range 0
        tl.store(at + tl.program_id(1) * M * N, acc, mask=out_ok)
        if FIXUP:  # every thread's stores, then one release-acquire count: the last range sees all the others'
            tl.debug_barrier()
            if tl.atomic_add(Counts + pid, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
                total = tl.load(at, mask=out_ok, other=0.0, cache_modifier=".cg")  # (L2: not this SM's L1)
                for s in tl.static_range(1, SPLIT_K):  # in range order, as _det_matmul_reduce_kernel
                    total += tl.load(at + s * M * N, mask=out_ok, other=0.0, cache_modifier=".cg")
                _epilogue(total, Out, Residual, rows[:, None], cols[None, :], out_ok, stride_om, stride_rm,
                          HAS_RESIDUAL)
                tl.atomic_xchg(Counts + pid, 0, sem="relaxed", scope="gpu")  # zero for the next launch
    else:
        _epilogue(acc, Out, Residual, rows[:, None], cols[None, :], out_ok, stride_om, stride_rm, HAS_RESIDUAL)


@triton.jit
def _epilogue(acc, Out, Residual, rows, cols, ok, stride_om, stride_rm, HAS_RESIDUAL: tl.constexpr):
    out = acc.to(Out.dtype.element_ty)
    if HAS_RESIDUAL:  # the product rounded first, as ``residual + linear(x)`` would round it
        res = tl.load(Residual + rows * stride_rm + cols, mask=ok, other=0.0)
        out = (out.to(tl.float32) + res.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + rows * stride_om + cols, out, mask=ok)


@triton.jit
def _det_matmul_reduce_kernel(Partial, Out, Residual, M, N, stride_om, stride_rm, SPLIT_K: tl.constexpr,
                              BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr):
    # grid: (M, cdiv(N, BLOCK)); Partial [SPLIT_K, M, N] float32, summed in split order
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    ok = cols < N
    acc = tl.load(Partial + row * N + cols, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(Partial + (s * M + row) * N + cols, mask=ok, other=0.0)
    _epilogue(acc, Out, Residual, row, cols, ok, stride_om, stride_rm, HAS_RESIDUAL)


def cuda_tile(n: int, k: int) -> tuple:
    """The CUDA tile of a ``[N, K]`` weight: by its shape class (and with ``MIN_PROGRAMS`` its size), never by the
    row count."""
    tile = CUDA_TILES.get(launch_class(1, n, k), CUDA_TILE)
    block_n, split_k = tile[1], (tile[6] if len(tile) > 6 else 1)
    if MIN_SPLIT_K and split_k > 1:
        split_k = max(1, min(split_k, k // MIN_SPLIT_K))
        tile = tile[:6] + (split_k,)
    while MIN_PROGRAMS and block_n > 16 and -(-n // block_n) * split_k < MIN_PROGRAMS:
        block_n //= 2
    return tile[:1] + (block_n,) + tile[2:]


def fit_stages(stages: int, per_stage: int, limit: int) -> int:
    """The most pipeline stages, at most ``stages``, whose operand buffers (``per_stage`` bytes each: an x tile, two
    with ``silu_mul``, and a weight tile) fit ``limit`` bytes of shared memory; at least 1. Stages only overlap the
    loads, so the sums are the same with any count (the tiles were tuned for 16-bit weights; float32 doubles them)."""
    while stages > 1 and stages * per_stage > limit:
        stages -= 1
    return stages


@functools.lru_cache(maxsize=None)
def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory a program may use on ``device`` (Triton's ``max_shared_mem``: 227 KiB on an H100)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def tile_shape(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int, int, int, bool, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, swap, k_per_split) over ``x`` and the ``[N, K]`` weight ``w``:
    :func:`cuda_tile` on CUDA, the interpreter's small tile elsewhere; ``k_per_split``: the columns of each K range,
    whole ``BLOCK_K`` steps (K itself, rounded up, without a split). By shapes alone: traced model code may ask it."""
    n, k = w.shape
    block_m, block_n, block_k, warps, stages, *extra = cuda_tile(n, k) if x.is_cuda else INTERPRET_TILE
    swap = bool(extra[0]) if extra else False
    k_per_split = triton.cdiv(triton.cdiv(k, extra[1] if len(extra) > 1 else 1), block_k) * block_k  # by K only
    return block_m, block_n, block_k, warps, stages, swap, k_per_split


def launch_tile(x: torch.Tensor, w: torch.Tensor, silu_mul: bool = False) -> tuple[int, int, int, int, int, bool, int]:
    """:func:`tile_shape` with its stages fitted to the device's shared memory on CUDA (float32 operands: the 16-bit
    tiles' stages may not fit; fewer change no sum)."""
    block_m, block_n, block_k, warps, stages, swap, k_per_split = tile_shape(x, w)
    if x.is_cuda:
        per_stage = block_k * ((2 if silu_mul else 1) * block_m * x.element_size() + block_n * w.element_size())
        stages = fit_stages(stages, per_stage, shared_memory(x.device))
    return block_m, block_n, block_k, warps, stages, swap, k_per_split


@torch.library.custom_op("tfs::det_matmul", mutates_args=())
def det_matmul_op(x: torch.Tensor, w: torch.Tensor, residual: Optional[torch.Tensor] = None, silu_mul: bool = False,
                  out_float32: bool = False, norm_weight: Optional[torch.Tensor] = None,
                  eps: float = 1e-5, pdl: bool = False) -> torch.Tensor:
    """x ``[M, K]`` (``[M, 2K]``: gate | up when ``silu_mul``; unit stride along K), w ``[N, K]`` (a linear
    layer's weight) -> ``x @ w.T`` ``[M, N]`` in w's dtype, or float32 (the accumulator, unrounded) when
    ``out_float32``; ``silu_mul``: ``(silu(gate) * up) @ w.T``; ``norm_weight`` ``[K]``: ``rmsnorm(x) @ w.T``
    (RMSNorm with ``eps``; not with ``silu_mul``); ``residual`` ``[M, N]``: added to the (rounded) product.
    ``pdl``: the kernels launched with programmatic dependent launch (CUDA, tfs_kernels/pdl.py), each program
    prefetching ``PDL_PREFETCH_K`` columns of its weight rows into L2 before it waits (the same sums)."""
    m = x.shape[0]
    n, k = w.shape
    torch._check(x.shape[1] == (2 * k if silu_mul else k), lambda: f"det_matmul: x has {x.shape[1]} columns for K {k}")
    torch._check(x.stride(1) == 1 and w.stride(1) == 1, lambda: "det_matmul: rows must have unit stride")
    out = torch.empty((m, n), dtype=torch.float32 if out_float32 else w.dtype, device=x.device)
    has_res = residual is not None
    torch._check(norm_weight is None or not silu_mul, lambda: "det_matmul: norm_weight with silu_mul")
    torch._check(not pdl or (HAS_GDC and x.is_cuda), lambda: "det_matmul: pdl needs CUDA and grid dependency control")
    if has_res:
        torch._check(residual.shape == (m, n) and residual.stride(1) == 1, lambda: "det_matmul: residual [M, N]")
    block_m, block_n, block_k, warps, stages, swap, k_per_split = launch_tile(x, w, silu_mul)
    split = triton.cdiv(k, k_per_split)
    norm = w if norm_weight is None else norm_weight
    launch = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SILU_MUL=silu_mul, HAS_RESIDUAL=has_res,
                  NORM=norm_weight is not None, IEEE_DOT=w.dtype == torch.float32, SWAP_AB=swap, SPLIT_K=split,
                  USE_PDL=pdl, PREFETCH_K=PDL_PREFETCH_K if pdl and w.element_size() == 2 else 0,
                  LATE_NORM=LATE_NORM and split == 1,
                  num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}))
    for r0 in range(0, m, SPLIT_ROWS if split > 1 else max(m, 1)):  # a row's sums: the same in any launch
        rows = min(m - r0, SPLIT_ROWS) if split > 1 else m
        xs, outs, res = x[r0:], out[r0:], residual[r0:] if has_res else out
        partial = torch.empty((split, rows, n), dtype=torch.float32, device=x.device) if split > 1 else outs
        grid = (triton.cdiv(n, block_n) * triton.cdiv(rows, block_m), split)
        counts = fixup_counts(x.device) if split > 1 and SPLIT_FIXUP and grid[0] <= FIXUP_TILES else None
        _det_matmul_kernel[grid](xs, w, outs, res, norm, partial, outs if counts is None else counts, rows, n, k,
                                 k_per_split, eps, x.stride(0), w.stride(0), out.stride(0), res.stride(0),
                                 FIXUP=counts is not None, **launch)
        if split > 1 and counts is None:
            _det_matmul_reduce_kernel[(rows, triton.cdiv(n, 1024))](
                partial, outs, res, rows, n, out.stride(0), res.stride(0), SPLIT_K=split, BLOCK=1024,
                HAS_RESIDUAL=has_res, USE_PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return out


_COUNTS: dict[torch.device, torch.Tensor] = {}


def fixup_counts(device: torch.device) -> Optional[torch.Tensor]:
    """The device's split-tile counts ``[FIXUP_TILES]`` int32 (zero between launches: each launch's last programs
    reset theirs), made on first use; None where the first use is inside a CUDA graph capture. A compiled runner
    makes them before anything compiles (ModelRunner): the warm-up run of torch.compile's CUDA graphs allocates
    from the graphs' pool, which refuses a tensor that outlives the run."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    counts = _COUNTS.get(device)
    if counts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counts = _COUNTS[device] = torch.zeros(FIXUP_TILES, dtype=torch.int32, device=device)
    return counts


@det_matmul_op.register_fake
def _det_matmul_fake(x: torch.Tensor, w: torch.Tensor, residual: Optional[torch.Tensor] = None,
                     silu_mul: bool = False, out_float32: bool = False, norm_weight: Optional[torch.Tensor] = None,
                     eps: float = 1e-5, pdl: bool = False) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32 if out_float32 else w.dtype)


CPU_ROW_BLOCK = 16  # rows per product of the reference


def det_matmul_reference(x: torch.Tensor, w: torch.Tensor, residual: Optional[torch.Tensor] = None,
                         silu_mul: bool = False, out_float32: bool = False, norm_weight: Optional[torch.Tensor] = None,
                         eps: float = 1e-5, pdl: bool = False) -> torch.Tensor:
    """Plain torch: the rows zero-padded to blocks of ``CPU_ROW_BLOCK`` and each block one ``[16, K] x [K, N]``
    product of a batched matmul, the same BLAS call shape for every block of every M. (One CPU GEMM over all M rows
    blocks K by M: nearly every output of a row differs in its last bits between M = 1 and M = 8; within a
    fixed-shape product a row's outputs do not depend on the other rows or its place, which the tests check.)"""
    n, k = w.shape
    if silu_mul:
        gate, up = x.float().chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    if norm_weight is not None:
        x = det_rmsnorm_reference(x, norm_weight, eps)
    m = x.shape[0]
    blocks = -(-m // CPU_ROW_BLOCK)
    xp = torch.nn.functional.pad(x.to(w.dtype), (0, 0, 0, blocks * CPU_ROW_BLOCK - m))
    out = torch.bmm(xp.view(blocks, CPU_ROW_BLOCK, k), w.t().expand(blocks, k, n))  # [blocks, 16, N]
    out = out.view(blocks * CPU_ROW_BLOCK, n)[:m]
    if residual is not None:
        out = (out.float() + residual.float()).to(w.dtype)
    return out.float() if out_float32 else out


register_cpu_reference(det_matmul_op, det_matmul_reference)


def det_matmul(x: torch.Tensor, w: torch.Tensor, residual: Optional[torch.Tensor] = None, silu_mul: bool = False,
               out_float32: bool = False, norm_weight: Optional[torch.Tensor] = None,
               eps: float = 1e-5, pdl: bool = False) -> torch.Tensor:
    """The op where Triton runs (see :mod:`tfs_kernels.dispatch`), the reference elsewhere (which ignores
    ``pdl``). x may have leading dims ``[..., K]`` (residual the same leading dims)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    res2 = None if residual is None else residual.reshape(-1, residual.shape[-1])
    fn = torch.ops.tfs.det_matmul if use_triton(x2) else det_matmul_reference
    return fn(x2, w, res2, silu_mul, out_float32, norm_weight, eps, pdl and x2.is_cuda).view(*lead, w.shape[0])
