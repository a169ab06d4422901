"""The paged KV pool of an MLA model with DeepSeek sparse attention: per layer the compressed latent (the
``kv_lora_rank`` normalised dims followed by the roped ``qk_rope_head_dim`` dims, one "head" shared by every query
head) and the lightning indexer's key cache."""

from __future__ import annotations

import torch
from torch import nn


class MLAPool(nn.Module):
    """``latent[i]`` ``[num_slots, latent_dim]`` and ``index_k[i]`` ``[num_slots, index_dim]`` per layer, held as
    module buffers (marked static addresses, like :class:`framework.kv.KVPool`)."""

    def __init__(self, num_layers: int, num_slots: int, latent_dim: int, index_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.num_layers = num_layers
        for i in range(num_layers):
            for kind, dim in (("latent", latent_dim), ("index_k", index_dim)):
                buf = torch.zeros(num_slots, dim, dtype=dtype, device=device)
                torch._dynamo.mark_static_address(buf)
                self.register_buffer(f"{kind}{i}", buf, persistent=False)
        self.latent = [getattr(self, f"latent{i}") for i in range(num_layers)]
        self.index_k = [getattr(self, f"index_k{i}") for i in range(num_layers)]

    def store_latent(self, layer: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """Write ``latent`` ``[num_tokens, latent_dim]`` at ``slots`` ``[num_tokens]``."""
        self.latent[layer].index_copy_(0, slots, latent.to(self.latent[layer].dtype))

    def store_index(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Write the indexer's keys ``[num_tokens, index_dim]`` at ``slots``."""
        self.index_k[layer].index_copy_(0, slots, keys.to(self.index_k[layer].dtype))
