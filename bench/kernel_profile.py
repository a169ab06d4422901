"""The GPU's side of a stretch of work: torch.profiler's kernels, how busy they kept the GPU, and the kernels that
took the most time per iteration. Used by ``bench/e2e.py --kernels N`` on the user's own job.

A CUDA graph replay's kernels are traced one by one (CUPTI), so a speculative iteration's prepare, verify forward,
and finish show up as their kernels; the busy share is the union of kernel intervals over the wall time, so what is
left (1 - share) is time the GPU waited for the host.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

import torch


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (us): time with at least one kernel running."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def kernel_times(prof) -> tuple[list, dict[str, list[float]]]:
    """A finished torch.profiler run's CUDA kernel events, and each kernel name's durations (us)."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        per_name[e.name].append(e.time_range.elapsed_us())
    return kernels, per_name


def timeline(spans: list[tuple[str, float, float]], count: int) -> list[tuple[str, float, float]]:
    """``count`` consecutive kernels from the middle of ``spans`` ((name, start us, end us), any order): (name, us
    it ran, us since the one before it ended; negative where they overlap, as PDL launches do) in start order. A
    replayed graph's kernels repeat, so the middle of a steady run shows a typical stretch, one layer's kernels
    apart from the next's."""
    spans = sorted(spans, key=lambda k: k[1])
    first = max(0, (len(spans) - count) // 2)
    out, end = [], None
    for name, start, stop in spans[first: first + count]:
        out.append((name, round(stop - start, 1), round(start - end, 1) if end is not None else 0.0))
        end = stop
    return out


def profile_kernels(work: Callable[[], int], top: int, stretch: int = 0) -> dict:
    """Run ``work`` (it returns how many iterations it ran) under torch.profiler (CUDA activity only) -> wall us,
    kernel us and GPU busy us per iteration, busy share, the ``top`` kernels by time: (name, calls per
    iteration, us per iteration), and ``stretch`` consecutive kernels in order (:func:`timeline`)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        iterations = work()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    kernels, per_name = kernel_times(prof)
    n = max(iterations, 1)
    busy = busy_us([(e.time_range.start, e.time_range.end) for e in kernels])
    ranked = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"iterations": iterations, "wall_us_per_iteration": round(wall_us / n, 1),
            "kernel_us_per_iteration": round(sum(sum(v) for v in per_name.values()) / n, 1),
            "kernels_per_iteration": round(len(kernels) / n, 1), "busy_us_per_iteration": round(busy / n, 1),
            "gpu_busy_share": round(busy / wall_us, 3) if wall_us else 0.0,
            "top_kernels": [(name, round(len(t) / n, 2), round(sum(t) / n, 1)) for name, t in ranked],
            "timeline": timeline([(e.name, e.time_range.start, e.time_range.end) for e in kernels], stretch)}


def print_profile(label: str, prof: dict) -> None:
    print(f"--- {label}: {prof['iterations']} iterations; per iteration: wall {prof['wall_us_per_iteration']:.0f} us, "
          f"GPU busy {prof['busy_us_per_iteration']:.0f} us (share {prof['gpu_busy_share']:.2f}), "
          f"{prof['kernels_per_iteration']:.0f} kernels of {prof['kernel_us_per_iteration']:.0f} us")
    print("kernel | calls per iteration | us per iteration")
    for name, calls, us in prof["top_kernels"]:
        print(f"{name[:90]} | {calls:.2f} | {us:.1f}")
    if prof.get("timeline"):
        print(f"{len(prof['timeline'])} consecutive kernels from the middle of the run: kernel | us | us after the "
              "one before (negative: overlapped)")
        for name, us, gap in prof["timeline"]:
            print(f"{name[:90]} | {us:.1f} | {gap:.1f}")
