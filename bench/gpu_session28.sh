#!/usr/bin/env bash
# GPU leases of 2026-12-02 (twenty-third session), H200. Results: docs/PERFORMANCE.md, "Twenty-third session".
# The weight stream's loads at L2's evict-first priority became main's default (kernels/gemv.py WEIGHT_EVICT_FIRST,
# measured first with bench/gpu_session27.sh a and b on branch exp/stream-evict):
#   a: the clocks, the gemv / lm_head / qkv kernels' GPU tests, then the 8B step A_ROUNDS times (default 2)
#   b: the compiled paths' GPU tests (logits against transformers, compiled == eager, spec == plain, staged inputs)
source "$(dirname "$0")/gpu_lease_env.sh"  # set -u, wheels, PYTHONPATH, TFS_TOKENIZER, OUT, gpu_tests, profile_8b
case "${1:-a}" in
  a) nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit,driver_version --format=csv \
       | tee "$OUT/clocks.csv"
     gpu_tests gpu_a.log "${A_LIMIT:-200}" tests/test_kernels_lm_head.py tests/test_kernels_gemv.py \
       tests/test_kernels_qkv_rope_store.py -k "gpu and not fused_decode_same_tokens"
     for r in $(seq "${A_ROUNDS:-2}"); do profile_8b here.log 60 --floor; done
     for f in "$OUT"/*_*.log; do echo "$f: $(python3 bench/layer_times.py "$f" --ends 2>/dev/null | head -1)"; done ;;
  b) gpu_tests gpu_b.log "${B_LIMIT:-500}" tests/test_gpu.py tests/test_kernels_pdl.py \
       tests/test_kernels_gemv.py -k "not gemv_gpu and not odd_k and not cuda_graphs" ;;
esac
