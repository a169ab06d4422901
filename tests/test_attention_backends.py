"""attention=flex and attention=triton: the cases of tests/test_attention_sdpa.py against its float64 reference,
and greedy output identical to attention=sdpa end to end on tiny_llama, with and without speculation (a chain and
a tree). SmolLM2-135M across backends: tests/test_smollm2_speculative.py.

triton on the CPU needs the Triton interpreter from process start (see tests/test_kernels_attention.py): under a
plain ``pytest`` its tests run in one ``TRITON_INTERPRET=1`` subprocess. GPU tests: ``pytest -m gpu``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from framework import LLM
from framework.batch import ForwardMode
from tfs_kernels.dispatch import interpreter_active
from tests.conftest import TINY
from tests.test_adaptive_v2 import CycleDepths
from tests.test_attention_sdpa import run_case
from tests.test_engine import PROMPTS
from tests.kernel_checks import ROOT
from tests.interpreted_runner import interpreted_subprocess

INTERPRETED = interpreter_active()
interpreted = pytest.mark.skipif(not INTERPRETED, reason="interpreter tests: run by the TRITON_INTERPRET=1 subprocess")
CASES = {
    "extend_with_prefix": dict(prefix_lens=[0, 5, 37, 16], new_lens=[7, 1, 20, 33], mode=ForwardMode.EXTEND,
                               tree=False),
    "decode": dict(prefix_lens=[1, 15, 16, 100, 200], new_lens=[1] * 5, mode=ForwardMode.DECODE, tree=False),
    "verify_tree": dict(prefix_lens=[3, 17, 64], new_lens=[8] * 3, mode=ForwardMode.TARGET_VERIFY, tree=True),
    "draft_wide_mask": dict(prefix_lens=[12, 30], new_lens=[4, 4], mode=ForwardMode.DRAFT_DECODE, tree=True,
                            mask_extra=9),
    # wider than one word: attention=triton passes bytes (tfs_kernels/mask_bits.py)
    "draft_mask_over_64": dict(prefix_lens=[80, 100], new_lens=[4, 4], mode=ForwardMode.DRAFT_DECODE, tree=True,
                               mask_extra=66),
}
REQUESTS = [{"prompt": p, "max_tokens": 12} for p in PROMPTS[:4]]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_flex_matches_reference(case, page_size):
    run_case(page_size, name="flex", **CASES[case])


@interpreted
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference(case, page_size):
    run_case(page_size, name="triton", **CASES[case])


@pytest.fixture(scope="module")
def sdpa_outputs(tiny_llm):
    return [o.token_ids for o in tiny_llm.generate(REQUESTS)]


def test_flex_greedy_equals_sdpa(sdpa_outputs):
    llm = LLM(TINY + ["attention=flex", "scheduler.max_running_requests=4"])
    assert [o.token_ids for o in llm.generate(REQUESTS)] == sdpa_outputs
    llm.engine.allocator.assert_all_free()


@pytest.fixture(scope="module")
def compiled_flex():
    """One CPU-compiled flex engine for the module (compilation is the slow part on two cores)."""
    return LLM(["model=tiny_llama", "compile=reduce_overhead", "attention=flex", "compile.batch_sizes=[1,2,4]",
                "scheduler.max_running_requests=4"])


def test_flex_compiled_greedy_equals_sdpa(compiled_flex, sdpa_outputs):
    runner = compiled_flex.engine.runner
    runner.graph_shapes.clear()
    assert [o.token_ids for o in compiled_flex.generate(REQUESTS)] == sdpa_outputs
    assert [o.token_ids for o in compiled_flex.generate(REQUESTS[:3])] == sdpa_outputs[:3]  # padded 3 -> 4
    assert runner.compiled and (ForwardMode.DECODE, 4, 1) in runner.graph_shapes


@interpreted
def test_triton_greedy_equals_sdpa(sdpa_outputs):
    llm = LLM(TINY + ["attention=triton", "scheduler.max_running_requests=4"])
    assert [o.token_ids for o in llm.generate(REQUESTS)] == sdpa_outputs


# speculative decoding through each backend: TARGET_VERIFY with a chain / tree mask, and the draft modes
SPEC = {"ngram-chain": ["speculative=ngram", "speculative.num_steps=4"],
        # every verify width 1 .. 5, the host choosing one per iteration (speculation v2)
        "ngram-adaptive": ["speculative=ngram", "speculative.num_steps=4", "speculative.adaptive=true"],
        "layer_skip-tree": ["speculative=layer_skip", "speculative.num_steps=3", "speculative.topk=4",
                            "speculative.num_draft_tokens=8", "speculative.exit_layer=1"]}


def spec_outputs(name: str, spec: str) -> list[list[int]]:
    llm = LLM(TINY + [f"attention={name}", "scheduler.max_running_requests=4", "kv.page_size=16", *SPEC[spec]])
    if "adaptive" in spec:  # every depth in turn, whatever the goodput model would pick
        llm.engine.spec_worker.adaptive = CycleDepths(4)
    out = [o.token_ids for o in llm.generate(REQUESTS)]
    assert llm.engine.spec_worker.stats.num_verify_steps > 0
    if "adaptive" in spec:
        assert llm.engine.spec_worker.stats.summary()["chosen_draft_lengths"].keys() == {"0", "1", "2", "3", "4"}
    llm.engine.allocator.assert_all_free()
    return out


@pytest.mark.parametrize("spec", list(SPEC))
def test_flex_speculative_greedy_equals_sdpa(spec, sdpa_outputs):
    assert spec_outputs("flex", spec) == sdpa_outputs


@interpreted
@pytest.mark.parametrize("spec", list(SPEC))
def test_triton_speculative_greedy_equals_sdpa(spec, sdpa_outputs):
    assert spec_outputs("triton", spec) == sdpa_outputs


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(), reason="the interpreted tests run in this process")
@interpreted_subprocess("-k", "triton and not subprocess and not needs_cuda")
def test_interpreted_triton_in_a_subprocess() -> None:
    """This file's interpreted tests, in a ``TRITON_INTERPRET=1`` subprocess (tests/interpreted_runner.py)."""


def test_triton_on_cpu_needs_cuda_one_line_exit_2():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "train_free_serve.py"), "model=tiny_llama", "model.device=cpu",
                           "attention=triton", "compile=eager", "run.progress=false"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["config error: attention=triton needs a CUDA device (set TRITON_INTERPRET=1 to run the Triton "
                     "interpreter on the CPU)"], proc.stderr[-3000:]


# ---- GPU ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", ["triton", "flex"])
def test_backend_matches_reference_on_cuda(name, case, page_size, dtype):
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    run_case(page_size, name=name, device="cuda", dtype=dtype, tol=tol, **CASES[case])


@pytest.mark.gpu
@pytest.mark.parametrize("compile_mode", ["eager", "reduce_overhead"])
@pytest.mark.parametrize("name", ["triton", "flex"])
def test_greedy_equals_sdpa_on_cuda(name, compile_mode):
    """tiny_llama in float32: identical greedy tokens to sdpa, eager and with CUDA graphs (padded batches)."""
    from tests.test_gpu import cuda_overrides

    common = ["model=tiny_llama", "model.dtype=float32", "scheduler.max_running_requests=4",
              "compile.batch_sizes=[1,2,4]"]
    ref = LLM(cuda_overrides(*common, "compile=eager")).generate(REQUESTS)
    llm = LLM(cuda_overrides(*common, f"compile={compile_mode}", f"attention={name}"))
    assert [o.token_ids for o in llm.generate(REQUESTS)] == [o.token_ids for o in ref]
    assert [o.token_ids for o in llm.generate(REQUESTS[:3])] == [o.token_ids for o in ref[:3]]
    assert llm.engine.runner.compiled == (compile_mode == "reduce_overhead")


BF16_PROMPTS = [{"prompt": "The history of the city begins", "max_tokens": 32, "ignore_eos": True},
                {"prompt": "def main():", "max_tokens": 32, "ignore_eos": True}]


def bf16_compiled_outputs(attention: str) -> list[list[int]]:
    from tests.test_gpu import cuda_overrides

    llm = LLM(cuda_overrides("model=smollm2_135m_random", "compile=reduce_overhead", f"attention={attention}",
                             "scheduler.max_running_requests=2", "compile.batch_sizes=[1,2]"))
    return [o.token_ids for o in llm.generate(BF16_PROMPTS)]


@pytest.fixture(scope="module")
def sdpa_bf16_outputs():
    return bf16_compiled_outputs("sdpa")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton", "flex"])
def test_bf16_compiled_agrees_with_sdpa_on_cuda(name, sdpa_bf16_outputs):
    """SmolLM2-shaped bf16 (9 query / 3 KV heads, head_dim 64) with CUDA graphs: same greedy tokens as sdpa for at
    least the first 8 steps (bf16 kernels round differently, so a late divergence is allowed)."""
    for ref, ours in zip(sdpa_bf16_outputs, bf16_compiled_outputs(name)):
        same = next((i for i, (a, b) in enumerate(zip(ref, ours)) if a != b), len(ref))
        assert same >= 8, (ref, ours)


@pytest.mark.gpu
@pytest.mark.parametrize("compile_mode", ["eager", "reduce_overhead"])
def test_tree_speculation_through_triton_equals_plain_on_cuda(compile_mode):
    """n-gram trees verified by attention=triton (the tree mask packed into a word per row), eager and in CUDA
    graphs: tiny_llama's greedy tokens equal plain decoding with sdpa, and no KV slot is left allocated."""
    from tests.test_gpu import cuda_overrides

    prompts = [{"prompt": p, "max_tokens": 24} for p in ["a b c a b c a b", "The quick brown fox", "1, 2, 3, 1, 2,"]]
    common = ["model=tiny_llama", "model.dtype=float32", "scheduler.max_running_requests=4",
              "compile.batch_sizes=[1,2,4]"]
    plain = [o.token_ids for o in LLM(cuda_overrides(*common, "compile=eager")).generate(prompts)]
    llm = LLM(cuda_overrides(*common, f"compile={compile_mode}", "attention=triton", "speculative=ngram",
                             "speculative.num_steps=4", "speculative.topk=4", "speculative.num_draft_tokens=8"))
    assert [o.token_ids for o in llm.generate(prompts)] == plain
    assert llm.engine.spec_worker.stats.num_verify_steps > 0
    llm.engine.allocator.assert_all_free()
