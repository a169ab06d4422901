"""Speculative decoding on this CPU: our n-gram drafter against Hugging Face transformers' prompt-lookup
decoding (``generate(..., prompt_lookup_num_tokens=N)``) on the same model (SmolLM2-135M-Instruct, fp32) and the
same input-grounded prompts (bench/prompts/grounded.jsonl), greedy, batch 1; plus ours at batch 8 and both
engines without speculation for reference.

    .venv/bin/python bench/bench_spec_cpu.py [--num-steps 5] [--compile reduce_overhead] [--versions v1 v2]

Tokens/s = generated tokens / wall time of the generation calls (loading, compilation, a warm-up excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.bench_cpu_vs_hf import hf_model, ours_generate, useful_tokens  # noqa: E402
from framework import LLM  # noqa: E402

PROMPTS = os.path.join(os.path.dirname(__file__), "prompts", "grounded.jsonl")


@torch.inference_mode()
def hf_run(model, prompts: list[list[int]], max_tokens: int, eos: int, lookup: int | None) -> tuple[int, float, list]:
    outs, tokens, start = [], 0, time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p])
        kwargs = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos, **kwargs)[0, len(p):].tolist()
        out = out[:useful_tokens(out, eos)]
        outs.append(out)
        tokens += len(out)
    return tokens, time.perf_counter() - start, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-steps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--compile", default="reduce_overhead")
    ap.add_argument("--versions", nargs="+", default=["v1", "v2"], help="speculative.version of our n-gram rows")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    items = [json.loads(line) for line in open(PROMPTS)]
    rows = []
    base = ["model=smollm2_135m", f"compile={args.compile}"]
    spec = ["speculative=ngram", f"speculative.num_steps={args.num_steps}"]
    runs = [("ours none", 1, [])] + [(f"ours ngram {v}", batch, spec + [f"speculative.version={v}"])
                                     for v in args.versions for batch in (1, 8)]
    for name, batch, extra in runs:
        llm = LLM(base + extra + [f"scheduler.max_running_requests={batch}"])
        tok = llm.tokenizer
        prompts = [tok(tok.apply_chat_template(it["messages"], add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"] for it in items]
        ours_generate(llm, prompts[:batch], 8)  # warm-up
        worker = llm.engine.spec_worker
        if worker is not None:
            worker.stats = type(worker.stats)(accepted_at_depth=[0] * args.num_steps)
        n, secs, outs = ours_generate(llm, prompts, args.max_tokens)
        accept = worker.stats.summary()["mean_accept_len"] if worker else 1.0
        rows.append((name, batch, n, n / secs, accept))
        if name == "ours none":
            reference = outs
        else:
            assert outs == reference, "speculative output differs from plain greedy"
        eos = tok.eos_token_id
        del llm
    model = hf_model()
    hf_run(model, prompts[:1], 8, eos, None)
    for name, lookup in [("HF generate", None), ("HF prompt lookup", 10)]:
        n, secs, outs = hf_run(model, prompts, args.max_tokens, eos, lookup)
        rows.append((name, 1, n, n / secs, float("nan")))
        same = sum(o == r for o, r in zip(outs, reference))
        print(f"{name}: {same}/{len(outs)} outputs token-identical to ours")
    lookup_tps = rows[-1][3]
    print(f"\nSmolLM2-135M fp32, {len(items)} grounded prompts x <= {args.max_tokens} tokens, greedy, "
          f"ngram num_steps={args.num_steps}, compile={args.compile}, torch threads {torch.get_num_threads()}")
    print(f"{'engine':>18} {'batch':>5} {'tokens':>7} {'tok/s':>8} {'accept len':>10} {'vs HF lookup':>12}")
    for name, batch, n, tps, accept in rows:
        print(f"{name:>18} {batch:>5} {n:>7} {tps:>8.1f} {accept:>10.2f} {tps / lookup_tps:>11.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([dict(zip(["engine", "batch", "tokens", "tok_s", "accept_len"], r)) for r in rows], fh, indent=2)


if __name__ == "__main__":
    main()
