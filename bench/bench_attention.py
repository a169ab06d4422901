"""Decode attention on a CUDA GPU: the Triton split-K kernel of ``attention=triton`` against FlexAttention over the
paged pool (``attention=flex``'s path: gather through req_to_token, then flex_attention, compiled per shape) and
torch SDPA's flash backend on a contiguous cache; achieved K/V bandwidth against the measured device copy
bandwidth; and verify (8 tokens per request, tree mask) against decode.

    python bench/bench_attention.py                                   # Llama-3-8B attention shape, ~3 min on H200
    python bench/bench_attention.py --configs 1x4096 64x32768 --page-sizes 16

Times: medians of ``triton.testing.do_bench`` over a CUDA graph that holds ``repeat`` back-to-back calls (divided by
``repeat``), so that launch overhead does not hide microsecond kernels. Data: random normal bf16 (never zero), pages
shuffled through the pool. Every implementation's output is checked against SDPA on the same data before timing.
Bandwidth = K/V bytes read (batch * context * kv_heads * head_dim * 2 tensors * 2 bytes) / time.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from framework.attention.flex import attend, block_tiles  # noqa: E402
from tfs_kernels.decode_attention import decode_attention_op  # noqa: E402,F401  (registers tfs::decode_attention)
from tfs_kernels.mask_bits import pack_mask_bits  # noqa: E402
from tfs_kernels.split_kv_attention import split_policy  # noqa: E402
from tfs_kernels.verify_attention import verify_attention_op  # noqa: E402,F401
from knobs import add_set_option, apply_sets  # noqa: E402  (bench/, the script's directory)

HEADS, KV_HEADS, DIM = 32, 8, 128  # Llama-3-8B attention
GROUP = HEADS // KV_HEADS
SCALE = DIM ** -0.5
DRAFT = 8  # verify: tokens per request


def time_us(fn: Callable[[], object], repeat: int) -> float:
    """Median microseconds per call of ``fn`` replayed from a CUDA graph of ``repeat`` calls."""
    fn()  # compile / autotune outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    ms = triton.testing.do_bench(graph.replay, return_mode="median")
    del graph
    return ms * 1000 / repeat


def copy_bandwidth() -> float:
    """GB/s of a 4 GiB device-to-device copy, counting bytes read + written."""
    src = torch.randn(1 << 31, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e6


def paged_cache(bs: int, context: int, page_size: int, slots: int, gen: torch.Generator):
    """(k_pool, v_pool [slots, kv_heads, dim], req_to_token [bs, context], k, v contiguous [bs, kv_heads, context,
    dim]): every request owns shuffled pages (page 0 reserved, as in the engine)."""
    pages = -(-context // page_size)
    page_of = (torch.randperm(bs * pages, generator=gen) + 1).view(bs, pages).cuda()
    pos = torch.arange(context, device="cuda")
    table = page_of[:, pos // page_size] * page_size + pos % page_size  # [bs, context]
    assert (bs * pages + 1) * page_size <= slots
    k_pool = torch.randn(slots, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.randn(slots, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    k = k_pool[table].permute(0, 2, 1, 3).contiguous()  # [bs, kv_heads, context, dim]
    v = v_pool[table].permute(0, 2, 1, 3).contiguous()
    return k_pool, v_pool, table, k, v


def sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q ``[bs, heads, dim]`` over a contiguous cache: the group's heads folded into query rows (plain MHA)."""
    bs = q.shape[0]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q.view(bs, KV_HEADS, GROUP, DIM), k, v, scale=SCALE)
    return out.reshape(bs, HEADS, DIM)


def flex_paged(q, k_pool, v_pool, table, seq_lens, q_lens, kv_num, kv_idx, full_num, full_idx):
    """attention=flex's decode path: gather through req_to_token, then flex_attention with the block mask."""
    kb = k_pool[table].transpose(1, 2)  # [bs, kv_heads, width, dim]
    vb = v_pool[table].transpose(1, 2)
    qb = (q[:, :, None] * SCALE).to(kb.dtype)  # [bs, heads, 1, dim]
    return attend(qb, kb, vb, seq_lens, q_lens, None, kv_num, kv_idx, full_num, full_idx, 1.0)[:, :, 0]


def verify_reference(q8: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA with a dense mask: q8 ``[bs * DRAFT, heads, dim]``, mask ``[bs, DRAFT, DRAFT]`` over the last keys."""
    bs, context = k.shape[0], k.shape[2]
    qb = q8.view(bs, DRAFT, KV_HEADS, GROUP, DIM).permute(0, 2, 1, 3, 4).reshape(bs, KV_HEADS, DRAFT * GROUP, DIM)
    allowed = torch.ones(bs, DRAFT, context, dtype=torch.bool, device="cuda")
    allowed[:, :, context - DRAFT:] = mask
    allowed = allowed.repeat_interleave(GROUP, dim=1)[:, None]  # [bs, 1, DRAFT * GROUP, context]
    out = F.scaled_dot_product_attention(qb, k, v, attn_mask=allowed, scale=SCALE)
    return out.view(bs, KV_HEADS, DRAFT, GROUP, DIM).permute(0, 2, 1, 3, 4).reshape(bs * DRAFT, HEADS, DIM)


def draft_tree_mask(bs: int, gen: torch.Generator) -> torch.Tensor:
    """``[bs, DRAFT, DRAFT]`` bool on CUDA: a random tree over the draft tokens (each sees itself and some earlier
    ones)."""
    mask = torch.rand(bs, DRAFT, DRAFT, generator=gen) < 0.5
    return ((mask & torch.ones(DRAFT, DRAFT, dtype=torch.bool).tril()) | torch.eye(DRAFT, dtype=torch.bool)).cuda()


def check(name: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    err = (out.float() - ref.float()).abs().max().item()
    if not err <= 2e-2:
        raise SystemExit(f"{name}: max abs error {err:.3g} against the reference; not timing a wrong kernel")


def bench_config(bs: int, context: int, page_size: int, slots: int, repeat: int, with_verify: bool,
                 flex_fn: Callable, verify_mask: str = "bits") -> dict:
    gen = torch.Generator().manual_seed(bs * 100003 + context + page_size)
    k_pool, v_pool, table, k, v = paged_cache(bs, context, page_size, slots, gen)
    q = torch.randn(bs, HEADS, DIM, generator=gen).to("cuda", torch.bfloat16)
    rpi = torch.arange(bs, device="cuda")
    seq = torch.full((bs,), context, device="cuda")
    ones = torch.ones_like(seq)
    tiles = block_tiles(seq, ones, 1, context, None)
    policy = split_policy(torch.device("cuda"), 1)
    triton_fn = lambda: torch.ops.tfs.decode_attention(q, k_pool, v_pool, table, rpi, seq, SCALE, *policy)  # noqa
    flex_call = lambda: flex_fn(q, k_pool, v_pool, table, seq, ones, *tiles)  # noqa: E731
    sdpa_fn = lambda: sdpa_flash(q, k, v)  # noqa: E731
    ref = sdpa_fn()
    check("triton decode", triton_fn(), ref)
    row = {"triton": time_us(triton_fn, repeat), "sdpa": time_us(sdpa_fn, repeat)}
    try:  # torch 2.11's flex template fails to compile for > 2^31-element gathers (int32/int64 index mix)
        check("flex decode", flex_call(), ref)
        row["flex"] = time_us(flex_call, repeat)
    except Exception as err:  # noqa: BLE001  report and go on with the other columns
        print(f"flex failed at bs={bs} context={context}: {str(err).splitlines()[0][:120]}", flush=True)
        row["flex"] = float("nan")
    if with_verify:
        q8 = torch.randn(bs * DRAFT, HEADS, DIM, generator=gen).to("cuda", torch.bfloat16)
        mask = draft_tree_mask(bs, gen)
        vpolicy = split_policy(torch.device("cuda"), DRAFT)
        # as attention=triton passes it (converted once per step, not per layer): packed bits, or bytes
        bits = pack_mask_bits(mask) if verify_mask == "bits" else None
        mask8 = mask.to(torch.uint8)
        verify_fn = lambda: torch.ops.tfs.verify_attention(q8, k_pool, v_pool, table, rpi, seq, mask8,  # noqa: E731
                                                           DRAFT, SCALE, *vpolicy, bits)
        check("triton verify", verify_fn(), verify_reference(q8, k, v, mask))
        row["verify"] = time_us(verify_fn, repeat)
    del k_pool, v_pool, table, k, v
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["1x4096", "1x32768", "32x4096", "64x32768"],
                    help="batch x context")
    ap.add_argument("--page-sizes", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--repeat", type=int, default=20, help="calls per CUDA graph (fewer for configs over 1 GB)")
    ap.add_argument("--verify-mask", default="bits", choices=["bits", "uint8"],
                    help="the tree mask as the verify kernel reads it: packed into a word per row (attention=triton "
                         "for masks up to 64 keys wide) or a byte per key")
    add_set_option(ap)
    args = ap.parse_args()
    apply_sets(ap, args.set)
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    # flex is compiled per shape (static: flex's decoding kernel); one pool size for every page size of a config
    # keeps it at one compile per (batch, context)
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
    flex_fn = torch.compile(flex_paged, dynamic=False, fullgraph=True)
    rows = []
    for config in args.configs:
        bs, context = (int(x) for x in config.split("x"))
        kv_bytes = bs * context * KV_HEADS * DIM * 2 * 2
        repeat = args.repeat if kv_bytes < 1e9 else 2
        slots = max((bs * -(-context // p) + 1) * p for p in args.page_sizes)
        for page_size in args.page_sizes:
            r = bench_config(bs, context, page_size, slots, repeat, page_size == args.page_sizes[-1], flex_fn,
                             args.verify_mask)
            rows.append((page_size, bs, context, kv_bytes, r))
            print(f"page {page_size} batch {bs} context {context}: {r}", flush=True)

    print(f"\ndecode attention, {HEADS} q / {KV_HEADS} kv heads, head_dim {DIM}, bf16, {torch.cuda.get_device_name()}; "
          f"device copy {copy_gbs:.0f} GB/s (read + write); verify's mask as {args.verify_mask}")
    print(f"{'page':>4} {'batch':>5} {'context':>7} {'KV MB':>7} | {'triton us':>9} {'GB/s':>6} {'/copy':>5} | "
          f"{'flex us':>8} {'GB/s':>6} | {'sdpa-flash us':>13} {'GB/s':>6} | {'verify8 us':>10} {'/decode':>7}")
    for page_size, bs, context, kv_bytes, r in rows:
        gbs = {name: kv_bytes / r[name] / 1e3 for name in ("triton", "flex", "sdpa")}
        verify = f"{r['verify']:>10.1f} {r['verify'] / r['triton']:>7.2f}" if "verify" in r else f"{'':>10} {'':>7}"
        print(f"{page_size:>4} {bs:>5} {context:>7} {kv_bytes / 1e6:>7.0f} | {r['triton']:>9.1f} {gbs['triton']:>6.0f} "
              f"{gbs['triton'] / copy_gbs:>5.2f} | {r['flex']:>8.1f} {gbs['flex']:>6.0f} | {r['sdpa']:>13.1f} "
              f"{gbs['sdpa']:>6.0f} | {verify}")


if __name__ == "__main__":
    main()
