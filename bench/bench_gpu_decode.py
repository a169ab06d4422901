"""Decode-step time on a CUDA GPU: compiled (torch.compile reduce-overhead, CUDA graphs) against eager.

    python bench/bench_gpu_decode.py --model smollm2_135m_random --batch 1 8 --context 512

Times (medians, after warm-up) (a) the model forward alone with CUDA events (graph replay when compiled) and
(b) a whole engine step (batch building, forward, sampling, host read-back), at each batch size with ``context``
tokens already in the KV cache. Extra Hydra overrides go after ``--``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from framework import LLM  # noqa: E402
from framework.request import Request  # noqa: E402
from framework.sampling import SamplingParams  # noqa: E402


def decode_setup(model: str, mode: str, bs: int, context: int, steps: int, extra: list[str],
                 device: str = "cuda"):
    """An engine with ``bs`` requests of ``context`` random tokens prefilled and decoding, and one decode
    ``(step, batch)`` scheduled from it (not yet run)."""
    llm = LLM([f"model={model}", f"model.device={device}", f"compile={mode}", f"scheduler.max_running_requests={bs}",
               f"scheduler.max_context={context + 4 * steps + 64}", *extra])
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    vocab = min(engine.model.args.vocab_size, 49152)
    for i in range(bs):
        ids = torch.randint(0, vocab, (context,), generator=gen).tolist()
        engine.submit(Request(rid=i, prompt_ids=ids, params=SamplingParams(max_tokens=4 * steps, ignore_eos=True),
                              seed=0, max_new_tokens=4 * steps))
    while any(not r.prefilled or not r.output_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(5):
        engine.step()
    engine.drain()  # (the overlapped loop's last step)
    step = engine.scheduler.schedule()
    return engine, step, engine.scheduler.build_batch(step)


@torch.inference_mode()
def forward_times_ms(engine, batch, reps: int) -> list[float]:
    """CUDA-event times of ``reps`` forwards of ``batch`` (graph replays when compiled), after 5 warm-up ones."""
    for _ in range(5):
        engine.runner.forward(batch)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        engine.runner.forward(batch)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_engine(model: str, mode: str, bs: int, context: int, steps: int, extra: list[str]) -> dict:
    engine, step, batch = decode_setup(model, mode, bs, context, steps, extra)
    # (a) the forward alone, replayed on one decode batch
    forward_ms = forward_times_ms(engine, batch, steps)
    with torch.inference_mode():
        logits, _ = engine.runner.forward(batch)
    engine.scheduler.commit_launch(step)
    engine.scheduler.process(step, logits.argmax(-1).tolist())
    # (b) whole engine steps
    step_ms = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - t0) * 1000)
    for req in list(engine.scheduler.running):
        engine.abort(req.rid)
    engine.allocator.assert_all_free()
    engine.close()  # (tensor parallelism: the other ranks)
    return {"forward_ms": statistics.median(forward_ms), "step_ms": statistics.median(step_ms),
            "startup_s": engine.startup_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2_135m_random")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--modes", nargs="+", default=["reduce_overhead", "eager"], choices=["reduce_overhead", "eager"])
    ap.add_argument("extra", nargs="*", help="extra Hydra overrides")
    args = ap.parse_args()
    rows = []
    for mode in args.modes:
        for bs in args.batch:
            r = time_engine(args.model, mode, bs, args.context, args.steps, args.extra)
            rows.append((mode, bs, r))
            print(f"{mode} bs={bs}: {r}", flush=True)
    print(f"\n{args.model}, bf16, context {args.context}, {torch.cuda.get_device_name()}")
    print(f"{'compile':>16} {'batch':>5} {'forward ms':>11} {'step ms':>8} {'tok/s':>8}")
    for mode, bs, r in rows:
        print(f"{mode:>16} {bs:>5} {r['forward_ms']:>11.3f} {r['step_ms']:>8.3f} {bs * 1000 / r['step_ms']:>8.1f}")


if __name__ == "__main__":
    main()
