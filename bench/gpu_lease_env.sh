# Sourced by the GPU lease scripts (bench/gpu_session12.sh and later), run from the repository root on the device
# machine: the wheels the image lacks (carry .whl), the tokenizer (carry .tok), $OUT, and gpu_tests.
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
