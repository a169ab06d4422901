#!/usr/bin/env bash
# GPU leases of 2026-12-01 (seventh session). Usage: bash bench/gpu_session12.sh a|b|...
#   a: HEAD checks: the merge's stale-partials test on CUDA (first run there), gemv GPU tests (lm_head's launch
#      class), the 8B decode step with lm_head at (16, 256, 4, 3)
source "$(dirname "$0")/gpu_lease_env.sh"  # set -u, wheels, PYTHONPATH, TFS_TOKENIZER, OUT, gpu_tests
# profile_8b NAME SECONDS [HYDRA_OVERRIDES...]: the 8B decode step at batch 1, 1k context, attention=triton
profile_8b() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 \
    --timeline 12 -- attention=triton "model.tokenizer=$TFS_TOKENIZER" "$@" 2>&1 | grep -v DEBUG \
    > "$OUT/profile_8b_$name.log"
  grep -A6 "^forward wall" "$OUT/profile_8b_$name.log"; grep -A13 "^one forward" "$OUT/profile_8b_$name.log"
}
if [ "${1:-a}" = a ]; then
  gpu_tests gpu_tests_a.log 240 tests/test_kernels_gemv.py \
    "tests/test_kernels_attention.py::test_merge_ignores_stale_partials_on_cuda"
  profile_8b a 180
fi
#   b: PDL ops (compile.pdl): op and chain tests, then the 8B decode step with compile.pdl=off / on
if [ "${1:-a}" = b ]; then
  gpu_tests gpu_pdl_b.log 200 tests/test_kernels_pdl.py -k "ops_equal or chain"
  for pdl in off on; do
    echo "compile.pdl=$pdl"; profile_8b "b_$pdl" 170 compile.pdl=$pdl
  done
fi
#   c: after the float32 scalar casts (eps, scale): the PDL tests (ops, chain eager / compiled / PDL, model tokens
#      plain and speculative), the attention and gemv GPU tests
if [ "${1:-a}" = c ]; then
  gpu_tests gpu_tests_c.log 560 tests/test_kernels_pdl.py tests/test_kernels_attention.py tests/test_kernels_gemv.py
fi
#   d: tfs::qkv_rope_store (qkv projection + RoPE + K/V store in one kernel) and the L2 prefetch of the split's
#      first K/V tile before the PDL wait: GPU tests, then the 8B decode step
if [ "${1:-a}" = d ]; then
  gpu_tests gpu_tests_d.log 330 tests/test_kernels_qkv_rope_store.py \
    tests/test_kernels_pdl.py::test_pdl_ops_equal_plain_ops \
    tests/test_kernels_pdl.py::test_pdl_chain_in_a_cuda_graph_equals_plain \
    "tests/test_kernels_gemv.py::test_fused_decode_same_tokens_as_unfused[smollm2_135m_random]" \
    "tests/test_kernels_pdl.py::test_model_tokens_same_with_pdl_on_and_off[spec2]"
  profile_8b d 170
fi
#   e: the 8B decode step, same lease: prev/ (`git archive b749123 kernels framework bench conf`: PDL, no
#      qkv_rope_store, no K/V prefetch), HEAD (both), HEAD with the gemvs' PDL trigger after the weight loop
if [ "${1:-a}" = e ]; then
  [ -d prev ] || { echo "prev/ missing"; exit 1; }
  for run in prev head head_late; do
    tree=.; [ $run = prev ] && tree=prev
    late=0; [ $run = head_late ] && late=1
    (cd $tree && TFS_PDL_LATE_TRIGGER=$late PYTHONPATH=/tmp/site:$PWD timeout 150 python3 bench/profile_gpu_decode.py \
      --model llama3_8b_random --batch 1 --context 1024 --timeline 12 -- attention=triton \
      "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG > "$OUT/profile_8b_e_$run.log")
    echo "$run"; grep -A6 "^forward wall" "$OUT/profile_8b_e_$run.log" | grep -v "^group\|^gemm\|^att\|^other\|^kv"
    grep -A13 "^one forward" "$OUT/profile_8b_e_$run.log" | tail -9
  done
fi
#   f: the 8B decode step (PDL, qkv_rope_store) with other gemv launches for o_proj (square), qkv (wide) and
#      down (tall), one class at a time (lease f ran at d2f8436 with a TFS_GEMV_LAUNCH environment knob in
#      kernels/gemv.py; since replaced by profile_gpu_decode.py --gemv-launch, which this script now passes)
if [ "${1:-a}" = f ]; then
  for launch in "" "square=8,1024,4,3" "wide=16,512,4,3" "wide=4,512,4,3" "tall=16,1024,4,3"; do
    timeout 90 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 \
      --timeline 12 ${launch:+--gemv-launch $launch} -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 \
      | grep -v DEBUG > "$OUT/profile_8b_f_${launch//[=,]/_}.log"  # no '=' or ',' in names: they come back
    echo "${launch:-base}: $(grep '^GPU span' "$OUT/profile_8b_f_${launch//[=,]/_}.log" | cut -c1-80)"
  done
fi
#   g: after the review fixes (prefetch offsets clamped to the head, uint8 mask once per step, the chain test with
#      tfs::qkv_rope_store on every other layer): the PDL op / chain tests, the fused-kernel tests, the attention
#      tests, and tree speculation (uint8 masks) with PDL on and off
if [ "${1:-a}" = g ]; then
  gpu_tests gpu_tests_g.log 400 tests/test_kernels_pdl.py tests/test_kernels_qkv_rope_store.py \
    tests/test_kernels_attention.py -k "not model_tokens or spec2"
fi
