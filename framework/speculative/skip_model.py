"""The draft model of ``speculative.skip_search``: the target's layers chosen by a device tensor, run in K static
slots, so that changing the skip set never recompiles nor re-records a CUDA graph, and a skipped layer costs
nothing.

Design (why not the simpler ones):

- A per-layer gate (``x + gate[i] * layer_i(x)``) keeps the graph static but runs every layer: it saves nothing.
- Gathering each slot's weights from stacked per-layer weights by index inside the graph (``W[layer_ids[k]]``)
  copies the layer's weights on every draft step: a memory-bound decode step then moves three times the weights
  a kept layer needs (read, write, read again), more than the full model.
- Per-layer graphs chosen on the host re-launch a graph per kept layer (host time per layer).

So each of the K slots is a :class:`DecoderLayer` with weights of its own (static addresses: the compiled graph,
its CUDA graph, the fused decode kernels and inductor see one fixed set of parameters); :meth:`SlotDraftModel.
set_layers` copies the chosen layers' weights into the slots that change, outside any graph, and writes the
``layer_ids`` ``[K]`` device tensor. The one thing a slot must address by layer is the K/V cache: its attention
(:class:`SlotAttention`) reads and writes the target's cache of layer ``layer_ids[k]`` through the pool's stacked
layout (``KVPool(scratch_rows > 0)``), at flat row ``layer_ids[k] * rows_per_layer + slot``: index arithmetic on
the gather that sdpa does anyway. The cost: K/L of the decoder's weights in extra memory, and a weight copy of the
slots that change when the search switches sets (or tries a candidate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from framework.attention.sdpa import SdpaBackend, SdpaMetadata
from framework.batch import ForwardBatch
from framework.kv import KVAllocator, KVPool
from framework.models.llama import DecoderLayer, LlamaForCausalLM


@dataclass(frozen=True)
class ScoreWindow:
    """``ForwardBatch.spec`` of a scoring forward: each request's last ``window`` committed tokens, re-drafted with
    their own K/V at the pool's scratch rows (row ``b``: scratch ``b * window ..``) over the target's prefix."""

    window: int


class SlotAttention(SdpaBackend):
    """sdpa over the stacked pool at the layer each slot runs (``layer_ids[slot]``, a device index)."""

    name = "skip_slots"

    def __init__(self, pool: KVPool, allocator: KVAllocator, num_heads: int, num_kv_heads: int, head_dim: int,
                 layer_ids: torch.Tensor, score_requests: int) -> None:
        super().__init__(pool, allocator, num_heads, num_kv_heads, head_dim)
        if pool.k_flat is None:
            raise ValueError("SlotAttention needs a KVPool built with scratch_rows > 0")
        self.layer_ids = layer_ids  # [K] int64, the draft model's buffer
        self.score_requests = score_requests

    def init_metadata(self, batch: ForwardBatch) -> SdpaMetadata:
        meta = super().init_metadata(batch)
        if isinstance(batch.spec, ScoreWindow):  # the window's keys are the scoring forward's own (scratch rows)
            w = batch.spec.window
            bs, width = meta.kv_slots.shape
            rel = torch.arange(width, device=meta.kv_slots.device)[None, :] - (batch.seq_lens - w)[:, None]
            row = torch.arange(bs, device=rel.device).clamp(max=self.score_requests - 1)[:, None]  # (padding: reads)
            scratch = self.pool.num_slots + row * w + rel
            meta.kv_slots = torch.where((rel >= 0) & (rel < w), scratch, meta.kv_slots)  # [bs, width]
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                meta: SdpaMetadata) -> torch.Tensor:
        base = self.layer_ids[layer] * self.pool.rows_per_layer  # [] first flat row of the slot's layer
        k_flat, v_flat = self.pool.k_flat, self.pool.v_flat  # [num_layers * rows_per_layer, kv_heads, dim]
        loc = base + meta.out_cache_loc
        k_flat.index_copy_(0, loc, k.to(k_flat.dtype))
        v_flat.index_copy_(0, loc, v.to(v_flat.dtype))
        rows = base + meta.kv_slots  # [bs, width]
        return self.attend(q, k_flat[rows], v_flat[rows], meta)


class SlotDraftModel(nn.Module):
    """The target's embedding, final norm and LM head (shared) around K slot layers; ``forward`` is the target's
    (:meth:`LlamaForCausalLM.forward`), so drafts take the same fused decode path."""

    forward = LlamaForCausalLM.forward
    tp = None  # (the skip search is refused with tensor parallelism)

    def __init__(self, target: LlamaForCausalLM, layers: list[int]) -> None:
        super().__init__()
        self._target = [target]  # (a list: not a submodule, its layers are not this model's)
        self.args = target.args
        self.embed_tokens, self.norm, self.lm_head = target.embed_tokens, target.norm, target.lm_head
        ref = target.layers[0]
        param = next(ref.parameters())
        self.layers = nn.ModuleList(DecoderLayer(target.args, k) for k in range(len(layers)))
        self.layers.to(device=param.device, dtype=param.dtype)
        self.layers.requires_grad_(False)
        self.register_buffer("layer_ids", torch.full((len(layers),), -1, dtype=torch.int64, device=param.device),
                             persistent=False)
        self.loaded: list[int] = [-1] * len(layers)  # host copy of layer_ids
        self.set_layers(layers)

    @property
    def rope_cos(self) -> torch.Tensor:
        return self._target[0].rope_cos

    @property
    def rope_sin(self) -> torch.Tensor:
        return self._target[0].rope_sin

    @property
    def fused_decode(self) -> bool:
        return self._target[0].fused_decode

    @property
    def deterministic(self) -> bool:  # (the LM head as the target's; drafts need no batch invariance)
        return self._target[0].deterministic

    @property
    def pdl(self) -> bool:
        return self._target[0].pdl

    @pdl.setter
    def pdl(self, value: bool) -> None:  # (ModelRunner sets it; the target's runner already did)
        pass

    def set_attention_backend(self, backend: Any) -> None:
        for layer in self.layers:
            layer.self_attn.backend = backend

    @torch.no_grad()
    def set_layers(self, layers: list[int]) -> int:
        """Run ``layers`` (ascending target layer ids, K of them) from now on; returns the slots copied."""
        if len(layers) != len(self.layers) or list(layers) != sorted(set(layers)):
            raise ValueError(f"expected {len(self.layers)} distinct ascending layer ids, got {layers}")
        changed = 0
        for slot, (layer, old) in enumerate(zip(layers, self.loaded)):
            if layer == old:
                continue
            src = self._target[0].layers[layer]
            for dst_p, src_p in zip(self.layers[slot].parameters(), src.parameters()):
                dst_p.copy_(src_p)
            changed += 1
        if changed:
            self.layer_ids.copy_(torch.tensor(layers, dtype=torch.int64), non_blocking=True)
            self.loaded = list(layers)
        return changed
