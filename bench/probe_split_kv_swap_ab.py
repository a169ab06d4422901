"""Probe: the split-K attention partial kernel with its products transposed ("swap AB"), and a sweep of the verify
launch at small batch, against main's kernel, on a CUDA GPU (or the Triton interpreter, for correctness only).

Main's partial kernel computes ``s = q @ k^T`` with the ``q_len * group`` query rows as the MMA's M dimension: 16
(decode, 4 rows padded) or 32 (an 8-token verify) rows, too few for Hopper's warpgroup MMA (wgmma needs M = 64 per
warpgroup), so Triton emits the older ``mma.sync``. Here the keys are M: ``s^T = k @ q^T`` ``[BLOCK_N, rows]`` and
``o^T += v^T @ p^T`` ``[head_dim, rows]``, both with M >= 64, so wgmma applies; the softmax runs down the columns.

    python bench/probe_split_kv_swap_ab.py                      # H200: ~3 min
    TRITON_INTERPRET=1 python bench/probe_split_kv_swap_ab.py --check-only   # CPU: the kernel against the reference

Prints, per (batch x context), decode and verify-over-an-8-token-tree times for each variant (kernel, partial dtype,
(BLOCK_N, warps, stages), programs per SM), each output checked against SDPA first, and which MMA each kernel used.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import kernels.split_kv_attention as skv  # noqa: E402
import kernels.split_kv_merge as skm  # noqa: E402
from kernels.decode_attention import decode_attention_op  # noqa: E402,F401  (registers the ops)
from kernels.split_kv_attention import _program_tile, _visibility  # noqa: E402
from kernels.verify_attention import verify_attention_op  # noqa: E402,F401


@triton.jit
def _attend_range_t(acc_t, l_i, m_i, q_t, scale_log2e, lo, hi, K_cache, V_cache, slot_row, kv_k, kv_v, mask_row,
                    t, row_ok, region, last_key, d, d_ok, stride_ks, stride_vs, stride_mt,
                    BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, CHECK: tl.constexpr):
    """``_attend_range`` transposed: acc_t ``[BLOCK_D, BLOCK_M]``, q_t ``[BLOCK_D, BLOCK_M]``."""
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        slot = tl.load(slot_row + j, mask=j_ok, other=0)  # [BLOCK_N]
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = tl.load(K_cache + slot[:, None] * stride_ks + kv_k + d[None, :], mask=kv_ok, other=0.0)
        s = (tl.dot(k, q_t) * scale_log2e).to(tl.float32)  # [BLOCK_N, BLOCK_M]
        if CHECK:
            if HAS_MASK:
                rel = j[:, None] - region
                in_region = rel >= 0
                tree = tl.load(mask_row + t[None, :] * stride_mt + rel,
                               mask=row_ok[None, :] & in_region & j_ok[:, None], other=0)
                allowed = j_ok[:, None] & ((rel < 0) | (tree != 0))
            else:
                allowed = j_ok[:, None] & (j[:, None] <= last_key[None, :])
            s = tl.where(allowed, s, float("-inf"))
        else:
            s = tl.where(j_ok[:, None], s, float("-inf"))
        v = tl.load(V_cache + slot[:, None] * stride_vs + kv_v + d[None, :], mask=kv_ok, other=0.0)
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[None, :])
        acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(v), p.to(v.dtype))
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    return acc_t, l_i, m_i


@triton.jit
def _split_kv_partial_kernel_t(
    Q, K_cache, V_cache, Req_to_token, Req_pool_indices, Seq_lens, Mask, Mid_o, Mid_lse,
    scale_log2e, mask_width, programs_per_split, max_splits, target_programs, min_split_len,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_req, stride_mb, stride_mt,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, M_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_BITS: tl.constexpr, IEEE_DOT: tl.constexpr, USE_PDL: tl.constexpr, LINE: tl.constexpr,
):
    """Same arguments and result as ``kernels.split_kv_attention._split_kv_partial_kernel`` (no PDL, bf16 / fp16
    caches: the default dot precision, a byte mask only)."""
    tl.static_assert(not MASK_BITS, "the transposed probe kernel reads the mask's bytes, not packed words")
    scale_log2e = tl.cast(scale_log2e, tl.float32)
    b, kv_head, split, seq_len, n_splits, start, end, t, row_ok, token, head = _program_tile(
        Seq_lens, programs_per_split, max_splits, target_programs, min_split_len, Q_LEN, GROUP, M_BLOCKS, BLOCK_M,
        BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    slot_row = Req_to_token + tl.load(Req_pool_indices + b) * stride_req
    q_t = tl.load(Q + token[None, :] * stride_qt + head[None, :] * stride_qh + d[:, None],
                  mask=row_ok[None, :] & d_ok[:, None], other=0.0).to(K_cache.dtype.element_ty)  # [BLOCK_D, BLOCK_M]
    mask_row = Mask + b * stride_mb
    last_key, region, mid = _visibility(seq_len, start, end, t, mask_width, Q_LEN, HAS_MASK, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_t = tl.zeros([BLOCK_D, BLOCK_M], tl.float32)
    acc_t, l_i, m_i = _attend_range_t(acc_t, l_i, m_i, q_t, scale_log2e, start, mid, K_cache, V_cache, slot_row,
                                      kv_head * stride_kh, kv_head * stride_vh, mask_row, t, row_ok, region,
                                      last_key, d, d_ok, stride_ks, stride_vs, stride_mt, BLOCK_N, HAS_MASK, False)
    acc_t, l_i, m_i = _attend_range_t(acc_t, l_i, m_i, q_t, scale_log2e, mid, end, K_cache, V_cache, slot_row,
                                      kv_head * stride_kh, kv_head * stride_vh, mask_row, t, row_ok, region,
                                      last_key, d, d_ok, stride_ks, stride_vs, stride_mt, BLOCK_N, HAS_MASK, True)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    store_ok = t < tl.where(split < n_splits, Q_LEN, 0)
    out = tl.trans(acc_t / l_safe[None, :])  # [BLOCK_M, BLOCK_D]
    tl.store(Mid_o + token[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_os + d[None, :],
             out.to(Mid_o.dtype.element_ty), mask=store_ok[:, None] & d_ok[None, :])
    tl.store(Mid_lse + token * stride_lt + head * stride_lh + split, lse, mask=store_ok)


MAIN_KERNEL = skv._split_kv_partial_kernel
KERNELS = {"main": MAIN_KERNEL, "swap": _split_kv_partial_kernel_t}
PREV = os.environ.get("PROBE_PREV_TREE")  # a `git archive` of an earlier commit: its partial kernel as "prev"
if PREV:
    import importlib.util

    _spec = importlib.util.spec_from_file_location("prev_split_kv", os.path.join(PREV, "kernels/split_kv_attention.py"))
    _prev = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_prev)
    KERNELS["prev"] = _prev._split_kv_partial_kernel


def mma_used(fn) -> str:
    """Which MMA instructions the compiled variants of ``fn`` contain (from their PTX), e.g. 'wgmma' / 'mma.sync'."""
    kinds = set()
    try:
        for entry in fn.device_caches.values():
            for compiled in entry[0].values():
                ptx = compiled.asm.get("ptx", "")
                kinds |= {k for k in ("wgmma", "mma.sync") if k in ptx}
    except Exception as err:  # noqa: BLE001  Triton versions differ; the probe's timings do not depend on this
        return f"unknown ({type(err).__name__})"
    return "+".join(sorted(kinds)) or "none"


def case(bs: int, context: int, page_size: int, dev: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
         dim: int, draft: int, seed: int):
    """Random paged cache and queries, and the two references (plain torch, float32 math)."""
    gen = torch.Generator().manual_seed(seed)
    pages = -(-context // page_size)
    page_of = (torch.randperm(bs * pages, generator=gen) + 1).view(bs, pages)
    pos = torch.arange(context)
    table = (page_of[:, pos // page_size] * page_size + pos % page_size).to(dev)
    slots = (bs * pages + 1) * page_size
    k_pool = torch.randn(slots, kv_heads, dim, generator=gen).to(dev, dtype)
    v_pool = torch.randn(slots, kv_heads, dim, generator=gen).to(dev, dtype)
    q1 = torch.randn(bs, heads, dim, generator=gen).to(dev, dtype)
    q8 = torch.randn(bs * draft, heads, dim, generator=gen).to(dev, dtype)
    mask = torch.rand(bs, draft, draft, generator=gen) < 0.5
    mask = ((mask & torch.ones(draft, draft, dtype=torch.bool).tril()) | torch.eye(draft, dtype=torch.bool)).to(dev)
    rpi = torch.arange(bs, device=dev)
    seq = torch.full((bs,), context, device=dev)
    scale = dim ** -0.5
    ref1 = skv.split_kv_attention_reference(q1, k_pool, v_pool, table, rpi, seq, None, 1, scale)
    ref8 = skv.split_kv_attention_reference(q8, k_pool, v_pool, table, rpi, seq, mask, draft, scale)
    decode = lambda pol: torch.ops.tfs.decode_attention(q1, k_pool, v_pool, table, rpi, seq, scale, *pol)  # noqa

    def verify(pol, kind: str = "bool"):
        """kind: bool (the op converts it), uint8 (as attention=triton passes it), causal (no mask)."""
        m = {"bool": mask, "uint8": mask8, "causal": None}[kind]
        return torch.ops.tfs.verify_attention(q8, k_pool, v_pool, table, rpi, seq, m, draft, scale, *pol)

    mask8 = mask.to(torch.uint8)
    causal = skv.split_kv_attention_reference(q8, k_pool, v_pool, table, rpi, seq, None, draft, scale)
    return decode, verify, ref1, {"bool": ref8, "uint8": ref8, "causal": causal}


def set_variant(kernel: str, partial: torch.dtype, launch: tuple[int, int, int], target: int,
                reduce_warps: int = 2) -> None:
    skv._split_kv_partial_kernel = KERNELS[kernel]
    skm.REDUCE_NUM_WARPS = reduce_warps
    skv.PARTIAL_DTYPE = partial
    for key in skv.CUDA_LAUNCH:
        skv.CUDA_LAUNCH[key] = launch
    skv.TARGET_PROGRAMS_PER_SM = {"decode": target, "multi": target}


def kernel_times(fn, calls: int = 20) -> str:
    """GPU time per call of each kernel ``fn`` launches (torch.profiler), e.g. 'partial 5.1 + reduce 2.0'."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" or getattr(ev, "self_device_time_total", 0) > 0:
            us = getattr(ev, "self_device_time_total", 0) or getattr(ev, "self_cuda_time_total", 0)
            if us > 0:
                totals[ev.key[:40]] = us / calls
    return " + ".join(f"{k} {v:.1f}" for k, v in sorted(totals.items(), key=lambda kv: -kv[1]))


def check(name: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    err = (out.float() - ref.float()).abs().max().item()
    if not err <= 2e-2:
        raise SystemExit(f"{name}: max abs error {err:.3g} against the reference")


def check_only() -> None:
    """Small shapes (interpreter): both kernels, both partial dtypes, decode and verify, against the reference."""
    dev = torch.device("cpu")
    for kernel, partial, (bs, context) in itertools.product(KERNELS, (torch.float32, torch.bfloat16),
                                                            ((1, 70), (2, 45))):
        set_variant(kernel, partial, skv.INTERPRET_LAUNCH, 4)
        # float32 caches: the interpreter's bf16 dot is not usable
        decode, verify, ref1, ref8 = case(bs, context, 4, dev, torch.float32, 8, 2, 32, 8, bs * 31 + context)
        pol = (4, 16, 32)
        check(f"{kernel} {partial} decode {bs}x{context}", decode(pol), ref1)
        check(f"{kernel} {partial} verify {bs}x{context}", verify(pol), ref8["bool"])
        print(f"ok: {kernel} {partial} {bs}x{context}", flush=True)


def merge_sweep(configs: list[str], sms: int, time_us) -> None:
    """Main's kernel and launches; decode, and verify with the uint8 mask (as attention=triton passes it), over the
    merge kernel's num_warps and the partials' dtype. (Lease c of the tenth session also swept a power-of-two
    rounding of the split count, since made the rule.)"""
    dev = torch.device("cuda")
    variants = list(itertools.product((1, 2, 4, 8), (torch.float32, torch.bfloat16)))
    for config in configs:
        bs, context = (int(x) for x in config.split("x"))
        decode, verify, ref1, ref8 = case(bs, context, 16, dev, torch.bfloat16, 32, 8, 128, 8, bs * 7 + context)
        repeat = 20 if bs * context < 1 << 20 else 2
        print(f"\n{config}: merge warps | partials | decode us | verify us | verify / decode")
        for warps, partial in variants:
            set_variant("main", partial, (64, 4, 1), 4, warps)
            pol = (64, 4 * sms, skv.MIN_SPLIT_LEN)
            check("decode", decode(pol), ref1)
            d = time_us(lambda: decode(pol), repeat)
            set_variant("main", partial, (128, 4, 1) if bs <= skv.SMALL_BATCH else (128, 4, 2), 2, warps)
            pol = (64, 2 * sms, skv.MIN_SPLIT_LEN)
            check("verify", verify(pol, "uint8"), ref8["uint8"])
            v = time_us(lambda: verify(pol, "uint8"), repeat)
            print(f"{warps} | {str(partial)[6:]} | {d:.1f} | {v:.1f} | {v / d:.2f}", flush=True)
        del decode, verify, ref1, ref8
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--configs", nargs="+", default=["1x1024", "1x4096", "1x32768"])
    ap.add_argument("--launches", nargs="+", default=["128,4,1", "64,4,1", "64,4,2", "128,4,2", "128,8,1"])
    ap.add_argument("--targets", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--decode-launches", nargs="+", default=["64,4,1", "128,4,1"])
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--partials", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--merge-sweep", action="store_true",
                    help="instead: main's kernel, verify with the uint8 mask, over the merge's warps and the "
                         "partials' dtype")
    ap.add_argument("--verify-kind", default="bool", choices=["bool", "uint8", "causal"],
                    help="the verify sweep's mask: bool (the op converts it per call), uint8 (as attention=triton "
                         "passes it), causal (none)")
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                    help="kernels.split_kv_attention constants, e.g. ROW_BLOCK=16")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    for item in args.set:
        name, _, value = item.partition("=")
        if not hasattr(skv, name):
            ap.error(f"--set {item}: kernels.split_kv_attention has no {name}")
        setattr(skv, name, ast.literal_eval(value))
    if args.check_only:
        return check_only()
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_attention import time_us

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    parse = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    partials = {p: {"fp32": torch.float32, "bf16": torch.bfloat16}[p] for p in args.partials}
    if args.merge_sweep:
        return merge_sweep(args.configs, sms, time_us)
    for config in args.configs:
        bs, context = (int(x) for x in config.split("x"))
        decode, verify, ref1, ref8 = case(bs, context, 16, dev, torch.bfloat16, 32, 8, 128, 8, bs * 7 + context)
        repeat = 20 if bs * context < 1 << 20 else 2
        rows = []
        for kernel, (pname, partial), launch in itertools.product(args.kernels, partials.items(),
                                                                args.decode_launches):
            set_variant(kernel, partial, parse(launch), 4)
            pol = (64, 4 * sms, skv.MIN_SPLIT_LEN)
            check(f"decode {kernel} {pname} {launch}", decode(pol), ref1)
            rows.append(("decode", kernel, pname, launch, 4, time_us(lambda: decode(pol), repeat)))
        for kernel, (pname, partial), launch, target in itertools.product(args.kernels, partials.items(),
                                                                          args.launches, args.targets):
            set_variant(kernel, partial, parse(launch), target)
            pol = (64, target * sms, skv.MIN_SPLIT_LEN)
            kind = args.verify_kind
            check(f"verify {kernel} {pname} {launch}", verify(pol, kind), ref8[kind])
            rows.append(("verify", kernel, pname, launch, target, time_us(lambda: verify(pol, kind), repeat)))
        set_variant("main", torch.float32, (128, 4, 1), 2)
        pol = (64, 2 * sms, skv.MIN_SPLIT_LEN)
        for kind in ("uint8", "causal"):
            check(f"verify {kind}", verify(pol, kind), ref8[kind])
            rows.append((f"verify-{kind}", "main", "fp32", "128,4,1", 2, time_us(lambda: verify(pol, kind), repeat)))
        print(f"{config} kernels, main's verify (bool mask): {kernel_times(lambda: verify(pol))}")
        print(f"{config} kernels, main's verify (uint8 mask): {kernel_times(lambda: verify(pol, 'uint8'))}")
        set_variant("main", torch.float32, (64, 4, 1), 4)
        pol = (64, 4 * sms, skv.MIN_SPLIT_LEN)
        print(f"{config} kernels, main's decode: {kernel_times(lambda: decode(pol))}")
        base_d = next(r[-1] for r in rows if r[:5] == ("decode", "main", "fp32", "64,4,1", 4))
        base_v = next(r[-1] for r in rows if r[1:5] == ("main", "fp32", "128,4,1", 2)
                      and r[0] == ("verify" if args.verify_kind == "bool" else f"verify-{args.verify_kind}"))
        print(f"\n{config}: main's decode {base_d:.1f} us, main's verify ({args.verify_kind} mask) {base_v:.1f} us "
              f"({base_v / base_d:.2f}x)")
        print("mode | kernel | partials | (BLOCK_N, warps, stages) | per SM | us | / main's decode")
        for mode in ("decode", "verify", "verify-uint8", "verify-causal"):
            for r in sorted((r for r in rows if r[0] == mode), key=lambda r: r[-1])[:args.top]:
                print(" | ".join(str(x) for x in r[:5]) + f" | {r[-1]:.1f} | {r[-1] / base_d:.2f}", flush=True)
        del decode, verify, ref1, ref8
        torch.cuda.empty_cache()
    print("\nMMA used: main", mma_used(MAIN_KERNEL), "| swap", mma_used(_split_kv_partial_kernel_t))


if __name__ == "__main__":
    main()
