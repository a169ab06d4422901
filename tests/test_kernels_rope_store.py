"""``tfs::rope_store_kv`` (tfs_kernels/rope_store.py) against its plain-torch reference, on fresh random inputs.

CPU: the Triton interpreter (in a ``TRITON_INTERPRET=1`` subprocess under a plain ``pytest``), small fp32 shapes,
including a half head_dim that is not a power of two, a qkv that is a column slice of a wider tensor and cos / sin
tables with a row stride of their own, read at random positions. The reference itself is checked against the
model's unfused code (``apply_rope`` and ``store_kv_reference``). GPU (``pytest -m gpu``): Llama-3-8B and SmolLM2
attention shapes in bf16 at decode, verify and prefill sizes, ``torch.library.opcheck`` in full, and torch.compile
with CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from tfs_kernels.dispatch import interpreter_active
from tfs_kernels.rope_store import rope_store_kv, rope_store_kv_reference
from tests.kernel_checks import run_opcheck_without_interpreter
from tests.interpreted_runner import interpreted_subprocess

INTERPRETED = interpreter_active()
interpreted = pytest.mark.skipif(not INTERPRETED, reason="interpreter tests: run by the TRITON_INTERPRET=1 subprocess")
SHAPES = [(4, 2, 16), (6, 3, 24), (8, 8, 32)]  # (heads, kv_heads, head_dim): GQA, half head_dim 12 (odd block), MHA


def rope_args(n: int, heads: int, kv_heads: int, dim: int, device: str, dtype: torch.dtype, seed: int,
              cache_dtype: torch.dtype | None = None) -> tuple:
    """Arguments of ``tfs::rope_store_kv``: qkv a column slice of a wider tensor (like a view of a larger
    projection), cos / sin tables of real RoPE angles (slices of one ``[max_pos, head_dim]`` table: row stride
    head_dim) read at n random positions (repeats allowed), and n slots scattered through a pool three times as
    large whose contents are stale noise."""
    gen = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(n, width + 8, generator=gen)[:, 3:3 + width]
    max_pos = 8192
    positions = torch.randint(0, max_pos, (n,), generator=gen)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, dim, 2).float() / dim)
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)  # [max_pos, dim // 2]
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_pos, dim]
    num_slots = 3 * n + 5
    k_cache = torch.randn(num_slots, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_slots, kv_heads, dim, generator=gen)
    slots = torch.randperm(num_slots, generator=gen)[:n]
    cache_dtype = cache_dtype or dtype
    qkv = qkv.to(device, dtype)  # keeps the column-slice strides
    return (qkv, table[:, : dim // 2].to(device), table[:, dim // 2:].to(device), positions.to(device),
            k_cache.to(device, cache_dtype), v_cache.to(device, cache_dtype), slots.to(device), heads, kv_heads, dim)


def check(args: tuple, tol: float) -> None:
    """Kernel vs reference on copies of the same caches: q, the written slots, and every other slot unchanged."""
    qkv, cos, sin, pos, k_cache, v_cache, slots, heads, kv_heads, dim = args
    stale_k, stale_v = k_cache.clone(), v_cache.clone()
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    q = rope_store_kv(*args)
    ref_q = rope_store_kv_reference(qkv, cos, sin, pos, ref_k, ref_v, slots, heads, kv_heads, dim)
    n = qkv.shape[0]
    assert q.shape == (n, heads, dim) and q.dtype == qkv.dtype and q.is_contiguous()
    torch.testing.assert_close(q.float(), ref_q.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(k_cache.float(), ref_k.float(), atol=tol, rtol=tol)
    assert torch.equal(v_cache, ref_v)  # v is a copy (and a cast): exact
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool, device=k_cache.device)
    untouched[slots] = False
    assert torch.equal(k_cache[untouched], stale_k[untouched]) and torch.equal(v_cache[untouched], stale_v[untouched])


def test_reference_is_the_models_unfused_code() -> None:
    """The reference computes what the unfused layer does: ``apply_rope`` on q and k, then ``store_kv``."""
    from framework.models.llama import apply_rope
    from tfs_kernels.store_kv import store_kv_reference

    for dtype, cache_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                               (torch.bfloat16, torch.float16)):
        qkv, cos, sin, pos, k_cache, v_cache, slots, heads, kv_heads, dim = rope_args(7, 6, 2, 32, "cpu", dtype, 1,
                                                                                  cache_dtype)
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        q = rope_store_kv_reference(qkv, cos, sin, pos, ref_k, ref_v, slots, heads, kv_heads, dim)
        q_part, k_part, v_part = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        expected_q = apply_rope(q_part.view(7, heads, dim), cos[pos][:, None], sin[pos][:, None])
        k = apply_rope(k_part.view(7, kv_heads, dim), cos[pos][:, None], sin[pos][:, None])
        store_kv_reference(k_cache, v_cache, slots, k, v_part.view(7, kv_heads, dim))
        assert torch.equal(q, expected_q) and torch.equal(ref_k, k_cache) and torch.equal(ref_v, v_cache)


# ---- CPU: Triton interpreter --------------------------------------------------------------------------------------
@interpreted
@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
def test_rope_store_kv_interpreted(heads: int, kv_heads: int, dim: int, n: int) -> None:
    check(rope_args(n, heads, kv_heads, dim, "cpu", torch.float32, seed=n * 100 + dim), tol=1e-6)


@interpreted
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float16, torch.float16), (torch.float16, torch.float32),
                                               (torch.float32, torch.float16)])
def test_rope_store_kv_half_precision_interpreted(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """float16 (the interpreter rounds float32 to bfloat16 toward zero, so bf16 is for the GPU tests): roped k is
    rounded to qkv's dtype before the cast to the cache's (float16 qkv into a float32 cache shows the order)."""
    check(rope_args(9, 4, 2, 16, "cpu", dtype, seed=4, cache_dtype=cache_dtype), tol=0)


@interpreted
def test_rope_store_kv_many_tokens_interpreted() -> None:
    check(rope_args(37, 4, 1, 16, "cpu", torch.float32, seed=3), tol=1e-6)


@interpreted
def test_input_checks_interpreted() -> None:
    """The op refuses mismatched shapes with one line each."""
    qkv, cos, sin, pos, k_cache, v_cache, slots, heads, kv_heads, dim = rope_args(3, 4, 2, 16, "cpu", torch.float32, 0)
    op = torch.ops.tfs.rope_store_kv
    with pytest.raises(RuntimeError, match="qkv"):
        op(qkv, cos, sin, pos, k_cache, v_cache, slots, heads, 1, dim)
    with pytest.raises(RuntimeError, match="cos"):
        op(qkv, cos[:, :3], sin, pos, k_cache, v_cache, slots, heads, kv_heads, dim)
    with pytest.raises(RuntimeError, match="sin"):
        op(qkv, cos, torch.cat([sin, sin], 1), pos, k_cache, v_cache, slots, heads, kv_heads, dim)
    with pytest.raises(RuntimeError, match="positions"):
        op(qkv, cos, sin, pos[:2], k_cache, v_cache, slots, heads, kv_heads, dim)
    with pytest.raises(RuntimeError, match="v_cache"):
        op(qkv, cos, sin, pos, k_cache, v_cache[:, :1], slots, heads, kv_heads, dim)
    with pytest.raises(RuntimeError, match="slots"):
        op(qkv, cos, sin, pos, k_cache, v_cache, slots[:2], heads, kv_heads, dim)


@interpreted
def test_opcheck_interpreted() -> None:
    for heads, kv_heads, dim in SHAPES[:2]:
        torch.library.opcheck(torch.ops.tfs.rope_store_kv, rope_args(3, heads, kv_heads, dim, "cpu", torch.float32, 0),
                              test_utils=("test_schema", "test_autograd_registration"))


def test_opcheck_reference_and_fake_kernel() -> None:
    """Without the interpreter the CPU kernel is the reference and the fake kernel is the triton_op body: opcheck
    compares them (shapes, dtypes, strides, the schema's mutation claims)."""
    run_opcheck_without_interpreter(
        "from tests.test_kernels_rope_store import rope_args, SHAPES\n"
        "cases = [(torch.ops.tfs.rope_store_kv, rope_args(n, h, kvh, d, 'cpu', torch.float32, 0))\n"
        "         for h, kvh, d in SHAPES for n in (1, 5)]\n")


def test_compiled_cpu_code_runs_the_reference() -> None:
    """torch.compile on the CPU traces the reference (tracing into the triton_op body would need a GPU driver)."""
    args = rope_args(5, 4, 2, 16, "cpu", torch.float32, 2)
    caches = args[4].clone(), args[5].clone()
    fn = torch.compile(lambda qkv, cos, sin, pos, kc, vc, slots: rope_store_kv(qkv, cos, sin, pos, kc, vc, slots, 4, 2,
                                                                               16) * 2, fullgraph=True)
    out = fn(*args[:4], *caches, args[6])
    torch.testing.assert_close(out, 2 * rope_store_kv_reference(*args), atol=1e-6, rtol=1e-6)
    assert torch.equal(caches[0], args[4]) and torch.equal(caches[1], args[5])


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(), reason="the interpreted tests run in this process")
@interpreted_subprocess("-k", "interpreted and not subprocess")
def test_interpreted_rope_store_in_a_subprocess() -> None:
    """This file's interpreted tests, in a ``TRITON_INTERPRET=1`` subprocess (tests/interpreted_runner.py)."""


# ---- GPU ----------------------------------------------------------------------------------------------------------
# NOTE: not exact on the GPU: the compiler contracts ``a * c - b * s`` into an FMA (one rounding, torch rounds the
# product first), so a float32 result can differ in its last bit and the bf16 rounding of it by one bf16 ulp
# (2^-8 relative): 1e-2 relative covers one ulp. The v cache is a copy and stays exact.
@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8, 300])
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (9, 3, 64)])  # Llama-3-8B, SmolLM2-135M
def test_rope_store_kv_gpu(heads: int, kv_heads: int, dim: int, n: int) -> None:
    check(rope_args(n, heads, kv_heads, dim, "cuda", torch.bfloat16, seed=n), tol=1e-2)


@pytest.mark.gpu
def test_rope_store_kv_gpu_float32_and_opcheck() -> None:
    check(rope_args(300, 32, 8, 128, "cuda", torch.float32, seed=9), tol=1e-5)
    check(rope_args(8, 6, 3, 24, "cuda", torch.float32, seed=10), tol=1e-5)  # masked (non-power-of-two) half
    for n in (1, 8, 300):
        torch.library.opcheck(torch.ops.tfs.rope_store_kv, rope_args(n, 32, 8, 128, "cuda", torch.bfloat16, n))


@pytest.mark.gpu
def test_rope_store_kv_gpu_compiled_with_cuda_graphs() -> None:
    args = rope_args(8, 32, 8, 128, "cuda", torch.bfloat16, 5)
    qkv, cos, sin, pos, k_cache, v_cache, slots, heads, kv_heads, dim = args
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_q = rope_store_kv_reference(qkv, cos, sin, pos, ref_k, ref_v, slots, heads, kv_heads, dim)
    fn = torch.compile(lambda qkv, cos, sin, pos, kc, vc, slots: rope_store_kv(qkv, cos, sin, pos, kc, vc, slots,
                                                                               heads, kv_heads, dim) * 2,
                       mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        out = fn(qkv, cos, sin, pos, k_cache, v_cache, slots)
    torch.testing.assert_close(out.float(), 2 * ref_q.float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(k_cache.float(), ref_k.float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(v_cache, ref_v)
