"""Sweep ``tfs::gemv``'s launch parameters on a CUDA GPU and compare with cuBLAS on a model's linear shapes
(Llama-3-8B's, or SmolLM2-135M's with ``--model smollm2``).

    python bench/tune_gemv.py                  # sweep at 1 and 8 rows, then the 32-layer chain
    python bench/tune_gemv.py --model smollm2 --rows 5 8 --fused --layers 30   # a 5-row verify, a batch-8 decode
    python bench/tune_gemv.py --rows 1 --chain-only
    python bench/tune_gemv.py --rows 1 --fused --shapes down --no-chain   # down with SiLU-mul + residual fused in

(1) For each (BLOCK_N, BLOCK_K, num_warps, num_stages), every shape's output is checked against ``F.linear`` and
timed with ``triton.testing.do_bench`` (median, L2 flushed between runs); cuBLAS (``F.linear``) is timed the same
way. Prints GB/s (weight bytes / time) per shape and each configuration's worst slowdown against the best one.
(2) The chain: ``--layers`` (32) layers' worth of distinct bf16 weights, each layer the four linears of a decoder
layer with what surrounds them (RMSNorm, SiLU-mul, residual adds), once as torch ops (cuBLAS + separate elementwise
kernels) and once as the four fused ``tfs::gemv`` calls, each captured in a CUDA graph; replay time against weight
bytes over the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import sys
from typing import Callable

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_attention import copy_bandwidth  # noqa: E402
import tfs_kernels.gemv as gemv_module  # noqa: E402
from tfs_kernels.gemv import PDL_PREFETCH_K, PDL_PRELOAD, gemv_reference, launch_class, launch_gemv  # noqa: E402
from tfs_kernels.pdl import HAS_GDC  # noqa: E402

# (hidden, intermediate, q width, k/v width, vocabulary) of the models whose linears the sweep and the chain use
DIMS = {"llama3_8b": (4096, 14336, 4096, 1024, 128256), "smollm2": (576, 1536, 576, 192, 49152)}
HIDDEN, INTER, Q, KV, VOCAB = DIMS["llama3_8b"]
# what the decoder layer fuses into each product: (RMSNorm prologue, residual epilogue, SiLU-mul prologue)
FUSION = {"qkv": (True, False, False), "o": (False, True, False), "gate_up": (True, False, False),
          "down": (False, True, True), "lm_head": (False, False, False)}


def linear_shapes() -> dict[str, tuple[int, int]]:
    """(n, k) of each weight, from the module's model dimensions."""
    return {"qkv": (Q + 2 * KV, HIDDEN), "o": (HIDDEN, Q), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER),
            "lm_head": (VOCAB, HIDDEN)}


SHAPES = linear_shapes()


def graph_ms(calls: list[Callable[[], object]]) -> float:
    """Median time of one call when ``calls`` run back to back in a CUDA graph (what a decode step does)."""
    for fn in calls:
        fn()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return statistics.median(times)


def sweep(rows: int, args: argparse.Namespace) -> None:
    """Each shape timed over enough distinct copies of its weight (>= 2 GB) that nothing is served from L2 (with
    ``--hot``, over one copy read again and again); with ``--fused``, with the layer's fusion (``FUSION``)."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    copies = {name: max(2, (2 << 30) // (n * k * 2)) for name, (n, k) in SHAPES.items()}
    weights = {name: [torch.randn(n, k, generator=gen, device="cuda").mul_(0.02).bfloat16()
                      for _ in range(1 if args.hot else copies[name])] for name, (n, k) in SHAPES.items()}
    if args.hot:  # --hot: every call reads the same copy (as far as it fits, from L2)
        weights = {name: ws * copies[name] for name, ws in weights.items()}
    # --fused: each weight with what the decoder layer fuses into its product (RMSNorm / residual / SiLU-mul)
    fusion = {name: FUSION[name] if args.fused else (False, False, False) for name in SHAPES}
    xs = {name: torch.randn(rows, k * (2 if fusion[name][2] else 1), generator=gen, device="cuda").bfloat16()
          for name, (n, k) in SHAPES.items()}
    extra = {name: (torch.randn(rows, n, generator=gen, device="cuda").bfloat16() if fusion[name][1] else None,
                    torch.rand(k, generator=gen, device="cuda").bfloat16() + 0.5 if fusion[name][0] else None,
                    1e-5, fusion[name][2]) for name, (n, k) in SHAPES.items()}
    gbs = lambda name, ms: SHAPES[name][0] * SHAPES[name][1] * 2 / ms / 1e6  # noqa: E731
    cublas = {name: graph_ms([lambda w=w, x=xs[name]: F.linear(x, w) for w in ws]) for name, ws in weights.items()
              if not args.fused}
    block_ns = [b for b in args.block_n if rows == 1 or not gemv_module.ROWS_DOT or b >= 16]  # tl.dot: N >= 16
    table = {}
    for launch in itertools.product(block_ns, args.block_k, args.warps, args.stages):
        if launch[0] * launch[1] > 32768:
            continue
        times = {}
        try:
            for name, ws in weights.items():
                out = launch_gemv(xs[name], ws[0], *extra[name], launch)
                ref = gemv_reference(xs[name], ws[0], *extra[name])
                torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
                times[name] = graph_ms([lambda w=w, x=xs[name], e=extra[name]: launch_gemv(x, w, *e, launch)
                                        for w in ws])
        except Exception as e:  # noqa: BLE001 (out of resources: report and go on)
            print(f"{launch}: {type(e).__name__}: {str(e)[:80]}")
            continue
        table[launch] = times
    del weights
    best = {name: min(t[name] for t in table.values()) for name in SHAPES}
    print(f"\nrows={rows}: GB/s per shape (weight bytes / median time per call, calls back to back in a CUDA graph)")
    print(f"{'launch (BN, BK, warps, stages)':>32} | " + " ".join(f"{n:>8}" for n in SHAPES) + " | worst/best")
    if cublas:
        print(f"{'cuBLAS':>32} | " + " ".join(f"{gbs(n, cublas[n]):>8.0f}" for n in SHAPES) + " | "
              f"{max(cublas[n] / best[n] for n in SHAPES):.3f}")
    ranked = sorted(table.items(), key=lambda kv: max(kv[1][n] / best[n] for n in SHAPES))
    for launch, t in ranked[: args.top]:
        print(f"{str(launch):>32} | " + " ".join(f"{gbs(n, t[n]):>8.0f}" for n in SHAPES) + " | "
              f"{max(t[n] / best[n] for n in SHAPES):.3f}")
    per_shape = {n: min(table, key=lambda launch: table[launch][n]) for n in SHAPES}
    print("best per shape: " + ", ".join(f"{n} {per_shape[n]} {gbs(n, table[per_shape[n]][n]):.0f}" for n in SHAPES))


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


LINEARS = ("qkv", "o", "gate_up", "down")


def chain_weights(rows: int, layers: int) -> tuple[list[dict], int, torch.Tensor]:
    """(per-layer weights, their bytes, x ``[rows, HIDDEN]``): ``layers`` layers' worth of distinct bf16 weights of
    the model's decoder layer's four linears and two RMSNorm weights (seeded: the same for every caller)."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    mk = lambda n, k: torch.randn(n, k, generator=gen, device="cuda").mul_(0.02).bfloat16()  # noqa: E731
    lw = [dict(qkv=mk(Q + 2 * KV, HIDDEN), o=mk(HIDDEN, Q), gate_up=mk(2 * INTER, HIDDEN), down=mk(HIDDEN, INTER),
               n1=torch.rand(HIDDEN, device="cuda").bfloat16() + 0.5,
               n2=torch.rand(HIDDEN, device="cuda").bfloat16() + 0.5)
          for _ in range(layers)]
    weight_bytes = sum(t.numel() * 2 for layer in lw for t in layer.values())
    return lw, weight_bytes, torch.randn(rows, HIDDEN, generator=gen, device="cuda").bfloat16()


def gemv_chain(lw: list[dict], x: torch.Tensor, fns: Callable | dict[str, Callable]) -> torch.Tensor:
    """Each layer's four linears with the layer's fusions (``launch_gemv``'s signature); ``fns``: one callable for
    all four, or one per name in ``LINEARS``."""
    fn = fns if isinstance(fns, dict) else dict.fromkeys(LINEARS, fns)
    for p in lw:
        qkv = fn["qkv"](x, p["qkv"], None, p["n1"], 1e-5, False)
        x = fn["o"](qkv[:, :Q], p["o"], x, None, 0.0, False)  # attention's output stands in for q
        h = fn["gate_up"](x, p["gate_up"], None, p["n2"], 1e-5, False)
        x = fn["down"](h, p["down"], x, None, 0.0, True)
    return x


def chain(rows: int, layers: int, copy_gbs: float) -> None:
    lw, weight_bytes, x0 = chain_weights(rows, layers)

    def torch_layers(x: torch.Tensor) -> torch.Tensor:
        for p in lw:
            qkv = F.linear(rms(x, p["n1"]), p["qkv"])
            x = x + F.linear(qkv[:, :Q], p["o"])  # attention's output stands in for q
            gate, up = F.linear(rms(x, p["n2"]), p["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, p["down"])
        return x

    def gemv_layers(x: torch.Tensor, fn: Callable = launch_gemv) -> torch.Tensor:  # fn: the op or its reference
        return gemv_chain(lw, x, fn)

    ref = gemv_layers(x0, gemv_reference)
    results = {}
    paths = [("torch (cuBLAS + elementwise)", torch_layers), ("fused tfs::gemv", gemv_layers)]
    if HAS_GDC and torch.cuda.get_device_capability()[0] >= 9:  # programmatic dependent launch between the gemvs
        for pf in (0, 512, 2048):  # with the first pf elements of each weight row prefetched before the wait
            fn = functools.partial(launch_gemv, pdl=True, prefetch_k=pf)
            paths.append((f"fused tfs::gemv, PDL, prefetch {pf}", lambda x, fn=fn: gemv_layers(x, fn)))
        # as the model launches them (tfs::gemv_pdl): its prefetch, and the first weight chunk loaded before the
        # wait where PDL_PRELOAD says (no attention between o_proj and the gemv before it here, unlike the model)
        fn = functools.partial(launch_gemv, pdl=True, prefetch_k=None, preload=None)
        classes = {name: launch_class(x0.shape[0], *lw[0][name].shape) for name in LINEARS}  # as the chain's
        prefetch = "/".join(f"{name} {PDL_PREFETCH_K[c]}" for name, c in classes.items())
        preload = "/".join(name for name, c in classes.items() if c in PDL_PRELOAD) or "none"
        paths.append((f"fused tfs::gemv, PDL, prefetch {prefetch}, preload {preload}",
                      lambda x, fn=fn: gemv_layers(x, fn)))
    for name, fn in paths:
        out = fn(x0)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        results[name] = (graph_ms([lambda fn=fn: fn(x0)]), err)
    floor_ms = weight_bytes / copy_gbs / 1e6
    print(f"\nchain: {layers} layers, {rows} row(s), {weight_bytes / 1e9:.2f} GB of weights, copy {copy_gbs:.0f} GB/s, "
          f"floor {floor_ms:.3f} ms")
    print(f"{'path':>30} | {'ms':>7} | {'GB/s':>6} | {'/floor':>6} | rel. err vs reference")
    for name, (ms, err) in results.items():
        print(f"{name:>30} | {ms:>7.3f} | {weight_bytes / ms / 1e6:>6.0f} | {ms / floor_ms:>6.3f} | {err:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=list(DIMS), default="llama3_8b", help="whose linear shapes")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--block-n", nargs="+", type=int, default=[8, 16, 32, 64])
    ap.add_argument("--block-k", nargs="+", type=int, default=[128, 256, 512, 1024])
    ap.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3, 4])
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--chain-only", action="store_true")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="weights to sweep")
    ap.add_argument("--no-chain", action="store_true", help="skip the 32-layer chain")
    ap.add_argument("--hot", action="store_true", help="one copy of each weight, read again by every call")
    ap.add_argument("--fused", action="store_true", help="sweep each weight with the layer's fusion (no cuBLAS row)")
    ap.add_argument("--norm-first", action="store_true",
                    help="tfs_kernels.gemv.LATE_NORM off: RMSNorm in a pass over x before the product")
    ap.add_argument("--rows-fma", action="store_true",
                    help="tfs_kernels.gemv.ROWS_DOT off: several rows on the CUDA cores, not the 16-row tl.dot tile")
    args = ap.parse_args()
    gemv_module.ROWS_DOT = not args.rows_fma
    global HIDDEN, INTER, Q, KV, VOCAB
    HIDDEN, INTER, Q, KV, VOCAB = DIMS[args.model]
    SHAPES.clear()
    SHAPES.update(linear_shapes())
    gemv_module.LATE_NORM = not args.norm_first
    for name in set(SHAPES) - set(args.shapes):
        del SHAPES[name]
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    copy_gbs = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    for rows in args.rows:
        if not args.chain_only:
            sweep(rows, args)
        if not args.no_chain:
            chain(rows, args.layers, copy_gbs)


if __name__ == "__main__":
    main()
