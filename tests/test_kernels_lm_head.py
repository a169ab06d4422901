"""``tfs::lm_head`` (tfs_kernels/lm_head.py): the final RMSNorm, the lm_head and the float32 logits of every row in one
kernel give what the unfused tail gives (``RMSNorm.forward``, ``tfs::gemv``, ``.float()``) and what the plain-torch
reference gives.

CPU: the Triton interpreter (in a ``TRITON_INTERPRET=1`` subprocess under a plain ``pytest``), small fp32 shapes:
one row (the RMSNorm after the product), several rows, a hidden size that is not a multiple of the tile. GPU
(``pytest -m gpu``): Llama-3-8B's lm_head in bf16 at 1 and 8 rows, its PDL variant, ``torch.library.opcheck``.
"""

from __future__ import annotations

import pytest
import torch

from tfs_kernels.dispatch import interpreter_active
from tfs_kernels.gemv import gemv
from tfs_kernels.lm_head import lm_head, lm_head_applies, lm_head_reference
from tests.kernel_checks import run_opcheck_without_interpreter
from tests.interpreted_runner import interpreted_subprocess

INTERPRETED = interpreter_active()
interpreted = pytest.mark.skipif(not INTERPRETED, reason="interpreter tests: run by the TRITON_INTERPRET=1 subprocess")


def lm_head_args(rows: int, vocab: int, hidden: int, device: str, dtype: torch.dtype, seed: int) -> tuple:
    """(x, norm_weight, eps, w); eps is large enough that dropping it shows."""
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, hidden, generator=gen)).to(device, dtype)
    nw = (torch.rand(hidden, generator=gen) + 0.5).to(device, dtype)
    w = (torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5).to(device, dtype)
    return x, nw, 0.1, w


def check(args: tuple, tol: float) -> None:
    """The kernel against (a) the unfused tail (hidden within a last-bit difference: the sum of squares runs in
    another order; logits within ``tol``) and (b) the reference."""
    x, nw, eps, w = args
    assert lm_head_applies(x, w)  # the kernel runs, not the reference
    logits, hidden = lm_head(*args)
    assert logits.shape == (x.shape[0], w.shape[0]) and logits.dtype == torch.float32
    assert hidden.shape == x.shape and hidden.dtype == x.dtype
    xf = x.float()
    unfused_hidden = nw * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    unfused = gemv(unfused_hidden, w).float()
    torch.testing.assert_close(hidden.float(), unfused_hidden.float(), atol=tol / 8, rtol=tol / 8)
    torch.testing.assert_close(logits, unfused, atol=tol, rtol=tol)
    ref_logits, ref_hidden = lm_head_reference(*args)
    torch.testing.assert_close(logits, ref_logits, atol=tol, rtol=tol)
    torch.testing.assert_close(hidden, ref_hidden, atol=tol / 8, rtol=tol / 8)
    # the logits are float32 copies of values of w's dtype, as .float() of the unfused product has them
    assert torch.equal(logits, logits.to(w.dtype).float())


@interpreted
@pytest.mark.parametrize("rows,rows_dot", [(1, True), (3, True), (5, True), (3, False), (5, False)])
@pytest.mark.parametrize("hidden", [48, 96])
def test_lm_head_interpreted(rows: int, rows_dot: bool, hidden: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``rows_dot``: several rows on the 16-row tl.dot tile, else on the CUDA cores (tfs_kernels/gemv.py ROWS_DOT)."""
    import tfs_kernels.gemv

    monkeypatch.setattr(tfs_kernels.gemv, "ROWS_DOT", rows_dot)
    check(lm_head_args(rows, 200, hidden, "cpu", torch.float32, seed=rows + hidden), tol=1e-4)


@interpreted
def test_opcheck_interpreted() -> None:
    torch.library.opcheck(torch.ops.tfs.lm_head, lm_head_args(2, 160, 32, "cpu", torch.float32, 0),
                          test_utils=("test_schema", "test_autograd_registration"))


def test_reference_outside_the_kernel_limits() -> None:
    """More rows than the kernel serves, or a vocabulary too small for a program per hidden row: the reference."""
    many = lm_head_args(17, 400, 16, "cpu", torch.float32, 0)
    small_vocab = lm_head_args(4, 40, 16, "cpu", torch.float32, 0)
    for args in (many, small_vocab):
        assert not lm_head_applies(args[0], args[3])
        for got, want in zip(lm_head(*args), lm_head_reference(*args)):
            assert torch.equal(got, want)


def test_opcheck_reference_and_fake_kernel() -> None:
    """Without the interpreter the CPU kernel is the reference and the fake kernel is the triton_op body."""
    run_opcheck_without_interpreter(
        "from tests.test_kernels_lm_head import lm_head_args\n"
        "cases = [(torch.ops.tfs.lm_head, lm_head_args(n, 160, 32, 'cpu', torch.float32, 0)) for n in (1, 4)]\n")


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(), reason="the interpreted tests run in this process")
@interpreted_subprocess("-k", "interpreted and not subprocess")
def test_interpreted_lm_head_in_a_subprocess() -> None:
    """This file's interpreted tests, in a ``TRITON_INTERPRET=1`` subprocess (tests/interpreted_runner.py)."""


# ---- GPU ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("rows,rows_dot", [(1, True), (8, True), (5, False)])
def test_lm_head_gpu(rows: int, rows_dot: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import tfs_kernels.gemv

    monkeypatch.setattr(tfs_kernels.gemv, "ROWS_DOT", rows_dot)
    args = lm_head_args(rows, 128256, 4096, "cuda", torch.bfloat16, seed=rows)
    check(args, tol=4e-2)
    torch.library.opcheck(torch.ops.tfs.lm_head, lm_head_args(2, 1000, 576, "cuda", torch.bfloat16, 1))


@pytest.mark.gpu
def test_lm_head_pdl_gpu() -> None:
    from tfs_kernels.pdl import pdl_supported

    if not pdl_supported(torch.device("cuda")):
        pytest.skip("PDL needs compute capability >= 9.0")
    args = lm_head_args(1, 128256, 4096, "cuda", torch.bfloat16, seed=3)
    for got, want in zip(lm_head(*args, pdl=True), lm_head(*args)):
        assert torch.equal(got, want)
    torch.library.opcheck(torch.ops.tfs.lm_head_pdl, args)
