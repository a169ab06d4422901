"""Sweep the split-K attention kernel's launch parameters on a CUDA GPU: (BLOCK_N, num_warps, num_stages) of
``tfs_kernels.split_kv_attention.CUDA_LAUNCH`` for decode (1 token per request) and verify (8 tokens, tree mask), and
the programs-per-SM target of the split policy. Llama-3-8B attention shape, bf16, page_size 16.

    python bench/tune_split_kv.py                      # ~3 min on an H200
    python bench/tune_split_kv.py --configs 32x4096 --targets 4

Each configuration's output is checked against SDPA before it is timed (bench_attention's helpers). Prints, per
mode, every configuration's time at each shape and its worst slowdown against the best configuration per shape.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_attention as ba  # noqa: E402
import tfs_kernels.split_kv_attention as skv  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["1x4096", "1x32768", "32x4096", "64x32768"])
    ap.add_argument("--block-n", nargs="+", type=int, default=[32, 64, 128])
    ap.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3, 4])
    ap.add_argument("--targets", nargs="+", type=int, default=[2, 4, 8], help="programs per SM (best launch only)")
    ap.add_argument("--min-split-lens", nargs="+", type=int, default=[128], help="(best launch only)")
    ap.add_argument("--sweep-at", nargs=2, type=int, default=[4, 128], metavar=("TARGET", "MIN_SPLIT"),
                    help="programs per SM and shortest split while sweeping the launches")
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in c.split("x")) for c in args.configs]
    launches = list(itertools.product(args.block_n, args.warps, args.stages))
    dev = torch.device("cuda")
    results: dict[str, dict] = {"decode": {}, "multi": {}}

    def run_shape(bs: int, context: int, modes_launch: dict, target: int, min_split: int = 128) -> dict:
        gen = torch.Generator().manual_seed(bs * 7 + context)
        slots = (bs * -(-context // args.page_size) + 1) * args.page_size
        k_pool, v_pool, table, k, v = ba.paged_cache(bs, context, args.page_size, slots, gen)
        q = torch.randn(bs, ba.HEADS, ba.DIM, generator=gen).to("cuda", torch.bfloat16)
        q8 = torch.randn(bs * ba.DRAFT, ba.HEADS, ba.DIM, generator=gen).to("cuda", torch.bfloat16)
        mask = torch.rand(bs, ba.DRAFT, ba.DRAFT, generator=gen) < 0.5
        mask = ((mask & torch.ones(ba.DRAFT, ba.DRAFT, dtype=torch.bool).tril())
                | torch.eye(ba.DRAFT, dtype=torch.bool)).cuda()
        mask8 = mask.to(torch.uint8)  # as attention=triton passes it (converted once per step, not per layer)
        rpi = torch.arange(bs, device="cuda")
        seq = torch.full((bs,), context, device="cuda")
        ref_d = ba.sdpa_flash(q, k, v)
        ref_v = ba.verify_reference(q8, k, v, mask)
        repeat = 20 if bs * context < 1 << 20 else 2
        skv.TARGET_PROGRAMS_PER_SM = {"decode": target, "multi": target}
        skv.MIN_SPLIT_LEN = min_split
        pol = skv.split_policy(dev, 1)
        out = {}
        for mode, launch in modes_launch.items():
            for cfg in launch:
                skv.CUDA_LAUNCH[mode] = skv.CUDA_LAUNCH[f"{mode}_small"] = cfg  # one launch at every batch
                if mode == "decode":
                    fn = lambda: torch.ops.tfs.decode_attention(q, k_pool, v_pool, table, rpi, seq,  # noqa: E731
                                                                ba.SCALE, *pol)
                    ba.check(f"decode {cfg}", fn(), ref_d)
                else:
                    fn = lambda: torch.ops.tfs.verify_attention(q8, k_pool, v_pool, table, rpi, seq, mask8,  # noqa
                                                                ba.DRAFT, ba.SCALE, *pol)
                    ba.check(f"verify {cfg}", fn(), ref_v)
                out[(mode, cfg)] = ba.time_us(fn, repeat)
        del k_pool, v_pool, table, k, v
        torch.cuda.empty_cache()
        return out

    for bs, context in shapes if len(launches) > 1 else []:
        r = run_shape(bs, context, {"decode": launches, "multi": launches}, *args.sweep_at)
        for (mode, cfg), us in r.items():
            results[mode].setdefault(cfg, {})[(bs, context)] = us
        print(f"{bs}x{context}: " + ", ".join(f"{m[0]}{c}={us:.1f}" for (m, c), us in sorted(r.items())), flush=True)

    best = {"decode": launches[0], "multi": launches[0]}
    for mode, table in results.items() if len(launches) > 1 else []:
        per_shape_best = {s: min(t[s] for t in table.values()) for s in shapes}
        ranked = sorted(table.items(), key=lambda kv: max(kv[1][s] / per_shape_best[s] for s in shapes))
        best[mode] = ranked[0][0]
        print(f"\n{mode}: (BLOCK_N, warps, stages) | " + " | ".join(f"{b}x{c} us" for b, c in shapes) + " | worst/best")
        for cfg, t in ranked[:8]:
            worst = max(t[s] / per_shape_best[s] for s in shapes)
            print(f"{cfg} | " + " | ".join(f"{t[s]:.1f}" for s in shapes) + f" | {worst:.3f}")

    print("\nprograms per SM, best launches", best)
    rows = {}
    for target, min_split in itertools.product(args.targets, args.min_split_lens):
        for bs, context in shapes:
            r = run_shape(bs, context, {m: [c] for m, c in best.items()}, target, min_split)
            rows[(target, min_split, bs, context)] = (r[("decode", best["decode"])], r[("multi", best["multi"])])
    copy_gbs = ba.copy_bandwidth()
    print(f"device copy {copy_gbs:.0f} GB/s (read + write)")
    print("target/SM | min split | batch x context | decode us | GB/s | /copy | verify8 us | verify/decode")
    for (target, min_split, bs, context), (d, v) in rows.items():
        gbs = bs * context * ba.KV_HEADS * ba.DIM * 4 / d / 1e3
        print(f"{target} | {min_split} | {bs}x{context} | {d:.1f} | {gbs:.0f} | {gbs / copy_gbs:.2f} | {v:.1f} | "
              f"{v / d:.2f}")


if __name__ == "__main__":
    main()
