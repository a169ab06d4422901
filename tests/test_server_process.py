"""The server with its engine loop in a process of its own (``run.engine_process=on``; auto turns it on for CUDA):
the same answers as offline generation, streamed or not; requests refused on the HTTP side; a client that leaves
mid-stream aborts its request in the engine process and frees its KV; metrics rendered there; a start-up error
raised here with its own message; and an engine process that dies fails its live requests instead of hanging them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from framework.config import CONF_DIR, ConfigError, compose
from framework.server import ServerThread
from framework.server.engine_process import EngineProcess
from tests.conftest import TINY
from tests.test_server import CHAT, PROMPT, _stop_across_tokens

MODEL = "tiny-test"


@pytest.fixture(scope="module")
def server():
    config = compose(TINY + ["run=server", "run.engine_process=on", "scheduler.max_running_requests=8",
                             "scheduler.max_context=4096", "scheduler.overlap=on", f"run.served_model_name={MODEL}"])
    with ServerThread(config) as srv:
        assert isinstance(srv.loop, EngineProcess)
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def metrics(server) -> dict[str, float]:
    """Unlabelled samples, plus requests by finish reason as ``requests_<reason>``."""
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.labels:
                out[s.name] = s.value
            elif s.name == "tfs_requests_total":
                out["requests_" + s.labels["finish_reason"]] = s.value
            elif s.name == "tfs_rejected_requests_total":
                out["rejected_" + s.labels["status"]] = s.value
    return out


def wait_idle(server, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["tfs_running_requests"] == 0 and m["tfs_queue_depth"] == 0:
            return m
        assert time.monotonic() < deadline, "the engine still has work"
        time.sleep(0.05)


def test_answers_equal_offline(client, tiny_llm):
    ref = tiny_llm.generate([{"prompt": PROMPT, "max_tokens": 12}, {"messages": CHAT, "max_tokens": 10}])
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12)
    assert out.choices[0].text == ref[0].text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (ref[0].num_prompt_tokens, 12)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10)
    assert chat.choices[0].message.content == ref[1].text
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref[1].text
    assert chunks[-1].usage.completion_tokens == 10


def test_stop_string_while_streaming(client, tiny_llm):
    stop, expected = _stop_across_tokens(tiny_llm, PROMPT)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_bad_request_is_refused_here_and_counted_there(server, client):
    before = metrics(server).get("rejected_400", 0)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5000}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "context window is 4096 tokens" in r.json()["error"]["message"]
    assert metrics(server)["rejected_400"] == before + 1
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3


def test_client_leaving_mid_stream_aborts_and_frees_kv(server):
    before = wait_idle(server).get("requests_abort", 0)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 4000, "stream": True, "ignore_eos": True}) as r:
        for n, line in enumerate(line for line in r.iter_lines() if line.startswith("data: ")):
            if n == 3:
                break
    after = wait_idle(server)  # the engine process hears of the abort and frees the request's KV
    assert after["requests_abort"] == before + 1
    assert after["tfs_kv_usage_ratio"] == 0.0


def test_config_error_in_the_engine_process_is_raised_here():
    config = compose(TINY + ["run=server", "run.engine_process=on", "model.deterministic=true", "attention=flex"])
    srv = ServerThread(config)
    try:
        with pytest.raises(ConfigError, match="attention=flex has no batch-invariant mode"):
            srv.start()
    finally:
        srv.sock.close()


def test_bad_engine_process_value_names_it():
    config = compose(TINY + ["run=server", "run.engine_process=sometimes"])
    srv = ServerThread(config)
    try:
        with pytest.raises(ConfigError, match="run.engine_process='sometimes' is not allowed; expected auto, on or "
                                              "off"):
            srv.start()
    finally:
        srv.sock.close()


def _engine_children(parent: int) -> list[int]:
    """Pids of ``parent``'s spawned (multiprocessing) children, from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                spawned = b"spawn_main" in fh.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and spawned:
            pids.append(int(entry))
    return pids


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_a_server_killed_while_building_leaves_no_engine_process():
    """SIGKILL the HTTP process while its engine is still being built (nobody reads the pipe then): the engine
    process goes too, before it finishes building (it never logs "engine ready")."""
    cmd = [sys.executable, str(CONF_DIR.parent / "train_free_serve.py"), "run=server", "run.port=0",
           "run.engine_process=on", *TINY]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (children := _engine_children(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, "no engine process was started"
            time.sleep(0.02)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60
        while any(_running(pid) for pid in children):
            assert time.monotonic() < deadline, "the engine process outlived the server"
            time.sleep(0.05)
        assert "engine ready" not in proc.stderr.read()  # (its stderr is this pipe; it is gone, so this ends)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_dead_engine_process_fails_live_requests(server):
    """Last in the module: it kills the engine process."""
    fatal = []
    server.loop.on_fatal = fatal.append
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 4000, "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        server.loop._proc.kill()
        rest = [line for line in lines if line.startswith("data: ")]
    assert '"server_error"' in rest[-2] and rest[-1] == "data: [DONE]"
    deadline = time.monotonic() + 10
    while not fatal:  # (called after the live requests' errors went out)
        assert time.monotonic() < deadline, "on_fatal was not called"
        time.sleep(0.01)
    assert len(fatal) == 1 and "exited with code" in str(fatal[0])
    assert httpx.get(server.url + "/health").status_code == 503
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, timeout=60)
    assert r.status_code == 503
