#!/usr/bin/env bash
# GPU leases of 2026-12-01 (tenth session), H200. Usage: bash bench/gpu_session16.sh a|b|c|d|e|f|g|h|i
# Results: docs/PERFORMANCE.md, "Tenth session". Leases a-c ran on working trees before the commit that made their
# winning knobs the rule (505db1d); re-running them on a later commit measures that commit's kernel.
#   a: the split-K partial kernel with its products transposed (wgmma-sized M) and bf16 partials, decode and verify
#      at batch 1, against main's kernel (bench/probe_split_kv_swap_ab.py)
source "$(dirname "$0")/gpu_lease_env.sh"  # set -u, wheels, PYTHONPATH, TFS_TOKENIZER, OUT, gpu_tests
case "${1:-a}" in
  a) timeout 560 python3 bench/probe_split_kv_swap_ab.py 2>&1 | tee "$OUT/probe_swap_ab.log" ;;
  b) # main's kernel with the tree-mask load issued before the K load, against the kernel before (carry .prev:
     # `mkdir -p .prev && git archive 909a7c0 kernels | tar -x -C .prev`); verify with a bool mask (converted by the
     # op), with the uint8 mask attention=triton passes, and causal; per-kernel GPU times
     PROBE_PREV_TREE=.prev timeout 300 python3 bench/probe_split_kv_swap_ab.py --kernels main prev --partials fp32 \
       --launches 128,4,1 128,4,2 --targets 2 --decode-launches 64,4,1 --configs 1x1024 1x4096 1x32768 32x4096 \
       2>&1 | tee "$OUT/probe_mask_order.log" ;;
  c) # (lease c ran this with a knob, since made the rule, that rounds the split count down to a power of two, as a
     # second dimension of the sweep)
     timeout 300 python3 bench/probe_split_kv_swap_ab.py --merge-sweep --configs 1x1024 1x4096 1x32768 32x4096 \
       2>&1 | tee "$OUT/probe_merge.log" ;;
  d) # power-of-two splits and the merge at 2 warps (now the rule): verify (uint8 mask) launches and programs per SM
     # at small batch; then the 8B decode step
     timeout 300 python3 bench/probe_split_kv_swap_ab.py --kernels main --partials fp32 --verify-kind uint8 \
       --launches 128,4,1 64,4,1 128,8,1 64,8,1 128,4,2 --targets 1 2 3 4 --decode-launches 64,4,1 128,4,1 \
       --configs 1x1024 1x4096 1x32768 32x4096 --top 6 2>&1 | tee "$OUT/probe_launch.log"
     for warps in 2 4 2 4; do  # the merge's num_warps: 2 (now) against 4 (before), alternating
       echo "merge warps $warps"
       timeout 100 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 12 \
         --set kernels.split_kv_merge.REDUCE_NUM_WARPS=$warps -- attention=triton "model.tokenizer=$TFS_TOKENIZER" \
         2>&1 | tee -a "$OUT/profile_8b_w$warps.log" | grep -E "^GPU span|reduce"
     done ;;
  e) # the tree mask read through clamped addresses without a predicate (a working tree, never committed: re-running
     # this now compares HEAD with 505db1d) against 505db1d's predicated gather (carry .prev: `mkdir -p .prev && git
     # archive 505db1d kernels | tar -x -C .prev`); then at most 16 query rows per program
     PROBE_PREV_TREE=.prev timeout 200 python3 bench/probe_split_kv_swap_ab.py --kernels main prev --partials fp32 \
       --verify-kind uint8 --launches 128,4,1 64,8,1 --targets 1 2 --decode-launches 64,4,1 \
       --configs 1x1024 1x4096 1x32768 --top 4 2>&1 | tee "$OUT/probe_mask_clamp.log" | grep -v Warn
     timeout 200 python3 bench/probe_split_kv_swap_ab.py --set ROW_BLOCK=16 --kernels main --partials fp32 \
       --verify-kind uint8 --launches 128,4,1 64,4,1 --targets 2 4 --decode-launches 64,4,1 \
       --configs 1x1024 1x4096 1x32768 --top 4 2>&1 | tee "$OUT/probe_rows16.log" | grep -E "^(1x|verify)" ;;
  f) # the issue's table with this session's kernels (a77b126); then verify launches
     # with 2 warps or 256-key tiles at batch 1
     timeout 330 python3 bench/bench_attention.py 2>&1 | tee "$OUT/bench_attention.log" | grep -v "^page"
     timeout 150 python3 bench/probe_split_kv_swap_ab.py --kernels main --partials fp32 --verify-kind uint8 \
       --launches 128,4,1 128,2,1 64,2,1 256,8,1 --targets 1 2 --decode-launches 64,4,1 --configs 1x4096 1x32768 \
       --top 5 2>&1 | tee "$OUT/probe_warps.log" | grep -E "^(1x|verify)" ;;
  g) # GPU tests of the attention kernels, the PDL ops and chain, and the backends; then decode launches at large batch
     gpu_tests gpu_attention.log 380 tests/test_kernels_attention.py tests/test_kernels_pdl.py \
       tests/test_attention_backends.py
     timeout 150 python3 bench/tune_split_kv.py --configs 32x4096 64x32768 --block-n 64 128 --warps 4 --stages 1 2 \
       --targets 4 --min-split-lens 64 --sweep-at 4 64 2>&1 | tee "$OUT/tune_large_batch.log" | tail -25 ;;
  h) # the three backend GPU tests lease g's 380 s did not reach; the issue's table with decode at (64, 4, 1) for every
     # batch (the kernel's outputs are checked against SDPA before timing)
     gpu_tests gpu_backends_rest.log 200 \
       "tests/test_attention_backends.py::test_greedy_equals_sdpa_on_cuda[flex-reduce_overhead]" \
       tests/test_attention_backends.py::test_bf16_compiled_agrees_with_sdpa_on_cuda
     timeout 200 python3 bench/bench_attention.py 2>&1 | tee "$OUT/bench_attention2.log" | grep -v "^page" ;;
  i) # the decode and verify GPU tests (32 requests of random lengths: the large-batch launch) at 54805de
     gpu_tests gpu_decode_tests.log 150 tests/test_kernels_attention.py -k "decode_on_cuda or verify_on_cuda" ;;
esac
