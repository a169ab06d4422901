"""Where a compiled decode forward's CPU time goes: torch.profiler over forwards of one decode batch, grouped into
MKL GEMMs, attention, and the rest (inductor's generated kernels and framework overhead).

    .venv/bin/python bench/profile_cpu_decode.py [--batch 1] [--prompt-len 80] [overrides...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from framework import LLM  # noqa: E402
from framework.request import Request  # noqa: E402
from framework.sampling import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=80)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("extra", nargs="*", help="extra Hydra overrides")
    args = ap.parse_args()
    llm = LLM(["model=smollm2_135m", "compile=reduce_overhead", f"scheduler.max_running_requests={args.batch}",
               *args.extra])
    engine = llm.engine
    for i in range(args.batch):
        ids = list(range(100 + i, 100 + i + args.prompt_len))
        engine.submit(Request(rid=i, prompt_ids=ids, params=SamplingParams(max_tokens=64, ignore_eos=True), seed=0,
                              max_new_tokens=64))
    for _ in range(args.batch + 4):
        engine.step()
    batch = engine.scheduler.build_batch(engine.scheduler.schedule())
    with torch.inference_mode():
        for _ in range(5):
            engine.runner.forward(batch)
        start = time.perf_counter()
        for _ in range(args.reps):
            engine.runner.forward(batch)
        wall_ms = (time.perf_counter() - start) / args.reps * 1000
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.reps):
                engine.runner.forward(batch)
    events = prof.key_averages()
    self_ms = {e.key: e.self_cpu_time_total / 1000 / args.reps for e in events}
    gemm = sum(ms for k, ms in self_ms.items() if "linear" in k or "mm" in k.split("::")[-1])
    attention = sum(ms for k, ms in self_ms.items() if "attention" in k)
    graph = sum(ms for k, ms in self_ms.items() if "CompiledFxGraph" in k)
    calls = {e.key: e.count // args.reps for e in events}
    print(f"\nbatch {args.batch}, prompt {args.prompt_len} tokens, torch threads {torch.get_num_threads()}")
    print(f"forward wall {wall_ms:.1f} ms | GEMMs (self) {gemm:.1f} ms in "
          f"{sum(c for k, c in calls.items() if 'linear' in k)} calls | attention {attention:.1f} ms | "
          f"inductor kernels (compiled graph self time) {graph:.1f} ms | profiled total "
          f"{sum(self_ms.values()):.1f} ms")


if __name__ == "__main__":
    main()
