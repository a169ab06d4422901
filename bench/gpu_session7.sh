#!/usr/bin/env bash
# GPU lease 7 (2026-11-30, third session): tfs::gemv launch sweep and layer chain against cuBLAS, then the
# Llama-3-8B-shaped decode step with model.fused_decode=true/false. Usage: bash bench/gpu_session7.sh [a|b]
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TFS_TOKENIZER=$PWD/.tok/smollm2
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
if [ "${1:-a}" = a ]; then
  timeout 280 python3 bench/tune_gemv.py --rows 1 --block-n 8 16 32 --block-k 256 512 1024 --warps 4 8 \
    --stages 3 4 2>&1 | grep -v DEBUG > "$OUT/tune_gemv_rows1.log"; tail -16 "$OUT/tune_gemv_rows1.log"
  for fused in true false; do
    timeout 150 python3 bench/bench_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --steps 30 \
      --modes reduce_overhead -- attention=triton "model.tokenizer=$TFS_TOKENIZER" model.fused_decode=$fused 2>&1 \
      | grep -v DEBUG > "$OUT/bench_gpu_decode_8b_fused_$fused.log"
    tail -2 "$OUT/bench_gpu_decode_8b_fused_$fused.log"
  done
elif [ "$1" = c ]; then
  timeout 150 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 24 \
    -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG > "$OUT/profile_8b_fused_tuned.log"
  grep -A5 "^forward wall" "$OUT/profile_8b_fused_tuned.log"; grep -A24 "^one forward" "$OUT/profile_8b_fused_tuned.log" | tail -12
  timeout 130 python3 bench/bench_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --steps 30 \
    --modes reduce_overhead -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 \
    | grep -v DEBUG > "$OUT/bench_gpu_decode_8b_fused_tuned.log"; tail -2 "$OUT/bench_gpu_decode_8b_fused_tuned.log"
  timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/test_kernels_gemv.py \
    tests/test_gpu.py 2>&1 | grep -v DEBUG > "$OUT/gpu_gemv_tests.log"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_gemv_tests.log" | tail -15
elif [ "$1" = d ]; then
  timeout 150 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 0 \
    -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG > "$OUT/profile_8b_span.log"
  grep -A6 "^forward wall" "$OUT/profile_8b_span.log"
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/test_kernels_gemv.py::test_fused_decode_same_tokens_as_unfused \
    tests/test_gpu.py 2>&1 | grep -v DEBUG > "$OUT/gpu_tests_d.log"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests_d.log" | tail -15
else
  timeout 200 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 40 \
    -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG > "$OUT/profile_8b_fused.log"
  grep -A12 "^forward wall" "$OUT/profile_8b_fused.log"
  timeout 200 python3 bench/tune_gemv.py --rows 1 --block-n 8 16 32 --block-k 256 512 1024 --warps 4 8 \
    --stages 3 4 2>&1 | grep -v DEBUG > "$OUT/tune_gemv_rows1.log"; tail -16 "$OUT/tune_gemv_rows1.log"
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gemv.py 2>&1 | grep -v DEBUG \
    > "$OUT/gpu_gemv_tests.log"; tail -15 "$OUT/gpu_gemv_tests.log"
fi
