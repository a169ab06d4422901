"""The OpenAI-compatible server: the official ``openai`` client for completions, chat and streaming; plain HTTP for
malformed requests, auth and disconnects; metrics; and ``run=server`` from the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from framework.config import CONF_DIR, compose
from framework.server import ServerThread
from framework.server.metrics import ServerMetrics
from framework.server.stream import TextDeltas, stop_prefix_len
from tests.conftest import TINY

KEY = "test-key"
MODEL = "tiny-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "Once upon a time in a land far away, there lived"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    """NOTE: with the overlapped loop (as on a GPU), against offline references without it (``tiny_llm``)."""
    config = compose(TINY + ["run=server", "run.engine_process=off", "scheduler.max_running_requests=8",
                             "scheduler.max_context=1024", "scheduler.overlap=on",
                             f"run.api_key={KEY}", f"run.served_model_name={MODEL}"])
    with ServerThread(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def wait_idle(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while server.loop.engine.has_work() or server.loop._live:
        assert time.monotonic() < deadline, "the engine still has work"
        time.sleep(0.01)


# ---- the happy paths, through the openai client -----------------------------------------------------------
def test_models_and_health(server, client, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # no key needed


def test_completion_equals_offline(client, tiny_llm):
    ref = tiny_llm.generate([{"prompt": PROMPT, "max_tokens": 12}])[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12)
    assert out.object == "text_completion" and out.model == MODEL and len(out.choices) == 1
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (ref.num_prompt_tokens, 12)
    assert out.usage.total_tokens == ref.num_prompt_tokens + 12


def test_chat_equals_offline(client, tiny_llm):
    ref = tiny_llm.generate([{"messages": CHAT, "max_tokens": 10}])[0]
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10)
    msg = out.choices[0].message
    assert out.object == "chat.completion" and msg.role == "assistant" and msg.content == ref.text
    assert out.usage.prompt_tokens == ref.num_prompt_tokens and out.usage.completion_tokens == 10
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                          {"type": "text", "text": "of France?"}]}]
    assert client.chat.completions.create(model=MODEL, messages=parts, max_tokens=10).choices[0].message.content \
        == ref.text


def test_streaming_completion_and_usage(client, tiny_llm):
    ref = tiny_llm.generate([{"prompt": PROMPT, "max_tokens": 16}])[0]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == ref.text and len(texts) > 3  # arrives in pieces
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert len({c.id for c in chunks}) == 1


def test_streaming_chat(client, tiny_llm):
    ref = tiny_llm.generate([{"messages": CHAT, "max_tokens": 12}])[0]
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].object == "chat.completion.chunk"


def test_sse_wire_format_ends_with_done(http):
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_sampling_fields_reach_the_engine(client, tiny_llm):
    item = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.9, "top_p": 0.9, "top_k": 20, "seed": 7}
    ref = tiny_llm.generate([item])[0]
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.9, top_p=0.9, seed=7,
                  extra_body={"top_k": 20})
    assert client.completions.create(**kwargs).choices[0].text == ref.text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    assert streamed == ref.text
    greedy = tiny_llm.generate([{"prompt": PROMPT, "max_tokens": 12}])[0]
    assert ref.text != greedy.text


def _stop_across_tokens(tiny_llm, prompt: str) -> tuple[str, str]:
    """A stop string that starts in one generated token and ends in the next, and the text it cuts to."""
    full = tiny_llm.generate([{"prompt": prompt, "max_tokens": 24}])[0]
    decode = tiny_llm.engine.detokenize
    for j in range(4, 20):
        before, at, after = (len(decode(full.token_ids[:k])) for k in (j - 1, j, j + 1))
        stop = full.text[at - 2: at + 2]
        if at - before >= 2 and after - at >= 2 and full.text.find(stop) == at - 2 and stop.strip():
            return stop, full.text[: at - 2]
    pytest.fail("no generated text with a stop string across a token boundary")


def test_stop_string_is_held_back_while_streaming(client, tiny_llm):
    stop, expected = _stop_across_tokens(tiny_llm, PROMPT)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stop=stop)
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_text_deltas_hold_back_partial_characters_and_stop_prefixes():
    deltas = TextDeltas(["STOP"])
    assert deltas.update("ab\ufffd") == "ab"  # half of a multi-byte character
    assert deltas.update("abé") == "é"
    assert deltas.update("abé S") == " "  # "S" may start "STOP"
    assert deltas.update("abé ST") == ""
    assert deltas.update("abé STx") == "STx"  # it did not
    assert deltas.finish("abé STx!") == "!" and deltas.sent == "abé STx!"
    assert stop_prefix_len("xxSTO", ["STOP", "O"]) == 3 and stop_prefix_len("abc", []) == 0


def test_events_cross_the_engine_process_pipe_unchanged():
    """What the engine process sends for each event (``Event.wire``, pickled) is the same event on the other side,
    for every kind, an error's included; a stream without stop strings sends all its text at once."""
    import pickle

    from framework.server.events import Event
    from framework.server.protocol import APIError

    events = [Event("accepted", prompt_tokens=7), Event("delta", text="héllo"),
              Event("finish", text=" end", finish_reason="stop", prompt_tokens=7, completion_tokens=3),
              Event("error", error=APIError("bad field", status=400))]
    for event in events:
        back = Event.from_wire(pickle.loads(pickle.dumps(event.wire(), pickle.HIGHEST_PROTOCOL)))
        assert (back.kind, back.text, back.finish_reason, back.prompt_tokens, back.completion_tokens) == \
            (event.kind, event.text, event.finish_reason, event.prompt_tokens, event.completion_tokens)
        assert (back.error is None) == (event.error is None)
        if event.error is not None:
            assert str(back.error) == str(event.error) and back.error.status == 400
    deltas = TextDeltas([])
    assert deltas.update("ab") == "ab" and deltas.update("abcd") == "cd" and deltas.sent == "abcd"


def test_a_stream_that_falls_behind_gets_what_piled_up_in_one_chunk():
    """Deltas queued behind the one a slow stream wakes for are sent as one chunk (with the finish when it is
    queued too), in order, and nothing is lost."""
    import asyncio

    from framework.server.app import stream_events
    from framework.server.events import Event
    from framework.server.protocol import APIError, ParsedRequest

    async def chunks(events: list[Event]) -> list[dict]:
        queue: asyncio.Queue = asyncio.Queue()
        for event in events:
            queue.put_nowait(event)
        parsed = ParsedRequest("completion", {}, MODEL, stream=True, include_usage=False, max_tokens=None)
        out = [c async for c in stream_events(None, "r", parsed, queue)]  # type: ignore[arg-type]
        assert out[-1] == "data: [DONE]\n\n"
        return [json.loads(c.removeprefix("data: ")) for c in out[:-1]]

    deltas = [Event("delta", t) for t in ("The", " quick", " brown")]
    got = asyncio.run(chunks(deltas + [Event("finish", " fox", "length")]))
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in got] == \
        [("The quick brown fox", "length")]
    err = Event("error", error=APIError("boom", status=500, type="server_error"))
    got = asyncio.run(chunks(deltas[:2] + [err]))
    assert got[0]["choices"][0]["text"] == "The quick" and got[1]["error"]["message"] == "boom"


# ---- bad input: 400 with an OpenAI-style error naming the field; the server keeps serving -----------------
LONG = "hello " * 1100  # more tokens than the 1024-token context

BAD = [
    ("/v1/completions", b"{not json", None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", None, "JSON object"),
    ("/v1/completions", {"max_tokens": 4}, "prompt", "prompt is required"),
    ("/v1/chat/completions", {"max_tokens": 4}, "messages", "messages is required"),
    ("/v1/completions", {"prompt": 42}, "prompt", "prompt must be a string"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "one string"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages", "non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages", "messages[0].content"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, "temperature", "temperature='hot'"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "5"}, "max_tokens", "max_tokens='5'"),
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, "stream", "stream='yes'"),
    ("/v1/completions", {"prompt": "a", "stop": 5}, "stop", "stop=5"),
    ("/v1/completions", {"prompt": "a", "seed": 1.5}, "seed", "seed=1.5"),
    ("/v1/completions", {"prompt": "a", "seed": 2**70}, "seed", "64 bits"),
    ("/v1/chat/completions", {"messages": CHAT, "top_k": -2**64}, "top_k", "64 bits"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, "model", "model='gpt-4' is not served"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens", "max_tokens=0 is not allowed"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -3}, "max_tokens", "max_tokens=-3 is not allowed"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 5000}, "max_tokens", "context window is 1024"),
    ("/v1/completions", {"prompt": "hello " * 1000, "max_tokens": 100}, "max_tokens", "at most 2"),
    ("/v1/completions", {"prompt": LONG}, "prompt", "context window is 1024"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages", "context window"),
    ("/v1/completions", {"prompt": "a", "temperature": -0.5}, "temperature", "temperature=-0.5 is not allowed"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, "top_p", "(0, 1]"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 1.5}, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "a", "n": 2}, "n", "n=2 is not supported"),
    ("/v1/completions", {"prompt": "a", "echo": True}, "echo", "not supported"),
    ("/v1/completions", {"prompt": "a", "ignore_eos": "false"}, "ignore_eos", "expected true or false"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [True]}, "stop_token_ids", "a list of integers"),
    ("/v1/completions", {"prompt": "a", "temperature": 10**400}, "temperature", "... (401 characters)"),
    ("/v1/completions", b'{"prompt": "a", "temperature": 1e999}', "temperature", "temperature=inf is not allowed"),
    ("/v1/completions", b"[" * 100000 + b"]" * 100000, None, "nested too deeply"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -1}, "max_completion_tokens",
     "max_completion_tokens=-1 is not allowed"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 5000}, "max_completion_tokens",
     "max_completion_tokens=5000 is too large"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}}, "response_format",
     "not supported"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice", "not supported"),
]


@pytest.mark.parametrize("path,body,param,needle", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_400_naming_the_field(http, path, body, param, needle):
    for stream in (False, True):
        if stream and not isinstance(body, dict):
            continue
        kwargs = {"json": dict(body, stream=True) if stream and "stream" not in body else body} \
            if isinstance(body, dict) else {"content": body}
        r = http.post(path, **kwargs)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] is None
        assert needle in err["message"] and "\n" not in err["message"]


def test_a_form_post_is_told_to_send_json(http):
    r = http.post("/v1/completions", data={"prompt": "a"})  # application/x-www-form-urlencoded
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "not valid JSON" in message and "application/x-www-form-urlencoded" in message and "\n" not in message


def test_server_keeps_serving_after_bad_requests(client, server):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="a", max_tokens=0)
    assert client.completions.create(model=MODEL, prompt="a", max_tokens=3).usage.completion_tokens == 3
    wait_idle(server)
    server.loop.engine.allocator.assert_all_free()


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key" and "API key" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/models").status_code == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_unknown_route_is_an_openai_error(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


# ---- disconnects, metrics ----------------------------------------------------------------------------------
def test_client_disconnect_aborts_and_frees_kv(server, http, monkeypatch):
    wait_idle(server)
    loop = server.loop
    # the tiny model can finish all 1000 tokens (and free its KV) before a starved client thread reads 3 chunks (seen
    # on a busy 2-core machine, even with the engine paced): after 40 steps the engine waits until the client has left
    step, steps, client_left = loop.engine.step, [0], threading.Event()

    def gated_step():
        steps[0] += 1
        if steps[0] > 40:
            client_left.wait(timeout=60)
        return step()

    monkeypatch.setattr(loop.engine, "step", gated_step)
    try:
        with http.stream("POST", "/v1/completions",
                         json={"prompt": PROMPT, "max_tokens": 1000, "stream": True, "ignore_eos": True}) as r:
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 3:
                    break
            assert loop.engine.allocator.num_used_slots > 0
    finally:
        client_left.set()
    wait_idle(server)  # the stream is closed: the server notices and aborts the request
    record = loop.abort_log[-1]
    assert record.freed_at_step - record.requested_at_step <= 1  # KV freed before the next engine step
    assert record.num_output_tokens < 1000
    assert loop.engine.allocator.num_used_slots == 0
    loop.engine.allocator.assert_all_free()


def test_client_gone_before_a_non_streamed_answer_aborts(server):
    wait_idle(server)
    loop = server.loop
    aborts = len(loop.abort_log)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=httpx.Timeout(60, read=0.3),
                   json={"messages": CHAT, "max_tokens": 900, "ignore_eos": True})
    wait_idle(server)
    assert len(loop.abort_log) == aborts + 1 and loop.abort_log[-1].rid.startswith("chatcmpl-")
    assert loop.abort_log[-1].num_output_tokens < 900
    loop.engine.allocator.assert_all_free()


def test_slow_tokenization_does_not_hold_up_generation(server, client, monkeypatch):
    """Prompts are tokenized off the engine thread: a request still being tokenized (a huge prompt, here one
    whose tokenization waits on an event) does not stop a running request from generating to its end."""
    wait_idle(server)
    engine, started, release = server.loop.engine, threading.Event(), threading.Event()
    make_request = engine.make_request

    def slow(item, rid=None):
        if item.get("prompt") == "slow":
            started.set()
            release.wait(60)
        return make_request(item, rid=rid)

    monkeypatch.setattr(engine, "make_request", slow)
    step, steps = engine.step, [0]

    def gated_step():  # after 40 steps the engine waits for the slow request, so that the long one is still running
        steps[0] += 1
        if steps[0] > 40:
            started.wait(60)
        return step()

    monkeypatch.setattr(engine, "step", gated_step)
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(client.completions.create, model=MODEL, prompt=PROMPT, max_tokens=300,
                              extra_body={"ignore_eos": True})
        while not server.loop._live:  # the long request is generating
            assert not running.done(), running.result()
            time.sleep(0.01)
        waiting = pool.submit(client.completions.create, model=MODEL, prompt="slow", max_tokens=2)
        assert started.wait(30)
        try:
            assert any(len(live.request.output_ids) < 300 for live in list(server.loop._live.values()))
            assert running.result(timeout=60).usage.completion_tokens == 300
            assert not waiting.done()
        finally:
            release.set()
        assert waiting.result(timeout=60).usage.completion_tokens == 2
    wait_idle(server)
    engine.allocator.assert_all_free()


def _thread_cpu_ticks(native_id: int) -> int:
    fields = open(f"/proc/self/task/{native_id}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_idle_engine_loop_sleeps(server):
    wait_idle(server)
    native_id = server.loop._thread.native_id
    before = _thread_cpu_ticks(native_id)
    time.sleep(1.0)
    assert _thread_cpu_ticks(native_id) - before <= 1  # blocked on its queue, not polling


def test_metrics_endpoint(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    wait_idle(server)
    text = httpx.get(server.url + "/metrics").text
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if not s.labels}
    by_reason = {s.labels["finish_reason"]: s.value for fam in text_string_to_metric_families(text)
                 for s in fam.samples if s.name == "tfs_requests_total"}
    assert by_reason["length"] >= 1 and samples["tfs_generation_tokens_total"] >= 5
    assert samples["tfs_prompt_tokens_total"] > 0 and samples["tfs_generation_tokens_per_second"] > 0
    for name in ("tfs_queue_depth", "tfs_running_requests", "tfs_kv_usage_ratio", "tfs_spec_mean_accept_length"):
        assert name in samples
    assert samples["tfs_spec_mean_accept_length"] == 0.0  # no speculation here
    # a prefill and 4 decodes at least; every step the loop ran, counted once it went idle (the loop updates its
    # gauges just after its last step: read again until it has)
    deadline = time.monotonic() + 5
    while samples["tfs_engine_steps_total"] != server.loop.num_steps and time.monotonic() < deadline:
        time.sleep(0.01)
        samples = {s.name: s.value for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
                   for s in fam.samples if not s.labels}
    assert samples["tfs_engine_steps_total"] == server.loop.num_steps >= 5
    # of them the prefill steps (one at least: this request's), as the scheduler counted them
    prefills = server.loop.engine.scheduler.num_prefill_steps
    assert samples["tfs_engine_prefill_steps_total"] == prefills and 1 <= prefills < server.loop.num_steps


def test_prefix_cache_metrics(server, client, tiny_llm):
    """The same long prompt twice: the second is served from the prefix cache, its output unchanged, and /metrics
    reports the hit rate, its sums and the prefilled tokens."""
    prompt = "The committee met on Tuesday to discuss the budget for the coming year. " * 6
    outs = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=6).choices[0].text for _ in range(2)]
    assert outs[0] == outs[1] == tiny_llm.generate([{"prompt": prompt, "max_tokens": 6}])[0].text
    text = httpx.get(server.url + "/metrics").text
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if not s.labels}
    prompt_tokens, hits = samples["tfs_prefix_cache_prompt_tokens_total"], samples["tfs_prefix_cache_hit_tokens_total"]
    assert hits >= 64 and samples["tfs_prefix_cache_hit_rate"] == pytest.approx(hits / prompt_tokens)
    assert samples["tfs_prefill_tokens_total"] <= prompt_tokens - hits  # (other tests' requests may share too)
    assert 0 < samples["tfs_prefix_cache_usage_ratio"] <= 1


def test_spec_mean_accept_length_is_accepted_per_verify_step():
    from framework.request import Request
    from framework.sampling import SamplingParams

    metrics = ServerMetrics()
    for steps, accepted in ((4, 10), (6, 5), (0, 0)):
        req = Request(rid="r", prompt_ids=[1], params=SamplingParams(), seed=0, max_new_tokens=4,
                      finish_reason="length", spec_verify_steps=steps, spec_accepted_tokens=accepted)
        metrics.on_finish(req)
    assert metrics.spec_accept_len._value.get() == pytest.approx(15 / 10)
    metrics.on_tokens(30, now=time.perf_counter())
    assert metrics._tokens_per_s() > 0


# ---- the command line ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_run_server_from_the_command_line(engine_process):
    cmd = [sys.executable, str(CONF_DIR.parent / "train_free_serve.py"), "run=server", "model=tiny_llama",
           "compile=eager", f"run.engine_process={engine_process}"]
    proc = subprocess.Popen(cmd + ["run.port=0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        line = "-"
        while line and not line.startswith("serving"):  # Hydra's log lines go to stdout too
            line = proc.stdout.readline()
        assert line.startswith("serving tiny_llama on http://127.0.0.1:"), "the server did not start"
        url = line.split()[3].removesuffix("/v1")
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        busy = subprocess.run(cmd + [f"run.port={url.rsplit(':', 1)[1]}"], capture_output=True, text=True,
                              timeout=120)
        assert busy.returncode == 2 and "run.port=" in busy.stderr and "cannot listen" in busy.stderr
        assert len(busy.stderr.strip().splitlines()) == 1
        # as a service manager stops it (systemd: every process of the service; the engine process waits to be
        # stopped by the server); Ctrl-C takes the same path
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- speculative decoding behind the server ----------------------------------------------------------------
def test_ngram_speculation_behind_the_server(tiny_llm):
    prompt = "one two three four five one two three four five one two three"
    ref = tiny_llm.generate([{"prompt": prompt, "max_tokens": 24}])[0]
    config = compose(TINY + ["run=server", "run.engine_process=off", "speculative=ngram", "scheduler.max_context=256"])
    with ServerThread(config) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        out = client.completions.create(model="tiny_llama", prompt=prompt, max_tokens=24)
        streamed = list(client.completions.create(model="tiny_llama", prompt=prompt, max_tokens=24, stream=True))
        text = httpx.get(srv.url + "/metrics").text
        wait_idle(srv)
        srv.loop.engine.allocator.assert_all_free()
    assert out.choices[0].text == ref.text and out.usage.completion_tokens == len(ref.token_ids)
    assert "".join(c.choices[0].text for c in streamed) == ref.text
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples["tfs_spec_verify_steps_total"] > 0
    mean = samples["tfs_spec_mean_accept_length"]
    assert mean == pytest.approx(samples["tfs_spec_accepted_tokens_total"] / samples["tfs_spec_verify_steps_total"])
    assert mean >= 1.0  # every verify step emits at least its bonus token


def test_speculation_v2_serves_the_offline_text(tiny_llm):
    """The server over the v2 iteration (n-gram, overlapped): completions and streams carry plain decoding's text."""
    config = compose(TINY + ["run=server", "run.engine_process=off", "scheduler.max_running_requests=4",
                             "scheduler.max_context=1024", "scheduler.overlap=on", "speculative=ngram",
                             "speculative.num_steps=4",
                             f"run.api_key={KEY}", f"run.served_model_name={MODEL}"])
    prompts = [PROMPT, "1, 2, 3, 1, 2, 3, 1, 2,"]
    refs = tiny_llm.generate([{"prompt": p, "max_tokens": 24} for p in prompts])
    with ServerThread(config) as srv:
        assert srv.loop.engine.spec_version == "v2"
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        for prompt, ref in zip(prompts, refs):
            assert c.completions.create(model=MODEL, prompt=prompt, max_tokens=24).choices[0].text == ref.text
            stream = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stream=True)
            assert "".join(chunk.choices[0].text for chunk in stream) == ref.text
        srv.loop.engine.allocator.assert_all_free()


def test_run_profile_writes_the_serving_loops_stats_when_the_server_stops(tmp_path):
    """run.profile: the engine's serving loop runs under cProfile; its pstats file, written at shutdown, holds the
    engine steps that served the requests."""
    import pstats

    path = tmp_path / "engine.prof"
    config = compose(TINY + ["run=server", "run.engine_process=off", f"run.profile={path}"])
    with ServerThread(config) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        out = c.completions.create(model=c.models.list().data[0].id, prompt=PROMPT, max_tokens=6,
                                   extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 6
        assert not path.exists()  # written when the loop ends
    steps = [v[1] for k, v in pstats.Stats(str(path)).stats.items()  # type: ignore[attr-defined]
             if k[0].endswith(os.path.join("framework", "engine.py")) and k[2] == "step"]
    assert steps and steps[0] >= 6
