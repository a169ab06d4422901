#!/usr/bin/env bash
# GPU leases of 2026-12-02 (twentieth session), H200. Results: docs/PERFORMANCE.md, "Twentieth session".
# One-row gemv accumulator folded by 16-byte runs (kernels/gemv.py _accumulate: registers 119-125 -> 56-64 for o,
# gate_up, down): A/B against BASE 825bc0d (main before it) unpacked into old/:
#   mkdir old && git archive 825bc0d kernels bench framework conf train_free_serve.py | tar -x -C old
#   a: the gemv / lm_head / qkv kernels' GPU tests, then the 8B step alternating here / here with gate_up's L2
#      window at 512 columns / old, A_ROUNDS rounds (default 2), then each log's head / layers / tail
#   c: tfs::lm_head's launch (vocab class): (16, 256, 4, 3) as on main, (8, 1024, 4, 3) (the LATE_NORM sweep's best
#      for lm_head's shape in the sixth session) and (8, 512, 4, 3), C_ROUNDS rounds (default 2)
#   d: each gemv weight-loop iteration prefetching the next chunk into L2 (kernels/gemv.py PREFETCH_NEXT; not in
#      qkv_rope_store) on / off, D_ROUNDS rounds (default 2), after the lm_head and gemv GPU tests
#   f: (not run yet) tfs::lm_head's launch (16, 256, 4, 3) (main) against (4, 1024, 4, 3), F_ROUNDS rounds (default 3)
#   b: the compiled paths' GPU tests (logits against transformers, compiled == eager, spec == plain, staged inputs,
#      PDL on / off tokens with the tree verification, the PDL chain)
# Ran: a with the folded accumulator over 825bc0d (since on branch exp/gemv-fold; old/ = 825bc0d), b and c at 825bc0d,
# d on branch exp/gemv-prefetch-next (PREFETCH_NEXT exists only there).
# The session's first lease ran bench/gpu_session25.sh a (A_TESTS=0 A_KNOBS=0 A_ROUNDS=3) at 825bc0d.
source "$(dirname "$0")/gpu_lease_env.sh"  # set -u, wheels, PYTHONPATH, TFS_TOKENIZER, OUT, gpu_tests, profile_8b
case "${1:-a}" in
  a) [ "${A_TESTS:-1}" = 0 ] || gpu_tests gpu_a.log 150 tests/test_kernels_lm_head.py tests/test_kernels_gemv.py \
       tests/test_kernels_qkv_rope_store.py -k "gpu and not fused_decode_same_tokens"
     for r in $(seq "${A_ROUNDS:-2}"); do
       profile_8b here.log 60 --floor
       [ "${A_KNOBS:-1}" = 0 ] || profile_8b w512.log 60 --floor --set kernels.gemv.PDL_PREFETCH_K.very_wide=512
       (cd old && PYTHONPATH=/tmp/site:$PWD profile_8b old.log 60 --floor)
     done
     for f in "$OUT"/*_*.log; do echo "$f: $(python3 bench/layer_times.py "$f" --ends 2>/dev/null | head -1)"; done ;;
  c) for r in $(seq "${C_ROUNDS:-2}"); do  # tfs::lm_head's launch (the vocab class): main's, then two others
       profile_8b here.log 60 --floor
       profile_8b v8x1024.log 60 --floor --gemv-launch vocab=8,1024,4,3
       profile_8b v8x512.log 60 --floor --gemv-launch vocab=8,512,4,3
     done
     for f in "$OUT"/*_*.log; do echo "$f: $(python3 bench/layer_times.py "$f" --ends 2>/dev/null | head -1)"; done ;;
  d) [ "${D_TESTS:-1}" = 0 ] || gpu_tests gpu_d.log 150 tests/test_kernels_lm_head.py tests/test_kernels_gemv.py \
       -k "gpu and not fused_decode_same_tokens and not cuda_graphs"
     for r in $(seq "${D_ROUNDS:-2}"); do  # the next weight chunk prefetched into L2 each iteration: on, off
       profile_8b next.log 60 --floor
       profile_8b nonext.log 60 --floor --set kernels.gemv.PREFETCH_NEXT=False
     done
     for f in "$OUT"/*_*.log; do echo "$f: $(python3 bench/layer_times.py "$f" --ends 2>/dev/null | head -1)"; done ;;
  f) for r in $(seq "${F_ROUNDS:-3}"); do  # tfs::lm_head at (4, 1024, 4, 3): main's 72 registers, no layout change
       profile_8b here.log 60 --floor
       profile_8b v4x1024.log 60 --floor --gemv-launch vocab=4,1024,4,3
     done
     for f in "$OUT"/*_*.log; do echo "$f: $(python3 bench/layer_times.py "$f" --ends 2>/dev/null | head -1)"; done ;;
  b) gpu_tests gpu_b.log "${B_LIMIT:-500}" tests/test_gpu.py tests/test_kernels_pdl.py \
       tests/test_kernels_gemv.py -k "not gemv_gpu and not odd_k and not cuda_graphs" ;;
esac
