#!/usr/bin/env bash
# GPU leases of 2026-12-01 (ninth session), H200. Usage: bash bench/gpu_session15.sh a|b|c|d|e|f|g
# None of the measured variants was faster; none is on main (docs/PERFORMANCE.md, ninth session).
#   a (on branch exp/merge-early-trigger, commit 70328b4 after its rebase onto main): bash bench/gpu_session14.sh a
#      (the merge kernel lets o_proj launch before its wait; o_proj's prefetch depth 1024 / 2048 / 4096 columns)
#   b: the persistent one-row gemv in the 32-layer chain, 1-4 programs per SM (lease b ran a first version of the
#      probe that loaded the residual inside the row block's epilogue branch; c and later load it before the branch)
#   c: the same at 2, 4, 6 and 8 programs per SM
#   d: the gemv with TMA weight loads through a pipelined shared-memory ring: per-shape sweep and the chain
#   f: the split policy's programs per SM for a verify at small batch (2, 3, 4), lease f
#   g (on branch exp/merge-early-trigger): o_proj at (8, 1024, 4, 3) with gate_up ("very_wide") prefetching 2048 /
#      4096 columns, against the unchanged step
#   e: the GPU test suite (the files with GPU tests; test_server*.py need the openai package, which the image lacks),
#      in two calls: the first ran out of its 560 s after 76 tests, the second ran the remaining 17
source "$(dirname "$0")/gpu_lease_env.sh"  # set -u, wheels, PYTHONPATH, TFS_TOKENIZER, OUT, gpu_tests
case "${1:-a}" in
  a) bash "$(dirname "$0")/gpu_session14.sh" a ;;
  b) timeout 400 python3 bench/probe_persistent_gemv.py --per-sm 1 2 3 4 2>&1 | tee "$OUT/probe_persistent.log" ;;
  c) timeout 400 python3 bench/probe_persistent_gemv.py --per-sm 2 4 6 8 2>&1 | tee "$OUT/probe_persistent2.log" ;;
  d) timeout 560 python3 bench/probe_tma_gemv.py 2>&1 | tee "$OUT/probe_tma.log" ;;
  f) timeout 300 python3 bench/tune_split_kv.py --configs 1x1024 1x4096 1x32768 8x4096 --block-n 64 128 --warps 4 \
       --stages 1 --targets 2 3 4 --min-split-lens 64 --sweep-at 4 64 2>&1 | tee "$OUT/tune_split_targets.log" ;;
  g) for arg in "" "very_wide=2048" "very_wide=4096"; do
       extra=(); [ -n "$arg" ] && extra=(--gemv-launch square=8,1024,4,3 --set "kernels.gemv.PDL_PREFETCH_K_BY_CLASS.$arg")
       timeout 75 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 12 \
         "${extra[@]}" -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -E "^GPU span"
     done ;;
  e) GPU_FILES="tests/test_kernels_attention.py tests/test_kernels_pdl.py tests/test_gpu.py
       tests/test_kernels_qkv_rope_store.py tests/test_kernels_rope_store.py tests/test_fill_bonus_tokens.py
       tests/test_attention_backends.py tests/test_kernels_gemv.py"
     # shellcheck disable=SC2086
     gpu_tests gpu_all.log 1200 $GPU_FILES ;;
esac
