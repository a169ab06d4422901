#!/usr/bin/env bash
# GPU lease for the next session: the tfs::gemv tests changed after the last GPU run of 2026-11-30 (input checks,
# odd K at one row, the launch count in the fused-decode test), the not-yet-run batch-8 gemv sweep, and the
# Llama-3-8B step (GPU span and forward) as the baseline for the next fusion work.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TFS_TOKENIZER=$PWD/.tok/smollm2
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -rA --tb=short tests/test_kernels_gemv.py \
  > "$OUT/gpu_gemv_tests.log" 2>&1; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_gemv_tests.log" | tail -20
timeout 150 python3 bench/tune_gemv.py --rows 8 --block-n 16 32 64 --block-k 128 256 512 --warps 4 8 --stages 3 \
  2>&1 | grep -v DEBUG > "$OUT/tune_gemv_rows8.log"; tail -14 "$OUT/tune_gemv_rows8.log"
timeout 150 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 0 \
  -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG > "$OUT/profile_8b_span.log"
grep -A6 "^forward wall" "$OUT/profile_8b_span.log"
# verify at (1, 4k) costs 1.30x decode (target 1.2x): the split policy around that shape
timeout 120 python3 bench/tune_split_kv.py --configs 1x4096 1x32768 --block-n 64 128 --warps 4 --stages 2 \
  --targets 1 2 4 8 --min-split-lens 64 128 256 2>&1 | grep -v DEBUG > "$OUT/tune_split_1x4k.log"
tail -20 "$OUT/tune_split_1x4k.log"
