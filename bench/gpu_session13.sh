#!/usr/bin/env bash
# GPU leases of 2026-12-01 (eighth session). Usage: bash bench/gpu_session13.sh a|b|...
#   a: the decode merge inside the split-K partial kernel (merge counters): the 8B decode step against prev/
#      (`git archive 8ebfbed kernels framework bench conf`: merge as a second kernel), same lease; GPU tests (fused
#      merge on CUDA, PDL ops and chain with counters, tree-speculation tokens); the decode attention table
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TFS_TOKENIZER=$PWD/.tok/smollm2
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
# gpu_tests LOG SECONDS PYTEST_ARGS...: the GPU tests, their verdict lines printed
gpu_tests() {
  local log=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -m gpu -p no:cacheprovider -rA --tb=short "$@" > "$OUT/$log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|^E " "$OUT/$log" | tail -40
}
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
#   b: PDL_PREFETCH_K (weight columns each PDL gemv prefetches before its wait) 1024, 2048, 256 vs 512 (HEAD);
#      then the model-token GPU tests (fused vs unfused gemv tokens, PDL on / off with tree speculation)
if [ "${1:-a}" = b ]; then
  for k in 512 1024 2048 256; do profile_8b . "b_k$k" 100 --pdl-prefetch-k $k; done
  gpu_tests gpu_tests_b.log 300 tests/test_kernels_pdl.py -k "model_tokens" \
    "tests/test_kernels_gemv.py::test_fused_decode_same_tokens_as_unfused"
fi
