#!/usr/bin/env bash
# GPU leases of 2026-12-01 (seventeenth session), H200. Results: docs/PERFORMANCE.md, "Seventeenth session".
#   qkv (branch exp/qkv-meta-early, a054b5b, against main a1bd3a4): gpu_session22.sh's case e, as its header says
#   cases d to i run on branch step-ends (git checkout step-ends: its STEP_END_OPS knob and bench/probe_*.py are not on
#   main):
#   d, e, f: A/B against a base commit's code unpacked into old/ (untracked, carried with the working tree):
#        mkdir old && git archive BASE kernels bench framework conf train_free_serve.py | tar -x -C old
#      d: the 8B step here and in old/, alternating (D_PAIRS pairs, default 3), then the step's first and last
#         kernels of the last run of each. Ran on branch step-ends (the step's first and last kernels with PDL:
#         tfs::embedding, tfs::final_norm, float32 logits from the lm_head) against BASE a1bd3a4 (main)
#      e: the same for SmolLM2-135M's shape (random weights, batch 1, 1k context), where a fixed cost per step
#         weighs 30 times more
#         Ran once (seventeenth session): every run on step-ends printed nothing before its 60 s limit (old/ ran
#         as always, 3869 / 3851 / 3848 us), and one more run without the profile's timeline, limited to 100 s,
#         printed nothing either. Then no machine was lent for the rest of the session. Next: case g, then f
#      f: the GPU tests of the change: the three ops and their PDL variants, the PDL chain in a CUDA graph, the
#         gemv's lm_head shape, greedy tokens with PDL on / off and fused / unfused
#      g: why step-ends' 8B profile printed nothing (a hang, or a slow compile): the ops' GPU tests and the PDL chain
#         with them (limited), then the profile with compile.pdl=off and with PDL, each under faulthandler
#         (SIGABRT at G_LIMIT s, default 150: the Python stacks of every thread show where it waits)
#      h: after g, the profile with PDL and one of the three step-end ops at a time (framework/models/llama.py
#         STEP_END_OPS), as in g
#         Ran g at 620d16e (second lease of the session): the ops' GPU tests and the PDL chain with them passed (5);
#         compile.pdl=off ran (4150 us); with PDL the run sat in inductor's IR __str__ recursion at 100 s (a text that
#         doubles per layer of custom ops, host side: an ExternKernel's text embeds its inputs' texts)
#      i: which code stringifies the IR: bench/probe_ir_str_caller.py (the profile, stopped at the first
#         ExternKernel.__str__ with the caller's frames), on step-ends with PDL, then the same in old/ (main)
#   p (branch exp/attn-prefetch-o): the decode's partial kernel, after its own loads and stores, pulls into L2 the
#      columns of o_proj's weight that o's PDL launch does not load before its wait (1536.. of 4096, 21 MB at 8B):
#      the attention leaves HBM idle ~7 us a layer. The PDL GPU tests (and a model's tokens with PDL on / off, the
#      prefetch on), then 3 alternating pairs of the 8B step with
#      the prefetch (PREFETCH_NEXT_LINES=2048) and without (=0)
source "$(dirname "$0")/gpu_lease_env.sh"  # set -u, wheels, PYTHONPATH, TFS_TOKENIZER, OUT, gpu_tests, profile_8b

# ends LOG: the first 5 and the last 4 kernels of the first forward in a --timeline log (the step's head and tail)
ends() {
  python3 - "$OUT/$1" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
n = int(re.search(r"in (\d+) kernels", text)[1])
rows = [l for l in text.splitlines() if re.match(r"\s*[\d.]+ \|", l)]
print("\n".join(rows[:5] + ["..."] + rows[n - 4:n]))
PY
}

case "${1:-d}" in
  d|e) model=llama3_8b_random; [ "$1" = e ] && model=smollm2_135m_random
     for r in $(seq "${D_PAIRS:-3}"); do
       profile_8b "here_$1.log" 60 --floor --model "$model"
       (cd old && PYTHONPATH=/tmp/site:$PWD profile_8b "old_$1.log" 60 --floor --model "$model")
     done
     echo "== here: head and tail"; ends "here_${1}_$run.log"
     echo "== old/: head and tail"; ends "old_${1}_$((run + 1)).log" ;;
  f) gpu_tests gpu_f.log 400 tests/test_kernels_step_ends.py tests/test_kernels_pdl.py tests/test_kernels_gemv.py \
       -k "step_ends or ops_equal or chain or lm_head or (pdl_on_and_off and spec0) or smollm2" ;;
  g|h) S=framework.models.llama.STEP_END_OPS c=$1
     one() {  # NAME ARGS...: one profile run under faulthandler, its verdict lines and any Python stacks
       local name=$1; shift
       echo "== $name"
       PYTHONFAULTHANDLER=1 timeout -s ABRT "${G_LIMIT:-150}" python3 bench/profile_gpu_decode.py \
         --model llama3_8b_random --batch 1 --context 1024 --timeline 0 --floor "$@" -- attention=triton \
         "model.tokenizer=$TFS_TOKENIZER" ${PDL_OFF:+compile.pdl=off} > "$OUT/${c}_$name.log" 2>&1
       echo "rc $?"; grep -v -i "warn" "$OUT/${c}_$name.log" | grep -E "GPU span|HBM|File|Thread|Error|error" | head -30
     }
     if [ "$c" = g ]; then
       # -v names each test as it starts, and faulthandler_timeout dumps the stacks of one running over 60 s
       gpu_tests gpu_g.log 200 tests/test_kernels_step_ends.py tests/test_kernels_pdl.py -v \
         -o faulthandler_timeout=60 -k "step_ends or ops_equal or chain"
       tail -4 "$OUT/gpu_g.log"
       PDL_OFF=1 one all_pdl_off
       one all
     else
       one embedding_only --set "$S.final_norm=False" "$S.float_logits=False"
       one final_norm_only --set "$S.embedding=False" "$S.float_logits=False"
       one float_logits_only --set "$S.embedding=False" "$S.final_norm=False"
     fi ;;
  i) timeout 150 python3 bench/probe_ir_str_caller.py --model llama3_8b_random --batch 1 --context 1024 \
       --timeline 0 -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 | grep -v -i warn | tail -30
     echo "== old/"
     cp bench/probe_ir_str_caller.py old/bench/
     (cd old && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 bench/probe_ir_str_caller.py --model llama3_8b_random \
        --batch 1 --context 1024 --timeline 0 -- attention=triton "model.tokenizer=$TFS_TOKENIZER" 2>&1 |
        grep -v -i warn | tail -8) ;;
  p) gpu_tests gpu_p.log 240 tests/test_kernels_pdl.py \
       -k "ops_equal or chain or early_columns or (pdl_on_and_off and spec0)"
     for r in 1 2 3; do
       profile_8b p.log 60 --floor
       profile_8b p.log 60 --floor --set kernels.split_kv_attention.PREFETCH_NEXT_LINES=0
     done ;;
esac
