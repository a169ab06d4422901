"""``tfs::fill_bonus_tokens``: the bonus token of each request after speculative verification.

``accept_tokens`` is flat ``[bs * stride]``: row i holds the tokens emitted by request i's accepted path, and the
bonus token (the target's own token after the last accepted node) is the last of its ``accept_lens[i]`` entries:
``bonus[i] = accept_tokens[i * stride + accept_lens[i] - 1]``.

NOTE: ``stride`` is the width of ``accept_index`` (num_steps + 1), NOT num_draft_tokens; the two differ when
topk > 1, and using the wrong one reads another request's tokens.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton


def fill_bonus_tokens_ref(accept_tokens: torch.Tensor, accept_lens: torch.Tensor, stride: int) -> torch.Tensor:
    """Plain-torch reference (and the CPU implementation): ``[bs]`` int64."""
    bs = accept_lens.shape[0]
    rows = torch.arange(bs, device=accept_tokens.device)
    return accept_tokens.view(bs, stride)[rows, accept_lens.long() - 1].to(torch.int64)


@triton.jit
def _fill_bonus_tokens_kernel(accept_tokens_ptr, accept_lens_ptr, out_ptr, bs, stride, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < bs
    lens = tl.load(accept_lens_ptr + offs, mask=mask, other=1).to(tl.int64)
    tokens = tl.load(accept_tokens_ptr + offs.to(tl.int64) * stride + lens - 1, mask=mask, other=0)
    tl.store(out_ptr + offs, tokens.to(tl.int64), mask=mask)


@triton_op("tfs::fill_bonus_tokens", mutates_args={})
def fill_bonus_tokens_op(accept_tokens: torch.Tensor, accept_lens: torch.Tensor, stride: int) -> torch.Tensor:
    bs = accept_lens.shape[0]
    out = torch.empty(bs, dtype=torch.int64, device=accept_tokens.device)
    block = 128
    wrap_triton(_fill_bonus_tokens_kernel)[(triton.cdiv(bs, block),)](accept_tokens, accept_lens, out, bs, stride,
                                                                      BLOCK=block)
    return out


@fill_bonus_tokens_op.register_kernel("cpu")
def _fill_bonus_tokens_cpu(accept_tokens: torch.Tensor, accept_lens: torch.Tensor, stride: int) -> torch.Tensor:
    return fill_bonus_tokens_ref(accept_tokens, accept_lens, stride)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def fill_bonus_tokens(accept_tokens: torch.Tensor, accept_lens: torch.Tensor, stride: int) -> torch.Tensor:
    """``[bs]`` int64 bonus tokens: the Triton kernel on CUDA (or under TRITON_INTERPRET=1), else the reference.

    NOTE: dispatch happens here rather than through the op's CPU kernel because torch.compile traces into a
    triton_op's body, which needs a GPU driver."""
    assert accept_tokens.dtype == torch.int64 and accept_tokens.dim() == 1, "accept_tokens: flat int64"
    if accept_tokens.is_cuda or interpreting():
        return torch.ops.tfs.fill_bonus_tokens(accept_tokens, accept_lens, stride)
    return fill_bonus_tokens_ref(accept_tokens, accept_lens, stride)
