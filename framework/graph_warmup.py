"""Prefill graphs recorded ahead of serving, so that no request waits for a compilation: the dynamic inductor graph
for long prefill steps, and the CUDA graphs of the padded short ones (:class:`framework.model_runner.ModelRunner`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from framework.graph_inputs import dummy_extend_batch

if TYPE_CHECKING:
    from framework.model_runner import ModelRunner

log = logging.getLogger(__name__)


@torch.inference_mode()
def warmup_extend(runner: "ModelRunner", lens_list: list[list[int]]) -> None:
    """Compile the prefill graph ahead of serving for batches of ``lens`` new tokens per request (dynamo
    specialises a few size classes: one request or several, one token or several, up to 16 tokens or more).
    Where prefill steps up to ``extend_graph_tokens`` run from CUDA graphs, the dynamic graph only meets larger
    ones: one request's and several requests'."""
    if runner._compiled_extend is None:
        return
    if runner.extend_graph_tokens:
        half = runner.extend_graph_tokens // 2 + 1
        lens_list = [[runner.extend_graph_tokens + 1], [half, half]]
    limit = runner.backend.allocator.req_to_token.shape[1]  # positions a request may have
    for lens in lens_list:
        batch = dummy_extend_batch([min(k, limit) for k in lens], runner.device)
        try:
            runner.forward(batch)
        except Exception as err:  # noqa: BLE001 - a compiler failure must not stop serving: prefill runs eagerly
            log.warning("compile.prefill: compiling the prefill graph failed, prefill runs eagerly: %s",
                        " ".join(str(err).split())[:300])
            runner._compiled_extend = None
            return


@torch.inference_mode()
def warmup_extend_graphs(runner: "ModelRunner", max_requests: int, mixed: bool = False) -> None:
    """Record the prefill CUDA graphs ahead of serving: every padded token count up to ``extend_graph_tokens`` for
    steps of up to min(max_requests, 7) requests, or of up to ``max_requests`` with ``mixed`` prefill (every
    decoding request rides along in a prefill step); steps of more requests record theirs when first met."""
    if not runner.extend_graph_tokens:
        return
    limit = max_requests if mixed else min(max_requests, 7)
    padded = 2
    while padded <= 1 << limit.bit_length():  # steps of padded // 2 .. padded - 1 requests pad to `padded`
        reqs = padded // 2
        tokens = 16
        while tokens <= runner.extend_graph_tokens:
            n = max(reqs, tokens // 2 if tokens > 16 else reqs)  # new tokens of a step padded to `tokens`
            if n < tokens:
                runner.forward(dummy_extend_batch([n - reqs + 1] + [1] * (reqs - 1), runner.device))
            tokens *= 2
        padded *= 2
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
