"""Probe: a persistent one-row gemv against ``tfs::gemv`` in the 32-layer chain of Llama-3-8B's four linears.

    python bench/probe_persistent_gemv.py [--per-sm 1 2 3 4] [--layers 32]

``tfs::gemv`` gives each program ``BLOCK_N`` whole weight rows; a grid of more programs than fit on the device at
once runs in waves, and each wave pays the pipeline's ramp (the loads in flight drain at a row block's end) and the
last wave a tail. The persistent variant launches ``per_sm`` programs per SM, each taking a contiguous range of
row blocks through one flattened loop over (row block, K chunk): the software pipeline keeps loading across row
block boundaries, and every program finishes within one row block of the others. Same tiles, same summation
order, so its output is bit-identical to ``tfs::gemv`` at the same (BLOCK_N, BLOCK_K) (checked first).

Prints the chain's time for ``tfs::gemv`` with PDL (as in the model) and for the persistent variant at each
``per_sm``, against the weight bytes over the copy bandwidth, and each kernel's registers and shared memory.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_attention import copy_bandwidth  # noqa: E402
from tune_gemv import chain_weights, gemv_chain, graph_ms  # noqa: E402
from kernels.gemv import launch_gemv, launch_params, pdl_options  # noqa: E402
from kernels.pdl import gdc_launch_dependents, gdc_wait, prefetch_l2  # noqa: E402


@triton.jit
def pdl_start(W, rows, N, K, stride_wn, USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr):
    """With PDL: an L2 prefetch of the first ``PREFETCH_K`` columns of weight ``rows`` ``[BLOCK_N]``, the wait, and
    the next kernel's launch (as ``tfs::gemv``)."""
    if USE_PDL:
        if PREFETCH_K > 0:
            lines = tl.minimum(tl.arange(0, PREFETCH_K // 64) * 64, K - 1)
            prefetch_l2(W + tl.minimum(rows, N - 1)[:, None].to(tl.int64) * stride_wn + lines[None, :])
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def x_chunk(X, NW, K, offs_k, ss, NORM: tl.constexpr, SILU_MUL: tl.constexpr, DTYPE: tl.constexpr):
    """(x's chunk ``[1, BLOCK_K]`` with ``tfs::gemv``'s one-row prologue, the running sum of squares ``ss``):
    SiLU-mul, or the late RMSNorm (x times the norm weight, in float32; 1/rms scales the sums at the end)."""
    if SILU_MUL:
        gate = tl.load(X + offs_k[None, :]).to(tl.float32)
        up = tl.load(X + K + offs_k[None, :])
        x = ((gate * tl.sigmoid(gate)).to(up.dtype) * up).to(DTYPE)
    elif NORM:
        xr = tl.load(X + offs_k[None, :]).to(tl.float32)
        ss += xr * xr
        x = xr * tl.load(NW + offs_k[None, :]).to(tl.float32)
    else:
        x = tl.load(X + offs_k[None, :]).to(DTYPE)
    return x, ss


@triton.jit
def store_rows(acc, ss, r, Y, offs_n, n_ok, K, eps, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """A row block's epilogue: the sums of ``acc`` ``[BLOCK_N, BLOCK_K]``, the late RMSNorm's scale, the residual
    ``r`` ``[1, BLOCK_N]`` (loaded by the caller), rounded as ``tfs::gemv`` does, stored to y."""
    out = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
    if NORM:
        out = out * tl.rsqrt(tl.sum(ss, axis=1) / K + eps)[:, None]
    out = out.to(Y.dtype.element_ty)
    if HAS_RESIDUAL:
        out = (out.to(tl.float32) + r.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + offs_n[None, :], out, mask=n_ok[None, :])


@triton.jit
def _gemv_persistent_kernel(
    X, W, Y, R, NW, N, K, eps, stride_wn, num_progs,
    NORM: tl.constexpr, SILU_MUL: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr,
):
    # grid: (num_progs,); program p: row blocks [p * tiles // num_progs, (p + 1) * tiles // num_progs), one row of x;
    # NORM is the late RMSNorm of tfs::gemv (1/rms(x) scales the float32 sums)
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0)
    tiles = tl.cdiv(N, BLOCK_N)
    t0 = pid * tiles // num_progs
    t1 = (pid + 1) * tiles // num_progs
    pdl_start(W, t0 * BLOCK_N + tl.arange(0, BLOCK_N), N, K, stride_wn, USE_PDL, PREFETCH_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    ss = tl.zeros((1, BLOCK_K), tl.float32)
    for i in range(0, (t1 - t0) * K_ITERS):
        tile = t0 + i // K_ITERS
        kc = i % K_ITERS
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = kc * BLOCK_K + tl.arange(0, BLOCK_K)
        n_ok = offs_n < N
        w = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :], mask=n_ok[:, None], other=0.0)
        x, ss = x_chunk(X, NW, K, offs_k, ss, NORM, SILU_MUL, W.dtype.element_ty)
        acc += w.to(tl.float32) * x.to(tl.float32)
        r = 0.0
        if HAS_RESIDUAL:  # loaded outside the branch (a load under it keeps the loop from being pipelined)
            r = tl.load(R + offs_n[None, :], mask=offs_n[None, :] < tl.where(kc == K_ITERS - 1, N, 0), other=0.0)
        if kc == K_ITERS - 1:  # the row block is complete: its epilogue, then the next block from zero
            store_rows(acc, ss, r, Y, offs_n, n_ok, K, eps, NORM, HAS_RESIDUAL)
            acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
            ss = tl.zeros((1, BLOCK_K), tl.float32)


KERNEL_INFO: dict[tuple, str] = {}


def launch_persistent(x, w, residual, norm_weight, eps, silu_mul, launch=None, per_sm=2, pdl=True,
                      prefetch_k=None):
    """One row: ``launch_gemv``'s contract (late RMSNorm), persistent grid of ``per_sm`` programs per SM;
    ``prefetch_k`` None: the model's window for the shape (kernels/gemv.py PDL_PREFETCH_K)."""
    n, k = w.shape
    prefetch_k = pdl_options(1, n, k, w.element_size())[0] if prefetch_k is None else prefetch_k
    block_n, block_k, warps, stages = launch or launch_params(1, n, k)
    assert x.shape[0] == 1 and k % block_k == 0
    y = torch.empty(1, n, dtype=w.dtype, device=x.device)
    progs = min(triton.cdiv(n, block_n), per_sm * torch.cuda.get_device_properties(x.device).multi_processor_count)
    compiled = _gemv_persistent_kernel[(progs,)](
        x, w, y, residual if residual is not None else y, norm_weight if norm_weight is not None else w,
        n, k, eps, w.stride(0), progs, NORM=norm_weight is not None, SILU_MUL=silu_mul,
        HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, BLOCK_K=block_k, K_ITERS=k // block_k, USE_PDL=pdl,
        PREFETCH_K=prefetch_k if pdl else 0, num_warps=warps, num_stages=stages,
        **({"launch_pdl": True} if pdl else {}))
    key = (n, k, block_n, block_k, warps, stages)
    if key not in KERNEL_INFO and hasattr(compiled, "n_regs"):
        KERNEL_INFO[key] = f"regs {compiled.n_regs}, shared {compiled.metadata.shared} B"
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-sm", nargs="+", type=int, default=[1, 2, 3, 4])
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    lw, weight_bytes, x0 = chain_weights(1, args.layers)
    layers = lambda x, fn: gemv_chain(lw, x, fn)  # noqa: E731
    base = functools.partial(launch_gemv, pdl=True, prefetch_k=None, preload=None)  # the model's
    ref = layers(x0, base)
    paths = {"tfs::gemv, PDL (the model's)": base}
    for per_sm in args.per_sm:
        fn = functools.partial(launch_persistent, per_sm=per_sm)
        out = layers(x0, fn)
        same = torch.equal(out, ref)
        print(f"persistent, {per_sm} per SM: chain output bit-identical to tfs::gemv: {same}")
        paths[f"persistent, {per_sm} per SM"] = fn
    copy_gbs = copy_bandwidth()
    floor_ms = weight_bytes / copy_gbs / 1e6
    print(f"\n{torch.cuda.get_device_name()}: chain of {args.layers} layers, {weight_bytes / 1e9:.2f} GB, copy "
          f"{copy_gbs:.0f} GB/s, floor {floor_ms:.3f} ms")
    print(f"{'path':>32} | {'ms':>7} | {'/floor':>6}")
    for rep in range(2):
        for name, fn in paths.items():
            ms = graph_ms([lambda fn=fn: layers(x0, fn)])
            print(f"{name:>32} | {ms:>7.3f} | {ms / floor_ms:>6.3f}")
    import kernels.gemv as gemv_module
    for cache in getattr(gemv_module._gemv_kernel, "device_caches", {}).values():
        for compiled in cache[0].values():
            print(f"tfs::gemv kernel: regs {compiled.n_regs}, shared {compiled.metadata.shared} B, "
                  f"warps {compiled.metadata.num_warps}, stages {compiled.metadata.num_stages}")
    for key, info in KERNEL_INFO.items():
        print(f"persistent kernel (n, k, BN, BK, warps, stages) {key}: {info}")


if __name__ == "__main__":
    main()
