"""Sweep ``tfs::det_matmul``'s CUDA tile per weight-shape class against what the default mode runs, on a CUDA GPU.

    python3 bench/tune_det_matmul.py                                 # Llama-3-8B's and SmolLM2's shapes, 1 and 8 rows
    python3 bench/tune_det_matmul.py --models smollm2 --rows 1 --block-n 16 32 --block-k 64 128 256
    python3 bench/tune_det_matmul.py --models llama3_8b --tiles 16,32,256,4,4 16,64,128,4,3,1,2   # given tiles
    python3 bench/tune_det_matmul.py --models llama3_8b --tiles 16,64,256,4,4,1,1 --late-norm 0   # the norm first

model.deterministic runs every linear through ``tfs::det_matmul`` with a tile chosen by the weight's shape class
(tfs_kernels.gemv.launch_class: tall, square, wide, very_wide, vocab; never by the row count, so any choice stays
batch-invariant). For each model's linears, with the decoder layer's fusions (RMSNorm into qkv and gate_up, the residual
into o and down, SiLU-mul into down), every tile (BLOCK_M 16; BLOCK_N, BLOCK_K, warps, stages, the operand order and K's
split from the options) is checked against the reference and timed in a CUDA graph over enough copies of the weight that
they come from HBM, as in a forward; the baseline is what the default mode runs for that row count (``tfs::gemv`` for
one row, cuBLAS with torch's elementwise ops for several). Prints each shape's baseline and best tiles, then per class
the tile with the lowest mean time over the baseline across rows and models: the ``CUDA_TILES`` entries to try in
tfs_kernels/det_matmul.py, then confirm with bench/bench_deterministic.py (the whole forward).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import tfs_kernels.det_matmul as det  # noqa: E402
from tfs_kernels.gemv import launch_class, launch_gemv  # noqa: E402
from tune_gemv import FUSION, graph_ms  # noqa: E402

MODELS = {  # name: (N, K) of each linear (qkv, o, gate_up, down, lm_head)
    "llama3_8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                  "lm_head": (128256, 4096)},
    "smollm2": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                "lm_head": (49152, 576)},
}


def default_path(x: torch.Tensor, w: torch.Tensor, res, nw, silu: bool) -> torch.Tensor:
    """The default mode's product for these rows: the fused one-row gemv, or cuBLAS with unfused elementwise ops."""
    if x.shape[0] == 1:
        return launch_gemv(x, w, res, nw, 1e-5, silu)
    if silu:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    if nw is not None:
        xf = x.float()
        x = nw * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    y = F.linear(x, w)
    return y if res is None else res + y


def det_call(x: torch.Tensor, w: torch.Tensor, res, nw, silu: bool) -> torch.Tensor:
    return torch.ops.tfs.det_matmul(x, w, res, silu, False, nw, 1e-5)


def sweep_shape(n: int, k: int, fusion: tuple[bool, bool, bool], rows: int, tiles: list[tuple]) -> dict:
    """{tile or "baseline": ms per call} for one ``[n, k]`` weight at ``rows`` rows."""
    norm, residual, silu = fusion
    gen = torch.Generator(device="cuda").manual_seed(n * 7 + k + rows)
    copies = min(256, max(2, (2 << 30) // (n * k * 2)))  # >= 2 GB, or 256 copies (> 50 MB of L2)
    ws = [torch.randn(n, k, generator=gen, device="cuda").mul_(0.02).bfloat16() for _ in range(copies)]
    x = torch.randn(rows, k * (2 if silu else 1), generator=gen, device="cuda").bfloat16()
    res = torch.randn(rows, n, generator=gen, device="cuda").bfloat16() if residual else None
    nw = torch.rand(k, generator=gen, device="cuda").bfloat16() + 0.5 if norm else None
    times = {"baseline": graph_ms([lambda w=w: default_path(x, w, res, nw, silu) for w in ws])}
    ref = det.det_matmul_reference(x, ws[0], res, silu, False, nw, 1e-5).float()
    for tile in tiles:
        det.CUDA_TILE, det.CUDA_TILES = tile, {}
        try:
            torch.testing.assert_close(det_call(x, ws[0], res, nw, silu).float(), ref, atol=3e-2, rtol=3e-2)
            times[tile] = graph_ms([lambda w=w: det_call(x, w, res, nw, silu) for w in ws])
        except Exception as e:  # noqa: BLE001 (out of resources: report and go on)
            print(f"  {tile}: {type(e).__name__}: {str(e)[:80]}")
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--block-n", nargs="+", type=int, default=[16, 32, 64])
    ap.add_argument("--block-k", nargs="+", type=int, default=[128, 256, 512])
    ap.add_argument("--warps", nargs="+", type=int, default=[4])
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3, 4])
    ap.add_argument("--swap", nargs="+", type=int, choices=[0, 1], default=[0, 1],
                    help="1: the weight as the product's first operand (the tile's sixth entry)")
    ap.add_argument("--split-k", nargs="+", type=int, default=[1], help="K ranges (the tile's seventh entry)")
    ap.add_argument("--tiles", nargs="+", default=[], metavar="BM,BN,BK,WARPS,STAGES[,SWAP[,SPLIT]]",
                    help="these tiles instead of the product of the options above")
    ap.add_argument("--late-norm", type=int, choices=[0, 1], default=int(det.LATE_NORM),
                    help="det_matmul.LATE_NORM: a fused RMSNorm's 1 / rms applied after the weight loop (1) or a pass "
                         "over x before it (0)")
    ap.add_argument("--min-programs", type=int, default=det.MIN_PROGRAMS,
                    help="det_matmul.MIN_PROGRAMS: a tile's BLOCK_N halves (down to 16) until the weight has this many "
                         "programs (0: every tile as given)")
    ap.add_argument("--split-fixup", type=int, choices=[0, 1], default=int(det.SPLIT_FIXUP),
                    help="det_matmul.SPLIT_FIXUP: a split tile summed by its last K range (1) or a second kernel (0)")
    ap.add_argument("--top", type=int, default=3)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    det.LATE_NORM = bool(args.late_norm)
    det.MIN_PROGRAMS = args.min_programs
    det.SPLIT_FIXUP = bool(args.split_fixup)
    if det.SPLIT_FIXUP:
        det.fixup_counts(torch.device("cuda"))  # (before the CUDA graphs that time the tiles are captured)
    tiles = [(16, bn, bk, w, s, bool(sw), sk) for bn, bk, w, s, sw, sk in itertools.product(
        args.block_n, args.block_k, args.warps, args.stages, args.swap, args.split_k) if bn * bk <= 32768]
    if args.tiles:
        tiles = [tuple(int(v) for v in t.split(",")) for t in args.tiles]
        tiles = [t[:5] + tuple(bool(v) if i == 0 else v for i, v in enumerate(t[5:])) for t in tiles]
    print(f"{torch.cuda.get_device_name()}: {len(tiles)} tiles (LATE_NORM {det.LATE_NORM}); the current default "
          f"{det.CUDA_TILE}, per class {det.CUDA_TILES or 'none'}; MIN_PROGRAMS {det.MIN_PROGRAMS}, SPLIT_FIXUP "
          f"{det.SPLIT_FIXUP}")
    ratios: dict[str, dict[tuple, list[float]]] = {}  # class -> tile -> [time / baseline per (model, shape, rows)]
    for model, rows in itertools.product(args.models, args.rows):
        print(f"\n{model}, {rows} row(s): ms per call (weights from HBM), x the default mode's")
        for name, (n, k) in MODELS[model].items():
            times = sweep_shape(n, k, FUSION[name], rows, tiles)
            base = times.pop("baseline")
            ranked = sorted(times, key=times.get)[: args.top]
            cls = launch_class(1, n, k)
            for tile, ms in times.items():
                ratios.setdefault(cls, {}).setdefault(tile, []).append(ms / base)
            print(f"  {name:>8} [{n}, {k}] ({cls}): default {base:.4f} | " + ", ".join(
                f"{t} {times[t]:.4f} ({times[t] / base:.2f}x)" for t in ranked))
    print("\nper shape class, the tile with the lowest mean time / default over the rows and models above:")
    for cls, by_tile in ratios.items():
        full = {t: r for t, r in by_tile.items() if len(r) == max(map(len, by_tile.values()))}
        best = min(full, key=lambda t: statistics.mean(full[t]))
        print(f"  {cls:>10}: {best}  mean {statistics.mean(full[best]):.2f}x, worst {max(full[best]):.2f}x")


if __name__ == "__main__":
    main()
