"""Tree masks packed into bits: one int64 word per query row, which the split-K verify kernel
(:mod:`tfs_kernels.split_kv_attention`) reads instead of a byte per (row, key). attention=triton packs the step's mask
once (``TritonBackend.init_metadata``) when it is at most :data:`MASK_WORD_BITS` keys wide."""

from __future__ import annotations

import functools

import torch

MASK_WORD_BITS = 64  # the widest mask one word holds


@functools.lru_cache(maxsize=8)
def _powers_of_two(device: torch.device) -> torch.Tensor:
    """``[64]`` int64: ``1 << i`` (``1 << 63`` is the sign bit), made once per device."""
    return torch.ones(MASK_WORD_BITS, dtype=torch.int64).bitwise_left_shift(torch.arange(MASK_WORD_BITS)).to(device)


def pack_mask_bits(custom_mask: torch.Tensor) -> torch.Tensor:
    """``custom_mask`` ``[bs, q_len, width <= 64]`` (bool, or uint8 0 / 1) -> ``[bs, q_len]`` int64, bit ``i`` =
    key ``i`` of the mask. Two kernels for a bool mask (a select and a sum; the uint8 conversion it replaces in
    attention=triton's step was one)."""
    width = custom_mask.shape[2]
    torch._check(width <= MASK_WORD_BITS, lambda: f"pack_mask_bits: a mask {width} keys wide is over 64")
    visible = custom_mask if custom_mask.dtype == torch.bool else custom_mask != 0
    # distinct powers of two: their sum is their bitwise or (wrapping into the sign bit for bit 63)
    return torch.where(visible, _powers_of_two(custom_mask.device)[:width], 0).sum(-1)


__all__ = ["MASK_WORD_BITS", "pack_mask_bits"]
