"""Train-free drafters against each other on this CPU: the real SmolLM2-135M (fp32), greedy, the prompts of
bench/prompts/grounded.jsonl (or another JSONL of chat prompts), at one batch size. Every drafter serves the
prompts twice in one engine: the first pass is the plain workload, the second the repeated-task one (the same
requests issued again: what suffix decoding's global tree is for). Each pass's output is asserted token-identical
to plain decoding.

    .venv/bin/python bench/bench_drafters_cpu.py                          # none, ngram, suffix at batch 1
    .venv/bin/python bench/bench_drafters_cpu.py --batch 8 --drafters ngram ngram_adaptive suffix_adaptive
    .venv/bin/python bench/bench_drafters_cpu.py --batch 32 --copies 4 --prompts bench/prompts/open.jsonl
    .venv/bin/python bench/bench_drafters_cpu.py --batch 64 --copies 8 --kv-tokens 65536   # 5 engines fit in 24 GB
    .venv/bin/python bench/bench_drafters_cpu.py --prompts bench/prompts/shared.jsonl --drafters ngram suffix
    .venv/bin/python bench/bench_drafters_cpu.py --batch 8 --drafters ngram suffix_chain suffix_v2  # v2 (device)
    .venv/bin/python bench/bench_drafters_cpu.py --compile eager --limit 4 --max-tokens 64 \
        --drafters none layer_skip layer_skip_search layer_skip_search_spread      # self-speculation

Printed per drafter and pass: tokens/s (generated tokens over the pass's wall time; engine start-up and a
warm-up request excluded), mean accepted tokens per verify step, and the ratio to ngram's acceptance. ``*_adaptive``
= the same drafter with ``speculative.adaptive=true`` (its chosen depths are printed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from framework import LLM  # noqa: E402

PROMPTS = os.path.join(os.path.dirname(__file__), "prompts", "grounded.jsonl")
SPECS = {"none": [], "ngram": ["speculative=ngram", "speculative.num_steps=5"], "suffix": ["speculative=suffix"],
         "ngram3": ["speculative=ngram", "speculative.num_steps=3"],
         "ngram1": ["speculative=ngram", "speculative.num_steps=1"],
         "ngram_adaptive": ["speculative=ngram", "speculative.num_steps=5", "speculative.adaptive=true"],
         "suffix_adaptive": ["speculative=suffix", "speculative.adaptive=true"],
         # the trees' defaults before 2026-12-07: 16 tokens, 8 deep
         "suffix16": ["speculative=suffix", "speculative.num_draft_tokens=16", "speculative.num_steps=8"],
         # wider trees: 32 nodes, 8 children a node, a draft size no longer tied to a short match's length
         "suffix_wide": ["speculative=suffix", "speculative.num_draft_tokens=32", "speculative.topk=8",
                         "speculative.max_spec_offset=16", "speculative.min_token_prob=0.02"],
         "suffix_wide_adaptive": ["speculative=suffix", "speculative.num_draft_tokens=32", "speculative.topk=8",
                                  "speculative.max_spec_offset=16", "speculative.min_token_prob=0.02",
                                  "speculative.adaptive=true"],
         # suffix chains (topk=1): the v1 iteration on the host's trees, and v2 drafting on the device
         "suffix_chain": ["speculative=suffix", "speculative.topk=1", "speculative.num_draft_tokens=0",
                          "speculative.num_steps=5", "speculative.version=v1"],
         "suffix_v2": ["speculative=suffix", "speculative.topk=1", "speculative.num_draft_tokens=0",
                       "speculative.num_steps=5", "speculative.version=v2"],
         # the same chains at a depth chosen per iteration (v2: shadow acceptance, bench/README.md)
         "suffix_v2_adaptive": ["speculative=suffix", "speculative.topk=1", "speculative.num_draft_tokens=0",
                                "speculative.num_steps=5", "speculative.version=v2", "speculative.adaptive=true"],
         # self-speculation: a fixed early exit (the first 24 of 30 layers), its kept layers searched from that
         # start (skip_search), and the search from its own evenly spaced start (skip_ratio 0.2: 24 layers too)
         "layer_skip": ["speculative=layer_skip", "speculative.num_steps=3", "speculative.exit_layer=24"],
         "layer_skip_search": ["speculative=layer_skip", "speculative.num_steps=3", "speculative.exit_layer=24",
                               "speculative.skip_search=true"],
         "layer_skip_search_spread": ["speculative=layer_skip", "speculative.num_steps=3",
                                      "speculative.skip_search=true"]}


def run_pass(llm: LLM, items: list[dict]) -> tuple[list[list[int]], float, float]:
    start = time.perf_counter()
    outs = llm.generate(items)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    steps = sum(o.spec["num_verify_steps"] for o in outs if o.spec)
    emitted = sum(o.spec["mean_accept_len"] * o.spec["num_verify_steps"] for o in outs if o.spec)
    return [o.token_ids for o in outs], tokens / wall, (emitted / steps if steps else 1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafters", nargs="+", default=["none", "ngram", "suffix"], choices=sorted(SPECS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", default=PROMPTS)
    ap.add_argument("--copies", type=int, default=1, help="each prompt this many times per pass (batches > 8)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts (0: all)")
    ap.add_argument("--compile", default="reduce_overhead")
    ap.add_argument("--kv-tokens", type=int, default=0,
                    help="each engine's KV pool in tokens (kv.max_total_tokens; 0: the conf's, enough for every "
                         "request at max_context: about 6 GB an engine at batch 64)")
    ap.add_argument("extra", nargs="*", help="Hydra overrides for the speculative engines (after --)")
    args = ap.parse_args()
    items = [dict(json.loads(line), max_tokens=args.max_tokens) for line in open(args.prompts) if line.strip()]
    for item in items:
        item.pop("id", None)
    items = [dict(it) for it in items[: args.limit or len(items)] for _ in range(args.copies)]
    base = ["model=smollm2_135m", f"compile={args.compile}", f"scheduler.max_running_requests={args.batch}",
            f"kv.max_total_tokens={args.kv_tokens}"]
    reference, rows = None, []
    # every engine first, then each pass across all of them in turn: a machine that slows down part of the time
    # (other jobs) skews every drafter's pass alike rather than one drafter's
    engines = {}
    for name in ["none"] + [d for d in args.drafters if d != "none"]:
        engines[name] = LLM(base + SPECS[name] + (args.extra if name != "none" else []))
        engines[name].generate([{"prompt": "Warm up.", "max_tokens": 8}])
    for label in ("first", "repeat"):
        for name, llm in engines.items():
            ids, tok_s, accept = run_pass(llm, items)
            reference = reference or ids
            assert ids == reference, f"{name} ({label} pass) differs from plain decoding"
            rows.append({"drafter": name, "pass": label, "tok_s": round(tok_s, 1), "accept": round(accept, 3)})
            worker = llm.engine.spec_worker
            if getattr(worker, "adaptive", None) is not None:
                rows[-1]["depths"] = worker.stats.summary()["chosen_draft_lengths"]
            if getattr(llm.engine.drafter, "search", None) is not None:  # skip_search: what it chose, its cost
                m = llm.engine.drafter.search_metrics()
                rows[-1]["search"] = {k: m[k] for k in ("kept_layers", "rounds", "switches", "search_s")}
            print(json.dumps(rows[-1]), flush=True)
    ngram = {r["pass"]: r["accept"] for r in rows if r["drafter"] == "ngram"}
    print(f"\nbatch {args.batch}, {len(items)} requests x {args.max_tokens} tokens at most, {args.prompts}")
    print(f"{'drafter':>24} {'pass':>7} {'tok/s':>8} {'accept':>7} {'vs ngram':>9}")
    for r in rows:
        vs = f"{r['accept'] / ngram[r['pass']]:.2f}x" if r["pass"] in ngram and r["drafter"] != "none" else ""
        print(f"{r['drafter']:>24} {r['pass']:>7} {r['tok_s']:>8} {r['accept']:>7} {vs:>9}")


if __name__ == "__main__":
    main()
