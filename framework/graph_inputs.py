"""The inputs of a compiled forward: padding with dummy requests (uniform modes to a captured batch size, prefill
steps to a power-of-two shape), and on CUDA the static buffers that the captured graphs read
(:class:`StaticInputs`), which the scheduler can write straight from the host."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from framework.batch import ForwardBatch, ForwardMode
from framework.kv import DUMMY_ROW, DUMMY_SLOT
from framework.transfer import PinnedStaging, upload

ALIGN = 2  # int64 elements: every buffer of a StaticInputs starts on 16 bytes, as inductor assumes of its inputs
# CUDA: StaticInputs.stage copies through a few pinned buffers of its own (transfer.PinnedStaging) instead of a
# pin_memory() per step (timed together with model_runner.GREEDY_IN_GRAPH); a constant so that bench/knobs.py --set
# can compare the two in one commit
STAGING_RING = True


def dummy_inputs_host(num_reqs: int, q_len: int, dummy_len: int) -> list[np.ndarray]:
    """(input_ids, positions, out_cache_loc, req_pool_indices, seq_lens) of ``num_reqs`` dummy requests: each has
    ``q_len`` tokens at positions 0.. in the reserved KV slot and req row, and ``dummy_len`` keys, all its own."""
    n = num_reqs * q_len
    return [np.zeros(n, np.int64), np.tile(np.arange(q_len, dtype=np.int64), num_reqs),
            np.full(n, DUMMY_SLOT, np.int64), np.full(num_reqs, DUMMY_ROW, np.int64),
            np.full(num_reqs, dummy_len, np.int64)]


def dummy_inputs(num_reqs: int, q_len: int, dummy_len: int, device: torch.device) -> list[torch.Tensor]:
    """:func:`dummy_inputs_host` on ``device``."""
    return [torch.from_numpy(a).to(device) for a in dummy_inputs_host(num_reqs, q_len, dummy_len)]


def int_inputs(batch: ForwardBatch) -> list[torch.Tensor]:
    """The batch's integer graph inputs, in :func:`dummy_inputs`' order."""
    return [batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens]


def pad_fresh(batch: ForwardBatch, extra: int, dummy_len: int) -> tuple[torch.Tensor, ...]:
    """(input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, logits_index) of ``batch`` with ``extra``
    dummy requests appended, as new tensors."""
    dev = batch.input_ids.device
    dummies = dummy_inputs(extra, batch.q_len, dummy_len, dev)
    return (*(torch.cat([real, dummy]) for real, dummy in zip(int_inputs(batch), dummies)),
            torch.arange((batch.bs + extra) * batch.q_len, device=dev))


class StaticInputs:
    """The integer inputs of one captured CUDA graph shape ``(mode, padded_bs, q_len)``, at fixed addresses.

    They are marked static (unguarded), so cudagraph trees replay without copying them into the graph's own input
    buffers. The five buffers are views of one allocation (each on 16 bytes), so that a batch built on the host is
    written by one host-to-device copy (:meth:`stage`, called by the scheduler: no kernel in the step); a batch
    already on the device is copied in by one ``torch._foreach_copy_`` (:meth:`fill`). Dummy rows are rewritten
    every time: a smaller batch after a larger one leaves no stale slots behind. What either writes is valid until
    the next stage or fill of the same shape.
    """

    def __init__(self, padded_bs: int, q_len: int, device: torch.device) -> None:
        self.padded_bs, self.q_len, self.device = padded_bs, q_len, device
        self.dummies: dict[int, list[torch.Tensor]] = {}  # dummy_len -> dummy_inputs for the whole padded batch
        self.dummies_host: dict[int, list[np.ndarray]] = {}  # dummy_len -> the same on the host, for stage
        n = padded_bs * q_len
        self.sizes = [n, n, n, padded_bs, padded_bs]
        self.starts = [0]
        for size in self.sizes:
            self.starts.append(self.starts[-1] + -(-size // ALIGN) * ALIGN)
        self.host = np.zeros(self.starts[-1], np.int64)  # the staging copy of the packed buffer
        self.ring = PinnedStaging(self.starts[-1], torch.int64) if STAGING_RING and device.type == "cuda" else None
        self.packed = torch.zeros(self.starts[-1], dtype=torch.int64, device=device)
        self.buffers = [self.packed[a:a + size] for a, size in zip(self.starts, self.sizes)]
        self.logits_index = torch.arange(n, device=device)
        self.staged: Optional[tuple[int, int]] = None  # (bs, dummy_len) of the last stage, until a fill
        for t in [*self.buffers, self.logits_index]:
            torch._dynamo.mark_static_address(t, guard=False)
            torch._dynamo.maybe_mark_dynamic(t, 0)

    def fill(self, batch: ForwardBatch, dummy_len: int) -> tuple[torch.Tensor, ...]:
        """Copy a device batch's inputs and the dummy tail in; returns the six padded inputs."""
        if dummy_len not in self.dummies:
            self.dummies[dummy_len] = dummy_inputs(self.padded_bs, self.q_len, dummy_len, self.device)
        n, bs = batch.input_ids.shape[0], batch.bs
        src = int_inputs(batch)
        cut = [n, n, n, bs, bs]
        dst = [buf[:c] for buf, c in zip(self.buffers, cut)]
        if bs < self.padded_bs:
            dst += [buf[c:] for buf, c in zip(self.buffers, cut)]
            src += [d[c:] for d, c in zip(self.dummies[dummy_len], cut)]
        with torch.inference_mode():  # (the buffers may be inference tensors)
            torch._foreach_copy_(dst, src)
        self.staged = None
        return (*self.buffers, self.logits_index)

    def stage(self, ints: Sequence[np.ndarray], dummy_len: int) -> list[torch.Tensor]:
        """Write a host batch's ``ints`` (:func:`int_inputs`' order) and the dummy tail with one host-to-device copy;
        returns the real batch's views (:func:`int_inputs`' order, then its logits_index) for its ForwardBatch."""
        bs = len(ints[3])
        cut = [bs * self.q_len] * 3 + [bs] * 2
        if dummy_len not in self.dummies_host:
            self.dummies_host[dummy_len] = dummy_inputs_host(self.padded_bs, self.q_len, dummy_len)
        dummies = self.dummies_host[dummy_len]
        for a, size, real, dummy, c in zip(self.starts, self.sizes, ints, dummies, cut):
            self.host[a:a + c] = real
            self.host[a + c:a + size] = dummy[c:]
        # NOTE: through a pinned copy of self.host, without blocking: self.host is free again at once, and the
        # buffers are overwritten in stream order, after the graph launched before (which may still read them)
        with torch.inference_mode():  # the buffers may have been made in a forward, as inference tensors
            if self.ring is not None:
                self.ring.copy(self.packed, self.host)
            else:
                host = torch.from_numpy(self.host)
                self.packed.copy_(host.pin_memory() if self.device.type == "cuda" else host, non_blocking=True)
        self.staged = (bs, dummy_len)
        return [*(buf[:c] for buf, c in zip(self.buffers, cut)), self.logits_index[:cut[0]]]

    def holds(self, batch: ForwardBatch, dummy_len: int) -> bool:
        """True when ``batch`` is the one :meth:`stage` wrote last (no fill since): its inputs are in place."""
        return (self.staged == (batch.bs, dummy_len)
                and all(t.data_ptr() == buf.data_ptr() for t, buf in zip(int_inputs(batch), self.buffers)))


def pad_uniform(batch: ForwardBatch, padded_bs: int, static: Optional[StaticInputs]) -> ForwardBatch:
    """A copy of a uniform-mode ``batch`` padded to ``padded_bs`` requests with dummy requests.

    NOTE: the copy's seq_lens / seq_lens_sum are the padded ones (metadata is derived from them while the
    graph runs); the caller's batch keeps its raw values. With ``static`` (CUDA) the integer inputs are those static
    buffers for this shape, rewritten in place: valid until the next forward.
    """
    extra = padded_bs - batch.bs
    q = batch.q_len
    dev = batch.input_ids.device
    custom_mask = batch.custom_mask
    if custom_mask is not None:  # the dummy sees all of its keys (they are all its own, at slot 0)
        width = custom_mask.shape[-1]
        custom_mask = torch.cat([custom_mask, torch.ones(extra, q, width, dtype=torch.bool, device=dev)])
    dummy_len = q if custom_mask is None else max(q, custom_mask.shape[-1])
    seq_lens_cpu = batch.seq_lens_cpu + [dummy_len] * extra
    hidden_in = batch.hidden_in
    if hidden_in is not None:
        hidden_in = torch.cat([hidden_in, hidden_in.new_zeros(extra * q, hidden_in.shape[-1])])
    if static is not None:
        ints = (*static.buffers, static.logits_index) if static.holds(batch, dummy_len) else static.fill(
            batch, dummy_len)
    else:  # NOTE: also when extra is 0: the compiled graph gets fresh, aligned tensors, never views
        ints = pad_fresh(batch, extra, dummy_len)
    input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, logits_index = ints
    return batch.replace(
        input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc, req_pool_indices=req_pool_indices,
        seq_lens=seq_lens, seq_lens_cpu=seq_lens_cpu, extend_lens_cpu=batch.extend_lens_cpu + [q] * extra,
        logits_index=logits_index, custom_mask=custom_mask, hidden_in=hidden_in, padded_bs=padded_bs,
        seq_lens_sum=sum(seq_lens_cpu),
    )


def dummy_extend_batch(lens: list[int], device: torch.device) -> ForwardBatch:
    """An EXTEND batch of dummy requests (the reserved row and KV slot) with ``lens`` new tokens each, for warm-ups."""
    n = sum(lens)
    zeros = torch.zeros(n, dtype=torch.int64, device=device)
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    return ForwardBatch(mode=ForwardMode.EXTEND, input_ids=zeros,
                        positions=torch.cat([torch.arange(k, device=device) for k in lens]),
                        out_cache_loc=torch.full_like(zeros, DUMMY_SLOT),
                        req_pool_indices=torch.full((len(lens),), DUMMY_ROW, dtype=torch.int64, device=device),
                        seq_lens=lens_t, seq_lens_cpu=list(lens), extend_lens_cpu=list(lens),
                        logits_index=lens_t.cumsum(0) - 1)


def extend_graph_shape(num_tokens: int, num_reqs: int, max_tokens: int) -> Optional[tuple[int, int]]:
    """(padded requests, padded tokens) of the CUDA graph a prefill step of ``num_tokens`` new tokens from
    ``num_reqs`` requests runs in: both the next power of two above the step's (so that one dummy request holds at
    least one padding token), at least 16 tokens; None when the tokens exceed ``max_tokens``."""
    tokens = max(16, 1 << num_tokens.bit_length())
    return (1 << num_reqs.bit_length(), tokens) if tokens <= max_tokens else None


def pad_extend(batch: ForwardBatch, padded_reqs: int, padded_tokens: int, width: int) -> ForwardBatch:
    """A copy of an EXTEND ``batch`` grown to ``padded_tokens`` tokens and ``padded_reqs`` requests, for a CUDA graph
    of that shape: the padding tokens are one dummy request's (positions 0.., the reserved row and KV slot: it
    attends to its own keys, so its rows stay finite), and the further dummy requests have no tokens. The copy's
    ``extend_width`` is ``width`` (>= ``padded_tokens``; the same for every shape, so that one compiled graph serves
    them all), so the attention metadata does not depend on the real lengths."""
    n, bs = batch.input_ids.shape[0], batch.bs
    pad_tokens, pad_reqs = padded_tokens - n, padded_reqs - bs
    assert pad_tokens >= 1 and pad_reqs >= 1, (n, bs, padded_tokens, padded_reqs)
    dummy_lens = [pad_tokens] + [0] * (pad_reqs - 1)
    tail = upload(np.concatenate([np.zeros(pad_tokens, np.int64), np.arange(pad_tokens, dtype=np.int64),
                                  np.full(pad_tokens, DUMMY_SLOT, np.int64), np.full(pad_reqs, DUMMY_ROW, np.int64),
                                  np.asarray(dummy_lens, np.int64), np.full(pad_reqs, n, np.int64)]),
                  batch.input_ids.device)
    cuts = np.cumsum([pad_tokens] * 3 + [pad_reqs] * 3)[:-1]
    ids, positions, slots, rows, seq_lens, logits_index = torch.tensor_split(tail, cuts.tolist())
    seq_lens_cpu = batch.seq_lens_cpu + dummy_lens
    return batch.replace(
        input_ids=torch.cat([batch.input_ids, ids]), positions=torch.cat([batch.positions, positions]),
        out_cache_loc=torch.cat([batch.out_cache_loc, slots]), req_pool_indices=torch.cat([batch.req_pool_indices, rows]),
        seq_lens=torch.cat([batch.seq_lens, seq_lens]), logits_index=torch.cat([batch.logits_index, logits_index]),
        seq_lens_cpu=seq_lens_cpu, extend_lens_cpu=batch.extend_lens_cpu + dummy_lens, padded_bs=padded_reqs,
        seq_lens_sum=sum(seq_lens_cpu), extend_width=width)
