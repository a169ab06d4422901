"""The DeepSeek-V3.2 sparse attention (DSA) kernels against their plain-torch references, on fresh random inputs:
``tfs::indexer_topk`` (tfs_kernels/indexer_topk.py) and ``tfs::sparse_mla_attention`` (tfs_kernels/sparse_mla.py).

CPU: the references against a naive per-token computation over each request's full key matrix (rows that see
fewer keys than ``topk``, rows that see none, a ``topk`` wider than the table, shuffled paged tables with pages of
1 and 16 slots); the kernels under the Triton interpreter (in a ``TRITON_INTERPRET=1`` subprocess under a plain
``pytest``) at small fp32 / fp16 shapes whose head counts and head dims are not powers of two, with index
positions in any order; ``torch.library.opcheck``. The indexer's picks equal the reference's exactly there (no
near ties at these sizes). GPU (``pytest -m gpu``): DeepSeek-V3.2 shapes in bf16 (indexer: 64 heads of 128,
top-2048 of 8k and 32k keys; MLA: 16 and 128 heads, dk 576, dv 512, 2048 keys), where picks may differ from the
reference's at near ties (checked by the scores they pick), opcheck in full and CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from tfs_kernels.dispatch import interpreter_active
from tfs_kernels.indexer_topk import (indexer_scores_reference, indexer_topk, indexer_topk_reference,
                                      launch_indexer_scores)
from tfs_kernels.sparse_mla import sparse_mla_attention, sparse_mla_attention_reference
from tests.kernel_checks import paged_table, run_opcheck_without_interpreter
from tests.interpreted_runner import interpreted_subprocess

INTERPRETED = interpreter_active()
interpreted = pytest.mark.skipif(not INTERPRETED, reason="interpreter tests: run by the TRITON_INTERPRET=1 subprocess")
VIS = [0, 5, 16, 17, 40, 70, 3]  # keys each query token sees (topk 16: fewer, exactly, more, none)
REQS = [0, 0, 1, 1, 2, 2, 2]  # the request of each token (index into the batch)


def indexer_args(vis: list[int], reqs: list[int], heads: int, dim: int, topk: int, page_size: int, device: str,
                 dtype: torch.dtype, seed: int, width: int | None = None, cache_dtype: torch.dtype | None = None):
    """Arguments of ``tfs::indexer_topk``: a shuffled paged table (rows out of order), random queries, weights and
    index keys."""
    width = width or max(vis) + 7
    table, rpi, num_slots = paged_table([0] * (max(reqs) + 1), page_size, width, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(vis), heads, dim, generator=gen).to(device, dtype)
    weights = (torch.randn(len(vis), heads, generator=gen) * heads ** -0.5).to(device)
    k_cache = torch.randn(num_slots, dim, generator=gen).to(device, cache_dtype or dtype)
    return (q, weights, k_cache, table, rpi[torch.tensor(reqs, device=device)], torch.tensor(vis, device=device),
            topk, dim ** -0.5)


def mla_args(vis: list[int], reqs: list[int], heads: int, dk: int, dv: int, k: int, page_size: int, device: str,
             dtype: torch.dtype, seed: int, width: int | None = None, shuffled: bool = True):
    """Arguments of ``tfs::sparse_mla_attention``: each token picks ``min(k, vis)`` distinct positions of its
    visible keys, in random order with the ``-1`` entries scattered among them (``shuffled``), or ascending with
    the ``-1`` last (as the indexer returns them); a token that sees no key is a padding row (all ``-1``)."""
    width = width or max(vis) + 7
    table, rpi, num_slots = paged_table([0] * (max(reqs) + 1), page_size, width, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(vis), heads, dk, generator=gen).to(device, dtype)
    kv_cache = torch.randn(num_slots, dk, generator=gen).to(device, dtype)
    pos = torch.full((len(vis), k), -1, dtype=torch.int64)
    for t, v in enumerate(vis):
        picked = torch.randperm(v, generator=gen)[:k]
        pos[t, :len(picked)] = picked if shuffled else picked.sort().values
        if shuffled:
            pos[t] = pos[t, torch.randperm(k, generator=gen)]
    return (q, kv_cache, table, rpi[torch.tensor(reqs, device=device)], pos.to(device), 192 ** -0.5, dv)


def naive_indexer(q, weights, k_cache, table, req_of_token, vis_lens, topk, scale):
    """Per token, over its request's full key matrix: scores of the visible keys, the top ``topk`` (ascending)."""
    scores = torch.full((q.shape[0], table.shape[1]), float("-inf"))
    picks = torch.full((q.shape[0], topk), -1, dtype=torch.int64)
    for t in range(q.shape[0]):
        keys = k_cache[table[req_of_token[t]]].float()  # [width, D]: all of the request's keys
        dense = (weights[t].float()[:, None] * (scale * q[t].float() @ keys.T).relu()).sum(0)  # [width]
        v = int(vis_lens[t])
        scores[t, :v] = dense[:v]
        top = torch.topk(dense[:v], min(topk, v)).indices.sort().values
        picks[t, :len(top)] = top
    return scores, picks


def naive_mla(q, kv_cache, table, req_of_token, topk_pos, scale, dv):
    out = torch.zeros(q.shape[0], q.shape[1], dv)
    for t in range(q.shape[0]):
        pos = topk_pos[t][topk_pos[t] >= 0]
        if len(pos):
            keys = kv_cache[table[req_of_token[t]]].float()[pos]  # [valid, dk]
            out[t] = (scale * q[t].float() @ keys.T).softmax(-1) @ keys[:, :dv]
    return out


def check_topk(out: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor, exact: bool) -> None:
    """Kernel picks vs the reference's: the same number per row, ascending, then ``-1``. ``exact``: identical, but
    for the order of keys whose scores tie exactly at the cut (with few heads, relu makes exact zeros); otherwise
    (bf16 at 32k keys: near ties) the reference scores of the picks match as sorted lists, and few picks
    differ."""
    assert out.shape == ref.shape and out.dtype == torch.int64
    assert torch.equal(out < 0, ref < 0)
    valid = out >= 0
    assert bool(((out[:, 1:] > out[:, :-1]) | ~valid[:, 1:]).all()), "picks not ascending and distinct"
    picked = torch.gather(scores, 1, out.clamp(min=0)).masked_fill(~valid, 0.0)
    expected = torch.gather(scores, 1, ref.clamp(min=0)).masked_fill(~valid, 0.0)
    assert bool(torch.isfinite(picked).all()), "a pick outside the visible keys"
    if exact:
        assert torch.equal(picked.sort(1).values, expected.sort(1).values)
        cut = expected.masked_fill(~valid, float("inf")).min(1).values[:, None]  # the lowest picked score
        tied = (scores == cut).sum(1) > ((expected == cut) & valid).sum(1)  # a key left out scores the same
        assert torch.equal(out[~tied], ref[~tied])
        return
    torch.testing.assert_close(picked.sort(1).values, expected.sort(1).values, rtol=1e-4, atol=1e-4)
    hits = torch.zeros(out.shape[0], scores.shape[1] + 1, dtype=torch.int64, device=out.device)
    hits.scatter_add_(1, torch.where(valid, out, scores.shape[1]), valid.long())
    hits.scatter_add_(1, torch.where(valid, ref, scores.shape[1]), valid.long())
    differ = int((hits[:, :-1] == 1).sum()) // 2
    assert differ <= max(2, int(valid.sum()) // 200), f"{differ} picks differ from the reference's"


def check_indexer(args: tuple, exact: bool = True) -> None:
    out = indexer_topk(*args)
    ref = indexer_topk_reference(*args)
    q, weights, k_cache, table, req_of_token, vis_lens, topk, scale = args
    scores = indexer_scores_reference(q, weights, k_cache, table, req_of_token, vis_lens, scale)
    check_topk(out, ref, scores, exact)


def check_mla(args: tuple, tol: float) -> None:
    out = sparse_mla_attention(*args)
    ref = sparse_mla_attention_reference(*args)
    q, dv = args[0], args[-1]
    assert out.shape == (q.shape[0], q.shape[1], dv) and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    padding = (args[4] < 0).all(1)
    assert bool((out[padding] == 0).all())


# ---- CPU: the references ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 16])
def test_indexer_reference_matches_naive(page_size: int) -> None:
    for heads, dim, topk, width in ((3, 24, 16, None), (8, 32, 16, 12), (5, 16, 1, None)):  # 12: topk > width
        vis = [min(v, width or v) for v in VIS]
        args = indexer_args(vis, REQS, heads, dim, topk, page_size, "cpu", torch.float32, page_size + heads, width)
        q, weights, k_cache, table, req_of_token, vis_lens, topk, scale = args
        naive_scores, naive_picks = naive_indexer(*args)
        scores = indexer_scores_reference(q, weights, k_cache, table, req_of_token, vis_lens, scale)
        assert scores.dtype == torch.float32 and torch.equal(scores.isinf(), naive_scores.isinf())
        torch.testing.assert_close(scores, naive_scores, rtol=1e-5, atol=1e-5)
        check_topk(indexer_topk_reference(*args), naive_picks, scores, exact=True)


@pytest.mark.parametrize("page_size", [1, 16])
def test_sparse_mla_reference_matches_naive(page_size: int) -> None:
    for heads, dk, dv, k in ((3, 40, 32, 16), (4, 24, 16, 64), (16, 40, 32, 8)):
        args = mla_args(VIS, REQS, heads, dk, dv, k, page_size, "cpu", torch.float32, page_size + heads)
        out = sparse_mla_attention_reference(*args)
        torch.testing.assert_close(out, naive_mla(*args), rtol=1e-5, atol=1e-5)
        assert bool((out[0] == 0).all()) and bool(out[1:].abs().sum(-1).gt(0).all())  # only the padding row is 0


def op_args(device: str) -> list[tuple]:
    """Small fp32 argument tuples: ``(op name, args)``."""
    return [("indexer_topk", indexer_args(VIS, REQS, 3, 24, 16, 16, device, torch.float32, 0)),
            ("indexer_topk", indexer_args([4, 9], [0, 1], 20, 16, 32, 1, device, torch.float32, 1)),
            ("sparse_mla_attention", mla_args(VIS, REQS, 3, 40, 32, 16, 16, device, torch.float32, 2)),
            ("sparse_mla_attention", mla_args([9, 30], [1, 0], 4, 32, 32, 24, 1, device, torch.float32, 3))]


def test_opcheck_reference_and_fake_kernel() -> None:
    """Without the interpreter the CPU kernel is the reference and the fake kernel is the triton_op body: opcheck
    compares them (shapes, dtypes, strides, the schema's mutation claims)."""
    run_opcheck_without_interpreter(
        "from tests.test_kernels_nsa import op_args\n"
        "cases = [(getattr(torch.ops.tfs, name), args) for name, args in op_args('cpu')]\n")


def test_compiled_cpu_code_runs_the_references() -> None:
    """torch.compile on the CPU traces the references (tracing into a triton_op body would need a GPU driver)."""
    q, weights, k_cache, table, rot, vis, topk, scale = indexer_args(VIS, REQS, 4, 40, 16, 16, "cpu", torch.float32, 5)
    _, kv_cache, _, _, _, mla_scale, dv = mla_args(VIS, REQS, 4, 40, 32, 16, 16, "cpu", torch.float32, 5)

    def dsa(q: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        picks = indexer_topk(q, weights, k_cache, table, rot, vis, topk, scale)
        return sparse_mla_attention(q, kv_cache, table, rot, picks, mla_scale, dv) * 2

    torch.testing.assert_close(torch.compile(dsa, fullgraph=True)(q, weights), dsa(q, weights), rtol=1e-5, atol=1e-5)


# ---- CPU: Triton interpreter --------------------------------------------------------------------------------------
@interpreted
@pytest.mark.parametrize("heads,dim,page_size", [(3, 24, 1), (4, 16, 16), (20, 40, 16)])  # 20: two head blocks
def test_indexer_topk_interpreted(heads: int, dim: int, page_size: int) -> None:
    args = indexer_args(VIS, REQS, heads, dim, 16, page_size, "cpu", torch.float32, heads + page_size)
    q, weights, k_cache, table, req_of_token, vis_lens, topk, scale = args
    scores = launch_indexer_scores(q, weights, k_cache, table, req_of_token, vis_lens, scale)
    ref = indexer_scores_reference(q, weights, k_cache, table, req_of_token, vis_lens, scale)
    assert torch.equal(scores.isinf(), ref.isinf())
    torch.testing.assert_close(scores, ref, rtol=1e-5, atol=1e-5)
    check_indexer(args)


@interpreted
def test_indexer_topk_edges_interpreted() -> None:
    """topk wider than the table (padded with -1), topk 1, and more tokens than one row of programs."""
    check_indexer(indexer_args([3, 12, 0, 7], [0, 1, 1, 0], 4, 16, 16, 1, "cpu", torch.float32, 1, width=12))
    check_indexer(indexer_args([9, 1, 30], [2, 0, 1], 4, 16, 1, 16, "cpu", torch.float32, 2))
    vis = torch.randint(0, 50, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    check_indexer(indexer_args(vis, [i % 5 for i in range(24)], 6, 16, 8, 16, "cpu", torch.float32, 3, width=64))


@interpreted
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float16, torch.float16), (torch.float32, torch.float16),
                                               (torch.float16, torch.float32)])
def test_indexer_topk_half_precision_interpreted(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """float16 (the interpreter mishandles bf16 loads; bf16 is for the GPU tests), also mixed with float32."""
    check_indexer(indexer_args(VIS, REQS, 3, 24, 16, 16, "cpu", dtype, 7, cache_dtype=cache_dtype))


@interpreted
@pytest.mark.parametrize("heads,dk,dv,k,page_size", [
    (3, 40, 32, 16, 1),  # dk = dv + a tail of 8 (padded to 16), 3 heads (a block of 16)
    (4, 24, 16, 64, 16),  # more entries than the visible keys of most rows
    (16, 40, 32, 24, 16),  # k not a multiple of the key block
    (20, 32, 32, 8, 1),  # dk == dv (no tail), two head blocks
])
def test_sparse_mla_interpreted(heads: int, dk: int, dv: int, k: int, page_size: int) -> None:
    check_mla(mla_args(VIS, REQS, heads, dk, dv, k, page_size, "cpu", torch.float32, heads + k), tol=1e-5)


@interpreted
def test_sparse_mla_sorted_and_half_precision_interpreted() -> None:
    check_mla(mla_args(VIS, REQS, 4, 40, 32, 16, 16, "cpu", torch.float32, 8, shuffled=False), tol=1e-5)
    check_mla(mla_args(VIS, REQS, 4, 40, 32, 16, 16, "cpu", torch.float16, 9), tol=2e-3)


@interpreted
def test_indexer_then_sparse_mla_interpreted() -> None:
    """The DSA pipeline: the indexer's picks (ascending, -1 last) feed the attention."""
    q, weights, k_cache, table, rot, vis, topk, scale = indexer_args(VIS, REQS, 4, 16, 8, 16, "cpu", torch.float32, 4)
    picks = indexer_topk(q, weights, k_cache, table, rot, vis, topk, scale)
    q_mla, kv_cache, *_ = mla_args(VIS, REQS, 16, 40, 32, 8, 16, "cpu", torch.float32, 4)
    check_mla((q_mla, kv_cache, table, rot, picks, 0.125, 32), tol=1e-5)


@interpreted
def test_input_checks_interpreted() -> None:
    """The ops refuse mismatched shapes with one line each."""
    q, weights, k_cache, table, rot, vis, topk, scale = indexer_args(VIS, REQS, 3, 24, 16, 16, "cpu", torch.float32, 0)
    op = torch.ops.tfs.indexer_topk
    with pytest.raises(RuntimeError, match="weights"):
        op(q, weights[:, :2], k_cache, table, rot, vis, topk, scale)
    with pytest.raises(RuntimeError, match="k_cache"):
        op(q, weights, k_cache[:, :16], table, rot, vis, topk, scale)
    with pytest.raises(RuntimeError, match="vis_lens"):
        op(q, weights, k_cache, table, rot, vis[:2], topk, scale)
    q, kv_cache, table, rot, pos, scale, dv = mla_args(VIS, REQS, 3, 40, 32, 16, 16, "cpu", torch.float32, 0)
    op = torch.ops.tfs.sparse_mla_attention
    with pytest.raises(RuntimeError, match="dv"):
        op(q, kv_cache, table, rot, pos, scale, 48)
    with pytest.raises(RuntimeError, match="kv_cache"):
        op(q, kv_cache[:, :32], table, rot, pos, scale, dv)
    with pytest.raises(RuntimeError, match="topk_pos"):
        op(q, kv_cache, table, rot, pos[:3], scale, dv)


@interpreted
def test_opcheck_interpreted() -> None:
    for name, args in op_args("cpu"):
        torch.library.opcheck(getattr(torch.ops.tfs, name), args,
                              test_utils=("test_schema", "test_autograd_registration"))


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(), reason="the interpreted tests run in this process")
@interpreted_subprocess("-k", "interpreted and not subprocess")
def test_interpreted_nsa_kernels_in_a_subprocess() -> None:
    """This file's interpreted tests, in a ``TRITON_INTERPRET=1`` subprocess (tests/interpreted_runner.py)."""


# ---- GPU ----------------------------------------------------------------------------------------------------------
def long_rows(width: int, seed: int) -> tuple[list[int], list[int]]:
    """Visible key counts of 8 tokens over 3 requests: the whole table, long, shorter than 2048, none."""
    gen = torch.Generator().manual_seed(seed)
    vis = [width, width - 1, *torch.randint(2048, width, (3,), generator=gen).tolist(), 2048, 700, 0]
    return vis, [0, 0, 1, 1, 2, 2, 2, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("width", [8192, 32768])
@pytest.mark.parametrize("page_size", [1, 64])
def test_indexer_topk_on_cuda(width: int, page_size: int) -> None:
    vis, reqs = long_rows(width, width + page_size)
    args = indexer_args(vis, reqs, 64, 128, 2048, page_size, "cuda", torch.bfloat16, page_size, width=width)
    q, weights, k_cache, table, req_of_token, vis_lens, topk, scale = args
    scores = launch_indexer_scores(q, weights, k_cache, table, req_of_token, vis_lens, scale)
    ref = indexer_scores_reference(q, weights, k_cache, table, req_of_token, vis_lens, scale)
    assert torch.equal(scores.isinf(), ref.isinf())
    torch.testing.assert_close(scores, ref, rtol=1e-4, atol=1e-4)
    check_indexer(args, exact=False)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("shuffled", [False, True])
def test_sparse_mla_on_cuda(heads: int, shuffled: bool) -> None:
    vis, reqs = long_rows(8192, heads)
    check_mla(mla_args(vis, reqs, heads, 576, 512, 2048, 64, "cuda", torch.bfloat16, heads, shuffled=shuffled),
              tol=2e-2)


@pytest.mark.gpu
def test_float32_and_mixed_dtypes_on_cuda() -> None:
    """float32 (exact products) and a float32 query over a bf16 cache (products in float32)."""
    vis, reqs = long_rows(4096, 1)
    check_indexer(indexer_args(vis, reqs, 64, 128, 2048, 16, "cuda", torch.float32, 1, width=4096), exact=False)
    check_indexer(indexer_args(vis, reqs, 20, 40, 512, 16, "cuda", torch.float32, 2, cache_dtype=torch.bfloat16),
                  exact=False)
    check_mla(mla_args(vis, reqs, 16, 576, 512, 2048, 16, "cuda", torch.float32, 3), tol=1e-4)
    check_mla(mla_args(vis, reqs, 20, 40, 32, 100, 16, "cuda", torch.float32, 4), tol=1e-4)


@pytest.mark.gpu
def test_opcheck_on_cuda() -> None:
    for name, args in op_args("cuda"):
        torch.library.opcheck(getattr(torch.ops.tfs, name), args)


@pytest.mark.gpu
def test_compiled_with_cuda_graphs() -> None:
    """torch.compile(mode="reduce-overhead", fullgraph=True) of each op at DeepSeek shapes: replays with fresh
    queries match the references."""
    vis, reqs = long_rows(8192, 7)
    _, _, k_cache, table, rot, vis_lens, topk, scale = indexer_args(vis, reqs, 64, 128, 2048, 64, "cuda",
                                                                    torch.bfloat16, 7, width=8192)
    _, kv_cache, mla_table, mla_rot, pos, mla_scale, dv = mla_args(vis, reqs, 128, 576, 512, 2048, 64, "cuda",
                                                                   torch.bfloat16, 8)
    index = torch.compile(lambda q, w: indexer_topk(q, w, k_cache, table, rot, vis_lens, topk, scale),
                          mode="reduce-overhead", fullgraph=True)
    attend = torch.compile(lambda q: sparse_mla_attention(q, kv_cache, mla_table, mla_rot, pos, mla_scale, dv),
                           mode="reduce-overhead", fullgraph=True)
    for i in range(3):
        gen = torch.Generator().manual_seed(100 + i)
        q = torch.randn(len(vis), 64, 128, generator=gen).to("cuda", torch.bfloat16)
        w = (torch.randn(len(vis), 64, generator=gen) / 8).cuda()
        q_mla = torch.randn(len(vis), 128, 576, generator=gen).to("cuda", torch.bfloat16)
        torch.compiler.cudagraph_mark_step_begin()
        picks, out = index(q, w).clone(), attend(q_mla).clone()
        args = (q, w, k_cache, table, rot, vis_lens, topk, scale)
        check_topk(picks, indexer_topk_reference(*args), indexer_scores_reference(*args[:6], scale), exact=False)
        ref = sparse_mla_attention_reference(q_mla, kv_cache, mla_table, mla_rot, pos, mla_scale, dv)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
