"""Throughput of the OpenAI-compatible server under concurrent clients (loopback only).

    .venv/bin/python bench/bench_server_load.py --clients 64 --requests 4 --max-tokens 32 \
        -- model=tiny_llama compile=eager scheduler.max_running_requests=64

Starts ``train_free_serve.py run=server run.port=0 <overrides>`` in a subprocess (or uses ``--url`` of a running
server), sends a few warm-up requests, then runs ``--clients`` concurrent clients (the official ``openai`` async
client), each sending ``--requests`` requests one after another: completions and chat, every other one streamed
(``--stream all`` / ``none``: every one, or none; ``--stream mixed none``: each load in turn on one server),
``max_tokens`` each with ``ignore_eos`` so every request generates exactly that many tokens. Prints requests/s,
generated tokens/s (completion tokens over the wall time from the first request to the last answer), the wall time
per engine step (the server's ``tfs_engine_steps_total``) and latency percentiles; ``--json PATH`` also writes them. ``--offline`` also runs the same requests through ``LLM.generate``
in-process (no HTTP, all submitted at once) as the engine's ceiling, and the same requests fed as the clients
feed the server, without HTTP (each of ``--clients`` lanes submits its next request when its previous one has
finished): server / that closed loop is what HTTP, streaming and the engine process cost; the closed loop / all
at once is what the clients' one-at-a-time sending costs (a slot idle between requests, prefills in steps of their
own). ``--profile N`` runs the server's engine loop (``run.profile``) and the offline closed loop under cProfile
and prints, per engine step, the host's time in each and the top N functions of each (``--profile-out DIR`` keeps
the stats files). ``--rounds N`` runs the load
(and the offline reference) N times on the same server (engine) and reports the round with the median tokens/s
beside every round's tokens/s: a load of a few seconds on a GPU varies between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import httpx
import openai

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PROMPTS = ["The quick brown fox", "Once upon a time in a land far away, there lived", "def fibonacci(n):",
           "Q: What is the capital of Italy?\nA:", "Dear Sir or Madam,", "The three primary colors are"]
CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "Count to five."]
DEFAULT_OVERRIDES = ["model=tiny_llama", "compile=eager", "scheduler.max_running_requests=64"]


def start_server(overrides: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, os.path.join(ROOT, "train_free_serve.py"), "run=server", "run.port=0", *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = "-"
    while line and not line.startswith("serving"):
        line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line:
        raise SystemExit(f"the server did not start (exit code {proc.wait()})")
    return proc, line.split()[3].removesuffix("/v1")


async def one_request(client: openai.AsyncOpenAI, model: str, i: int, stream: bool,
                      max_tokens: int) -> dict[str, Any]:
    """One request; returns its latency, time to first token (streams) and completion tokens."""
    extra = {"ignore_eos": True}
    t0 = time.perf_counter()
    first: Optional[float] = None
    if i % 3 == 2:
        kwargs = dict(model=model, messages=[{"role": "user", "content": CHATS[i % len(CHATS)]}],
                      max_tokens=max_tokens, extra_body=extra)
        call = client.chat.completions.create
    else:
        kwargs = dict(model=model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, extra_body=extra)
        call = client.completions.create  # type: ignore[assignment]
    if not stream:
        out = await call(**kwargs)
        tokens = out.usage.completion_tokens
    else:
        tokens = 0
        async for chunk in await call(stream=True, stream_options={"include_usage": True}, **kwargs):
            if first is None and chunk.choices:
                first = time.perf_counter() - t0
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    return {"latency_s": time.perf_counter() - t0, "ttft_s": first, "tokens": tokens}


def engine_steps(url: str, settle: bool = False) -> Optional[tuple[int, int]]:
    """The server's ``tfs_engine_steps_total`` and ``tfs_engine_prefill_steps_total`` (None where it has none;
    0 prefill steps where it counts none); ``settle``: once they stop changing (the loop counts its last steps when
    it goes idle)."""
    last = None
    for _ in range(50):
        try:
            text = httpx.get(url + "/metrics", timeout=10).text
        except httpx.HTTPError:
            return None
        found = {line.split()[0]: int(float(line.split()[-1])) for line in text.splitlines()
                 if line.startswith(("tfs_engine_steps_total ", "tfs_engine_prefill_steps_total "))}
        now = (found["tfs_engine_steps_total"], found.get("tfs_engine_prefill_steps_total", 0)) \
            if "tfs_engine_steps_total" in found else None
        if not settle or now is None or now == last:
            return now
        last = now
        time.sleep(0.06)  # (the loop updates its counters every 50 ms while it works)
    return last


def streamed(stream: str, c: int, j: int) -> bool:
    """Whether client ``c``'s ``j``-th request streams: ``mixed`` every other one, ``all`` or ``none``."""
    return stream == "all" or (stream == "mixed" and (c + j) % 2 == 1)


async def run_load(url: str, model: str, clients: int, per_client: int, max_tokens: int,
                   stream: str = "mixed") -> dict[str, Any]:
    async def one_client(c: int) -> list[dict[str, Any]]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=os.environ.get("TFS_API_KEY", "none"),
                                      max_retries=0, timeout=600) as client:
            return [await one_request(client, model, c * per_client + j, streamed(stream, c, j), max_tokens)
                    for j in range(per_client)]

    steps0 = engine_steps(url)
    t0 = time.perf_counter()
    per = await asyncio.gather(*(one_client(c) for c in range(clients)))
    wall = time.perf_counter() - t0
    steps = engine_steps(url, settle=True)
    done = [r for rs in per for r in rs]
    latencies = sorted(r["latency_s"] for r in done)
    ttfts = sorted(r["ttft_s"] for r in done if r["ttft_s"] is not None)
    tokens = sum(r["tokens"] for r in done)
    counted = (steps[0] - steps0[0], steps[1] - steps0[1]) if steps is not None and steps0 is not None else (None, 0)
    return {"clients": clients, "requests_per_client": per_client, "max_tokens": max_tokens, "stream": stream,
            **load_result(len(done), tokens, wall, *counted), "latency_p50_s": round(statistics.median(latencies), 3),
            "latency_p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
            "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None}


def closed_loop(engine: Any, items: list[dict[str, Any]], clients: int) -> int:
    """``items`` through ``engine`` as the load's clients send them: client ``c`` sends its items (``items[c * n:
    (c + 1) * n]``) one at a time, each submitted as soon as the step that finishes the previous one returns;
    returns the tokens generated."""
    per_client = len(items) // clients
    todo = [list(items[c * per_client:(c + 1) * per_client]) for c in range(clients)]
    lane: dict[int, int] = {}

    def send(c: int) -> None:
        if todo[c]:
            req = engine.make_request(todo[c].pop(0), rid=f"lane{c}-{len(todo[c])}")
            lane[id(req)] = c
            engine.submit(req)

    for c in range(clients):
        send(c)
    tokens = 0
    while engine.has_work():
        for req in engine.step():
            tokens += len(req.output_ids)
            send(lane.pop(id(req)))
    return tokens


def print_profile(stats: pstats.Stats, title: str, top: int, steps: int) -> None:
    """The host's time per engine step (``steps`` of them) and the ``top`` functions by own time."""
    raw = stats.stats  # type: ignore[attr-defined]  # {(file, line, name): (cc, nc, tt, ct, callers)}
    steps = max(steps, 1)
    idle = [k for k in raw if "SimpleQueue" in k[2]]  # the loop waiting for a request while it has no work
    total = sum(v[2] for k, v in raw.items() if k not in idle)
    print(f"\n{title}: {steps} engine steps, {1e6 * total / steps:.0f} us of profiled host time a step, every "
          f"thread (waits for requests while idle left out: {sum(raw[k][2] for k in idle):.2f} s)")
    print("function | calls a step | own us a step")
    busy = sorted(((k, v) for k, v in raw.items() if k not in idle), key=lambda kv: -kv[1][2])
    for (file, line, name), v in busy[:top]:
        where = f"{os.path.basename(file)}:{line}({name})" if line else name
        print(f"{where} | {v[1] / steps:.2f} | {1e6 * v[2] / steps:.1f}")


def counting_steps(engine: Any) -> list[int]:
    """Count ``engine``'s steps from now on (its ``step`` wrapped on the instance); returns the one-item counter."""
    count, step = [0], engine.step

    def counted() -> list:
        count[0] += 1
        return step()

    engine.step = counted
    return count


def run_offline(overrides: list[str], clients: int, per_client: int, max_tokens: int, rounds: int = 1,
                profile: int = 0, profile_out: Optional[str] = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same requests in this process, without HTTP (the median of ``rounds`` runs on one engine): through
    ``LLM.generate``, all submitted at once (the engine's ceiling), and in the clients' closed loop
    (:func:`closed_loop`)."""
    sys.path.insert(0, ROOT)
    from framework import LLM

    llm = LLM(overrides)
    items, requests = [], clients * per_client
    for i in range(requests):
        item: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True}
        if i % 3 == 2:
            item["messages"] = [{"role": "user", "content": CHATS[i % len(CHATS)]}]
        else:
            item["prompt"] = PROMPTS[i % len(PROMPTS)]
        items.append(item)
    llm.generate(items[:4])  # warm-up
    runs: dict[str, list[dict[str, Any]]] = {"at_once": [], "closed_loop": []}
    profiler = cProfile.Profile() if profile else None
    steps, profiled_steps = counting_steps(llm.engine), 0
    for _ in range(rounds):
        for kind, run in (("at_once", lambda: sum(len(o.token_ids) for o in llm.generate(items))),
                          ("closed_loop", lambda: closed_loop(llm.engine, items, clients))):
            t0, steps0, prefills0 = time.perf_counter(), steps[0], llm.engine.scheduler.num_prefill_steps
            if profiler is not None and kind == "closed_loop":
                tokens = profiler.runcall(run)
                profiled_steps += steps[0] - steps0
            else:
                tokens = run()
            wall = time.perf_counter() - t0
            runs[kind].append(load_result(requests, tokens, wall, steps[0] - steps0,
                                          llm.engine.scheduler.num_prefill_steps - prefills0))
    llm.engine.allocator.assert_all_free()
    if profiler is not None:
        print_profile(pstats.Stats(profiler), "offline closed loop (the profiler's cost included)", profile,
                      profiled_steps)
        if profile_out:
            profiler.dump_stats(os.path.join(profile_out, "closed_loop.prof"))
    return median_round(runs["at_once"]), median_round(runs["closed_loop"])


def load_result(requests: int, tokens: int, wall: float, steps: Optional[int],
                prefill_steps: int = 0) -> dict[str, Any]:
    """One run's throughput, and its engine steps (where counted: how many of them prefilled) and wall time per
    step."""
    out = {"requests": requests, "output_tokens": tokens, "wall_s": round(wall, 3),
           "requests_per_s": round(requests / wall, 2), "tokens_per_s": round(tokens / wall, 1)}
    if steps:
        out.update(steps=steps, prefill_steps=prefill_steps, ms_per_step=round(1e3 * wall / steps, 3))
    return out


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median tokens/s (the lower middle one of an even count), with every round's tokens/s."""
    ranked = sorted(rounds, key=lambda r: r["tokens_per_s"])
    return dict(ranked[(len(ranked) - 1) // 2], rounds_tokens_per_s=[r["tokens_per_s"] for r in rounds])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=4, help="requests per client, sent one after another")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the load (and --offline) this many times; report the median round")
    parser.add_argument("--stream", choices=["mixed", "all", "none"], nargs="+", default=["mixed"],
                        help="which requests stream: every other one (mixed), all or none; several: each in turn, "
                             "on the same server")
    parser.add_argument("--url", help="a running server (default: start one with the overrides)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--offline", action="store_true",
                        help="also run the same requests through LLM.generate in-process (no HTTP), for reference")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile the server's engine loop and the offline closed loop; print their top N")
    parser.add_argument("--profile-out", metavar="DIR",
                        help="with --profile: also keep the cProfile stats there (server.prof, closed_loop.prof)")
    parser.add_argument("overrides", nargs="*", help=f"Hydra overrides (default: {' '.join(DEFAULT_OVERRIDES)})")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be at least 1")
    proc = None
    url = args.url
    profile_path = os.path.join(tempfile.mkdtemp(), "engine.prof") if args.profile and url is None else None
    if url is None:
        proc, url = start_server((args.overrides or DEFAULT_OVERRIDES)
                                 + ([f"run.profile={profile_path}"] if profile_path else []))
    server_steps = None
    try:
        model = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("TFS_API_KEY", "none")).models.list()
        model_id = model.data[0].id
        asyncio.run(run_load(url, model_id, 4, 1, 4))  # warm-up
        results = [median_round([asyncio.run(run_load(url, model_id, args.clients, args.requests, args.max_tokens,
                                                      stream)) for _ in range(args.rounds)])
                   for stream in args.stream]
        counters = engine_steps(url, settle=True)
        server_steps = counters[0] if counters is not None else None
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    if profile_path is not None and os.path.exists(profile_path):  # (written when the server stops)
        print_profile(pstats.Stats(profile_path), "server engine loop (warm-up, every round; the profiler's cost "
                      "included)", args.profile, server_steps or 0)
        if args.profile_out:
            os.makedirs(args.profile_out, exist_ok=True)
            shutil.copy(profile_path, os.path.join(args.profile_out, "server.prof"))
    print(f"\n{'stream':>7} {'clients':>8} {'requests':>9} {'tokens':>7} {'wall s':>7} {'req/s':>7} {'tok/s':>8} "
          f"{'steps':>6} {'prefill':>7} {'ms/step':>8} {'p50 s':>6} {'p99 s':>6} {'ttft p50':>9}")
    for r in results:
        print(f"{r['stream']:>7} {r['clients']:>8} {r['requests']:>9} {r['output_tokens']:>7} {r['wall_s']:>7.2f} "
              f"{r['requests_per_s']:>7.1f} {r['tokens_per_s']:>8.1f} {r.get('steps', 0):>6} "
              f"{r.get('prefill_steps', 0):>7} {r.get('ms_per_step', 0):>8.3f} "
              f"{r['latency_p50_s']:>6.2f} {r['latency_p99_s']:>6.2f} {r['ttft_p50_s'] or 0:>9.3f}")
    if args.rounds > 1:
        print(f"(the median of {args.rounds} rounds; tok/s of each: "
              f"{'; '.join(str(r['rounds_tokens_per_s']) for r in results)})")
    result = dict(results[0], model=model_id, by_stream=results)
    if args.offline:
        ref, loop = run_offline(args.overrides or DEFAULT_OVERRIDES, args.clients, args.requests, args.max_tokens,
                                args.rounds, args.profile, args.profile_out)
        result["offline"], result["offline_closed_loop"] = ref, loop
        for what, r in ((f"all {ref['requests']} requests at once", ref),
                        (f"{args.clients} lanes of {args.requests} requests one after another", loop)):
            print(f"offline, {what}: {r['requests_per_s']:.1f} req/s, {r['tokens_per_s']:.1f} tok/s "
                  f"({r['output_tokens']} tokens in {r['wall_s']:.2f} s, {r.get('steps', 0)} steps of which "
                  f"{r.get('prefill_steps', 0)} prefilled, "
                  f"{r.get('ms_per_step', 0):.3f} ms a step)"
                  + (f"; tok/s of each round: {r['rounds_tokens_per_s']}" if args.rounds > 1 else ""))
        for r in results:
            print(f"stream {r['stream']}: server / offline: {r['tokens_per_s'] / ref['tokens_per_s']:.3f}; server / "
                  f"closed loop: {r['tokens_per_s'] / loop['tokens_per_s']:.3f}; closed loop / offline: "
                  f"{loop['tokens_per_s'] / ref['tokens_per_s']:.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
