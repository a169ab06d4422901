"""Speculation and sparse attention on the DeepSeek-V3.2 family (model=dsa_tiny, fp32, CPU).

- ``speculative=mtp`` (the model's MTP layer as an EAGLE-style head), v1 and v2, with and without top-k index
  reuse, chains and (v1) trees, batch 1 with page size 1 and batch 4 with page size 16: greedy output token-identical to plain decoding,
  no KV slot leaked.
- The index-reuse contract of the seeds: indexer calls per draft forward (1 with reuse, one per draft step without),
  the state cleared after the forward and after an exception, reuse off with one log line for topk > 1, never reuse
  for a model without the flag, ``draft_indexer_calls`` in the metrics.
- ``attention=nsa`` equals ``attention=sdpa`` (plain, mtp v1 and v2); under the Triton interpreter (a
  ``TRITON_INTERPRET=1`` subprocess) its kernels run and still equal sdpa.
"""

from __future__ import annotations

import logging

import pytest
import torch

from framework import LLM
from framework.jobs.generate import metrics
from tfs_kernels.dispatch import interpreter_active
from tests.interpreted_runner import interpreted_subprocess

BASE = ["model=dsa_tiny", "compile=eager", "model.device=cpu"]
PROMPTS = ["The quick brown fox jumps over the lazy dog and then runs far away into the forest",
           "1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 1 2 3", "Hello", "def f(x):\n    return x + 1\n\ndef g(x):\n    return"]
MAX_TOKENS = 14
REUSE = "model.index_share_for_mtp_iteration=true"
INTERPRETED = interpreter_active()


def items(count: int = len(PROMPTS)) -> list[dict]:
    return [{"prompt": p, "max_tokens": MAX_TOKENS} for p in PROMPTS[:count]]


@pytest.fixture(scope="module")
def reference():
    return [o.token_ids for o in LLM(BASE + ["scheduler.max_running_requests=4"]).generate(items())]


@pytest.mark.skipif(INTERPRETED, reason="run without the interpreter")
@pytest.mark.parametrize("batch,page_size", [(1, 1), (4, 16)])
@pytest.mark.parametrize("variant", ["v1", "v1-reuse", "v2", "v2-reuse", "v1-tree"])
def test_mtp_greedy_equals_plain(reference, variant, batch, page_size):
    extra = ["speculative=mtp", f"speculative.version={variant[:2]}"]
    if "reuse" in variant or "tree" in variant:
        extra.append(REUSE)
    if "tree" in variant:
        extra += ["speculative.topk=3", "speculative.num_draft_tokens=6"]
    llm = LLM(BASE + extra + [f"scheduler.max_running_requests={batch}", f"kv.page_size={page_size}"])
    count = len(PROMPTS) if batch > 1 else 2
    assert [o.token_ids for o in llm.generate(items(count))] == reference[:count]
    assert llm.engine.spec_version == variant[:2]
    assert llm.engine.spec_worker.stats.num_verify_steps > 0
    llm.engine.allocator.assert_all_free()


def counting_llm(*extra: str) -> tuple[LLM, list[int]]:
    """An mtp engine whose MTP-layer indexer counts its calls during each draft forward (``propose``)."""
    llm = LLM(BASE + ["speculative=mtp", "speculative.num_steps=4", "scheduler.max_running_requests=4", *extra])
    drafter = llm.engine.drafter
    indexer = drafter.head.layer.self_attn.indexer
    calls, per_draft = [0], []
    original_forward, original_propose = indexer.forward, drafter.propose

    def forward(*args, **kwargs):
        calls[0] += 1
        return original_forward(*args, **kwargs)

    def propose(ctx):
        before = calls[0]
        try:
            return original_propose(ctx)
        finally:
            per_draft.append(calls[0] - before)

    indexer.forward, drafter.propose = forward, propose
    return llm, per_draft


@pytest.mark.skipif(INTERPRETED, reason="run without the interpreter")
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_indexer_calls_per_draft_forward(reference, version):
    for reuse, expected in ((True, 1), (False, 3)):  # num_steps=4: the root's state comes from the extend
        llm, per_draft = counting_llm(f"speculative.version={version}", f"model.index_share_for_mtp_iteration={reuse}")
        outs = llm.generate(items())
        assert [o.token_ids for o in outs] == reference
        assert per_draft and set(per_draft) == {expected}, (reuse, per_draft)
        drafter = llm.engine.drafter
        assert drafter.draft_indexer_calls == expected * len(per_draft)
        report = metrics(llm.engine, outs)
        assert report["draft_indexer_calls"] == drafter.draft_indexer_calls
        assert report["spec_params"]["index_reuse"] is reuse
        assert drafter.head.reuse.mode is None and not drafter.head.reuse.stored  # cleared after the forward


@pytest.mark.skipif(INTERPRETED, reason="run without the interpreter")
def test_reuse_state_cleared_when_a_step_raises():
    llm = LLM(BASE + ["speculative=mtp", "speculative.num_steps=4", REUSE])
    drafter = llm.engine.drafter
    original = drafter.runner.forward
    seen = []

    def failing(batch, *args, **kwargs):
        seen.append(drafter.head.reuse.mode)
        if drafter.head.reuse.mode == "reuse":  # the second draft step
            raise RuntimeError("draft step failed")
        return original(batch, *args, **kwargs)

    drafter.runner.forward = failing
    with pytest.raises(RuntimeError, match="draft step failed"):
        llm.generate(items(1))
    assert "store" in seen and "reuse" in seen
    assert drafter.head.reuse.mode is None and not drafter.head.reuse.stored


@pytest.mark.skipif(INTERPRETED, reason="run without the interpreter")
def test_reuse_guard_and_flag(caplog):
    with caplog.at_level(logging.INFO, logger="framework.speculative.mtp"):
        tree = LLM(BASE + ["speculative=mtp", "speculative.topk=3", "speculative.num_draft_tokens=6", REUSE])
    assert not tree.engine.drafter.reuse_topk
    assert any("reuse is off for topk=3" in r.getMessage() for r in caplog.records)
    plain = LLM(BASE + ["speculative=mtp"])  # dsa_tiny does not declare index_share_for_mtp_iteration
    assert not plain.engine.model.args.index_share_for_mtp_iteration and not plain.engine.drafter.reuse_topk
    assert LLM(BASE + ["speculative=mtp", REUSE]).engine.drafter.reuse_topk


def test_mtp_needs_an_mtp_model():
    from framework.config import ConfigError

    with pytest.raises(ConfigError, match="speculative=mtp is not allowed for model='tiny_llama'"):
        LLM(["model=tiny_llama", "compile=eager", "speculative=mtp"])


@pytest.mark.parametrize("extra", [[], ["speculative=mtp", "speculative.version=v1"],
                                   ["speculative=mtp", "speculative.version=v2", REUSE]])
def test_nsa_equals_sdpa(reference, extra):
    """Without the interpreter the nsa ops run their torch references; under it, their Triton kernels."""
    from tfs_kernels.dispatch import use_triton

    count = 2 if INTERPRETED else len(PROMPTS)
    assert use_triton(torch.empty(1)) == INTERPRETED  # interpreted: the nsa ops launch their Triton kernels
    # interpreted: a short table (the kernels read req_to_token at its whole width, one program per 64 positions)
    short = ["scheduler.max_context=128"] if INTERPRETED else []
    llm = LLM(BASE + ["attention=nsa", "kv.page_size=16", "scheduler.max_running_requests=4", *short, *extra])
    assert [o.token_ids for o in llm.generate(items(count))] == reference[:count]
    llm.engine.allocator.assert_all_free()


@pytest.mark.skipif(INTERPRETED, reason="interpreted tests run in this process")
@interpreted_subprocess("-k", "nsa_equals_sdpa", timeout=900)
def test_nsa_interpreted_in_a_subprocess() -> None:
    """This file's interpreted tests, in a ``TRITON_INTERPRET=1`` subprocess (tests/interpreted_runner.py)."""
