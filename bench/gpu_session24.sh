#!/usr/bin/env bash
# GPU leases of 2026-12-01 (eighteenth session), H200. Results: docs/PERFORMANCE.md, "Eighteenth session".
#   On branch step-ends, after its 01ee101 (inductor's fallbacks registered before the compile: the hang is gone):
#     bash bench/gpu_session23.sh i    who stringified the IR (inductor's implicit fallback, on the branch and main)
#     bash bench/gpu_session23.sh d    the A/B against main (a1bd3a4's code) unpacked into old/
#     bash bench/gpu_session24.sh t    (on step-ends, 67de6f3: its copy of this script has case t) the tail's best
#        case: alternating the branch as it is, STEP_END_OPS.probe_norm_in_lm_head=True (the lm_head applies the
#        final norm, no final-norm kernel, wrong hidden states that plain decode does not read), and the branch with
#        only its embedding kernel
#   m (main, after 5a9888c: the fallback registration landed): the compiled CUDA paths' GPU tests (logits against
#      transformers under reduce-overhead, spec == plain, PDL on / off tokens, the PDL chain) and two 8B profiles
#      (tests/test_inductor_fallbacks.py has no GPU tests: -m gpu deselects it). Its PDL tests ran past the 330 s
#      limit; then, in a second call: gpu_tests gpu_m2.log 200 tests/test_kernels_pdl.py -k "chain or pdl_on_and_off"
source "$(dirname "$0")/gpu_lease_env.sh"  # set -u, wheels, PYTHONPATH, TFS_TOKENIZER, OUT, gpu_tests, profile_8b
case "${1:-m}" in
  m) gpu_tests gpu_m.log 330 tests/test_gpu.py tests/test_kernels_pdl.py tests/test_inductor_fallbacks.py
     profile_8b m.log 60 --floor
     profile_8b m.log 60 --floor ;;
esac
