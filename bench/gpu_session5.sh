#!/usr/bin/env bash
# GPU lease 5 (2026-11-30): every gpu-marked test except the kernel tests of lease 4.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TFS_TOKENIZER=$PWD/.tok/smollm2
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
timeout 540 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests/test_attention_backends.py \
  tests/test_gpu.py tests/test_fill_bonus_tokens.py 2>&1 | grep -v DEBUG > "$OUT/gpu_tests5.log"
grep -E "passed|failed|FAILED|Error|s call" "$OUT/gpu_tests5.log" | tail -20
