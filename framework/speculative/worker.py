"""One speculative iteration for the running requests (the "v1" path): draft -> TARGET_VERIFY forward over the
tree -> verify on device -> one host read of the accept lengths -> KV compaction -> commit -> drafter update.

KV contract: the iteration assigns slots for row positions ``[L, L + width)`` of every request up front
(monotonic: nothing is freed while a forward that may read it is pending). Verification writes the tree's K/V
at positions ``L .. L + n - 1`` in node order; the accepted path's K/V are then copied to the request's
contiguous positions ``L + 1 .. L + k`` (only trees need it), the committed length becomes ``L + k + 1`` and
pages past the next root's position go back to the allocator. The scheduler's committed lengths change only here,
after acceptance.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from framework.batch import ForwardBatch, ForwardMode
from framework.config import SpeculativeConfig
from framework.request import Request
from framework.scheduler import ScheduledStep
from framework.speculative import DRAFTERS
from framework.speculative.adaptive import DraftLengthController, record_iteration
from framework.speculative.base import Drafter, SpecContext
from framework.speculative.tree import tree_mask
from framework.speculative.verify import verify


@dataclass
class SpecStats:
    num_verify_steps: int = 0
    num_emitted: int = 0
    accepted_at_depth: list[int] = field(default_factory=list)  # [num_steps]: verify steps accepting depth d+1
    draft_s: float = 0.0
    verify_s: float = 0.0
    extend_s: float = 0.0  # v2: the head drafter's DRAFT_EXTEND_V2
    num_iterations: int = 0  # v2: iterations whose GPU time (draft_s + verify_s + extend_s, CUDA events) is counted
    longest_s: float = 0.0  # v2: the longest of those iterations' GPU time (a stop of the host shows here)
    draft_lengths: dict[int, int] = field(default_factory=dict)  # speculative.adaptive: depth -> iterations

    def add(self, lens: list[int], draft_s: float = 0.0, verify_s: float = 0.0, extend_s: float = 0.0) -> None:
        """Count verify steps emitting ``lens[i]`` tokens each, and time spent drafting / verifying / extending."""
        self.num_verify_steps += len(lens)
        self.num_emitted += sum(lens)
        for length in lens:
            for d in range(min(length - 1, len(self.accepted_at_depth))):
                self.accepted_at_depth[d] += 1
        self.draft_s += draft_s
        self.verify_s += verify_s
        self.extend_s += extend_s

    def summary(self) -> dict:
        steps = max(self.num_verify_steps, 1)
        total = self.draft_s + self.verify_s + self.extend_s
        return {"mean_accept_len": round(self.num_emitted / steps, 4) if self.num_verify_steps else 0.0,
                "accept_rate_per_position": [round(c / steps, 4) for c in self.accepted_at_depth],
                "draft_time_share": round(self.draft_s / total, 4) if total else 0.0,
                "verify_time_share": round(self.verify_s / total, 4) if total else 0.0,
                **({"extend_time_share": round(self.extend_s / total, 4)} if self.extend_s else {}),
                **({"gpu_ms_per_iteration": round(1e3 * total / self.num_iterations, 4),
                    "gpu_ms_longest_iteration": round(1e3 * self.longest_s, 4)} if self.num_iterations else {}),
                **({"chosen_draft_lengths": {str(k): v for k, v in sorted(self.draft_lengths.items())}}
                   if self.draft_lengths else {})}


def spec_kv_width(cfg: SpeculativeConfig) -> int:
    """Row positions one iteration assigns: the tree or the drafter's scratch, plus the next root's slot."""
    return max(cfg.num_draft_tokens, DRAFTERS.get(cfg.name).scratch_width(cfg)) + 1


class SpecWorker:
    """The v1 iteration: drafting on the host, one host read of the accept lengths per iteration."""

    version = "v1"

    def __init__(self, engine, drafter: Drafter, cfg: SpeculativeConfig) -> None:
        self.engine = engine
        self.drafter = drafter
        self.cfg = cfg
        self.width = spec_kv_width(cfg)
        self.stats = SpecStats(accepted_at_depth=[0] * cfg.num_steps)
        # speculative.adaptive: a depth from measured acceptance, or (drafters with adaptive_widths: suffix trees) a
        # verify width from the drafter's own estimate, its levels k standing for widths[k - 1] (0: a plain step)
        self.widths = drafter.adaptive_widths() if cfg.adaptive else None
        self.adaptive = None if not cfg.adaptive else \
            DraftLengthController(len(self.widths), shadow=True) if self.widths else DraftLengthController(cfg.num_steps)

    def on_extend_launch(self, step: ScheduledStep, batch: ForwardBatch, hidden: torch.Tensor,
                         sampled: torch.Tensor) -> None:
        """v1 drafters learn about prefills from ``Drafter.on_prefill`` once the tokens are on the host."""

    def step(self, step: ScheduledStep) -> list[Request]:
        """Run one iteration for the step's requests (all prefilled); returns those that finished."""
        reqs = step.reqs
        eng, sched, alloc = self.engine, self.engine.scheduler, self.engine.allocator
        cfg, bs = self.cfg, len(reqs)
        t0 = time.perf_counter()
        kv_lens = [r.kv_len for r in reqs]
        rows = [r.row for r in reqs]
        slots = alloc.assign(rows, kv_lens, [L + self.width for L in kv_lens]).view(bs, self.width)
        dev = slots.device
        packed = torch.tensor([[r.output_ids[-1] for r in reqs], kv_lens, rows], dtype=torch.int64).to(dev)
        roots, kv_lens_t, rows_t = packed[0], packed[1], packed[2]
        sampling = sched.sampling_batch(reqs)
        ctx = SpecContext(reqs=reqs, kv_lens=kv_lens, slots=slots, roots=roots, kv_lens_t=kv_lens_t, rows_t=rows_t,
                          sampling=sampling)
        depth = cfg.num_steps if not self.adaptive else \
            self.adaptive.choose(bs, tokens=self.drafter.expected_tokens(ctx) if self.widths else None)
        if self.widths:
            ctx.width = self.widths[depth - 1] if depth else None
        else:
            ctx.max_depth = depth
        tree = self.drafter.propose(ctx) if depth > 0 else None
        if tree is None:  # nothing drafted for any request: a plain decode step (its slots were assigned above)
            for req, L in zip(reqs, kv_lens):
                alloc.truncate(req.row, L + 1)
                req.spec_verify_steps += 1  # an iteration that emits one token
                req.spec_accepted_tokens += 1
            self._record([1] * bs, time.perf_counter() - t0, 0.0)
            finished = eng.plain_step(step)
            self._adapt(bs, 0 if self.widths else depth, [1] * bs, t0)  # (a depth: requests without drafts missed)
            return finished
        n = tree.num_nodes  # at most num_draft_tokens (a drafter may draft a narrower tree)
        t1 = time.perf_counter()

        batch = ForwardBatch(
            mode=ForwardMode.TARGET_VERIFY, input_ids=tree.tokens.reshape(-1),
            positions=(kv_lens_t[:, None] + tree.depths).reshape(-1),
            out_cache_loc=slots[:, :n].reshape(-1), req_pool_indices=rows_t, seq_lens=kv_lens_t + n,
            seq_lens_cpu=[L + n for L in kv_lens], extend_lens_cpu=[n] * bs,
            logits_index=torch.arange(bs * n, device=dev), custom_mask=tree_mask(tree),
            sampling=sampling)
        logits, hidden = eng.runner.forward(batch)
        result = verify(tree, logits, sampling, cfg.num_steps, self.drafter.max_children)
        host = torch.cat([result.accept_lens, result.accept_index.reshape(-1), result.accept_tokens]).tolist()
        t2 = time.perf_counter()

        stride = cfg.num_steps + 1
        lens = host[:bs]
        paths = [host[bs + b * stride: bs + b * stride + lens[b]] for b in range(bs)]
        emitted = [host[bs + bs * stride + b * stride: bs + bs * stride + b * stride + lens[b]] for b in range(bs)]
        self._compact(reqs, kv_lens, paths)
        self.drafter.on_accept(ctx, tree, paths, hidden, [e[-1] for e in emitted])
        finished = []
        for req, L, path, tokens in zip(reqs, kv_lens, paths, emitted):
            req.kv_len = L + len(path)  # the root and the accepted drafts now hold K/V
            req.spec_verify_steps += 1
            req.spec_accepted_tokens += len(tokens)
            if req.first_token_s is None:
                req.first_token_s = t2
            if sched.append_tokens(req, tokens):
                finished.append(req)
            else:
                alloc.truncate(req.row, req.kv_len + 1)  # keep the next root's slot; rejected pages go back
        self._record(lens, t1 - t0 + time.perf_counter() - t2, t2 - t1)
        self._adapt(bs, depth, lens, t0)
        return finished

    def _adapt(self, bs: int, depth: int, lens: list[int], t0: float) -> None:
        """speculative.adaptive: what an iteration drafted ``depth`` deep gave, for the next choices."""
        if self.adaptive is not None:  # (reported as draft tokens a request: a width's nodes past the root)
            record_iteration(self.adaptive, self.stats.draft_lengths, bs, depth, lens, time.perf_counter() - t0,
                             reported=self.widths[depth - 1] - 1 if self.widths and depth else depth)

    def _compact(self, reqs: list[Request], kv_lens: list[int], paths: list[list[int]]) -> None:
        """Copy each accepted node's K/V from its tree position to the path's contiguous position."""
        src, dst = [], []
        table = self.engine.allocator.req_to_token_host
        for req, L, path in zip(reqs, kv_lens, paths):
            for depth, node in enumerate(path):
                if node != depth:
                    src.append(table[req.row, L + node])
                    dst.append(table[req.row, L + depth])
        if not src:
            return
        idx = torch.from_numpy(np.asarray([src, dst], dtype=np.int64)).to(self.engine.device)
        self.engine.runner.copy_kv(idx)  # the target's pool (drafters with their own re-extend accepted tokens)

    def _record(self, lens: list[int], draft_s: float, verify_s: float) -> None:
        self.stats.add(lens, draft_s, verify_s)
