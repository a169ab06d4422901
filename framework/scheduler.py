"""Scheduler: waiting/running queues, continuous batching, admission by free KV, ForwardBatch building, and
applying sampled tokens (finish on EOS, stop tokens, stop strings, length).

NOTE: with the overlapped engine loop the scheduler plans step N+1 before step N's tokens reach the host. A
launched step's positions count at once (``Request.kv_len``; :meth:`Scheduler.commit_launch`) and its sampled
tokens as ``Request.num_pending``; a decode input whose token the host lacks is the placeholder ``-1 - row``,
which the forward replaces on the device with the row's latest sampled token (``ModelRunner.next_tokens``).

Prefix cache (``kv.prefix_cache``): a request is admitted with the longest cached prefix of its tokens (whole pages,
at most ``prefill_target - 1`` tokens: the last one is always computed, for its logits) and prefills the rest; its
pages go into the tree as its prefill chunks complete, and all its full pages of written tokens when it finishes or
is preempted (a preempted request re-runs mostly from the cache).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from framework.batch import ForwardBatch, ForwardMode, SamplingBatch
from framework.config import SchedulerConfig
from framework.detokenizer import IncrementalDetokenizer, find_stop
from framework.kv import KVAllocator
from framework.prefix_sharing import PrefixSharing
from framework.request import Request
from framework.sampling.device_params import DeviceSamplingParams
from framework.transfer import upload


@dataclass
class ScheduledStep:
    """What the scheduler decided for one forward: the requests and how many tokens each adds."""

    mode: ForwardMode
    reqs: list[Request]
    extend_lens: list[int]
    samples: list[bool]  # whether request i gets a new token from this forward (a finished prefill or decode)


def future_token(req: Request) -> int:
    """The input id of ``req``'s next position: its last token, or the placeholder ``-1 - row`` while that token
    is still on its way to the host (the forward reads it from the device)."""
    return -1 - req.row if req.num_pending else req.output_ids[-1]


class Scheduler:
    """Prefill first (chunked to ``max_prefill_tokens``), otherwise one decode step for every running request.

    Admission needs the prompt's pages next to what the running requests need for their next step
    (``reserve_tokens`` positions each: 1, or the speculative width). When a decode step cannot get its pages,
    the newest requests are preempted (their KV freed) and re-run later from prompt + generated tokens.
    """

    def __init__(self, cfg: SchedulerConfig, allocator: KVAllocator, eos_ids: set[int],
                 new_detokenizer: Callable[[], IncrementalDetokenizer], device: torch.device,
                 reserve_tokens: int = 1) -> None:
        self.cfg = cfg
        self.allocator = allocator
        self.eos_ids = eos_ids
        self.new_detokenizer = new_detokenizer
        self.device = device
        self.reserve_tokens = reserve_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admitted, oldest first: holding a req row and KV
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # prompt tokens of admitted requests (first admission)
        self.num_cached_prompt_tokens = 0  # of them, served by the prefix cache
        self.num_prefill_tokens = 0  # tokens prefilled (EXTEND forwards; re-prefills after preemption included)
        self.num_prefill_steps = 0  # EXTEND steps launched (mixed prefill: decoding requests may ride along)
        self.prefix = PrefixSharing(allocator)  # the prefix cache's side of admission and freeing
        # ModelRunner.stage, set by the engine when forwards run from static buffers: a decode batch's inputs are
        # written into the graph's static buffers (it must return them for every DECODE batch)
        self.stage_inputs: Optional[Callable[..., Optional[list[torch.Tensor]]]] = None
        self._sampling = DeviceSamplingParams(device)

    # ---- queues ---------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.params.stop and req.detokenizer is None:  # stop strings are searched for in the growing text
            req.detokenizer = self.new_detokenizer()
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, rid) -> Optional[Request]:
        """Finish the request with id ``rid`` as "abort" and free its KV now; None if it is not here."""
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish_reason = "abort"
                return req
        for req in self.running:
            if req.rid == rid:
                self.finish(req, "abort")
                return req
        return None

    def finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.finish_s = time.perf_counter()
        if req in self.running:
            self.running.remove(req)
        if req.row >= 0:
            self.prefix.release(req)
            req.row = -1

    # ---- admission and preemption --------------------------------------------------------------------
    def _pages_for_next(self, req: Request, tokens: int) -> int:
        """Pages ``req`` lacks to hold ``tokens`` more positions."""
        return max(0, self.allocator.pages_for(min(req.kv_len + tokens, self.allocator.max_context))
                   - self.allocator.num_pages_of(req.row))

    def _step_pages(self, reqs: list[Request]) -> int:
        """Pages a decode (or speculative) step of ``reqs`` needs on top of what they hold."""
        return sum(self._pages_for_next(r, self.reserve_tokens) for r in reqs)

    def _step_fits(self, reqs: list[Request]) -> bool:
        """Whether the free pages hold a decode (or speculative) step of ``reqs``; no request lacks more than the
        pages of ``reserve_tokens`` positions (its pages cover its K/V), so most steps need no count."""
        free = self.allocator.num_free_pages
        return len(reqs) * self.allocator.pages_for(self.reserve_tokens) <= free or self._step_pages(reqs) <= free

    def preempt(self, req: Request) -> None:
        """Retract a running request: free its KV and queue it first; it re-runs from prompt + generated tokens
        (the re-prefill covers every generated token but the last), so nothing is lost."""
        assert not (req.num_pending or req.spec_inflight), "a request is preempted only once the host has all of its tokens"
        self.running.remove(req)
        self.prefix.release(req)
        req.row, req.kv_len = -1, 0
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _decodable(self) -> list[Request]:
        """Running requests whose next step is a decode: prefilled, and not already given their last token by a
        launched step (such a request finishes when the host gets that token)."""
        return [r for r in self.running if r.prefilled and r.num_generated < r.max_new_tokens]

    def schedule(self, allow_preempt: bool = True) -> Optional[ScheduledStep]:
        """Pick the next forward: EXTEND if prompt tokens are pending or a waiting request fits, else DECODE for
        every prefilled request, preempting the newest requests when the pool cannot hold their next step.

        ``allow_preempt=False`` (a launched step's tokens are not on the host yet): where a preemption would be
        needed, or nothing can run until those tokens arrive, return None instead."""
        decoding = self._decodable()
        if self.waiting or len(decoding) < len(self.running):  # (else no request has a prompt chunk to run)
            step = self._extend(decoding)
            if step is not None:
                return step
        # preempt the newest while the decode step's pages do not fit, or while nothing can run at all (chunked
        # prefills holding the pages each other need)
        while len(self.running) > 1 and (not decoding or not self._step_fits(decoding)):
            if not allow_preempt:
                return None
            victim = self.running[-1]  # the newest
            self.preempt(victim)
            if victim in decoding:
                decoding.remove(victim)
        if not decoding:
            return self._extend(decoding) if self.running else None  # a lone chunked prefill: the pool holds all of it
        return ScheduledStep(ForwardMode.DECODE, decoding, [1] * len(decoding), [True] * len(decoding))

    def _extend(self, decoding: list[Request]) -> Optional[ScheduledStep]:
        """The next prefill chunks (continued ones first, then newly admitted requests), or None; ``decoding``: the
        running requests whose next step is a decode (:meth:`_decodable`), riders with mixed prefill."""
        budget = self.cfg.max_prefill_tokens
        reqs, lens, samples = [], [], []
        # free pages, less what the prefilled requests' next decode (or verify) step needs
        free = self.allocator.num_free_pages - self._step_pages([r for r in self.running if r.prefilled])
        for req in self.running:  # continue chunked prefills first, as far as the free pages reach
            if not req.prefilled and budget > 0:
                room = (self.allocator.num_pages_of(req.row) + max(free, 0)) * self.allocator.page_size - req.kv_len
                n = min(req.prefill_target - req.kv_len, budget, room)
                if n <= 0:
                    continue
                free -= self._pages_for_next(req, n)
                reqs.append(req), lens.append(n), samples.append(self._samples(req, n))
                budget -= n
        # mixed prefill: the decoding requests ride along with any prefill chunk (a continued one or a new
        # admission's), one token each; their tokens come out of the budget first
        riders = decoding[:max(budget, 0)] if self.cfg.mixed_prefill else []
        budget -= len(riders)
        # admission: the new prompt's pages must fit next to what running requests need for their next step
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running_requests:
            req = self.waiting[0]
            target = req.prefill_target
            prefix = self.prefix.match(req, target)
            cached = len(prefix) * self.allocator.page_size
            n = min(target - cached, budget)
            need = self.allocator.pages_for(n + (self.reserve_tokens if cached + n == target else 0))
            if prefix:  # cached pages nobody holds count as free until this request holds them
                need += self.allocator.cache.num_unreferenced(prefix)
            if need > free or self.prefix.computing(req, cached, reqs, lens):
                break
            self.waiting.popleft()
            free -= need
            req.row = self.allocator.alloc_request(prefix)
            req.kv_len = req.prefix_len = cached
            if not req.num_admissions:
                req.num_cached_tokens = cached
                self.num_prompt_tokens += len(req.prompt_ids)
                self.num_cached_prompt_tokens += cached
            req.num_admissions += 1
            self.running.append(req)
            reqs.append(req), lens.append(n), samples.append(self._samples(req, n))
            budget -= n
        if not reqs:
            return None
        for req in riders:
            reqs.append(req), lens.append(1), samples.append(True)
        return ScheduledStep(ForwardMode.EXTEND, reqs, lens, samples)

    @staticmethod
    def _samples(req: Request, n: int) -> bool:
        """A prefill chunk samples a token when it completes a fresh request's prompt (a re-prefill after a
        preemption already has its next token)."""
        return req.kv_len + n == req.prefill_target and not req.num_generated

    # ---- batch building -------------------------------------------------------------------------------
    def build_batch(self, step: ScheduledStep) -> ForwardBatch:
        """Assign KV slots for the step's tokens and pack everything into one ForwardBatch."""
        reqs, lens = step.reqs, step.extend_lens
        starts = [r.kv_len for r in reqs]
        ends = [s + n for s, n in zip(starts, lens)]
        # a decode batch goes straight into the CUDA graph's static buffers, and its forward writes the new slots
        # into the device's req_to_token (no upload and scatter of its own)
        staging = step.mode is ForwardMode.DECODE and self.stage_inputs is not None
        if staging:
            slots = self.allocator.assign_host([r.row for r in reqs], starts, ends)
        else:
            out_cache_loc = self.allocator.assign([r.row for r in reqs], starts, ends)
        if step.mode is ForwardMode.EXTEND:  # (a decoding request in a mixed step: its one next position)
            ids = np.concatenate([np.asarray([future_token(r)] if r.prefilled else r.token_slice(s, e), dtype=np.int64)
                                  for r, s, e in zip(reqs, starts, ends)])
            positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)])
            logits_index = np.cumsum(lens) - 1
        else:
            ids = np.asarray([future_token(r) for r in reqs], dtype=np.int64)
            positions = np.asarray(starts, dtype=np.int64)
            logits_index = np.arange(len(reqs))
        rows = np.asarray([r.row for r in reqs], dtype=np.int64)
        if staging:
            staged = self.stage_inputs(step.mode, 1, [ids, positions, slots, rows, np.asarray(ends, dtype=np.int64)])
            input_ids, positions_t, out_cache_loc, rows_t, seq_lens, logits_index_t = staged
        else:
            parts = [ids, positions, rows, np.asarray(ends, dtype=np.int64), logits_index]
            packed = upload(np.concatenate(parts).astype(np.int64), self.device)
            views, offset = [], 0
            for part in parts:
                views.append(packed[offset: offset + len(part)])
                offset += len(part)
            input_ids, positions_t, rows_t, seq_lens, logits_index_t = views
        return ForwardBatch(
            mode=step.mode, input_ids=input_ids, positions=positions_t, out_cache_loc=out_cache_loc,
            req_pool_indices=rows_t, seq_lens=seq_lens, seq_lens_cpu=ends, extend_lens_cpu=list(lens),
            logits_index=logits_index_t, sampling=self.sampling_batch(reqs), write_slots=staging,
        )

    def sampling_batch(self, reqs: list[Request]) -> SamplingBatch:
        """Device tensors of the requests' sampling parameters and the index of the token each samples next
        (:class:`DeviceSamplingParams`: kept on the device while the batch's requests stay the same)."""
        return self._sampling.get(reqs, steps=[r.num_generated for r in reqs])

    def commit_launch(self, step: ScheduledStep) -> None:
        """A launched step's positions count at once; the tokens it samples are pending until :meth:`process`."""
        self.num_prefill_steps += step.mode is ForwardMode.EXTEND
        for req, n, gets_token in zip(step.reqs, step.extend_lens, step.samples):
            if step.mode is ForwardMode.EXTEND and not req.prefilled:
                self.num_prefill_tokens += n
            req.kv_len += n
            req.num_pending += gets_token
        self.prefix.share(step.mode, step.reqs, launched=True)

    # ---- results --------------------------------------------------------------------------------------
    def process(self, step: ScheduledStep, tokens: list[int]) -> list[Request]:
        """Append a committed step's sampled tokens (``tokens[i]`` for request i) and finish requests; a request
        that finished (or was aborted) after the step was launched drops its token. Returns the requests that
        finished."""
        finished = []
        now = time.perf_counter()
        self.prefix.share(step.mode, step.reqs, launched=False)  # (a v1 drafter's own pool has the chunk now)
        for req, gets_token, token in zip(step.reqs, step.samples, tokens):
            if not gets_token:
                continue
            req.num_pending -= 1
            if req.finished:
                continue
            if req.first_token_s is None:
                req.first_token_s = now
            if self.append_tokens(req, [token]):
                finished.append(req)
        return finished

    def append_tokens(self, req: Request, tokens: list[int]) -> bool:
        """Append generated tokens one by one, stopping at the first finish condition; True if finished."""
        for token in tokens:
            req.output_ids.append(token)
            reason = self.finish_reason(req, token)
            if reason is not None:
                self.finish(req, reason)
                return True
        return False

    def finish_reason(self, req: Request, token: int) -> Optional[str]:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            return "stop"
        if req.detokenizer is not None:
            piece = req.detokenizer.add(token)
            at = find_stop(req.detokenizer.text, len(piece), p.stop)
            if at is not None:
                req.stop_text_len = at
                return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return None
