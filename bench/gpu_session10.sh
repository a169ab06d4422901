#!/usr/bin/env bash
# GPU leases of 2026-11-30 (fifth session). Usage: bash bench/gpu_session10.sh a|b|...
#   a: split policy and tile size at short contexts (1 x 1k), and the gemv launch sweep for the small weights
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TFS_TOKENIZER=$PWD/.tok/smollm2
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
if [ "${1:-a}" = a ]; then
  for bn in 32 64 128; do
    timeout 100 python3 bench/tune_split_kv.py --configs 1x1024 1x4096 32x4096 --block-n $bn --warps 4 --stages 2 \
      --targets 4 8 --min-split-lens 32 64 128 2>&1 | grep -v DEBUG > "$OUT/tune_split_short_bn$bn.log"
    echo "BLOCK_N $bn"; tail -19 "$OUT/tune_split_short_bn$bn.log"
  done
  timeout 60 python3 bench/tune_split_kv.py --configs 1x1024 --block-n 32 64 --warps 2 4 --stages 1 2 3 --targets 8 \
    --min-split-lens 32 --sweep-at 8 32 2>&1 | grep -v DEBUG > "$OUT/tune_split_1k_launch.log"; tail -22 "$OUT/tune_split_1k_launch.log"
  timeout 240 python3 bench/tune_gemv.py --rows 1 --shapes qkv o down --no-chain --block-n 2 4 8 16 \
    --block-k 512 1024 2048 --warps 4 8 --stages 3 4 --top 12 2>&1 | grep -v DEBUG > "$OUT/tune_gemv_small.log"
  tail -16 "$OUT/tune_gemv_small.log"
fi
#   b: decode launch at every shape with short splits; gemv sweep with the layer's fusions; L2-hot gemv
if [ "${1:-a}" = b ]; then
  timeout 200 python3 bench/tune_split_kv.py --configs 1x1024 1x4096 1x32768 8x4096 32x4096 64x32768 \
    --block-n 32 64 128 --warps 4 --stages 1 2 --sweep-at 4 32 --targets 4 --min-split-lens 32 2>&1 | grep -v DEBUG \
    > "$OUT/tune_split_all.log"; tail -30 "$OUT/tune_split_all.log"
  timeout 240 python3 bench/tune_gemv.py --rows 1 --fused --shapes qkv o gate_up down --no-chain --block-n 2 4 8 16 \
    --block-k 256 512 1024 2048 --warps 4 8 --stages 3 --top 10 2>&1 | grep -v DEBUG > "$OUT/tune_gemv_fused.log"
  tail -14 "$OUT/tune_gemv_fused.log"
  timeout 60 python3 bench/tune_gemv.py --rows 1 --hot --shapes qkv o --no-chain --block-n 2 16 --block-k 1024 \
    --warps 4 --stages 3 2>&1 | grep -v DEBUG > "$OUT/tune_gemv_hot.log"; tail -6 "$OUT/tune_gemv_hot.log"
fi
#   c: L2 prefetch probe; gemv A/B for gate_up, down, lm_head with fusions; attention kernels' GPU tests and table
#      with the batch-dependent launch
if [ "${1:-a}" = c ]; then
  timeout 90 python3 bench/probe_l2_prefetch.py 2>&1 | grep -v DEBUG > "$OUT/probe_l2.log"; tail -12 "$OUT/probe_l2.log"
  timeout 150 python3 bench/tune_gemv.py --rows 1 --fused --shapes gate_up down lm_head --no-chain --block-n 2 8 16 \
    --block-k 256 1024 --warps 4 --stages 3 --top 8 2>&1 | grep -v DEBUG > "$OUT/tune_gemv_ab.log"
  tail -11 "$OUT/tune_gemv_ab.log"
  timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -rA --tb=short tests/test_kernels_attention.py \
    > "$OUT/gpu_attention_tests.log" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_attention_tests.log" | tail -8
  timeout 200 python3 bench/bench_attention.py 2>&1 | grep -v DEBUG > "$OUT/bench_attention.log"
  tail -12 "$OUT/bench_attention.log"
fi
#   d: the 8B decode step with the new launches (attention by batch, down's gemv), then the GPU tests
if [ "${1:-a}" = d ]; then
  timeout 170 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 12 \
    -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG > "$OUT/profile_8b_d.log"
  grep -A6 "^forward wall" "$OUT/profile_8b_d.log"; grep -A13 "^one forward" "$OUT/profile_8b_d.log"
  timeout 260 python3 -m pytest -m gpu -p no:cacheprovider -rA --tb=short tests/test_gpu.py \
    tests/test_kernels_gemv.py > "$OUT/gpu_tests_d.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|^E " "$OUT/gpu_tests_d.log" | tail -30
fi
#   e: rope tables read by position inside tfs::rope_store_kv (no per-layer gather kernels): its GPU tests, the 8B
#      step, tests/test_gpu.py
if [ "${1:-a}" = e ]; then
  timeout 100 python3 -m pytest -m gpu -p no:cacheprovider -rA --tb=short tests/test_kernels_rope_store.py \
    > "$OUT/gpu_rope_tests_e.log" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed|^E " "$OUT/gpu_rope_tests_e.log" | tail -8
  timeout 170 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 12 \
    -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG > "$OUT/profile_8b_e.log"
  grep -A6 "^forward wall" "$OUT/profile_8b_e.log"; grep -A13 "^one forward" "$OUT/profile_8b_e.log"
  timeout 250 python3 -m pytest -m gpu -p no:cacheprovider -rA --tb=short tests/test_gpu.py > "$OUT/gpu_tests_e.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|^E " "$OUT/gpu_tests_e.log" | tail -14
fi
#   f: before / after the in-kernel rope gather in one lease (prev/ = `git archive HEAD~1 kernels framework bench
#      conf`), then the SmolLM2-shaped fused-decode test
if [ "${1:-a}" = f ]; then
  [ -d prev ] || { echo "prev/ missing: mkdir prev && git archive HEAD~1 kernels framework bench conf | tar -x -C prev"; exit 1; }
  for tree in prev .; do
    (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 140 python3 bench/profile_gpu_decode.py --model llama3_8b_random \
      --batch 1 --context 1024 --timeline 0 -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 \
      | grep -v DEBUG > "$OUT/profile_8b_f_$(basename $(realpath $tree)).log")
    echo "$tree"; grep -A6 "^forward wall" "$OUT/profile_8b_f_$(basename $(realpath $tree)).log"
  done
  timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -rA --tb=short \
    "tests/test_kernels_gemv.py::test_fused_decode_same_tokens_as_unfused" > "$OUT/gpu_fused_f.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|^E " "$OUT/gpu_fused_f.log" | tail -8
fi
