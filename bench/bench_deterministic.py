"""What model.deterministic costs: the compiled decode forward (CUDA-graph replay, CUDA-event median) in the default
mode and in deterministic mode at each batch size, with ``context`` tokens in every request's KV, and their ratio.

    python3 bench/bench_deterministic.py --model llama3_8b_random --batch 1 8 32 --context 512 -- \
        attention=triton model.tokenizer=$TFS_TOKENIZER
    python3 bench/bench_deterministic.py --modes deterministic --tiles 16,32,256,4,4 16,64,128,4,4 -- ...

One engine per mode (and per ``--tiles`` entry: ``tfs::det_matmul``'s (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[, swap
[, split_k]]) on CUDA, tfs_kernels/det_matmul.py CUDA_TILE, for every shape class) serves every batch size; extra Hydra
overrides go after ``--``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import tfs_kernels.det_matmul as det_matmul  # noqa: E402
from bench_gpu_decode import forward_times_ms  # noqa: E402
from framework import LLM  # noqa: E402
from framework.request import Request  # noqa: E402
from framework.sampling import SamplingParams  # noqa: E402


def decode_batch(engine, bs: int, context: int, first_rid: int):
    """``bs`` requests of ``context`` random tokens prefilled and decoding; the next decode step and its batch."""
    engine.scheduler.cfg.max_running_requests = bs
    gen = torch.Generator().manual_seed(first_rid)
    vocab = min(engine.model.args.vocab_size, 49152)
    for i in range(bs):
        ids = torch.randint(0, vocab, (context,), generator=gen).tolist()
        engine.submit(Request(rid=first_rid + i, prompt_ids=ids, seed=0, max_new_tokens=200,
                              params=SamplingParams(max_tokens=200, ignore_eos=True)))
    while any(not r.prefilled or not r.output_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.drain()
    step = engine.scheduler.schedule()
    return step, engine.scheduler.build_batch(step)


def time_mode(args: argparse.Namespace, deterministic: bool, tile: tuple | None) -> dict[int, float]:
    if tile is not None:  # every shape class
        det_matmul.CUDA_TILE, det_matmul.CUDA_TILES = tile, {}
    sizes = ",".join(map(str, sorted(set(args.batch))))
    llm = LLM([f"model={args.model}", "model.device=cuda", "compile=reduce_overhead",
               f"model.deterministic={str(deterministic).lower()}", f"scheduler.max_running_requests={max(args.batch)}",
               f"compile.batch_sizes=[{sizes}]", f"scheduler.max_context={args.context + 256}",
               "compile.prefill=false", *args.extra])  # (prefill eager: the decode programs, a shorter start-up)
    engine = llm.engine
    print(f"deterministic={deterministic} tile={tile}: engine start-up {engine.startup_s:.1f} s", flush=True)
    times = {}
    for n, bs in enumerate(args.batch):
        step, batch = decode_batch(engine, bs, args.context, 1000 * n)
        times[bs] = statistics.median(forward_times_ms(engine, batch, args.reps))
        engine.scheduler.commit_launch(step)
        with torch.inference_mode():
            logits, _ = engine.runner.forward(batch)
        engine.scheduler.process(step, logits.argmax(-1).tolist())
        for req in list(engine.scheduler.running):
            engine.abort(req.rid)
        print(f"deterministic={deterministic} tile={tile} bs={bs}: {times[bs]:.3f} ms", flush=True)
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3_8b_random")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--modes", nargs="+", default=["default", "deterministic"], choices=["default", "deterministic"])
    ap.add_argument("--tiles", nargs="+", default=[],
                    help="det_matmul CUDA tiles BM,BN,BK,warps,stages[,swap[,split]] to compare")
    ap.add_argument("extra", nargs="*", help="extra Hydra overrides")
    args = ap.parse_args()
    rows = []
    if "default" in args.modes:
        rows.append(("default", time_mode(args, False, None)))
    if "deterministic" in args.modes:
        for tile in [tuple(int(v) for v in t.split(",")) for t in args.tiles] or [None]:
            rows.append((f"deterministic {tile or 'default tiles'}", time_mode(args, True, tile)))
    base = rows[0][1]
    print(f"\n{args.model}, decode forward ms (CUDA graph replay), context {args.context}, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'mode':>40} " + " ".join(f"{'bs=' + str(b):>16}" for b in args.batch))
    for name, times in rows:
        cells = " ".join(f"{times[b]:>7.3f} ({times[b] / base[b]:.2f}x)" for b in args.batch)
        print(f"{name:>40} {cells}")


if __name__ == "__main__":
    main()
