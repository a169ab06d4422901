"""Tensor parallelism on the CPU (gloo): greedy output token-identical to one process, with and without
speculation; bad sizes fail at start-up with one line; a rank that dies fails the engine with one clear error."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from framework import LLM
from framework.config import ConfigError, compose
from framework.parallel import TensorParallelError
from framework.parallel.leader import check_parallel

TINY = ["model=tiny_llama", "compile=eager", "scheduler.max_running_requests=4"]
# prompts whose greedy continuations repeat (random weights fall into loops), so that n-gram drafts get accepted
PROMPTS = [{"prompt": "one two three one two three one two three", "max_tokens": 40},
           {"prompt": "The three primary colors are", "max_tokens": 24},
           {"prompt": "a b a b a b a b", "max_tokens": 32}]


def run(overrides: list[str], prompts: list[dict] = PROMPTS) -> tuple[list, dict]:
    llm = LLM(overrides)
    try:
        outs = llm.generate(prompts)
        worker = llm.engine.spec_worker
        return [o.token_ids for o in outs], worker.stats.summary() if worker is not None else {}
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def tiny_reference() -> list:
    return run(TINY)[0]


@pytest.mark.parametrize("spec", [
    [],
    ["speculative=ngram", "speculative.version=v1"],
    ["speculative=ngram", "speculative.version=v2"],
    ["speculative=ngram", "speculative.version=v1", "speculative.topk=2", "speculative.num_draft_tokens=7"],
    ["speculative=layer_skip", "speculative.version=v1", "speculative.exit_layer=1"],
    ["speculative=draft_model", "speculative.draft_model=tiny_llama", "speculative.num_steps=3"],
    ["speculative=suffix", "speculative.version=v2"],  # (chains: suffix's default shape on CUDA)
], ids=["plain", "ngram_v1", "ngram_v2", "ngram_tree", "layer_skip", "self_draft", "suffix_v2"])
def test_tiny_llama_tp2_matches_one_process(tiny_reference, spec):
    tokens, stats = run(TINY + ["parallel.tensor_parallel_size=2"] + spec)
    assert tokens == tiny_reference
    if spec:  # verify steps ran over the ranks (the tree case also copies accepted K/V in every rank's pool)
        assert stats["mean_accept_len"] >= 1.0
    if "speculative=draft_model" in spec:  # tiny_llama drafting for itself, unsharded on rank 0: all accepted
        assert stats["accept_rate_per_position"] == [1.0, 1.0, 1.0]


def test_smollm2_shape_tp3_matches_one_process():
    """SmolLM2-135M's shape (9 query heads, 3 KV heads: one KV head per rank), with n-gram speculation."""
    model = ["model=smollm2_135m_random", "compile=eager", "scheduler.max_running_requests=2"]
    prompts = [{"prompt": "The capital of France is", "max_tokens": 8}, {"prompt": "1 2 3 4 5", "max_tokens": 6}]
    reference = run(model, prompts)[0]
    tokens, stats = run(model + ["parallel.tensor_parallel_size=3", "speculative=ngram"], prompts)
    assert tokens == reference
    assert stats["mean_accept_len"] > 1.5  # (its greedy output repeats: drafts get accepted)


def test_kv_heads_replicated_when_fewer_than_ranks():
    """tiny_llama has 2 KV heads: at 4 ranks each KV head is held by two ranks."""
    prompts = PROMPTS[1:2]
    reference = run(TINY, prompts)[0]
    assert run(TINY + ["parallel.tensor_parallel_size=4"], prompts)[0] == reference


def test_compiled_tp2_matches_one_process(tiny_reference):
    tokens, _ = run(["model=tiny_llama", "compile=reduce_overhead", "scheduler.max_running_requests=4",
                     "compile.batch_sizes=[4]", "parallel.tensor_parallel_size=2"])
    assert tokens == tiny_reference


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tensor_parallel_size=3"], "parallel.tensor_parallel_size=3 is not allowed: it must divide the "
                                          "model's num_heads (4)"),
    (["parallel.tensor_parallel_size=2", "speculative=eagle"], "speculative=eagle is not allowed with "
                                                               "parallel.tensor_parallel_size=2"),
])
def test_bad_sizes_fail_with_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        LLM(TINY + overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_values_fail_with_one_line(monkeypatch):
    with pytest.raises(ConfigError, match=r"^parallel.tensor_parallel_size=0 is not allowed; expected an integer "
                                          r">= 1$"):
        compose(TINY + ["parallel.tensor_parallel_size=0"])
    config = compose(TINY + ["parallel.tensor_parallel_size=2"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"^parallel.tensor_parallel_size=2 is not allowed: this machine has 1 "
                                          r"CUDA device\(s\)$"):
        check_parallel(config, torch.device("cuda"))


def test_killed_rank_fails_the_engine_with_one_line():
    llm = LLM(TINY + ["parallel.tensor_parallel_size=2"])
    try:
        proc = llm.engine.tp.procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError) as err:
            llm.generate(PROMPTS[1:2])
        assert time.monotonic() - t0 < 30
        line = str(err.value)
        assert "\n" not in line
        assert f"tensor parallel rank 1 (pid {proc.pid}) was killed by SIGKILL" in line
        with pytest.raises(TensorParallelError, match="rank 1"):  # the engine stays down
            llm.generate(PROMPTS[1:2])
    finally:
        llm.engine.close()
    assert not proc.is_alive()
