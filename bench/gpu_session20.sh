#!/usr/bin/env bash
# GPU leases of 2026-12-01 (fourteenth session), H200. Usage: bash bench/gpu_session20.sh c
# Results: docs/PERFORMANCE.md, "Fourteenth session".
#   a (twice; run from branch exp/early-q, whose copy of this script has the case): EARLY_Q, the fused qkv kernel
#      signalling each KV head's q to the split-K decode, which attends to the older keys before its wait; GPU
#      tests, then the 8B step with and without it, alternating: slower, not on main
#   c: main after MERGE_CHUNK's removal: the GPU tests of the merge, decode / verify and the PDL ops and chain, then
#      the 8B step at the defaults, three runs
#   d (ran on a working tree of 50cdf36 whose knob was not kept, so the case left too): the partial kernel's
#      programs of unused split slots returning before the wait (kernels.split_kv_attention.EXIT_UNUSED_SPLITS,
#      an `if split >= n_splits: return`); the attention GPU tests, then the 8B step with and without it,
#      alternating: no faster
source "$(dirname "$0")/gpu_lease_env.sh"  # set -u, wheels, PYTHONPATH, TFS_TOKENIZER, OUT, gpu_tests, profile_8b

case "${1:-c}" in
  c) gpu_tests gpu_main.log 200 tests/test_kernels_pdl.py tests/test_kernels_attention.py \
       -k "ops_equal or chain or stale or decode_on_cuda or verify_on_cuda"
     for run in 1 2 3; do
       profile_8b profile_8b_c.log 60 --floor
     done ;;
esac
