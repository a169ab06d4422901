"""The engine loop in its own process, so that the HTTP side never competes with it for the GIL.

``run.engine_process`` (auto: on for CUDA). In one process the event loop's per-token work (SSE chunks, socket
writes, JSON) and the engine thread's host work (scheduling, launches, sampling bookkeeping) take turns on one GIL,
so a streaming server's step is the sum of both; SGLang and vLLM run their schedulers in processes of their own for
this reason. Here the HTTP process keeps uvicorn, the app, the tokenizer (tokenization and validation stay on its
tokenizer thread) and one reader thread; a spawned engine process runs :class:`EngineLoop` unchanged. One pipe
joins them:

- HTTP -> engine: ("submit", rid, parsed, request), ("abort", rid), ("reject", status), ("metrics",), ("stop",);
- engine -> HTTP: ("ready", info) or ("startup_error", err) once, then ("events", [(rid, Event), ...]) once per
  engine iteration, ("metrics", body, content_type), ("fatal", err).

:class:`EngineProcess` has the interface of :class:`EngineLoop` that the app uses (``prepare``, ``submit``, ``abort``,
``metrics``, ``alive``, ``max_context``). The engine's metrics live in the engine process (the loop feeds them as
in one process); ``GET /metrics`` asks for their rendering. If the engine process dies, every live request gets a
server error and ``on_fatal`` stops the server.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable, Optional

from prometheus_client import CONTENT_TYPE_LATEST

from framework.config import Config
from framework.request import Request
from framework.request_parsing import parse_request
from framework.server.events import AsyncioSink, Event
from framework.server.loop import EngineLoop
from framework.server.protocol import APIError, ParsedRequest, prepare_request

log = logging.getLogger(__name__)


def _portable(err: BaseException) -> BaseException:
    """``err`` if it survives pickling, else a RuntimeError with its text (an error must reach the other side)."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - any unpicklable error
        return RuntimeError(f"{type(err).__name__}: {err}")


class _PipeSink:
    """The engine process's sink: one message per iteration, the targets being request ids."""

    def __init__(self, send: Callable[[tuple], None]) -> None:
        self.send = send

    def deliver(self, items: list[tuple[Any, Event]]) -> None:
        self.send(("events", [(target, event.wire()) for target, event in items]))


def pipe_sender(conn: Any) -> Callable[[tuple], None]:
    """The engine process's ``send(message)`` on ``conn``: any thread; the message pickled as ``conn.send`` would,
    without its pickler's set-up for every message (the HTTP side reads it with ``conn.recv``)."""
    lock = threading.Lock()

    def send(message: tuple) -> None:
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        with lock:
            conn.send_bytes(data)

    return send


def _die_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel SIGKILL this process when the thread that started it ends (PR_SET_PDEATHSIG, as
    SGLang's subprocesses do), so that an HTTP process killed while the engine is still being built (when nothing
    reads the pipe) leaves no engine behind holding the GPU; exit at once if it is already gone."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the pipe's closing still ends the engine once it is built
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def engine_main(config: Config, conn: Any, parent_pid: int) -> None:
    """The engine process: build the engine, then serve the pipe's commands until "stop" or the pipe closes."""
    _die_with_parent(parent_pid)
    from framework.engine import Engine

    # A terminal's Ctrl-C, or a service manager's SIGTERM to every process of the server, also reaches the HTTP
    # process, which lets its requests finish and then stops this one (or this one sees the pipe close)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=config.log_level, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    send = pipe_sender(conn)
    loop = EngineLoop(lambda: Engine(config), profile=config.run.profile)
    try:
        loop.start()
    except BaseException as err:  # noqa: BLE001 - handed to the HTTP process, which raises it
        send(("startup_error", _portable(err)))
        return
    engine = loop.engine
    loop.on_fatal = lambda err: send(("fatal", _portable(err)))
    send(("ready", {"tokenizer": engine.tokenizer, "vocab_size": engine.model.args.vocab_size,
                    "max_context": engine.max_context}))
    sink = _PipeSink(send)
    try:
        while loop.alive:
            if not conn.poll(0.5):
                continue
            message = conn.recv()
            kind = message[0]
            if kind == "submit":
                _, rid, parsed, request = message
                try:
                    loop.enqueue(rid, parsed, request, rid, sink)
                except APIError as err:
                    sink.deliver([(rid, Event("error", error=err))])
            elif kind == "abort":
                loop.abort(message[1])
            elif kind == "reject":
                loop.metrics.on_reject(message[1])
            elif kind == "metrics":
                send(("metrics", *loop.metrics.render()))
            elif kind == "stop":
                break
    except (EOFError, OSError):  # the HTTP process is gone
        pass
    finally:
        loop.stop()


class _RemoteMetrics:
    """The app's view of the engine process's metrics: rejects are sent there, renderings fetched from there."""

    def __init__(self, owner: "EngineProcess") -> None:
        self._owner = owner
        self._lock = threading.Lock()
        self.replies: queue.SimpleQueue = queue.SimpleQueue()

    def on_reject(self, status: int) -> None:
        self._owner.send(("reject", status))

    def render(self, timeout: float = 10.0) -> tuple[bytes, str]:
        with self._lock:
            while not self.replies.empty():  # a reply that came after its caller gave up
                self.replies.get_nowait()
            if not self._owner.send(("metrics",)):
                return b"", CONTENT_TYPE_LATEST
            try:
                return self.replies.get(timeout=timeout)
            except queue.Empty:
                return b"", CONTENT_TYPE_LATEST


class EngineProcess:
    """An :class:`EngineLoop` in a spawned process, driven from this one; see the module docstring."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = _RemoteMetrics(self)
        self.fatal_error: Optional[BaseException] = None
        self.on_fatal: Optional[Callable[[BaseException], None]] = None
        ctx = mp.get_context("spawn")
        self._conn, self._child_conn = ctx.Pipe()
        # not a daemon: a tensor-parallel engine starts rank processes of its own
        self._proc = ctx.Process(target=engine_main, args=(config, self._child_conn, os.getpid()), name="engine")
        self._send_lock = threading.Lock()
        self._handles: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._handles_lock = threading.Lock()
        self._dead = False
        self._stopping = False
        self._make_request: Optional[Callable[..., Request]] = None
        self._max_context = 0
        self._reader = threading.Thread(target=self._read, name="engine-pipe", daemon=True)
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    # ---- control ------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine process and wait until its engine is built; re-raise the error if building failed.
        NOTE: the engine process is killed when the thread that calls this ends (``_die_with_parent``): call it from
        a thread that lives as long as the server (the main thread, as ``serve`` and ``ServerThread`` do)."""
        self._proc.start()
        self._child_conn.close()
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            raise RuntimeError(f"the engine process exited with code {self._proc.exitcode} before its engine was "
                               f"built; see its log above") from None
        if kind == "startup_error":
            self._proc.join(30)
            raise payload
        self._max_context = payload["max_context"]
        self._make_request = partial(parse_request, tokenizer=payload["tokenizer"], vocab_size=payload["vocab_size"],
                                     max_context=self._max_context, sampling=self.config.sampling)
        self._reader.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine process (its live requests get "the server is shutting down") and wait for it."""
        self._stopping = True
        self.send(("stop",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("the engine process did not stop within %.0f s; killing it", timeout)
            self._proc.kill()
            self._proc.join(10)
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    @property
    def alive(self) -> bool:
        return self._proc.is_alive() and not self._dead

    @property
    def max_context(self) -> int:
        return self._max_context

    def send(self, message: tuple) -> bool:
        """Send a command to the engine process; False if it is gone."""
        if self._dead:
            return False
        try:
            with self._send_lock:
                self._conn.send(message)
            return True
        except (OSError, ValueError):  # the pipe is closed
            return False

    # ---- requests (the asyncio event loop) ----------------------------------------------------------------
    async def prepare(self, rid: str, parsed: ParsedRequest) -> Request:
        """Tokenize and validate a request on this process's tokenizer thread; raises :class:`APIError`."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_thread, prepare_request, self._make_request, self._max_context, rid, parsed)

    def submit(self, rid: str, parsed: ParsedRequest, request: Request) -> asyncio.Queue:
        """Send a prepared request to the engine; its events arrive on the returned queue."""
        events: asyncio.Queue = asyncio.Queue()
        with self._handles_lock:
            self._handles[rid] = (events, asyncio.get_running_loop())
        if not self.send(("submit", rid, parsed, request)):
            with self._handles_lock:
                self._handles.pop(rid, None)
            raise APIError("the engine loop is not running", status=503, type="server_error")
        return events

    def abort(self, rid: str) -> None:
        """Abort a request whose client went away; its KV is freed before the engine's next step."""
        with self._handles_lock:
            self._handles.pop(rid, None)
        self.send(("abort", rid))

    # ---- the reader thread ----------------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                kind, *payload = self._conn.recv()
                if kind == "events":
                    self._dispatch([(rid, Event.from_wire(fields)) for rid, fields in payload[0]])
                elif kind == "metrics":
                    self.metrics.replies.put((payload[0], payload[1]))
                elif kind == "fatal":
                    self.fatal_error = payload[0]
        except (EOFError, OSError):
            pass
        self._dead = True
        self._proc.join(5)
        if self._stopping and self.fatal_error is None:
            return
        if self.fatal_error is None:
            self.fatal_error = RuntimeError(f"the engine process exited with code {self._proc.exitcode}")
        log.error("%s", self.fatal_error)
        error = APIError("the engine failed; see the server log", status=500, type="server_error")
        with self._handles_lock:
            handles, self._handles = self._handles, {}
        self._dispatch_to(handles, [(rid, Event("error", error=error)) for rid in handles])
        if self.on_fatal is not None:
            self.on_fatal(self.fatal_error)

    def _dispatch(self, items: list[tuple[str, Event]]) -> None:
        with self._handles_lock:
            handles = {rid: self._handles[rid] for rid, _ in items if rid in self._handles}
            for rid, event in items:
                if event.kind in ("finish", "error"):
                    self._handles.pop(rid, None)
        self._dispatch_to(handles, items)

    @staticmethod
    def _dispatch_to(handles: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]],
                     items: list[tuple[str, Event]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Event]]] = {}
        for rid, event in items:
            if rid in handles:  # (an aborted request's late events have no handler)
                events, aloop = handles[rid]
                by_loop.setdefault(aloop, []).append((events, event))
        for aloop, batch in by_loop.items():
            AsyncioSink(aloop).deliver(batch)
