"""DeepSeek sparse attention on a CUDA GPU, one decode step of one layer at DeepSeek-V3.2's shapes (128 heads,
latent 512 + 64, indexer 64 heads x 128, index_topk 2048, bf16): ``tfs::indexer_topk`` plus
``tfs::sparse_mla_attention`` over the selected keys (attention=nsa) against dense MLA decode over the same cache
(the same kernel given every position), and the indexer against its memory-bound floor (reading the visible index
keys once at the measured copy bandwidth).

    python bench/bench_nsa.py                                   # batch 1 and 8 at 32k and 128k tokens, ~2 min on H200
    python bench/bench_nsa.py --configs 1x32768 --page-size 1

Times: medians of ``triton.testing.do_bench`` over a CUDA graph of ``repeat`` back-to-back calls (divided by
``repeat``). Data: random normal bf16 (never zero), pages shuffled through the pool; the sparse output is checked
against the torch reference before timing.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.bench_attention import copy_bandwidth, time_us  # noqa: E402
from tfs_kernels.indexer_topk import indexer_topk  # noqa: E402
from tfs_kernels.sparse_mla import sparse_mla_attention, sparse_mla_attention_reference  # noqa: E402

HEADS, DK, DV, INDEX_HEADS, INDEX_DIM = 128, 576, 512, 64, 128


def shuffled_table(bs: int, context: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """``[bs, context]`` slots over shuffled pages of a pool of ``bs * context`` slots."""
    pages = bs * (-(-context // page_size))
    page_of = torch.randperm(pages, generator=gen).view(bs, -1)
    pos = torch.arange(context)
    return (page_of[:, pos // page_size] * page_size + pos % page_size).cuda()


def bench(bs: int, context: int, topk: int, page_size: int, repeat: int, bandwidth: float) -> dict:
    gen = torch.Generator().manual_seed(bs * 7 + context)
    table = shuffled_table(bs, context, page_size, gen)
    slots = bs * (-(-context // page_size)) * page_size
    latent = torch.randn(slots, DK, generator=gen).to("cuda", torch.bfloat16)
    index_k = torch.randn(slots, INDEX_DIM, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(bs, HEADS, DK, generator=gen).to("cuda", torch.bfloat16)
    q_index = torch.randn(bs, INDEX_HEADS, INDEX_DIM, generator=gen).to("cuda", torch.bfloat16)
    weights = torch.randn(bs, INDEX_HEADS, generator=gen).cuda()
    rows = torch.arange(bs, device="cuda")
    vis = torch.full((bs,), context, dtype=torch.int64, device="cuda")
    scale = 192 ** -0.5
    sel = indexer_topk(q_index, weights, index_k, table, rows, vis, topk, INDEX_DIM ** -0.5)
    every = torch.arange(context, device="cuda").expand(bs, context).contiguous()
    out = sparse_mla_attention(q, latent, table, rows, sel, scale, DV)
    ref = sparse_mla_attention_reference(q, latent, table, rows, sel, scale, DV)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    t_index = time_us(lambda: indexer_topk(q_index, weights, index_k, table, rows, vis, topk, INDEX_DIM ** -0.5),
                      repeat)
    t_sparse = time_us(lambda: sparse_mla_attention(q, latent, table, rows, sel, scale, DV), repeat)
    t_dense = time_us(lambda: sparse_mla_attention(q, latent, table, rows, every, scale, DV), repeat)
    floor_us = bs * context * INDEX_DIM * 2 / bandwidth / 1e3  # index keys read once (GB/s -> us)
    return {"bs": bs, "context": context, "indexer_us": t_index, "sparse_us": t_sparse, "nsa_us": t_index + t_sparse,
            "dense_us": t_dense, "speedup": t_dense / (t_index + t_sparse), "indexer_floor_us": floor_us,
            "indexer_vs_floor": t_index / floor_us}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["1x32768", "1x131072", "8x32768", "8x131072"],
                    help="BATCHxCONTEXT")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    bandwidth = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {bandwidth:.0f} GB/s")
    print("bs  context  indexer_us  sparse_us  nsa_us  dense_us  dense/nsa  indexer/floor")
    for c in args.configs:
        bs, context = map(int, c.split("x"))
        r = bench(bs, context, args.topk, args.page_size, args.repeat, bandwidth)
        print(f"{r['bs']:<3} {r['context']:<8} {r['indexer_us']:<11.1f} {r['sparse_us']:<10.1f} {r['nsa_us']:<7.1f} "
              f"{r['dense_us']:<9.1f} {r['speedup']:<10.2f} {r['indexer_vs_floor']:.2f}")


if __name__ == "__main__":
    main()
