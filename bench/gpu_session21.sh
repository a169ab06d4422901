#!/usr/bin/env bash
# GPU leases of 2026-12-01 (fifteenth session), H200. Results: docs/PERFORMANCE.md, "Fifteenth session".
# None of the knobs these cases measured was faster, so none is on main: each case runs on the commit it ran at
# (`git checkout COMMIT && bash bench/gpu_session21.sh CASE`); on main their --set names stop with "no such module
# constant".
#   a (at b947d15): the split-K partial kernel's EARLY_LOADS (kernels/split_kv_attention.py: the slots of each tile
#      loaded a tile ahead, the first before the PDL wait; V's loads issued before K's; after the wait, q and the
#      first K / V tile pulled into L1 at once): the attention and PDL GPU tests, then the 8B step with and without
#      it, alternating
#   c (at dd96b10): the partial kernel's registers as Triton 3.6 compiles it (bench/probe_partial_regs.py, which is
#      on main), with and without PDL_MAXNREG / PREFETCH_L1; GPU tests at that commit's defaults (EARLY_LOADS,
#      PREFETCH_L1 off, PDL_MAXNREG 128); then the 8B step with them and with EARLY_LOADS off, alternating, and
#      once with PREFETCH_L1 too
#   d (at cf24618): the merge's smaller tile for short requests (kernels/split_kv_merge.py MERGE_SMALL_SLOTS, 16):
#      the merge / decode / verify / PDL GPU tests, then the 8B step with and without it, alternating
#   e (main, 6dc9afe): the GPU tests not run on main's kernels in this session's or the fourteenth's leases: the
#      model-level and backend tests, the fused qkv / RoPE / store kernels, the bonus-token fill, and the PDL model
#      tests (plain, n-gram and layer-skip tokens with PDL on and off; tree speculation through triton)
#   f, g: moved, not run here: bench/gpu_session22.sh a and b (sixteenth session)
source "$(dirname "$0")/gpu_lease_env.sh"  # set -u, wheels, PYTHONPATH, TFS_TOKENIZER, OUT, gpu_tests, profile_8b

case "${1:-a}" in
  a) gpu_tests gpu_a.log 200 tests/test_kernels_pdl.py tests/test_kernels_attention.py \
       -k "ops_equal or chain or stale or decode_on_cuda or verify_on_cuda"
     for run in 1 2 3; do
       profile_8b profile_8b_a.log 60 --floor
       profile_8b profile_8b_a.log 60 --floor --set kernels.split_kv_attention.EARLY_LOADS=False
     done ;;
  c) K=kernels.split_kv_attention
     for s in "" "$K.PDL_MAXNREG=None" "$K.PREFETCH_L1=True" "$K.EARLY_LOADS=False"; do
       timeout 60 python3 bench/probe_partial_regs.py ${s:+--set $s} 2>&1 | grep "partial kernel"
     done
     gpu_tests gpu_c.log 120 tests/test_kernels_pdl.py tests/test_kernels_attention.py \
       -k "ops_equal or chain or decode_on_cuda"
     for run in 1 2 3; do
       profile_8b profile_8b_c.log 60 --floor
       profile_8b profile_8b_c.log 60 --floor --set $K.EARLY_LOADS=False
     done
     profile_8b profile_8b_c.log 60 --floor --set $K.PREFETCH_L1=True ;;
  d) gpu_tests gpu_d.log 200 tests/test_kernels_pdl.py tests/test_kernels_attention.py \
       -k "ops_equal or chain or stale or decode_on_cuda or verify_on_cuda"
     for run in 1 2 3; do
       profile_8b profile_8b_d.log 60 --floor
       profile_8b profile_8b_d.log 60 --floor --set kernels.split_kv_merge.MERGE_SMALL_SLOTS=0
     done ;;
  e) gpu_tests gpu_e1.log 150 tests/test_kernels_qkv_rope_store.py tests/test_kernels_rope_store.py \
       tests/test_fill_bonus_tokens.py
     gpu_tests gpu_e2.log 200 tests/test_kernels_pdl.py -k "model_tokens or tree"
     gpu_tests gpu_e3.log 200 tests/test_gpu.py tests/test_attention_backends.py ;;
esac
