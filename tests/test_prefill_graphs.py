"""Prefill steps run from CUDA graphs (``compile.prefill_graph_tokens``): the padded shape and the padding itself.

On CUDA a prefill step of up to ``compile.prefill_graph_tokens`` tokens is padded (``graph_inputs.pad_extend``) to a
power-of-two token count and request count and replayed from a graph; tests/test_overlap_gpu.py checks the GPU run.
Here, on the CPU: the shapes, and that a padded batch's forward gives the real requests the logits of the unpadded
one."""

from __future__ import annotations

import pytest
import torch

from framework import LLM
from framework.batch import ForwardMode
from framework.config import ConfigError, compose
from framework.graph_inputs import extend_graph_shape, pad_extend
from framework.graph_warmup import warmup_extend_graphs
from framework.kv import DUMMY_ROW, DUMMY_SLOT
from tests.conftest import TINY


@pytest.mark.parametrize("tokens,reqs,want", [(1, 1, (2, 16)), (15, 1, (2, 16)), (16, 1, (2, 32)), (16, 3, (4, 32)),
                                              (300, 4, (8, 512)), (511, 7, (8, 512)), (512, 2, None)])
def test_graph_shape_is_a_power_of_two_with_room_for_padding(tokens, reqs, want):
    shape = extend_graph_shape(tokens, reqs, 512)
    assert shape == want
    if shape is not None:  # at least one padding token and one dummy request: the dummy holds the padding
        assert shape[0] > reqs and shape[1] > tokens


@pytest.fixture(scope="module")
def engine():
    return LLM(TINY + ["scheduler.max_running_requests=4"]).engine


@pytest.mark.parametrize("prompts", [["Once"], ["Hello there my friend", "The quick brown fox jumps", "Once"]])
def test_padded_prefill_gives_the_real_requests_the_same_logits(engine, prompts):
    for p in prompts:
        engine.submit(engine.make_request({"prompt": p, "max_tokens": 2}))
    step = engine.scheduler.schedule()
    assert step.mode is ForwardMode.EXTEND and len(step.reqs) == len(prompts)
    batch = engine.scheduler.build_batch(step)
    n, bs = batch.input_ids.shape[0], batch.bs
    reqs, tokens = extend_graph_shape(n, bs, 512)
    padded = pad_extend(batch, reqs, tokens, 512)
    # the dummy request holds every padding token, at positions 0.. in the reserved row and slot; the rest are empty
    assert padded.input_ids.shape[0] == tokens and padded.req_pool_indices.shape[0] == reqs
    assert padded.extend_lens_cpu == batch.extend_lens_cpu + [tokens - n] + [0] * (reqs - bs - 1)
    assert padded.positions[n:].tolist() == list(range(tokens - n))
    assert set(padded.out_cache_loc[n:].tolist()) == {DUMMY_SLOT}
    assert set(padded.req_pool_indices[bs:].tolist()) == {DUMMY_ROW}
    assert padded.seq_lens_sum == sum(padded.seq_lens_cpu) == padded.seq_lens.sum().item()
    assert padded.extend_width == 512 and padded.padded_bs == reqs and batch.extend_width == 0
    with torch.inference_mode():
        want, _ = engine.runner.forward(batch)
        got, hidden = engine.runner.forward(padded)
    # (equal up to float rounding: the GEMMs see more rows, which on some CPUs' BLAS moves a logit by ~1e-5)
    torch.testing.assert_close(got[:bs], want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[:bs].argmax(-1), want.argmax(-1))
    assert torch.isfinite(got).all() and torch.isfinite(hidden).all()
    engine.scheduler.commit_launch(step)
    engine.scheduler.process(step, want.argmax(-1).tolist())
    while engine.has_work():
        engine.step()
    engine.allocator.assert_all_free()


def test_prefill_graphs_only_where_forwards_are_captured(engine):
    assert engine.config.compile.prefill_graph_tokens == 512  # the default
    assert engine.runner.extend_graph_tokens == 0  # eager on the CPU: no CUDA graphs
    with pytest.raises(ConfigError, match="compile.prefill_graph_tokens"):
        compose(TINY + ["compile.prefill_graph_tokens=-1"])


@pytest.mark.parametrize("max_requests,mixed", [(1, False), (4, False), (16, False), (8, True), (16, True)])
def test_start_up_records_every_prefill_graph_a_step_can_meet(max_requests, mixed):
    """Start-up records the prefill graph of every (requests, tokens) shape a prefill step can take: steps of up to
    7 requests, or, with mixed prefill (every decoding request rides along), of up to ``max_requests``."""

    class Runner:  # what warmup_extend_graphs uses of a ModelRunner: the shapes of the forwards it runs
        extend_graph_tokens, device, shapes = 128, torch.device("cpu"), set()

        def forward(self, batch):
            self.shapes.add(extend_graph_shape(batch.input_ids.shape[0], batch.bs, self.extend_graph_tokens))

    runner = Runner()
    warmup_extend_graphs(runner, max_requests, mixed)
    limit = max_requests if mixed else min(max_requests, 7)
    wanted = {extend_graph_shape(n, reqs, 128) for reqs in range(1, limit + 1) for n in range(reqs, 128)}
    assert None not in runner.shapes and wanted - {None} <= runner.shapes

