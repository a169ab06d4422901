"""``tfs::verify_attention``: paged attention for ``q_len`` new tokens per request (TARGET_VERIFY, DRAFT_EXTEND,
DRAFT_DECODE) with a per-request custom (tree) mask over the last ``mask_width`` keys and full attention to the
keys before them; without a mask the new tokens attend causally among themselves.

Same split-K kernel as decode (:mod:`tfs_kernels.split_kv_attention`): the ``q_len * group`` query rows of one KV head
share every K/V tile, so verifying 8 tokens reads the cache once, like one decode step.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op

from tfs_kernels.dispatch import register_cpu_reference, use_triton
from tfs_kernels.split_kv_attention import launch_split_kv_attention, split_kv_attention_reference


@triton_op("tfs::verify_attention", mutates_args=())
def verify_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                        req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, custom_mask: Optional[torch.Tensor],
                        q_len: int, scale: float, max_splits: int, target_programs: int,
                        min_split_len: int, mask_bits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q ``[bs * q_len, heads, dim]`` (request-major); custom_mask ``[bs, q_len, mask_width]`` bool (or uint8 0 /
    1) or None; seq_lens ``[bs]``: keys after this forward -> ``[bs * q_len, heads, dim]`` (q's dtype).
    ``mask_bits``: optionally the same mask as ``pack_mask_bits(custom_mask)`` ``[bs, q_len]`` int64 (width <= 64),
    which the kernel reads instead of the mask's bytes (then only custom_mask's width is used)."""
    return launch_split_kv_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, custom_mask,
                                     q_len, scale, max_splits, target_programs, min_split_len, mask_bits=mask_bits)


def verify_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                               custom_mask: Optional[torch.Tensor], q_len: int, scale: float, max_splits: int,
                               target_programs: int, min_split_len: int,
                               mask_bits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain torch; the split policy arguments and ``mask_bits`` (a packed copy of the mask) do not change the
    result."""
    return split_kv_attention_reference(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, custom_mask,
                                        q_len, scale)


register_cpu_reference(verify_attention_op, verify_attention_reference)


@torch.library.custom_op("tfs::verify_attention_pdl", mutates_args=())
def verify_attention_pdl_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                            req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                            custom_mask: Optional[torch.Tensor], q_len: int, scale: float, max_splits: int,
                            target_programs: int, min_split_len: int,
                            mask_bits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``tfs::verify_attention`` with programmatic dependent launch (CUDA, tfs_kernels/pdl.py): an opaque op, which
    inductor calls as it is, so that the launches keep their PDL attribute inside captured graphs."""
    return launch_split_kv_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, custom_mask,
                                     q_len, scale, max_splits, target_programs, min_split_len, pdl=True,
                                     mask_bits=mask_bits)


@verify_attention_pdl_op.register_fake
def _verify_attention_pdl_fake(q: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(q)


def verify_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, custom_mask: Optional[torch.Tensor],
                     q_len: int, scale: float, max_splits: int, target_programs: int,
                     min_split_len: int, pdl: bool = False, mask_bits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The op where Triton runs (see :mod:`tfs_kernels.dispatch`; ``pdl``: its PDL variant on CUDA), the reference
    elsewhere. ``mask_bits``: ``custom_mask`` packed by :func:`tfs_kernels.mask_bits.pack_mask_bits`, read by the
    kernel in its place."""
    fn = torch.ops.tfs.verify_attention if use_triton(q) else verify_attention_reference
    if pdl and q.is_cuda:
        fn = torch.ops.tfs.verify_attention_pdl
    return fn(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, custom_mask, q_len, scale, max_splits,
              target_programs, min_split_len, mask_bits)
