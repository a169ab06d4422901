#!/usr/bin/env bash
# GPU leases of 2026-12-01 (sixteenth session), H200. Results: docs/PERFORMANCE.md, "Sixteenth session".
#   a (main): the partial kernel's registers for the 8-token verify tile as the GPU's Triton compiles it
#      (bench/probe_partial_regs.py --verify; a CPU compile with Triton 3.9 gave 255 registers and 16 B of spills),
#      then the qkv kernel's launch (the gemv class `wide`, (8, 512, 4, 3) on main), whose 13.0 us are 1.3 us over
#      its weight at the copy bandwidth: launches the twelfth session did not try, one run each between two runs of
#      the defaults
#   b (main): 2 split-K programs per SM for decode (TARGET_PROGRAMS_PER_SM.decode=2: 32 split slots at batch 1, the
#      merge 1.7 us instead of 2.3 in the thirteenth session's two runs), three alternating pairs, then what it
#      costs the long single requests of the attention table (1 x 4k, 1 x 32k)
#   c (main): the issue's attention table (bench/bench_attention.py, defaults) twice: case b's run of its batch-1 rows
#      gave verify / decode 1.37 at 1 x 4k (page 16), where the eleventh session's table had 1.19; and the clocks
source "$(dirname "$0")/gpu_lease_env.sh"  # set -u, wheels, PYTHONPATH, TFS_TOKENIZER, OUT, gpu_tests, profile_8b

case "${1:-a}" in
  a) timeout 90 python3 bench/probe_partial_regs.py --verify 2>&1 | tee "$OUT/probe_regs_a.log" | grep "partial kernel"
     profile_8b profile_8b_a.log 60 --floor
     for launch in 4,512,4,3 8,256,4,3 4,1024,4,3 8,512,4,4 8,512,2,3; do
       profile_8b profile_8b_a.log 60 --floor --gemv-launch "wide=$launch"
     done
     profile_8b profile_8b_a.log 60 --floor ;;
  b) T=kernels.split_kv_attention.TARGET_PROGRAMS_PER_SM.decode
     for run in 1 2 3; do
       profile_8b profile_8b_b.log 60 --floor
       profile_8b profile_8b_b.log 60 --floor --set "$T=2"
     done
     for per_sm in 4 2; do
       timeout 150 python3 bench/bench_attention.py --configs 1x4096 1x32768 --page-sizes 16 --set "$T=$per_sm" \
         2>&1 | tee "$OUT/bench_attention_b$per_sm.log" | grep -v "^page"
     done ;;
  c) nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.limit,temperature.gpu \
       --format=csv | tee "$OUT/clocks_c.log"
     for run in 1 2; do
       timeout 250 python3 bench/bench_attention.py 2>&1 | tee "$OUT/bench_attention_c$run.log" | grep -v "^page"
     done ;;
esac
