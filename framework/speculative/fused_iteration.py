"""Speculation v2's prepare and TARGET_VERIFY forward as one compiled program, for drafters that draft on the
device (n-gram, suffix chains).

:class:`SpecV2Worker` otherwise runs an iteration as three compiled programs (prepare, the runner's TARGET_VERIFY
forward, finish). Where the drafter drafts on the device and the attention backend builds a causal uniform batch's
metadata from device tensors (:meth:`AttentionBackend.uniform_metadata`: ``attention=triton``), prepare and the
forward are one ``torch.compile(mode="reduce-overhead")`` program (one CUDA graph replay, no static-input copies
between them, inductor fuses prepare's small kernels with the forward's). The greedy finish (verification and the
token history update) is part of it too: an all-greedy batch's iteration is one replay, where a second compiled call
cost the host about 0.2 ms an iteration. In a batch where some request samples, a device flag turns the program's
history update off and the sampling finish follows (compiled; top-k / top-p eager). The model is compiled once per verify
width, whatever the sampling: with one per sampling kind per width (greedy, sampling, and the runner's forward for
top-k / top-p), each compiled twice (batch size 1 and the rest), a fixed-depth n-gram engine with the real SmolLM2 on
an H200 had not started after about four and a half minutes, nor an adaptive one (a program per width) after nine.
Each verify width the worker runs (``speculative.adaptive=true``: every width from 1 to ``num_steps + 1``) is a
program of its own (:func:`adaptive_v2.width_programs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from framework.speculative.adaptive_v2 import width_programs

if TYPE_CHECKING:
    from framework.speculative.worker_v2 import SpecV2Worker

# the greedy finish inside the program (False: every batch's finish is a program of its own, as before 7f301c5); a
# constant so that bench/knobs.py --set can compare the two in one commit
GREEDY_FINISH = True
# a batch-1 iteration runs padded to the next captured batch size (SpecV2Worker.padded_size: no second compile of
# the program for dynamo's size-1 specialisation); False: size 1 is a program of its own, compiled and captured at
# start-up (a verify of q rows, not 2q, for one more compile of the whole model per width); a constant so that
# bench/knobs.py --set can compare the two in one commit
PAD_SIZE_1 = True


class FusedIteration:
    """The compiled prepare-and-verify programs of one :class:`SpecV2Worker`, a program per width; :meth:`applies`
    says whether the worker's drafter, backend and runner allow them."""

    def __init__(self, worker: "SpecV2Worker") -> None:
        self.worker = worker
        self._verify_fn = width_programs(self._verify_logits, worker.widths, compiled=worker.graphs, pass_width=True)
        # whether the program's greedy finish updates the token history: a bool on the device, read in the graph
        self._greedy = torch.ones((), dtype=torch.bool, device=worker.device)
        self._greedy_now = True
        if worker.device.type == "cuda":
            torch._dynamo.mark_static_address(self._greedy)

    @staticmethod
    def applies(worker: "SpecV2Worker") -> bool:
        """Compiled CUDA graphs, an on-device drafter, a backend with device-built uniform metadata, and one process
        (a tensor-parallel forward goes through ModelRunner.forward, which sends the batch to the other ranks)."""
        if not (worker.graphs and worker.drafter.drafts_on_device) or worker.engine.runner.tp is not None:
            return False
        empty = torch.zeros(0, dtype=torch.int64, device=worker.device)
        return worker.engine.runner.backend.uniform_metadata(empty, empty, empty, worker.q) is not None

    def run(self, rows: torch.Tensor, q: int, all_greedy: bool) -> tuple[torch.Tensor, ...]:
        """Queue prepare, the TARGET_VERIFY forward and the greedy finish of the requests ``rows`` ``[bs]`` (padded)
        at ``q`` verify tokens each: (tokens, valid ``[bs, q]``, logits ``[bs * q, vocab]``, sampling steps ``[bs]``,
        the greedy finish's result, which counts only where ``all_greedy``: otherwise the token history is left for
        the sampling finish; None without ``GREEDY_FINISH``); the caller has marked the CUDA-graph step."""
        if GREEDY_FINISH and all_greedy != self._greedy_now:  # (a fill on the device, queued; on a change only)
            self._greedy.fill_(all_greedy)
            self._greedy_now = all_greedy
        torch._dynamo.maybe_mark_dynamic(rows, 0)
        return self._verify_fn[q](rows)

    def _verify_logits(self, rows: torch.Tensor, q: int) -> tuple[torch.Tensor, ...]:
        w = self.worker
        runner = w.engine.runner
        tokens, valid, positions, slots, seq_lens, _committed, steps = w._prepare(rows, q)
        input_ids = tokens.reshape(-1)  # [bs * q]
        meta = runner.backend.uniform_metadata(slots.reshape(-1), rows, seq_lens, q)
        logits_index = torch.arange(input_ids.shape[0], device=input_ids.device)
        logits, _hidden = runner.model(input_ids, positions, meta, logits_index, None)
        greedy = w._finish_greedy(rows, tokens, valid, logits, self._greedy) if GREEDY_FINISH else None
        return tokens, valid, logits, steps, greedy
