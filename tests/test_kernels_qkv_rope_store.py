"""``tfs::qkv_rope_store`` (tfs_kernels/qkv_rope_store.py): the qkv projection, RoPE and the K/V store in one kernel
give what ``tfs::gemv`` followed by ``tfs::rope_store_kv`` give, and what their plain-torch references give.

CPU: the Triton interpreter (in a ``TRITON_INTERPRET=1`` subprocess under a plain ``pytest``), small shapes, one
and several rows, with and without the RMSNorm. GPU (``pytest -m gpu``): Llama-3-8B and SmolLM2 shapes in bf16,
its PDL variant, ``torch.library.opcheck``.
"""

from __future__ import annotations

import pytest
import torch

from tfs_kernels.dispatch import interpreter_active
from tfs_kernels.gemv import gemv
from tfs_kernels.qkv_rope_store import qkv_rope_store, qkv_rope_store_applies, qkv_rope_store_reference
from tfs_kernels.rope_store import rope_store_kv
from tests.kernel_checks import run_opcheck_without_interpreter
from tests.interpreted_runner import interpreted_subprocess
from tests.test_kernels_rope_store import rope_args

INTERPRETED = interpreter_active()
interpreted = pytest.mark.skipif(not INTERPRETED, reason="interpreter tests: run by the TRITON_INTERPRET=1 subprocess")


def fused_args(rows: int, heads: int, kv_heads: int, dim: int, hidden: int, norm: bool, device: str,
               dtype: torch.dtype, seed: int) -> tuple:
    """Arguments of ``tfs::qkv_rope_store``: x, the projection's weight, the norm's weight (or None), a large eps,
    then the rope tables, positions, stale caches, slots and head counts of :func:`rope_args`."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).to(device, dtype)
    w = (torch.randn((heads + 2 * kv_heads) * dim, hidden, generator=gen) / hidden ** 0.5).to(device, dtype)
    nw = (torch.rand(hidden, generator=gen) + 0.5).to(device, dtype) if norm else None
    _, cos, sin, pos, k_cache, v_cache, slots, *heads_args = rope_args(rows, heads, kv_heads, dim, device, dtype,
                                                                        seed)
    return (x, w, nw, 0.1, cos, sin, pos, k_cache, v_cache, slots, *heads_args)


def check(args: tuple, tol: float) -> None:
    """The fused kernel against (a) gemv + rope_store_kv, the two kernels it replaces: q and k within ``tol`` (the
    same roundings; a compiler may contract the rotation differently), v exact; (b) the plain-torch reference."""
    x, w, nw, eps, cos, sin, pos, k_cache, v_cache, slots, heads, kv_heads, dim = args
    assert qkv_rope_store_applies(x, w, dim)  # the kernel runs, not the reference
    two_k, two_v, ref_k, ref_v = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    q = qkv_rope_store(*args)
    two_q = rope_store_kv(gemv(x, w, norm_weight=nw, eps=eps), cos, sin, pos, two_k, two_v, slots, heads, kv_heads,
                          dim)
    assert q.shape == (x.shape[0], heads, dim) and q.dtype == w.dtype and q.is_contiguous()
    torch.testing.assert_close(q.float(), two_q.float(), atol=tol / 4, rtol=tol / 4)
    torch.testing.assert_close(k_cache.float(), two_k.float(), atol=tol / 4, rtol=tol / 4)
    assert torch.equal(v_cache, two_v)
    ref_q = qkv_rope_store_reference(x, w, nw, eps, cos, sin, pos, ref_k, ref_v, slots, heads, kv_heads, dim)
    torch.testing.assert_close(q.float(), ref_q.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(k_cache.float(), ref_k.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(v_cache.float(), ref_v.float(), atol=tol, rtol=tol)


@interpreted
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("rows,rows_dot", [(1, True), (3, True), (3, False)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (2, 1, 32)])
def test_qkv_rope_store_interpreted(heads: int, kv_heads: int, dim: int, rows: int, rows_dot: bool, norm: bool,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``rows_dot``: several rows on the 16-row tl.dot tile, else on the CUDA cores (tfs_kernels/gemv.py ROWS_DOT)."""
    import tfs_kernels.gemv

    monkeypatch.setattr(tfs_kernels.gemv, "ROWS_DOT", rows_dot)
    check(fused_args(rows, heads, kv_heads, dim, 48, norm, "cpu", torch.float32, seed=rows), tol=1e-4)


@interpreted
def test_opcheck_interpreted() -> None:
    torch.library.opcheck(torch.ops.tfs.qkv_rope_store, fused_args(2, 4, 2, 16, 32, True, "cpu", torch.float32, 0),
                          test_utils=("test_schema", "test_autograd_registration"))


def test_opcheck_reference_and_fake_kernel() -> None:
    """Without the interpreter the CPU kernel is the reference and the fake kernel is the triton_op body."""
    run_opcheck_without_interpreter(
        "from tests.test_kernels_qkv_rope_store import fused_args\n"
        "cases = [(torch.ops.tfs.qkv_rope_store, fused_args(n, 4, 2, 16, 32, norm, 'cpu', torch.float32, 0))\n"
        "         for n in (1, 5) for norm in (True, False)]\n")


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(), reason="the interpreted tests run in this process")
@interpreted_subprocess("-k", "interpreted and not subprocess")
def test_interpreted_qkv_rope_store_in_a_subprocess() -> None:
    """This file's interpreted tests, in a ``TRITON_INTERPRET=1`` subprocess (tests/interpreted_runner.py)."""


# ---- GPU ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("rows,rows_dot", [(1, True), (4, True), (5, False)])
@pytest.mark.parametrize("heads,kv_heads,dim,hidden", [(32, 8, 128, 4096), (9, 3, 64, 576)])
def test_qkv_rope_store_gpu(heads: int, kv_heads: int, dim: int, hidden: int, rows: int, rows_dot: bool,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    import tfs_kernels.gemv

    monkeypatch.setattr(tfs_kernels.gemv, "ROWS_DOT", rows_dot)
    args = fused_args(rows, heads, kv_heads, dim, hidden, True, "cuda", torch.bfloat16, seed=rows)
    check(args, tol=4e-2)
    torch.library.opcheck(torch.ops.tfs.qkv_rope_store, args)


@pytest.mark.gpu
def test_qkv_rope_store_pdl_gpu() -> None:
    from tfs_kernels.pdl import pdl_supported

    if not pdl_supported(torch.device("cuda")):
        pytest.skip("PDL needs compute capability >= 9.0")
    args = fused_args(1, 32, 8, 128, 4096, True, "cuda", torch.bfloat16, seed=3)
    assert qkv_rope_store_applies(args[0], args[1], 128)
    caches = args[7].clone(), args[8].clone()
    q = qkv_rope_store(*args, pdl=True)
    pdl_caches = args[7].clone(), args[8].clone()
    args[7].copy_(caches[0])
    args[8].copy_(caches[1])
    assert torch.equal(q, qkv_rope_store(*args))
    assert torch.equal(pdl_caches[0], args[7]) and torch.equal(pdl_caches[1], args[8])
    torch.library.opcheck(torch.ops.tfs.qkv_rope_store_pdl, args)
