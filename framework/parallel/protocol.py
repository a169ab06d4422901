"""What rank 0 broadcasts to the other ranks: a small host header (pickled, over a gloo group: the receivers learn
the shapes before any device data moves), then for a forward one packed int64 payload on the model's group
(NCCL on CUDA): the batch's integer tensors, its tree mask and the ``req_to_token`` rows it reads."""

from __future__ import annotations

import pickle
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from framework.batch import ForwardBatch, ForwardMode

HEADER_BYTES = 4096  # a header that does not fit (8 bytes of length first) follows in a second broadcast
ALIGN = 2  # int64 elements: every payload piece starts on 16 bytes, as inductor assumes of its inputs


class HeaderChannel:
    """Pickled host objects from rank 0 to every rank, over a gloo group."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        self.view = self.buf.numpy()

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.view[:8] = np.frombuffer(np.int64(len(data)).tobytes(), np.uint8)
        small = len(data) <= HEADER_BYTES - 8
        if small:
            self.view[8:8 + len(data)] = np.frombuffer(data, np.uint8)
        dist.broadcast(self.buf, 0, group=self.group)
        if not small:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.group)

    def recv(self) -> Any:
        dist.broadcast(self.buf, 0, group=self.group)
        size = int(self.view[:8].view(np.int64)[0])
        if size <= HEADER_BYTES - 8:
            return pickle.loads(self.view[8:8 + size].tobytes())
        extra = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(extra, 0, group=self.group)
        return pickle.loads(extra.numpy().tobytes())


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack_forward(batch: ForwardBatch, input_ids: torch.Tensor, table: torch.Tensor, layer_ids: Any
                 ) -> tuple[dict, torch.Tensor]:
    """(header, payload) of a forward. ``input_ids``: the batch's ids with the future-token placeholders resolved
    (the other ranks do not hold ``next_tokens``); ``table``: rank 0's ``req_to_token``, of which the batch's rows
    up to its longest (host-known) length go along, so that the other ranks' tables agree where it reads them."""
    if batch.hidden_in is not None:
        raise NotImplementedError("tensor parallelism: forwards with input hidden states (EAGLE heads)")
    width = min(table.shape[1], max(batch.seq_lens_cpu, default=1))
    rows = table[batch.req_pool_indices, :width]  # [bs, width]
    pieces = [input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens,
              batch.logits_index, rows.reshape(-1)]
    mask = batch.custom_mask
    if mask is not None:
        pieces.append(mask.reshape(-1).to(torch.int64))
    sizes = [p.numel() for p in pieces]
    flat: list[torch.Tensor] = []
    for p, n in zip(pieces, sizes):
        flat.append(p.reshape(-1))
        if _aligned(n) != n:
            flat.append(p.new_zeros(_aligned(n) - n))
    header = {"kind": "forward", "mode": batch.mode.value, "sizes": sizes, "width": width,
              "mask_shape": None if mask is None else tuple(mask.shape), "bs": batch.bs, "padded_bs": batch.padded_bs,
              "seq_lens_cpu": list(batch.seq_lens_cpu), "extend_lens_cpu": list(batch.extend_lens_cpu),
              "seq_lens_sum": batch.seq_lens_sum, "write_slots": batch.write_slots,
              "extend_width": batch.extend_width, "layer_ids": layer_ids}
    return header, torch.cat(flat)


def payload_size(header: dict) -> int:
    return sum(_aligned(n) for n in header["sizes"])


def unpack_forward(header: dict, payload: torch.Tensor, table: torch.Tensor) -> ForwardBatch:
    """The batch of a forward header and its received payload; writes the rows it carries into ``table``."""
    views, start = [], 0
    for n in header["sizes"]:
        views.append(payload[start:start + n])
        start += _aligned(n)
    input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, logits_index, rows = views[:7]
    width = header["width"]
    table[req_pool_indices, :width] = rows.view(-1, width)
    mask: Optional[torch.Tensor] = None
    if header["mask_shape"] is not None:
        mask = views[7].view(header["mask_shape"]).to(torch.bool)
    return ForwardBatch(
        mode=ForwardMode(header["mode"]), input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
        req_pool_indices=req_pool_indices, seq_lens=seq_lens, seq_lens_cpu=header["seq_lens_cpu"],
        extend_lens_cpu=header["extend_lens_cpu"], logits_index=logits_index, bs=header["bs"],
        padded_bs=header["padded_bs"], seq_lens_sum=header["seq_lens_sum"], custom_mask=mask,
        write_slots=header["write_slots"], extend_width=header["extend_width"])
