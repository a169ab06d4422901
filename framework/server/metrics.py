"""Prometheus metrics of one server: requests, tokens, tokens/s, queue depth, KV usage, prefix-cache hits,
speculative acceptance.

Each server owns its own ``CollectorRegistry`` (several servers can live in one process, e.g. in tests). The
engine loop feeds the counters; ``GET /metrics`` renders them in the Prometheus text format.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from framework.request import Request

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    """Counters, gauges and histograms under the ``tfs_`` prefix, safe to update from the engine thread."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tfs_requests", "Requests that ended, by finish reason (stop, length, abort, "
                                "error)", ["finish_reason"], registry=r)
        self.rejected = Counter("tfs_rejected_requests", "Requests refused before generation, by HTTP status",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("tfs_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("tfs_generation_tokens", "Generated tokens", registry=r)
        self.tokens_per_s = Gauge("tfs_generation_tokens_per_second",
                                  f"Generated tokens per second over the last {window_s:g} s", registry=r)
        self.queue_depth = Gauge("tfs_queue_depth", "Requests waiting for admission (not yet holding KV)",
                                 registry=r)
        self.running = Gauge("tfs_running_requests", "Requests admitted and holding KV", registry=r)
        self.kv_usage = Gauge("tfs_kv_usage_ratio", "Fraction of KV cache slots in use by running requests "
                              "(cached pages no request holds excluded)", registry=r)
        self.cache_prompt_tokens = Counter("tfs_prefix_cache_prompt_tokens", "Prompt tokens of admitted requests",
                                           registry=r)
        self.cache_hit_tokens = Counter("tfs_prefix_cache_hit_tokens", "Prompt tokens of admitted requests served "
                                        "by the prefix cache", registry=r)
        self.cache_hit_rate = Gauge("tfs_prefix_cache_hit_rate", "Prompt tokens served by the prefix cache / prompt "
                                    "tokens of admitted requests (0 before any)", registry=r)
        self.prefill_tokens = Counter("tfs_prefill_tokens", "Tokens prefilled (re-prefills after preemption "
                                      "included)", registry=r)
        self.cache_usage = Gauge("tfs_prefix_cache_usage_ratio", "Fraction of KV cache slots in pages the prefix "
                                 "cache holds", registry=r)
        self.engine_steps = Counter("tfs_engine_steps", "Engine steps run (each one forward of the target model: a "
                                    "prefill, a decode or a speculative iteration)", registry=r)
        self.prefill_steps = Counter("tfs_engine_prefill_steps", "Engine steps that prefilled prompt tokens (with "
                                     "scheduler.mixed_prefill the decoding requests ride along; without, they wait "
                                     "a step)", registry=r)
        self.spec_steps = Counter("tfs_spec_verify_steps", "Speculative verify steps of ended requests", registry=r)
        self.spec_accepted = Counter("tfs_spec_accepted_tokens", "Tokens emitted by verify steps of ended requests "
                                     "(accepted drafts plus the bonus token)", registry=r)
        self.spec_accept_len = Gauge("tfs_spec_mean_accept_length", "Tokens emitted per speculative verify step over "
                                     "ended requests (0 without speculation)", registry=r)
        self.ttft = Histogram("tfs_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("tfs_request_latency_seconds", "Arrival to finish", buckets=_LATENCY_BUCKETS,
                                 registry=r)
        self._window_s = window_s
        self._start = time.perf_counter()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) per step
        self._lock = threading.Lock()
        self._spec_totals = [0, 0]  # verify steps, accepted tokens
        self._steps_counted = 0  # engine steps the counter holds
        self._prefill_steps_counted = 0  # ... and prefill steps
        self._cache_totals = (0, 0, 0)  # prompt tokens, cached prompt tokens, prefilled tokens: the scheduler's last
        self.tokens_per_s.set_function(self._tokens_per_s)

    # ---- updates (engine thread) --------------------------------------------------------------------------
    def on_accept(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_reject(self, status: int) -> None:
        self.rejected.labels(status=str(status)).inc()

    def on_tokens(self, num_tokens: int, now: Optional[float] = None) -> None:
        if num_tokens <= 0:
            return
        self.generation_tokens.inc(num_tokens)
        with self._lock:
            self._recent.append((time.perf_counter() if now is None else now, num_tokens))

    def on_finish(self, req: Request) -> None:
        self.requests.labels(finish_reason=req.finish_reason or "abort").inc()
        if req.first_token_s is not None:
            self.ttft.observe(req.first_token_s - req.arrival_s)
        self.latency.observe((req.finish_s or time.perf_counter()) - req.arrival_s)
        steps, accepted = getattr(req, "spec_verify_steps", 0), getattr(req, "spec_accepted_tokens", 0)
        if steps > 0:
            self.spec_steps.inc(steps)
            self.spec_accepted.inc(accepted)
            self._spec_totals[0] += steps
            self._spec_totals[1] += accepted
            self.spec_accept_len.set(self._spec_totals[1] / self._spec_totals[0])

    def set_load(self, waiting: int, running: int, kv_usage: float) -> None:
        self.queue_depth.set(waiting)
        self.running.set(running)
        self.kv_usage.set(kv_usage)

    def set_steps(self, steps: int, prefill_steps: int = 0) -> None:
        """The engine loop's step count so far, and how many of them prefilled (the counters advance by the
        difference)."""
        if steps > self._steps_counted:
            self.engine_steps.inc(steps - self._steps_counted)
            self._steps_counted = steps
        if prefill_steps > self._prefill_steps_counted:
            self.prefill_steps.inc(prefill_steps - self._prefill_steps_counted)
            self._prefill_steps_counted = prefill_steps

    def set_prefix_cache(self, prompt_tokens: int, cached_tokens: int, prefill_tokens: int,
                         cache_usage: float) -> None:
        """The scheduler's running totals (the counters advance by the difference) and the cache's share of KV."""
        last = self._cache_totals
        for counter, now, before in zip((self.cache_prompt_tokens, self.cache_hit_tokens, self.prefill_tokens),
                                        (prompt_tokens, cached_tokens, prefill_tokens), last):
            if now > before:
                counter.inc(now - before)
        self._cache_totals = (prompt_tokens, cached_tokens, prefill_tokens)
        self.cache_hit_rate.set(cached_tokens / prompt_tokens if prompt_tokens else 0.0)
        self.cache_usage.set(cache_usage)

    # ---- reading (HTTP thread) ----------------------------------------------------------------------------
    def _tokens_per_s(self, now: Optional[float] = None) -> float:
        now = time.perf_counter() if now is None else now
        with self._lock:
            while self._recent and self._recent[0][0] < now - self._window_s:
                self._recent.popleft()
            tokens = sum(n for _, n in self._recent)
        span = min(self._window_s, now - self._start)
        return tokens / span if span > 0 else 0.0

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
