"""The sdpa backend against a per-request float64 reference over the paged pool (fresh random inputs)."""

from __future__ import annotations

import math

import pytest
import torch

from framework.attention import ATTENTION_BACKENDS
from framework.batch import ForwardBatch, ForwardMode
from framework.kv import KVAllocator, KVPool

HEADS, KV_HEADS, DIM = 6, 2, 16


def make_backend(page_size: int, name: str = "sdpa", device: str = "cpu", dtype: torch.dtype = torch.float32):
    alloc = KVAllocator(num_tokens=4096, page_size=page_size, max_requests=8, max_context=512,
                        device=torch.device(device))
    pool = KVPool(1, alloc.num_slots, KV_HEADS, DIM, dtype, torch.device(device))
    return ATTENTION_BACKENDS.build(name, pool, alloc, HEADS, KV_HEADS, DIM), alloc, pool


def reference(q, keys, values, allowed):
    """q [n, heads, dim]; keys/values [L, kv_heads, dim]; allowed [n, L] bool -> [n, heads * dim]."""
    group = HEADS // KV_HEADS
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) / math.sqrt(DIM)
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    out = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)
    return out.reshape(q.shape[0], -1)


def run_case(page_size: int, prefix_lens: list[int], new_lens: list[int], mode: ForwardMode, tree: bool,
             name: str = "sdpa", mask_extra: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
             tol: float = 1e-4):
    """``tree``: a random custom mask over each request's last ``new + mask_extra`` keys (parents first).
    The reference runs in float64 on the CPU; ``device`` / ``dtype`` / ``tol`` serve other backends and the GPU."""
    torch.manual_seed(page_size * 1000 + sum(prefix_lens) + len(new_lens))
    backend, alloc, pool = make_backend(page_size, name, device, dtype)
    rows = [alloc.alloc_request() for _ in prefix_lens]
    # cached prefix: random K/V written straight into the pool
    if sum(prefix_lens):
        slots = alloc.assign(rows, [0] * len(rows), prefix_lens)
        pool.k[0][slots] = torch.randn(len(slots), KV_HEADS, DIM).to(device, dtype)
        pool.v[0][slots] = torch.randn(len(slots), KV_HEADS, DIM).to(device, dtype)
    ends = [p + n for p, n in zip(prefix_lens, new_lens)]
    out_cache_loc = alloc.assign(rows, prefix_lens, ends)
    total = sum(new_lens)
    q = torch.randn(total, HEADS, DIM)
    k = torch.randn(total, KV_HEADS, DIM)
    v = torch.randn(total, KV_HEADS, DIM)
    custom = None
    if tree:
        n, width = new_lens[0], new_lens[0] + mask_extra
        custom = torch.rand(len(rows), n, width) < 0.5
        custom[:, :, mask_extra:] |= torch.eye(n, dtype=torch.bool)
        custom[:, :, mask_extra:] &= torch.ones(n, n, dtype=torch.bool).tril()  # parents come before children
    if dtype != torch.float32:  # the reference sees exactly what the backend sees
        q, k, v = q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float()
    dev = torch.device(device)
    batch = ForwardBatch(mode=mode, input_ids=torch.zeros(total, dtype=torch.int64, device=dev),
                         positions=torch.zeros(total, dtype=torch.int64, device=dev), out_cache_loc=out_cache_loc,
                         req_pool_indices=torch.tensor(rows, device=dev), seq_lens=torch.tensor(ends, device=dev),
                         seq_lens_cpu=ends, extend_lens_cpu=new_lens, logits_index=torch.arange(total, device=dev),
                         custom_mask=None if custom is None else custom.to(dev))
    meta = backend.init_metadata(batch)
    out = backend.forward(q.to(dev, dtype), k.to(dev, dtype), v.to(dev, dtype), 0, meta).cpu()
    start = 0
    for b, (row, p, n) in enumerate(zip(rows, prefix_lens, new_lens)):
        slots = alloc.req_to_token[row, : p + n].cpu()
        keys, values = pool.k[0].cpu().float()[slots], pool.v[0].cpu().float()[slots]
        allowed = torch.zeros(n, p + n, dtype=torch.bool)
        if tree:
            allowed[:, : p - mask_extra] = True
            allowed[:, p - mask_extra:] = custom[b]
        else:
            allowed[:, :p] = True
            allowed[:, p:] = torch.ones(n, n, dtype=torch.bool).tril()
        ref = reference(q[start:start + n], keys, values, allowed)
        torch.testing.assert_close(out[start:start + n].double(), ref, rtol=tol, atol=tol)
        start += n
    for row in rows:
        alloc.free_request(row)
    alloc.assert_all_free()


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_with_cached_prefix(page_size):
    run_case(page_size, prefix_lens=[0, 5, 37, 16], new_lens=[7, 1, 20, 33], mode=ForwardMode.EXTEND, tree=False)


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode(page_size):
    run_case(page_size, prefix_lens=[1, 15, 16, 100, 200], new_lens=[1] * 5, mode=ForwardMode.DECODE, tree=False)


@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_with_tree_mask(page_size):
    run_case(page_size, prefix_lens=[3, 17, 64], new_lens=[8] * 3, mode=ForwardMode.TARGET_VERIFY, tree=True)


@pytest.mark.parametrize("page_size", [1, 16])
def test_draft_step_mask_reaches_into_earlier_tokens(page_size):
    run_case(page_size, prefix_lens=[12, 30], new_lens=[4, 4], mode=ForwardMode.DRAFT_DECODE, tree=True,
             mask_extra=9)


def test_key_width_is_bucketed():
    from framework.attention.sdpa import kv_width_bucket

    assert [kv_width_bucket(n, 512) for n in (1, 64, 65, 200, 511, 600)] == [64, 64, 128, 256, 512, 512]
