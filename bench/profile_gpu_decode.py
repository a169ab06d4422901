"""Where a compiled decode step's GPU time goes: torch.profiler over replays of one decode forward, kernels
grouped into GEMMs, attention, KV store and the rest (norms, RoPE, activations: inductor's fused Triton kernels).

    python bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 -- attention=triton

Prints the top kernels by total GPU time, the per-forward sum of kernel time by group, the number of kernels per
forward, and the forward's wall time (CUDA events), so that the gap between kernels shows as wall - kernel sum.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_gpu_decode import decode_setup, forward_times_ms  # noqa: E402
from tfs_kernels.gemv import PREFETCH_CHOICES  # noqa: E402
from kernel_profile import kernel_times  # noqa: E402
from knobs import add_set_option, apply_sets  # noqa: E402

GROUPS = [("gemm", r"gemm|gemv|det_matmul|cutlass|sm90_|sm80_|ampere|cublas|nvjet|splitK|qkv_rope_store"),
          ("attention", r"split_kv"),
          ("kv store", r"store_kv"), ("copy/memset", r"memcpy|memset|Memcpy|Memset")]


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name):
            return group
    return "other (fused elementwise, norms, rope, ...)"


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: every parameter once, but of the embedding table one row per token
    (a tied lm_head reads the table whole, so then it counts whole)."""
    emb = model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() lists a tied table once
    if model.lm_head.weight is emb:
        return total
    return total - emb.numel() * emb.element_size() + emb.shape[1] * emb.element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3_8b_random")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup-s", type=float, default=1.0,
                    help="replay the forward for this long before measuring (it does not remove the 0.6-0.8%% "
                         "by which a call's first run is often slower: docs/PERFORMANCE.md, 8B decode step)")
    ap.add_argument("--mode", default="reduce_overhead", choices=["reduce_overhead", "eager"])
    ap.add_argument("--timeline", type=int, default=24, help="print this many kernels of one forward in order")
    ap.add_argument("--gemv-launch", nargs="*", default=[], metavar="CLASS=BN,BK,WARPS,STAGES",
                    help="replace tfs::gemv launch classes (tfs_kernels/gemv.py CUDA_LAUNCH), e.g. square=8,1024,4,3")
    ap.add_argument("--pdl-prefetch-k", type=int, choices=PREFETCH_CHOICES,
                    help="weight columns every PDL gemv prefetches into L2 before its wait, in every launch class "
                         "(tfs_kernels/gemv.py PDL_PREFETCH_K, also tfs::qkv_rope_store's), before any --set")
    add_set_option(ap)
    ap.add_argument("--floor", action="store_true",
                    help="also measure the copy bandwidth and print the GPU span over the HBM floor (the weight "
                         "bytes a decode step reads over the copy bandwidth)")
    ap.add_argument("extra", nargs="*", help="extra Hydra overrides")
    args = ap.parse_args()
    if args.pdl_prefetch_k:
        from tfs_kernels.gemv import PDL_PREFETCH_K

        PDL_PREFETCH_K.update(dict.fromkeys(PDL_PREFETCH_K, args.pdl_prefetch_k))
    apply_sets(ap, args.set)
    for item in args.gemv_launch:
        from tfs_kernels.gemv import CUDA_LAUNCH

        name, launch = item.split("=")
        if name not in CUDA_LAUNCH:
            ap.error(f"--gemv-launch {item}: no launch class {name!r}; classes: {', '.join(CUDA_LAUNCH)}")
        CUDA_LAUNCH[name] = tuple(int(v) for v in launch.split(","))
    engine, _, batch = decode_setup(args.model, args.mode, args.batch, args.context, 8, args.extra)
    with torch.inference_mode():
        start = time.perf_counter()
        while time.perf_counter() - start < args.warmup_s:
            engine.runner.forward(batch)
            torch.cuda.synchronize()
    wall = forward_times_ms(engine, batch, args.reps)
    with torch.inference_mode():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                engine.runner.forward(batch)
            torch.cuda.synchronize()
    kernels, per_name = kernel_times(prof)
    if not kernels:  # this torch's profiler did not expose device events one by one: fall back to its own table
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30))
        return
    total_us = sum(sum(v) for v in per_name.values()) / args.reps
    by_group: dict[str, float] = defaultdict(float)
    for name, times in per_name.items():
        by_group[group_of(name)] += sum(times) / args.reps
    print(f"\n{args.model}, batch {args.batch}, context {args.context}, {args.mode}, {torch.cuda.get_device_name()}")
    print(f"forward wall (CUDA events, median of {args.reps}): {statistics.median(wall) * 1000:.0f} us; "
          f"kernel time per forward: {total_us:.0f} us in {len(kernels) / args.reps:.0f} kernels")
    print("group | us per forward | share")
    for group, us in sorted(by_group.items(), key=lambda kv: -kv[1]):
        print(f"{group} | {us:.0f} | {us / total_us:.2f}")
    per_forward = len(kernels) // args.reps
    ordered = sorted(kernels, key=lambda e: e.time_range.start)
    spans = [ordered[i + per_forward - 1].time_range.end - ordered[i].time_range.start
             for i in range(0, per_forward * args.reps, per_forward)]
    print(f"GPU span of one forward (first kernel start to last kernel end, median): {statistics.median(spans):.0f} us"
          " (the wall time above also counts the host's work before the graph launch)")
    if args.floor:
        from bench_attention import copy_bandwidth

        read, gbs = step_weight_bytes(engine.model), copy_bandwidth()
        floor_us = read / gbs / 1e3  # bytes over GB/s, in us
        print(f"HBM floor: {read / 1e9:.2f} GB of weights at {gbs:.0f} GB/s (device copy) = "
              f"{floor_us:.0f} us; GPU span / floor = {statistics.median(spans) / floor_us:.3f}")
    one = ordered[per_forward: per_forward + args.timeline]  # the 2nd replay
    print(f"\none forward's first {len(one)} kernels: start us | gap before us | duration us | name")
    for prev, e in zip([None, *one], one):
        gap = e.time_range.start - prev.time_range.end if prev is not None else 0.0
        print(f"{e.time_range.start - one[0].time_range.start:8.1f} | {gap:6.1f} | {e.time_range.elapsed_us():7.1f} | "
              f"{e.name[:80]}")
    print("\ntop kernels | calls per forward | us per forward | mean us")
    for name, times in sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:25]:
        print(f"{name[:90]} | {len(times) / args.reps:.0f} | {sum(times) / args.reps:.0f} | "
              f"{statistics.mean(times):.1f}")


if __name__ == "__main__":
    main()
