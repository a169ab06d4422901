"""The top-k selection of ``tfs::indexer_topk`` (tfs_kernels/radix_select.py) on fresh random inputs.

CPU: the reference's tie rule (exactly equal scores at the cut: lower positions first, ``-0.0 == 0.0``) against a
naive per-row loop. Under the Triton interpreter (a ``TRITON_INTERPRET=1`` subprocess under a plain ``pytest``):
the whole op equals its reference exactly (positions, order, ``-1`` padding) for rows that see fewer, exactly,
one more and many more keys than ``topk`` (rows spanning several selection chunks, a table wider than any row),
page sizes 1 and 16, and scores with many exact ties (few heads, weights that zero most heads); the selection alone
on crafted scores (few distinct values, negatives, signed zeros). GPU (``pytest -m gpu``): DeepSeek-V3.2 shapes
at 128k keys, a static table wider than the context, and exact ties in float32.
"""

from __future__ import annotations

import pytest
import torch

from tfs_kernels.dispatch import interpreter_active
from tfs_kernels.indexer_topk import (indexer_scores_reference, indexer_topk, indexer_topk_reference,
                                      launch_indexer_scores, select_topk)
from tfs_kernels.radix_select import HIST_WIDTH, hist_view, launch_select, new_state
from tests.interpreted_runner import interpreted_subprocess
from tests.test_kernels_nsa import check_indexer, check_topk, indexer_args

INTERPRETED = interpreter_active()
interpreted = pytest.mark.skipif(not INTERPRETED, reason="interpreter tests: run by the TRITON_INTERPRET=1 subprocess")


def ikey(scores: torch.Tensor) -> torch.Tensor:
    """The kernels' 32-bit key in torch (int64 holding uint32): ascending as the score descends."""
    bits = (scores + 0.0).view(torch.int32).long() & 0xFFFFFFFF
    return torch.where(bits >= 2 ** 31, bits, bits ^ 0x7FFFFFFF)


def naive_select(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Per row: visible positions ranked by (score descending, position ascending), the first ``topk``, ascending."""
    out = torch.full((scores.shape[0], topk), -1, dtype=torch.int64)
    for t, row in enumerate(scores.tolist()):
        ranked = sorted((j for j, s in enumerate(row) if s != float("-inf")), key=lambda j: (-row[j], j))
        picked = sorted(ranked[:topk])
        out[t, :len(picked)] = torch.tensor(picked, dtype=torch.int64)
    return out


def tied_scores(n: int, width: int, seed: int) -> torch.Tensor:
    """Few distinct values (negatives, +-0.0), random visible lengths, ``-inf`` past them."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.tensor([-2.0, -0.5, -0.0, 0.0, 0.25, 1.0, 3.0])
    scores = values[torch.randint(0, len(values), (n, width), generator=gen)]
    vis = torch.randint(0, width + 1, (n,), generator=gen)
    vis[0] = width
    return scores.masked_fill(torch.arange(width)[None, :] >= vis[:, None], float("-inf"))


def test_reference_tie_rule_matches_naive() -> None:
    for seed, (n, width, topk) in enumerate([(6, 40, 16), (5, 17, 16), (4, 9, 16), (3, 64, 1)]):
        scores = tied_scores(n, width, seed)
        assert torch.equal(select_topk(scores, topk), naive_select(scores, topk))
    scores = torch.randn(4, 50, generator=torch.Generator().manual_seed(9))
    assert torch.equal(select_topk(scores, 20), naive_select(scores, 20))


def test_ikey_orders_descending() -> None:
    scores = torch.tensor([float("inf"), 3.0, 1.0, 0.0, -0.0, -1e-30, -1.0, -3.0, float("-inf")])
    keys = ikey(scores)
    assert bool((keys[1:] >= keys[:-1]).all()) and keys[3] == keys[4] and bool((keys < 2 ** 32).all())


# ---- Triton interpreter -------------------------------------------------------------------------------------------
@interpreted
@pytest.mark.parametrize("page_size", [1, 16])
def test_indexer_topk_lengths_interpreted(page_size: int) -> None:
    """topk 16, 16-position chunks: fewer, exactly, one more, several chunks, none; a wider static table."""
    vis = [5, 16, 17, 33, 64, 100, 0, 48]
    reqs = [0, 1, 1, 2, 2, 2, 0, 1]
    for heads, dim, seed in ((4, 16, 1), (20, 40, 2)):
        args = indexer_args(vis, reqs, heads, dim, 16, page_size, "cpu", torch.float32, seed + page_size, width=160)
        assert torch.equal(indexer_topk(*args), indexer_topk_reference(*args))
        check_indexer(args)
        # the score kernel's first histogram level (one atomic per distinct bin of a block) counts every key once
        q, weights, k_cache, table, rows, vis_lens, topk, scale = args
        state = new_state(len(vis), table.shape[1], q.device)
        scores = launch_indexer_scores(q, weights, k_cache, table, rows, vis_lens, scale, state, topk)
        expected = torch.zeros(len(vis), HIST_WIDTH, dtype=torch.int32)
        for t, v in enumerate(vis):
            if v > topk:
                expected[t].scatter_add_(0, ikey(scores[t, :v]) >> 21, torch.ones(v, dtype=torch.int32))
        assert torch.equal(hist_view(state), expected)


@interpreted
@pytest.mark.parametrize("page_size", [1, 16])
def test_indexer_topk_exact_ties_interpreted(page_size: int) -> None:
    """Two heads, one with weight 0: relu zeroes about half the scores exactly, ties across chunks at the cut."""
    vis = [40, 70, 100, 16, 17, 90]
    for seed in range(3):
        args = list(indexer_args(vis, [0, 1, 2, 0, 1, 2], 2, 16, 16, page_size, "cpu", torch.float32, seed,
                                 width=112))
        args[1] = torch.tensor([[1.0, 0.0]]).expand(len(vis), 2).contiguous()
        out, ref = indexer_topk(*args), indexer_topk_reference(*args)
        assert torch.equal(out, ref)
        scores = indexer_scores_reference(*args[:6], args[7])
        assert int((scores == 0).sum()) > 100  # the ties are there


@interpreted
def test_select_on_crafted_scores_interpreted() -> None:
    """The selection kernels alone: the first histogram level filled in torch, then launch_select."""
    for seed, (n, width, topk) in enumerate([(6, 80, 16), (4, 50, 1), (5, 33, 32)]):
        scores = tied_scores(n, width, seed)
        vis = (scores != float("-inf")).sum(1)
        state = new_state(n, width, scores.device)
        bins = torch.where(scores != float("-inf"), ikey(scores) >> 21, HIST_WIDTH)
        hist_view(state).scatter_add_(1, bins.clamp(max=HIST_WIDTH - 1), (bins < HIST_WIDTH).int())
        out = launch_select(scores.clone(), vis, state, topk)
        assert torch.equal(out, naive_select(scores, topk))


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(), reason="the interpreted tests run in this process")
@interpreted_subprocess("-k", "interpreted and not subprocess")
def test_interpreted_select_in_a_subprocess() -> None:
    """This file's interpreted tests, in a ``TRITON_INTERPRET=1`` subprocess (tests/interpreted_runner.py)."""


# ---- GPU ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 64])
def test_indexer_topk_128k_on_cuda(page_size: int) -> None:
    """DeepSeek-V3.2 shapes (64 heads of 128, top 2048, bf16): 128k keys, and rows shorter than a 64k table."""
    for width, vis in ((131072, [131072, 131071, 100000, 2049, 2048, 700, 0]),
                       (65536, [30000, 4096, 2047, 32768, 1, 2049, 9000])):
        args = indexer_args(vis, [0, 0, 1, 1, 2, 2, 1], 64, 128, 2048, page_size, "cuda", torch.bfloat16,
                            page_size, width=width)
        check_indexer(args, exact=False)


@pytest.mark.gpu
def test_indexer_topk_exact_ties_on_cuda() -> None:
    """float32, two heads, one weighted 0: about half the scores are exact zeros and fewer than 2048 positive, so
    the cut falls among thousands of zeros (the lowest positions win); the picks equal the reference's."""
    vis = [3000, 3900, 2049, 2600, 3333]
    args = list(indexer_args(vis, [0, 1, 2, 0, 1], 2, 128, 2048, 16, "cuda", torch.float32, 3, width=4096))
    args[1] = torch.tensor([[1.0, 0.0]], device="cuda").expand(len(vis), 2).contiguous()
    assert torch.equal(indexer_topk(*args), indexer_topk_reference(*args))


@pytest.mark.gpu
def test_indexer_topk_graph_replays_on_cuda() -> None:
    """One captured CUDA graph replayed with new queries and new visible lengths (the state is zeroed every
    replay, the chunks' tickets start over): every replay equals the reference."""
    vis = [40000, 30000, 2048, 9000]
    args = list(indexer_args(vis, [0, 1, 2, 0], 64, 128, 2048, 64, "cuda", torch.bfloat16, 11, width=40960))
    q, weights, vis_lens = args[0], args[1], args[5]
    indexer_topk(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = indexer_topk(*args)
    gen = torch.Generator().manual_seed(12)
    for lens in ([40960, 100, 2049, 33000], [5000, 40000, 1, 2048], vis):
        q.copy_(torch.randn(q.shape, generator=gen).to(q))
        weights.copy_(torch.randn(weights.shape, generator=gen).to(weights) * 0.125)
        vis_lens.copy_(torch.tensor(lens))
        graph.replay()
        scores = indexer_scores_reference(*args[:6], args[7])
        check_topk(out.clone(), indexer_topk_reference(*args), scores, exact=False)
