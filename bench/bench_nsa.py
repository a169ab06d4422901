"""DeepSeek sparse attention on a CUDA GPU, one decode step of one layer at DeepSeek-V3.2's shapes (128 heads,
latent 512 + 64, indexer 64 heads x 128, index_topk 2048, bf16): ``tfs::indexer_topk`` plus
``tfs::sparse_mla_attention`` over the selected keys (attention=nsa) against dense MLA decode over the same cache
(the same kernel given every position), and the indexer against its memory-bound floor (reading the visible index
keys once at the measured copy bandwidth, and at the nominal 4.8 TB/s).

    python bench/bench_nsa.py                                   # batch 1 and 8 at 32k and 128k tokens, ~2 min on H200
    python bench/bench_nsa.py --configs 1x32768 --page-size 1
    python bench/bench_nsa.py --table-width 163840              # the engine's static req_to_token width
    python bench/bench_nsa.py --score-launch 64,64,4 128,64,8   # score-kernel tiles to compare
    python bench/bench_nsa.py --select-launch 1024,4 2048,8     # selection chunks (positions, warps) to compare

Times: medians of ``triton.testing.do_bench`` over a CUDA graph of ``repeat`` back-to-back calls (divided by
``repeat``); the indexer's calls cycle through copies of the index keys (256 MB in all) so that they read HBM, not
L2. ``score_us``: the indexer's score pass alone (its first kernel; the rest of ``indexer_us`` is the selection).
``same_picks``: the fraction of the reference's picks the kernel made (bf16 near ties may differ). Data: random
normal bf16 (never zero), pages shuffled through the pool; the sparse output is checked against the torch
reference before timing.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.bench_attention import copy_bandwidth, time_us  # noqa: E402
import tfs_kernels.indexer_topk as it  # noqa: E402
from tfs_kernels.indexer_topk import indexer_topk, indexer_topk_reference, launch_indexer_scores  # noqa: E402
import tfs_kernels.radix_select as rs  # noqa: E402
from tfs_kernels.radix_select import new_state  # noqa: E402
from tfs_kernels.sparse_mla import sparse_mla_attention, sparse_mla_attention_reference  # noqa: E402

HEADS, DK, DV, INDEX_HEADS, INDEX_DIM = 128, 576, 512, 64, 128
COLD_BYTES = 256 << 20  # index-key copies cycled through by the timed calls (H200 L2: 50 MB)
NOMINAL_GBS = 4800.0  # H200 HBM3e, nominal


def shuffled_table(bs: int, context: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """``[bs, context]`` slots over shuffled pages of a pool of ``bs * context`` slots."""
    pages = bs * (-(-context // page_size))
    page_of = torch.randperm(pages, generator=gen).view(bs, -1)
    pos = torch.arange(context)
    return (page_of[:, pos // page_size] * page_size + pos % page_size).cuda()


def index_copies(slots: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Copies of the index-key cache, together over ``COLD_BYTES``, so that back-to-back calls read their keys from
    HBM rather than the 50 MB L2 (as in a real step, where the other layers' weights pass between two indexers)."""
    one = torch.randn(slots, INDEX_DIM, generator=gen).to("cuda", torch.bfloat16)
    count = max(1, -(-COLD_BYTES // (one.numel() * 2)))
    return [one] + [one.roll(i + 1, 0) for i in range(count - 1)]


def bench(bs: int, context: int, topk: int, page_size: int, repeat: int, bandwidth: float,
          table_width: int) -> dict:
    gen = torch.Generator().manual_seed(bs * 7 + context)
    width = max(table_width, context)
    table = shuffled_table(bs, width, page_size, gen)
    slots = bs * (-(-width // page_size)) * page_size
    latent = torch.randn(slots, DK, generator=gen).to("cuda", torch.bfloat16)
    keys = index_copies(slots, gen)
    q = torch.randn(bs, HEADS, DK, generator=gen).to("cuda", torch.bfloat16)
    q_index = torch.randn(bs, INDEX_HEADS, INDEX_DIM, generator=gen).to("cuda", torch.bfloat16)
    weights = torch.randn(bs, INDEX_HEADS, generator=gen).cuda()
    rows = torch.arange(bs, device="cuda")
    vis = torch.full((bs,), context, dtype=torch.int64, device="cuda")
    scale, index_scale = 192 ** -0.5, INDEX_DIM ** -0.5
    sel = indexer_topk(q_index, weights, keys[0], table, rows, vis, topk, index_scale)
    ref = indexer_topk_reference(q_index, weights, keys[0], table, rows, vis, topk, index_scale)
    same = float(((sel[:, :, None] == ref[:, None, :]).any(-1) & (sel >= 0)).sum() / (ref >= 0).sum())
    every = torch.arange(context, device="cuda").expand(bs, context).contiguous()
    out = sparse_mla_attention(q, latent, table, rows, sel, scale, DV)
    mla_ref = sparse_mla_attention_reference(q, latent, table, rows, sel, scale, DV)
    torch.testing.assert_close(out.float(), mla_ref.float(), atol=2e-2, rtol=2e-2)
    cycle = itertools.cycle(keys)
    t_index = time_us(lambda: indexer_topk(q_index, weights, next(cycle), table, rows, vis, topk, index_scale),
                      repeat)
    state = new_state(bs, width, torch.device("cuda"))  # zeroed once: the histogram counts pile up, times do not
    t_score = time_us(lambda: launch_indexer_scores(q_index, weights, next(cycle), table, rows, vis, index_scale,
                                                    state, topk), repeat)
    t_sparse = time_us(lambda: sparse_mla_attention(q, latent, table, rows, sel, scale, DV), repeat)
    t_dense = time_us(lambda: sparse_mla_attention(q, latent, table, rows, every, scale, DV), repeat)
    key_bytes = bs * context * INDEX_DIM * 2  # the visible index keys, read once
    floor_us, nominal_us = key_bytes / bandwidth / 1e3, key_bytes / NOMINAL_GBS / 1e3  # GB/s -> us
    return {"bs": bs, "context": context, "indexer_us": t_index, "score_us": t_score, "sparse_us": t_sparse,
            "nsa_us": t_index + t_sparse, "dense_us": t_dense, "speedup": t_dense / (t_index + t_sparse),
            "indexer_floor_us": floor_us, "indexer_vs_floor": t_index / floor_us,
            "indexer_vs_nominal": t_index / nominal_us, "same_picks": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["1x32768", "1x131072", "8x32768", "8x131072"],
                    help="BATCHxCONTEXT")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--table-width", type=int, default=0,
                    help="req_to_token's static width (default: the context; the engine's is max_context)")
    ap.add_argument("--score-launch", nargs="+", default=[],
                    help="score-kernel tiles to try, BLOCK_N,BLOCK_H,WARPS each (default: the module's)")
    ap.add_argument("--select-launch", nargs="+", default=[],
                    help="selection launches to try, CHUNK,WARPS each (default: the module's)")
    args = ap.parse_args()
    bandwidth = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {bandwidth:.0f} GB/s")
    launches = [(a, b) for a in args.score_launch or [",".join(map(str, it.CUDA_LAUNCH))]
                for b in args.select_launch or [",".join(map(str, rs.CUDA_CHUNK))]]
    for score_launch, select_launch in launches:
        it.CUDA_LAUNCH = tuple(int(x) for x in score_launch.split(","))
        rs.CUDA_CHUNK = tuple(int(x) for x in select_launch.split(","))
        print(f"score tiles (BLOCK_N, BLOCK_H, warps) = {it.CUDA_LAUNCH}, selection (chunk, warps) = "
              f"{rs.CUDA_CHUNK}, table width {args.table_width or 'context'}")
        print("bs  context  indexer_us  score_us  sparse_us  nsa_us  dense_us  dense/nsa  indexer/floor  "
              "indexer/4.8TB/s  same_picks")
        for c in args.configs:
            bs, context = map(int, c.split("x"))
            r = bench(bs, context, args.topk, args.page_size, args.repeat, bandwidth, args.table_width)
            print(f"{r['bs']:<3} {r['context']:<8} {r['indexer_us']:<11.1f} {r['score_us']:<9.1f} "
                  f"{r['sparse_us']:<10.1f} {r['nsa_us']:<7.1f} {r['dense_us']:<9.1f} {r['speedup']:<10.2f} "
                  f"{r['indexer_vs_floor']:<14.2f} {r['indexer_vs_nominal']:<16.2f} {r['same_picks']:.4f}")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
