#!/usr/bin/env bash
# One GPU lease (the device tool): the GPU tests of the speculative and Triton paths, the verify-step timing and the
# Llama-3-8B-shaped decode step with attention=triton. Logs go to $OUT. Run from the repository root with the
# wheels from ../shared/tools/device-wheels.sh in .whl/ and a saved SmolLM2 tokenizer in .tok/smollm2.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TFS_TOKENIZER=$PWD/.tok/smollm2
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
timeout 250 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=6 \
  tests/test_kernels_attention.py::test_store_and_decode_in_a_cuda_graph \
  tests/test_attention_backends.py::test_greedy_equals_sdpa_on_cuda \
  tests/test_attention_backends.py::test_bf16_compiled_agrees_with_sdpa_on_cuda \
  tests/test_gpu.py::test_speculative_greedy_on_cuda_equals_plain 2>&1 | grep -v DEBUG > "$OUT/gpu_tests2.log"
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests2.log" | tail -12
timeout 150 python3 bench/bench_gpu_verify.py --model smollm2_135m_random --batch 8 --context 512 \
  -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG > "$OUT/bench_gpu_verify.log"
tail -8 "$OUT/bench_gpu_verify.log"
timeout 170 python3 bench/bench_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 --steps 30 \
  --modes reduce_overhead -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v DEBUG \
  > "$OUT/bench_gpu_decode_8b.log"
tail -5 "$OUT/bench_gpu_decode_8b.log"
python3 -c "import torch; x=torch.randint(0, 256, (2**31,), dtype=torch.uint8, device='cuda'); y=torch.empty_like(x); y.copy_(x); torch.cuda.synchronize(); import time; s=torch.cuda.Event(enable_timing=True); e=torch.cuda.Event(enable_timing=True); ts=[]
for _ in range(10):
    s.record(); y.copy_(x); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
ts.sort(); print('copy GB/s (read+write):', 2*2**31/ts[5]/1e6)" 2>&1 | tee "$OUT/copy_bw.log"
