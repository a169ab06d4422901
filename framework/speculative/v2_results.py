"""Speculation v2's host side of an iteration: what a launched iteration carries to the host, and how its result is
applied (committed lengths, tokens, finished requests, freed pages, statistics and the adaptive depth's record).

The host runs this while the next iteration computes (the engine's overlapped loop): the committed lengths
(``Request.kv_len``) change only here, after acceptance, and a request keeps the slots of every position the next
iteration may write (the KV contract in :mod:`framework.speculative.worker_v2`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from framework.request import Request
from framework.scheduler import ScheduledStep
from framework.speculative.adaptive import record_iteration
from framework.transfer import AsyncCopy

if TYPE_CHECKING:
    from framework.speculative.worker_v2 import SpecV2Worker


@dataclass
class SpecLaunched:
    """An iteration queued on the device; its accept lengths and tokens are on their way to the host."""

    step: ScheduledStep
    padded_bs: int
    result: AsyncCopy  # [padded_bs + padded_bs * q]: accept lengths, then the emitted tokens of each request
    events: Optional[list[torch.cuda.Event]]  # CUDA: start, drafted, accepted, extended
    q: int  # verify tokens per request (the root and q - 1 drafts)
    wall_s: float  # the host's time launching it (on the CPU: its computation)
    host_s: Optional[float] = None  # CUDA: the host's own time from its launch to the next (adaptive_v2.HostClock)


def apply_result(worker: "SpecV2Worker", launched: SpecLaunched) -> list[Request]:
    """Apply an iteration's result (waiting for it if it has not arrived); returns the finished requests."""
    t0 = time.perf_counter()
    host = launched.result.numpy()
    worker._clock.waited(time.perf_counter() - t0)
    worker._inflight.remove(launched)
    sched, alloc, q = worker.engine.scheduler, worker.engine.allocator, worker.q
    padded_bs = launched.padded_bs
    lens = host[:padded_bs].tolist()
    tokens = host[padded_bs: padded_bs * (1 + launched.q)].reshape(padded_bs, launched.q)
    finished, live, now = [], [], time.perf_counter()
    for b, req in enumerate(launched.step.reqs):
        req.spec_inflight -= 1
        if req.finished:  # finished (or aborted) after this iteration was launched: its tokens are dropped
            continue
        live.append(b)
        n = lens[b]
        req.kv_len += n  # the root and the accepted drafts now hold K/V
        req.spec_verify_steps += 1
        req.spec_accepted_tokens += n
        if req.first_token_s is None:
            req.first_token_s = now
        if sched.append_tokens(req, tokens[b, :n].tolist()):
            finished.append(req)
        else:  # keep what the next iteration writes; rejected positions' pages go back
            keep = req.kv_len + q + 1
            alloc.truncate(req.row, keep)
            worker._assigned[req.row] = min(worker._assigned[req.row], alloc.pages_for(keep) * alloc.page_size)
    bs = len(launched.step.reqs)
    seconds = account(worker, lens[:bs], launched)  # (CUDA: GPU time; the CPU: the launch's wall time, the whole)
    if worker.adaptive is not None and bs:  # (start-up's iterations have no requests)
        shadow = rows = None
        if worker.shadow is not None:  # the requests still running (another may hold a finished one's row now)
            if launched.q == q:  # the deepest drafts: the verified chains are the shadow's
                shadow = worker.shadow.verified(np.asarray(lens)[live] - 1, q - 1)
            else:
                shadow = worker.shadow.split(host, padded_bs)[live]
            rows = [launched.step.reqs[b].row for b in live]
        record_iteration(worker.adaptive, worker.stats.draft_lengths, bs, launched.q - 1, lens[:bs], seconds,
                         shadow, rows, host_s=worker._clock.host_time(launched.host_s) if launched.events else None)
    worker.drafter.on_finished(finished)
    return finished


def account(worker: "SpecV2Worker", lens: list[int], launched: SpecLaunched) -> float:
    """Count the iteration in the worker's stats; returns its cost: GPU time on CUDA, the launch's wall time on the
    CPU."""
    events = launched.events
    if events is None:
        worker.stats.add(lens)
        return launched.wall_s
    s = [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(3)]  # (all done: the copy came last)
    worker._events.append(events)
    worker.stats.add(lens, *s)
    worker.stats.num_iterations += 1
    worker.stats.longest_s = max(worker.stats.longest_s, sum(s))
    return sum(s)
