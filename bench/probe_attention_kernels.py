"""Where a split-K attention call's time goes: the partial kernel and the merge kernel, timed one by one
(torch.profiler, eager launches) next to the whole call replayed in a CUDA graph (what a decode step sees).
Llama-3-8B attention shape, bf16, page_size 16, the production launch and split policy.

    python bench/probe_attention_kernels.py                     # (1, 1k), (1, 4k), (1, 32k), (32, 4k)
    python bench/probe_attention_kernels.py --configs 1x4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_attention as ba  # noqa: E402
from kernels.split_kv_attention import split_policy  # noqa: E402


def kernel_us(fn, reps: int = 50) -> dict[str, float]:
    """Median GPU microseconds of each kernel ``fn`` launches (eager; torch.profiler's device events)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name].append(e.time_range.elapsed_us())
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["1x1024", "1x4096", "1x32768", "32x4096"])
    args = ap.parse_args()
    dev = torch.device("cuda")
    print("batch x context | mode | graph us per call | partial kernel us | merge kernel us")
    for bs, context in (tuple(int(x) for x in c.split("x")) for c in args.configs):
        gen = torch.Generator().manual_seed(bs + context)
        slots = (bs * -(-context // 16) + 1) * 16
        k_pool, v_pool, table, k, v = ba.paged_cache(bs, context, 16, slots, gen)
        q = torch.randn(bs, ba.HEADS, ba.DIM, generator=gen).to("cuda", torch.bfloat16)
        q8 = torch.randn(bs * ba.DRAFT, ba.HEADS, ba.DIM, generator=gen).to("cuda", torch.bfloat16)
        mask = ((torch.rand(bs, ba.DRAFT, ba.DRAFT, generator=gen) < 0.5).tril()
                | torch.eye(ba.DRAFT, dtype=torch.bool)).cuda()
        rpi = torch.arange(bs, device="cuda")
        seq = torch.full((bs,), context, device="cuda")
        calls = {
            "decode": lambda: torch.ops.tfs.decode_attention(q, k_pool, v_pool, table, rpi, seq, ba.SCALE,
                                                             *split_policy(dev, 1)),
            "verify": lambda: torch.ops.tfs.verify_attention(q8, k_pool, v_pool, table, rpi, seq, mask, ba.DRAFT,
                                                             ba.SCALE, *split_policy(dev, ba.DRAFT)),
        }
        ba.check("decode", calls["decode"](), ba.sdpa_flash(q, k, v))
        ba.check("verify", calls["verify"](), ba.verify_reference(q8, k, v, mask))
        for mode, fn in calls.items():
            per_kernel = kernel_us(fn)
            partial = sum(us for name, us in per_kernel.items() if "partial" in name)
            merge = sum(us for name, us in per_kernel.items() if "reduce" in name)
            print(f"{bs}x{context} | {mode} | {ba.time_us(fn, 20):.1f} | {partial:.1f} | {merge:.1f}", flush=True)


if __name__ == "__main__":
    main()
