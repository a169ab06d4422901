"""The suffix drafter's counting trees (:class:`SuffixTree`) and its best-first draft growth (:func:`grow_draft`).

A tree's nodes are integer ids into flat lists, not objects: a node is a ``{token: child id}`` dict (or None) and a
count. Dicts of ints are not tracked by CPython's cyclic garbage collector, so a tree of many nodes adds nothing to
the collector's work; nodes as objects (one GC-tracked object and dict each) made the collections it triggered cost
about 7x the counting itself.
"""

from __future__ import annotations

import heapq
from typing import Optional

ROOT = 0  # the root's node id: the empty string


class SuffixTree:
    """Every substring of the sequences added, up to ``max_depth`` tokens, with its number of occurrences.

    Node ``i`` (``ROOT`` the empty string) has ``counts[i]`` occurrences and one-token extensions ``kids[i]``
    ({token: node id}, in first-insertion order; None or empty: none). Removed nodes' ids are recycled, so the lists
    stay as long as the most nodes the tree held at once (plus the root)."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.kids: list[Optional[dict[int, int]]] = [None]  # [node id] -> {token: child id}
        self.counts: list[int] = [0]  # [node id] -> occurrences of the node's string (0: the root, free ids)
        self._free: list[int] = []  # ids of removed nodes, reused first

    def add(self, tokens: list[int], active: Optional[list[int]] = None, sign: int = 1) -> list[int]:
        """Count ``tokens`` as the continuation of a sequence whose suffix node ids are ``active`` (shortest first;
        None: a new sequence); ``sign=-1`` removes a sequence added before. Returns the new suffix node ids (of
        lengths 1 .. ``max_depth - 1``)."""
        active = [] if active is None else active
        if sign < 0:
            return self._remove(tokens, active)
        kids, counts, free = self.kids, self.counts, self._free
        keep = self.max_depth - 1  # suffix nodes kept: lengths 1 .. max_depth - 1
        for token in tokens:  # (this loop is most of a suffix drafter's host time)
            grown = []
            for node in [ROOT] + active:  # the suffixes of lengths 0 .. len(active)
                children = kids[node]
                if children is None:
                    children = kids[node] = {}
                nxt = children.get(token)
                if nxt is not None:
                    counts[nxt] += 1
                elif free:  # a removed node's id: its count 0, its kids None
                    nxt = children[token] = free.pop()
                    counts[nxt] = 1
                else:
                    nxt = children[token] = len(counts)
                    counts.append(1)
                    kids.append(None)
                grown.append(nxt)
            active = grown[:keep]
        return active

    def _remove(self, tokens: list[int], active: list[int]) -> list[int]:
        """``add``'s ``sign=-1``: uncount a sequence added before; a node counted 0 goes, and its subtree with it."""
        kids, counts = self.kids, self.counts
        for token in tokens:
            grown, gone = [], []
            for depth, node in enumerate([ROOT] + active):  # the suffixes of lengths 0 .. len(active)
                children = kids[node]
                nxt = children[token]
                counts[nxt] -= 1
                if counts[nxt] == 0:  # no occurrence left: nor of its extensions, which go with it
                    del children[token]
                    gone.append(nxt)
                elif depth + 1 < self.max_depth:
                    grown.append(nxt)
            # NOTE: freed after the loop, which may still walk a node of a subtree gone earlier in it (removing
            # "a a a", the third "a": "a" goes, then the loop walks "a a" below it). No node of ``grown`` lies in one
            # (an extension of a string gone here ends here too, so it is gone too)
            for node in gone:
                self._release(node)
            active = grown
        return active

    def _release(self, node: int) -> None:
        """Free ``node`` and its subtree's ids for reuse."""
        kids, counts, free = self.kids, self.counts, self._free
        stack = [node]
        while stack:
            node = stack.pop()
            if kids[node]:
                stack += kids[node].values()
            kids[node] = None
            counts[node] = 0
            free.append(node)

    def matches(self, context: list[int]) -> list[tuple[int, int]]:
        """(node id, length) of every suffix of ``context`` that occurred with a continuation, longest first."""
        kids, found = self.kids, []
        for length in range(min(self.max_depth - 1, len(context)), 0, -1):
            node: Optional[int] = ROOT
            for token in context[len(context) - length:]:
                children = kids[node]
                node = children.get(token) if children else None
                if node is None:
                    break
            if node is not None and kids[node]:
                found.append((node, length))
        return found

    def num_nodes(self) -> int:
        """Nodes below the root."""
        return len(self.counts) - 1 - len(self._free)


def grow_draft(states: list[tuple[SuffixTree, int, float]], budget: int, max_depth: int, max_children: int,
               min_prob: float) -> tuple[list[tuple[int, int, int]], list[float]]:
    """Best-first draft below the matched nodes ``states`` ((tree, node id, weight); the trees may differ): up to
    ``budget`` (token, parent index, depth) nodes, parents first (index 0 is the root), and their path
    probabilities, which never rise along the list (their sum: the expected number of accepted tokens). So the nodes
    at least ``min_prob`` likely are a prefix of those drafted with ``min_prob`` 0, in the same order. A token's
    probability after a path is the weighted mean, over the states that continue the path, of its count over its
    siblings' total: one state drafts from one match's counts; several (every matched suffix of both trees, weighted
    by its length) back off from the longer matches to the shorter ones where those have seen what follows."""
    heap: list[tuple[float, int, int, int, int, list]] = []  # (-prob, tie, token, parent index, depth, states)
    tie = 0

    def push(sts: list[tuple[SuffixTree, int, float]], parent_index: int, depth: int, prob: float) -> None:
        nonlocal tie
        if depth > max_depth:
            return
        live = []  # (tree, the node's {token: child id}, weight) of the states that go on
        for tree, node, w in sts:
            if tree.kids[node]:
                live.append((tree, tree.kids[node], w))
        if not live:
            return
        # (sorts are stable: among equal counts a tree's first-inserted child first, as suffix_chain_device's
        # earliest occurrence)
        if len(live) == 1:  # one match's counts, in suffix_chain_device's order of operations: prob * count / total
            tree, children, _ = live[0]
            counts = tree.counts
            total = sum(counts[c] for c in children.values())
            ranked = [(token, prob * counts[child] / total)
                      for token, child in sorted(children.items(), key=lambda kv: -counts[kv[1]])[:max_children]]
        else:
            mix: dict[int, float] = {}
            for tree, children, w in live:
                counts = tree.counts
                total = sum(counts[c] for c in children.values())
                for token, child in children.items():
                    mix[token] = mix.get(token, 0.0) + w * counts[child] / total
            weight = sum(w for _, _, w in live)
            ranked = [(token, prob * q / weight)
                      for token, q in sorted(mix.items(), key=lambda kv: -kv[1])[:max_children]]
        for token, p in ranked:
            if p >= min_prob:
                nxt = [(tree, children[token], w) for tree, children, w in live if token in children]
                heapq.heappush(heap, (-p, tie, token, parent_index, depth, nxt))
                tie += 1

    nodes: list[tuple[int, int, int]] = []
    probs: list[float] = []
    push(states, 0, 1, 1.0)
    while heap and len(nodes) < budget:
        neg, _, token, parent, depth, sts = heapq.heappop(heap)
        nodes.append((token, parent, depth))
        probs.append(-neg)
        push(sts, len(nodes), depth + 1, -neg)
    return nodes, probs
