"""Speculation v2: a whole iteration on the device, launched without waiting for the previous one's result.

One iteration for the running requests is three device programs, each replayed from a CUDA graph when the runner
compiles (``torch.compile(mode="reduce-overhead")`` at the captured batch sizes), none read back by the host:

1. prepare: each request's root and chain drafts from its token history on the device (:class:`TokenHistory`;
   n-gram lookup as a batched comparison), and the TARGET_VERIFY inputs (positions, slots from ``req_to_token``);
2. the TARGET_VERIFY forward (causal over the chain: a chain needs no tree mask and no K/V compaction);
3. finish: verification as tensor operations (:mod:`chain_verify`), the accepted tokens and the bonus token
   (``tfs::fill_bonus_tokens``, the next root) appended to the token history.

The accept lengths and tokens go to the host through pinned memory; the host applies them (stop checks,
detokenization, streaming, freeing: :mod:`v2_results`) while the next iteration runs (the engine's overlapped loop).

KV contract: the host does not know an in-flight iteration's accept lengths, so an iteration launched while one is
pending assigns slots through the largest advance the pending one can make: positions ``[L, L + 2 * q)`` for a
committed length ``L`` and ``q = num_steps + 1`` verify tokens. Nothing an in-flight iteration may write is freed:
after an iteration is applied its request keeps positions ``< L' + q`` (what the next iteration writes). The
committed lengths (``Request.kv_len``) change only when an iteration's result is applied. With
``speculative.adaptive=true`` an iteration verifies ``k + 1 <= q`` tokens, ``k`` chosen by the host per iteration
(:mod:`adaptive_v2`); the bounds above stay those of the largest width ``q``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import numpy as np
import torch

from framework.batch import ForwardBatch, ForwardMode, SamplingBatch
from framework.config import SpeculativeConfig
from framework.kv import DUMMY_ROW
from framework.request import Request
from framework.sampling.device_params import DeviceSamplingParams
from framework.scheduler import ScheduledStep
from framework.speculative.adaptive import DraftLengthController
from framework.speculative.adaptive_v2 import (HostClock, ShadowAcceptance, any_width_program, capture_widths,
                                               iteration_widths, mark_any_width, width_programs)
from framework.speculative.base import Drafter, SpecContext
from framework.speculative.chain_verify import verify_chain_greedy, verify_chain_sampling
from framework.speculative import fused_iteration
from framework.speculative.fused_iteration import FusedIteration
from framework.speculative.token_history import TokenHistory
from framework.speculative.v2_results import SpecLaunched, apply_result
from framework.speculative.worker import SpecStats
from framework.transfer import AsyncCopy, upload


def v2_kv_width(cfg: SpeculativeConfig) -> int:
    """Row positions past the committed length that v2 may assign: two iterations' verify tokens, plus one."""
    return 2 * (cfg.num_steps + 1) + 1


class SpecV2Worker:
    version = "v2"

    def __init__(self, engine, drafter: Drafter, cfg: SpeculativeConfig) -> None:
        self.engine = engine
        self.drafter = drafter
        self.cfg = cfg
        self.q = cfg.num_steps + 1  # verify tokens per request: the root and the chain (adaptive: the most)
        self.widths = iteration_widths(cfg)  # the widths iterations run at (adaptive: 1 .. q), each captured
        self.width = v2_kv_width(cfg)
        self.stats = SpecStats(accepted_at_depth=[0] * cfg.num_steps)
        self.device = engine.device
        table = engine.allocator.req_to_token  # [rows, positions]
        self.history = TokenHistory(table.shape[0], table.shape[1], self.device)
        # adaptive: acceptance of every depth from unverified drafts (drafters on the device), plain steps included
        self.shadow = ShadowAcceptance(table.shape[0], cfg.num_steps, self.device) \
            if cfg.adaptive and drafter.drafts_on_device else None
        self.adaptive = DraftLengthController(cfg.num_steps, shadow=self.shadow is not None) if cfg.adaptive else None
        self._clock = HostClock()  # adaptive on CUDA: an iteration costs the longer of its GPU and host times
        self._last: Optional[SpecLaunched] = None  # the last iteration launched
        self._assigned: dict[int, int] = {}  # request row -> positions [0, n) that have slots
        self._inflight: list[SpecLaunched] = []
        self._events: list[list[torch.cuda.Event]] = []  # CUDA events of applied iterations, for reuse
        self._rows: dict[int, tuple[tuple, torch.Tensor]] = {}  # padded_bs -> (rows, device tensor) last used
        self._sampling = DeviceSamplingParams(self.device)  # padded; the steps are computed on the device
        self._logits_index: dict[tuple[int, int], torch.Tensor] = {}
        self._eager_width: Optional[int] = None  # eager drafting: the history columns that can hold tokens
        engine.runner.backend.expect_q_lens([1, *self.widths])  # (before anything that reads them compiles)
        self.graphs = engine.runner.compiled and self.device.type == "cuda"
        drafter.use_v2()
        self._prepare_fn = width_programs(self._prepare, self.widths, self.graphs, pass_width=True)
        # the finishes: one program each for every width (the width is a dynamic dimension of their inputs)
        self._greedy_fn = any_width_program(self._finish_greedy, self.graphs)
        self._sampling_fn = any_width_program(self._finish_sampling, self.graphs)
        # prepare, verify and finish as one program where the drafter and the backend allow it
        self._fused = FusedIteration(self) if FusedIteration.applies(self) else None

    # ---- device programs (graph bodies) -----------------------------------------------------------------
    def _prepare(self, rows: torch.Tensor, q: int) -> tuple[torch.Tensor, ...]:
        """rows ``[bs]`` -> tokens / valid ``[bs, q]`` (root first; drafts where the drafter drafts on the device),
        positions ``[bs * q]``, slots ``[bs, q]``, seq_lens, committed lengths and sampling steps ``[bs]``."""
        table = self.engine.allocator.req_to_token
        lens = self.history.lens[rows]  # [bs] known tokens; the root is the last
        root = self.history.tokens[rows[:, None], (lens - 1)[:, None]]  # [bs, 1]
        if self.drafter.drafts_on_device and (q > 1 or self.shadow is not None):  # (q == 1: a plain step)
            history = self.history.tokens[rows, : self._eager_width]  # [bs, width] (eager: the filled part)
            drafts, valid = self.drafter.propose_device(history, lens)  # [bs, num_steps]
            if self.shadow is not None and q == self.q:  # the verify measures this chain (ShadowAcceptance)
                self.shadow.drop(rows)
            elif self.shadow is not None:
                self.shadow.update(rows, self.history.tokens, lens, drafts, valid)
            drafts, valid = drafts[:, : q - 1], valid[:, : q - 1]  # [bs, q - 1]: the first q - 1 of the chain
        else:  # a model drafter fills them in with its own forwards
            drafts = torch.zeros(rows.shape[0], q - 1, dtype=torch.int64, device=rows.device)
            valid = torch.ones_like(drafts, dtype=torch.bool)
        tokens = torch.cat([root, drafts], dim=1).to(torch.int64)
        valid = torch.cat([torch.ones_like(root, dtype=torch.bool), valid], dim=1)  # (root: [bs, 1])
        committed = lens - 1  # the root's position: its K/V is written by this forward
        positions = committed[:, None] + torch.arange(q, device=rows.device)[None, :]
        slots = table[rows[:, None], positions.clamp(max=table.shape[1] - 1)]
        steps = lens - self.history.prompt_lens[rows]  # generated tokens: the index of this iteration's draws
        return tokens, valid, positions.reshape(-1), slots, committed + q, committed, steps

    def _finish_greedy(self, rows: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor,
                       logits: torch.Tensor, enabled: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Greedy verification and its token history update (none where ``enabled`` is false on the device)."""
        accept_lens, accept_tokens, bonus = verify_chain_greedy(tokens, valid, logits)
        self.history.append(rows, accept_tokens, accept_lens, bonus, enabled)
        return self._result(rows, accept_lens, accept_tokens)

    def _finish_sampling(self, rows: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, logits: torch.Tensor,
                         temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, seeds: torch.Tensor,
                         steps: torch.Tensor, need_top_k_top_p: bool,
                         draft_probs: Optional[torch.Tensor]) -> torch.Tensor:
        accept_lens, accept_tokens, bonus = verify_chain_sampling(tokens, valid, logits, temperatures, top_ks, top_ps,
                                                                  seeds, steps, need_top_k_top_p, draft_probs)
        self.history.append(rows, accept_tokens, accept_lens, bonus)
        return self._result(rows, accept_lens, accept_tokens)

    def _result(self, rows: torch.Tensor, accept_lens: torch.Tensor, accept_tokens: torch.Tensor) -> torch.Tensor:
        """What the host reads of an iteration: accept lengths ``[bs]``, the emitted tokens ``[bs * q]``, and with
        shadow acceptance each request's counts ``[bs * 2 * num_steps]``."""
        parts = [accept_lens, accept_tokens.reshape(-1)]
        if self.shadow is not None:
            parts.append(self.shadow.per_row(rows))
        return torch.cat(parts)

    # ---- host side --------------------------------------------------------------------------------------
    def on_extend_launch(self, step: ScheduledStep, batch: ForwardBatch, hidden: torch.Tensor,
                         sampled: torch.Tensor) -> None:
        """Before a prefill step's positions are committed: the drafter's own pool gets the chunk, and the requests
        whose prompt it completes get their token history (prompt, generated tokens, and the token the step
        samples, still on the device)."""
        self.drafter.on_prefill_launch(step, batch, hidden, sampled)
        self._clock.dirty()
        rows, seqs, prompt_lens, index, samples = [], [], [], [], []
        for i, (req, n, gets) in enumerate(zip(step.reqs, step.extend_lens, step.samples)):
            if req.prefilled or req.kv_len + n < req.prefill_target:
                continue
            rows.append(req.row), seqs.append(req.prompt_ids + req.output_ids)
            prompt_lens.append(len(req.prompt_ids)), index.append(i), samples.append(gets)
            self._assigned[req.row] = req.prefill_target
        if rows:
            self.history.start(rows, seqs, prompt_lens, sampled, index, samples)
            if self.shadow is not None:
                self.shadow.reset(rows)
                self.adaptive.forget(rows)

    def padded_size(self, bs: int, q: int) -> int:
        """The batch size an iteration of ``bs`` requests at width ``q`` runs at: the runner's captured size, but a
        prepare-and-verify program (:class:`FusedIteration`) of two or more tokens skips size 1 for the next
        captured size. Dynamo compiles a program once more for size 1 (it specialises sizes of 1), and that program
        holds the whole model, while a padded request adds only ``q`` rows to a verify of ``q``. Width 1 (a plain
        step) keeps size 1, where the decode forward runs its one-row kernels. ``fused_iteration.PAD_SIZE_1``
        False: size 1 stays size 1."""
        runner = self.engine.runner
        if not runner.compiled:
            return bs
        padded = runner.padded_size(bs)
        if padded == 1 and q > 1 and self._fused is not None and fused_iteration.PAD_SIZE_1:
            return next((b for b in runner.batch_sizes if b > 1), padded)
        return padded

    def _rows_tensor(self, reqs: list[Request], padded_bs: int) -> torch.Tensor:
        rows = tuple(r.row for r in reqs) + (DUMMY_ROW,) * (padded_bs - len(reqs))
        last = self._rows.get(padded_bs)
        if last is None or last[0] != rows:
            last = (rows, upload(np.asarray(rows, dtype=np.int64), self.device))
            self._rows[padded_bs] = last
        return last[1]

    def _assign_slots(self, reqs: list[Request]) -> None:
        """Slots for every position this iteration may write (through a pending iteration's largest advance)."""
        rows, starts, ends = [], [], []
        page, limit = self.engine.allocator.page_size, self.engine.allocator.max_context
        for req in reqs:
            need = req.kv_len + self.q * (1 + req.spec_inflight) + 1  # (+1: a draft extend's last position)
            have = self._assigned[req.row]
            if need > have:  # through the end of the last page: the next iterations need no assignment
                end = min(-(-need // page) * page, limit)
                rows.append(req.row), starts.append(have), ends.append(end)
                self._assigned[req.row] = end
        if rows:
            self.engine.allocator.assign(rows, starts, ends)

    def launch(self, step: ScheduledStep) -> SpecLaunched:
        """Queue one iteration for the step's requests (all prefilled); nothing here waits for the device."""
        reqs = step.reqs
        self._assign_slots(reqs)
        bs = len(reqs)
        if self.adaptive is not None:  # (from results known so far; shadow acceptance: of these requests)
            q = self.adaptive.choose(bs, [r.row for r in reqs] if self.shadow is not None else None) + 1
        else:
            q = self.q
        padded_bs = self.padded_size(bs, q)
        rows = self._rows_tensor(reqs, padded_bs)
        # host bounds of seq_lens: the committed length, the pending iterations' largest advance, and this one's q
        bounds = [r.kv_len + self.q * r.spec_inflight + q for r in reqs] + [q] * (padded_bs - bs)
        sampling = self._sampling.get(reqs, padded_bs)
        return self._run(step, rows, bounds, sampling, q)

    def _run(self, step: ScheduledStep, rows: torch.Tensor, bounds: list[int], sampling: SamplingBatch,
             q: int) -> SpecLaunched:
        padded_bs, t0 = rows.shape[0], time.perf_counter()
        host_s = self._clock.launch(t0)
        if self._last is not None:
            self._last.host_s = host_s
        events = None
        if self.device.type == "cuda":  # (reused once an iteration's times are read: creating events costs host time)
            events = self._events.pop() if self._events else [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()  # one step: prepare, verify and finish read each other
        self._record(events, 0)
        draft_probs = hidden = committed = greedy_out = None
        if self._fused is not None:  # prepare, verify and a greedy finish in one program (drafting counts as verifying)
            self._record(events, 1)
            tokens, valid, logits, steps, greedy_out = self._fused.run(rows, q, sampling.all_greedy)
        else:
            if not self.graphs:  # eager drafting scans the histories' filled part (64-token steps), not the table
                self._eager_width = min(-(-(max(bounds) + 1) // 64) * 64, self.history.tokens.shape[1])
            tokens, valid, positions, slots, seq_lens, committed, steps = self._prepare_fn[q](rows)
            if not self.drafter.drafts_on_device:  # a model drafter: its draft forwards, replayed from their graphs
                ctx = SpecContext(reqs=step.reqs, kv_lens=[b - q for b in bounds], slots=slots, roots=tokens[:, 0],
                                  kv_lens_t=committed, rows_t=rows, sampling=dataclasses.replace(sampling, steps=steps))
                chain = self.drafter.propose(ctx)
                tokens, valid, draft_probs = chain.tokens, chain.valid, chain.draft_probs
            self._record(events, 1)
            if (padded_bs, q) not in self._logits_index:
                self._logits_index[padded_bs, q] = torch.arange(padded_bs * q, device=self.device)
            batch = ForwardBatch(mode=ForwardMode.TARGET_VERIFY, input_ids=tokens.reshape(-1), positions=positions,
                                 out_cache_loc=slots.reshape(-1), req_pool_indices=rows, seq_lens=seq_lens,
                                 seq_lens_cpu=bounds, extend_lens_cpu=[q] * padded_bs,
                                 logits_index=self._logits_index[padded_bs, q])
            logits, hidden = self.engine.runner.forward(batch, new_step=False)
        sampling = dataclasses.replace(sampling, steps=steps)
        if greedy_out is not None and sampling.all_greedy:  # finished inside the fused program
            out = greedy_out
        else:
            out = self._finish(rows, tokens, valid, logits, sampling, draft_probs)
        self._record(events, 2)
        if self.drafter.extends_after_verify:  # DRAFT_EXTEND_V2 over the emitted tokens, from its graph
            emitted = out[padded_bs: padded_bs * (1 + q)].view(padded_bs, q)
            self.drafter.extend_v2(rows, committed, emitted, out[:padded_bs], hidden, bounds)
        self._record(events, 3)
        return self._launched(step, padded_bs, out, events, q, t0)

    def _finish(self, rows: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, logits: torch.Tensor,
                sampling: SamplingBatch, draft_probs: Optional[torch.Tensor]) -> torch.Tensor:
        """Queue the finish program that fits the batch's sampling: verification and the token history update."""
        if self.graphs:  # one compile serves most batch sizes and widths (dynamo specialises sizes of 1)
            mark_any_width([rows, tokens, valid, logits, sampling.steps, sampling.temperatures, sampling.top_ps,
                            sampling.top_ks, sampling.seeds, draft_probs], [tokens, valid, draft_probs])
        if sampling.all_greedy:
            return self._greedy_fn(rows, tokens, valid, logits)
        # NOTE: top-k / top-p batches run it eagerly: inductor fails on the sort-and-scatter of the filter
        finish = self._finish_sampling if sampling.need_top_k_top_p else self._sampling_fn
        return finish(rows, tokens, valid, logits, sampling.temperatures, sampling.top_ks, sampling.top_ps,
                      sampling.seeds, sampling.steps, sampling.need_top_k_top_p, draft_probs)

    def _launched(self, step: ScheduledStep, padded_bs: int, out: torch.Tensor,
                  events: Optional[list[torch.cuda.Event]], q: int, t0: float) -> SpecLaunched:
        """The queued iteration, its result on its way to the host."""
        launched = SpecLaunched(step, padded_bs, AsyncCopy(out), events, q, time.perf_counter() - t0)
        self._last = launched
        for req in step.reqs:
            req.spec_inflight += 1
        self._inflight.append(launched)
        return launched

    @staticmethod
    def _record(events: Optional[list[torch.cuda.Event]], i: int) -> None:
        if events is not None:
            events[i].record()

    def complete(self, launched: SpecLaunched) -> list[Request]:
        """Apply an iteration's result (waiting for it if it has not arrived); returns the finished requests."""
        return apply_result(self, launched)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Record the iteration's graphs for every width and captured batch size (:func:`capture_widths`), so that no
        batch compiles while serving."""
        if self.graphs:
            capture_widths(self, [(True, False), (False, False)] + ([(False, True)] if self._fused is not None else []))
