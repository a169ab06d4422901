"""The engine loop: one thread that owns the Engine and serves every HTTP request through it.

HTTP handlers (on the asyncio event loop) validate and tokenize a request on a tokenizer thread
(:meth:`EngineLoop.prepare`), so a long prompt never holds up the engine, then put commands on a thread-safe
queue: submit a prepared request, abort one. The loop thread takes all queued commands, runs one
``engine.step()`` (continuous batching across HTTP requests), and hands each live request's news (text deltas,
the finish, errors) to the request's :class:`Sink`, one call per sink per iteration: in this process, an
:class:`AsyncioSink` puts them on the handler's ``asyncio.Queue`` with ``call_soon_threadsafe``; in an engine
process (framework/server/engine_process.py), a sink sends them down a pipe to the HTTP process. With no work it
blocks on the queue.

NOTE: the Engine is constructed inside the loop thread: torch.compile's CUDA-graph trees are thread-local, and
the warm-up compilation happens in ``Engine.__init__``. Nothing outside this thread touches the engine's state
while the loop runs (reading a counter for a health check or a test is fine).
"""

from __future__ import annotations

import asyncio
import collections
import cProfile
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from framework.parallel import TensorParallelError
from framework.request import Request
from framework.server.events import AbortRecord, AsyncioSink, Event, Sink
from framework.server.metrics import ServerMetrics
from framework.server.protocol import APIError, ParsedRequest, prepare_request
from framework.server.stream import TextDeltas

log = logging.getLogger(__name__)

# the load gauges (queue depth, running requests, KV usage, prefix-cache totals) are set at most this often while the
# engine works: a scrape every few seconds needs no more, and setting them every step costs the engine thread time
LOAD_INTERVAL_S = 0.05


@dataclass
class _Submission:
    rid: str
    parsed: ParsedRequest
    request: Request
    target: Any  # what the sink addresses this request's events to
    sink: Sink


@dataclass
class _Live:
    sub: _Submission
    request: Request
    deltas: Optional[TextDeltas]  # streaming requests only
    num_tokens_seen: int = 0


@dataclass
class _Outbox:
    items: dict[Sink, list[tuple[Any, Event]]] = field(default_factory=dict)

    def add(self, sub: _Submission, event: Event) -> None:
        self.items.setdefault(sub.sink, []).append((sub.target, event))


class EngineLoop:
    """Runs ``build_engine()`` and then the serving loop in a background thread; see the module docstring."""

    def __init__(self, build_engine: Callable[[], Any], metrics: Optional[ServerMetrics] = None,
                 profile: Optional[str] = None) -> None:
        self._build_engine = build_engine
        self.profile = profile  # run.profile: a path for the serving loop's cProfile stats, written when it ends
        self.metrics = metrics or ServerMetrics()
        self.engine: Any = None
        self.num_steps = 0
        self.abort_log: collections.deque[AbortRecord] = collections.deque(maxlen=256)
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._outbox = _Outbox()
        self._ready = threading.Event()
        self._load_updated = 0.0
        self._dead = False
        self._startup_error: Optional[BaseException] = None
        # an error that took the engine down (a tensor-parallel rank died): the loop ends and on_fatal is called
        self.fatal_error: Optional[BaseException] = None
        self.on_fatal: Optional[Callable[[BaseException], None]] = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # NOTE: one thread, so the tokenizer's Python-side state is never used by two encodes at once
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    # ---- control (any thread) -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread and wait until the engine is built; re-raise the error if building failed."""
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def stop(self, timeout: float = 30.0) -> None:
        """Fail the live requests ("server is shutting down") and end the thread."""
        if self._thread.is_alive():
            self._commands.put(("stop", None))
            self._thread.join(timeout)
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._dead

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    # ---- requests (the asyncio event loop) ----------------------------------------------------------------
    async def prepare(self, rid: str, parsed: ParsedRequest) -> Request:
        """Tokenize and validate a request on the tokenizer thread (it reads only the engine's tokenizer and
        config); raises :class:`APIError` (400) naming the bad field."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, self._prepare, rid, parsed)

    def _prepare(self, rid: str, parsed: ParsedRequest) -> Request:
        return prepare_request(self.engine.make_request, self.engine.max_context, rid, parsed)

    def submit(self, rid: str, parsed: ParsedRequest, request: Request) -> asyncio.Queue:
        """Queue a prepared request; its events arrive on the returned queue, the first being "accepted" or
        "error"."""
        events: asyncio.Queue = asyncio.Queue()
        self.enqueue(rid, parsed, request, events, AsyncioSink(asyncio.get_running_loop()))
        return events

    def enqueue(self, rid: str, parsed: ParsedRequest, request: Request, target: Any, sink: Sink) -> None:
        """Queue a prepared request whose events go to ``sink`` addressed to ``target`` (any thread)."""
        self._commands.put(("submit", _Submission(rid, parsed, request, target, sink)))
        if self._dead:  # NOTE: set before the loop's last drain, so a command put after that drain is seen here
            raise APIError("the engine loop is not running", status=503, type="server_error")

    def abort(self, rid: str) -> None:
        """Abort a request whose client went away; its KV is freed before the next engine step."""
        self._commands.put(("abort", (rid, self.num_steps)))

    # ---- the loop (engine thread) -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._build_engine()
        except BaseException as err:  # noqa: BLE001 - handed to start()'s caller
            self._startup_error = err
            self._dead = True
            self._ready.set()
            return
        self._ready.set()
        profiler = cProfile.Profile() if self.profile else None
        if profiler is not None:
            profiler.enable()
        try:
            while self._take_commands(block=not self.engine.has_work()):
                self._flush()
                if self.engine.has_work():
                    self._step()
                    self._publish()
                    self._flush()
                self._update_load()
        except TensorParallelError as err:  # the engine is down: fail what is live, then tell the server
            log.error("%s", err)
            self.fatal_error = err
        except BaseException:
            log.exception("the engine loop failed")
        finally:
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(self.profile)
                log.info("the serving loop's profile (%d steps): %s", self.num_steps, self.profile)
            self._shutdown()
            if self.fatal_error is not None and self.on_fatal is not None:
                self.on_fatal(self.fatal_error)

    def _take_commands(self, block: bool) -> bool:
        """Handle every queued command (waiting for one if ``block``); False once asked to stop."""
        while True:
            try:
                kind, payload = self._commands.get() if block else self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "submit":
                self._admit(payload)
            elif kind == "abort":
                self._abort(*payload)

    def _admit(self, sub: _Submission) -> None:
        req = sub.request
        if sub.parsed.stream:  # its text is needed as it grows
            req.detokenizer = self.engine.new_detokenizer()
        self.engine.submit(req)
        self._live[sub.rid] = _Live(sub, req, TextDeltas(req.params.stop) if sub.parsed.stream else None)
        self.metrics.on_accept(len(req.prompt_ids))
        self._outbox.add(sub, Event("accepted", prompt_tokens=len(req.prompt_ids)))

    def _abort(self, rid: str, requested_at_step: int) -> None:
        live = self._live.pop(rid, None)
        if live is None:  # it finished (and was answered) already
            return
        self.engine.abort(rid)
        self.metrics.on_finish(live.request)
        self.abort_log.append(AbortRecord(rid, requested_at_step, self.num_steps, len(live.request.output_ids)))

    def _step(self) -> None:
        try:
            self.engine.step()
        except TensorParallelError:
            raise
        except Exception:  # noqa: BLE001 - every accepted request still gets an answer
            log.exception("engine step failed; failing its %d live requests", len(self._live))
            self._fail_all(APIError("the engine failed while generating; see the server log", status=500,
                                    type="server_error"))
            self.engine.allocator.clear_cache()  # its K/V may be incomplete
        self.num_steps += 1

    def _publish(self) -> None:
        """Queue each live request's news: new streaming text, or its finish."""
        new_tokens = 0
        for rid, live in list(self._live.items()):
            req = live.request
            num_tokens = len(req.output_ids)
            new_tokens += max(0, num_tokens - live.num_tokens_seen)
            grew, live.num_tokens_seen = num_tokens != live.num_tokens_seen, num_tokens
            if req.finished:
                del self._live[rid]
                self._finish(live)
            elif grew and live.deltas is not None:
                delta = live.deltas.update(req.detokenizer.text)
                if delta:
                    self._outbox.add(live.sub, Event("delta", text=delta))
        self.metrics.on_tokens(new_tokens)

    def _finish(self, live: _Live) -> None:
        req = live.request
        self.metrics.on_finish(req)
        if req.finish_reason not in ("stop", "length"):  # the engine ended it ("abort", "error") on its own
            self._outbox.add(live.sub, Event("error", error=APIError(
                f"the request ended with finish_reason={req.finish_reason!r}", status=500, type="server_error")))
            return
        text = self.engine.output(req).text
        if live.deltas is not None:
            text = live.deltas.finish(text)
        self._outbox.add(live.sub, Event("finish", text=text, finish_reason=req.finish_reason,
                                         prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids)))

    def _fail_all(self, error: APIError) -> None:
        for rid, live in list(self._live.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the engine may be broken; the client must hear back regardless
                log.exception("could not abort request %s", rid)
            self.metrics.on_finish(live.request)
            self._outbox.add(live.sub, Event("error", error=error))
        self._live.clear()

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, _Outbox()
        for sink, items in outbox.items.items():
            sink.deliver(items)

    def _update_load(self) -> None:
        """The load gauges, at most every ``LOAD_INTERVAL_S`` while the engine works and whenever it goes idle."""
        now = time.monotonic()
        if self.engine.has_work() and now - self._load_updated < LOAD_INTERVAL_S:
            return
        self._load_updated = now
        scheduler, allocator = self.engine.scheduler, self.engine.allocator
        self.metrics.set_steps(self.num_steps, scheduler.num_prefill_steps)
        total = allocator.num_pages * allocator.page_size
        self.metrics.set_load(len(scheduler.waiting), len(scheduler.running),
                              allocator.num_used_slots / total if total else 0.0)
        self.metrics.set_prefix_cache(scheduler.num_prompt_tokens, scheduler.num_cached_prompt_tokens,
                                      scheduler.num_prefill_tokens,
                                      allocator.num_cached_pages * allocator.page_size / total if total else 0.0)

    def _shutdown(self) -> None:
        self._dead = True
        stopping = APIError("the server is shutting down", status=503, type="server_error")
        if self.engine is not None:
            self._fail_all(stopping)
        while True:  # answer whatever is still queued
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self._outbox.add(payload, Event("error", error=stopping))
        self._flush()
        if self.engine is not None:
            self.engine.close()
