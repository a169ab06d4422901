"""compile.regional: a compiled forward's decoder layers are nested compile regions, identical layers installed once,
and the forward computes what the flat graph and eager mode compute.

Dynamo's graph is captured with a recording backend (no inductor): cheap enough for CI. Compiled output against eager
with regions on and off is tests/test_compile.py's (one page size each)."""

from __future__ import annotations

import collections

import pytest
import torch

from framework import LLM
from framework.batch import ForwardBatch, ForwardMode
from framework.models.regions import regions_available
from tests.conftest import TINY

pytestmark = pytest.mark.skipif(not regions_available(), reason="torch.compiler.nested_compile_region: torch >= 2.8")

LAYERS = 4


BS, MAX_Q = 2, 3


@pytest.fixture(scope="module")
def engine():
    """A 4-layer tiny Llama."""
    return LLM(TINY + [f"model.arch.num_layers={LAYERS}"]).engine


@pytest.fixture
def rows(engine):
    """BS request rows whose first MAX_Q positions have slots, for one test."""
    alloc = engine.allocator
    rows = [alloc.alloc_request() for _ in range(BS)]
    alloc.assign(rows, [0] * BS, [MAX_Q] * BS)
    yield rows
    for row in rows:
        alloc.free_request(row)


def _forward_args(engine, rows: list[int], mode: ForwardMode, q_len: int) -> tuple:
    """A uniform batch of ``rows`` at positions 0 .. q_len - 1 (random tokens) and its metadata."""
    bs = len(rows)
    n = bs * q_len
    table = engine.allocator.req_to_token
    row_t = torch.tensor(rows)
    positions = torch.arange(q_len).repeat(bs)
    batch = ForwardBatch(mode=mode, input_ids=torch.randint(0, engine.model.args.vocab_size, (n,)),
                         positions=positions, out_cache_loc=table[row_t[:, None], torch.arange(q_len)].reshape(-1),
                         req_pool_indices=row_t, seq_lens=torch.full((bs,), q_len), seq_lens_cpu=[q_len] * bs,
                         extend_lens_cpu=[q_len] * bs, logits_index=torch.arange(n),
                         custom_mask=torch.ones(bs, q_len, q_len, dtype=torch.bool).tril() if q_len > 1 else None)
    meta = engine.backend.init_metadata(batch)
    return batch.input_ids, batch.positions, meta, batch.logits_index


def _traced(model, args, regional: bool):
    """Dynamo's graph of the model's forward (fullgraph) and its outputs."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model.regional = regional
    torch._dynamo.reset()
    try:
        with torch.inference_mode():
            out = torch.compile(model.forward, backend=record, fullgraph=True)(*args)
    finally:
        model.regional = False
    return graphs[0], out


def _region_calls(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph]


@pytest.mark.parametrize("mode,q_len", [(ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, MAX_Q)])
def test_layers_are_regions_installed_once(engine, rows, mode, q_len):
    """The parts of every layer around attention are calls of two region graphs, whatever the depth: after attention
    in every layer, before it in every layer but the first (which has no residual delta yet: inline); attention,
    which writes the K/V cache, stays outside them. The flat graph has no region. Outputs equal eager's bit for bit
    (dynamo's graph runs the same ops)."""
    model = engine.model
    torch.manual_seed(0)
    args = _forward_args(engine, rows, mode, q_len)
    k0 = engine.pool.k[LAYERS - 1].clone()
    with torch.inference_mode():
        want = model(*args)
    gm, got = _traced(model, args, regional=True)
    calls = _region_calls(gm)
    assert len(calls) == 2 * LAYERS - 1
    assert len({n.args[1] for n in calls}) == 2  # (a region's identifier)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert not torch.equal(engine.pool.k[LAYERS - 1], k0)  # the last layer's K/V were written
    flat, _ = _traced(model, args, regional=False)
    assert not _region_calls(flat)


def test_deepseek_layers_are_regions_and_equal_eager():
    """The DeepSeek-V3.2 family (MLA, the indexer, dense and MoE layers) splits the same way: one region graph before
    attention for every layer but the first, one after it per kind of MLP (dense, MoE), attention (MLA with the
    indexer, which write their caches) outside; outputs equal eager's bit for bit."""
    dsa = LLM(["model=dsa_tiny", "model.dtype=float32", "compile=eager", "model.device=cpu",
               f"model.arch.num_layers={LAYERS}"]).engine  # layer 0 dense, the rest MoE
    alloc = dsa.allocator
    rows = [alloc.alloc_request() for _ in range(BS)]
    alloc.assign(rows, [0] * BS, [MAX_Q] * BS)
    torch.manual_seed(3)
    args = _forward_args(dsa, rows, ForwardMode.TARGET_VERIFY, MAX_Q)
    with torch.inference_mode():
        want = dsa.model(*args)
    gm, got = _traced(dsa.model, args, regional=True)
    uses = collections.Counter(n.args[1] for n in _region_calls(gm))
    # before attention in layers 1-3, after it in the MoE layers 1-3; the dense layer's part after attention, a
    # region called once, is a region of its own or (torch 2.13) inlined
    assert sorted(uses.values()) in ([LAYERS - 1] * 2, [1] + [LAYERS - 1] * 2)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    for row in rows:
        alloc.free_request(row)


def test_parts_around_attention_sum_to_the_layer(engine, rows):
    """A layer's parts (before attention, attention, after it) give the layer's output as (residual, delta); the
    next layer's first part takes the pair as its input."""
    torch.manual_seed(1)
    ids, positions, meta, _ = _forward_args(engine, rows, ForwardMode.TARGET_VERIFY, MAX_Q)
    from tfs_kernels.rope_store import rope_at

    model = engine.model
    rope = rope_at(model.rope_cos, model.rope_sin, positions)
    x = model.embed_tokens(ids)
    with torch.inference_mode():
        first, second = model.layers[0], model.layers[1]
        h, qkv = first.pre_attention(x, None)
        residual, delta = first.post_attention(h, first.self_attn.attend(qkv, rope, meta))
        out = first(x, rope, meta)
        assert torch.equal(residual + delta, out)
        h2, qkv2 = second.pre_attention(residual, delta)
        assert torch.equal(h2, out)
        r2, d2 = second.post_attention(h2, second.self_attn.attend(qkv2, rope, meta))
        assert torch.equal(r2 + d2, second(out, rope, meta))


def test_inductor_regions_equal_eager(engine, rows):
    """Compiled by inductor with regions (no freezing, as on CUDA: regions called again are not traced again), the
    forward computes eager's logits and hidden states (fp32, up to inductor's reassociation)."""
    model = engine.model
    torch.manual_seed(2)
    args = _forward_args(engine, rows, ForwardMode.TARGET_VERIFY, MAX_Q)
    with torch.inference_mode():
        want = model(*args)
    model.regional = True
    torch._dynamo.reset()
    try:
        with torch.inference_mode():
            got = torch.compile(model.forward, fullgraph=True)(*args)
    finally:
        model.regional = False
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_regional_resolves_with_one_line_where_it_cannot_apply(engine, caplog):
    """compile.regional=true applies to a compiled Llama-family model; elsewhere one warning names the reason and
    the forward compiles flat. Not asked for, or not compiled: off, silently."""
    from framework.resolve import resolve_regional

    assert resolve_regional(True, True, engine.model)
    assert not resolve_regional(False, True, engine.model) and not resolve_regional(True, False, engine.model)
    assert not caplog.records
    with caplog.at_level("WARNING"):
        assert not resolve_regional(True, True, torch.nn.Linear(2, 2))
    assert len(caplog.records) == 1 and "compile.regional=true: Linear's layers" in caplog.records[0].getMessage()
