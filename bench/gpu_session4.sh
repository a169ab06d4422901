#!/usr/bin/env bash
# GPU lease 4 (2026-11-30): split policy sweep with the chosen launch, the attention benchmark, the kernel tests and
# the Llama-3-8B-shaped decode step, after the split-K kernel changes.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TFS_TOKENIZER=$PWD/.tok/smollm2
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
timeout 100 python3 bench/tune_split_kv.py --block-n 128 --warps 4 --stages 2 --targets 2 4 \
  --min-split-lens 128 512 2>&1 | grep -v DEBUG > "$OUT/tune_policy.log"; tail -18 "$OUT/tune_policy.log"
timeout 80 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_attention.py 2>&1 | grep -v DEBUG \
  > "$OUT/gpu_kernel_tests.log"; tail -3 "$OUT/gpu_kernel_tests.log"
timeout 230 python3 bench/bench_attention.py 2>&1 | grep -v DEBUG > "$OUT/bench_attention.log"
tail -11 "$OUT/bench_attention.log"
timeout 170 python3 bench/bench_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --steps 30 \
  --modes reduce_overhead -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG \
  > "$OUT/bench_gpu_decode_8b.log"
tail -3 "$OUT/bench_gpu_decode_8b.log"
