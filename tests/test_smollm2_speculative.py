"""Speculative decoding on the real SmolLM2-135M: greedy output identical to plain decoding for ngram and
layer_skip (chain and tree), and the target drafting for itself (draft_model) accepts every draft token."""

from __future__ import annotations

import pytest

from framework import LLM
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
    assert [o.token_ids for o in llm.generate(items())] == plain
    llm.engine.allocator.assert_all_free()


def test_target_as_its_own_draft_accepts_everything(plain):
    llm = LLM(BASE + ["speculative=draft_model", "speculative.draft_model=smollm2_135m", "speculative.num_steps=4"])
    assert [o.token_ids for o in llm.generate(items())] == plain
    # verification does not see EOS or max_tokens: every draft position is accepted in every verify step
    assert llm.engine.spec_worker.stats.summary()["accept_rate_per_position"] == [1.0] * 4
