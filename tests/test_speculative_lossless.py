"""Lossless speculative decoding on tiny_llama: for every drafter x topk {1, 4} x batch {1, 8} x page_size
{1, 16}, greedy output is token-identical to ``speculative=none``; no KV slot leaks (also after runs where every
draft is rejected); acceptance statistics reach the outputs."""

from __future__ import annotations

import pytest

from framework import LLM
from tests.conftest import TINY

PROMPTS = ["The quick brown fox", "1, 2, 3, 1, 2, 3, 1, 2,", "hello hello hello hello", "def f(x):\n    return",
           "a b c d a b c d a b", "Once upon a time", "x", "import numpy as np\nimport"]
MAX_TOKENS = 20
DRAFTERS = {
    "ngram": ["speculative=ngram", "speculative.num_steps=4"],
    "layer_skip": ["speculative=layer_skip", "speculative.num_steps=3", "speculative.exit_layer=1"],
    # (rounds every 2 iterations on 8-token windows: the search switches sets while these requests run)
    "layer_skip_search": ["speculative=layer_skip", "speculative.num_steps=3", "speculative.skip_search=true",
                          "speculative.search_window=8", "speculative.search_interval=2"],
    "draft_model": ["speculative=draft_model", "speculative.draft_model=tiny_llama", "speculative.num_steps=3"],
    "eagle": ["speculative=eagle", "speculative.num_steps=3"],
    "suffix": ["speculative=suffix", "speculative.num_steps=4"],  # (a tree at its default topk)
}


def items(count: int = len(PROMPTS)) -> list[dict]:
    return [{"prompt": p, "max_tokens": MAX_TOKENS} for p in PROMPTS[:count]]


@pytest.fixture(scope="module")
def reference():
    return [o.token_ids for o in LLM(TINY + ["scheduler.max_running_requests=8"]).generate(items())]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("topk", [1, 4])
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_greedy_equals_no_speculation(reference, drafter, topk, batch, page_size):
    tree = [f"speculative.topk={topk}", "speculative.num_draft_tokens=8"] if topk > 1 else []
    llm = LLM(TINY + DRAFTERS[drafter] + tree + [f"scheduler.max_running_requests={batch}",
                                                  f"kv.page_size={page_size}"])
    count = len(PROMPTS) if batch > 1 else 3  # batch 1 runs the requests one after another
    outs = llm.generate(items(count))
    assert [o.token_ids for o in outs] == reference[:count]
    assert all(o.spec is not None and o.spec["num_verify_steps"] >= 1 for o in outs
               if drafter not in ("ngram", "suffix"))
    stats = llm.engine.spec_worker.stats
    assert stats.num_verify_steps > 0
    llm.engine.allocator.assert_all_free()


def test_self_draft_accepts_everything(reference):
    llm = LLM(TINY + DRAFTERS["draft_model"] + ["scheduler.max_running_requests=8"])
    outs = llm.generate(items())
    assert [o.token_ids for o in outs] == reference
    summary = llm.engine.spec_worker.stats.summary()
    assert summary["accept_rate_per_position"] == [1.0, 1.0, 1.0]
    # every verify step emits num_steps + 1 tokens, except where max_tokens cut the last one short
    assert all(o.spec["num_verify_steps"] == -(-(MAX_TOKENS - 1) // 4) for o in outs)


def test_all_rejected_leaks_nothing(reference):
    llm = LLM(TINY + DRAFTERS["eagle"] + ["speculative.topk=4", "speculative.num_draft_tokens=10",
                                           "speculative.num_steps=3", "kv.page_size=4"])
    outs = llm.generate(items() * 2)
    assert [o.token_ids for o in outs] == reference * 2
    assert llm.engine.spec_worker.stats.summary()["mean_accept_len"] < 1.2  # a random head: nearly all rejected
    llm.engine.allocator.assert_all_free()


def test_stop_conditions_inside_accepted_drafts(reference):
    """EOS / stop tokens / max_tokens that fall inside a multi-token acceptance cut the output exactly there."""
    llm = LLM(TINY + DRAFTERS["draft_model"] + ["scheduler.max_running_requests=8"])
    target = reference[2][5]
    cut = reference[2].index(target) + 1
    outs = llm.generate([{"prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "stop_token_ids": [target]},
                         {"prompt": PROMPTS[3], "max_tokens": 6}])
    assert outs[0].token_ids == reference[2][:cut] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == reference[3][:6] and outs[1].finish_reason == "length"


@pytest.mark.parametrize("drafter", ["layer_skip", "layer_skip_search", "eagle"])
def test_compiled_speculation_equals_eager(reference, drafter):
    llm = LLM(TINY[:1] + ["compile=reduce_overhead", "compile.batch_sizes=[8]",
                          "scheduler.max_running_requests=8", "speculative.topk=4",
                          "speculative.num_draft_tokens=8"] + DRAFTERS[drafter])
    assert [o.token_ids for o in llm.generate(items())] == reference


@pytest.mark.parametrize("topk", [1, 4])
def test_seeded_request_does_not_depend_on_drafting_neighbours(topk):
    """A seeded sampled request that ngram cannot draft for runs plain steps alone, and root-only verify steps
    next to a greedy request that drafts: the two must draw the same tokens (the root's residual draw once used
    its own salt, and the outputs parted at the first step)."""
    tree = [f"speculative.topk={topk}", "speculative.num_draft_tokens=8"] if topk > 1 else []
    llm = LLM(TINY + DRAFTERS["ngram"] + tree + ["scheduler.max_running_requests=4"])
    sampled = {"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0.8, "seed": 1234}
    drafting = {"prompt": "1, 2, 3, 1, 2, 3, 1, 2,", "max_tokens": 30}
    alone = llm.generate([sampled])[0].token_ids
    together = llm.generate([drafting, sampled])
    assert together[1].token_ids == alone
    assert together[0].spec["mean_accept_len"] > 1  # the neighbour really drafted


@pytest.mark.parametrize("spec", [DRAFTERS["ngram"] + ["speculative.topk=4", "speculative.num_draft_tokens=8"],
                                  DRAFTERS["layer_skip"], DRAFTERS["eagle"]], ids=["ngram-tree", "layer_skip", "eagle"])
def test_context_window_is_the_same_with_speculation(spec):
    """When the model's own window (max_position_embeddings) binds, speculation once shortened it by the tree's
    width: fewer tokens, and prompts near the end refused. Draft nodes past the window lead only to discarded
    tokens; the rope table covers their positions."""
    window = ["model.arch.max_position_embeddings=64", "scheduler.max_running_requests=4", "kv.page_size=4"]
    plain = LLM(TINY + window)
    ids = plain.tokenizer("a b c d " * 40)["input_ids"]
    reqs = [{"prompt": plain.tokenizer.decode(ids[:n]), "max_tokens": 48} for n in (40, 56, 60, 63)]
    expected = [(o.token_ids, o.finish_reason) for o in plain.generate(reqs)]
    assert [len(t) for t, _ in expected] == [24, 8, 4, 1]
    llm = LLM(TINY + window + spec)
    assert [(o.token_ids, o.finish_reason) for o in llm.generate(reqs)] == expected
    llm.engine.allocator.assert_all_free()
