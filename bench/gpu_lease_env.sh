# Sourced by the GPU lease scripts (bench/gpu_session12.sh and later), run from the repository root on the device
# machine: the wheels the image lacks (carry .whl), the tokenizer (carry .tok), $OUT, gpu_tests and profile_8b.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TFS_TOKENIZER=$PWD/.tok/smollm2
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
# gpu_tests LOG SECONDS PYTEST_ARGS...: the GPU tests, their verdict lines printed
gpu_tests() {
  local log=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -m gpu -p no:cacheprovider -rA --tb=short "$@" > "$OUT/$log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|^E " "$OUT/$log" | tail -40
}
# profile_8b NAME SECONDS ARGS...: the Llama-3-8B-shaped decode step's profile (batch 1, 1k context,
# attention=triton; ARGS: bench/profile_gpu_decode.py options) into $OUT/NAME_<run>.log (one log per run); prints
# the GPU span, the floor when measured, and the median layer (bench/layer_times.py)
run=0
profile_8b() {
  run=$((run + 1))
  local log="${1%.log}_$run.log" limit=$2; shift 2
  timeout "$limit" python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 \
    --timeline 400 "$@" -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v -i "warn\|DEBUG" \
    > "$OUT/$log"
  echo "$*: $(grep -o 'GPU span of one forward.*median): [0-9]* us' "$OUT/$log" | grep -o '[0-9]* us$')"
  grep "HBM floor" "$OUT/$log"
  python3 bench/layer_times.py "$OUT/$log" | tail -2
}
