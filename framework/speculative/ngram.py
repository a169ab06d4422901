"""``speculative=ngram``: train-free prompt lookup. Each request keeps an index from its n-grams (sizes
``ngram_min .. ngram_max``) to where they occurred in prompt + output; the tokens that followed the longest
matching suffix are the draft. A chain takes the most recent match; a tree (topk > 1) merges the continuations
of several matches into a trie and keeps the most frequent nodes. No model forward.

Chains also run on the device (:func:`ngram_chain_device`, speculation v2): the same match computed over each
request's token history as one batched comparison, so drafting needs nothing from the host."""

from __future__ import annotations

from collections import defaultdict

import torch

from framework.config import SpeculativeConfig
from framework.request import Request
from framework.speculative import DRAFTERS
from framework.speculative.base import DraftTree, Drafter, SpecContext
from framework.speculative.tree import host_tree


class NgramIndex:
    """n-gram -> positions where the token after it sits, kept up to date as tokens are appended."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.tables: dict[int, dict[tuple, list[int]]] = {n: defaultdict(list) for n in range(min_n, max_n + 1)}

    def sync(self, tokens: list[int]) -> None:
        """Index the tokens appended since the last call (``tokens`` extends the indexed sequence)."""
        for t in range(len(self.tokens), len(tokens)):
            self.tokens.append(tokens[t])
            for n in range(self.min_n, min(self.max_n, t + 1) + 1):
                self.tables[n][tuple(self.tokens[t + 1 - n: t + 1])].append(t + 1)

    def continuations(self, max_len: int, max_matches: int) -> list[list[int]]:
        """Continuations of the longest suffix that occurred before, most recent first."""
        end = len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            starts = self.tables[n].get(tuple(self.tokens[end - n:]), [])
            conts = [self.tokens[s: s + max_len] for s in reversed(starts) if s < end][:max_matches]
            if conts:
                return conts
        return []


def trie_nodes(conts: list[list[int]], budget: int, max_children: int) -> list[tuple[int, int, int]]:
    """Pick up to ``budget`` trie nodes (token, parent node index, depth), parents first, at most
    ``max_children`` children a node, preferring nodes that more continuations pass through."""
    stats: dict[tuple, list[int]] = {}  # path -> [count, first seen]
    for rank, cont in enumerate(conts):
        for d in range(1, len(cont) + 1):
            entry = stats.setdefault(tuple(cont[:d]), [0, rank])
            entry[0] += 1
    order = sorted(stats, key=lambda path: (-stats[path][0], len(path), stats[path][1]))
    index: dict[tuple, int] = {(): 0}
    children: dict[int, int] = defaultdict(int)
    nodes: list[tuple[int, int, int]] = []
    for path in order:
        parent = index.get(path[:-1])
        if parent is None or children[parent] >= max_children:
            continue
        children[parent] += 1
        nodes.append((path[-1], parent, len(path)))
        index[path] = len(nodes)
        if len(nodes) == budget:
            break
    return nodes


def ngram_chain_device(history: torch.Tensor, lens: torch.Tensor, num_steps: int, min_n: int,
                       max_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain :class:`NgramIndex` drafts, for a batch at once on the device: ``history`` ``[bs, width]`` each
    request's tokens, ``lens`` ``[bs]`` how many are known -> (drafts ``[bs, num_steps]``, valid ``[bs,
    num_steps]``). The longest suffix (``min_n .. max_n`` tokens) that also ends at an earlier position ``j``
    wins, the most recent ``j`` among equals; the draft is the tokens after ``j``, up to the known end."""
    bs, width = history.shape
    dev = history.device
    ends = torch.arange(width, device=dev)[None, :]  # [1, width] candidate end positions j
    run = torch.ones(bs, width, dtype=torch.bool, device=dev)
    match = torch.zeros(bs, width, dtype=torch.int64, device=dev)  # matched suffix length ending at j
    for i in range(max_n):  # (over suffix sizes: at most max_n small comparisons)
        at = (lens - 1 - i)[:, None]  # [bs, 1] suffix token i from the end
        want = torch.gather(history, 1, at.clamp(min=0))
        have = torch.gather(history, 1, (ends - i).clamp(min=0).expand(bs, width))
        run = run & (ends - i >= 0) & (at >= 0) & (have == want)
        match = match + run
    candidate = (ends <= lens[:, None] - 2) & (match >= min_n)  # a token follows j, before the root
    score = torch.where(candidate, match * width + ends, torch.full_like(match, -1))
    best = score.max(dim=1)
    start = best.indices + 1  # [bs] first drafted position
    cols = start[:, None] + torch.arange(num_steps, device=dev)[None, :]  # [bs, num_steps]
    drafts = torch.gather(history, 1, cols.clamp(max=width - 1))
    valid = (best.values >= 0)[:, None] & (cols < lens[:, None])
    return drafts, valid


@DRAFTERS.register("ngram")
class NgramDrafter(Drafter):
    name = "ngram"
    drafts_on_device = drafts_in_v2 = v2_by_default = True  # chains: ngram_chain_device (speculation v2)

    def __init__(self, engine, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg
        self.max_children = cfg.topk

    def propose_device(self, history: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chain drafts ``[bs, num_steps]`` and their validity from the requests' token histories (v2)."""
        return ngram_chain_device(history, lens, self.cfg.num_steps, self.cfg.ngram_min, self.cfg.ngram_max)

    def _index(self, req: Request) -> NgramIndex:
        if req.drafter_state is None:
            req.drafter_state = NgramIndex(self.cfg.ngram_min, self.cfg.ngram_max)
        req.drafter_state.sync(req.prompt_ids + req.output_ids)
        return req.drafter_state

    @staticmethod
    def width(cfg: SpeculativeConfig, depth: int) -> int:
        """Tree nodes per request when drafting ``depth`` deep (speculative.adaptive: below num_steps)."""
        return cfg.num_draft_tokens if depth >= cfg.num_steps else min(cfg.num_draft_tokens, 1 + depth * cfg.topk)

    @classmethod
    def verify_widths(cls, cfg: SpeculativeConfig) -> list[int]:
        depths = range(1, cfg.num_steps + 1) if cfg.adaptive else [cfg.num_steps]
        return sorted({cls.width(cfg, d) for d in depths})

    def propose(self, ctx: SpecContext) -> DraftTree | None:
        steps, k = min(self.cfg.num_steps, ctx.max_depth or self.cfg.num_steps), self.cfg.topk
        n = self.width(self.cfg, steps)
        rows = []
        for req in ctx.reqs:
            conts = self._index(req).continuations(steps, max_matches=1 if k == 1 else 4 * k)
            rows.append(trie_nodes(conts, n - 1, k))
        if not any(rows):
            return None  # nothing to verify: the worker runs a plain decode step
        return host_tree(rows, n, ctx.roots)
