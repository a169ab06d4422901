"""compile=reduce_overhead on tiny_llama: identical greedy output to eager, padding to captured sizes.

One compiled engine per page size for the module (compilation is the slow part on CI's two cores)."""

from __future__ import annotations

import pytest
import torch

from framework import LLM
from framework.batch import ForwardMode
from tests.conftest import TINY
from tests.test_engine import PROMPTS, reqs

COMPILED = ["model=tiny_llama", "compile=reduce_overhead", "compile.batch_sizes=[1,2,4,8]",
            "scheduler.max_running_requests=8"]


@pytest.fixture(scope="module")
def eager_outputs():
    return [o.token_ids for o in LLM(TINY + ["scheduler.max_running_requests=8"]).generate(reqs(20))]


@pytest.fixture(scope="module", params=[1, 16])
def compiled(request):
    """Also with compile.skip_guards=true (opt-in); its process-wide stance is undone for the tests after these.
    Page size 1 compiles the layers' parts around attention as nested compile regions (compile.regional=true), page
    size 16 as one flat graph (the default), and takes greedy tokens from the compiled graph's own argmax
    (``model_runner.GREEDY_IN_GRAPH``)."""
    import framework.model_runner as model_runner
    from framework.compile_guards import restore_guards_process_wide

    greedy_in_graph = model_runner.GREEDY_IN_GRAPH
    model_runner.GREEDY_IN_GRAPH = request.param == 16  # (read when the runner is built)
    try:
        llm = LLM(COMPILED + [f"kv.page_size={request.param}", "compile.skip_guards=true",
                              f"compile.regional={str(request.param == 1).lower()}"])
    finally:
        model_runner.GREEDY_IN_GRAPH = greedy_in_graph
    yield llm
    restore_guards_process_wide()


def test_compiled_greedy_equals_eager(compiled, eager_outputs, monkeypatch):
    import framework.engine as engine_module

    runner = compiled.engine.runner
    taken, sampled = [], []
    take, sample = runner.take_greedy, engine_module.sample
    monkeypatch.setattr(runner, "take_greedy", lambda: taken.append(take()) or taken[-1])
    monkeypatch.setattr(engine_module, "sample", lambda *args: sampled.append(1) or sample(*args))
    outs = compiled.generate(reqs(20))
    assert [o.token_ids for o in outs] == eager_outputs
    assert runner.compiled
    # with GREEDY_IN_GRAPH every compiled step's tokens are the graph's argmax (no eager sampling after it); only the
    # eager prefills (no graph argmax) sample; without it every step samples
    assert any(t is not None for t in taken) == runner.greedy_in_graph
    assert len(sampled) == sum(t is None for t in taken) and len(taken) > 0


def test_batches_are_padded_to_captured_sizes(compiled, eager_outputs):
    runner = compiled.engine.runner
    runner.graph_shapes.clear()
    outs = compiled.generate(reqs(20)[:3])  # three requests decode as a padded batch of four
    assert [o.token_ids for o in outs] == eager_outputs[:3]
    assert (ForwardMode.DECODE, 4, 1) in runner.graph_shapes
    assert all(bs in (1, 2, 4, 8) for _, bs, _ in runner.graph_shapes)


def test_padding_keeps_the_callers_batch(compiled):
    engine = compiled.engine
    for p in PROMPTS[:3]:
        engine.submit(engine.make_request({"prompt": p, "max_tokens": 4}))
    engine.step()  # prefill
    engine.drain()
    step = engine.scheduler.schedule()
    batch = engine.scheduler.build_batch(step)
    raw_sum, raw_lens = batch.seq_lens_sum, batch.seq_lens.clone()
    padded = engine.runner.pad(batch)
    assert (padded.bs, padded.padded_bs, batch.bs) == (3, 4, 3)
    assert padded.seq_lens_sum == raw_sum + 1 and padded.seq_lens.shape[0] == 4
    assert padded.req_pool_indices[-1].item() == 0 and padded.out_cache_loc[-1].item() == 0  # dummy row / slot
    logits, _ = engine.runner.forward(batch)
    assert logits.shape[0] == 3
    assert batch.seq_lens_sum == raw_sum and torch.equal(batch.seq_lens, raw_lens) and batch.padded_bs == 3
    engine.scheduler.commit_launch(step)
    engine.scheduler.process(step, logits.argmax(-1).tolist())
    while engine.has_work():
        engine.step()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine stages for itself on CUDA (tests/test_gpu.py)")
def test_staged_inputs_equal_the_scheduled_batch(compiled):
    """On CUDA the scheduler writes a decode batch's inputs from the host straight into the graph's static buffers
    (``StaticInputs.stage``, one copy; the runner then copies nothing): they hold what the device batch and fresh
    padding hold, each buffer on 16 bytes, until a fill of the same shape replaces them."""
    from framework.graph_inputs import StaticInputs, int_inputs, pad_fresh

    engine = compiled.engine
    assert not engine.runner.stages_inputs and engine.scheduler.stage_inputs is None  # compiled, but on the CPU
    for p in PROMPTS[:3]:
        engine.submit(engine.make_request({"prompt": p, "max_tokens": 4}))
    engine.step()  # prefill
    engine.drain()
    step = engine.scheduler.schedule()
    with torch.inference_mode():  # as the runner makes them, in a forward
        static = StaticInputs(4, 1, torch.device("cpu"))
    engine.scheduler.stage_inputs = lambda mode, q_len, ints: static.stage(ints, q_len)
    try:
        staged = engine.scheduler.build_batch(step)
    finally:
        engine.scheduler.stage_inputs = None  # as on the CPU, where forwards do not run from static buffers
    # the staged batch's slots are in the host mirror only; its forward writes them into the device table
    alloc, rows, cols = engine.allocator, staged.req_pool_indices, staged.positions
    host_slots = torch.from_numpy(alloc.req_to_token_host[rows.numpy(), cols.numpy()])
    assert staged.write_slots and torch.equal(staged.out_cache_loc, host_slots)
    alloc.req_to_token[rows, cols] = 0  # (an earlier test's requests may have left these slots in the table)
    staged_logits, _ = engine.runner.forward(staged)
    assert torch.equal(alloc.req_to_token[rows, cols], host_slots)
    plain = engine.scheduler.build_batch(step)  # (assigns the same slots again, through the device)
    assert not plain.write_slots
    for got, want in zip([*int_inputs(staged), staged.logits_index], [*int_inputs(plain), plain.logits_index]):
        assert torch.equal(got, want)
    assert static.holds(staged, 1) and not static.holds(staged, 2)
    for got, want in zip((*static.buffers, static.logits_index), pad_fresh(plain, 1, 1)):
        assert torch.equal(got, want)
    assert all(buf.data_ptr() % 16 == 0 for buf in static.buffers)
    static.fill(plain, 1)
    assert not static.holds(staged, 1)
    logits, _ = engine.runner.forward(plain)
    assert torch.equal(logits.argmax(-1), staged_logits.argmax(-1))
    engine.scheduler.commit_launch(step)
    engine.scheduler.process(step, logits.argmax(-1).tolist())
    while engine.has_work():
        engine.step()


def test_static_inputs_equal_fresh_padding_and_leave_no_stale_rows():
    """The CUDA path's static graph inputs (filled in place) hold what fresh padding builds, also when a smaller
    batch follows a larger one in the same buffers (no slot or row of the earlier batch survives)."""
    from framework.batch import ForwardBatch
    from framework.graph_inputs import StaticInputs, pad_fresh

    def batch(bs: int, q: int, seed: int) -> ForwardBatch:
        gen = torch.Generator().manual_seed(seed)
        ints = lambda n: torch.randint(1, 1000, (n,), generator=gen)  # noqa: E731
        lens = ints(bs).tolist()
        return ForwardBatch(mode=ForwardMode.TARGET_VERIFY, input_ids=ints(bs * q), positions=ints(bs * q),
                            out_cache_loc=ints(bs * q), req_pool_indices=ints(bs), seq_lens=torch.tensor(lens),
                            seq_lens_cpu=lens, extend_lens_cpu=[q] * bs, logits_index=torch.arange(bs * q))

    static = StaticInputs(4, 3, torch.device("cpu"))
    for bs, dummy_len in [(4, 3), (3, 5), (1, 3), (4, 3)]:
        b = batch(bs, 3, seed=bs)
        filled = static.fill(b, dummy_len)
        for got, want in zip(filled, pad_fresh(b, 4 - bs, dummy_len)):
            assert torch.equal(got, want)
    assert all(t.data_ptr() == s.data_ptr() for t, s in zip(static.fill(batch(2, 3, 0), 3), filled))


def test_input_signature_tells_apart_what_guards_check():
    """compile.skip_guards skips dynamo's guards only for an input signature already run with them: the signature
    must change with every shape, dtype and metadata value a guard could look at, and not with tensor contents."""
    from dataclasses import dataclass

    from framework.compile_guards import input_signature

    @dataclass
    class Meta:
        slots: torch.Tensor
        q_len: int
        policy: tuple

    def sig(n=4, q_len=1, dtype=torch.int64, policy=(64, 528, 128), layers=None, fill=0):
        t = torch.full((n,), fill, dtype=dtype)
        return input_signature((t, Meta(t, q_len, policy), layers))

    base = sig()
    assert sig(fill=7) == base
    for changed in (sig(n=8), sig(q_len=2), sig(dtype=torch.int32), sig(policy=(64, 264, 128)), sig(layers=[0, 2])):
        assert changed != base
    assert sig(layers=[0, 2]) != sig(layers=[0, 3])
