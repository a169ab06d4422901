"""``tfs::gemv`` (tfs_kernels/gemv.py) against its plain-torch reference on fresh random inputs, with every fusion.

CPU: the Triton interpreter (in a ``TRITON_INTERPRET=1`` subprocess under a plain ``pytest``), small fp32 shapes,
including a K that is not a multiple of the tile. GPU (``pytest -m gpu``): Llama-3-8B's linear shapes in bf16 at
1 and 8 rows, inside ``torch.compile`` with CUDA graphs, ``torch.library.opcheck``, and a whole model whose fused
decode path gives the same greedy tokens as the unfused one.
"""

from __future__ import annotations

import pytest
import torch

from tfs_kernels.dispatch import interpreter_active
from tfs_kernels.gemv import gemv, gemv_reference
from tests.kernel_checks import run_opcheck_without_interpreter
from tests.interpreted_runner import interpreted_subprocess

INTERPRETED = interpreter_active()
interpreted = pytest.mark.skipif(not INTERPRETED, reason="interpreter tests: run by the TRITON_INTERPRET=1 subprocess")
FUSIONS = ["plain", "norm", "silu_mul", "residual", "silu_mul+residual", "norm+residual"]


def gemv_args(rows: int, n: int, k: int, fusion: str, device: str, dtype: torch.dtype, seed: int) -> tuple:
    """Arguments of ``tfs::gemv``; the residual is a column slice of a wider tensor (a row stride other than n), and
    eps is large enough that dropping it shows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * k if "silu_mul" in fusion else k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    residual = torch.randn(rows, n + 8, generator=gen)[:, :n] if "residual" in fusion else None
    norm_weight = torch.rand(k, generator=gen) + 0.5 if "norm" in fusion else None
    put = lambda t: None if t is None else t.to(device, dtype)  # noqa: E731
    return put(x), put(w), put(residual), put(norm_weight), 0.1, "silu_mul" in fusion


def check(rows: int, n: int, k: int, fusion: str, device: str, dtype: torch.dtype, tol: float, seed: int) -> None:
    args = gemv_args(rows, n, k, fusion, device, dtype, seed)
    out = torch.ops.tfs.gemv(*args)
    ref = gemv_reference(*args)
    assert out.shape == ref.shape == (rows, n) and out.dtype == args[1].dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@interpreted
@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("rows,n,k", [(1, 40, 96), (3, 32, 128), (16, 24, 64)])
def test_gemv_interpreted(rows: int, n: int, k: int, fusion: str) -> None:
    check(rows, n, k, fusion, "cpu", torch.float32, 1e-4, seed=rows * 100 + n + k)


@interpreted
@pytest.mark.parametrize("fusion", ["norm", "norm+residual"])
def test_gemv_one_row_norm_first_interpreted(fusion: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One row's RMSNorm as a pass over x before the product (``LATE_NORM`` off), the path the tuner compares."""
    import tfs_kernels.gemv

    monkeypatch.setattr(tfs_kernels.gemv, "LATE_NORM", False)
    check(1, 40, 96, fusion, "cpu", torch.float32, 1e-4, seed=7)


@interpreted
@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("rows", [2, 5])
def test_gemv_several_rows_on_cuda_cores_interpreted(rows: int, fusion: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several rows with ``ROWS_DOT`` off: a tile of the next power of two rows on the CUDA cores, the RMSNorm after
    the product."""
    import tfs_kernels.gemv

    monkeypatch.setattr(tfs_kernels.gemv, "ROWS_DOT", False)
    check(rows, 40, 96, fusion, "cpu", torch.float32, 1e-4, seed=rows)


class _StubAttention:
    """Stands in for an attention backend: a fixed function of q, k, v (``[n, heads * dim]``, like a backend)."""

    def forward_projection(self, x, w_qkv, norm_weight, eps, rope, layer_id, meta):
        return None  # not fused: the layer projects with tfs::gemv and calls forward_qkv

    def forward_qkv(self, qkv, rope, layer_id, meta):
        return None  # not fused: the layer applies RoPE and calls forward

    def forward(self, q, k, v, layer_id, meta):
        group = q.shape[1] // k.shape[1]
        return (q + (k * v).repeat_interleave(group, dim=1)).flatten(1)


@interpreted
@pytest.mark.parametrize("rows", [1, 5])
def test_fused_decoder_layer_equals_unfused_interpreted(rows: int) -> None:
    """DecoderLayer.forward(fused=True) (four tfs::gemv calls with norm / SiLU-mul / residual folded in) computes
    what the unfused layer computes, on a tiny Llama layer with GQA."""
    from framework.models.llama import DecoderLayer, LlamaArgs
    from tfs_kernels.rope_store import rope_at

    torch.manual_seed(rows)
    args = LlamaArgs(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=96,
                     vocab_size=32)
    layer = DecoderLayer(args, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 2 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
    layer.self_attn.backend = _StubAttention()
    x = torch.randn(rows, 64)
    angles = torch.rand(40, 8) * 3  # a rope table [max_pos, head_dim // 2]
    rope = rope_at(angles.cos(), angles.sin(), torch.randint(0, 40, (rows,)))
    with torch.no_grad():
        fused = layer(x, rope, None, fused=True)
        unfused = layer(x, rope, None)
    torch.testing.assert_close(fused, unfused, atol=1e-4, rtol=1e-4)


@interpreted
def test_opcheck_interpreted() -> None:
    for fusion in ("plain", "norm+residual", "silu_mul"):
        torch.library.opcheck(torch.ops.tfs.gemv, gemv_args(2, 16, 64, fusion, "cpu", torch.float32, 0),
                              test_utils=("test_schema", "test_autograd_registration"))


def test_opcheck_reference_and_fake_kernel() -> None:
    """Without the interpreter the CPU kernel is the reference and the fake kernel is the triton_op body: opcheck
    compares them (shapes, dtypes, strides). (The dynamic-shape trace needs a GPU driver: the GPU test runs it.)"""
    run_opcheck_without_interpreter(
        "from tests.test_kernels_gemv import gemv_args\n"
        "cases = [(torch.ops.tfs.gemv, gemv_args(rows, n, k, fusion, 'cpu', torch.float32, 0))\n"
        "         for fusion in ('plain', 'norm+residual', 'silu_mul+residual')\n"
        "         for rows, n, k in ((2, 256, 512), (1, 64, 64))]\n")


@interpreted
@pytest.mark.parametrize("rows", [16, 17, 40])
def test_row_limit_and_fallback_interpreted(rows: int) -> None:
    """Up to 16 rows gemv runs the kernel, above it the reference (the unfused torch code); the op itself refuses
    more than 16 rows, and silu_mul with norm_weight, with one line."""
    x, w, residual, norm_weight, eps, _ = gemv_args(rows, 24, 64, "norm+residual", "cpu", torch.float32, 1)
    unfused = residual + torch.nn.functional.linear(
        norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)), w)
    torch.testing.assert_close(gemv(x, w, residual, norm_weight, eps), unfused, atol=1e-4, rtol=1e-4)
    if rows > 16:
        with pytest.raises(RuntimeError, match="at most 16 rows"):
            torch.ops.tfs.gemv(x, w, residual, norm_weight, eps, False)
    with pytest.raises(ValueError, match="silu_mul and norm_weight"):
        gemv(x, w, norm_weight=norm_weight, silu_mul=True)
    with pytest.raises(RuntimeError, match="silu_mul with norm_weight"):
        torch.ops.tfs.gemv(torch.cat([x, x], 1)[:16], w, None, norm_weight, eps, True)


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(), reason="the interpreted tests run in this process")
@interpreted_subprocess("-k", "interpreted and not subprocess")
def test_interpreted_gemv_in_a_subprocess() -> None:
    """This file's interpreted tests, in a ``TRITON_INTERPRET=1`` subprocess (tests/interpreted_runner.py)."""


# ---- GPU ----------------------------------------------------------------------------------------------------------
LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
            "lm_head": (128256, 4096)}


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("shape", list(LLAMA_8B))
def test_gemv_gpu(shape: str, rows: int) -> None:
    n, k = LLAMA_8B[shape]
    fusion = {"qkv": "norm", "o": "residual", "gate_up": "norm", "down": "silu_mul+residual", "lm_head": "plain"}[shape]
    check(rows, n, k, fusion, "cuda", torch.bfloat16, 2e-2, seed=rows)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 5, 8])
@pytest.mark.parametrize("shape", ["qkv", "down"])
def test_gemv_gpu_several_rows_on_cuda_cores(shape: str, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import tfs_kernels.gemv

    monkeypatch.setattr(tfs_kernels.gemv, "ROWS_DOT", False)
    n, k = LLAMA_8B[shape]
    check(rows, n, k, "norm" if shape == "qkv" else "silu_mul+residual", "cuda", torch.bfloat16, 2e-2, seed=rows)
    check(rows, 1000, 576, "norm+residual", "cuda", torch.bfloat16, 2e-2, seed=rows)  # SmolLM2's K, a ragged N


@pytest.mark.gpu
def test_gemv_gpu_odd_k_and_opcheck() -> None:
    for rows in (1, 4):  # SmolLM2's hidden size; N not a multiple of the tile
        for fusion in ("norm+residual", "silu_mul+residual"):
            check(rows, 1000, 576, fusion, "cuda", torch.bfloat16, 2e-2, seed=3)
    for fusion in ("plain", "norm+residual", "silu_mul+residual"):
        torch.library.opcheck(torch.ops.tfs.gemv, gemv_args(2, 256, 512, fusion, "cuda", torch.bfloat16, 0))


@pytest.mark.gpu
def test_gemv_gpu_compiled_with_cuda_graphs() -> None:
    args = gemv_args(1, 4096, 4096, "norm+residual", "cuda", torch.bfloat16, 5)
    eps = args[4]
    fn = torch.compile(lambda x, w, r, nw: gemv(x, w, r, nw, eps) * 2, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        out = fn(*args[:4])
    torch.testing.assert_close(out.float(), 2 * gemv_reference(*args).float(), atol=4e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny_llama", "smollm2_135m_random"])
def test_fused_decode_same_tokens_as_unfused(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled (CUDA graphs) greedy decoding with model.fused_decode=true against false: identical tokens for
    tiny_llama in float32; for SmolLM2-shaped bf16 (8 layers), identical for at least the first 8 steps (the fused
    kernels sum in another order, and bf16 rounding may flip a late near-tie), like the attention backends' bf16
    test."""
    import tfs_kernels.gemv as gemv_module
    from framework import LLM
    from tests.test_attention_backends import BF16_PROMPTS
    from tests.test_gpu import cuda_overrides

    launches = []  # the op's body runs when torch.compile traces and lowers it: proof that the fused path is used
    real_launch = gemv_module.launch_gemv
    monkeypatch.setattr(gemv_module, "launch_gemv", lambda *a, **kw: launches.append(1) or real_launch(*a, **kw))
    outs = []
    for fused in ("true", "false"):
        launches.clear()
        # SmolLM2's shapes with 8 of its 30 layers: the same kernels, a quarter of the compile time
        extra = ["model.dtype=float32"] if model == "tiny_llama" else ["model.arch.num_layers=8"]
        llm = LLM(cuda_overrides(f"model={model}", *extra, f"model.fused_decode={fused}", "attention=triton",
                                 "compile=reduce_overhead", "scheduler.max_running_requests=2",
                                 "compile.batch_sizes=[1,2]"))
        outs.append([o.token_ids for o in llm.generate(BF16_PROMPTS)])
        assert bool(launches) == (fused == "true")
    for fused, unfused in zip(*outs):
        same = next((i for i, (a, b) in enumerate(zip(fused, unfused)) if a != b), len(fused))
        assert same == len(fused) if model == "tiny_llama" else same >= 8, (fused, unfused)
