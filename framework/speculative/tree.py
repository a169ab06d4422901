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
    parents first, at most ``n - 1``; padded to ``n`` nodes with invalid ones (children of the root); ``roots``
    ``[bs]`` on the device. Up to 64 nodes the ancestor mask comes with them, built on the host as one int64 of bits
    per node, in the same upload (no device work to derive it; wider trees: :func:`tree_mask`)."""
    wide = n > 64
    tokens = [[0] * n for _ in rows]
    parents = [[-1] + [0] * (n - 1) for _ in rows]
    depths = [[0] + [1] * (n - 1) for _ in rows]
    valid = [[True] + [False] * (n - 1) for _ in rows]
    bits = [[1] + [1 | 1 << i for i in range(1, n)] for _ in rows]  # [b][i]: bit j set iff j is i or an ancestor
    for b, nodes in enumerate(rows):
        row_bits = bits[b]
        for i, (token, parent, depth) in enumerate(nodes, start=1):
            tokens[b][i], parents[b][i], depths[b][i], valid[b][i] = token, parent, depth, True
            if not wide:
                row_bits[i] = row_bits[parent] | 1 << i
        bits[b] = [0] * n if wide else [v - (1 << 64) if v >> 63 else v for v in row_bits]  # (bit 63: the sign)
    packed = torch.tensor([tokens, parents, depths, valid, bits], dtype=torch.int64).to(roots.device)
    tokens_t = packed[0].clone()
    tokens_t[:, 0] = roots
    mask = None if wide else \
        ((packed[4][:, :, None] >> torch.arange(n, device=roots.device)) & 1).bool()  # (arithmetic shift: bit 63 too)
    return DraftTree(tokens=tokens_t, parents=packed[1], depths=packed[2], valid=packed[3].bool(), mask=mask)


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


def tree_mask(tree: DraftTree) -> torch.Tensor:
    """``tree``'s ancestor mask ``[bs, n, n]`` (:func:`ancestor_mask`), computed once per tree."""
    if tree.mask is None:
        tree.mask = ancestor_mask(tree.parents)
    return tree.mask


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
