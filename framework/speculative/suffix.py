"""``speculative=suffix``: train-free suffix decoding (SuffixDecoding, Oliaro et al. 2024; vLLM's ``suffix``).

Two suffix trees of bounded depth (``suffix_max_depth``) count how often every string of up to that many tokens
occurred: one per request over its prompt and output, and one global tree over the prompts and outputs of
finished requests (at most ``suffix_cache_tokens`` tokens; the oldest request is evicted first). To draft, each
suffix of the request's tokens that occurred before (with a continuation) grows a draft tree from its node best
first by the empirical probability of each path (a child's count over its siblings' total, multiplied along
the path), keeping nodes of probability at least ``min_token_prob``, at most ``topk`` children a node and
``num_steps`` deep. The draft size follows the match: at most ``max_spec_factor * match_length +
max_spec_offset`` tokens (and ``num_draft_tokens - 1``). A tree (``topk > 1``) grows from every matched suffix of
both trees at once: a token's probability is the mean of the matches' empirical ones, weighted by match length,
over the matches that have seen the path so far (longer contexts first, shorter ones where those end), and its size
follows the longest match; a batch verifies every request at its widest draft's size (rounded up to a power of two),
and a shorter tree grows into those rows with its next-best nodes. A chain grows from each match alone, and the one
with the largest expected number of accepted tokens (the sum of its path probabilities) wins. No model forward.

Chains (``topk=1``) also run in speculation v2 (``speculative.version=v2``): the same chain computed on the device
(:func:`suffix_chain_device`) from each request's token history and a ring of finished requests' tokens
(:class:`SuffixCorpus`, ``suffix_cache_tokens`` slots), which the v2 worker feeds as it applies their last iteration.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Optional

import torch

from framework.config import SpeculativeConfig
from framework.request import Request
from framework.speculative import DRAFTERS
from framework.speculative.base import DraftTree, Drafter, SpecContext
from framework.speculative.suffix_corpus import SuffixCorpus
from framework.speculative.suffix_device import chain_limits, suffix_chain_device
from framework.speculative.tree import host_tree


class Node:
    """A string's occurrence count and the nodes of its one-token extensions."""

    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: Optional[dict[int, "Node"]] = None

    def child(self, token: int) -> "Node":
        if self.children is None:
            self.children = {}
        node = self.children.get(token)
        if node is None:
            node = self.children[token] = Node()
        return node


class SuffixTree:
    """Every substring of the sequences added, up to ``max_depth`` tokens, with its number of occurrences."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = Node()

    def add(self, tokens: list[int], active: Optional[list[Node]] = None, sign: int = 1) -> list[Node]:
        """Count ``tokens`` as the continuation of a sequence whose suffix nodes are ``active`` (shortest first;
        None: a new sequence); ``sign=-1`` removes a sequence added before. Returns the new suffix nodes."""
        active = [] if active is None else active
        if sign < 0:
            for token in tokens:
                grown = []
                for depth, node in enumerate([self.root] + active):  # the suffixes of lengths 0 .. len(active)
                    nxt = node.children[token]
                    nxt.count -= 1
                    if nxt.count == 0:  # no occurrence left: nor of its extensions, which go with it
                        del node.children[token]
                    elif depth + 1 < self.max_depth:
                        grown.append(nxt)
                active = grown
            return active
        keep = self.max_depth - 1  # suffix nodes kept: lengths 1 .. max_depth - 1
        for token in tokens:  # (Node.child inlined: this loop is most of a suffix drafter's host time)
            grown = []
            for node in [self.root] + active:  # the suffixes of lengths 0 .. len(active)
                children = node.children
                if children is None:
                    children = node.children = {}
                nxt = children.get(token)
                if nxt is None:
                    nxt = children[token] = Node()
                nxt.count += 1
                grown.append(nxt)
            active = grown[:keep]
        return active

    def matches(self, context: list[int]) -> list[tuple[Node, int]]:
        """(node, length) of every suffix of ``context`` that occurred with a continuation, longest first."""
        found = []
        for length in range(min(self.max_depth - 1, len(context)), 0, -1):
            node = self.root
            for token in context[len(context) - length:]:
                node = node.children.get(token) if node.children else None
                if node is None:
                    break
            if node is not None and node.children:
                found.append((node, length))
        return found

    def num_nodes(self) -> int:
        """Nodes below the root (a walk: for tests and memory checks)."""
        stack, count = [self.root], 0
        while stack:
            node = stack.pop()
            children = list(node.children.values()) if node.children else []
            count += len(children)
            stack += children
        return count


def grow_draft(states: list[tuple[Node, float]], budget: int, max_depth: int, max_children: int,
               min_prob: float) -> tuple[list[tuple[int, int, int]], list[float]]:
    """Best-first draft below the matched nodes ``states`` ((node, weight) pairs): up to ``budget`` (token, parent
    index, depth) nodes, parents first (index 0 is the root), and their path probabilities, which never rise along
    the list (their sum: the expected number of accepted tokens). So the nodes at least ``min_prob`` likely are a
    prefix of those drafted with ``min_prob`` 0, in the same order. A token's probability after a path is the weighted mean, over the states that
    continue the path, of its count over its siblings' total: one state drafts from one match's counts; several (every
    matched suffix of both trees, weighted by its length) back off from the longer matches to the shorter ones where
    those have seen what follows."""
    heap: list[tuple[float, int, int, int, int, list]] = []  # (-prob, tie, token, parent index, depth, states)
    tie = 0

    def push(sts: list[tuple[Node, float]], parent_index: int, depth: int, prob: float) -> None:
        nonlocal tie
        if depth > max_depth:
            return
        live = [(node, w) for node, w in sts if node.children]
        if not live:
            return
        # (sorts are stable: among equal counts a tree's first-inserted child first, as suffix_chain_device's
        # earliest occurrence)
        if len(live) == 1:  # one match's counts, in suffix_chain_device's order of operations: prob * count / total
            children = live[0][0].children
            total = sum(c.count for c in children.values())
            ranked = [(token, prob * child.count / total)
                      for token, child in sorted(children.items(), key=lambda kv: -kv[1].count)[:max_children]]
        else:
            mix: dict[int, float] = {}
            for node, w in live:
                total = sum(c.count for c in node.children.values())
                for token, child in node.children.items():
                    mix[token] = mix.get(token, 0.0) + w * child.count / total
            weight = sum(w for _, w in live)
            ranked = [(token, prob * q / weight)
                      for token, q in sorted(mix.items(), key=lambda kv: -kv[1])[:max_children]]
        for token, p in ranked:
            if p >= min_prob:
                nxt = [(node.children[token], w) for node, w in live if token in node.children]
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


class SuffixState:
    """A request's suffix tree and how many of its tokens it holds."""

    def __init__(self, max_depth: int) -> None:
        self.tree = SuffixTree(max_depth)
        self.active: list[Node] = []
        self.num_tokens = 0

    def sync(self, req: Request) -> list[int]:
        """Add the request's tokens appended since the last call; returns its last ``max_depth`` tokens."""
        total = len(req.prompt_ids) + len(req.output_ids)
        if total > self.num_tokens:
            self.active = self.tree.add(req.token_slice(self.num_tokens, total), self.active)
            self.num_tokens = total
        return req.token_slice(max(0, total - self.tree.max_depth), total)


@DRAFTERS.register("suffix")
class SuffixDrafter(Drafter):
    name = "suffix"
    drafts_on_device = drafts_in_v2 = True  # chains: suffix_chain_device (speculation v2)
    v2_by_default = False  # (not yet run on a GPU: speculative.version=auto keeps v1)

    def __init__(self, engine, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(engine.device)
        self.corpus: Optional[SuffixCorpus] = None  # v2: finished requests' tokens on the device
        self.max_children = cfg.topk
        self.global_tree = SuffixTree(cfg.suffix_max_depth)
        self._cached: deque[list[int]] = deque()  # sequences in the global tree, oldest first
        self._cached_tokens = 0
        self._live: list[Request] = []  # requests with a state, until they finish and join the global tree

    # ---- the global tree ------------------------------------------------------------------------------
    def remember(self, tokens: list[int]) -> None:
        """Add a finished request's tokens to the global tree, evicting the oldest sequences past the budget."""
        tokens = tokens[-self.cfg.suffix_cache_tokens:] if self.cfg.suffix_cache_tokens > 0 else []
        if not tokens:
            return
        self.global_tree.add(tokens)
        self._cached.append(tokens)
        self._cached_tokens += len(tokens)
        while self._cached_tokens > self.cfg.suffix_cache_tokens:
            old = self._cached.popleft()
            self.global_tree.add(old, sign=-1)
            self._cached_tokens -= len(old)

    def _retire_finished(self) -> None:
        live = []
        for req in self._live:
            if req.finished:
                if req.finish_reason != "error":
                    self.remember(req.prompt_ids + req.output_ids)
                req.drafter_state = None
            else:
                live.append(req)
        self._live = live

    # ---- speculation v2 -------------------------------------------------------------------------------
    def use_v2(self) -> None:
        super().use_v2()
        cfg = self.cfg
        limits = chain_limits(cfg.num_steps, cfg.suffix_max_depth, cfg.max_spec_factor, cfg.max_spec_offset)
        self._limits = torch.tensor(limits, dtype=torch.int64, device=self.device)  # [suffix_max_depth - 1]
        if self.device.type == "cuda":
            torch._dynamo.mark_static_address(self._limits)
        if cfg.suffix_cache_tokens >= 2:
            self.corpus = SuffixCorpus(cfg.suffix_cache_tokens, self.device)

    def propose_device(self, history: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chain drafts ``[bs, num_steps]`` and their validity from the token histories and the corpus (v2; inside a
        CUDA graph over the whole ring, eagerly over its filled slots only)."""
        corpus = self.corpus
        ring = None if corpus is None else \
            (corpus.tokens, corpus.start) if torch.compiler.is_compiling() else corpus.window()
        return suffix_chain_device(history, lens, ring[0] if ring else None, ring[1] if ring else None,
                                   self._limits, self.cfg.num_steps, self.cfg.min_token_prob)

    def on_finished(self, reqs: list[Request]) -> None:
        """v2: requests whose last iteration was applied join the corpus (as :meth:`_retire_finished`, v1)."""
        if self.corpus is not None:
            self.corpus.add([r.prompt_ids + r.output_ids for r in reqs if r.finish_reason != "error"])

    # ---- drafting -------------------------------------------------------------------------------------
    def _state(self, req: Request) -> SuffixState:
        if not isinstance(req.drafter_state, SuffixState):
            req.drafter_state = SuffixState(self.cfg.suffix_max_depth)
            self._live.append(req)
        return req.drafter_state

    @classmethod
    def verify_widths(cls, cfg: SpeculativeConfig) -> list[int]:
        """Powers of two below num_draft_tokens, and it: :meth:`propose` rounds the batch's widest draft up."""
        return sorted({min(cfg.num_draft_tokens, 1 << b) for b in range(1, cfg.num_draft_tokens.bit_length() + 1)})

    def draft(self, req: Request, max_depth: Optional[int] = None, fill: int = 0) -> list[tuple[int, int, int]]:
        """The request's draft nodes (token, parent index, depth), parents first; may be empty. ``max_depth``:
        at most this deep (and ``topk`` times as many nodes), below ``num_steps``. ``fill`` (trees): grow to this
        many nodes where the matches have them, past the match-length budget and ``min_token_prob`` (rows that the
        batch verifies anyway); the nodes drafted without it come first, in the same order."""
        own, grown = self._drafts(req, max_depth)
        return grown[:fill] if fill > len(own) else own

    def _drafts(self, req: Request, max_depth: Optional[int]) -> tuple[list, list]:
        """(the request's draft, and for trees its growth to ``num_draft_tokens - 1`` nodes past the match-length
        budget and ``min_token_prob``, of which the draft is a prefix: one growth serves both)."""
        cfg = self.cfg
        depth = min(cfg.num_steps, max_depth or cfg.num_steps)
        most = cfg.num_draft_tokens - 1 if depth >= cfg.num_steps else min(cfg.num_draft_tokens - 1, depth * cfg.topk)
        tail = self._state(req).sync(req)
        matches = [(node, length) for tree in (req.drafter_state.tree, self.global_tree)
                   for node, length in tree.matches(tail)]
        if cfg.topk > 1:  # a tree from every match at once, the longer ones weighing more
            if not matches:
                return [], []
            states = [(node, float(length)) for node, length in matches]
            budget = min(most, int(cfg.max_spec_factor * max(n for _, n in matches) + cfg.max_spec_offset))
            grown, probs = grow_draft(states, cfg.num_draft_tokens - 1, depth, cfg.topk, 0.0)
            likely = sum(p >= cfg.min_token_prob for p in probs)  # (a prefix: probabilities never rise)
            return grown[: max(0, min(budget, likely))], grown
        # a chain: the match whose draft has the largest expected number of accepted tokens (as suffix_chain_device
        # drafts it in speculation v2). NOTE: every match length competes: a long match leaves the depth-bounded
        # tree little room to continue
        best: tuple[list, float] = ([], 0.0)
        for node, length in matches:
            budget = min(most, int(cfg.max_spec_factor * length + cfg.max_spec_offset))
            if budget < 1 or budget <= best[1]:  # (a draft's score never exceeds its size)
                continue
            nodes, probs = grow_draft([(node, 1.0)], budget, depth, cfg.topk, cfg.min_token_prob)
            if sum(probs) > best[1]:
                best = (nodes, sum(probs))
        return best[0], best[0]

    def batch_drafts(self, reqs: list[Request], max_depth: Optional[int] = None) -> tuple[list[list], int]:
        """Each request's draft nodes and the batch's verify width ``n`` (the largest draft and the root, rounded up
        to a power of two to bound graph shapes); ``n`` 0: nothing drafted. Trees shorter than ``n - 1`` grow into
        the rows the batch verifies anyway (:meth:`draft`'s ``fill``)."""
        drafts = [self._drafts(req, max_depth) for req in reqs]
        rows = [own for own, _ in drafts]
        if not any(rows):
            return rows, 0
        n = min(self.cfg.num_draft_tokens, 1 << max(len(r) for r in rows).bit_length())
        if self.cfg.topk > 1:
            rows = [grown[: n - 1] if len(own) < n - 1 else own for own, grown in drafts]
        return rows, n

    def propose(self, ctx: SpecContext) -> DraftTree | None:
        self._retire_finished()
        rows, n = self.batch_drafts(ctx.reqs, ctx.max_depth)
        if not n:
            return None  # nothing to verify: the worker runs a plain decode step
        return host_tree(rows, n, ctx.roots)
