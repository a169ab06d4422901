"""Suffix decoding's chain (``speculative=suffix``, ``topk=1``) computed on the device for a batch (speculation v2).

:func:`suffix_chain_device` drafts what :meth:`SuffixDrafter.draft` drafts for a chain, from two sources held as
token rows on the device instead of suffix trees: the request's own tokens (its :class:`TokenHistory` row) and the
corpus of finished requests (:class:`SuffixCorpus`, a ring of tokens with a separator after each request). A
suffix tree's node for a string ``s`` counts the occurrences of ``s``; here an occurrence is a position ``j`` where
the request's last ``L`` tokens also end, and a child's count is the number of those occurrences followed by that
token. For every source and every match length ``L`` (``1 .. suffix_max_depth - 1``, as v1's ``matches``), the chain
is grown greedily: at depth ``k`` the most frequent next token among the occurrences that still agree with the
chain (ties: the earliest occurrence, as a tree's first-inserted child), its path probability the product of the
count over the total at each depth; the chain stops where that falls below ``min_token_prob``, at
``min(num_steps, int(max_spec_factor * L + max_spec_offset))`` tokens, and where ``L + k`` would pass
``suffix_max_depth`` (the trees' depth bound). The chain with the largest sum of path probabilities wins (the own
tokens first, longer matches first, among equals), as v1's scoring across trees and match lengths.

Differences from v1's host drafts (documented where they can show):

- counts come from at most ``max_occurrences`` occurrences a source (those of the longest matches, the most recent
  among equals): exact where a suffix occurred at most that often, a sample of its best matches otherwise;
- after evictions, equal counts may break differently (v1 keeps a surviving child's original insertion order);
- a request's own tokens are the device's (no lag); finished requests join the corpus when the host applies their
  last iteration, which an already queued iteration does not see; requests aborted while running do not join it;
- the corpus budget counts slots: a request's tokens and its separator.

Everything is fixed-shape tensor work (no host synchronisation), so it runs inside the iteration's CUDA graph and,
the same code, eagerly on the CPU. :func:`suffix_chain_reference` is the plain host reference (lists, brute force).
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import torch
import torch.nn.functional as F

SEP = -1  # no token: a separator between corpus requests, a free slot, past a request's known tokens
MAX_OCCURRENCES = 64  # occurrences per source whose continuations are counted
# Compiled (inside the iteration's CUDA graph), the form that inductor fuses: both sources, the request's own tokens
# and the corpus ring (rotated to start at its oldest slot), as one batch of 2 x bs rows padded with separators to the
# longer one, and each step's counts as a reduction rather than a batched matmul. Compiled by inductor on the CPU: 7
# launches against 41 (probe/suffix-launches). The same drafts (tests/test_suffix_v2.py); off until timed on a GPU.
# Eagerly the two sources and the matmul stay: on the CPU this form costs 3.7x / 8.5x at batch 8 / 64 (its padded rows
# and [rows, Lm, m, m] reduction are work that a GPU spreads; bench/step_host_cost.py, "fused form us").
FUSED_GRAPH = False


def chain_limits(num_steps: int, max_depth: int, factor: float, offset: float) -> list[int]:
    """The most tokens a chain from a match of length ``L`` (index ``L - 1``, ``L < max_depth``) may draft."""
    return [min(num_steps, int(factor * n + offset), max_depth - n) for n in range(1, max_depth)]


def _source_chains(text: torch.Tensor, age: torch.Tensor, query: torch.Tensor, limits: torch.Tensor, num_steps: int,
                   min_prob: float, max_occurrences: int,
                   reduce_counts: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chains of one source for every match length. text / age ``[1 or bs, n]`` (a ring: text holds at least one
    SEP, so no match runs around it; age orders occurrences, oldest smallest), query ``[bs, Lm]`` the request's
    tokens from its last back (SEP past its first), limits ``[Lm]`` -> (tokens ``[bs, Lm, num_steps]``, their
    validity, the chains' scores ``[bs, Lm]`` float64), index ``L - 1`` for match length ``L``."""
    bs, lm = query.shape
    n = text.shape[1]
    dev = text.device
    query = torch.where(query == SEP, torch.full_like(query, SEP - 1), query)  # (matches nothing in text)
    run = torch.ones(bs, n, dtype=torch.bool, device=dev)
    match = torch.zeros(bs, n, dtype=torch.int32, device=dev)  # [bs, n] matched suffix length ending at j
    ring = torch.cat([text[:, n - lm:], text], dim=1) if lm <= n else text.repeat(1, lm // n + 2)[:, -(n + lm):]
    for i in range(lm):  # text[j - i] (ring[lm + j - i]) against the request's token i from the end
        run &= ring[:, lm - i: lm - i + n] == query[:, i:i + 1]
        match += run
    match = match.to(torch.int64)
    following = torch.roll(text, -1, dims=1)  # [1 or bs, n] the token after j
    candidate = (match >= 1) & (following != SEP)
    score = torch.where(candidate, match * n + age, torch.full_like(match, -1))
    m = min(max_occurrences, n)
    top = torch.topk(score, m, dim=1)  # [bs, m] the longest matches, the most recent among equals
    picked = top.values >= 0
    order = torch.sort(torch.where(picked, torch.gather(age.expand(bs, n), 1, top.indices),
                                   torch.full_like(top.indices, n)), dim=1).indices  # oldest first
    at = torch.gather(top.indices, 1, order)  # [bs, m] occurrence ends
    picked = torch.gather(picked, 1, order)
    length = torch.gather(match, 1, at)  # [bs, m]
    steps = torch.arange(1, num_steps + 1, device=dev)
    cont = torch.gather(text.expand(bs, n), 1, ((at[:, :, None] + steps) % n).reshape(bs, -1)).view(bs, m, num_steps)
    known = torch.cumprod((cont != SEP).to(torch.int64), dim=2).bool()  # nothing after a separator belongs
    cont = torch.where(known, cont, torch.full_like(cont, SEP))  # [bs, m, num_steps]
    lengths = torch.arange(1, lm + 1, device=dev)
    alive = picked[:, None, :] & (length[:, None, :] >= lengths[None, :, None])  # [bs, Lm, m] agreeing occurrences
    active = torch.ones(bs, lm, dtype=torch.bool, device=dev)
    prob = torch.ones(bs, lm, dtype=torch.float64, device=dev)
    total_score = torch.zeros(bs, lm, dtype=torch.float64, device=dev)
    tokens, valid = [], []
    for k in range(num_steps):
        c = cont[:, :, k]  # [bs, m] each occurrence's next token
        has = alive & (c != SEP)[:, None, :]  # [bs, Lm, m]
        same = c[:, :, None] == c[:, None, :]  # [bs, m, m]
        if reduce_counts:  # (FUSED_GRAPH) a reduction, which fuses with the step's other work when compiled
            counts = (has[:, :, None, :] & same[:, None, :, :]).sum(dim=3).to(torch.float32)
        else:
            counts = torch.bmm(has.to(torch.float32), same.to(torch.float32))
        # counts [bs, Lm, m]: occurrences sharing occurrence i's token
        counts = torch.where(has, counts, torch.full_like(counts, -1.0))
        best = counts.argmax(dim=2, keepdim=True)  # [bs, Lm, 1] the first (oldest) of the most frequent
        count = torch.gather(counts, 2, best)[:, :, 0].to(torch.float64)
        total = has.sum(dim=2).to(torch.float64)  # [bs, Lm]
        token = torch.gather(c, 1, best[:, :, 0])  # [bs, Lm]
        p = prob * count / total.clamp(min=1.0)  # (v1's order of operations: prob * count / total)
        ok = active & (total > 0) & (k < limits)[None, :] & (p >= min_prob)
        prob = torch.where(ok, p, prob)
        total_score = total_score + torch.where(ok, p, torch.zeros_like(p))
        tokens.append(token)
        valid.append(ok)
        active = ok
        alive = has & (c[:, None, :] == token[:, :, None])
    return torch.stack(tokens, dim=2), torch.stack(valid, dim=2), total_score


def suffix_chain_device(history: torch.Tensor, lens: torch.Tensor, corpus: Optional[torch.Tensor],
                        corpus_start: Optional[torch.Tensor], limits: torch.Tensor, num_steps: int, min_prob: float,
                        max_occurrences: int = MAX_OCCURRENCES,
                        fused_graph: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """history ``[bs, width]`` each request's tokens, ``lens`` ``[bs]`` how many are known (the last the root);
    corpus ``[c]`` finished requests' tokens (SEP-separated ring, or None), ``corpus_start`` ``[1]`` its oldest
    slot; limits ``[suffix_max_depth - 1]`` (:func:`chain_limits`) -> (drafts ``[bs, num_steps]`` int64, valid
    ``[bs, num_steps]`` bool, a prefix of each row). ``fused_graph``: :data:`FUSED_GRAPH`'s form (the same drafts;
    None: :data:`FUSED_GRAPH` where compiling)."""
    bs, width = history.shape
    dev = history.device
    lm = limits.shape[0]
    cols = torch.arange(width + 1, device=dev)
    own = torch.cat([history, torch.full_like(history[:, :1], SEP)], dim=1)  # [bs, width + 1]: a SEP at the end
    own = torch.where(cols[None, :] < lens[:, None], own, torch.full_like(own, SEP))
    back = lens[:, None] - 1 - torch.arange(lm, device=dev)[None, :]  # [bs, Lm] positions of the last tokens
    query = torch.where(back >= 0, torch.gather(own, 1, back.clamp(min=0)), torch.full_like(back, SEP))
    if fused_graph is None:
        fused_graph = FUSED_GRAPH and torch.compiler.is_compiling()
    if corpus is not None and fused_graph:
        c = corpus.shape[0]
        n = max(width + 1, c)
        ring = corpus[(torch.arange(c, device=dev) + corpus_start) % c]  # [c] oldest slot first (ages 0 .. c - 1)
        text = torch.cat([F.pad(own, (0, n - width - 1), value=SEP),
                          F.pad(ring, (0, n - c), value=SEP)[None, :].expand(bs, n)])  # [2 * bs, n]
        t, v, s = _source_chains(text, torch.arange(n, device=dev)[None, :], torch.cat([query, query]), limits,
                                 num_steps, min_prob, max_occurrences, reduce_counts=True)
        tokens, valid, score = (torch.cat([a[:bs].flip(1), a[bs:].flip(1)], dim=1) for a in (t, v, s))
        return _best_chain(tokens, valid, score)
    tokens, valid, score = _source_chains(own, cols[None, :], query, limits, num_steps, min_prob, max_occurrences,
                                          fused_graph)
    if corpus is not None:
        c = corpus.shape[0]
        age = (torch.arange(c, device=dev) - corpus_start) % c  # [c] slots in insertion order
        t2, v2, s2 = _source_chains(corpus[None, :], age[None, :], query, limits, num_steps, min_prob,
                                    max_occurrences)
        tokens, valid, score = (torch.cat([a.flip(1), b.flip(1)], dim=1) for a, b in
                                ((tokens, t2), (valid, v2), (score, s2)))
    else:
        tokens, valid, score = tokens.flip(1), valid.flip(1), score.flip(1)  # longest match first
    return _best_chain(tokens, valid, score)


def _best_chain(tokens: torch.Tensor, valid: torch.Tensor, score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chains ``[bs, chains, num_steps]`` (own tokens first, longer matches first), their validity and scores
    ``[bs, chains]`` -> the best chain's drafts and validity ``[bs, num_steps]``."""
    bs, dev = tokens.shape[0], tokens.device
    best = score.argmax(dim=1)  # [bs] the first of the best: own before corpus, longer before shorter
    rows = torch.arange(bs, device=dev)
    drafts = tokens[rows, best]  # [bs, num_steps]
    ok = valid[rows, best] & (score[rows, best] > 0)[:, None]
    # the verify forward embeds every node and sampling gathers at each draft: no SEP there, even where invalid
    return torch.where(ok, drafts, torch.zeros_like(drafts)).to(torch.int64), ok


def suffix_chain_reference(tokens: list[int], corpus: list[list[int]], num_steps: int, max_depth: int,
                           limits: list[int], min_prob: float, max_occurrences: int = MAX_OCCURRENCES) -> list[int]:
    """:func:`suffix_chain_device` for one request, over lists: ``tokens`` its known tokens, ``corpus`` the finished
    requests' sequences, oldest first. Returns the draft (may be empty)."""
    best: tuple[list[int], float] = ([], 0.0)
    for source in ([tokens], corpus):
        occurrences = []  # (match length, age, sequence, end)
        age = 0
        for seq in source:
            for j in range(len(seq)):
                length = 0
                while (length < min(max_depth - 1, len(tokens)) and j - length >= 0
                       and seq[j - length] == tokens[len(tokens) - 1 - length]):
                    length += 1
                if length >= 1 and j + 1 < len(seq):
                    occurrences.append((length, age + j, seq, j))
            age += len(seq) + 1
        occurrences = sorted(occurrences, key=lambda o: (-o[0], -o[1]))[:max_occurrences]
        occurrences.sort(key=lambda o: o[1])
        for length in range(max_depth - 1, 0, -1):
            alive = [o for o in occurrences if o[0] >= length]
            chain, prob, score = [], 1.0, 0.0
            for k in range(1, limits[length - 1] + 1):
                nxt = [(o, o[2][o[3] + k]) for o in alive if o[3] + k < len(o[2])]
                if not nxt:
                    break
                counts = Counter(t for _, t in nxt)
                token = max(counts, key=lambda t: (counts[t], -min(o[1] for o, u in nxt if u == t)))
                p = prob * counts[token] / len(nxt)
                if p < min_prob:
                    break
                chain.append(token)
                prob, score = p, score + p
                alive = [o for o, t in nxt if t == token]
            if score > best[1]:
                best = (chain, score)
    return best[0]
