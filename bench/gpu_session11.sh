#!/usr/bin/env bash
# GPU leases of 2026-11-30 (sixth session). Usage: bash bench/gpu_session11.sh a|b|...
#   a: side-stream L2 prefetch probe; the SmolLM2-shaped fused-decode GPU test (8 layers)
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TFS_TOKENIZER=$PWD/.tok/smollm2
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
if [ "${1:-a}" = a ]; then
  timeout 120 python3 bench/probe_l2_prefetch.py 2>&1 | grep -v DEBUG > "$OUT/probe_l2_side.log"
  tail -20 "$OUT/probe_l2_side.log"
  timeout 300 python3 -m pytest -m gpu -p no:cacheprovider -rA --tb=short \
    "tests/test_kernels_gemv.py::test_fused_decode_same_tokens_as_unfused" > "$OUT/gpu_fused_decode_a.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|^E " "$OUT/gpu_fused_decode_a.log" | tail -12
fi
#   b: split-K attention: V loaded with K (early_v) against after the softmax, small-batch launches, at the decode
#      policy (4 programs per SM) and the verify policy (2 per SM). Ran on a working tree with an EARLY_V launch
#      option (V's load issued right after K's in _attend_range; tune_split_kv --early-v) that was never committed
if [ "${1:-a}" = b ]; then
  for target in 4 2; do
    timeout 200 python3 bench/tune_split_kv.py --configs 1x1024 1x4096 1x32768 8x4096 32x4096 --block-n 64 128 \
      --warps 4 --stages 1 2 --early-v 0 1 --sweep-at $target 64 --targets $target --min-split-lens 64 2>&1 \
      | grep -v DEBUG > "$OUT/tune_split_earlyv_t$target.log"
    echo "programs per SM $target"; tail -28 "$OUT/tune_split_earlyv_t$target.log"
  done
fi
#   c: partial vs merge kernel time of the attention; gemv with RMSNorm applied after the product (LATE_NORM) or
#      before it (--norm-first; in lease c the code had the opposite flag, --late-norm, and LATE_NORM off)
if [ "${1:-a}" = c ]; then
  timeout 120 python3 bench/probe_attention_kernels.py 2>&1 | grep -v DEBUG > "$OUT/probe_attention_kernels.log"
  tail -9 "$OUT/probe_attention_kernels.log"
  for first in --norm-first ""; do
    timeout 200 python3 bench/tune_gemv.py --rows 1 --fused --shapes qkv gate_up lm_head --no-chain $first \
      --block-n 2 4 8 16 --block-k 256 512 1024 --warps 4 --stages 3 --top 6 2>&1 | grep -v DEBUG \
      > "$OUT/tune_gemv_norm$first.log"
    echo "norm: ${first:-after the product}"; tail -9 "$OUT/tune_gemv_norm$first.log"
  done
fi
#   d: 8B decode step before / after LATE_NORM in one lease (prev/ = `git archive 664396e kernels framework bench
#      conf`); a wider launch sweep with LATE_NORM
if [ "${1:-a}" = d ]; then
  [ -d prev ] || { echo "prev/ missing: mkdir prev && git archive 664396e kernels framework bench conf" \
    "| tar -x -C prev"; exit 1; }
  for tree in prev .; do
    (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 bench/profile_gpu_decode.py --model llama3_8b_random \
      --batch 1 --context 1024 --timeline 12 -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 \
      | grep -v DEBUG > "$OUT/profile_8b_d_$(basename $(realpath $tree)).log")
    echo "$tree"; grep -A6 "^forward wall" "$OUT/profile_8b_d_$(basename $(realpath $tree)).log"
  done
  timeout 200 python3 bench/tune_gemv.py --rows 1 --fused --shapes qkv gate_up lm_head --no-chain \
    --block-n 4 8 16 --block-k 512 1024 2048 --warps 4 8 --stages 3 4 --top 8 2>&1 | grep -v DEBUG \
    > "$OUT/tune_gemv_late_wide.log"; tail -11 "$OUT/tune_gemv_late_wide.log"
fi
#   e: merge with one round trip: attention kernels' times; GPU tests of attention, gemv (LATE_NORM), the model
if [ "${1:-a}" = e ]; then
  timeout 90 python3 bench/probe_attention_kernels.py 2>&1 | grep -v DEBUG > "$OUT/probe_attention_kernels_e.log"
  tail -9 "$OUT/probe_attention_kernels_e.log"
  timeout 420 python3 -m pytest -m gpu -p no:cacheprovider -rA --tb=short tests/test_kernels_attention.py \
    tests/test_kernels_gemv.py tests/test_gpu.py > "$OUT/gpu_tests_e.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|^E " "$OUT/gpu_tests_e.log" | tail -40
fi
#   f: the stale-partials test (fixed: a verify's request has at least q_len keys), the 8B step and the attention
#      table with everything of this session
if [ "${1:-a}" = f ]; then
  timeout 60 python3 -m pytest -m gpu -p no:cacheprovider -rA --tb=short \
    "tests/test_kernels_attention.py::test_merge_ignores_stale_partials_on_cuda" > "$OUT/gpu_stale_f.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|^E " "$OUT/gpu_stale_f.log" | tail -6
  timeout 160 python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --timeline 12 \
    -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG > "$OUT/profile_8b_f.log"
  grep -A6 "^forward wall" "$OUT/profile_8b_f.log"; grep -A13 "^one forward" "$OUT/profile_8b_f.log"
  timeout 220 python3 bench/bench_attention.py 2>&1 | grep -v DEBUG > "$OUT/bench_attention_f.log"
  tail -12 "$OUT/bench_attention_f.log"
fi
#   g: programmatic dependent launch between the gemvs of a 32-layer chain (with and without an L2 prefetch of the
#      first weight columns before the wait)
if [ "${1:-a}" = g ]; then
  python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
  timeout 150 python3 bench/tune_gemv.py --rows 1 --chain-only 2>&1 | grep -v DEBUG > "$OUT/chain_pdl.log"
  tail -12 "$OUT/chain_pdl.log"
fi
#   h: a verify's query rows over several programs (max BLOCK_M 16 / 32 / 64), 4 or 8 warps, small batches (needs
#      commit 9b15788: the option was measured, found no gain and reverted)
if [ "${1:-a}" = h ]; then
  timeout 200 python3 bench/tune_split_kv.py --configs 1x1024 1x4096 1x32768 8x4096 --block-n 64 128 --warps 4 8 \
    --stages 1 --block-m 16 32 64 --sweep-at 2 64 --targets 2 4 --min-split-lens 64 2>&1 | grep -v DEBUG \
    > "$OUT/tune_split_block_m.log"; tail -34 "$OUT/tune_split_block_m.log"
fi
#   i: the 32-layer chain's error against the reference with RMSNorm before the product (the old kernel) vs after;
#      gemv GPU tests with the PDL parameters in the kernel (fused-decode cases excluded: lease e ran them)
if [ "${1:-a}" = i ]; then
  timeout 60 python3 bench/tune_gemv.py --rows 1 --chain-only --norm-first 2>&1 | grep -v DEBUG \
    > "$OUT/chain_norm_first.log"
  tail -7 "$OUT/chain_norm_first.log"
  timeout 100 python3 -m pytest -m gpu -p no:cacheprovider -rA --tb=short tests/test_kernels_gemv.py \
    -k "not fused_decode" > "$OUT/gpu_gemv_i.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed|^E " "$OUT/gpu_gemv_i.log" | tail -8
fi
