#!/usr/bin/env bash
# GPU leases of 2026-12-02 (prepared in the twenty-first session, run in the twenty-third), H200. Results:
# docs/PERFORMANCE.md, "Twenty-third session". Both cases ran on branch exp/stream-evict (main has no
# PREFETCH_EVICT_LAST; its WEIGHT_EVICT_FIRST is now True by default).
#   a: (branch exp/stream-evict) the weight stream's L2 hints (kernels/gemv.py WEIGHT_EVICT_FIRST,
#      PREFETCH_EVICT_LAST):
#      none (main's code), weight loads evict-first, and evict-first with the PDL prefetches at evict-last,
#      A_ROUNDS rounds (default 2), then each log's head / layers / tail; first the GPU's clocks and power limit
#      (the two kinds of H200 stream weights at different speeds: docs/PERFORMANCE.md, twenty-first session)
#   b: (branch exp/stream-evict, after a) evict-first weight loads with wider PDL prefetch windows, which the L2 may
#      now keep until used: evict-first alone; gate_up 2048 columns; qkv and down 1024; o_proj 1024 (main: 1024 for
#      gate_up, 512 for the others), B_ROUNDS rounds (default 2)
# The session's first leases ran bench/gpu_session26.sh b, f (main) and e (branch exp/prefetch-first-wave).
source "$(dirname "$0")/gpu_lease_env.sh"  # set -u, wheels, PYTHONPATH, TFS_TOKENIZER, OUT, gpu_tests, profile_8b
case "${1:-a}" in
  a) nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.limit,driver_version \
       --format=csv | tee "$OUT/clocks.csv"
     for r in $(seq "${A_ROUNDS:-2}"); do
       profile_8b none.log 60 --floor
       profile_8b ef.log 60 --floor --set kernels.gemv.WEIGHT_EVICT_FIRST=True
       profile_8b efpl.log 60 --floor --set kernels.gemv.WEIGHT_EVICT_FIRST=True \
         kernels.gemv.PREFETCH_EVICT_LAST=True
     done
     for f in "$OUT"/*_*.log; do echo "$f: $(python3 bench/layer_times.py "$f" --ends 2>/dev/null | head -1)"; done ;;
  b) ef="kernels.gemv.WEIGHT_EVICT_FIRST=True"
     for r in $(seq "${B_ROUNDS:-2}"); do
       profile_8b ef.log 60 --floor --set $ef
       profile_8b gu2048.log 60 --floor --set $ef kernels.gemv.PDL_PREFETCH_K.very_wide=2048
       profile_8b qd1024.log 60 --floor --set $ef kernels.gemv.PDL_PREFETCH_K.wide=1024 \
         kernels.gemv.PDL_PREFETCH_K.tall=1024
       profile_8b o1024.log 60 --floor --set $ef kernels.gemv.PDL_PREFETCH_K.square=1024
     done
     for f in "$OUT"/*_*.log; do echo "$f: $(python3 bench/layer_times.py "$f" --ends 2>/dev/null | head -1)"; done ;;
esac
