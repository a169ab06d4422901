"""Speculation v2's iteration as one compiled program, for drafters that draft on the device (n-gram).

:class:`SpecV2Worker` runs an iteration as three compiled programs (prepare, the TARGET_VERIFY forward, finish).
Where the drafter drafts on the device and the attention backend builds a causal uniform batch's metadata from
device tensors (:meth:`AttentionBackend.uniform_metadata`: ``attention=triton``), the three are one
``torch.compile(mode="reduce-overhead")`` program: one CUDA graph replay and one set of guards per iteration
instead of three, no static-input copies between them, and inductor fuses prepare's and finish's small kernels
with the forward's. Batches with top-k / top-p sampling keep the three programs (their finish runs eagerly); start-up
(:meth:`SpecV2Worker.warmup`) records both paths. Each verify width the worker runs (``speculative.adaptive=true``:
every width from 1 to ``num_steps + 1``) is a program of its own (:func:`adaptive_v2.width_programs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from framework.batch import SamplingBatch
from framework.speculative.adaptive_v2 import width_programs

if TYPE_CHECKING:
    from framework.speculative.worker_v2 import SpecV2Worker


class FusedIteration:
    """The compiled whole-iteration programs of one :class:`SpecV2Worker` (greedy, and sampling without top-k /
    top-p); :meth:`applies` says whether the worker's drafter and backend allow them."""

    def __init__(self, worker: "SpecV2Worker") -> None:
        self.worker = worker
        self._greedy_fn = width_programs(self._greedy, worker.widths, compiled=True, pass_width=True)
        self._sampling_fn = width_programs(self._sampling, worker.widths, compiled=True, pass_width=True)

    @staticmethod
    def applies(worker: "SpecV2Worker") -> bool:
        """Compiled CUDA graphs, an on-device drafter, and a backend with device-built uniform metadata."""
        if not (worker.graphs and worker.drafter.drafts_on_device):
            return False
        empty = torch.zeros(0, dtype=torch.int64, device=worker.device)
        return worker.engine.runner.backend.uniform_metadata(empty, empty, empty, worker.q) is not None

    def serves(self, sampling: SamplingBatch) -> bool:
        """Greedy batches and sampling batches without top-k / top-p, in one process (a tensor-parallel forward
        goes through ModelRunner.forward, which sends the batch to the other ranks first)."""
        return self.worker.engine.runner.tp is None and (sampling.all_greedy or not sampling.need_top_k_top_p)

    def run(self, rows: torch.Tensor, sampling: SamplingBatch, q: int) -> torch.Tensor:
        """The iteration's result ``[bs + bs * q]`` (accept lengths, then each request's emitted tokens) for the
        requests ``rows`` ``[bs]`` (padded) at ``q`` verify tokens each, queued on the device; the caller has marked
        the CUDA-graph step."""
        torch._dynamo.maybe_mark_dynamic(rows, 0)
        if sampling.all_greedy:
            return self._greedy_fn[q](rows)
        return self._sampling_fn[q](rows, sampling.temperatures, sampling.top_ks, sampling.top_ps, sampling.seeds)

    def _verify_logits(self, rows: torch.Tensor, q: int) -> tuple[torch.Tensor, ...]:
        """prepare, then the TARGET_VERIFY forward: (tokens, valid ``[bs, q]``, logits ``[bs * q, vocab]``, sampling
        steps ``[bs]``)."""
        w = self.worker
        runner = w.engine.runner
        tokens, valid, positions, slots, seq_lens, _committed, steps = w._prepare(rows, q)
        input_ids = tokens.reshape(-1)  # [bs * q]
        meta = runner.backend.uniform_metadata(slots.reshape(-1), rows, seq_lens, q)
        logits_index = torch.arange(input_ids.shape[0], device=input_ids.device)
        logits, _hidden = runner.model(input_ids, positions, meta, logits_index, None)
        return tokens, valid, logits, steps

    def _greedy(self, rows: torch.Tensor, q: int) -> torch.Tensor:
        tokens, valid, logits, _steps = self._verify_logits(rows, q)
        return self.worker._finish_greedy(rows, tokens, valid, logits)

    def _sampling(self, rows: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                  seeds: torch.Tensor, q: int) -> torch.Tensor:
        tokens, valid, logits, steps = self._verify_logits(rows, q)
        return self.worker._finish_sampling(rows, tokens, valid, logits, temperatures, top_ks, top_ps, seeds, steps,
                                            False, None)
