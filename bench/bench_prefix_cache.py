"""Prefix caching: many requests that share a long prefix, with the cache off and on (``kv.prefix_cache``).

    .venv/bin/python bench/bench_prefix_cache.py --requests 16                      # CPU, the real SmolLM2
    python3 bench/bench_prefix_cache.py --model llama3_8b_random -- attention=triton model.tokenizer=$TFS_TOKENIZER

``--requests`` requests (default 64) share a ``--prefix-tokens`` prefix (default 2000 tokens: the text of
bench/prompts/grounded.jsonl, repeated) and each has its own ``--suffix-tokens`` suffix (default 50: a numbered
question, then seeded random tokens), greedy, ``--max-tokens`` new tokens each with ``ignore_eos``. They are all
submitted at once to one engine per mode (``scheduler.max_running_requests`` = the request count, a KV pool that
holds every request whole in both modes, so that the only difference is the cache) after a warm-up (two requests
with another prefix, then as many short requests as measured ones: compilation and graph capture excluded).

Printed per mode: tokens prefilled (EXTEND forwards), the cache's hit rate (prompt tokens served from the cache /
prompt tokens), time to first token (submission to the first generated token on the host) p50 and p90, generated
tokens per second over the wall time, and the wall time; then the ratios, and whether the two modes generated the
same tokens (asserted). ``--json PATH`` writes the numbers. Arguments after ``--`` are config overrides for both
engines (``attention=triton``, ``compile=eager``, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from framework.config import compose  # noqa: E402
from framework.engine import Engine  # noqa: E402
from framework.request import Request  # noqa: E402
from framework.sampling import SamplingParams  # noqa: E402

PROMPTS = os.path.join(os.path.dirname(__file__), "prompts", "grounded.jsonl")


def build_prompts(engine: Engine, requests: int, prefix_tokens: int, suffix_tokens: int,
                  seed: int) -> list[list[int]]:
    """A shared prefix of real text, then a distinct suffix per request (token ids)."""
    with open(PROMPTS, encoding="utf-8") as fh:
        text = " ".join(json.loads(line)["messages"][-1]["content"] for line in fh if line.strip())
    tok = engine.tokenizer
    base = tok(text, add_special_tokens=False)["input_ids"]
    prefix = (base * (prefix_tokens // max(len(base), 1) + 1))[:prefix_tokens]
    rng = random.Random(seed)
    vocab = min(engine.model.args.vocab_size, len(tok))
    prompts = []
    for i in range(requests):
        suffix = tok(f"\n\nQuestion {i}: summarise the text above in one line.", add_special_tokens=False)["input_ids"]
        suffix = (suffix + [rng.randrange(100, vocab) for _ in range(suffix_tokens)])[:suffix_tokens]
        prompts.append(prefix + suffix)
    return prompts


def serve(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[Request], float]:
    """Submit every prompt at once and step until all finish; returns the requests and the wall time."""
    reqs = [Request(rid=i, prompt_ids=list(p), params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    seed=0, max_new_tokens=max_tokens) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    for req in reqs:
        req.arrival_s = start
        engine.submit(req)
    while engine.has_work():
        engine.step()
    return reqs, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def run_mode(cache: bool, args: argparse.Namespace, overrides: list[str]) -> dict:
    context = args.prefix_tokens + args.suffix_tokens + args.max_tokens + 16
    engine = Engine(compose([f"model={args.model}", f"kv.prefix_cache={str(cache).lower()}",
                             f"kv.page_size={args.page_size}", f"scheduler.max_running_requests={args.requests}",
                             f"scheduler.max_context={context}", f"kv.max_total_tokens={args.requests * context}",
                             *overrides]))
    prompts = build_prompts(engine, args.requests, args.prefix_tokens, args.suffix_tokens, args.seed)
    # warm-up: two long prompts with another prefix (nothing shared with the measured ones), and as many short ones as
    # there are requests (the decode graphs of every batch size the measured run uses)
    rng = random.Random(args.seed + 1)
    warm = [p[::-1] for p in build_prompts(engine, 2, args.prefix_tokens, args.suffix_tokens, args.seed + 1)]
    serve(engine, warm, args.max_tokens)
    serve(engine, [[rng.randrange(100, 1000) for _ in range(32)] for _ in range(args.requests)], args.max_tokens)
    sched = engine.scheduler
    before = (sched.num_prefill_tokens, sched.num_prompt_tokens, sched.num_cached_prompt_tokens)
    reqs, wall = serve(engine, prompts, args.max_tokens)
    ttft = [r.first_token_s - r.arrival_s for r in reqs]
    prompt = sched.num_prompt_tokens - before[1]
    cached = sched.num_cached_prompt_tokens - before[2]
    engine.allocator.assert_all_free()
    engine.close()  # the next engine starts from clean compile state (framework/compile_state.py)
    return {"prefix_cache": cache, "prefill_tokens": sched.num_prefill_tokens - before[0],
            "hit_rate": round(cached / prompt, 4) if prompt else 0.0, "ttft_p50_s": round(percentile(ttft, 0.5), 4),
            "ttft_p90_s": round(percentile(ttft, 0.9), 4),
            "tokens_per_s": round(sum(len(r.output_ids) for r in reqs) / wall, 2), "wall_s": round(wall, 3),
            "tokens": [r.output_ids for r in reqs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2_135m", help="a conf/model option")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--suffix-tokens", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("overrides", nargs="*", help="config overrides for both engines, after --")
    args = ap.parse_args()
    results = [run_mode(cache, args, args.overrides) for cache in (False, True)]
    off, on = results
    same = off.pop("tokens") == on.pop("tokens")
    print(f"\n{args.requests} requests, {args.prefix_tokens}-token shared prefix, {args.suffix_tokens}-token suffixes, "
          f"{args.max_tokens} new tokens, model={args.model}, page_size={args.page_size} {' '.join(args.overrides)}")
    print(f"{'prefix_cache':>12} {'prefill tok':>11} {'hit rate':>8} {'TTFT p50 s':>10} {'TTFT p90 s':>10} "
          f"{'tok/s':>8} {'wall s':>8}")
    for r in results:
        print(f"{'on' if r['prefix_cache'] else 'off':>12} {r['prefill_tokens']:>11} {r['hit_rate']:>8.3f} "
              f"{r['ttft_p50_s']:>10.3f} {r['ttft_p90_s']:>10.3f} {r['tokens_per_s']:>8.1f} {r['wall_s']:>8.2f}")
    summary = {"prefill_tokens_saved": round(1 - on["prefill_tokens"] / off["prefill_tokens"], 4),
               "ttft_p50_speedup": round(off["ttft_p50_s"] / on["ttft_p50_s"], 2),
               "tokens_per_s_ratio": round(on["tokens_per_s"] / off["tokens_per_s"], 2), "same_tokens": same}
    print(f"prefill tokens {100 * summary['prefill_tokens_saved']:.1f}% fewer, TTFT p50 {summary['ttft_p50_speedup']}x "
          f"lower, tok/s {summary['tokens_per_s_ratio']}x; same tokens: {same}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"args": vars(args), "results": results, "summary": summary}, fh, indent=2)
    assert same, "the cache changed the generated tokens"


if __name__ == "__main__":
    main()
