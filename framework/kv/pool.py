"""Per-layer K/V tensors of the paged pool."""

from __future__ import annotations

import torch
from torch import nn


class KVPool(nn.Module):
    """K and V caches, ``[num_slots, num_kv_heads, head_dim]`` per layer, held as module buffers.

    NOTE: the caches are mutated inside compiled graphs; as buffers (and marked static addresses) they are
    neither copied on every CUDA-graph replay nor make cudagraph trees skip the graph.

    ``scratch_rows > 0`` (``speculative.skip_search``): every kind is one stacked buffer ``[num_layers,
    num_slots + scratch_rows, ...]`` whose per-layer caches are the views ``[i, :num_slots]`` (the same shapes and
    slots as the default layout), so that a forward can address a layer chosen by a device index through the flat
    view ``k_flat`` ``[num_layers * rows_per_layer, ...]`` at ``layer * rows_per_layer + slot``. The rows past
    ``num_slots`` of each layer belong to no request: the skip-set search writes its draft K/V there.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, scratch_rows: int = 0) -> None:
        super().__init__()
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.rows_per_layer = num_slots + scratch_rows
        if scratch_rows:
            for kind in ("k", "v"):
                stacked = torch.zeros(num_layers, self.rows_per_layer, num_kv_heads, head_dim, dtype=dtype,
                                      device=device)
                torch._dynamo.mark_static_address(stacked)
                self.register_buffer(f"{kind}_all", stacked, persistent=False)
                views = [stacked[i, :num_slots] for i in range(num_layers)]
                flat = stacked.view(num_layers * self.rows_per_layer, num_kv_heads, head_dim)
                for t in views + [flat]:
                    torch._dynamo.mark_static_address(t)
                setattr(self, kind, views)
                setattr(self, f"{kind}_flat", flat)
            return
        for i in range(num_layers):
            for kind in ("k", "v"):
                buf = torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
                torch._dynamo.mark_static_address(buf)
                self.register_buffer(f"{kind}{i}", buf, persistent=False)
        self.k = [getattr(self, f"k{i}") for i in range(num_layers)]
        self.v = [getattr(self, f"v{i}") for i in range(num_layers)]
        self.k_flat = self.v_flat = None

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k, v`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slots`` ``[num_tokens]``."""
        self.k[layer].index_copy_(0, slots, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v[layer].dtype))
