"""Probe: a one-row gemv whose weight tiles arrive by TMA (Hopper's tensor memory accelerator) through a
software-pipelined ring of shared-memory buffers, against ``tfs::gemv``, whose plain loads Triton does not pipeline
(its kernels use 128-256 B of shared memory: one weight tile in flight per program).

    python bench/probe_tma_gemv.py [--block-n 8 16 32] [--block-k 128 256] [--stages 3 4 6 8]

(1) Each of Llama-3-8B's four decoder linears with the layer's fusion (as ``tune_gemv.py --fused``), over >= 2 GB of
distinct weight copies: GB/s per launch, ``tfs::gemv``'s tuned launch first. Each TMA launch's output is checked
first: bit-identical to ``tfs::gemv`` at the same (BLOCK_N, BLOCK_K) (same tiles, same summation order).
(2) The 32-layer chain of the four linears with PDL (as in the model), ``tfs::gemv`` against the TMA kernel at each
shape's best launch from (1).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_attention import copy_bandwidth  # noqa: E402
from tune_gemv import FUSION, LINEARS, SHAPES, chain_weights, gemv_chain, graph_ms  # noqa: E402
from probe_persistent_gemv import pdl_start, store_rows, x_chunk  # noqa: E402
from kernels.gemv import launch_gemv, launch_params, pdl_options  # noqa: E402


@triton.jit
def _gemv_tma_kernel(
    X, W, W_desc, Y, R, NW, N, K, eps, stride_wn,
    NORM: tl.constexpr, SILU_MUL: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, STAGES: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N),); one row of x; NORM is tfs::gemv's late RMSNorm
    eps = tl.cast(eps, tl.float32)
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    pdl_start(W, offs_n, N, K, stride_wn, USE_PDL, PREFETCH_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    ss = tl.zeros((1, BLOCK_K), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = W_desc.load([n0, k0])  # [BLOCK_N, BLOCK_K]; rows past N come back as zeros
        x, ss = x_chunk(X, NW, K, offs_k, ss, NORM, SILU_MUL, W.dtype.element_ty)
        acc += w.to(tl.float32) * x.to(tl.float32)
    r = 0.0
    if HAS_RESIDUAL:
        r = tl.load(R + offs_n[None, :], mask=n_ok[None, :], other=0.0)
    store_rows(acc, ss, r, Y, offs_n, n_ok, K, eps, NORM, HAS_RESIDUAL)


KERNEL_INFO: dict[tuple, str] = {}
DESCRIPTORS: dict[tuple, TensorDescriptor] = {}


def launch_tma(x, w, residual, norm_weight, eps, silu_mul, launch=(16, 256, 4, 4), pdl=True,
               prefetch_k=None):
    """One row, ``launch_gemv``'s contract (late RMSNorm); launch = (BLOCK_N, BLOCK_K, warps, stages);
    ``prefetch_k`` None: the model's window for the shape (kernels/gemv.py PDL_PREFETCH_K)."""
    n, k = w.shape
    prefetch_k = pdl_options(1, n, k, w.element_size())[0] if prefetch_k is None else prefetch_k
    block_n, block_k, warps, stages = launch
    key = (w.data_ptr(), block_n, block_k)
    if key not in DESCRIPTORS:  # built once per weight (the chain's graph capture reuses it)
        DESCRIPTORS[key] = TensorDescriptor.from_tensor(w, [block_n, block_k])
    y = torch.empty(1, n, dtype=w.dtype, device=x.device)
    compiled = _gemv_tma_kernel[(triton.cdiv(n, block_n),)](
        x, w, DESCRIPTORS[key], y, residual if residual is not None else y,
        norm_weight if norm_weight is not None else w, n, k, eps, w.stride(0), NORM=norm_weight is not None,
        SILU_MUL=silu_mul, HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
        USE_PDL=pdl, PREFETCH_K=prefetch_k if pdl else 0, num_warps=warps,
        **({"launch_pdl": True} if pdl else {}))
    info = (n, k) + tuple(launch)
    if info not in KERNEL_INFO and hasattr(compiled, "n_regs"):
        KERNEL_INFO[info] = f"regs {compiled.n_regs}, shared {compiled.metadata.shared} B"
    return y


def sweep(args) -> dict[str, tuple]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    best = {}
    print("GB/s (weight bytes / median time per call over >= 2 GB of weight copies, calls back to back in a graph)")
    for name in LINEARS:
        n, k = SHAPES[name]
        norm, res, silu = FUSION[name]
        ws = [torch.randn(n, k, generator=gen, device="cuda").mul_(0.02).bfloat16()
              for _ in range(max(2, (2 << 30) // (n * k * 2)))]
        x = torch.randn(1, 2 * k if silu else k, generator=gen, device="cuda").bfloat16()
        extra = (torch.randn(1, n, generator=gen, device="cuda").bfloat16() if res else None,
                 torch.rand(k, generator=gen, device="cuda").bfloat16() + 0.5 if norm else None, 1e-5, silu)
        gbs = lambda ms: n * k * 2 / ms / 1e6  # noqa: E731
        base = launch_params(1, n, k)
        t = graph_ms([lambda w=w: launch_gemv(x, w, *extra, base) for w in ws])
        rows = [(f"tfs::gemv {base}", gbs(t))]
        results, differ = {}, []
        for bn, bk, st in itertools.product(args.block_n, args.block_k, args.stages):
            launch = (bn, bk, 4, st)
            try:
                ref = launch_gemv(x, ws[0], *extra, (bn, bk, 4, 1))
                out = launch_tma(x, ws[0], *extra, launch, pdl=False)
                same = torch.equal(out, ref)
                t = graph_ms([lambda w=w: launch_tma(x, w, *extra, launch, pdl=False) for w in ws])
            except Exception as e:  # noqa: BLE001 (out of resources: report and go on)
                print(f"{name} {launch}: {type(e).__name__}: {str(e)[:100]}")
                continue
            results[launch] = gbs(t)
            if not same:
                differ.append(launch)
            rows.append((f"tma {launch}{'' if same else ' (NOT bit-identical)'}", gbs(t)))
        DESCRIPTORS.clear()
        del ws
        best[name] = max(results, key=results.get)
        print(f"\n{name} {(n, k)}, fusion (norm, residual, silu) {FUSION[name]}; of {len(results)} TMA launches, "
              f"output not bit-identical to tfs::gemv at the same tiles: {differ or 'none'}")
        for label, g in sorted(rows, key=lambda r: -r[1])[: args.top]:
            print(f"  {label:>44} | {g:7.0f}")
    return best


def chain(best: dict[str, tuple], layers: int) -> None:
    lw, weight_bytes, x0 = chain_weights(1, layers)
    base = functools.partial(launch_gemv, pdl=True, prefetch_k=None, preload=None)  # the model's
    run = lambda x, fns: gemv_chain(lw, x, fns)  # noqa: E731
    paths = {"tfs::gemv, PDL (the model's)": dict.fromkeys(LINEARS, base)}
    paths["tma at each shape's best, PDL"] = {c: functools.partial(launch_tma, launch=best[c]) for c in best}
    for c in best:  # one shape at a time on TMA
        paths[f"tma for {c} only"] = {**paths["tfs::gemv, PDL (the model's)"], c: paths["tma at each shape's best, PDL"][c]}
    ref = run(x0, paths["tfs::gemv, PDL (the model's)"])
    copy_gbs = copy_bandwidth()
    floor_ms = weight_bytes / copy_gbs / 1e6
    print(f"\nchain of {layers} layers, {weight_bytes / 1e9:.2f} GB, copy {copy_gbs:.0f} GB/s, floor {floor_ms:.3f} ms; "
          f"tma launches {best}")
    print(f"{'path':>32} | {'ms':>7} | {'/floor':>6} | rel. err vs tfs::gemv")
    for rep in range(2):
        for name, fns in paths.items():
            out = run(x0, fns)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            ms = graph_ms([lambda fns=fns: run(x0, fns)])
            print(f"{name:>32} | {ms:>7.3f} | {ms / floor_ms:>6.3f} | {err:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-n", nargs="+", type=int, default=[8, 16, 32])
    ap.add_argument("--block-k", nargs="+", type=int, default=[128, 256])
    ap.add_argument("--stages", nargs="+", type=int, default=[3, 4, 6, 8])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args()
    # TMA descriptors built on the host need no device allocator; in-kernel ones would (triton.set_allocator)
    best = sweep(args)
    chain(best, args.layers)
    for key, info in KERNEL_INFO.items():
        print(f"tma kernel (n, k, BN, BK, warps, stages) {key}: {info}")


if __name__ == "__main__":
    main()
