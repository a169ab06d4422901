"""Paged KV cache: the pool of per-layer K/V tensors and the slot allocator with its req_to_token table,
and the prefix cache (a radix tree of shared pages)."""

from framework.kv.allocator import DUMMY_ROW, DUMMY_SLOT, KVAllocator
from framework.kv.mla_pool import MLAPool
from framework.kv.pool import KVPool
from framework.kv.radix_cache import RadixCache

__all__ = ["DUMMY_ROW", "DUMMY_SLOT", "KVAllocator", "KVPool", "MLAPool", "RadixCache"]
