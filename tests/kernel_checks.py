"""Shared by the kernel tests: paged KV fixtures (a shuffled ``req_to_token`` table, a random pool, a random tree
mask), the split-K / extend attention checks against their references, and the runner of ``torch.library.opcheck``
without the interpreter, in a fresh process (the interpreter's runs of a test module: tests/interpreted_runner.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tfs_kernels.decode_attention import decode_attention, decode_attention_reference
from tfs_kernels.extend_attention import extend_attention, extend_attention_reference
from tfs_kernels.mask_bits import pack_mask_bits
from tfs_kernels.verify_attention import verify_attention, verify_attention_reference

ROOT = Path(__file__).resolve().parents[1]


def paged_table(seq_lens: list[int], page_size: int, width: int, device: str, seed: int):
    """``req_to_token`` ``[rows, width]`` over shuffled pages (a request's pages are scattered through the pool;
    positions past its length hold valid slots of stale data), the ``req_pool_indices`` of the batch (not in row
    order), and the pool size in slots."""
    gen = torch.Generator().manual_seed(seed)
    rows, pages_per_row = len(seq_lens) + 2, -(-width // page_size)
    num_pages = rows * pages_per_row + 1
    page_of = torch.randperm(num_pages, generator=gen)[: rows * pages_per_row].view(rows, pages_per_row)
    pos = torch.arange(width)
    table = page_of[:, pos // page_size] * page_size + pos % page_size  # [rows, width]
    req_pool_indices = torch.randperm(rows, generator=gen)[: len(seq_lens)]
    return table.to(device), req_pool_indices.to(device), num_pages * page_size


def random_pool(num_slots: int, kv_heads: int, dim: int, dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_slots, kv_heads, dim, generator=gen)
    v = torch.randn(num_slots, kv_heads, dim, generator=gen)
    return k.to(device, dtype), v.to(device, dtype)


def tree_mask(bs: int, q_len: int, width: int, seed: int) -> torch.Tensor:
    """``[bs, q_len, width]``: random over the earlier region, a random tree (parents first) over the last q_len."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(bs, q_len, width, generator=gen) < 0.5
    own = mask[:, :, width - q_len:] & torch.ones(q_len, q_len, dtype=torch.bool).tril()
    mask[:, :, width - q_len:] = own | torch.eye(q_len, dtype=torch.bool)
    return mask


def check_split_kv(heads: int, kv_heads: int, dim: int, page_size: int, seq_lens: list[int], q_len: int,
                   mask_width, policy: tuple[int, int, int], device: str = "cpu",
                   dtype: torch.dtype = torch.float32, tol: float = 1e-5, seed: int = 0, bits: bool = False) -> None:
    """decode (q_len 1, no mask) or verify, kernel vs reference; ``mask_width`` None = causal; ``bits``: the kernel
    reads the mask packed by pack_mask_bits (as attention=triton passes masks up to 64 keys wide), and an all-zero
    byte mask of the same width, which it must ignore."""
    width = max(seq_lens) + 5
    table, rpi, num_slots = paged_table(seq_lens, page_size, width, device, seed)
    k_cache, v_cache = random_pool(num_slots, kv_heads, dim, dtype, device, seed + 1)
    bs = len(seq_lens)
    q = torch.randn(bs * q_len, heads, dim, generator=torch.Generator().manual_seed(seed + 2)).to(device, dtype)
    seq = torch.tensor(seq_lens, device=device)
    scale = dim ** -0.5
    if q_len == 1 and mask_width is None:
        out = decode_attention(q, k_cache, v_cache, table, rpi, seq, scale, *policy)
        ref = decode_attention_reference(q, k_cache, v_cache, table, rpi, seq, scale, *policy)
    else:
        mask = None if mask_width is None else tree_mask(bs, q_len, mask_width, seed + 3).to(device)
        packed = pack_mask_bits(mask) if bits else None
        # with the words, the kernel must not read the mask's bytes (only its width): give it a wrong mask
        kernel_mask = torch.zeros_like(mask) if bits else mask
        out = verify_attention(q, k_cache, v_cache, table, rpi, seq, kernel_mask, q_len, scale, *policy,
                               mask_bits=packed)
        ref = verify_attention_reference(q, k_cache, v_cache, table, rpi, seq, mask, q_len, scale, *policy)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def check_extend(heads: int, kv_heads: int, dim: int, page_size: int, prefix_lens: list[int], new_lens: list[int],
                 device: str = "cpu", dtype: torch.dtype = torch.float32, tol: float = 1e-5, seed: int = 0) -> None:
    seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
    table, rpi, num_slots = paged_table(seq_lens, page_size, max(seq_lens) + 3, device, seed)
    k_cache, v_cache = random_pool(num_slots, kv_heads, dim, dtype, device, seed + 1)
    q = torch.randn(sum(new_lens), heads, dim, generator=torch.Generator().manual_seed(seed + 2)).to(device, dtype)
    lens = torch.tensor(new_lens, device=device)
    starts = torch.cumsum(lens, 0) - lens
    args = (q, k_cache, v_cache, table, rpi, torch.tensor(seq_lens, device=device), starts, lens, max(new_lens),
            dim ** -0.5)
    torch.testing.assert_close(extend_attention(*args).float(), extend_attention_reference(*args).float(),
                               rtol=tol, atol=tol)


def run_opcheck_without_interpreter(setup: str) -> None:
    """In a fresh process without the interpreter or a GPU, run ``torch.library.opcheck`` (schema, autograd
    registration, fake tensors) on each ``(op, args)`` of the list ``cases`` that the code ``setup`` defines."""
    code = ("import torch\n" + setup + "assert cases\nfor op, args in cases:\n"
            "    torch.library.opcheck(op, args,\n"
            "                          test_utils=('test_schema', 'test_autograd_registration', 'test_faketensor'))\n"
            "print('opcheck ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "opcheck ok" in proc.stdout, proc.stderr[-3000:]
