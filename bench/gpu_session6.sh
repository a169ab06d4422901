#!/usr/bin/env bash
# GPU lease 6 (2026-11-30): verify-step cost for k = 1, 2, 4, 8 draft tokens against a decode step.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TFS_TOKENIZER=$PWD/.tok/smollm2
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
timeout 540 python3 bench/bench_gpu_verify.py --model smollm2_135m_random --batch 8 --context 512 --reps 30 \
  -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG > "$OUT/bench_gpu_verify.log"
tail -9 "$OUT/bench_gpu_verify.log"
