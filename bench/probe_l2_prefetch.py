"""Probe: can o_proj's weight stream into L2 while a bs-1 decode attention runs, so that the o_proj gemv that follows
reads it from L2? Llama-3-8B shapes (o_proj 4096 x 4096 bf16, 33.6 MB; attention over 1 x 1024 keys, paged).

    python bench/probe_l2_prefetch.py

Each variant runs back to back over distinct weight copies (>= 1 GB, so nothing but a prefetch puts a weight in L2)
inside one CUDA graph; prints the median time per iteration:
  attn+o            the two kernels as in a decode step
  pf_asm+attn+o     a prefetch kernel first (PTX ``prefetch.global.L2::evict_last`` per 128-byte line, no loads)
  pf_load+attn+o    a prefetch kernel that loads the lines (evict_last) and stores one sum per program
  attn+o (hot)      every iteration reads one copy (L2-resident: the best case)
  pf_asm, pf_load   the prefetch kernels alone
and, with the qkv gemv in front (as in a layer: qkv, attention, o):
  qkv+attn+o        the three kernels in one stream
  qkv+side(...)     a side stream forked after qkv prefetches o's weight while attention runs in the main stream;
                    joined after o ("join after o") or before it ("join before o"); programs in the prefetch grid
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_attention as ba  # noqa: E402
from kernels.gemv import launch_gemv  # noqa: E402
from kernels.split_kv_attention import split_policy  # noqa: E402
from tune_gemv import graph_ms  # noqa: E402


@triton.jit
def _prefetch_asm(W, n_lines, BLOCK: tl.constexpr):
    # grid: (programs,); each program issues L2 prefetches for BLOCK lines at a time, strided over the grid
    base = W.to(tl.pointer_type(tl.int8))
    for l0 in range(tl.program_id(0) * BLOCK, n_lines, tl.num_programs(0) * BLOCK):
        offs = tl.minimum(l0 + tl.arange(0, BLOCK), n_lines - 1).to(tl.int64)
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                  [base + offs * 128], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_load(W, Scratch, n_words, BLOCK: tl.constexpr):
    # grid: (programs,); loads int32 words with evict_last and keeps a sum so that the loads stay
    acc = tl.zeros((BLOCK,), tl.int32)
    for w0 in range(tl.program_id(0) * BLOCK, n_words, tl.num_programs(0) * BLOCK):
        offs = w0 + tl.arange(0, BLOCK)
        acc += tl.load(W + offs, mask=offs < n_words, other=0, eviction_policy="evict_last")
    tl.store(Scratch + tl.program_id(0), tl.sum(acc, 0))


def main() -> None:
    dev = torch.device("cuda")
    n = k = 4096
    copies = 32
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, device=dev).mul_(0.02).bfloat16() for _ in range(copies)]
    x = torch.randn(1, k, device=dev).bfloat16()
    res = torch.randn(1, n, device=dev).bfloat16()
    k_pool, v_pool, table, kc, vc = ba.paged_cache(1, 1024, 16, (64 + 1) * 16, gen)
    q = torch.randn(1, ba.HEADS, ba.DIM, device=dev).bfloat16()
    rpi = torch.zeros(1, dtype=torch.long, device=dev)
    seq = torch.full((1,), 1024, device=dev)
    pol = split_policy(dev, 1)
    scratch = torch.empty(4096, dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    n_lines = n * k * 2 // 128

    def attn():
        return torch.ops.tfs.decode_attention(q, k_pool, v_pool, table, rpi, seq, ba.SCALE, *pol)

    def o(w):
        return launch_gemv(x, w, res, None, 0.0, False)

    def pf_asm(w, programs=sms):
        _prefetch_asm[(programs,)](w, n_lines, BLOCK=256, num_warps=4)

    def pf_load(w, programs=2 * sms):
        _prefetch_load[(programs,)](w.view(torch.int32), scratch, n * k // 2, BLOCK=1024, num_warps=4)

    qkvs = [torch.randn(3 * n // 2, k, device=dev).mul_(0.02).bfloat16() for _ in range(copies)]
    side = torch.cuda.Stream()

    def qkv(i):
        return launch_gemv(x, qkvs[i], None, None, 0.0, False)

    def layer_side(i, programs, join_before_o):
        qkv(i)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            pf_asm(ws[i], programs)
        attn()
        if join_before_o:
            torch.cuda.current_stream().wait_stream(side)
        o(ws[i])
        torch.cuda.current_stream().wait_stream(side)

    variants = {
        "qkv+attn+o": [lambda i=i: (qkv(i), attn(), o(ws[i])) for i in range(copies)],
        "qkv+o (no attention)": [lambda i=i: (qkv(i), o(ws[i])) for i in range(copies)],
        "qkv+side(1xSM)+attn+o, join after o": [lambda i=i: layer_side(i, sms, False) for i in range(copies)],
        "qkv+side(1xSM)+attn+o, join before o": [lambda i=i: layer_side(i, sms, True) for i in range(copies)],
        "qkv+side(SM/4)+attn+o, join after o": [lambda i=i: layer_side(i, sms // 4, False) for i in range(copies)],
        "qkv+side(SM/2)+attn+o, join after o": [lambda i=i: layer_side(i, sms // 2, False) for i in range(copies)],
        "qkv+side(2xSM)+attn+o, join after o": [lambda i=i: layer_side(i, 2 * sms, False) for i in range(copies)],
        "attn": [attn for _ in ws],
        "o": [lambda w=w: o(w) for w in ws],
        "attn+o": [lambda w=w: (attn(), o(w)) for w in ws],
        "pf_asm+attn+o": [lambda w=w: (pf_asm(w), attn(), o(w)) for w in ws],
        "pf_asm(4xSM)+attn+o": [lambda w=w: (pf_asm(w, 4 * sms), attn(), o(w)) for w in ws],
        "pf_load+attn+o": [lambda w=w: (pf_load(w), attn(), o(w)) for w in ws],
        "attn+o (hot)": [lambda: (attn(), o(ws[0])) for _ in ws],
        "pf_asm": [lambda w=w: pf_asm(w) for w in ws],
        "pf_load": [lambda w=w: pf_load(w) for w in ws],
    }
    print(f"{torch.cuda.get_device_name()}: o_proj {n}x{k} bf16 ({n * k * 2 / 1e6:.1f} MB), attention 1 x 1024 keys")
    for name, calls in variants.items():
        print(f"{name:>40}: {graph_ms(calls) * 1e3:7.2f} us per iteration", flush=True)


if __name__ == "__main__":
    main()
