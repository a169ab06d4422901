"""The prefix cache's tree and the allocator's page bookkeeping, against a reference model of the tree.

The reference keeps every cached prefix (a tuple of token ids, a multiple of page_size long) with its page, the
number of live requests holding it and the time it was last used; eviction takes the unheld prefix that no other
cached prefix extends and that was used least recently. Random workloads (shared stems, divergence mid-page,
progress during prefill, preemption-like early frees, pools small enough to evict) run through the real allocator
and the reference side by side, and after every operation the two agree and the allocator's invariants hold.
"""

from __future__ import annotations

import random

import pytest
import torch

from framework.kv import KVAllocator, RadixCache


class RefTree:
    """prefix -> [page, holders, last_used]; requests hold every prefix of their path."""

    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.nodes: dict[tuple, list[int]] = {}
        self.clock = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def match(self, tokens: list[int], max_tokens: int) -> list[tuple]:
        path = []
        for end in range(self.ps, min(max_tokens, len(tokens)) + 1, self.ps):
            if tuple(tokens[:end]) not in self.nodes:
                break
            path.append(tuple(tokens[:end]))
        return path

    def hold(self, path: list[tuple], delta: int) -> None:
        t = self.tick()
        for prefix in path:
            self.nodes[prefix][1] += delta
            self.nodes[prefix][2] = t

    def add(self, tokens: list[int], pages: list[int], first: int, stop_at_conflict: bool) -> tuple[int, list[int]]:
        """Add pages first.. of tokens; returns (pages taken, duplicate pages)."""
        t, dups, taken = self.tick(), [], 0
        for i, page in enumerate(pages):
            prefix = tuple(tokens[: (first + i + 1) * self.ps])
            if prefix in self.nodes and self.nodes[prefix][0] != page:
                if stop_at_conflict:
                    break
                dups.append(page)
            elif prefix not in self.nodes:
                self.nodes[prefix] = [page, 0, t]
            taken += 1
        return taken, dups

    def evict(self, n: int) -> list[int]:
        freed = []
        for _ in range(n):
            leaves = [p for p, (_, ref, _) in self.nodes.items() if ref == 0 and
                      not any(len(q) == len(p) + self.ps and q[: len(p)] == p for q in self.nodes)]
            if not leaves:
                break
            victim = min(leaves, key=lambda p: self.nodes[p][2])
            freed.append(self.nodes.pop(victim)[0])
        return freed

    @property
    def evictable(self) -> int:
        return sum(ref == 0 for _, ref, _ in self.nodes.values())


def tree_prefixes(cache: RadixCache) -> dict[tuple, tuple[int, int]]:
    """The implementation's tree as prefix -> (page, ref)."""
    out, stack = {}, [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            key = prefix + child.key
            out[key] = (child.page, child.ref)
            stack.append((child, key))
    return out


def agree(alloc: KVAllocator, ref: RefTree) -> None:
    alloc.check_invariants()
    assert tree_prefixes(alloc.cache) == {p: (v[0], v[1]) for p, v in ref.nodes.items()}
    assert alloc.cache.num_evictable == ref.evictable


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_matches_the_reference_tree(page_size, seed):
    rng = random.Random(seed * 31 + page_size)
    pool_tokens = page_size * rng.choice([12, 24, 48])
    alloc = KVAllocator(pool_tokens, page_size, max_requests=6, max_context=8 * page_size + 8,
                        device=torch.device("cpu"), prefix_cache=True)
    ref = RefTree(page_size)
    stems = [[rng.randrange(3) for _ in range(rng.randrange(1, 5 * page_size + 2))] for _ in range(3)]
    live: dict[int, dict] = {}  # row -> {"tokens", "written", "path"}
    for _ in range(300):
        op = rng.random()
        if op < 0.45 and len(live) < 6:  # admit: a stem (maybe cut mid-page) plus a random tail
            stem = rng.choice(stems)
            tail = [rng.randrange(3) for _ in range(rng.randrange(1, 2 * page_size + 3))]
            tokens = stem[: rng.randrange(len(stem) + 1)] + tail
            tokens = tokens[: alloc.max_context]
            limit = len(tokens) - 1
            path = alloc.match_prefix(tokens, limit)
            ref_path = ref.match(tokens, limit)
            assert [n.page for n in path] == [ref.nodes[p][0] for p in ref_path]
            need = alloc.pages_for(len(tokens)) - len(path) + RadixCache.num_unreferenced(path)
            if need > alloc.num_free_pages:
                continue
            row = alloc.alloc_request(path)
            ref.hold(ref_path, +1)
            short = alloc.pages_for(len(tokens)) - len(path) - len(alloc._free_pages)
            ref_freed = ref.evict(short) if short > 0 else []
            alloc.assign([row], [len(path) * page_size], [len(tokens)])  # evicts what the reference evicted
            assert set(ref_freed) <= set(alloc._pages[row])
            slots = alloc.req_to_token_host[row, : len(tokens)]
            assert slots.tolist() == alloc.req_to_token[row, : len(tokens)].tolist()
            for i, node in enumerate(path):  # the cached pages' slots, in order
                assert slots[i * page_size] == node.page * page_size
            live[row] = {"tokens": tokens, "written": len(path) * page_size, "path": ref_path}
        elif op < 0.7 and live:  # progress: the row's K/V grows and its full pages are shared
            row = rng.choice(list(live))
            st = live[row]
            st["written"] = rng.randrange(st["written"], len(st["tokens"]) + 1)
            alloc.cache_prefix(row, st["tokens"], st["written"])
            full = st["written"] // page_size
            first = len(st["path"])
            if full > first:
                taken, _ = ref.add(st["tokens"], alloc._pages[row][first:full], first, True)
                new_path = st["path"] + [tuple(st["tokens"][: (first + i + 1) * page_size]) for i in range(taken)]
                if taken:
                    ref.hold(new_path, +1)
                    ref.hold(st["path"], -1)
                st["path"] = new_path
        elif live:  # finish or preempt: written full pages stay cached
            row = rng.choice(list(live))
            st = live.pop(row)
            written = rng.randrange(st["written"], len(st["tokens"]) + 1)
            pages = list(alloc._pages[row])
            alloc.free_request(row, st["tokens"], written)
            first = len(st["path"])
            full = written // page_size
            if full > first:
                ref.add(st["tokens"], pages[first:full], first, False)
            ref.hold(st["path"], -1)
        agree(alloc, ref)
    for row, st in list(live.items()):
        alloc.free_request(row, st["tokens"], st["written"])
    alloc.assert_all_free()


def test_eviction_is_least_recently_used_leaves_first():
    cache = RadixCache(page_size=2)
    a = cache.insert(cache.root, cache.keys([1, 1, 2, 2, 3, 3], 3), [1, 2, 3], False)[0]  # [1 1] [2 2] [3 3]
    b = cache.insert(cache.root.children[(1, 1)], [(4, 4)], [4], False)[0]  # [1 1] [4 4], newer
    assert cache.num_pages == 4 and cache.num_evictable == 4 and b.parent is a.parent.parent
    cache.lock(a)
    cache.unlock(a)  # the [2 2] [3 3] branch is now the most recently used
    assert cache.evict(1) == [4]  # so the other leaf goes first
    cache.lock(a)
    assert cache.evict(10) == [] and cache.num_evictable == 0  # every page is held
    cache.unlock(a)
    assert cache.evict(10) == [3, 2, 1] and cache.num_pages == 0  # leaves first, up the branch


def test_a_held_page_is_never_evicted_or_freed():
    alloc = KVAllocator(8, 2, max_requests=2, max_context=8, device=torch.device("cpu"), prefix_cache=True)
    tokens = [5, 6, 7, 8, 9]
    row = alloc.alloc_request()
    alloc.assign([row], [0], [5])
    alloc.free_request(row, tokens, 5)  # pages of [5 6] [7 8] cached, the partial [9] freed
    assert alloc.num_cached_pages == 2 and alloc.num_free_pages == 4
    path = alloc.match_prefix(tokens, 4)
    other = alloc.alloc_request(path)
    assert alloc.num_free_pages == 2  # the two cached pages are held now
    alloc.assign([other], [4], [5])
    hog = alloc.alloc_request()
    with pytest.raises(MemoryError):
        alloc.assign([hog], [0], [4])  # 2 pages would fit only by evicting the held ones
    alloc.truncate(other, 0)  # truncation never drops the row's cached pages
    assert alloc.num_pages_of(other) == 2
    alloc.check_invariants()
    alloc.free_request(other, tokens, 4)
    alloc.free_request(hog)
    alloc.assert_all_free()
    assert alloc.clear_cache() == 2 and alloc.num_cached_pages == 0 and alloc.num_free_pages == alloc.num_pages
    alloc.assert_all_free()


def test_a_concurrent_duplicate_page_stays_private_then_is_freed():
    alloc = KVAllocator(16, 2, max_requests=3, max_context=8, device=torch.device("cpu"), prefix_cache=True)
    tokens = [1, 2, 3, 4, 5]
    a, b = alloc.alloc_request(), alloc.alloc_request()
    alloc.assign([a, b], [0, 0], [5, 5])  # the same prompt computed twice, in one step
    alloc.cache_prefix(a, tokens, 5)
    alloc.cache_prefix(b, tokens, 5)  # b's pages hold the same tokens: they stay b's own
    assert alloc.num_cached_pages == 2 and alloc._shared[b] == 0
    alloc.check_invariants()
    free_before = len(alloc._free_pages)
    alloc.free_request(b, tokens, 5)  # b's duplicates and its partial page go back
    assert len(alloc._free_pages) == free_before + 3 and alloc.num_cached_pages == 2
    alloc.free_request(a, tokens, 5)
    alloc.assert_all_free()
    assert alloc.num_cached_pages == 2


def test_leak_and_double_ownership_are_detected():
    alloc = KVAllocator(8, 2, max_requests=2, max_context=8, device=torch.device("cpu"), prefix_cache=True)
    row = alloc.alloc_request()
    alloc.assign([row], [0], [4])
    alloc.free_request(row, [1, 2, 3, 4], 4)
    alloc.assert_all_free()
    alloc._free_pages.append(alloc.cache.pages()[0])  # a cached page also on the free list
    with pytest.raises(AssertionError):
        alloc.assert_all_free()
    alloc._free_pages.pop()
    node = next(alloc.cache.nodes())
    node.ref += 1  # a reference nobody holds
    with pytest.raises(AssertionError):
        alloc.check_invariants()
    node.ref -= 1
    alloc.assert_all_free()
