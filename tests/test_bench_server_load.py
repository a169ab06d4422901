"""bench/bench_server_load.py's closed-loop reference: the requests reach the engine as the load's clients send them,
at most one per client at a time, each as soon as the previous one has finished, and every token is counted."""

from __future__ import annotations

import os
import sys

import pytest

from framework import LLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

openai = pytest.importorskip("openai")  # (the bench's client)
import bench_server_load  # noqa: E402


def test_closed_loop_keeps_one_request_per_client_in_flight():
    engine = LLM(["model=tiny_llama", "compile=eager", "scheduler.max_running_requests=8"]).engine
    clients, per_client, max_tokens = 3, 4, 5
    items = [{"prompt": f"request {i}", "max_tokens": max_tokens, "ignore_eos": True}
             for i in range(clients * per_client)]
    in_flight, most, order = [0], [0], []
    submit, step = engine.submit, engine.step

    def counted_submit(req):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        order.append(req.prompt_ids)
        return submit(req)

    def counted_step():
        finished = step()
        in_flight[0] -= len(finished)
        return finished

    engine.submit, engine.step = counted_submit, counted_step
    tokens = bench_server_load.closed_loop(engine, items, clients)
    assert tokens == clients * per_client * max_tokens
    assert most[0] == clients  # every client busy at once, never two requests of one client
    # each client's items in its own order: the first of every client, then the others as their lanes free up
    first = [engine.make_request(items[c * per_client], rid="x").prompt_ids for c in range(clients)]
    assert order[:clients] == first and len(order) == len(items)
    engine.allocator.assert_all_free()
