#!/usr/bin/env bash
# GPU lease 3 (2026-11-30): the split-K kernel's launch sweep and a profile of the Llama-3-8B-shaped decode step.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TFS_TOKENIZER=$PWD/.tok/smollm2
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
timeout 300 python3 bench/tune_split_kv.py 2>&1 | grep -v DEBUG > "$OUT/tune_split_kv.log"; tail -40 "$OUT/tune_split_kv.log"
timeout 240 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 \
  -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG > "$OUT/profile_8b.log"
tail -36 "$OUT/profile_8b.log"
