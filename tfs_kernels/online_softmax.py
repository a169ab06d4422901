"""The online-softmax update and the dot product shared by the attention kernels (flash-attention style, base-2
exponentials)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, IEEE_DOT: tl.constexpr):
    """``a @ b`` with float32 accumulation; exact float32 products when ``IEEE_DOT`` (float32 inputs only)."""
    if IEEE_DOT:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def online_softmax_step(acc, l_i, m_i, s, v, IEEE_DOT: tl.constexpr):
    """Fold one tile of keys into the running state of each query row.

    acc ``[BLOCK_M, BLOCK_D]`` float32 (unnormalised output), l_i / m_i ``[BLOCK_M]`` (sum of weights, running max,
    base-2 log units); s ``[BLOCK_M, BLOCK_N]`` scores already scaled by ``scale * log2(e)``, ``-inf`` where masked;
    v ``[BLOCK_N, BLOCK_D]``. Rows that have seen only masked keys keep ``m = -inf`` and ``l = 0`` (no NaN).
    ``IEEE_DOT``: exact float32 products (float32 caches; otherwise the default tensor-core precision).
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked row must not compute -inf - -inf
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE_DOT)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, l_i, m_new
