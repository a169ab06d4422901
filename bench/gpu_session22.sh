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
#   d, e: A/B against a base commit's code unpacked into old/ (untracked, carried with the working tree):
#        mkdir old && git archive BASE kernels bench framework conf train_free_serve.py | tar -x -C old
#      d: the batch-1 rows of the attention table (1 x 4k, 1 x 32k), here and in old/, alternating twice. Ran at
#         2152d2d (main) and then with ca458e1's merge change in the working tree, both against BASE 6a2cb8c (the
#         eleventh session's kernels, whose verify / decode was 1.19)
#      e: the merge / decode / verify / PDL GPU tests (or, with E_TESTS=epilogue, the gemv / qkv / PDL ones), then
#         the 8B step here and in old/, alternating (E_PAIRS pairs, default 2). Ran at ca458e1 against BASE 2152d2d
#         (tests, 2 pairs, then 2 more pairs starting with old/), and at 84f4f39 against BASE ca458e1
#         (E_TESTS=epilogue, 3 pairs)
#   the same case e at branch exp/qkv-meta-early (a054b5b: qkv_rope_store loads the positions and slots before its
#      PDL wait, the cos / sin rows right after it), against main; ran in the seventeenth session (level):
#        git checkout exp/qkv-meta-early && mkdir old && git archive main kernels bench framework conf \
#          train_free_serve.py | tar -x -C old && E_TESTS=epilogue E_PAIRS=3 bash bench/gpu_session22.sh e
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
  d) for r in 1 2; do
       echo "== here $r"; python3 bench/bench_attention.py --configs 1x4096 1x32768 2>&1 | grep -A9 "^decode attention"
       echo "== old/ $r"
       (cd old && PYTHONPATH=/tmp/site:$PWD python3 bench/bench_attention.py --configs 1x4096 1x32768 2>&1 |
          grep -A9 "^decode attention")
     done ;;
  e) if [ "${E_TESTS:-merge}" = epilogue ]; then
       gpu_tests gpu_e.log 130 tests/test_kernels_pdl.py tests/test_kernels_qkv_rope_store.py \
         tests/test_kernels_gemv.py -k "ops_equal or chain or qkv_rope_store_gpu or qkv_rope_store_pdl or gemv_gpu"
     else
       gpu_tests gpu_e.log 150 tests/test_kernels_pdl.py tests/test_kernels_attention.py \
         -k "ops_equal or chain or stale or decode_on_cuda or verify_on_cuda or merge"
     fi
     for r in $(seq "${E_PAIRS:-2}"); do
       profile_8b here.log 60 --floor
       (cd old && PYTHONPATH=/tmp/site:$PWD profile_8b old.log 60 --floor)
     done ;;
esac
