"""Decode-step time on a CUDA GPU: compiled (torch.compile reduce-overhead, CUDA graphs) against eager.

    python bench/bench_gpu_decode.py --model smollm2_135m_random --batch 1 8 --context 512
    python bench/bench_gpu_decode.py --batch 1 4 8 --modes reduce_overhead \
        --set framework.models.llama.FUSED_MAX_ROWS=8 -- attention=triton

Times (medians, after warm-up) (a) the model forward alone with CUDA events (graph replay when compiled) and
(b) a whole engine step (batch building, forward, sampling, host read-back), at each batch size with ``context``
tokens already in the KV cache. One engine per compile mode, sized for the largest batch: the smaller batches are
what remains after aborting requests. Extra Hydra overrides go after ``--``; ``--set`` overrides a module-level
tuning constant (bench/knobs.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from knobs import add_set_option, apply_sets  # noqa: E402

from framework import LLM  # noqa: E402
from framework.request import Request  # noqa: E402
from framework.sampling import SamplingParams  # noqa: E402


def decode_setup(model: str, mode: str, bs: int, context: int, steps: int, extra: list[str],
                 device: str = "cuda"):
    """An engine with ``bs`` requests of ``context`` random tokens prefilled and decoding, and one decode
    ``(step, batch)`` scheduled from it (not yet run). Prefill runs eagerly (``compile.prefill=false``, unless
    ``extra`` says otherwise): the decode programs are the same, and the engine starts without the prefill
    compiles, the larger part of a start-up."""
    llm = LLM([f"model={model}", f"model.device={device}", f"compile={mode}", f"scheduler.max_running_requests={bs}",
               f"scheduler.max_context={context + 4 * steps + 64}", "compile.prefill=false", *extra])
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
    return (engine, *next_decode(engine))


@torch.inference_mode()
def forward_times_ms(engine, batch, reps: int, block: int = 10) -> list[float]:
    """GPU ms per forward of ``batch`` (graph replays when compiled), after 5 warm-up ones: CUDA-event times of
    blocks of ``block`` forwards, each block queued while the GPU sleeps, so that no host work between forwards
    shows in the time (about ``reps`` forwards in all)."""
    for _ in range(5):
        engine.runner.forward(batch)
    times = []
    for _ in range(max(reps // block, 3)):
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # ~25 ms: longer than the host takes to queue the block
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(block):
            engine.runner.forward(batch)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / block)
    return times


def next_decode(engine):
    """The next decode ``(step, batch)`` of the engine's running requests, scheduled but not run."""
    engine.drain()  # (the overlapped loop's last step)
    step = engine.scheduler.schedule()
    return step, engine.scheduler.build_batch(step)


def time_batch(engine, step, batch, steps: int) -> dict:
    """(a) the forward alone, replayed on one decode batch, and (b) whole engine steps, for the running requests."""
    forward_ms = forward_times_ms(engine, batch, steps)
    with torch.inference_mode():
        logits, _ = engine.runner.forward(batch)
    engine.scheduler.commit_launch(step)
    engine.scheduler.process(step, logits.argmax(-1).tolist())
    step_ms = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - t0) * 1000)
    return {"forward_ms": statistics.median(forward_ms), "step_ms": statistics.median(step_ms)}


def time_engine(model: str, mode: str, batches: list[int], context: int, steps: int, extra: list[str]) -> dict:
    """Times per batch size (largest first) from one engine sized for the largest."""
    batches = sorted(set(batches), reverse=True)
    engine, step, batch = decode_setup(model, mode, batches[0], context, 2 * steps * len(batches), extra)
    out = {}
    for bs in batches:
        if step is None:  # the requests beyond bs leave; the rest decode on
            engine.drain()
            for req in list(engine.scheduler.running)[bs:]:
                engine.abort(req.rid)
            step, batch = next_decode(engine)
        out[bs] = {**time_batch(engine, step, batch, steps), "startup_s": engine.startup_s}
        step = None
    for req in list(engine.scheduler.running):
        engine.abort(req.rid)
    engine.drain()
    engine.allocator.assert_all_free()
    engine.close()  # (tensor parallelism: the other ranks)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2_135m_random")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--modes", nargs="+", default=["reduce_overhead", "eager"], choices=["reduce_overhead", "eager"])
    add_set_option(ap)
    ap.add_argument("extra", nargs="*", help="extra Hydra overrides")
    args = ap.parse_args()
    apply_sets(ap, args.set)
    rows = []
    for mode in args.modes:
        for bs, r in sorted(time_engine(args.model, mode, args.batch, args.context, args.steps, args.extra).items()):
            rows.append((mode, bs, r))
            print(f"{mode} bs={bs}: {r}", flush=True)
    print(f"\n{args.model}, bf16, context {args.context}, {torch.cuda.get_device_name()} {' '.join(args.set)}")
    print(f"{'compile':>16} {'batch':>5} {'forward ms':>11} {'step ms':>8} {'tok/s':>8}")
    for mode, bs, r in rows:
        print(f"{mode:>16} {bs:>5} {r['forward_ms']:>11.3f} {r['step_ms']:>8.3f} {bs * 1000 / r['step_ms']:>8.1f}")


if __name__ == "__main__":
    main()
