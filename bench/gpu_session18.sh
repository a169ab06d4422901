#!/usr/bin/env bash
# GPU leases of 2026-12-01 (twelfth session), H200. Usage: bash bench/gpu_session18.sh a|b|c|d|e|f|g
# Results: docs/PERFORMANCE.md, "Twelfth session". Leases a-f ran before commit 1987b22 made the kept configuration
# (o_proj launched before the merge's wait, qkv / o / down preloading, o_proj at (8, 1024, 4, 3)) the default; here
# each run sets every knob it measured, from "$before" (the code before), so that a re-run measures the same thing.
#   a: the Llama-3-8B-shaped decode step (batch 1, context 1k), attention=triton, every kernel of one forward in order
#   b: PDL gemvs that load their first weight chunk into registers before the wait (kernels.gemv.PDL_PRELOAD): the
#      PDL op and chain tests with it on, then the 8B step with it off / on in every launch class, alternating
#   c: the knob per launch class: none / qkv and down / qkv, down and gate_up, alternating
#   d: the merge kernel lets o_proj launch before its wait (kernels.split_kv_merge.MERGE_EARLY_TRIGGER) so that
#      o_proj's programs load their first weight chunk while the partial kernel runs, against qkv and down preloading
#   e: around d's best: o_proj's launch, gate_up preloading too, down not preloading; each run also measures the HBM
#      floor (in the lease only the first and the last did)
#   f: e's best with other gemv launches for qkv (wide), gate_up (very_wide) and down (tall)
#   g: the defaults at 1987b22 (e's best): the 8B step with its floor, then the GPU tests of the PDL path
#   h: (not run yet) the GPU tests lease g ran out of time for, and those the review after it added
source "$(dirname "$0")/gpu_lease_env.sh"  # set -u, wheels, PYTHONPATH, TFS_TOKENIZER, OUT, gpu_tests, profile_8b

before="kernels.split_kv_merge.MERGE_EARLY_TRIGGER=False kernels.gemv.CUDA_LAUNCH.square=(16,1024,4,4)"
kept="kernels.split_kv_merge.MERGE_EARLY_TRIGGER=True kernels.gemv.CUDA_LAUNCH.square=(8,1024,4,3)"
kept="$kept kernels.gemv.PDL_PRELOAD=('wide','tall','square')"
# shellcheck disable=SC2086  # below, $before / $kept / $sets: one --set argument per word
case "${1:-a}" in
  a) profile_8b profile_8b_full.log 300 --set $before "kernels.gemv.PDL_PRELOAD=()"
     grep -v "^ *[0-9.]* | " "$OUT/profile_8b_full_1.log" | tail -40 ;;
  b) timeout 200 python3 -c "import kernels.gemv as g, pytest, sys; g.PDL_PRELOAD = tuple(g.CUDA_LAUNCH); \
       sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', 'tests/test_kernels_pdl.py', \
       '-k', 'ops_equal or chain']))" 2>&1 | tail -3
     all="('tall','square','wide','very_wide','vocab','rows')"
     for v in "()" "$all" "()" "$all"; do
       profile_8b profile_8b_preload.log 150 --set $before "kernels.gemv.PDL_PRELOAD=$v"
     done ;;
  c) for v in "()" "('wide','tall')" "('wide','tall','very_wide')" "()" "('wide','tall')" \
       "('wide','tall','very_wide')"; do
       profile_8b profile_8b_c.log 150 --set $before "kernels.gemv.PDL_PRELOAD=$v"
     done ;;
  d) base="kernels.gemv.PDL_PRELOAD=('wide','tall')"
     early="kernels.split_kv_merge.MERGE_EARLY_TRIGGER=True"
     for sets in "$before $base" "$before $early kernels.gemv.PDL_PRELOAD=('wide','tall','square')" \
       "$before $early $base" "$kept" "$before $base" \
       "$before $early kernels.gemv.PDL_PRELOAD=('wide','tall','square')"; do
       profile_8b profile_8b_d.log 150 --set $sets
     done ;;
  e) for sets in "$kept" "$kept kernels.gemv.CUDA_LAUNCH.square=(4,1024,4,3)" \
       "$kept kernels.gemv.CUDA_LAUNCH.square=(8,2048,4,3)" \
       "$kept kernels.gemv.PDL_PRELOAD=('wide','tall','square','very_wide')" \
       "$kept kernels.gemv.PDL_PRELOAD=('wide','square')" "$kept"; do
       profile_8b profile_8b_e.log 150 --floor --set $sets
     done ;;
  f) for alt in "" "wide=(8,1024,4,3)" "wide=(16,512,4,3)" "very_wide=(16,1024,4,3)" "very_wide=(4,1024,4,3)" \
       "very_wide=(8,512,4,3)" "tall=(16,1024,4,3)" "tall=(8,2048,4,3)" "tall=(4,1024,4,3)" ""; do
       profile_8b profile_8b_f.log 100 --set $kept ${alt:+kernels.gemv.CUDA_LAUNCH.$alt}
     done ;;
  g) profile_8b profile_8b_g.log 80 --floor
     gpu_tests gpu_pdl.log 200 tests/test_kernels_pdl.py tests/test_kernels_attention.py \
       tests/test_attention_backends.py -k "pdl or stale or tree_speculation_through_triton"
     gpu_tests gpu_gemv.log 100 tests/test_kernels_gemv.py ;;
  h) gpu_tests gpu_pdl_ops.log 200 tests/test_kernels_pdl.py tests/test_kernels_attention.py \
       -k "ops_equal or chain or stale"
     gpu_tests gpu_pdl_models.log 350 tests/test_kernels_pdl.py tests/test_attention_backends.py \
       -k "model_tokens or tree_speculation_through_triton" ;;
esac
