"""Verification of a draft tree against the target's logits, on the device, without host synchronisation.

Greedy: follow the child whose token equals the target's argmax; the bonus is the argmax at the last accepted
node (tensor operations over the whole tree, no loop over depth). Stochastic (multi-candidate rejection sampling): at each accepted node try its children in turn; child x is
accepted with probability min(1, p(x) / q(x)); after a rejection the target distribution becomes the normalised
residual max(0, p - q). When no child is accepted (or a leaf is reached) the bonus token is drawn from the
current residual. Drafters that choose children deterministically use q = one-hot(x), which makes trying
siblings in turn lossless (a rejected sibling is removed from p). The emitted tokens have exactly the target's
distribution; temperature / top-k / top-p apply to p and q alike. (Each residual depends on the siblings rejected
before, so stochastic tree verification loops over depth and children, unrolled into the graph; chains are
vectorized in :mod:`framework.speculative.chain_verify`.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from framework.batch import SamplingBatch
from framework.sampling import probs_from_logits, sample_from_probs, uniform_noise
from framework.speculative.base import DraftTree
from framework.speculative.tree import children_table, tree_mask
from tfs_kernels.fill_bonus_tokens import fill_bonus_tokens

SALT_ACCEPT = 101  # uniform draws for the acceptance tests, one per node
SALT_RESIDUAL = 211  # + depth: the bonus / residual draw at each depth below the root


def residual_salt(depth: int) -> int:
    """The root's draw uses the plain sampler's salt (0): a request with no draft then gets the token a plain
    decode step would give it, so a seeded request's output does not depend on whether its batch-mates drafted.
    The draws stay independent: acceptance (SALT_ACCEPT), drafts (model_drafter.SALT_DRAFT) and deeper residuals
    use other salts, and a plain step at the same step index never runs in the same trajectory."""
    return 0 if depth == 0 else SALT_RESIDUAL + depth


@dataclass
class VerifyResult:
    accept_index: torch.Tensor  # [bs, num_steps + 1] accepted path nodes, root first, -1 padded
    accept_lens: torch.Tensor  # [bs] int64: tokens emitted (accepted drafts + the bonus token)
    accept_tokens: torch.Tensor  # [bs * (num_steps + 1)] int64: the token emitted after each path node
    bonus: torch.Tensor  # [bs] int64: the last emitted token (the next root)


def _finish(predict: torch.Tensor, accept_index: torch.Tensor, accept_lens: torch.Tensor) -> VerifyResult:
    """Gather the emitted tokens along each path and fill the bonus tokens.

    NOTE: the stride of the flat accept_tokens is ``accept_index.shape[1]`` (num_steps + 1), not
    num_draft_tokens; the two differ for trees."""
    stride = accept_index.shape[1]
    accept_tokens = torch.gather(predict, 1, accept_index.clamp(min=0)).reshape(-1)  # [bs * stride]
    bonus = fill_bonus_tokens(accept_tokens, accept_lens, stride)
    return VerifyResult(accept_index, accept_lens, accept_tokens, bonus)


def target_probs(logits: torch.Tensor, sampling: SamplingBatch, n: int) -> torch.Tensor:
    """``[bs, n, vocab]`` target distributions over the tree; greedy rows are one-hot on the argmax."""
    bs = logits.shape[0] // n
    rep = lambda t: t.repeat_interleave(n)  # noqa: E731  per request -> per node
    probs = probs_from_logits(logits, rep(sampling.temperatures), rep(sampling.top_ks), rep(sampling.top_ps),
                              sampling.need_top_k_top_p)
    onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    greedy = (rep(sampling.temperatures) == 0)[:, None]
    return torch.where(greedy, onehot, probs).view(bs, n, -1)


def residual_after_rejection(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, p - q)) per row ``[bs, vocab]``; rows where that is all zero keep p."""
    leftover = (p - q).clamp(min=0)
    mass = leftover.sum(-1, keepdim=True)
    return torch.where(mass > 0, leftover / mass.clamp(min=1e-30), p)


def verify(tree: DraftTree, logits: torch.Tensor, sampling: SamplingBatch, num_steps: int,
           max_children: int) -> VerifyResult:
    """logits ``[bs * n, vocab]`` (float32) of the target over the tree nodes."""
    if sampling.all_greedy:
        return verify_greedy(tree, logits, num_steps, max_children)
    return verify_stochastic(tree, target_probs(logits, sampling, tree.num_nodes), sampling, num_steps,
                             max_children)


def verify_greedy(tree: DraftTree, logits: torch.Tensor, num_steps: int, max_children: int) -> VerifyResult:
    """Tensor operations over the whole tree, no loop over depth: a node is accepted when it and each of its
    ancestors is the first of its parent's (first ``max_children`` valid) children whose token is the target's
    argmax at the parent, which is the path a walk from the root down the matching children takes."""
    bs, n = tree.tokens.shape
    dev = tree.tokens.device
    predict = logits.argmax(-1).view(bs, n)  # [bs, n] the target's token after each node
    idx = torch.arange(n, device=dev)
    parents = tree.parents
    earlier = (parents[:, :, None] == parents[:, None, :]) & tree.valid[:, None, :] & (idx[None, None, :] <
                                                                                        idx[None, :, None])
    rank = earlier.sum(-1)  # [bs, n] earlier valid siblings
    child = tree.valid & (parents >= 0) & (rank < max_children) & (tree.depths <= num_steps)
    match = child & (tree.tokens == torch.gather(predict, 1, parents.clamp(min=0)))
    first = match & ~(earlier & match[:, None, :]).any(-1)  # [bs, n] the first matching child of its parent
    first[:, 0] = True  # the root
    accepted = (~tree_mask(tree) | first[:, None, :]).all(-1)  # [bs, n]: the accepted path, a chain
    accept_lens = torch.where(accepted, tree.depths, -1).max(-1).values + 1
    slot = torch.where(accepted, tree.depths, num_steps + 1)  # each path node's depth; the rest to a dump column
    accept_index = torch.full((bs, num_steps + 2), -1, dtype=torch.int64, device=dev)
    accept_index.scatter_(1, slot, idx.expand(bs, n).contiguous())
    return _finish(predict, accept_index[:, :-1], accept_lens)


def verify_stochastic(tree: DraftTree, p_nodes: torch.Tensor, sampling: SamplingBatch, num_steps: int,
                      max_children: int) -> VerifyResult:
    """p_nodes ``[bs, n, vocab]``: the target distribution at every node (already temperature-processed)."""
    bs, n = tree.tokens.shape
    dev = tree.tokens.device
    rows = torch.arange(bs, device=dev)
    children = children_table(tree.parents, tree.valid, max_children)
    u = uniform_noise(sampling.seeds, sampling.steps, n, salt=SALT_ACCEPT)  # [bs, n] one draw per node
    greedy = sampling.temperatures == 0  # [bs] rows whose p is one-hot (target_probs)
    predict = torch.zeros(bs, n, dtype=torch.int64, device=dev)
    accept_index = torch.full((bs, num_steps + 1), -1, dtype=torch.int64, device=dev)
    accept_index[:, 0] = 0
    cur = torch.zeros(bs, dtype=torch.int64, device=dev)
    active = torch.ones(bs, dtype=torch.bool, device=dev)
    accept_lens = torch.ones(bs, dtype=torch.int64, device=dev)
    for depth in range(num_steps + 1):
        residual = p_nodes[rows, cur]  # [bs, vocab]
        q = tree.draft_probs[rows, cur] if tree.draft_probs is not None else None
        chosen = torch.full((bs,), -1, dtype=torch.int64, device=dev)
        if depth < num_steps:
            cands = children[rows, cur]
            for j in range(max_children):
                child = cands[:, j]
                trying = active & (child >= 0) & (chosen < 0)
                x = torch.gather(tree.tokens, 1, child.clamp(min=0)[:, None])  # [bs, 1]
                q_row = q if q is not None else torch.zeros_like(residual).scatter_(1, x, 1.0)
                ratio = torch.gather(residual, 1, x)[:, 0] / torch.gather(q_row, 1, x)[:, 0].clamp(min=1e-20)
                accept = trying & (torch.gather(u, 1, child.clamp(min=0)[:, None])[:, 0] < ratio)
                chosen = torch.where(accept, child, chosen)
                rejected = (trying & ~accept)[:, None]
                residual = torch.where(rejected, residual_after_rejection(residual, q_row), residual)
        moved = chosen >= 0
        bonus = sample_from_probs(residual, sampling.seeds, sampling.steps, salt=residual_salt(depth))
        bonus = torch.where(greedy, residual.argmax(-1), bonus)  # a greedy row's residual is one-hot: no noise
        emitted = torch.where(moved, torch.gather(tree.tokens, 1, chosen.clamp(min=0)[:, None])[:, 0], bonus)
        predict[rows, cur] = torch.where(active, emitted, predict[rows, cur])
        if depth < num_steps:
            accept_index[:, depth + 1] = torch.where(active & moved, chosen, -1)
            accept_lens += active & moved
            cur = torch.where(active & moved, chosen, cur)
            active = active & moved
    return _finish(predict, accept_index, accept_lens)
