"""Compile the split-K partial kernel for sm_90 without a GPU (Triton's CUDA backend only) and print its register
use and, after the PDL wait, the order of its global loads, shared-memory conversions and MMAs: where a decode
program's memory round trips follow one another. The local Triton may differ from the GPU machine's (the H200's
numbers: bench/probe_partial_regs.py).

    python bench/partial_sass.py                # batch-1 decode tile (Llama-3-8B attention), with the JIT's hints
    python bench/partial_sass.py --no-hints     # without the divisibility hints: scalar loads, 255 registers
    python bench/partial_sass.py --q-len 8      # a verify over 8 tokens with the packed tree mask
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kernels.split_kv_attention import _split_kv_partial_kernel as KERNEL  # noqa: E402

POINTERS = {"Q": "*bf16", "K_cache": "*bf16", "V_cache": "*bf16", "Req_to_token": "*i64",
            "Req_pool_indices": "*i64", "Seq_lens": "*i64", "Mask": "*i64", "Mid_o": "*fp32", "Mid_lse": "*fp32"}
# integer arguments the JIT would see as multiples of 16 at this shape (batch 1, 32 / 8 heads, head_dim 128, 64
# split slots, 4096-wide request rows): it gives them tt.divisibility=16, which lets K / V loads vectorise
DIVISIBLE = {"stride_qt", "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "stride_req", "stride_ot",
             "stride_oh", "stride_os", "stride_lt", "stride_lh", "max_splits", "target_programs", "min_split_len"}
SHOWN = re.compile(r"LDG|STG|STS|LDSM|HMMA|BAR|ACQBULK|PREEXIT|CCTL|STL|LDL")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--q-len", type=int, default=1, help="1: decode (64-key tiles); more: verify (128-key tiles)")
    ap.add_argument("--no-hints", action="store_true", help="compile without the JIT's divisibility hints")
    ap.add_argument("--no-pdl", action="store_true")
    args = ap.parse_args()
    verify = args.q_len > 1
    consts = dict(Q_LEN=args.q_len, GROUP=4, HEAD_DIM=128, M_BLOCKS=1, BLOCK_M=32 if verify else 16,
                  BLOCK_N=128 if verify else 64, BLOCK_D=128, HAS_MASK=verify, MASK_BITS=verify, IEEE_DOT=False,
                  USE_PDL=not args.no_pdl, LINE=64)
    names = KERNEL.arg_names
    sig = {n: "constexpr" if n in consts else POINTERS.get(n, "fp32" if n == "scale_log2e" else "i32") for n in names}
    attrs = {} if args.no_hints else {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                                      if n in POINTERS or n in DIVISIBLE}
    compiled = triton.compile(ASTSource(fn=KERNEL, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=1))
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", f.name],
                              capture_output=True, text=True, check=True).stdout
    print(next(line.strip() for line in usage.splitlines() if "REG:" in line), f"(Triton {triton.__version__})")
    lines = sass.splitlines()
    start = next((i for i, line in enumerate(lines) if "ACQBULK" in line), 0)  # the PDL wait
    for line in lines[start:]:
        if SHOWN.search(line):
            print(" ".join(line.split())[:110])


if __name__ == "__main__":
    main()
