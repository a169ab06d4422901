"""Load on the server (loopback only): 64 concurrent clients x 4 requests each, completions and chat, streaming
and not. All 256 complete, greedy outputs equal the offline engine's, requests share engine steps, and every KV
slot is free at the end; then again with a KV pool small enough that the scheduler must preempt requests."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from framework.config import compose
from framework.server import ServerThread
from tests.conftest import TINY

CLIENTS, REQUESTS_PER_CLIENT = 64, 4

PROMPTS = ["The quick brown fox", "Once upon a time in a land far away, there lived", "1, 2, 3,",
           "def fibonacci(n):", "Q: What is the capital of Italy?\nA:", "hello " * 30, "x", "Dear Sir or Madam,",
           "The three primary colors are", "import numpy as np\n", "Roses are red,", "In 1492,"]
CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "Say hi.", "Count to five."]
# (kind, prompt or message, max_tokens)
CASES = [("completion", p, 8 + 4 * (i % 4)) for i, p in enumerate(PROMPTS)] + \
        [("chat", c, 6 + 5 * (i % 3)) for i, c in enumerate(CHATS)]


def offline_item(case: tuple[str, str, int]) -> dict:
    kind, text, max_tokens = case
    key = "prompt" if kind == "completion" else "messages"
    return {key: text if kind == "completion" else [{"role": "user", "content": text}], "max_tokens": max_tokens}


async def one_request(client: openai.AsyncOpenAI, case: tuple[str, str, int], stream: bool) -> tuple[str, str]:
    """(text, finish_reason) of one request."""
    kind, text, max_tokens = case
    if kind == "completion":
        out = await client.completions.create(model="tiny_llama", prompt=text, max_tokens=max_tokens, stream=stream)
        if not stream:
            return out.choices[0].text, out.choices[0].finish_reason
        pieces = [(c.choices[0].text, c.choices[0].finish_reason) async for c in out]
    else:
        messages = [{"role": "user", "content": text}]
        out = await client.chat.completions.create(model="tiny_llama", messages=messages, max_tokens=max_tokens,
                                                   stream=stream)
        if not stream:
            return out.choices[0].message.content, out.choices[0].finish_reason
        pieces = [(c.choices[0].delta.content or "", c.choices[0].finish_reason) async for c in out]
    return "".join(t for t, _ in pieces), pieces[-1][1]


async def run_load(url: str, clients: int, per_client: int) -> list[tuple[int, str, str]]:
    """Every client sends its requests one after another; clients run concurrently. Returns (case, text, reason)."""
    async def one_client(i: int) -> list[tuple[int, str, str]]:
        done = []
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
            for j in range(per_client):
                k = (i * per_client + j) % len(CASES)
                text, reason = await one_request(client, CASES[k], stream=(i + j) % 2 == 1)
                done.append((k, text, reason))
        return done

    per = await asyncio.gather(*(one_client(i) for i in range(clients)))
    return [r for rs in per for r in rs]


# roomy: every client's request fits at once; small_kv: 768 KV slots hold about a dozen of the ~60-token requests
POOLS = {"roomy": [], "small_kv": ["kv.max_total_tokens=768"]}


@pytest.fixture(scope="module", params=list(POOLS))
def server(request):
    config = compose(TINY + ["run=server", "run.engine_process=off", "scheduler.max_running_requests=64",
                             "scheduler.max_context=256", *POOLS[request.param]])
    with ServerThread(config) as srv:
        srv.pool = request.param
        yield srv


def test_concurrent_clients_match_offline_and_free_all_kv(server, tiny_llm):
    offline = tiny_llm.generate([offline_item(c) for c in CASES])
    engine = server.loop.engine
    batch_sizes: list[int] = []
    step = engine.step
    engine.step = lambda: (batch_sizes.append(len(engine.scheduler.running)), step())[1]
    try:
        results = asyncio.run(run_load(server.url, CLIENTS, REQUESTS_PER_CLIENT))
    finally:
        engine.step = step
    assert len(results) == CLIENTS * REQUESTS_PER_CLIENT
    for k, text, reason in results:
        assert (text, reason) == (offline[k].text, offline[k].finish_reason), CASES[k]
    assert max(batch_sizes) > 8  # HTTP requests really share engine steps
    if server.pool == "small_kv":
        assert engine.scheduler.num_preemptions > 0  # the pool really ran out, and nothing was lost
    else:
        assert max(batch_sizes) > 16
    deadline = time.monotonic() + 10
    while engine.has_work():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    engine.allocator.assert_all_free()
    finished = server.loop.metrics.requests
    assert sum(finished.labels(finish_reason=r)._value.get() for r in ("stop", "length")) == len(results)
