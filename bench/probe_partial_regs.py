"""Registers and spills of the split-K partial kernel as the GPU's Triton compiles it: one batch-1 decode (1k keys,
Llama-3-8B attention shape, PDL and plain) and one 8-token verify with a packed causal-chain tree mask (the same, with
``--verify``) per ``--set`` configuration given, then every compiled variant's ``n_regs`` / ``n_spills`` and how many
programs of its warps fit an SM's 64K registers.

    python bench/probe_partial_regs.py --set "kernels.split_kv_attention.CUDA_LAUNCH.decode_small=(64,8,1)"
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kernels import split_kv_attention as ska  # noqa: E402
from kernels.decode_attention import decode_attention  # noqa: E402
from kernels.mask_bits import pack_mask_bits  # noqa: E402
from kernels.verify_attention import verify_attention  # noqa: E402
from knobs import add_set_option, apply_sets  # noqa: E402


def compiled_variants(fn) -> list:
    """The CompiledKernels a JITFunction holds (Triton 3.x keeps them per device)."""
    out = []
    for cache in getattr(fn, "device_caches", {}).values():
        table = cache[0] if isinstance(cache, tuple) else cache
        out.extend(table.values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_set_option(ap)
    ap.add_argument("--verify", action="store_true", help="also compile the 8-token verify tile")
    args = ap.parse_args()
    apply_sets(ap, args.set)
    heads, kv_heads, dim, context = 32, 8, 128, 1024
    q = torch.randn(1, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(context + 1, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.arange(1, context + 1, device="cuda")[None]
    rpi = torch.zeros(1, dtype=torch.int64, device="cuda")
    seq = torch.full((1,), context, device="cuda")
    policy = ska.split_policy(q.device, 1)
    for pdl in (False, True):
        decode_attention(q, k, v, table, rpi, seq, dim ** -0.5, *policy, pdl=pdl)
    torch.cuda.synchronize()
    decode_variants = {id(kernel) for kernel in compiled_variants(ska._split_kv_partial_kernel)}
    if args.verify:
        draft = 8
        qv = torch.randn(draft, heads, dim, device="cuda", dtype=torch.bfloat16)
        mask = torch.ones(draft, draft, device="cuda", dtype=torch.bool).tril()[None]  # [1, q_len, q_len]
        vpolicy = ska.split_policy(q.device, draft)
        for pdl in (False, True):
            verify_attention(qv, k, v, table, rpi, seq, mask, draft, dim ** -0.5, *vpolicy, pdl=pdl,
                             mask_bits=pack_mask_bits(mask))
    torch.cuda.synchronize()
    for kernel in compiled_variants(ska._split_kv_partial_kernel):
        warps = kernel.metadata.num_warps
        per_sm = 65536 // (-(-kernel.n_regs * 32 // 256) * 256 * warps)
        tile = "decode" if id(kernel) in decode_variants else "verify"
        print(f"partial kernel ({tile}): {kernel.n_regs} registers, {kernel.n_spills} spills, {warps} warps: "
              f"{per_sm} programs per SM by registers ({args.set or 'defaults'})")


if __name__ == "__main__":
    main()
