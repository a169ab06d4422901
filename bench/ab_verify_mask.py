"""A/B on a CUDA GPU: the split-K verify kernel reading the tree mask as one packed int64 word per query row
(``pack_mask_bits``, what attention=triton passes for masks up to 64 keys wide) against a byte per (row, key)
(uint8), with causal verify (no mask) and decode as yardsticks; Llama-3-8B attention, bf16, page size 16.

    python bench/ab_verify_mask.py                         # H200: ~1 min
    python bench/ab_verify_mask.py --configs 1x4096 --rounds 5

Each round times every variant once, in turn (bench_attention.time_us: median of do_bench over a CUDA graph of
back-to-back calls), so that clock drift falls on all of them alike; the table shows the median over rounds. Every
output is checked against the plain-torch reference before timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_attention import (DIM, DRAFT, HEADS, KV_HEADS, SCALE, check, draft_tree_mask, paged_cache,  # noqa: E402
                             time_us)
from kernels.decode_attention import decode_attention_op  # noqa: E402,F401  (registers the ops)
from kernels.mask_bits import pack_mask_bits  # noqa: E402
from kernels.split_kv_attention import split_kv_attention_reference, split_policy  # noqa: E402
from kernels.verify_attention import verify_attention_op  # noqa: E402,F401


def variants(bs: int, context: int) -> dict:
    """name -> a call of the op, each checked against the reference."""
    gen = torch.Generator().manual_seed(bs * 7 + context)
    slots = (bs * -(-context // 16) + 1) * 16
    k_pool, v_pool, table, _, _ = paged_cache(bs, context, 16, slots, gen)
    q1 = torch.randn(bs, HEADS, DIM, generator=gen).to("cuda", torch.bfloat16)
    q8 = torch.randn(bs * DRAFT, HEADS, DIM, generator=gen).to("cuda", torch.bfloat16)
    mask = draft_tree_mask(bs, gen)
    mask8, bits = mask.to(torch.uint8), pack_mask_bits(mask)
    rpi = torch.arange(bs, device="cuda")
    seq = torch.full((bs,), context, device="cuda")
    dpol, vpol = split_policy(torch.device("cuda"), 1), split_policy(torch.device("cuda"), DRAFT)
    verify = lambda m, b=None: lambda: torch.ops.tfs.verify_attention(  # noqa: E731
        q8, k_pool, v_pool, table, rpi, seq, m, DRAFT, SCALE, *vpol, b)
    calls = {
        "decode": lambda: torch.ops.tfs.decode_attention(q1, k_pool, v_pool, table, rpi, seq, SCALE, *dpol),
        "verify uint8": verify(mask8), "verify bits": verify(mask8, bits), "verify causal": verify(None),
    }
    ref = lambda q, m, q_len: split_kv_attention_reference(q, k_pool, v_pool, table, rpi, seq, m, q_len,  # noqa
                                                           SCALE)
    refs = {"decode": ref(q1, None, 1), "verify causal": ref(q8, None, DRAFT)}
    refs["verify uint8"] = refs["verify bits"] = ref(q8, mask, DRAFT)
    for name, call in calls.items():
        check(f"{name} {bs}x{context}", call(), refs[name])
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["1x1024", "1x4096", "1x32768", "32x4096", "64x32768"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; median us over {args.rounds} rounds")
    print("batch x context | decode | verify uint8 | verify bits | verify causal | uint8 / decode | bits / decode "
          "| bits / uint8")
    for config in args.configs:
        bs, context = (int(x) for x in config.split("x"))
        calls = variants(bs, context)
        repeat = 20 if bs * context < 1 << 20 else 2
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                times[name].append(time_us(call, repeat))
        t = {name: statistics.median(v) for name, v in times.items()}
        d, u, b = t["decode"], t["verify uint8"], t["verify bits"]
        print(f"{config} | {d:.1f} | {u:.1f} | {b:.1f} | {t['verify causal']:.1f} | {u / d:.3f} | {b / d:.3f} "
              f"| {b / u:.3f}", flush=True)
        del calls
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
