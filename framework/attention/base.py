"""The attention-backend interface."""

from __future__ import annotations

from typing import Any, Optional

import torch

from framework.batch import ForwardBatch
from framework.config import ConfigError
from framework.kv import KVAllocator, KVPool


class AttentionBackend:
    """Turns a ForwardBatch into kernel metadata and runs attention over the paged KV pool.

    ``init_metadata`` runs outside compiled graphs; its output must have fixed shapes for a given
    (mode, padded_bs, tokens per request, kv width bucket) so that captured graphs replay. ``forward`` runs inside
    them: it stores the new K/V at ``batch.out_cache_loc`` and attends.
    """

    name = "base"
    pdl = False  # set by the model runner (compile.pdl): backends with PDL kernel variants launch them
    # EXTEND metadata made of tensors and sizes only (no per-request host lists inside forward): a ragged prefill
    # can run as one compiled graph with dynamic token and request counts
    compiles_extend = False
    # forward reads slots from the allocator's req_to_token itself (the metadata holds the table, not a gather of
    # it): a staged decode batch's new slots can be written inside the compiled forward (ModelRunner._forward)
    reads_table_in_forward = False
    deterministic = False  # model.deterministic: see set_deterministic

    def __init__(self, pool: KVPool, allocator: KVAllocator, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> None:
        self.pool = pool
        self.allocator = allocator
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def set_deterministic(self) -> None:
        """model.deterministic: from now on a query token's attention output must not depend on the forward it is
        in (decode, verify, prefill; batch size, position in the batch). Backends that can promise it override."""
        raise ConfigError(f"model.deterministic=true: attention={self.name} has no batch-invariant mode; use "
                          "attention=triton (CUDA, or the CPU under TRITON_INTERPRET=1) or attention=sdpa (CPU)")

    def init_metadata(self, batch: ForwardBatch) -> Any:
        raise NotImplementedError

    def expect_q_lens(self, q_lens: list[int]) -> None:
        """The tokens per request that uniform batches will have. A backend that caches state per ``q_len`` fills it
        here, before the programs that read it compile: a cache that grows under a compiled program's guards makes
        dynamo compile that program again."""

    def uniform_metadata(self, out_cache_loc: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                         q_len: int) -> Optional[Any]:
        """The metadata of a uniform batch of ``q_len`` causal tokens per request (no custom mask) from device
        tensors alone, so that a compiled program can build it from tensors it computed itself (speculation v2's
        fused iteration): out_cache_loc ``[bs * q_len]``, req_pool_indices / seq_lens ``[bs]``. None where the
        backend needs the host (then the caller builds a ForwardBatch for :meth:`init_metadata`)."""
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: Any) -> torch.Tensor:
        """q ``[num_tokens, num_heads, head_dim]``, k/v ``[num_tokens, num_kv_heads, head_dim]``
        -> ``[num_tokens, num_heads * head_dim]``."""
        raise NotImplementedError

    def forward_qkv(self, qkv: torch.Tensor, rope: Any, layer: int, meta: Any) -> Optional[torch.Tensor]:
        """A backend that fuses RoPE and the K/V store takes the raw projection here: qkv ``[n, (heads + 2 *
        kv_heads) * head_dim]``, rope a :class:`tfs_kernels.rope_store.Rope` -> ``[n, heads * head_dim]``. None:
        not fused, the model applies RoPE and calls :meth:`forward`."""
        return None

    def forward_projection(self, x: torch.Tensor, w_qkv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           rope: Any, layer: int, meta: Any, det: bool = False) -> Optional[torch.Tensor]:
        """A backend that fuses a decode-sized batch's qkv projection (with the RMSNorm before it), RoPE and the
        K/V store takes the layer's input here: x ``[n, hidden]``, w_qkv ``[(heads + 2 * kv_heads) * head_dim,
        hidden]`` -> ``[n, heads * head_dim]``; ``det``: the projection summed as ``tfs::det_matmul`` sums it (the
        model's several-row path). None: not fused (the model projects and calls :meth:`forward_qkv`)."""
        return None

    def dynamic_dims(self, meta: Any) -> list[tuple[torch.Tensor, int]]:
        """(tensor, dim) pairs of ``meta`` whose size varies between replays of one compiled graph."""
        return []
