"""Per-layer K/V tensors of the paged pool."""

from __future__ import annotations

import torch
from torch import nn


class KVPool(nn.Module):
    """K and V caches, ``[num_slots, num_kv_heads, head_dim]`` per layer, held as module buffers.

    NOTE: the caches are mutated inside compiled graphs; as buffers (and marked static addresses) they are
    neither copied on every CUDA-graph replay nor make cudagraph trees skip the graph.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_layers = num_layers
        for i in range(num_layers):
            for kind in ("k", "v"):
                buf = torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
                torch._dynamo.mark_static_address(buf)
                self.register_buffer(f"{kind}{i}", buf, persistent=False)
        self.k = [getattr(self, f"k{i}") for i in range(num_layers)]
        self.v = [getattr(self, f"v{i}") for i in range(num_layers)]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k, v`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slots`` ``[num_tokens]``."""
        self.k[layer].index_copy_(0, slots, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v[layer].dtype))
