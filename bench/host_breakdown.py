"""Where the host's time goes in the user's generate job, phase by phase: scheduling, batch building, the compiled
calls, sampling, applying tokens, and the time the host waits for the GPU (the only part that is not host work).

    python3 bench/host_breakdown.py --cases smollm2_random:1 smollm2_random:8
    python3 bench/host_breakdown.py --cases smollm2_random:1 --speculative ngram -- compile.skip_guards=true

Each case runs the job of ``bench/e2e.py`` (same engine, prompts and settings, overlap on) with the engine's phases
wrapped in wall-clock timers, and prints microseconds per step (a speculative iteration counts as one step) for
each phase. ``wait`` is time blocked on the device's results: when it is near zero the host limits the step.
Timers nest (``launch`` contains ``build_batch`` and ``forward``), so the rows do not add up; the timers themselves
cost about a microsecond each.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from e2e import build_engine, case_items  # noqa: E402
from framework.engine import EngineStats  # noqa: E402
from framework.jobs.generate import generate_items  # noqa: E402
from framework.transfer import AsyncCopy  # noqa: E402

TIMES: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - t0
            CALLS[name] += 1
    return wrapper


def timed_by_mode(name: str, fn):
    """:func:`timed`, keyed by the ForwardBatch's mode (the first argument)."""
    def wrapper(batch, *args, **kwargs):
        return timed(f"{name} {batch.mode.name}", fn)(batch, *args, **kwargs)
    return wrapper


def instrument(engine) -> None:
    """Wrap the engine's phases (instance attributes shadow the methods; the module-level ones are patched)."""
    import framework.engine as engine_mod

    sched, runner = engine.scheduler, engine.runner
    for obj, names in ((engine, ["step", "launch", "complete"]), (sched, ["schedule", "build_batch", "process",
                                                                            "sampling_batch", "commit_launch"]),
                       (runner, ["pad"]), (engine.allocator, ["assign", "assign_host"]),
                       (runner.backend, ["init_metadata"])):
        for name in names:
            setattr(obj, name, timed(name, getattr(obj, name)))
    runner.forward = timed_by_mode("forward", runner.forward)
    if engine.spec_worker is not None:
        for name in ("launch", "complete", "_run", "_prepare_fn", "_greedy_fn"):
            if hasattr(engine.spec_worker, name):
                setattr(engine.spec_worker, name, timed(f"spec.{name}", getattr(engine.spec_worker, name)))
    if runner._compiled_forward is not None:
        runner._compiled_forward = timed("compiled forward call", runner._compiled_forward)
    engine_mod.sample = timed("sample", engine_mod.sample)
    AsyncCopy.__init__ = timed("AsyncCopy (start the copy)", AsyncCopy.__init__)
    AsyncCopy.numpy = timed("wait (AsyncCopy.numpy)", AsyncCopy.numpy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=["smollm2_random:1", "smollm2_random:8"])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--speculative", default=None, help="a drafter (speculative=<name>)")
    ap.add_argument("extra", nargs="*", help="Hydra overrides (after --)")
    args = ap.parse_args()
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases]
    tokenizer = os.environ.get("TFS_TOKENIZER")
    for name in dict.fromkeys(n for n, _ in cases):
        extra = list(args.extra) + ([f"speculative={args.speculative}"] if args.speculative else [])
        if tokenizer and name != "smollm2":
            extra.append(f"model.tokenizer={tokenizer}")
        engine = build_engine(name, max(b for n, b in cases if n == name), extra)
        instrument(engine)
        for batch in [b for n, b in cases if n == name]:
            items = case_items(name, batch, args.new_tokens, 4)
            engine.scheduler.cfg.max_running_requests = batch
            engine.overlap = True
            generate_items(engine, items[: max(batch, 8)], progress=False)  # warm-up
            TIMES.clear(), CALLS.clear()
            engine.stats = EngineStats()
            t0 = time.perf_counter()
            outputs = generate_items(engine, items, progress=False)
            wall = time.perf_counter() - t0
            steps = CALLS["step"]
            tokens = sum(len(o.token_ids) for o in outputs)
            print(f"\n{name}:{batch} {args.speculative or 'none'} {' '.join(args.extra)}: {tokens / wall:.1f} tok/s, "
                  f"{steps} engine steps, {wall / steps * 1e6:.1f} us a step (torch {torch.__version__})")
            for phase, total in TIMES.most_common():
                print(f"  {phase:<32} {total / steps * 1e6:9.1f} us/step  ({CALLS[phase]} calls)")


if __name__ == "__main__":
    main()
