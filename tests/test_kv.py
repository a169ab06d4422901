"""The paged allocator and req_to_token table."""

from __future__ import annotations

import pytest
import torch

from framework.kv import DUMMY_ROW, DUMMY_SLOT, KVAllocator


def make(page_size: int, num_tokens: int = 64) -> KVAllocator:
    return KVAllocator(num_tokens, page_size, max_requests=4, max_context=48, device=torch.device("cpu"))


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_slots_follow_pages_and_table_mirrors_device(page_size):
    alloc = make(page_size)
    a, b = alloc.alloc_request(), alloc.alloc_request()
    assert DUMMY_ROW not in (a, b)
    s1 = alloc.assign([a, b], [0, 0], [5, 3]).tolist()
    s2 = alloc.assign([a], [5], [11]).tolist()
    slots_a = s1[:5] + s2
    assert DUMMY_SLOT not in slots_a and len(set(slots_a + s1[5:])) == 14
    for pos, slot in enumerate(slots_a):  # position p sits at offset p % page_size of its page
        assert slot % page_size == pos % page_size
        assert slot // page_size == slots_a[pos - pos % page_size] // page_size
    assert alloc.req_to_token[a, :11].tolist() == slots_a
    assert alloc.req_to_token_host[a, :11].tolist() == slots_a
    alloc.free_request(a)
    alloc.free_request(b)
    alloc.assert_all_free()


def test_exhaustion_allocates_nothing_and_truncate_frees_pages():
    alloc = make(page_size=4, num_tokens=16)  # 4 usable pages
    a = alloc.alloc_request()
    alloc.assign([a], [0], [10])  # 3 pages
    b = alloc.alloc_request()
    with pytest.raises(MemoryError):
        alloc.assign([b], [0], [8])  # needs 2, 1 free
    assert alloc.num_free_pages == 1 and alloc.num_pages_of(b) == 0
    alloc.truncate(a, 4)
    assert alloc.num_free_pages == 3
    alloc.assign([b], [0], [8])
    alloc.free_request(a)
    alloc.free_request(b)
    alloc.assert_all_free()


def test_leak_is_detected():
    alloc = make(page_size=2)
    a = alloc.alloc_request()
    alloc.assign([a], [0], [3])
    with pytest.raises(AssertionError):
        alloc.assert_all_free()
    alloc.free_request(a)
    alloc.assert_all_free()


def test_context_limit():
    alloc = make(page_size=1)
    a, b = alloc.alloc_request(), alloc.alloc_request()
    with pytest.raises(ValueError):
        alloc.assign([a, b], [0, 0], [4, 49])
    assert alloc.num_pages_of(a) == 0  # nothing allocated for the valid row either
    alloc.free_request(a)
    alloc.free_request(b)
