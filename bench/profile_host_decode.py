"""Where the host's time goes in one compiled decode forward (``runner.forward``): padding, attention metadata,
the compiled call (dynamo guards, cudagraph-tree input handling, graph launch), timed section by section over many
calls, then cProfile's top functions.

    python bench/profile_host_decode.py --model smollm2_135m_random --batch 1 --context 1024 -- attention=triton

On a small model the host, not the GPU, limits the step, so the per-call host times are what the GPU waits for.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_gpu_decode import decode_setup  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, reps: int, device: str) -> float:
    """Host microseconds per call of ``fn`` (the device is synchronised only before and after the loop)."""
    for _ in range(3):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps * 1e6
    sync(device)
    return host


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2_135m_random")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--dynamo", nargs="*", default=[], metavar="KEY=VALUE",
                    help="torch._dynamo.config settings to try (e.g. inline_inbuilt_nn_modules=False)")
    ap.add_argument("--skip-guards", action="store_true",
                    help="after the guarded rows, the same rows in torch.compiler.set_stance(skip_guard_eval_unsafe=True): the guards' cost")
    ap.add_argument("extra", nargs="*", help="extra Hydra overrides")
    args = ap.parse_args()
    for item in args.dynamo:
        key, value = item.split("=", 1)
        setattr(torch._dynamo.config, key, {"True": True, "False": False}.get(value, value))
    engine, _, batch = decode_setup(args.model, "reduce_overhead", args.batch, args.context, args.reps, args.extra,
                                    device=args.device)
    runner = engine.runner
    padded = runner.pad(batch)
    padded.attn = runner.backend.init_metadata(padded)
    writes = (padded.req_pool_indices, padded.out_cache_loc) if batch.write_slots else None
    rows = [("runner.forward (all)", lambda: runner.forward(batch)),
            ("pad", lambda: runner.pad(batch)),
            ("init_metadata", lambda: runner.backend.init_metadata(padded)),
            ("compiled call on a padded batch", lambda: (torch.compiler.cudagraph_mark_step_begin(),
                                                         runner._compiled_forward(padded.input_ids, padded.positions,
                                                                                  padded.attn, padded.logits_index,
                                                                                  None, writes, runner.greedy_in_graph)))]
    for _ in range(3):
        runner.forward(batch)
    for skip in (False, True) if args.skip_guards else (False,):
        if skip:
            torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        print(f"\n{args.model}, batch {args.batch}, context {args.context}, {args.device}, dynamo {args.dynamo}, "
              f"skip guards {skip}: host us per call (mean of {args.reps})")
        for name, fn in rows:
            print(f"{name} | {per_call_us(fn, args.reps, args.device):.1f}")
    print(f"torch {torch.__version__}; compile.skip_guards active: {runner.skip_guards}; input signatures run with "
          f"guards: {len(runner._guarded)}")
    step_ms = []
    for _ in range(args.reps):  # whole engine steps, each ending in the sampled tokens' read-back
        t0 = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - t0) * 1e3)
    print(f"engine.step wall (median of {args.reps}) | {sorted(step_ms)[len(step_ms) // 2] * 1e3:.1f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.reps):
        runner.forward(batch)
    sync(args.device)
    prof.disable()
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
        print(f"\ncProfile of {args.reps} runner.forward calls, by {key}:")
        print("\n".join(out.getvalue().splitlines()[4:]))


if __name__ == "__main__":
    main()
