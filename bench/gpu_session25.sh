#!/usr/bin/env bash
# GPU leases of 2026-12-01 (nineteenth session), H200. Results: docs/PERFORMANCE.md, "Nineteenth session".
# The step's own kernels cut: tfs::lm_head (final norm + lm_head + float32 logits in one kernel, knob
# framework.models.llama.FUSED_LM_HEAD) and decode inputs staged by the scheduler into the graph's static buffers
# (no copy kernel in the forward). A/B against BASE ad86a5c (main before them) unpacked into old/:
#   mkdir old && git archive ad86a5c kernels bench framework conf train_free_serve.py | tar -x -C old
#   a: the kernels' GPU tests (lm_head, gemv, qkv_rope_store: gemv_tile's row gather), then the 8B step alternating
#      here / here without tfs::lm_head (A_KNOBS=0: not) / old, A_ROUNDS rounds (default 2), then each log's head /
#      layers / tail
#   c: (after the lm_head lost its row index) the lm_head's GPU tests and the compiled paths' main ones (logits against
#      transformers, compiled == eager, spec == plain, fused == unfused tokens, the PDL chain and ops, plain decoding
#      with PDL on / off), then one pair of 8B profiles, here and old
#   b: the compiled paths' GPU tests (logits against transformers, compiled == eager, spec == plain, PDL on / off
#      tokens with the tree verification, the PDL chain): not run (device time)
# Ran: a at 1c77e8a (tests; its profiles failed: inference tensors, fixed in 5d888ed / 40a2d2c), A_TESTS=0 a at
#   40a2d2c, A_KNOBS=0 A_ROUNDS=3 a at 2986b71 (with the embedding gather, reverted in b76b392), c at 24c19a9 (also
#   with it). Next session: A_TESTS=0 A_KNOBS=0 A_ROUNDS=3 a on the final code, then b (its tree test has not run
#   since the eighteenth session's fallback fix)
source "$(dirname "$0")/gpu_lease_env.sh"  # set -u, wheels, PYTHONPATH, TFS_TOKENIZER, OUT, gpu_tests, profile_8b
case "${1:-a}" in
  a) [ "${A_TESTS:-1}" = 0 ] || gpu_tests gpu_a.log 150 tests/test_kernels_lm_head.py tests/test_kernels_gemv.py tests/test_kernels_qkv_rope_store.py \
       -k "gpu and not fused_decode_same_tokens"
     for r in $(seq "${A_ROUNDS:-2}"); do
       profile_8b here.log 60 --floor
       [ "${A_KNOBS:-1}" = 0 ] || profile_8b nohead.log 60 --floor --set framework.models.llama.FUSED_LM_HEAD=False
       (cd old && PYTHONPATH=/tmp/site:$PWD profile_8b old.log 60 --floor)
     done
     for f in "$OUT"/here_*.log "$OUT"/old_*.log; do echo "$f: $(python3 bench/layer_times.py "$f" --ends | head -1)"; done ;;
  c) gpu_tests gpu_c.log 330 tests/test_kernels_lm_head.py tests/test_gpu.py tests/test_kernels_pdl.py \
       tests/test_kernels_gemv.py -k "lm_head or test_gpu or fused_decode_same_tokens or chain or ops_equal or (pdl_on_and_off and spec0)"
     profile_8b here.log 60 --floor
     (cd old && PYTHONPATH=/tmp/site:$PWD profile_8b old.log 60 --floor)
     for f in "$OUT"/here_*.log "$OUT"/old_*.log; do echo "$f: $(python3 bench/layer_times.py "$f" --ends | head -1)"; done ;;
  b) gpu_tests gpu_b.log "${B_LIMIT:-500}" tests/test_gpu.py tests/test_kernels_pdl.py \
       tests/test_kernels_gemv.py -k "not gemv_gpu and not odd_k and not cuda_graphs" ;;
esac
