"""Tree utilities: chains, ancestor masks, children tables, and the top-k tree build of model drafters."""

from __future__ import annotations

import torch

from framework.speculative.base import DraftTree


def chain_tree(tokens: torch.Tensor, valid: torch.Tensor, draft_probs: torch.Tensor | None = None) -> DraftTree:
    """tokens / valid ``[bs, n]`` (root first) as a chain."""
    bs, n = tokens.shape
    idx = torch.arange(n, device=tokens.device)
    return DraftTree(tokens=tokens, parents=(idx - 1).expand(bs, n).contiguous(), depths=idx.expand(bs, n).contiguous(),
                     valid=valid, draft_probs=draft_probs)


def host_tree(rows: list[list[tuple[int, int, int]]], n: int, roots: torch.Tensor) -> DraftTree:
    """Trees drafted on the host: ``rows[b]`` request b's nodes (token, parent index, depth) after the root,
    parents first, at most ``n - 1``; padded to ``n`` nodes with invalid ones; ``roots`` ``[bs]`` on the device."""
    tokens = [[0] * n for _ in rows]
    parents = [[-1] + [0] * (n - 1) for _ in rows]
    depths = [[0] + [1] * (n - 1) for _ in rows]
    valid = [[True] + [False] * (n - 1) for _ in rows]
    for b, nodes in enumerate(rows):
        for i, (token, parent, depth) in enumerate(nodes, start=1):
            tokens[b][i], parents[b][i], depths[b][i], valid[b][i] = token, parent, depth, True
    packed = torch.tensor([tokens, parents, depths, valid], dtype=torch.int64).to(roots.device)
    tokens_t = packed[0].clone()
    tokens_t[:, 0] = roots
    return DraftTree(tokens=tokens_t, parents=packed[1], depths=packed[2], valid=packed[3].bool())


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """``[bs, n, n]`` bool: node i may attend node j iff j is i or one of its ancestors (parents[:, i] < i).

    The reflexive-transitive closure of the parent relation by repeated squaring: log2(n) small matmuls."""
    bs, n = parents.shape
    eye = torch.eye(n, device=parents.device).expand(bs, n, n)
    reach = eye + torch.zeros(bs, n, n, device=parents.device).scatter_(
        2, parents.clamp(min=0)[:, :, None], (parents >= 0)[:, :, None].float())  # self + parent
    for _ in range(max(1, (n - 1).bit_length())):  # paths of length 2^k after k squarings
        reach = (reach @ reach).clamp(max=1.0)
    return reach > 0


def children_table(parents: torch.Tensor, valid: torch.Tensor, max_children: int) -> torch.Tensor:
    """``[bs, n, max_children]`` int64: the valid children of every node in index order, -1 padded."""
    bs, n = parents.shape
    i = torch.arange(n, device=parents.device)
    same = (parents[:, :, None] == parents[:, None, :]) & valid[:, None, :] & (i[None, None, :] < i[None, :, None])
    rank = same.sum(-1)  # [bs, n]: earlier valid siblings
    keep = valid & (parents >= 0) & (rank < max_children)
    table = torch.full((bs, n * max_children + 1), -1, dtype=torch.int64, device=parents.device)
    flat = torch.where(keep, parents.clamp(min=0) * max_children + rank, n * max_children)  # dump slot at the end
    table.scatter_(1, flat, i.expand(bs, n).clone())
    return table[:, :-1].view(bs, n, max_children)


def select_tree(roots: torch.Tensor, cand_tokens: torch.Tensor, cand_parents: torch.Tensor,
                cand_scores: torch.Tensor, cand_depths: torch.Tensor, num_nodes: int) -> DraftTree:
    """Keep the best ``num_nodes - 1`` candidates by cumulative score and build the tree (root + them).

    cand_*: ``[bs, C]``, candidates in creation order; ``cand_parents`` indexes candidates (-1 = the root).
    A child's score never exceeds its parent's (log-probabilities add up), and ties keep creation order, so the
    kept set is closed under parents; sorting kept indices ascending puts parents before children.
    """
    bs, c = cand_tokens.shape
    k = num_nodes - 1
    # stable top-k: on equal scores the earlier (parent-side) candidate wins
    order = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices[:, :k]
    kept = torch.sort(order, dim=1).values  # [bs, k] candidate ids in creation order
    position = torch.full((bs, c), -1, dtype=torch.int64, device=roots.device)
    position.scatter_(1, kept, torch.arange(1, k + 1, device=roots.device).expand(bs, k).contiguous())
    cand_parent = torch.gather(cand_parents, 1, kept)  # [bs, k] candidate id or -1
    node_parent = torch.where(cand_parent >= 0, torch.gather(position, 1, cand_parent.clamp(min=0)),
                              torch.zeros_like(cand_parent))
    tokens = torch.cat([roots[:, None], torch.gather(cand_tokens, 1, kept)], dim=1)
    parents = torch.cat([torch.full((bs, 1), -1, dtype=torch.int64, device=roots.device), node_parent], dim=1)
    depths = torch.cat([torch.zeros(bs, 1, dtype=torch.int64, device=roots.device),
                        torch.gather(cand_depths, 1, kept)], dim=1)
    valid = torch.ones_like(tokens, dtype=torch.bool)
    return DraftTree(tokens=tokens, parents=parents, depths=depths, valid=valid)
