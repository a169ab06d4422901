#!/usr/bin/env bash
# GPU leases of 2026-11-30 (fourth session). Usage: bash bench/gpu_session9.sh a|b|...
#   a: the gemv GPU tests not yet run since the review fixes, the host's share of a compiled decode forward, and
#      the split policy around the (1, 4k) verify.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TFS_TOKENIZER=$PWD/.tok/smollm2
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
if [ "${1:-a}" = a ]; then
  timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -rA --tb=short tests/test_kernels_gemv.py \
    > "$OUT/gpu_gemv_tests.log" 2>&1; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_gemv_tests.log" | tail -20
  timeout 150 python3 bench/profile_host_decode.py --model smollm2_135m_random --batch 1 --context 1024 --top 40 \
    -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG > "$OUT/profile_host_smollm2.log"
  head -8 "$OUT/profile_host_smollm2.log"
  timeout 120 python3 bench/tune_split_kv.py --configs 1x4096 1x32768 --block-n 64 128 --warps 4 --stages 2 \
    --targets 1 2 4 8 --min-split-lens 64 128 256 2>&1 | grep -v DEBUG > "$OUT/tune_split_1x4k.log"
  tail -20 "$OUT/tune_split_1x4k.log"
fi
if [ "${1:-a}" = b ]; then  # the runner's static graph inputs: GPU tests, then the host's share again
  timeout 330 python3 -m pytest -m gpu -p no:cacheprovider -rA --tb=short tests/test_gpu.py \
    "tests/test_kernels_gemv.py::test_gemv_gpu_compiled_with_cuda_graphs" \
    "tests/test_kernels_gemv.py::test_fused_decode_same_tokens_as_unfused" > "$OUT/gpu_tests_b.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/gpu_tests_b.log" | tail -20
  for flags in "" "--skip-guards"; do
    timeout 100 python3 bench/profile_host_decode.py --model smollm2_135m_random --batch 1 --context 1024 --top 40 \
      $flags -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG \
      > "$OUT/profile_host_smollm2${flags}.log"
    head -9 "$OUT/profile_host_smollm2${flags}.log"
  done
fi
if [ "${1:-a}" = c ]; then  # fused RoPE + KV store, guard skipping: GPU tests, then the 8B step and the host share
  timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -rA --tb=short tests/test_kernels_rope_store.py \
    tests/test_gpu.py > "$OUT/gpu_tests_c.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/gpu_tests_c.log" | tail -24
  timeout 170 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 12 \
    -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG > "$OUT/profile_8b_c.log"
  grep -A6 "^forward wall" "$OUT/profile_8b_c.log"; grep -A13 "^one forward" "$OUT/profile_8b_c.log"
  timeout 100 python3 bench/profile_host_decode.py --model smollm2_135m_random --batch 1 --context 1024 --top 25 \
    -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG > "$OUT/profile_host_smollm2_c.log"
  head -8 "$OUT/profile_host_smollm2_c.log"
fi
if [ "${1:-a}" = d ]; then  # is compile.skip_guards in effect on this torch? (against a process-wide stance)
  for flags in "" "--skip-guards"; do
    timeout 100 python3 bench/profile_host_decode.py --model smollm2_135m_random --batch 1 --context 1024 --top 25 \
      --reps 300 $flags -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG \
      > "$OUT/profile_host_smollm2_d${flags}.log"
    head -9 "$OUT/profile_host_smollm2_d${flags}.log"
  done
fi
if [ "${1:-a}" = e ]; then  # process-wide skip stance: GPU correctness, then the 8B step
  timeout 170 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 0 \
    -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG > "$OUT/profile_8b_e.log"
  grep -A6 "^forward wall" "$OUT/profile_8b_e.log"
  timeout 170 python3 -m pytest -m gpu -p no:cacheprovider -rA --tb=short tests/test_gpu.py > "$OUT/gpu_tests_e.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|^E " "$OUT/gpu_tests_e.log" | tail -14
fi
