"""``tfs::det_qkv_rope_store`` (tfs_kernels/det_qkv_rope_store.py): the qkv projection through ``tfs::det_matmul``'s
main loop with RoPE and the K/V store as its epilogue gives what ``tfs::det_matmul`` followed by
``tfs::rope_store_kv`` give, and what their plain-torch references give.

CPU: the Triton interpreter (in a ``TRITON_INTERPRET=1`` subprocess under a plain ``pytest``), small shapes, one
to 17 rows (two row tiles), with and without the RMSNorm. GPU (``pytest -m gpu``): Llama-3-8B and SmolLM2 shapes in
bf16, its PDL variant, ``torch.library.opcheck``.
"""

from __future__ import annotations

import pytest
import torch

from tfs_kernels.det_matmul import det_matmul
from tfs_kernels.det_qkv_rope_store import (det_qkv_rope_store, det_qkv_rope_store_applies,
                                            det_qkv_rope_store_reference)
from tfs_kernels.dispatch import interpreter_active
from tfs_kernels.rope_store import rope_store_kv
from tests.interpreted_runner import interpreted_subprocess
from tests.kernel_checks import run_opcheck_without_interpreter
from tests.test_kernels_qkv_rope_store import fused_args

INTERPRETED = interpreter_active()
interpreted = pytest.mark.skipif(not INTERPRETED, reason="interpreter tests: run by the TRITON_INTERPRET=1 subprocess")


def check(args: tuple, tol: float) -> None:
    """The fused kernel against (a) det_matmul + rope_store_kv, the two kernels it replaces: the same q and k up
    to the rotation's contraction (``tol / 4``), v exact; (b) the plain-torch reference; slots not written keep
    their contents."""
    x, w, nw, eps, cos, sin, pos, k_cache, v_cache, slots, heads, kv_heads, dim = args
    assert det_qkv_rope_store_applies(x, w, dim)  # the kernel runs, not the reference
    two_k, two_v, ref_k, ref_v = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    q = det_qkv_rope_store(*args)
    two_q = rope_store_kv(det_matmul(x, w, norm_weight=nw, eps=eps), cos, sin, pos, two_k, two_v, slots, heads,
                          kv_heads, dim)
    assert q.shape == (x.shape[0], heads, dim) and q.dtype == w.dtype and q.is_contiguous()
    torch.testing.assert_close(q.float(), two_q.float(), atol=tol / 4, rtol=tol / 4)
    torch.testing.assert_close(k_cache.float(), two_k.float(), atol=tol / 4, rtol=tol / 4)
    assert torch.equal(v_cache, two_v)
    ref_q = det_qkv_rope_store_reference(x, w, nw, eps, cos, sin, pos, ref_k, ref_v, slots, heads, kv_heads, dim)
    torch.testing.assert_close(q.float(), ref_q.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(k_cache.float(), ref_k.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(v_cache.float(), ref_v.float(), atol=tol, rtol=tol)


@interpreted
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (2, 1, 32)])
def test_det_qkv_rope_store_interpreted(heads: int, kv_heads: int, dim: int, rows: int, norm: bool) -> None:
    check(fused_args(rows, heads, kv_heads, dim, 48, norm, "cpu", torch.float32, seed=rows), tol=1e-4)


@interpreted
def test_det_matmuls_norm_order_is_followed_interpreted(monkeypatch) -> None:
    """``det_matmul.LATE_NORM=False`` (the RMSNorm pass before the weight loop): the fused kernel sums as
    ``tfs::det_matmul`` then does (v, stored unrotated, the same bits)."""
    import tfs_kernels.det_matmul as det_matmul_module

    monkeypatch.setattr(det_matmul_module, "LATE_NORM", False)
    check(fused_args(3, 4, 2, 16, 48, True, "cpu", torch.float32, seed=11), tol=1e-4)


@interpreted
def test_a_row_is_the_same_bits_at_any_row_count_interpreted() -> None:
    """As ``tfs::det_matmul``'s: a token's q, k and v do not depend on the other rows of the call."""
    args = fused_args(9, 4, 2, 16, 48, True, "cpu", torch.float32, seed=5)
    x, w, nw, eps, cos, sin, pos, k_cache, v_cache, slots, *heads = args
    q = det_qkv_rope_store(*args)
    k_all = k_cache.clone()
    for r in (0, 4, 8):
        k_one = k_cache.clone()
        q_one = det_qkv_rope_store(x[r:r + 1], w, nw, eps, cos, sin, pos[r:r + 1], k_one, v_cache.clone(),
                                   slots[r:r + 1], *heads)
        assert torch.equal(q_one[0], q[r]) and torch.equal(k_one[slots[r]], k_all[slots[r]])


@interpreted
def test_forced_several_row_layers_with_the_fused_projection_give_the_same_tokens_interpreted(monkeypatch) -> None:
    """The model's several-row layers (``det``, as ``DET_MAX_ROWS`` runs them compiled on CUDA; forced here for
    every forward of 2-8 rows) with ``DET_QKV_ROPE_STORE``: attention=triton's ``forward_projection(det=True)``
    writes the K/V that later steps read, and greedy output is the unfused layers' token for token."""
    import framework.models.llama as llama
    import tfs_kernels.det_qkv_rope_store as fused_module
    from framework import LLM
    from tests.conftest import TINY
    from tests.test_engine import PROMPTS

    real_layers, real_fused, calls = llama.run_layers, fused_module.det_qkv_rope_store, []

    def forced(layers, x, rope, meta, fused, pdl, regional, det=False):
        return real_layers(layers, x, rope, meta, fused, pdl, regional, det or 1 < x.shape[0] <= 8)

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real_fused(*args, **kwargs)

    monkeypatch.setattr(llama, "run_layers", forced)
    monkeypatch.setattr(fused_module, "det_qkv_rope_store", counted)
    requests = [{"prompt": p, "max_tokens": 4} for p in PROMPTS[:3]]
    tokens, called = {}, {}
    for on in (False, True):
        monkeypatch.setattr(llama, "DET_QKV_ROPE_STORE", on)
        llm = LLM(TINY + ["attention=triton", "scheduler.max_running_requests=4"])
        tokens[on] = [o.token_ids for o in llm.generate(requests)]
        llm.engine.allocator.assert_all_free()
        called[on], calls[:] = list(calls), []
    assert not called[False] and called[True] and all(1 < n <= 8 for n in called[True])  # several rows only
    assert tokens[True] == tokens[False]


@interpreted
def test_opcheck_interpreted() -> None:
    torch.library.opcheck(torch.ops.tfs.det_qkv_rope_store,
                          fused_args(2, 4, 2, 16, 32, True, "cpu", torch.float32, 0),
                          test_utils=("test_schema", "test_autograd_registration"))


def test_opcheck_reference_and_fake_kernel() -> None:
    """Without the interpreter the CPU kernel is the reference and the fake kernel is the triton_op body."""
    run_opcheck_without_interpreter(
        "from tests.test_kernels_qkv_rope_store import fused_args\n"
        "import tfs_kernels.det_qkv_rope_store\n"
        "cases = [(torch.ops.tfs.det_qkv_rope_store, fused_args(n, 4, 2, 16, 32, norm, 'cpu', torch.float32, 0))\n"
        "         for n in (1, 5) for norm in (True, False)]\n")


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(), reason="the interpreted tests run in this process")
@interpreted_subprocess("-k", "interpreted and not subprocess")
def test_interpreted_det_qkv_rope_store_in_a_subprocess() -> None:
    """This file's interpreted tests, in a ``TRITON_INTERPRET=1`` subprocess (tests/interpreted_runner.py)."""


# ---- GPU ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 5, 8, 17])
@pytest.mark.parametrize("heads,kv_heads,dim,hidden", [(32, 8, 128, 4096), (9, 3, 64, 576)])
def test_det_qkv_rope_store_gpu(heads: int, kv_heads: int, dim: int, hidden: int, rows: int) -> None:
    args = fused_args(rows, heads, kv_heads, dim, hidden, True, "cuda", torch.bfloat16, seed=rows)
    check(args, tol=4e-2)
    torch.library.opcheck(torch.ops.tfs.det_qkv_rope_store, args)


@pytest.mark.gpu
def test_det_qkv_rope_store_pdl_gpu() -> None:
    from tfs_kernels.pdl import pdl_supported

    if not pdl_supported(torch.device("cuda")):
        pytest.skip("PDL needs compute capability >= 9.0")
    args = fused_args(5, 9, 3, 64, 576, True, "cuda", torch.bfloat16, seed=3)
    caches = args[7].clone(), args[8].clone()
    q = det_qkv_rope_store(*args, pdl=True)
    pdl_caches = args[7].clone(), args[8].clone()
    args[7].copy_(caches[0])
    args[8].copy_(caches[1])
    assert torch.equal(q, det_qkv_rope_store(*args))
    assert torch.equal(pdl_caches[0], args[7]) and torch.equal(pdl_caches[1], args[8])
    torch.library.opcheck(torch.ops.tfs.det_qkv_rope_store_pdl, args)
