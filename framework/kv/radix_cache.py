"""Prefix cache: a radix tree over token ids at page granularity whose nodes own KV pages.

Each node below the root is one FULL page: its key is the page's ``page_size`` token ids, its value the KV page
that holds their K/V (computed after exactly the tokens on the path from the root). A request that starts with
the tokens of a path can take those pages instead of prefilling them (SGLang's RadixAttention, vLLM's automatic
prefix caching; only full pages are shared, a partial page is always recomputed into a page of its own).

NOTE (reference counts): ``node.ref`` is the number of running requests holding the node, and a request holds a
whole path from the root (it locks its deepest node), so refs never increase from a node to its child: a node with
ref 0 has only ref-0 descendants, and every ref-0 node can be evicted once its subtree is gone. ``num_evictable``
counts them. Eviction takes ref-0 leaves, least recently used first (a heap with lazy deletion).

The tree knows nothing of allocators or requests: callers hand it page ids and get page ids back.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterator, Optional


class Node:
    """One full page of a cached prefix."""

    __slots__ = ("key", "page", "parent", "children", "ref", "last_access")

    def __init__(self, key: tuple, page: int, parent: Optional["Node"]) -> None:
        self.key = key  # the page's token ids, [page_size]
        self.page = page  # the KV page holding their K/V (-1: the root, which holds nothing)
        self.parent = parent
        self.children: dict[tuple, Node] = {}
        self.ref = 0  # running requests holding this node (and so its whole path)
        self.last_access = 0  # logical clock of the last lock / unlock / insert


class RadixCache:
    """Cached prefixes: :meth:`match`, :meth:`lock` / :meth:`unlock`, :meth:`insert`, :meth:`evict`."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = Node((), -1, None)
        self.root.ref = 1  # NOTE: never evicted, never counted
        self.num_pages = 0  # pages the tree holds
        self.num_evictable = 0  # of them, those no running request holds (ref 0)
        self.num_evicted = 0  # pages evicted so far
        self.version = 0  # changes whenever a page enters or leaves the tree (a match may have changed)
        self._clock = itertools.count(1)
        self._heap: list[tuple[int, int, Node]] = []  # (last_access, tiebreak, leaf) eviction candidates
        self._tiebreak = itertools.count()

    def keys(self, tokens: list[int], num_pages: int, first: int = 0) -> list[tuple]:
        """The keys of pages ``first .. num_pages - 1`` of ``tokens``."""
        ps = self.page_size
        return [tuple(tokens[i * ps: (i + 1) * ps]) for i in range(first, num_pages)]

    # ---- lookup -------------------------------------------------------------------------------------------
    def match(self, tokens: list[int], max_pages: int) -> list[Node]:
        """The path of the longest cached prefix of ``tokens``, at most ``max_pages`` pages (root excluded)."""
        ps, node, path = self.page_size, self.root, []
        for i in range(min(max_pages, len(tokens) // ps)):
            node = node.children.get(tuple(tokens[i * ps: (i + 1) * ps]))
            if node is None:
                break
            path.append(node)
        return path

    @staticmethod
    def num_unreferenced(path: list[Node]) -> int:
        """Nodes of ``path`` that no request holds: locking the path takes them out of the evictable pages."""
        # NOTE: refs do not increase along a path, so the unreferenced nodes are a suffix of it
        n = 0
        for node in reversed(path):
            if node.ref:
                break
            n += 1
        return n

    # ---- reference counts ---------------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        """A request holds ``node`` and every node above it."""
        stamp = next(self._clock)
        while node is not self.root:
            if node.ref == 0:
                self.num_evictable -= 1
            node.ref += 1
            node.last_access = stamp
            node = node.parent

    def unlock(self, node: Node) -> None:
        """A request no longer holds ``node`` and the nodes above it; nodes nobody holds become evictable."""
        stamp = next(self._clock)
        deepest = node
        while node is not self.root:
            assert node.ref > 0, "prefix cache: unlock of a node nobody holds"
            node.ref -= 1
            node.last_access = stamp
            if node.ref == 0:
                self.num_evictable += 1
            node = node.parent
        self._push(deepest)

    # ---- insertion ----------------------------------------------------------------------------------------
    def insert(self, node: Node, keys: list[tuple], pages: list[int], stop_at_conflict: bool
               ) -> tuple[Node, int, list[int]]:
        """Add pages ``pages[i]`` (keys ``keys[i]``) below ``node``, one level each.

        Where a page's key is cached already under another page, ``stop_at_conflict`` stops there (a running
        request keeps reading its own page); otherwise the walk goes on below the cached node and the caller's page
        is a duplicate. New nodes start with ref 0. Returns the deepest node reached, how many of ``pages`` it
        covers, and the duplicate pages (the caller frees them). Existing nodes keep their recency: only
        :meth:`lock` and :meth:`unlock` (which re-push the deepest node) use a path."""
        stamp = next(self._clock)
        duplicates: list[int] = []
        created = False
        for i, (key, page) in enumerate(zip(keys, pages)):
            child = node.children.get(key)
            if child is None:
                child = Node(key, page, node)
                child.last_access = stamp
                node.children[key] = child
                self.num_pages += 1
                self.num_evictable += 1
                self.version += 1
                created = True
            elif child.page != page:
                if stop_at_conflict:
                    return self._inserted(node, created), i, duplicates
                duplicates.append(page)
            node = child
        return self._inserted(node, created), len(pages), duplicates

    def _inserted(self, node: Node, created: bool) -> Node:
        if created:
            self._push(node)
        return node

    # ---- eviction -----------------------------------------------------------------------------------------
    def _push(self, node: Node) -> None:
        if node is not self.root and node.ref == 0 and not node.children:
            heapq.heappush(self._heap, (node.last_access, next(self._tiebreak), node))

    def evict(self, num_pages: int) -> list[int]:
        """Remove up to ``num_pages`` unreferenced pages, least recently used leaves first; returns their pages."""
        freed: list[int] = []
        while len(freed) < num_pages and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if node.ref or node.children or node.parent is None or node.last_access != stamp:
                continue  # stale entry: held, grown, evicted, or used again since it was pushed
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            self.num_pages -= 1
            self.num_evictable -= 1
            self.version += 1
            freed.append(node.page)
            self._push(parent)
        self.num_evicted += len(freed)
        return freed

    # ---- inspection ---------------------------------------------------------------------------------------
    def nodes(self) -> Iterator[Node]:
        """Every node below the root (depth first)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def pages(self) -> list[int]:
        return [node.page for node in self.nodes()]
