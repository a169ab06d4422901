#!/usr/bin/env bash
# GPU leases of 2026-12-01 (eleventh session), H200. Usage: bash bench/gpu_session17.sh a|b|c|d|e|f
# Results: docs/PERFORMANCE.md, "Eleventh session". Leases a and b ran at 3df4f7c (the packed mask's word loaded at
# the start of each program's checked tail), which is the kernel kept; lease d ran at e826e5e (the word loaded in the
# prologue, only by programs whose keys reach the mask), which was slower and reverted: re-running d now measures
# the kept kernel.
#   a: verify reading the tree mask as packed bits (pack_mask_bits) against bytes, same lease (bench/ab_verify_mask.py);
#      then the split-K kernel's GPU tests, compiled ones included
#   b: the issue's table (bench/bench_attention.py: verify with the mask as attention=triton passes it, bits)
#   c: the PDL ops and the backends on the GPU, and lossless speculation (tree verify) through attention=triton
#   d: a and b's timings again (the A/B, then the issue's table)
#   e: the Llama-3-8B-shaped decode step (batch 1, context 1k) under reduce-overhead with attention=triton
#   f: the GPU tests of the review fixes
source "$(dirname "$0")/gpu_lease_env.sh"  # set -u, wheels, PYTHONPATH, TFS_TOKENIZER, OUT, gpu_tests
case "${1:-a}" in
  a) timeout 200 python3 bench/ab_verify_mask.py 2>&1 | tee "$OUT/ab_verify_mask.log"
     gpu_tests gpu_kernels.log 330 tests/test_kernels_attention.py ;;
  b) timeout 330 python3 bench/bench_attention.py 2>&1 | tee "$OUT/bench_attention.log" | grep -v "^page"
     timeout 200 python3 bench/ab_verify_mask.py --rounds 5 --configs 1x4096 1x32768 2>&1 \
       | tee "$OUT/ab_verify_mask2.log" ;;
  c) gpu_tests gpu_pdl_backends.log 420 tests/test_kernels_pdl.py \
       "tests/test_attention_backends.py::test_backend_matches_reference_on_cuda" \
       "tests/test_attention_backends.py::test_greedy_equals_sdpa_on_cuda[triton-reduce_overhead]" \
       "tests/test_attention_backends.py::test_bf16_compiled_agrees_with_sdpa_on_cuda[triton]"
     gpu_tests gpu_spec.log 150 tests/test_attention_backends.py -k tree_speculation_through_triton ;;
  d) timeout 200 python3 bench/ab_verify_mask.py 2>&1 | tee "$OUT/ab_verify_mask3.log"
     timeout 330 python3 bench/bench_attention.py 2>&1 | tee "$OUT/bench_attention2.log" | grep -v "^page" ;;
  e) timeout 200 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 0 \
       -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v -i "warn\|DEBUG" \
       | tee "$OUT/profile_8b.log" ;;
  f) # after the review (kernels/mask_bits.py: the packing in two kernels; the verify kernel given an all-zero byte
     # mask beside the words; a mask over 64 keys through the backend): the tests that cover it
     gpu_tests gpu_review.log 300 tests/test_kernels_attention.py tests/test_kernels_pdl.py \
       tests/test_attention_backends.py -k "verify_on_cuda or opcheck or pdl_ops or tree_speculation \
       or (triton and (over_64 or verify_tree))" ;;
esac
