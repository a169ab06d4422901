"""``tfs::decode_attention``: paged decode attention (one new token per request) with split-K over the keys.

The kernel is the split-K kernel of :mod:`tfs_kernels.split_kv_attention` with ``q_len = 1`` and the causal rule (the
token sees every key of its request); :func:`decode_attention_reference` is the plain-torch definition and the
CPU implementation.
"""

from __future__ import annotations

import torch
from torch.library import triton_op

from tfs_kernels.dispatch import register_cpu_reference, use_triton
from tfs_kernels.split_kv_attention import launch_split_kv_attention, split_kv_attention_reference


@triton_op("tfs::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                        req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_splits: int,
                        target_programs: int, min_split_len: int) -> torch.Tensor:
    """q ``[bs, heads, dim]``; k/v_cache ``[num_slots, kv_heads, dim]``; req_to_token ``[rows, width]`` int64;
    req_pool_indices / seq_lens ``[bs]`` int64 -> ``[bs, heads, dim]`` (q's dtype)."""
    return launch_split_kv_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, None, 1, scale,
                                     max_splits, target_programs, min_split_len)


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, max_splits: int, target_programs: int,
                               min_split_len: int) -> torch.Tensor:
    """Plain torch; the split policy arguments do not change the result."""
    return split_kv_attention_reference(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, None, 1,
                                        scale)


register_cpu_reference(decode_attention_op, decode_attention_reference)


@torch.library.custom_op("tfs::decode_attention_pdl", mutates_args=())
def decode_attention_pdl_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                            req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_splits: int,
                            target_programs: int, min_split_len: int) -> torch.Tensor:
    """``tfs::decode_attention`` with programmatic dependent launch (CUDA, tfs_kernels/pdl.py): an opaque op, which
    inductor calls as it is, so that the launches keep their PDL attribute inside captured graphs."""
    return launch_split_kv_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, None, 1, scale,
                                     max_splits, target_programs, min_split_len, pdl=True)


@decode_attention_pdl_op.register_fake
def _decode_attention_pdl_fake(q: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(q)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_splits: int,
                     target_programs: int, min_split_len: int, pdl: bool = False) -> torch.Tensor:
    """The op where Triton runs (see :mod:`tfs_kernels.dispatch`; ``pdl``: its PDL variant on CUDA), the reference
    elsewhere."""
    fn = torch.ops.tfs.decode_attention if use_triton(q) else decode_attention_reference
    if pdl and q.is_cuda:
        fn = torch.ops.tfs.decode_attention_pdl
    return fn(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale, max_splits, target_programs,
              min_split_len)
