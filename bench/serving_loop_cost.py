"""The server's engine loop's own work per step, apart from the engine: what a step costs the engine process beyond
``Engine.step`` (each live request's news, streamed text deltas, events pickled and written to the pipe).

A stub engine stands in for the real one: each step appends one random token to every request (and feeds it to the
request's incremental detokenizer where the request streams, as the scheduler does), so what is timed is
:class:`framework.server.loop.EngineLoop`'s ``_publish`` and ``_flush`` with the engine process's pipe sink, the
pipe read by another process. Requests restart every ``--tokens`` steps (their text grows to that length and no
further). Prints the median over ``--runs`` of the microseconds a step, with and without the loop's work.

    .venv/bin/python bench/serving_loop_cost.py --requests 8 --streamed 4 -- model.tokenizer=smollm2

On the CPU machine this runs in about 10 s.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from framework.config import ModelConfig  # noqa: E402
from framework.detokenizer import IncrementalDetokenizer  # noqa: E402
from framework.request import Request  # noqa: E402
from framework.sampling.params import SamplingParams  # noqa: E402
from framework.server.engine_process import _PipeSink, pipe_sender  # noqa: E402
from framework.server.loop import EngineLoop, _Submission  # noqa: E402
from framework.server.stream import TextDeltas  # noqa: E402
from framework.tokenizer import load_tokenizer  # noqa: E402


class StubEngine:
    """What the loop needs of an engine: every step gives each request one token."""

    def __init__(self, tokenizer: Any, rng: random.Random) -> None:
        self.tokenizer, self.rng, self.live = tokenizer, rng, []

    def new_detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer)

    def submit(self, req: Request) -> None:
        self.live.append(req)

    def has_work(self) -> bool:
        return True

    def step(self) -> None:
        for req in self.live:
            token = self.rng.randrange(1000, 20000)
            req.output_ids.append(token)
            if req.detokenizer is not None:
                req.detokenizer.add(token)


def drain(conn: Any) -> None:
    """The HTTP process's side of the pipe: read every message."""
    while True:
        try:
            conn.recv()
        except EOFError:
            return


def run(loop: EngineLoop, engine: StubEngine, steps: int, tokens: int, serve: bool) -> float:
    """Microseconds a step over ``steps`` steps (``serve``: with the loop's publish and flush)."""
    t0 = time.perf_counter()
    for i in range(steps):
        if i % tokens == 0:  # new requests in the same slots
            for live in loop._live.values():
                live.request.output_ids.clear()
                live.num_tokens_seen = 0
                if live.deltas is not None:
                    live.deltas, live.request.detokenizer = TextDeltas([]), engine.new_detokenizer()
        engine.step()
        if serve:
            loop._publish()
            loop._flush()
    return 1e6 * (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8, help="live requests")
    ap.add_argument("--streamed", type=int, default=4, help="of them, streaming")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per request")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("overrides", nargs="*", help="model.tokenizer=NAME|DIR (default smollm2)")
    args = ap.parse_args()
    name = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("model.tokenizer=")), "smollm2")
    engine = StubEngine(load_tokenizer(ModelConfig(tokenizer=name)), random.Random(0))
    loop = EngineLoop(lambda: None)
    loop.engine = engine
    ours, theirs = mp.Pipe()
    reader = mp.get_context("fork").Process(target=drain, args=(theirs,), daemon=True)
    reader.start()
    sink = _PipeSink(pipe_sender(ours))
    for i in range(args.requests):
        req = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=args.tokens), 0, args.tokens)
        loop._admit(_Submission(f"r{i}", SimpleNamespace(stream=i < args.streamed), req, f"r{i}", sink))
    loop._flush()
    run(loop, engine, args.tokens, args.tokens, True)  # warm-up
    alone = statistics.median(run(loop, engine, args.steps, args.tokens, False) for _ in range(args.runs))
    served = statistics.median(run(loop, engine, args.steps, args.tokens, True) for _ in range(args.runs))
    print(f"{args.requests} requests ({args.streamed} streamed), {args.tokens} tokens each: the stub engine's step "
          f"{alone:.1f} us, with the loop's publish and flush {served:.1f} us: **{served - alone:.1f} us a step** "
          f"of serving work (median of {args.runs} runs of {args.steps} steps)")
    ours.close()
    reader.terminate()


if __name__ == "__main__":
    main()
