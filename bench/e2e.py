"""End to end: the user's generate job, timed as the CLI reports it, beside the decode forward's GPU time.

    python3 bench/e2e.py                                   # the default cases, overlap on and off
    python3 bench/e2e.py --cases 8b:1 smollm2:8 --overlap on -- model.tokenizer=/path/to/tokenizer
    python3 bench/e2e.py --cases smollm2_random:1 --overlap on --profile 40   # where the host's time goes
    python3 bench/e2e.py --cases smollm2:1 --overlap on --speculative ngram --kernels 25   # and the GPU's
    python3 bench/e2e.py --cases smollm2_random:1 --overlap on --speculative ngram --kernels 25 --timeline 60
    python3 bench/e2e.py --cases smollm2:1 smollm2:8 --overlap on --speculative none ngram --max-tokens 256
    python3 bench/e2e.py --cases smollm2_random:8 --overlap on --set framework.models.llama.FUSED_MAX_ROWS=8
    python3 bench/e2e.py --cases smollm2:1 --overlap on --speculative none layer_skip,speculative.exit_layer=24 \
        layer_skip,speculative.skip_search=true         # DRAFTER,OVERRIDE,...: overrides of that engine only
    python3 bench/e2e.py --cases smollm2:1 smollm2:8 --overlap on --speculative none ngram \
        ngram,speculative.num_steps=2 ngram,speculative.adaptive=true   # adaptive depth: chosen_draft_lengths too
    python3 bench/e2e.py --cases smollm2:8 --overlap on --rounds 3 --speculative ngram ngram,speculative.adaptive=true

Each case ``MODEL:BATCH`` runs the CLI's job code (``framework.jobs.generate``: the same request parsing,
generation loop and metrics as ``train_free_serve.py``) with at most BATCH requests running, then, in the same
process and engine, times one decode forward of BATCH requests at the run's mean context with CUDA events (a graph
replay; median of 50 after warm-up). One engine per model serves all of its cases (built as
``train_free_serve.py model=MODEL attention=triton scheduler.max_running_requests=<largest BATCH>`` builds it, so
its graphs are captured for every batch size up to that); each case sets the scheduler's running limit to BATCH
and the engine's ``overlap``, which is what ``scheduler.max_running_requests`` and ``scheduler.overlap`` set.
Printed per case: the job's tokens/s, its ms per step (wall time over the forwards the job launched; a speculative
iteration counts as one; ``--rounds N``: the case N times, the median round reported), the forward's GPU ms and their ratio (1.0 = the host costs nothing on the critical path);
with ``--speculative`` (one engine per drafter, ``speculative=<drafter>``) also the mean accepted tokens per
iteration and the iteration's GPU time from CUDA events (speculation v2). Each row's ``gc`` gives the garbage
collector's collections during the timed run per generation: [count, ms in all, the longest ms] (a full collection
scans the whole heap a compiled engine's start-up left, unless it is frozen: framework/heap.py). ``--kernels N``:
after each case, one batch of its requests again under torch.profiler (bench/kernel_profile.py): per iteration, the GPU's busy time against
the wall time (what is left is the GPU waiting for the host) and the N kernels that took the most. A drafter that remembers finished requests
(``speculative=suffix``: its corpus of earlier outputs) keeps them across an engine's rounds and cases, so a second
round, or a later case over the same prompts, is a repeat of those prompts for it: for first sight, one case and one
round a command. Where there are several engines (models x
drafters), each runs in a process of its own, one after another, and the table at the end gathers their rows: an
engine built after another in one process runs slower (docs/PERFORMANCE.md, "A second engine in one process");
``--one-process`` builds them all in this one.

- ``8b``: ``llama3_8b_random`` (Llama-3-8B's shape, random weights), the prompts of bench/prompts/grounded.jsonl
  repeated to max(8, BATCH) requests, 256 new tokens each with ``ignore_eos``.
- ``smollm2``: the real SmolLM2-135M GGUF, bench/prompts/grounded.jsonl (``--prompts open``: open.jsonl) repeated
  ``--repeat`` times (at least enough to fill BATCH), greedy, each
  prompt's own ``max_tokens`` (requests end at EOS).
- ``smollm2_random``: SmolLM2's shape with random weights, like ``8b``.
- ``dsa``: ``dsa_small_random`` (DeepSeek-V3.2's MLA and indexer shapes) with ``attention=nsa``, like ``8b``; with
  ``--prompt-tokens N`` the random-weight cases' prompts are the grounded text repeated to about N tokens (the row's
  ``context`` is the measured mean). E.g. index reuse in the MTP draft forward at ~28k tokens, on then off:
  ``python3 bench/e2e.py --cases dsa:1 --overlap on --speculative mtp --prompt-tokens 28000 --new-tokens 64 --
  scheduler.max_context=40960 'compile.batch_sizes=[1]' model.index_share_for_mtp_iteration=true`` (then ``=false``):
  ``gpu_ms_per_iteration`` times ``draft_time_share`` is the draft forward's GPU time.

About 1-2 minutes per 8B case (compilation included) and 30 s per SmolLM2 case on an H200.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from framework.config import compose  # noqa: E402
from framework.engine import Engine, EngineStats  # noqa: E402
from framework.jobs.generate import generate_items, metrics, read_prompts  # noqa: E402
from framework.request import Request  # noqa: E402
from framework.sampling import SamplingParams  # noqa: E402
from framework.speculative.worker import SpecStats  # noqa: E402
from kernel_profile import print_profile, profile_kernels  # noqa: E402
from knobs import add_set_option, apply_sets  # noqa: E402

PROMPTS = ROOT / "bench" / "prompts"  # grounded.jsonl, open.jsonl (--prompts)
MODELS = {"8b": "llama3_8b_random", "smollm2": "smollm2_135m", "smollm2_random": "smollm2_135m_random",
          "dsa": "dsa_small_random"}
ATTENTION = {"dsa": "nsa"}  # the attention backend of each model (default: triton)
DEFAULT_CASES = ["8b:1", "8b:8", "8b:64", "smollm2:1", "smollm2:8"]


def case_items(model: str, batch: int, new_tokens: int, repeat: int, max_tokens: int = 0,
               prompt_tokens: int = 0, prompt_set: str = "grounded") -> list[dict]:
    n = max(8, batch)
    prompts = read_prompts(str(PROMPTS / f"{prompt_set}.jsonl"))
    if prompt_tokens and model != "smollm2":  # a long context: the grounded prompts' text, repeated (~4 chars/token)
        text = " ".join(p.get("prompt") or p["messages"][-1]["content"] for p in prompts if isinstance(p, dict))
        text = text * (4 * prompt_tokens // len(text) + 2)
        return [{"id": i, "prompt": text[7 * i:7 * i + 4 * prompt_tokens], "max_tokens": new_tokens,
                 "ignore_eos": True} for i in range(n)]
    if model == "smollm2":  # at least enough copies to fill the batch
        fixed = {"max_tokens": max_tokens} if max_tokens else {}
        copies = max(repeat, -(-batch // len(prompts)))
        return [dict(p, id=f"{p['id']}-{r}", **fixed) for r in range(copies) for p in prompts]
    return [dict(prompts[i % len(prompts)], id=i, max_tokens=new_tokens, ignore_eos=True) for i in range(n)]


@torch.inference_mode()
def decode_forward_ms(engine: Engine, batch: int, context: int, reps: int = 50) -> float:
    """Median CUDA-event time of one decode forward of ``batch`` requests holding ``context`` tokens."""
    from bench_gpu_decode import forward_times_ms

    gen = torch.Generator().manual_seed(0)
    vocab = min(engine.model.args.vocab_size, 49152)
    reqs = [Request(rid=f"timing-{i}", prompt_ids=torch.randint(0, vocab, (context,), generator=gen).tolist(),
                    params=SamplingParams(max_tokens=8, ignore_eos=True), seed=0, max_new_tokens=8)
            for i in range(batch)]
    for req in reqs:
        engine.submit(req)
    while engine.scheduler.waiting or any(not r.output_ids for r in reqs):
        engine.step()
    engine.drain()
    step = engine.scheduler.schedule()
    times = forward_times_ms(engine, engine.scheduler.build_batch(step), reps)
    for req in reqs:
        engine.abort(req.rid)
    engine.allocator.assert_all_free()
    return statistics.median(times)


def build_engine(name: str, max_batch: int, extra: list[str]) -> Engine:
    return Engine(compose([f"model={MODELS[name]}", f"attention={ATTENTION.get(name, 'triton')}", f"scheduler.max_running_requests={max_batch}",
                           "run.progress=false", *extra]))


@contextlib.contextmanager
def counting_launches(engine: Engine) -> Iterator[list[str]]:
    """The modes of the forwards the engine launches meanwhile (a speculative iteration counts as one)."""
    launches: list[str] = []
    launch = engine.launch_step
    engine.launch_step = lambda step: launches.append(step.mode.name) or launch(step)
    if engine.spec_version == "v1":  # its verify iterations do not go through launch_step
        spec_step = engine.spec_worker.step
        engine.spec_worker.step = lambda step: launches.append(step.mode.name) or spec_step(step)
    try:
        yield launches
    finally:
        del engine.launch_step
        if engine.spec_version == "v1":
            del engine.spec_worker.step


def engine_overlap(engine: Engine, overlap: str) -> str:
    """The overlap a case runs with: off for a v1 speculative engine (it drafts on the host from applied tokens,
    and its config refuses scheduler.overlap=on), else ``overlap``."""
    return "off" if engine.spec_version == "v1" else overlap


@contextlib.contextmanager
def timing_collections() -> Iterator[dict[str, list[float]]]:
    """The garbage collector's collections meanwhile: generation -> their seconds (framework/heap.py)."""
    pauses: dict[str, list[float]] = {}
    start = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            pauses.setdefault(str(info["generation"]), []).append(time.perf_counter() - start[0])

    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


def run_case(engine: Engine, name: str, batch: int, overlap: str, new_tokens: int, repeat: int,
             profile: int = 0, max_tokens: int = 0, prompt_tokens: int = 0, prompt_set: str = "grounded",
             kernels: int = 0, stretch: int = 0) -> dict:
    items = case_items(name, batch, new_tokens, repeat, max_tokens, prompt_tokens, prompt_set)
    engine.scheduler.cfg.max_running_requests = batch
    overlap = engine_overlap(engine, overlap)
    engine.overlap = overlap == "on"
    engine.stats = EngineStats()
    if engine.spec_worker is not None:
        engine.spec_worker.stats = SpecStats(accepted_at_depth=[0] * engine.config.speculative.num_steps)
    profiler = cProfile.Profile() if profile else None
    with counting_launches(engine) as launches, timing_collections() as collections:
        if profiler:
            profiler.enable()
        outputs = generate_items(engine, items, progress=False)
        if profiler:
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(profile)
            print(f"--- {name}:{batch} overlap {overlap}: host functions by own time (cProfile slows the host)\n"
                  + text.getvalue().split("\n\n", 1)[-1].strip(), flush=True)
    summary = metrics(engine, outputs)
    errors = [o.error for o in outputs if o.finish_reason == "error"]
    if errors:
        raise SystemExit(f"{name}:{batch}: {len(errors)} requests failed, e.g. {errors[0]}")
    tokens = [len(o.token_ids) for o in outputs]
    prompt = [o.num_prompt_tokens for o in outputs]
    context = int(statistics.mean(prompt) + statistics.mean(tokens) / 2)
    forward_ms = decode_forward_ms(engine, batch, context)
    step_ms = summary["wall_s"] * 1000 / len(launches)
    row = {"case": f"{name}:{batch}", "model": MODELS[name], "batch": batch, "overlap": overlap, "requests": len(items),
           "output_tokens": summary["num_output_tokens"], "tokens_per_s": summary["tokens_per_s"],
           "wall_s": summary["wall_s"], "forwards": len(launches), "prefill_forwards": launches.count("EXTEND"),
           "step_ms": round(step_ms, 3), "context": context, "forward_ms": round(forward_ms, 3),
           "ratio": round(step_ms / forward_ms, 3), "startup_s": round(engine.startup_s, 1),
           "device": torch.cuda.get_device_name(),
           "frozen_objects": gc.get_freeze_count(),
           # generation -> [collections, their ms in all, the longest ms] during the timed run
           "gc": {g: [len(v), round(sum(v) * 1e3, 2), round(max(v) * 1e3, 2)] for g, v in sorted(collections.items())}}
    if kernels:  # one batch of the requests again (their prompts now cached), under torch.profiler
        def work() -> int:
            with counting_launches(engine) as again:
                generate_items(engine, [dict(it, id=f"{it['id']}-k") for it in items[:batch]], progress=False)
            return sum(m != "EXTEND" for m in again)  # decode steps / speculative iterations

        row["kernels"] = profile_kernels(work, kernels, stretch)
        print_profile(f"{name}:{batch} overlap {overlap}, {len(items[:batch])} requests (prefills not counted as "
                      "iterations, their kernels are)", row["kernels"])
    if engine.spec_worker is not None:  # acceptance and the iteration's GPU split
        sp = engine.config.speculative
        search = (" search" if sp.skip_search else "") + (" adaptive" if sp.adaptive else "")
        row.update(speculative=f"{sp.name}{search} {engine.spec_version}", num_steps=sp.num_steps, topk=sp.topk,
                   num_draft_tokens=sp.num_draft_tokens,
                   **{k: summary[k] for k in ("mean_accept_len", "draft_time_share", "verify_time_share",
                                              "gpu_ms_per_iteration", "gpu_ms_longest_iteration", "skip_search",
                                              "chosen_draft_lengths")
                      if k in summary})
    return row


def median_round(rounds: list[dict]) -> dict:
    """The round with the median tokens/s (the lower middle of an even count), with every round's tokens/s."""
    row = sorted(rounds, key=lambda r: r["tokens_per_s"])[(len(rounds) - 1) // 2]
    return dict(row, rounds_tokens_per_s=[r["tokens_per_s"] for r in rounds]) if len(rounds) > 1 else row


def child_argv(args: argparse.Namespace, cases: list[str], drafter: str | None, json_path: str) -> list[str]:
    """The command line that runs one engine (``cases`` of one model, one drafter) in a process of its own."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--cases", *cases, "--overlap", *args.overlap,
            "--new-tokens", str(args.new_tokens), "--repeat", str(args.repeat), "--prompts", args.prompts,
            "--max-tokens", str(args.max_tokens), "--prompt-tokens", str(args.prompt_tokens),
            "--profile", str(args.profile), "--kernels", str(args.kernels), "--timeline", str(args.timeline),
            "--rounds", str(args.rounds),
            "--json", json_path, "--no-table"]
    if drafter is not None:
        argv += ["--speculative", drafter]
    if args.set:
        argv += ["--set", *args.set]
    return argv + ["--", *args.extra]


def run_in_processes(args: argparse.Namespace, engines: list[tuple[str, str | None]]) -> tuple[list[dict], int]:
    """Each engine's cases in a child process, one after another; returns their rows and the number that failed."""
    rows, failed = [], 0
    for name, drafter in engines:
        cases = [c for c in args.cases if c.split(":")[0] == name]
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            print(f"=== {name} {drafter or 'none'}: a process of its own", flush=True)
            code = subprocess.call(child_argv(args, cases, drafter, out))
            if code != 0 or not os.path.exists(out):
                print(f"=== {name} {drafter or 'none'}: failed (exit code {code})", flush=True)
                failed += 1
                continue
            rows += json.loads(Path(out).read_text())
    return rows, failed


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    print(f"\n{rows[0]['device']}, torch {torch.__version__}")
    print(f"{'case':>16} {'drafter':>10} {'overlap':>7} {'reqs':>5} {'tok/s':>9} {'step ms':>8} {'fwd ms':>7} {'ratio':>6} "
          f"{'accept':>6} {'gpu iter ms':>11}")
    for r in rows:
        drafter = r.get("speculative", "none") + (f" k={r['num_steps']}" if "num_steps" in r else "") + \
            (f" tree {r['num_draft_tokens']}" if r.get("topk", 1) > 1 else "")
        print(f"{r['case']:>16} {drafter:>10} {r['overlap']:>7} {r['requests']:>5} "
              f"{r['tokens_per_s']:>9.1f} {r['step_ms']:>8.3f} {r['forward_ms']:>7.3f} {r['ratio']:>6.3f} {r.get('mean_accept_len', 1.0):>6.2f} "
              f"{r.get('gpu_ms_per_iteration', 0.0):>11.3f}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="MODEL:BATCH, MODEL in " + ", ".join(MODELS))
    ap.add_argument("--overlap", nargs="+", default=["on", "off"], choices=["on", "off"])
    ap.add_argument("--new-tokens", type=int, default=256, help="tokens per request of the random-weight cases")
    ap.add_argument("--repeat", type=int, default=4,
                    help="copies of the prompts for the smollm2 cases (more where the batch needs them)")
    ap.add_argument("--prompts", choices=sorted(p.stem for p in PROMPTS.glob("*.jsonl")), default="grounded",
                    help="bench/prompts/<NAME>.jsonl: input-grounded or open-ended chat prompts, or tasks that share "
                         "structure (shared, shared32)")
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="smollm2 cases: max_tokens of every request (default: each prompt's own)")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="random-weight cases: prompts of this many random token ids (default: the grounded prompts)")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="run each job under cProfile and print its top N host functions (the job's numbers then "
                         "include the profiler's cost)")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="after each case, one batch of its requests under torch.profiler: the GPU's busy share "
                         "and its top N kernels per iteration")
    ap.add_argument("--timeline", type=int, default=0, metavar="N",
                    help="with --kernels: also N consecutive kernels in launch order from the middle of that run, "
                         "each with its time and the gap before it (which kernel of a layer costs what)")
    ap.add_argument("--rounds", type=int, default=1, metavar="N",
                    help="run each case N times on its engine and report the round with the median tokens/s (each "
                         "round's tokens/s in rounds_tokens_per_s): short batch jobs spread by 20-40%% between runs")
    ap.add_argument("--speculative", nargs="+", default=[None], metavar="DRAFTER",
                    help="one engine per drafter (none, ngram, ...; DRAFTER,OVERRIDE,... adds Hydra overrides for "
                         "that engine) for each model, built in this process")
    ap.add_argument("--one-process", action="store_true",
                    help="build every engine in this process (default: each in a process of its own)")
    ap.add_argument("--no-table", action="store_true", help=argparse.SUPPRESS)  # a child of run_in_processes
    add_set_option(ap)
    ap.add_argument("extra", nargs="*", help="Hydra overrides for every case (after --)")
    return ap


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    apply_sets(ap, args.set)
    if not torch.cuda.is_available():
        raise SystemExit("bench/e2e.py needs a CUDA GPU")
    tokenizer = os.environ.get("TFS_TOKENIZER")
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases]
    engines = [(n, d) for n in dict.fromkeys(n for n, _ in cases) for d in args.speculative]
    if len(engines) > 1 and not args.one_process:
        rows, failed = run_in_processes(args, engines)
        print_table(rows)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        raise SystemExit(1 if failed else 0)
    rows = []
    for name, drafter in engines:  # one engine per model and drafter, in the order given
        drafter, *own = drafter.split(",") if drafter else [None]  # DRAFTER,OVERRIDE,...
        extra = list(args.extra) + ([f"speculative={drafter}"] if drafter else []) + own
        if tokenizer and name != "smollm2" and not any(e.startswith("model.tokenizer=") for e in extra):
            extra.append(f"model.tokenizer={tokenizer}")
        engine = build_engine(name, max(b for n, b in cases if n == name), extra)
        for batch in [b for n, b in cases if n == name]:
            for overlap in args.overlap:
                t0 = time.perf_counter()
                rounds = [run_case(engine, name, batch, overlap, args.new_tokens, args.repeat, args.profile,
                                   args.max_tokens, args.prompt_tokens, args.prompts, args.kernels, args.timeline)
                          for _ in range(max(1, args.rounds))]
                rows.append(median_round(rounds))
                print(json.dumps(rows[-1]), f"({time.perf_counter() - t0:.0f} s)", flush=True)
        engine.close()  # the next engine starts from clean compile state (framework/compile_state.py)
        del engine
        torch.cuda.empty_cache()
    if not args.no_table:
        print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
