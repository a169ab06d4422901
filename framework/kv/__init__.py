"""Paged KV cache: the pool of per-layer K/V tensors and the slot allocator with its req_to_token table."""

from framework.kv.allocator import DUMMY_ROW, DUMMY_SLOT, KVAllocator
from framework.kv.mla_pool import MLAPool
from framework.kv.pool import KVPool

__all__ = ["DUMMY_ROW", "DUMMY_SLOT", "KVAllocator", "KVPool", "MLAPool"]
