"""Where a speculative run's time goes on this machine: wall time of the model forwards by mode and token count
(prefill, verify, plain decode steps), and the rest (drafting, verification, scheduling), for SmolLM2-135M with
n-gram speculation on bench/prompts/grounded.jsonl, as bench/bench_spec_cpu.py runs it.

    .venv/bin/python bench/spec_step_breakdown.py [--batch 1] [--num-steps 5] [overrides...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.bench_cpu_vs_hf import ours_generate  # noqa: E402
from bench.bench_spec_cpu import PROMPTS  # noqa: E402
from framework import LLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--num-steps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("extra", nargs="*", help="extra Hydra overrides")
    args = ap.parse_args()
    llm = LLM(["model=smollm2_135m", "compile=reduce_overhead", "speculative=ngram",
               f"speculative.num_steps={args.num_steps}", f"scheduler.max_running_requests={args.batch}",
               *args.extra])
    tok = llm.tokenizer
    prompts = [tok(tok.apply_chat_template(json.loads(line)["messages"], add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for line in open(PROMPTS)]
    ours_generate(llm, prompts[:args.batch], 8)  # warm-up
    runner = llm.engine.runner
    forward = runner.forward
    spent: dict[tuple[str, int], list[float]] = defaultdict(list)

    def timed(batch, *rest):
        start = time.perf_counter()
        out = forward(batch, *rest)
        spent[(batch.mode.name, batch.input_ids.shape[0])].append(time.perf_counter() - start)
        return out

    runner.forward = timed
    tokens, secs, _ = ours_generate(llm, prompts, args.max_tokens)
    by_mode: dict[str, list[float]] = defaultdict(list)
    for (mode, _), times in spent.items():
        by_mode[mode] += times
    print(f"\n{tokens} tokens in {secs:.2f} s ({tokens / secs:.1f} tok/s), batch {args.batch}, "
          f"ngram num_steps={args.num_steps}")
    print("forward mode | calls | total s | mean ms")
    for mode, times in sorted(by_mode.items(), key=lambda kv: -sum(kv[1])):
        print(f"{mode} | {len(times)} | {sum(times):.2f} | {sum(times) / len(times) * 1000:.1f}")
    print(f"everything else | | {secs - sum(sum(t) for t in by_mode.values()):.2f} |")


if __name__ == "__main__":
    main()
