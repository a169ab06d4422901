"""Verification of draft chains as tensor operations: no loop over depth or requests, nothing read by the host.

The same decisions as :func:`framework.speculative.verify.verify` makes for a chain (same uniform draws, same
residual salts), so a seeded request emits the same tokens on either path:

- greedy: the accepted prefix is the run of drafts equal to the target's argmax after the node before them;
- sampling: draft ``x`` at depth ``d`` is accepted with probability ``min(1, p_d(x) / q_d(x))``; the bonus token is
  drawn at the first rejected depth from ``normalise(max(0, p - q))`` (``q`` one-hot for deterministic drafters),
  or from ``p`` where no draft was tried.
"""

from __future__ import annotations

from typing import Optional

import torch

from framework.sampling import probs_from_logits, sample_from_probs, uniform_noise
from framework.speculative import verify as tree_verify  # (its residual_after_rejection: one definition)
from framework.speculative.verify import SALT_ACCEPT, SALT_RESIDUAL
from tfs_kernels.fill_bonus_tokens import fill_bonus_tokens


def _accepted(accept: torch.Tensor) -> torch.Tensor:
    """``[bs]`` int64: length of the leading run of True in ``accept`` ``[bs, k]``."""
    return torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)


def verify_chain_greedy(tokens: torch.Tensor, valid: torch.Tensor,
                        logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens / valid ``[bs, q]`` (root first), logits ``[bs * q, vocab]`` -> (accept_lens ``[bs]``,
    accept_tokens ``[bs, q]``: the tokens emitted, the first ``accept_lens`` of each row valid, bonus ``[bs]``)."""
    bs, q = tokens.shape
    predict = logits.argmax(-1).view(bs, q)  # the target's token after each node
    accept_lens = _accepted(valid[:, 1:] & (tokens[:, 1:] == predict[:, :-1])) + 1
    return accept_lens, predict, fill_bonus_tokens(predict.reshape(-1), accept_lens, q)


def verify_chain_sampling(tokens: torch.Tensor, valid: torch.Tensor, logits: torch.Tensor,
                          temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                          seeds: torch.Tensor, steps: torch.Tensor, need_top_k_top_p: bool,
                          draft_probs: Optional[torch.Tensor] = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`verify_chain_greedy` for a batch where some requests sample. Sampling tensors ``[bs]``; ``steps``
    the index of each request's first token of this iteration; ``draft_probs`` ``[bs, q, vocab]`` the
    distribution each node's child was drawn from (None: drafts chosen deterministically, q one-hot). ``q = 1`` (the
    root alone, no draft) samples the bonus token from the target's distribution, as a plain decode step does."""
    bs, q = tokens.shape
    dev = tokens.device
    rep = lambda t: t.repeat_interleave(q)  # noqa: E731  per request -> per node
    probs = probs_from_logits(logits, rep(temperatures), rep(top_ks), rep(top_ps), need_top_k_top_p)
    onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    greedy = temperatures == 0  # [bs]
    p = torch.where(rep(greedy)[:, None], onehot, probs).view(bs, q, -1)  # [bs, q, vocab]
    drafts = tokens[:, 1:]  # [bs, k] the child of node d is drafts[:, d]
    p_x = torch.gather(p[:, :-1], 2, drafts[:, :, None])[:, :, 0]  # [bs, k]
    q_x = torch.ones_like(p_x) if draft_probs is None else \
        torch.gather(draft_probs[:, :-1], 2, drafts[:, :, None])[:, :, 0]
    u = uniform_noise(seeds, steps, q, salt=SALT_ACCEPT)  # [bs, q] one draw per node, as verify_stochastic
    accepted = _accepted(valid[:, 1:] & (u[:, 1:] < p_x / q_x.clamp(min=1e-20)))  # [bs] drafts accepted
    rows = torch.arange(bs, device=dev)
    p_stop = p[rows, accepted]  # [bs, vocab] the target at the node where the chain stops
    child = accepted.clamp(max=q - 2)
    tried = (accepted < q - 1) & valid[rows, child + 1]  # a draft was tried there, and rejected
    if draft_probs is None:
        q_stop = torch.zeros_like(p_stop).scatter_(1, tokens[rows, child + 1][:, None], 1.0)  # (drafts[rows, child])
    else:
        q_stop = draft_probs[rows, accepted]
    residual = torch.where(tried[:, None], tree_verify.residual_after_rejection(p_stop, q_stop), p_stop)
    salt = torch.where(accepted == 0, torch.zeros_like(accepted), accepted + SALT_RESIDUAL)  # residual_salt
    bonus = torch.where(greedy, residual.argmax(-1), sample_from_probs(residual, seeds, steps, salt=salt))
    depth = torch.arange(q, device=dev)[None, :]
    shifted = torch.cat([drafts, tokens[:, :1]], dim=1)  # the emitted token at depth d < accepted is drafts[d]
    accept_tokens = torch.where(depth < accepted[:, None], shifted, bonus[:, None])  # [bs, q]
    accept_lens = accepted + 1
    return accept_lens, accept_tokens, fill_bonus_tokens(accept_tokens.reshape(-1), accept_lens, q)
