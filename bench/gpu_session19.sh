#!/usr/bin/env bash
# GPU leases of 2026-12-01 (thirteenth session), H200. Usage: bash bench/gpu_session19.sh a|b|c|d|e
# Results: docs/PERFORMANCE.md, "Thirteenth session".
#   a: the GPU tests of the PDL path that the twelfth session did not run (its lease script's h), and the gemv tests
#   b: the L2 prefetch window before a PDL gemv's wait, per launch class (kernels.gemv.PDL_PREFETCH_K, 512 in every
#      class before): o_proj (square) prefetches while the attention runs and HBM is nearly idle; the 8B step with
#      its floor at each setting, the defaults first and last
#   c: b's best (gate_up's window 1024, the default since) against the defaults before, alternating
#   (b and c ran before gate_up's 1024 became the default, 90574bb: they set the 512 of the time first)
#   d, e: below
#   f (ran in the fourteenth session at 142c8c8; its knob was removed after it, with the case): the merge reading
#      only the used splits, 16 at a time (kernels.split_kv_merge.MERGE_CHUNK=16, off then), its GPU tests and the
#      8B step against the defaults, alternating, then with TARGET_PROGRAMS_PER_SM.decode=2 too: slower
#      (docs/PERFORMANCE.md, fourteenth session)
source "$(dirname "$0")/gpu_lease_env.sh"  # set -u, wheels, PYTHONPATH, TFS_TOKENIZER, OUT, gpu_tests, profile_8b

case "${1:-a}" in
  a) gpu_tests gpu_pdl_ops.log 150 tests/test_kernels_pdl.py tests/test_kernels_attention.py \
       -k "ops_equal or chain or stale"
     gpu_tests gpu_pdl_models.log 300 tests/test_kernels_pdl.py tests/test_attention_backends.py \
       -k "model_tokens or tree_speculation_through_triton"
     gpu_tests gpu_gemv.log 100 tests/test_kernels_gemv.py ;;
  b) pf=kernels.gemv.PDL_PREFETCH_K  # every run from the windows of the time (512 in every class; later --set wins)
     for sets in "" "$pf.square=1024" "$pf.square=2048" "$pf.square=4096" "$pf.very_wide=1024" \
       "$pf.very_wide=2048" "$pf.wide=1024" "$pf.tall=1024" ""; do
       profile_8b profile_8b_b.log 75 --floor --set $pf.very_wide=512 $sets
     done ;;
  c) pf=kernels.gemv.PDL_PREFETCH_K  # b's best (gate_up's window 1024) against the defaults then (512), alternating
     for sets in "" "$pf.very_wide=1024" "" "$pf.very_wide=1024" "" "$pf.very_wide=1024" \
       "$pf.very_wide=1024 $pf.square=1024" "$pf.very_wide=1024 $pf.tall=1024"; do
       profile_8b profile_8b_c.log 75 --floor --set $pf.very_wide=512 $sets
     done ;;
  d) sk=kernels.split_kv_attention  # the defaults with gate_up's window 1024, and the split-K decode's grid: fewer
     # programs per SM (a smaller grid and merge block) or longer splits, against the defaults; then the GPU test
     # lease a ran out of time for
     for sets in "" "$sk.TARGET_PROGRAMS_PER_SM.decode=2" "$sk.TARGET_PROGRAMS_PER_SM.decode=1" \
       "$sk.MIN_SPLIT_LEN=128" "" "$sk.TARGET_PROGRAMS_PER_SM.decode=2"; do
       profile_8b profile_8b_d.log 75 --floor ${sets:+--set $sets}
     done
     gpu_tests gpu_tree.log 300 tests/test_attention_backends.py -k "tree_speculation_through_triton and reduce" ;;
  e) # gate_up's launch (very_wide) in the 8B step: its 56-57 us per layer are 4.2 TB/s, where lm_head streams at
     # 4.4-4.5; launches the twelfth session's lease f did not try
     for alt in "" "(16,512,4,3)" "(16,256,4,3)" "(8,1024,4,4)" "(8,1024,8,3)" "(32,256,4,3)" ""; do
       profile_8b profile_8b_e.log 70 --floor ${alt:+--set kernels.gemv.CUDA_LAUNCH.very_wide=$alt}
     done ;;
esac
