"""Sampling on the device without host synchronisation.

Random draws come from a counter-based hash of (request seed, token index, vocabulary id), so a seeded
request samples the same tokens whatever batch it runs in, and no ``torch.multinomial`` (which syncs and
cannot be captured) is needed: the token is ``argmax(log p - log E)`` with ``E ~ Exp(1)`` per vocabulary entry
(the exponential race, equivalent to Gumbel-max).
"""

from __future__ import annotations

import torch

from framework.batch import SamplingBatch

_MASK32 = 0xFFFFFFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``(h * c) mod 2^32`` for int64 ``h`` in [0, 2^32), in 16-bit halves so that nothing overflows int64."""
    lo = h & 0xFFFF
    hi = h >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, width: int, salt: int = 0) -> torch.Tensor:
    """``[bs, width]`` float32 in (0, 1), a pure function of (seed, step, column, salt).

    NOTE: 23 bits, so that ``(k + 0.5) / 2^23`` is exact in float32 and strictly below 1. With 24 bits the top
    value rounded to 1.0 (about once per 2^24 draws: once per ~340 rows of a 49k vocabulary), ``-log(u)`` was 0,
    and the exponential race picked that column whatever its probability, even 0 (a greedy row's one-hot, a
    token top-k had removed)."""
    row = _fmix32((seeds & _MASK32) ^ _fmix32(_mul32(steps & _MASK32, 0x9E3779B1) ^ (salt & _MASK32)))  # [bs]
    cols = torch.arange(width, device=seeds.device, dtype=torch.int64)
    h = _fmix32(row[:, None] ^ _fmix32(_mul32(cols, 0x27D4EB2F) ^ 0x165667B1)[None, :])  # [bs, width]
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def probs_from_logits(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                      top_ps: torch.Tensor, need_top_k_top_p: bool) -> torch.Tensor:
    """Temperature-scaled, top-k / top-p filtered probabilities ``[bs, vocab]`` (rows with temperature 0 are
    computed at temperature 1; callers take argmax for them). The same transform is applied to target and draft
    distributions in speculative verification."""
    temps = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    probs = torch.softmax(logits.float() / temps[:, None], dim=-1)
    if not need_top_k_top_p:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(top_ks > 0, top_ks, torch.full_like(top_ks, probs.shape[-1]))
    cum_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly better tokens
    keep = (ranks < k[:, None]) & (cum_before < top_ps[:, None])  # the top token is always kept
    sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, salt: int = 0) -> torch.Tensor:
    """One token per row ``[bs]`` int64 drawn from ``probs`` ``[bs, vocab]`` by the exponential race."""
    u = uniform_noise(seeds, steps, probs.shape[-1], salt)
    return torch.argmax(probs / -torch.log(u), dim=-1)


def sample(logits: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    """Next token per row ``[bs]`` int64 from ``logits`` ``[bs, vocab]``; greedy rows take argmax."""
    greedy = torch.argmax(logits, dim=-1)
    if params.all_greedy:
        return greedy
    probs = probs_from_logits(logits, params.temperatures, params.top_ks, params.top_ps, params.need_top_k_top_p)
    sampled = sample_from_probs(probs, params.seeds, params.steps)
    return torch.where(params.temperatures > 0, sampled, greedy)
