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

Trees with ``speculative.adaptive=true``: the batch's verify width (a power of two up to ``num_draft_tokens``, or a
plain step) is the one with the most tokens per second by the trees' own path probabilities, calibrated by what
verification accepted (:mod:`suffix_width`), and each width's measured cost; every request's tree grows to it
(``max_spec_factor``, ``max_spec_offset`` and ``min_token_prob`` do not bound it).

Chains (``topk=1``) also run in speculation v2 (``speculative.version=v2``): the same chain computed on the device
(:func:`suffix_chain_device`) from each request's token history and a ring of finished requests' tokens
(:class:`SuffixCorpus`, ``suffix_cache_tokens`` slots), which the v2 worker feeds as it applies their last iteration.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch

from framework.config import SpeculativeConfig
from framework.request import Request
from framework.speculative import DRAFTERS
from framework.speculative.base import DraftTree, Drafter, SpecContext
from framework.speculative.suffix_corpus import SuffixCorpus
from framework.speculative.suffix_device import chain_limits, suffix_chain_device
from framework.speculative.suffix_tree import SuffixTree, grow_draft
from framework.speculative.suffix_width import WidthEstimate
from framework.speculative.tree import host_tree


class SuffixState:
    """A request's suffix tree and how many of its tokens it holds."""

    def __init__(self, max_depth: int) -> None:
        self.tree = SuffixTree(max_depth)
        self.active: list[int] = []  # the node ids of the sequence's suffixes of lengths 1 .. max_depth - 1
        self.num_tokens = 0

    def sync(self, req: Request) -> list[int]:
        """Add the request's tokens appended since the last call; returns its last ``max_depth`` tokens."""
        total = len(req.prompt_ids) + len(req.output_ids)
        if total > self.num_tokens:
            self.active = self.tree.add(req.token_slice(self.num_tokens, total), self.active)
            self.num_tokens = total
        return req.token_slice(max(0, total - self.tree.max_depth), total)

    def matches(self) -> list[tuple[int, int]]:
        """``tree.matches`` of the synced tokens, from the suffix nodes the tree's walk would reach."""
        kids = self.tree.kids
        return [(node, length) for length, node in reversed(list(enumerate(self.active, 1))) if kids[node]]


# ``speculative.topk=0`` (auto, the conf's default): trees of this shape where the iteration drafts on the host
TREE_TOPK, TREE_DRAFT_TOKENS = 4, 8


def resolve_auto_shape(cfg: SpeculativeConfig, device_type: str) -> None:
    """``topk=0`` (auto) and ``num_draft_tokens=0`` (auto), in place. Chains (``topk=1``, drafted on the device in
    speculation v2) on CUDA: there a tree's v1 iteration waits on the host (2.5 ms an iteration on the H100 against
    n-gram v2's 0.78 ms), and at the default size a tree accepts little more than the best chain (1.32x against 1.27x
    n-gram's tokens a step on the shared-structure tasks in ``bench/suffix_replay.py``). Trees of ``TREE_DRAFT_TOKENS``
    nodes, ``TREE_TOPK`` children a node, elsewhere (on the CPU the forward dwarfs the host's drafting), with
    ``version=v1``, and where ``num_draft_tokens`` asks for more than a chain's ``num_steps + 1``; ``version=v2``
    asks for chains (v2 runs chains only)."""
    if cfg.topk == 0:
        tree = cfg.version == "v1" or cfg.num_draft_tokens > cfg.num_steps + 1 or \
            (cfg.version == "auto" and device_type != "cuda")
        cfg.topk = TREE_TOPK if tree else 1
    if cfg.num_draft_tokens == 0 and cfg.topk > 1:
        cfg.num_draft_tokens = TREE_DRAFT_TOKENS


@DRAFTERS.register("suffix")
class SuffixDrafter(Drafter):
    name = "suffix"
    drafts_on_device = drafts_in_v2 = True  # chains: suffix_chain_device (speculation v2)
    v2_by_default = True  # chains: v1's tokens on a GPU, no synchronisation (tests/test_spec_v2_gpu.py)

    def __init__(self, engine, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(engine.device)
        self.corpus: Optional[SuffixCorpus] = None  # v2: finished requests' tokens on the device
        self.max_children = cfg.topk
        self.global_tree = SuffixTree(cfg.suffix_max_depth)
        self._cached: deque[list[int]] = deque()  # sequences in the global tree, oldest first
        self._cached_tokens = 0
        self._live: list[Request] = []  # requests with a state, until they finish and join the global tree
        # speculative.adaptive with trees: the width estimate, and the iteration's requests with their growths
        self._widths = WidthEstimate(self.verify_widths(cfg))
        self._pending: tuple[list[Request], list[tuple[list, list[float]]]] = ([], [])

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
        own, grown, _ = self._drafts(req, max_depth)
        return grown[:fill] if fill > len(own) else own

    def _drafts(self, req: Request, max_depth: Optional[int]) -> tuple[list, list, list[float]]:
        """(the request's draft, and for trees its growth to ``num_draft_tokens - 1`` nodes past the match-length
        budget and ``min_token_prob``, of which the draft is a prefix: one growth serves both; the growth's path
        probabilities)."""
        cfg = self.cfg
        depth = min(cfg.num_steps, max_depth or cfg.num_steps)
        most = cfg.num_draft_tokens - 1 if depth >= cfg.num_steps else min(cfg.num_draft_tokens - 1, depth * cfg.topk)
        state = self._state(req)
        tail = state.sync(req)
        matches = [(state.tree, node, length) for node, length in state.matches()] + \
            [(self.global_tree, node, length) for node, length in self.global_tree.matches(tail)]
        if cfg.topk > 1:  # a tree from every match at once, the longer ones weighing more
            if not matches:
                return [], [], []
            states = [(tree, node, float(length)) for tree, node, length in matches]
            budget = min(most, int(cfg.max_spec_factor * max(n for _, _, n in matches) + cfg.max_spec_offset))
            grown, probs = grow_draft(states, cfg.num_draft_tokens - 1, depth, cfg.topk, 0.0)
            likely = sum(p >= cfg.min_token_prob for p in probs)  # (a prefix: probabilities never rise)
            return grown[: max(0, min(budget, likely))], grown, probs
        # a chain: the match whose draft has the largest expected number of accepted tokens (as suffix_chain_device
        # drafts it in speculation v2). NOTE: every match length competes: a long match leaves the depth-bounded
        # tree little room to continue
        best: tuple[list, float, list[float]] = ([], 0.0, [])
        for tree, node, length in matches:
            budget = min(most, int(cfg.max_spec_factor * length + cfg.max_spec_offset))
            if budget < 1 or budget <= best[1]:  # (a draft's score never exceeds its size)
                continue
            nodes, probs = grow_draft([(tree, node, 1.0)], budget, depth, cfg.topk, cfg.min_token_prob)
            if sum(probs) > best[1]:
                best = (nodes, sum(probs), probs)
        return best[0], best[0], best[2]

    def batch_drafts(self, reqs: list[Request], max_depth: Optional[int] = None) -> tuple[list[list], int]:
        """Each request's draft nodes and the batch's verify width ``n`` (the largest draft and the root, rounded up
        to a power of two to bound graph shapes); ``n`` 0: nothing drafted. Trees shorter than ``n - 1`` grow into
        the rows the batch verifies anyway (:meth:`draft`'s ``fill``)."""
        drafts = [self._drafts(req, max_depth) for req in reqs]
        rows = [own for own, _, _ in drafts]
        if not any(rows):
            return rows, 0
        n = min(self.cfg.num_draft_tokens, 1 << max(len(r) for r in rows).bit_length())
        if self.cfg.topk > 1:
            rows = [grown[: n - 1] if len(own) < n - 1 else own for own, grown, _ in drafts]
        return rows, n

    # ---- speculative.adaptive (trees): the batch's verify width from the trees' own probabilities -------------
    def adaptive_widths(self) -> Optional[list[int]]:
        return self.verify_widths(self.cfg) if self.cfg.topk > 1 else None

    def expected_tokens(self, ctx: SpecContext) -> list[float]:
        """Grows each request's tree (kept for :meth:`propose`) and estimates its tokens at each width."""
        self._retire_finished()
        self._pending = (ctx.reqs, [self._drafts(req, None)[1:] for req in ctx.reqs])
        return self._widths.expected_tokens([probs for _, probs in self._pending[1]])

    def on_accept(self, ctx: SpecContext, tree: DraftTree, accept_index: list[list[int]],
                  hidden: torch.Tensor, new_roots: list[int]) -> None:
        if ctx.width is not None:
            self._widths.record([probs for _, probs in self._pending[1]], ctx.width, accept_index)

    def propose(self, ctx: SpecContext) -> DraftTree | None:
        if ctx.width is not None:  # speculative.adaptive: the width chosen from expected_tokens' trees
            reqs, drafts = self._pending
            assert reqs is ctx.reqs, "expected_tokens drafts the iteration's requests before propose"
            rows = [grown[: ctx.width - 1] for grown, _ in drafts]
            return host_tree(rows, ctx.width, ctx.roots) if any(rows) else None
        self._retire_finished()
        rows, n = self.batch_drafts(ctx.reqs, ctx.max_depth)
        if not n:
            return None  # nothing to verify: the worker runs a plain decode step
        return host_tree(rows, n, ctx.roots)
