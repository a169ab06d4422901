"""Scheduler: waiting/running queues, continuous batching, admission by free KV, ForwardBatch building, and
applying sampled tokens (finish on EOS, stop tokens, stop strings, length)."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from framework.batch import ForwardBatch, ForwardMode, SamplingBatch
from framework.config import SchedulerConfig
from framework.kv import KVAllocator
from framework.request import Request


@dataclass
class ScheduledStep:
    """What the scheduler decided for one forward: the requests and how many tokens each adds."""

    mode: ForwardMode
    reqs: list[Request]
    extend_lens: list[int]
    samples: list[bool]  # whether request i gets a new token from this forward (a finished prefill or decode)


class Scheduler:
    """Prefill first (chunked to ``max_prefill_tokens``), otherwise one decode step for every running request.

    Admission needs the prompt's pages next to what the running requests need for their next step
    (``reserve_tokens`` positions each: 1, or the speculative width). When a decode step cannot get its pages,
    the newest requests are preempted (their KV freed) and re-run later from prompt + generated tokens.
    """

    def __init__(self, cfg: SchedulerConfig, allocator: KVAllocator, eos_ids: set[int],
                 detokenize: Callable[[list[int]], str], device: torch.device, reserve_tokens: int = 1) -> None:
        self.cfg = cfg
        self.allocator = allocator
        self.eos_ids = eos_ids
        self.detokenize = detokenize
        self.device = device
        self.reserve_tokens = reserve_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admitted, oldest first: holding a req row and KV
        self.num_preemptions = 0
        # ModelRunner.stage, set by the engine: a decode batch's inputs written into the graph's static buffers
        self.stage_inputs: Optional[Callable[..., Optional[list[torch.Tensor]]]] = None

    # ---- queues ---------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
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
            self.allocator.free_request(req.row)
            req.row = -1

    # ---- admission and preemption --------------------------------------------------------------------
    def _pages_for_next(self, req: Request, tokens: int) -> int:
        """Pages ``req`` lacks to hold ``tokens`` more positions."""
        return max(0, self.allocator.pages_for(min(req.kv_len + tokens, self.allocator.max_context))
                   - self.allocator.num_pages_of(req.row))

    def _step_pages(self, reqs: list[Request]) -> int:
        """Pages a decode (or speculative) step of ``reqs`` needs on top of what they hold."""
        return sum(self._pages_for_next(r, self.reserve_tokens) for r in reqs)

    def preempt(self, req: Request) -> None:
        """Retract a running request: free its KV and queue it first; it re-runs from prompt + generated tokens
        (the re-prefill covers every generated token but the last), so nothing is lost."""
        self.running.remove(req)
        self.allocator.free_request(req.row)
        req.row, req.kv_len = -1, 0
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> Optional[ScheduledStep]:
        """Pick the next forward: EXTEND if prompt tokens are pending or a waiting request fits, else DECODE for
        every prefilled request, preempting the newest requests when the pool cannot hold their next step."""
        step = self._extend()
        if step is not None:
            return step
        decoding = [r for r in self.running if r.prefilled]
        # preempt the newest while the decode step's pages do not fit, or while nothing can run at all (chunked
        # prefills holding the pages each other need)
        while len(self.running) > 1 and (not decoding or self._step_pages(decoding) > self.allocator.num_free_pages):
            victim = self.running[-1]  # the newest
            self.preempt(victim)
            if victim in decoding:
                decoding.remove(victim)
        if not decoding:
            return self._extend() if self.running else None  # a lone chunked prefill: the pool holds all of it
        return ScheduledStep(ForwardMode.DECODE, decoding, [1] * len(decoding), [True] * len(decoding))

    def _extend(self) -> Optional[ScheduledStep]:
        """The next prefill chunks (continued ones first, then newly admitted requests), or None."""
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
        # admission: the new prompt's pages must fit next to what running requests need for their next step
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running_requests:
            req = self.waiting[0]
            n = min(req.prefill_target, budget)
            need = self.allocator.pages_for(n + (self.reserve_tokens if n == req.prefill_target else 0))
            if need > free:
                break
            self.waiting.popleft()
            free -= need
            req.row = self.allocator.alloc_request()
            self.running.append(req)
            reqs.append(req), lens.append(n), samples.append(self._samples(req, n))
            budget -= n
        return ScheduledStep(ForwardMode.EXTEND, reqs, lens, samples) if reqs else None

    @staticmethod
    def _samples(req: Request, n: int) -> bool:
        """A prefill chunk samples a token when it completes a fresh request's prompt (a re-prefill after a
        preemption already has its next token)."""
        return req.kv_len + n == req.prefill_target and not req.output_ids

    # ---- batch building -------------------------------------------------------------------------------
    def build_batch(self, step: ScheduledStep) -> ForwardBatch:
        """Assign KV slots for the step's tokens and pack everything into one ForwardBatch."""
        reqs, lens = step.reqs, step.extend_lens
        starts = [r.kv_len for r in reqs]
        ends = [s + n for s, n in zip(starts, lens)]
        out_cache_loc = self.allocator.assign([r.row for r in reqs], starts, ends)
        if step.mode is ForwardMode.EXTEND:
            ids = np.concatenate([np.asarray(r.token_slice(s, e), dtype=np.int64) for r, s, e in zip(reqs, starts, ends)])
            positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)])
            logits_index = np.cumsum(lens) - 1
        else:
            ids = np.asarray([r.output_ids[-1] for r in reqs], dtype=np.int64)
            positions = np.asarray(starts, dtype=np.int64)
            logits_index = np.arange(len(reqs))
        rows = np.asarray([r.row for r in reqs], dtype=np.int64)
        staged = None
        if step.mode is ForwardMode.DECODE and self.stage_inputs is not None:  # into the graph's static buffers
            slots = self.allocator.req_to_token_host[rows, positions]  # one token per request: what assign gave
            staged = self.stage_inputs(step.mode, 1, [ids, positions, slots, rows, np.asarray(ends, dtype=np.int64)])
        if staged is not None:
            input_ids, positions_t, out_cache_loc, rows_t, seq_lens, logits_index_t = staged
        else:
            parts = [ids, positions, rows, np.asarray(ends, dtype=np.int64), logits_index]
            packed = torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(self.device)
            views, offset = [], 0
            for part in parts:
                views.append(packed[offset: offset + len(part)])
                offset += len(part)
            input_ids, positions_t, rows_t, seq_lens, logits_index_t = views
        return ForwardBatch(
            mode=step.mode, input_ids=input_ids, positions=positions_t, out_cache_loc=out_cache_loc,
            req_pool_indices=rows_t, seq_lens=seq_lens, seq_lens_cpu=ends, extend_lens_cpu=list(lens),
            logits_index=logits_index_t, sampling=self.sampling_batch(reqs),
        )

    def sampling_batch(self, reqs: list[Request], steps: Optional[list[int]] = None) -> SamplingBatch:
        """Device tensors of the requests' sampling parameters; ``steps`` defaults to each one's output length."""
        temps = [r.params.temperature for r in reqs]
        all_greedy = all(t == 0 for t in temps)
        need_filter = any(r.params.top_k > 0 or r.params.top_p < 1 for r in reqs if r.params.temperature > 0)
        steps = [len(r.output_ids) for r in reqs] if steps is None else steps
        ints = torch.tensor([[r.params.top_k for r in reqs], [r.seed for r in reqs], steps], dtype=torch.int64)
        floats = torch.tensor([temps, [r.params.top_p for r in reqs]], dtype=torch.float32)
        ints, floats = ints.to(self.device), floats.to(self.device)
        return SamplingBatch(temperatures=floats[0], top_ps=floats[1], top_ks=ints[0], seeds=ints[1], steps=ints[2],
                             all_greedy=all_greedy, need_top_k_top_p=need_filter)

    # ---- results --------------------------------------------------------------------------------------
    def process(self, step: ScheduledStep, tokens: list[int]) -> list[Request]:
        """Commit the step's KV, append sampled tokens (``tokens[i]`` for request i), and finish requests.
        Returns the requests that finished."""
        finished = []
        now = time.perf_counter()
        for req, n, gets_token, token in zip(step.reqs, step.extend_lens, step.samples, tokens):
            req.kv_len += n
            if not gets_token or req.finished:
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
        if p.stop:
            text = self.detokenize(req.output_ids)
            hits = [text.find(s) for s in p.stop if s in text]
            if hits:
                req.stop_text_len = min(hits)
                return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return None
