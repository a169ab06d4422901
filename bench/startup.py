"""Engine start-up: how long it takes and which compiled programs it is made of.

    python3 bench/startup.py -- model=smollm2_135m_random attention=triton speculative=ngram
    python3 bench/startup.py --engines none ngram ngram,speculative.adaptive=true -- model=smollm2_135m_random \
        attention=triton model.tokenizer=$TFS_TOKENIZER

Builds one engine per ``--engines`` entry (``DRAFTER,OVERRIDE,...``; ``none``: no speculation) in this process, in
turn, with the Hydra overrides after ``--``, and prints its start-up time and, per compiled function (dynamo's code
name, e.g. ``_forward`` for the model runner, ``_verify_logits_q6`` for speculation v2's prepare-and-verify program of
width 6), how many times dynamo compiled it and the seconds that took (``torch._dynamo.utils.get_compilation_metrics``),
split into dynamo's tracing, AOTAutograd's and inductor's.
The programs that hold the whole model are the large compiles, so their count is most of what start-up is made
of. Engines after the first can reuse inductor's in-process and on-disk caches, so compare first engines (one
call each) when the absolute time matters.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from framework.config import compose  # noqa: E402
from framework.engine import Engine  # noqa: E402


def compile_table(since: int) -> dict[str, list[float]]:
    """code name -> [compiles, seconds, of which the backend's (AOTAutograd and inductor; the rest is dynamo's
    tracing), of which inductor's] over the compilation metrics recorded after the first ``since``."""
    from torch._dynamo.utils import get_compilation_metrics

    table: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for m in list(get_compilation_metrics())[since:]:
        row = table[m.co_name or "?"]
        row[0] += 1
        row[1] += m.entire_frame_compile_time_s or 0.0
        row[2] += getattr(m, "backend_compile_time_s", None) or 0.0
        row[3] += getattr(m, "inductor_compile_time_s", None) or 0.0
    return table


def report_progress(every_s: float, since: int, t0: float, stop: threading.Event) -> None:
    """Every ``every_s`` seconds until ``stop``: the compiles finished so far (a start-up cut short by a time limit
    still shows where its time went)."""
    while not stop.wait(every_s):
        table = compile_table(since)
        done = ", ".join(f"{name} x{int(row[0])} {row[1]:.0f} s" for name, row in table.items())
        print(f"  ... {time.perf_counter() - t0:.0f} s: {done or 'no compile finished yet'}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=["none"], metavar="DRAFTER")
    ap.add_argument("--progress", type=float, default=60.0, metavar="SECONDS",
                    help="print the compiles finished so far this often (0: never)")
    ap.add_argument("extra", nargs="*", help="Hydra overrides for every engine (after --)")
    args = ap.parse_args()
    from torch._dynamo.utils import get_compilation_metrics, set_compilation_metrics_limit

    set_compilation_metrics_limit(1 << 16)  # (64 by default: an adaptive engine compiles more, and indexing from
    # `since` into a full deque would read nothing)
    for spec in args.engines:
        drafter, *own = spec.split(",")
        overrides = list(args.extra) + ([] if drafter == "none" else [f"speculative={drafter}"]) + own
        since = len(list(get_compilation_metrics()))
        t0 = time.perf_counter()
        stop = threading.Event()
        if args.progress > 0:
            threading.Thread(target=report_progress, args=(args.progress, since, t0, stop), daemon=True).start()
        try:
            engine = Engine(compose(["run.progress=false", *overrides]))
        finally:
            stop.set()
        seconds = time.perf_counter() - t0
        table = compile_table(since)
        version = f" ({engine.spec_version})" if engine.spec_worker is not None else ""
        print(f"{spec}{version}: start-up {seconds:.1f} s, {sum(int(row[0]) for row in table.values())} compiles "
              f"taking {sum(row[1] for row in table.values()):.1f} s", flush=True)
        for name, (n, s, backend, inductor) in sorted(table.items(), key=lambda kv: -kv[1][1]):
            print(f"    {name:<36} {int(n):>3} compiles {s:>7.1f} s (dynamo {s - backend:.1f} s, "
                  f"aot {backend - inductor:.1f} s, inductor {inductor:.1f} s)")
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
