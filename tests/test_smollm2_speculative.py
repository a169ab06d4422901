"""Speculative decoding on the real SmolLM2-135M: greedy output identical to plain decoding for ngram and
layer_skip (chain and tree), and the target drafting for itself (draft_model) accepts every draft token. Across
attention backends: flex and triton (interpreted on the CPU, in a ``TRITON_INTERPRET=1`` subprocess) give sdpa's
greedy output, with and without speculation."""

from __future__ import annotations

import functools

import pytest
import torch

from framework import LLM
from tfs_kernels.dispatch import interpreter_active
from tests.interpreted_runner import interpreted_subprocess
from tests.test_smollm2_golden import CHATS

pytestmark = pytest.mark.slow
MAX_TOKENS = 48
BASE = ["model=smollm2_135m", "compile=eager", "scheduler.max_running_requests=8"]


def items() -> list[dict]:
    return [{"messages": [{"role": "user", "content": c}], "max_tokens": MAX_TOKENS} for c in CHATS]


@pytest.fixture(scope="module")
def plain():
    return [o.token_ids for o in LLM(BASE).generate(items())]


@pytest.mark.parametrize("spec", [
    ["speculative=ngram", "speculative.num_steps=5", "kv.page_size=16"],
    ["speculative=ngram", "speculative.num_steps=4", "speculative.topk=4", "speculative.num_draft_tokens=12",
     "kv.page_size=1"],
    ["speculative=layer_skip", "speculative.num_steps=3", "kv.page_size=1"],
    ["speculative=layer_skip", "speculative.num_steps=3", "speculative.topk=4", "speculative.num_draft_tokens=8",
     "kv.page_size=16", "scheduler.max_running_requests=1"],
], ids=["ngram-chain", "ngram-tree", "layer_skip-chain", "layer_skip-tree-batch1"])
def test_greedy_equals_plain(plain, spec):
    llm = LLM(BASE + spec)
    count = 3 if "scheduler.max_running_requests=1" in spec else len(CHATS)  # batch 1: one request after another
    assert [o.token_ids for o in llm.generate(items()[:count])] == plain[:count]
    llm.engine.allocator.assert_all_free()


def test_target_as_its_own_draft_accepts_everything(plain):
    llm = LLM(BASE + ["speculative=draft_model", "speculative.draft_model=smollm2_135m", "speculative.num_steps=4"])
    assert [o.token_ids for o in llm.generate(items())] == plain
    # verification does not see EOS or max_tokens: every draft position is accepted in every verify step
    assert llm.engine.spec_worker.stats.summary()["accept_rate_per_position"] == [1.0] * 4


# ---- across attention backends (shorter runs: the Triton interpreter is slow) ------------------------------------
BACKEND_SPECS = {"plain": [], "ngram-tree": ["speculative=ngram", "speculative.num_steps=4", "speculative.topk=4",
                                             "speculative.num_draft_tokens=8"]}
interpreted = pytest.mark.skipif(not interpreter_active(), reason="run by the TRITON_INTERPRET=1 subprocess")


def short_items(n: int, max_tokens: int) -> list[dict]:
    return [dict(item, max_tokens=max_tokens) for item in items()[:n]]


@functools.cache
def backend_outputs(attention: str, spec: str, n: int, max_tokens: int) -> list[list[int]]:
    llm = LLM(BASE + [f"attention={attention}", "kv.page_size=16", *BACKEND_SPECS[spec]])
    out = [o.token_ids for o in llm.generate(short_items(n, max_tokens))]
    llm.engine.allocator.assert_all_free()
    return out


@pytest.mark.parametrize("spec", list(BACKEND_SPECS))
def test_flex_equals_sdpa(spec):
    assert backend_outputs("flex", spec, 2, 16) == backend_outputs("sdpa", "plain", 2, 16)


@interpreted
def test_triton_interpreted_equals_sdpa():
    """One short request (the interpreter is slow on 30 layers): prefill, verify of n-gram trees, and plain decode
    steps where nothing matched."""
    assert backend_outputs("triton", "ngram-tree", 1, 10) == backend_outputs("sdpa", "plain", 1, 10)


@pytest.mark.skipif(interpreter_active() or torch.cuda.is_available(), reason="interpreted tests run in this process")
@interpreted_subprocess("-k", "triton_interpreted_equals", timeout=900)
def test_triton_interpreted_in_a_subprocess() -> None:
    """This file's interpreted tests, in a ``TRITON_INTERPRET=1`` subprocess (tests/interpreted_runner.py)."""
