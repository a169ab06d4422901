#!/usr/bin/env bash
# Second GPU lease of 2026-11-30: the speculative path on CUDA, the verify-step timing with attention=triton, and
# the bf16 CUDA-graph agreement test of attention=triton (after the bool-mask fix). Logs go to $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TFS_TOKENIZER=$PWD/.tok/smollm2
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py::test_speculative_greedy_on_cuda_equals_plain \
  2>&1 | grep -v DEBUG > "$OUT/gpu_spec_tests.log"; tail -3 "$OUT/gpu_spec_tests.log"
timeout 170 python3 bench/bench_gpu_verify.py --model smollm2_135m_random --batch 8 --context 512 --reps 30 \
  -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG > "$OUT/bench_gpu_verify.log"
tail -7 "$OUT/bench_gpu_verify.log"
timeout 140 python3 -m pytest -q -m gpu -p no:cacheprovider \
  "tests/test_attention_backends.py::test_bf16_compiled_agrees_with_sdpa_on_cuda[triton]" 2>&1 | grep -v DEBUG \
  > "$OUT/gpu_bf16_triton.log"; tail -3 "$OUT/gpu_bf16_triton.log"
