"""Compile the split-K partial kernel for sm_90 without a GPU (Triton's CUDA backend only) and print its register
use and, after the PDL wait, the order of its global loads, shared-memory conversions and MMAs: where a decode
program's memory round trips follow one another. The local Triton may differ from the GPU machine's (there, a
compiled kernel's ``n_regs`` and ``n_spills`` give the register count).

    python bench/partial_sass.py                # batch-1 decode tile (Llama-3-8B attention), with the JIT's hints
    python bench/partial_sass.py --no-hints     # without the divisibility hints: scalar loads, 255 registers
    python bench/partial_sass.py --q-len 8      # a verify over 8 tokens with the packed tree mask

``--kernel merge | gemv | qkv | lm_head | gemv_vocab | gate_up | down`` does the same for the split-K merge (a
verify's, plain launch), ``tfs::gemv`` with a residual (o_proj's PDL launch), ``tfs::qkv_rope_store`` (PDL),
``tfs::lm_head``, the same product through ``tfs::gemv`` and gate_up's launch (both with the RMSNorm after the
product) and down_proj's (SiLU-mul, residual), printing every global load and store, shared-memory store / matrix
load and barrier (with ``--no-pdl``, from the start): where a load of what the epilogue needs sits against the
weight loop, and whether the loop converts the weight tile's layout through shared memory. ``--launch
BLOCK_N,BLOCK_K,WARPS,STAGES`` compiles another launch of those kernels; ``--rows M`` compiles them for M rows of x
as their launches would (``BLOCK_M``, ``LATE_NORM``, no preload: :func:`tfs_kernels.gemv.block_rows`; with ``--set
tfs_kernels.gemv.ROWS_DOT=False``, the CUDA-core tile); ``--ttgir`` also prints the layout conversions Triton
inserted (``ttg.convert_layout``).
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

from knobs import add_set_option, apply_sets  # noqa: E402
import tfs_kernels.gemv as gemv_module  # noqa: E402
from tfs_kernels.gemv import _gemv_kernel, stream_hints  # noqa: E402
from tfs_kernels.lm_head import _lm_head_kernel  # noqa: E402
from tfs_kernels.qkv_rope_store import _qkv_rope_store_kernel  # noqa: E402
from tfs_kernels.split_kv_attention import _split_kv_partial_kernel as KERNEL  # noqa: E402
from tfs_kernels.split_kv_merge import split_kv_merge_kernel  # noqa: E402

POINTERS = {"Q": "*bf16", "K_cache": "*bf16", "V_cache": "*bf16", "Req_to_token": "*i64",
            "Req_pool_indices": "*i64", "Seq_lens": "*i64", "Mask": "*i64", "Mid_o": "*fp32", "Mid_lse": "*fp32"}
# integer arguments the JIT would see as multiples of 16 at this shape (batch 1, 32 / 8 heads, head_dim 128, 64
# split slots, 4096-wide request rows): it gives them tt.divisibility=16, which lets K / V loads vectorise
DIVISIBLE = {"stride_qt", "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "stride_req", "stride_ot",
             "stride_oh", "stride_os", "stride_lt", "stride_lh", "max_splits", "target_programs", "min_split_len"}
# the other kernels: (kernel, pointer types, constexprs, num_warps, num_stages), Llama-3-8B shapes at one row
OTHERS = {
    "merge": (split_kv_merge_kernel, {"Mid_o": "*fp32", "Mid_lse": "*fp32", "Out": "*bf16", "Seq_lens": "*i64"},
              dict(Q_LEN=8, HEAD_DIM=128, BLOCK_D=128, BLOCK_S=32, USE_PDL=False, EARLY_TRIGGER=False), 2, 1),
    "gemv": (_gemv_kernel, {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "R": "*bf16", "NW": "*bf16"},
             dict(NORM=False, SILU_MUL=False, HAS_RESIDUAL=True, BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, EVEN_K=True,
                  IEEE_DOT=False, LATE_NORM=False, USE_PDL=True, PREFETCH_K=512, PRELOAD=True), 4, 3),
    # the lm_head's launch class ("vocab") with the final norm: tfs::lm_head, and tfs::gemv as the same product
    "lm_head": (_lm_head_kernel, {"X": "*bf16", "W": "*bf16", "NW": "*bf16", "Logits": "*fp32", "Hidden": "*bf16"},
                dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=256, EVEN_K=True, IEEE_DOT=False, LATE_NORM=True, USE_PDL=True,
                     PREFETCH_K=512), 4, 3),
    # gate_up's launch class ("very_wide") with its RMSNorm after the product, as the 8B decode step launches it
    "gate_up": (_gemv_kernel, {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "R": "*bf16", "NW": "*bf16"},
                dict(NORM=True, SILU_MUL=False, HAS_RESIDUAL=False, BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, EVEN_K=True,
                     IEEE_DOT=False, LATE_NORM=True, USE_PDL=True, PREFETCH_K=1024, PRELOAD=False), 4, 3),
    # down_proj's PDL launch: SiLU-mul of [gate | up] in, the residual added
    "down": (_gemv_kernel, {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "R": "*bf16", "NW": "*bf16"},
             dict(NORM=False, SILU_MUL=True, HAS_RESIDUAL=True, BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, EVEN_K=True,
                  IEEE_DOT=False, LATE_NORM=False, USE_PDL=True, PREFETCH_K=512, PRELOAD=True), 4, 3),
    "gemv_vocab": (_gemv_kernel, {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "R": "*bf16", "NW": "*bf16"},
                   dict(NORM=True, SILU_MUL=False, HAS_RESIDUAL=False, BLOCK_M=1, BLOCK_N=16,
                        BLOCK_K=256, EVEN_K=True, IEEE_DOT=False, LATE_NORM=True, USE_PDL=True, PREFETCH_K=512,
                        PRELOAD=False), 4, 3),
    "qkv": (_qkv_rope_store_kernel, {"X": "*bf16", "W": "*bf16", "NW": "*bf16", "Cos": "*fp32", "Sin": "*fp32",
                                     "Positions": "*i64", "K_cache": "*bf16", "V_cache": "*bf16", "Slots": "*i64",
                                     "Q_out": "*bf16"},
            dict(HEADS=32, KV_HEADS=8, HEAD_DIM=128, HALF=64, NORM=True, BLOCK_M=1, BLOCK_N=8, BLOCK_K=512,
                 EVEN_K=True, IEEE_DOT=False, LATE_NORM=True, USE_PDL=True, PREFETCH_K=512, PRELOAD=True), 4, 3),
}
SHOWN_OTHERS = re.compile(r"LDG|STG|STS|LDSM|ACQBULK|PREEXIT|BRA|BAR|\.L_")
SHOWN = re.compile(r"LDG|STG|STS|LDSM|HMMA|BAR|ACQBULK|PREEXIT|CCTL|STL|LDL")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--q-len", type=int, default=1, help="1: decode (64-key tiles); more: verify (128-key tiles)")
    ap.add_argument("--no-hints", action="store_true", help="compile without the JIT's divisibility hints")
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--kernel", default="partial", choices=["partial", *OTHERS])
    ap.add_argument("--launch", metavar="BLOCK_N,BLOCK_K,WARPS,STAGES",
                    help="another launch of a gemv-family kernel (gemv, gate_up, down, lm_head, gemv_vocab, qkv)")
    ap.add_argument("--rows", type=int, default=1,
                    help="rows of x for a gemv-family kernel (BLOCK_M and LATE_NORM as its launch would set them)")
    ap.add_argument("--ttgir", action="store_true", help="also print the TTGIR's layout conversions")
    add_set_option(ap)  # e.g. tfs_kernels.gemv.WEIGHT_EVICT_FIRST=True (the weight stream's L2 hints)
    args = ap.parse_args()
    apply_sets(ap, args.set)
    if args.kernel != "partial":
        fn, pointers, consts, warps, stages = OTHERS[args.kernel]
        if args.launch:
            if "BLOCK_K" not in consts or args.kernel == "merge":
                ap.error(f"--launch: not for --kernel {args.kernel}")
            block_n, block_k, warps, stages = (int(v) for v in args.launch.split(","))
            consts = {**consts, "BLOCK_N": block_n, "BLOCK_K": block_k}
        if "PREFETCH_K" in consts:  # the gemv family: the weight stream's L2 hints, as tfs_kernels/gemv.py sets them
            consts = {**stream_hints(), **consts}
        if args.rows > 1:
            if "BLOCK_M" not in consts:
                ap.error(f"--rows: not for --kernel {args.kernel}")
            norm = consts.get("NORM", True)  # tfs::lm_head always has its RMSNorm
            consts = {**consts, "BLOCK_M": gemv_module.block_rows(args.rows),
                      "LATE_NORM": gemv_module.late_norm(args.rows, norm)}
            if "PRELOAD" in consts:  # the several-row launch classes do not preload (PDL_PRELOAD)
                consts["PRELOAD"] = False
        if "USE_PDL" in consts and args.no_pdl:
            consts = {**consts, "USE_PDL": False, "PRELOAD": False}
        sig = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n == "eps" else "i32")
               for n in fn.arg_names}
        hinted = {n for n in fn.arg_names if n in pointers or n.startswith("stride") or n in ("N", "K", "max_splits")}
        attrs = {} if args.no_hints else {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                                          if n in hinted}
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
        if args.ttgir:
            for line in compiled.asm["ttgir"].splitlines():
                if "convert_layout" in line:
                    print(" ".join(line.split())[:160])
        show(compiled, SHOWN_OTHERS, from_wait=False)
        return
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
    show(compiled, SHOWN, from_wait=True)


def show(compiled, shown: re.Pattern, from_wait: bool) -> None:
    """Print the cubin's registers and its SASS lines matching ``shown`` (from the PDL wait on, with
    ``from_wait``)."""
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
    start = next((i for i, line in enumerate(lines) if "ACQBULK" in line), 0) if from_wait else 0
    for line in lines[start:]:
        if shown.search(line):
            print(" ".join(line.split())[:110])


if __name__ == "__main__":
    main()
