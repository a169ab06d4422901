#!/usr/bin/env bash
# GPU leases of 2026-12-01 (twelfth session), H200. Usage: bash bench/gpu_session18.sh a|...
# Results: docs/PERFORMANCE.md, "Twelfth session".
#   a: the Llama-3-8B-shaped decode step (batch 1, context 1k), attention=triton, every kernel of one forward in order
#   b: PDL gemvs that load their first weight chunk into registers before the wait (kernels.gemv.PDL_PRELOAD): the
#      PDL op and chain tests with it on, then the 8B step with it off / on, alternating (lease b ran the knob as
#      one switch, before it took launch classes)
#   c: the same with the knob per launch class: none / qkv and down / qkv, down and gate_up, alternating
#   d: the merge kernel lets o_proj launch before its wait (kernels.split_kv_attention.MERGE_EARLY_TRIGGER) so that
#      o_proj's programs load their first weight chunk while the partial kernel runs, against qkv and down preloading
#   e: around d's best (merge early trigger, qkv / down / o_proj preloading, o_proj at (8, 1024, 4, 3)): o_proj's
#      launch, gate_up preloading too, down not preloading; the first and last run also measure the HBM floor
#   f: e's best (e0 below) with other gemv launches for qkv (wide), gate_up (very_wide) and down (tall)
#   g: the defaults now (e0 above): the 8B step with its floor, then the GPU tests of the PDL path
source "$(dirname "$0")/gpu_lease_env.sh"  # set -u, wheels, PYTHONPATH, TFS_TOKENIZER, OUT, gpu_tests
case "${1:-a}" in
  a) timeout 300 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 400 \
       -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v -i "warn\|DEBUG" \
       > "$OUT/profile_8b_full.log"; grep -v "^ *[0-9.]* | " "$OUT/profile_8b_full.log" | tail -40 ;;
  b) timeout 200 python3 -c "import kernels.gemv as g, pytest, sys; g.PDL_PRELOAD = tuple(g.CUDA_LAUNCH); \
       sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', 'tests/test_kernels_pdl.py', \
       '-k', 'ops_equal or chain']))" 2>&1 | tail -3
     all="('tall','square','wide','very_wide','vocab','rows')"
     i=0; for v in "()" "$all" "()" "$all"; do i=$((i + 1))
       timeout 150 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 400 \
         --set "kernels.gemv.PDL_PRELOAD=$v" -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 \
         | grep -v -i "warn\|DEBUG" > "$OUT/profile_8b_preload_$i.log"
       echo "PDL_PRELOAD=$v: $(grep 'GPU span' "$OUT/profile_8b_preload_$i.log")"
     done ;;
  c) for v in "()" "('wide','tall')" "('wide','tall','very_wide')" "()" "('wide','tall')" \
       "('wide','tall','very_wide')"; do
       timeout 150 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 400 \
         --set "kernels.gemv.PDL_PRELOAD=$v" -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 \
         | grep -v -i "warn\|DEBUG" > "$OUT/profile_8b_c.log"
       echo "PDL_PRELOAD=$v: $(grep 'GPU span' "$OUT/profile_8b_c.log")"
       python3 bench/layer_times.py "$OUT/profile_8b_c.log"
     done ;;
  d) base="kernels.gemv.PDL_PRELOAD=('wide','tall')"
     early="kernels.split_kv_attention.MERGE_EARLY_TRIGGER=True"
     for sets in "$base" "$early kernels.gemv.PDL_PRELOAD=('wide','tall','square')" "$early $base" \
       "$early kernels.gemv.PDL_PRELOAD=('wide','tall','square') kernels.gemv.CUDA_LAUNCH.square=(8,1024,4,3)" \
       "$base" "$early kernels.gemv.PDL_PRELOAD=('wide','tall','square')"; do
       # shellcheck disable=SC2086  # one --set argument per word
       timeout 150 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 400 \
         --set $sets -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 \
         | grep -v -i "warn\|DEBUG" > "$OUT/profile_8b_d.log"
       echo "$sets: $(grep 'GPU span' "$OUT/profile_8b_d.log")"
       python3 bench/layer_times.py "$OUT/profile_8b_d.log"
     done ;;
  e) e0="kernels.split_kv_attention.MERGE_EARLY_TRIGGER=True kernels.gemv.CUDA_LAUNCH.square=(8,1024,4,3)"
     pre="kernels.gemv.PDL_PRELOAD=('wide','tall','square')"
     for sets in "--floor --set $e0 $pre" "--set $e0 $pre kernels.gemv.CUDA_LAUNCH.square=(4,1024,4,3)" \
       "--set $e0 $pre kernels.gemv.CUDA_LAUNCH.square=(8,2048,4,3)" \
       "--set $e0 kernels.gemv.PDL_PRELOAD=('wide','tall','square','very_wide')" \
       "--set $e0 kernels.gemv.PDL_PRELOAD=('wide','square')" "--floor --set $e0 $pre"; do
       # shellcheck disable=SC2086  # one argument per word
       timeout 150 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 400 \
         $sets -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 \
         | grep -v -i "warn\|DEBUG" > "$OUT/profile_8b_e.log"
       echo "$sets: $(grep 'GPU span' "$OUT/profile_8b_e.log" | cut -c1-90)"; grep "HBM floor" "$OUT/profile_8b_e.log"
       python3 bench/layer_times.py "$OUT/profile_8b_e.log" | tail -2
     done ;;
  f) e0="kernels.split_kv_attention.MERGE_EARLY_TRIGGER=True kernels.gemv.CUDA_LAUNCH.square=(8,1024,4,3)"
     e0="$e0 kernels.gemv.PDL_PRELOAD=('wide','tall','square')"
     for alt in "" "wide=(8,1024,4,3)" "wide=(16,512,4,3)" "very_wide=(16,1024,4,3)" "very_wide=(4,1024,4,3)" \
       "very_wide=(8,512,4,3)" "tall=(16,1024,4,3)" "tall=(8,2048,4,3)" "tall=(4,1024,4,3)" ""; do
       # shellcheck disable=SC2086  # one argument per word
       timeout 100 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 400 \
         --set $e0 ${alt:+kernels.gemv.CUDA_LAUNCH.$alt} -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 \
         | grep -v -i "warn\|DEBUG" > "$OUT/profile_8b_f.log"
       echo "e0 ${alt:-}: $(grep 'GPU span' "$OUT/profile_8b_f.log" | cut -c70-90)"
       python3 bench/layer_times.py "$OUT/profile_8b_f.log" | tail -2 | head -1
     done ;;
  g) timeout 80 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 400 \
       --floor -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v -i "warn\|DEBUG" \
       > "$OUT/profile_8b_g.log"
     grep "GPU span\|HBM floor" "$OUT/profile_8b_g.log" | cut -c1-120; python3 bench/layer_times.py "$OUT/profile_8b_g.log"
     gpu_tests gpu_pdl.log 200 tests/test_kernels_pdl.py tests/test_kernels_attention.py \
       tests/test_attention_backends.py -k "pdl or stale or tree_speculation_through_triton"
     gpu_tests gpu_gemv.log 100 tests/test_kernels_gemv.py ;;
esac
