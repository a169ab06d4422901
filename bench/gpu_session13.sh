#!/usr/bin/env bash
# GPU leases of 2026-12-01 (eighth session). Usage: bash bench/gpu_session13.sh a|b|...
# Leases a, c and d compared kernel variants that were slower or no faster and are not on main (docs/PERFORMANCE.md,
# eighth session): at HEAD their "head" runs time the same code as prev/. Lease a's variant is commit 9807bba.
#   a (at 9807bba): the decode merge inside the split-K partial kernel (merge counters): the 8B decode step against
#      prev/ (`git archive 8ebfbed kernels framework bench conf`: merge as a second kernel), same lease; GPU tests
#      (fused merge on CUDA, PDL ops and chain with counters); the decode attention table
source "$(dirname "$0")/gpu_lease_env.sh"  # set -u, wheels, PYTHONPATH, TFS_TOKENIZER, OUT, gpu_tests
# profile_8b TREE NAME SECONDS [ARGS...]: the 8B decode step at batch 1, 1k context, attention=triton, run from TREE
# (. or prev); ARGS go to profile_gpu_decode.py (options, then -- and Hydra overrides)
profile_8b() {
  local tree=$1 name=$2 limit=$3; shift 3
  (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout "$limit" python3 bench/profile_gpu_decode.py \
    --model llama3_8b_random --batch 1 --context 1024 --timeline 12 "$@" -- attention=triton \
    "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG > "$OUT/profile_8b_$name.log")
  echo "== $name: $(grep -E '^GPU span' "$OUT/profile_8b_$name.log" | cut -c1-100)"
  grep -E "^forward wall|kernels per forward|skipping cudagraphs" "$OUT/profile_8b_$name.log" | head -4
}
if [ "${1:-a}" = a ]; then
  [ -d prev ] || { echo "prev/ missing"; exit 1; }
  profile_8b prev a_prev 120
  profile_8b . a_head 120
  profile_8b prev a_prev2 120
  profile_8b . a_head2 120
  grep -A13 "^one forward" "$OUT/profile_8b_a_head.log" | tail -9
  gpu_tests gpu_tests_a.log 240 tests/test_kernels_attention.py -k "decode_on_cuda" \
    tests/test_kernels_pdl.py::test_pdl_ops_equal_plain_ops tests/test_kernels_pdl.py::test_pdl_chain_in_a_cuda_graph_equals_plain
  timeout 150 python3 bench/bench_attention.py --configs 1x1024 1x4096 1x32768 32x4096 --page-sizes 16 \
    > "$OUT/bench_attention_a.log" 2>&1; tail -7 "$OUT/bench_attention_a.log"
fi
#   b: tuning constants in the model, one run each (HEAD = 8ebfbed for the model): PDL_PREFETCH_K (weight columns
#      each PDL gemv prefetches before its wait) 1024 / 2048 / 256 against 512; the decode split policy's shortest
#      split (MIN_SPLIT_LEN 64: 16 splits at 1k) 128 / 256, with 64- or 128-key tiles; 32-key tiles
if [ "${1:-a}" = b ]; then
  S=kernels.split_kv_attention
  profile_8b . b_base 100
  for k in 1024 2048 256; do profile_8b . "b_k$k" 100 --pdl-prefetch-k $k; done
  profile_8b . b_msl128 100 --set $S.MIN_SPLIT_LEN=128
  profile_8b . b_msl128_bn128 100 --set $S.MIN_SPLIT_LEN=128 "$S.CUDA_LAUNCH.decode_small=(128,4,1)"
  profile_8b . b_msl256 100 --set $S.MIN_SPLIT_LEN=256
  profile_8b . b_bn32 100 --set "$S.CUDA_LAUNCH.decode_small=(32,4,1)"
  profile_8b . b_base2 100
fi
#   c (a working tree, never committed): the PDL decode's first tile of older K/V loaded into registers before the
#      wait: the 8B step against prev/ (`git archive c23d0ec ...`: L2 prefetch only), same lease, twice each; GPU tests (PDL ops and chain
#      bit-identical, decode on CUDA, tree speculation tokens with PDL on and off)
if [ "${1:-a}" = c ]; then
  [ -d prev ] || { echo "prev/ missing"; exit 1; }
  for run in prev head prev2 head2; do tree=.; [ "${run#prev}" != "$run" ] && tree=prev; profile_8b $tree "c_$run" 100; done
  grep -A13 "^one forward" "$OUT/profile_8b_c_head.log" | tail -9
  gpu_tests gpu_tests_c.log 300 tests/test_kernels_pdl.py -k "ops_equal or chain or spec2" \
    tests/test_kernels_attention.py -k "decode_on_cuda or ops_equal or chain or spec2"
fi
#   d (a working tree, never committed): the PDL merge kernel loads only the splits the request used (its length arrives before the wait): the 8B
#      step against prev/ (`git archive c23d0ec ...`), same lease, twice each; the decode partial with 2 and 8 warps;
#      GPU tests (the merge's stale-partials test with and without PDL, PDL ops and chain bit-identical)
if [ "${1:-a}" = d ]; then
  [ -d prev ] || { echo "prev/ missing"; exit 1; }
  for run in prev head prev2 head2; do tree=.; [ "${run#prev}" != "$run" ] && tree=prev; profile_8b $tree "d_$run" 90; done
  for w in 2 8; do profile_8b . "d_warps$w" 90 --set "kernels.split_kv_attention.CUDA_LAUNCH.decode_small=(64,$w,1)"; done
  gpu_tests gpu_tests_d.log 200 tests/test_kernels_attention.py -k "stale or ops_equal or chain" \
    tests/test_kernels_pdl.py -k "stale or ops_equal or chain"
fi
