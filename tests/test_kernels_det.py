"""The batch-invariant kernels of model.deterministic (``tfs::det_matmul``, ``tfs::det_rmsnorm``,
``tfs::det_attention``) against their plain-torch references on fresh random inputs, and the property they exist
for: a row's output is the same bits whatever the number of rows in the call, the row's place among them, and (for
attention) whether the token is a decode step, a row of a verify or a row of a prefill.

CPU: the Triton interpreter (in a ``TRITON_INTERPRET=1`` subprocess under a plain ``pytest``), small fp32 shapes;
the references' own row invariance (the CPU's deterministic path) without it. GPU (``pytest -m gpu``): bf16 at the
8B model's shapes, where cuBLAS itself is not row-invariant.
"""

from __future__ import annotations

import pytest
import torch

from tfs_kernels.det_attention import det_attention, det_attention_reference, min_split
import tfs_kernels.det_matmul as det_matmul_module
from tfs_kernels.det_matmul import det_matmul, det_matmul_reference
from tfs_kernels.det_rmsnorm import det_rmsnorm, det_rmsnorm_reference
from tfs_kernels.dispatch import interpreter_active
from tfs_kernels.mask_bits import pack_mask_bits
from tests.kernel_checks import paged_table, random_pool, run_opcheck_without_interpreter
from tests.interpreted_runner import interpreted_subprocess

INTERPRETED = interpreter_active()
interpreted = pytest.mark.skipif(not INTERPRETED, reason="interpreter tests: run by the TRITON_INTERPRET=1 subprocess")
plain_cpu = pytest.mark.skipif(INTERPRETED, reason="the references' own invariance: without the interpreter")


def randn(*shape: int, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def assert_rows_invariant(fn, row: torch.Tensor, width: int, counts: list[int], device: str,
                          dtype: torch.dtype) -> None:
    """``fn(x)[p]`` is ``fn(row[None])[0]``, bit for bit, for batches of each count with the row at several
    places among other random rows."""
    alone = fn(row[None].clone())[0]
    for count in counts:
        for place in sorted({0, count // 2, count - 1}):
            x = randn(count, width, seed=count * 31 + place, device=device, dtype=dtype)
            x[place] = row
            out = fn(x)[place]
            assert torch.equal(out, alone), f"row at {place} of {count}: max diff {(out - alone).abs().max()}"


# ---- interpreted: kernels vs references, and the invariance --------------------------------------------------------
# the tile's optional entries (swap, split_k): x first or w first, K whole or in 3 ranges
ORDERS = [(False, 1), (True, 1), (False, 3), (True, 3)]
ORDER_IDS = ["x_first", "w_first", "x_first_split3", "w_first_split3"]


@interpreted
@pytest.mark.parametrize("fusion", ["plain", "float32", "residual", "silu_mul+residual", "norm", "norm+residual"])
@pytest.mark.parametrize("m,n,k,order", [(1, 40, 96, ORDERS[0]), (5, 33, 70, ORDERS[0]), (37, 24, 64, ORDERS[0]),
                                         (1, 40, 96, ORDERS[3]), (5, 33, 70, ORDERS[1]), (37, 24, 64, ORDERS[2])])
def test_det_matmul_interpreted(m: int, n: int, k: int, fusion: str, order: tuple, monkeypatch) -> None:
    monkeypatch.setattr(det_matmul_module, "INTERPRET_TILE", det_matmul_module.INTERPRET_TILE[:5] + order)
    silu_mul = "silu_mul" in fusion
    x, w = randn(m, 2 * k if silu_mul else k, seed=m), randn(n, k, seed=n + k) / k ** 0.5
    residual = randn(m, n + 3, seed=m + n)[:, :n] if "residual" in fusion else None  # a row stride other than n
    norm_weight = torch.rand(k, generator=torch.Generator().manual_seed(k)) + 0.5 if "norm" in fusion else None
    args = (x, w, residual, silu_mul, fusion == "float32", norm_weight, 0.1)  # (an eps that shows when dropped)
    out = torch.ops.tfs.det_matmul(*args)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, det_matmul_reference(*args), atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("order", ORDERS, ids=ORDER_IDS)
def test_det_matmul_rows_invariant_interpreted(order: tuple, monkeypatch) -> None:
    monkeypatch.setattr(det_matmul_module, "INTERPRET_TILE", det_matmul_module.INTERPRET_TILE[:5] + order)
    monkeypatch.setattr(det_matmul_module, "SPLIT_ROWS", 16)  # several split-K launches at 17 and 40 rows
    w = randn(40, 80, seed=1)
    assert_rows_invariant(lambda x: torch.ops.tfs.det_matmul(x, w), randn(80, seed=2), 80, [1, 2, 16, 17, 40],
                          "cpu", torch.float32)
    w2 = randn(40, 40, seed=3)  # SiLU-mul of gate | up, and an RMSNorm first: still a row's own
    assert_rows_invariant(lambda x: torch.ops.tfs.det_matmul(x, w2, None, True), randn(80, seed=4), 80, [2, 17],
                          "cpu", torch.float32)
    assert_rows_invariant(lambda x: torch.ops.tfs.det_matmul(x, w, None, False, False, torch.ones(80)),
                          randn(80, seed=5), 80, [2, 17], "cpu", torch.float32)


@interpreted
@pytest.mark.parametrize("order", ORDERS[2:], ids=ORDER_IDS[2:])
def test_split_tiles_finish_in_their_last_range_as_the_reducing_kernel(order: tuple, monkeypatch) -> None:
    """``SPLIT_FIXUP``: a split tile's last K range to finish sums the ranges in order and applies the epilogue, the
    same bits as the second, reducing kernel; every tile's count is back to zero after the launch."""
    monkeypatch.setattr(det_matmul_module, "INTERPRET_TILE", det_matmul_module.INTERPRET_TILE[:5] + order)
    monkeypatch.setattr(det_matmul_module, "SPLIT_ROWS", 16)  # several launches at 37 rows
    x, w, res = randn(37, 2 * 70, seed=5), randn(33, 70, seed=6) / 70 ** 0.5, randn(37, 33, seed=7)
    outs = {}
    for fixup in (True, False):
        monkeypatch.setattr(det_matmul_module, "SPLIT_FIXUP", fixup)
        outs[fixup] = [torch.ops.tfs.det_matmul(x[:, :70].contiguous(), w), torch.ops.tfs.det_matmul(x, w, res, True)]
    assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
    assert not det_matmul_module.fixup_counts(torch.device("cpu")).any()


@interpreted
def test_det_rmsnorm_interpreted_and_invariant() -> None:
    weight = torch.rand(96, generator=torch.Generator().manual_seed(3)) + 0.5
    x = randn(9, 96, seed=4)
    torch.testing.assert_close(torch.ops.tfs.det_rmsnorm(x, weight, 0.1), det_rmsnorm_reference(x, weight, 0.1),
                               atol=1e-5, rtol=1e-5)
    assert_rows_invariant(lambda x: torch.ops.tfs.det_rmsnorm(x, weight, 1e-5), randn(96, seed=5), 96, [1, 3, 20],
                          "cpu", torch.float32)


class Paged:
    """A shuffled paged pool with requests of the given lengths (tests/kernel_checks.py)."""

    def __init__(self, seq_lens: list[int], heads: int = 6, kv_heads: int = 2, dim: int = 32, page_size: int = 4,
                 width: int = 150, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        self.table, self.rpi, num_slots = paged_table(seq_lens, page_size, width, device, seed)
        self.k, self.v = random_pool(num_slots, kv_heads, dim, dtype, device, seed + 1)
        self.heads, self.dim, self.device, self.dtype = heads, dim, device, dtype
        self.split = min_split(device)
        self.seq_lens = seq_lens

    def run(self, q, reqs, seq_lens, q_len=1, mask=None, bits=False, starts=None, lens=None, reference=False,
            pdl=False):
        fn = det_attention_reference if reference else det_attention
        dev = self.device
        return fn(q, self.k, self.v, self.table, self.rpi[reqs], torch.tensor(seq_lens, device=dev),
                  None if starts is None else torch.tensor(starts, device=dev),
                  None if lens is None else torch.tensor(lens, device=dev), mask,
                  pack_mask_bits(mask) if bits and mask is not None else None, q_len, self.dim ** -0.5, self.split,
                  pdl)


@interpreted
@pytest.mark.parametrize("case", ["decode", "causal", "tree-bytes", "tree-bits", "extend"])
def test_det_attention_interpreted(case: str) -> None:
    from tests.kernel_checks import tree_mask

    seq = [70, 33, 100]
    p = Paged(seq)
    reqs = list(range(3))
    q_len = 1 if case == "decode" else 4
    mask = tree_mask(3, q_len, 9, seed=6) if case.startswith("tree") else None
    starts = lens = None
    if case == "extend":
        lens, starts = [5, 1, 9], [0, 5, 6]
        q = randn(15, p.heads, p.dim, seed=7)
    else:
        q = randn(3 * q_len, p.heads, p.dim, seed=7)
    args = dict(q_len=q_len, mask=mask, bits=case == "tree-bits", starts=starts, lens=lens)
    out = p.run(q, reqs, seq, **args)
    torch.testing.assert_close(out, p.run(q, reqs, seq, reference=True, **args), atol=1e-5, rtol=1e-5)


@interpreted
def test_det_attention_token_invariant_interpreted() -> None:
    """A token's output is the same bits as a decode step (batch 1 or 3, any place), as a row of a causal verify,
    of a verify with a chain's mask (bytes and words), and of a prefill (with other requests around it)."""
    seq = [70, 33, 100]
    p = Paged(seq)
    q_len = 5
    qv = randn(3 * q_len, p.heads, p.dim, seed=8)
    verify = p.run(qv, [0, 1, 2], seq, q_len).view(3, q_len, p.heads, p.dim)
    chain = torch.ones(3, q_len, q_len + 3, dtype=torch.bool)
    chain[:, :, 3:] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    for bits in (False, True):
        masked = p.run(qv, [0, 1, 2], seq, q_len, mask=chain, bits=bits)
        assert torch.equal(masked.view_as(verify), verify)
    for b in range(3):
        for t in range(q_len):
            pos = seq[b] - q_len + t
            token = qv.view(3, q_len, p.heads, p.dim)[b, t]
            alone = p.run(token[None].contiguous(), [b], [pos + 1])[0]
            assert torch.equal(alone, verify[b, t]), (b, t)
            others = [r for r in range(3) if r != b]  # the same token decoded among the other requests
            batch = torch.stack([randn(p.heads, p.dim, seed=r) for r in others] + [token])
            out = p.run(batch, others + [b], [seq[r] for r in others] + [pos + 1])
            assert torch.equal(out[-1], alone)
    lens = [4, 2 * q_len, 3]  # request 2's last q_len tokens (positions seq - q_len ..) inside a prefill chunk
    starts = [0, 4, 4 + 2 * q_len]
    q = randn(sum(lens), p.heads, p.dim, seed=9)
    q[4 + q_len: 4 + 2 * q_len] = qv.view(3, q_len, p.heads, p.dim)[2]
    extend = p.run(q, [0, 2, 1], [seq[0], seq[2], seq[1]], starts=starts, lens=lens)
    assert torch.equal(extend[4 + q_len: 4 + 2 * q_len], verify[2])


@interpreted
def test_opcheck_interpreted() -> None:
    """Schema and autograd registration with the interpreted kernels (the fake-tensor checks cannot run an
    interpreted kernel: they run in the next test and on the GPU)."""
    p = Paged([20, 9], width=40)
    q = randn(2, p.heads, p.dim, seed=10)
    cases = [(torch.ops.tfs.det_attention,
              (q, p.k, p.v, p.table, p.rpi[:2], torch.tensor([20, 9]), None, None, None, None, 1, 0.2, p.split)),
             (torch.ops.tfs.det_matmul, (randn(3, 32, seed=11), randn(16, 32, seed=12), randn(3, 16, seed=9))),
             (torch.ops.tfs.det_rmsnorm, (randn(3, 32, seed=13), torch.ones(32), 1e-5))]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration"))


def test_opcheck_reference_and_fake_kernel() -> None:
    """Without the interpreter the CPU kernel is the reference; the registered fake kernels give the right shapes."""
    run_opcheck_without_interpreter(
        "from tfs_kernels.det_matmul import det_matmul_op\nfrom tfs_kernels.det_rmsnorm import det_rmsnorm_op\n"
        "g = torch.Generator().manual_seed(0)\n"
        "from tfs_kernels.det_attention import det_attention_op\n"
        "k, v = torch.randn(40, 2, 16, generator=g), torch.randn(40, 2, 16, generator=g)\n"
        "table = torch.randperm(40, generator=g).view(2, 20)\n"
        "cases = [(torch.ops.tfs.det_matmul, (torch.randn(3, 32, generator=g), torch.randn(16, 32, generator=g))),"
        " (torch.ops.tfs.det_rmsnorm, (torch.randn(3, 32, generator=g), torch.ones(32), 1e-5)),"
        " (torch.ops.tfs.det_attention, (torch.randn(2, 4, 16, generator=g), k, v, table, torch.tensor([1, 0]),"
        " torch.tensor([20, 7]), None, None, None, None, 1, 0.25, 16))]\n")


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(), reason="interpreted tests run in this process")
@interpreted_subprocess("-k", "interpreted and not subprocess")
def test_interpreted_det_kernels_in_a_subprocess() -> None:
    """This file's interpreted tests, in a ``TRITON_INTERPRET=1`` subprocess (tests/interpreted_runner.py)."""


# ---- the CPU's deterministic path: the references themselves -------------------------------------------------------
@plain_cpu
def test_cpu_matmul_and_norm_rows_invariant() -> None:
    """The CPU path of model.deterministic (the references) is row-invariant at SmolLM2's shapes, where one GEMM
    is not: MKL blocks K by the row count, and a row's outputs differ between 1 row and 8."""
    w = randn(1536, 576, seed=14) / 24
    row = randn(576, seed=15)
    x = randn(8, 576, seed=16)
    x[3] = row
    gemm = torch.nn.functional.linear
    assert not torch.equal(gemm(x, w)[3], gemm(row[None], w)[0])  # why the deterministic path exists
    assert_rows_invariant(lambda x: det_matmul(x, w), row, 576, [2, 8, 48], "cpu", torch.float32)
    weight = torch.rand(576, generator=torch.Generator().manual_seed(17)) + 0.5
    assert_rows_invariant(lambda x: det_rmsnorm(x, weight, 1e-5), row, 576, [2, 8, 300], "cpu", torch.float32)


def test_min_programs_narrows_small_weights_tiles_only(monkeypatch) -> None:
    """``MIN_PROGRAMS``: a small weight's tile narrows (BLOCK_N down to 16) until it has that many programs; a large
    weight's tile, and every tile with the knob off, stay as the class gives them (a choice by shape only)."""
    smol = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
    llama8b = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
    assert det_matmul_module.MIN_PROGRAMS == 48  # the default (timed on SmolLM2, docs/KERNELS.md)
    monkeypatch.setattr(det_matmul_module, "MIN_PROGRAMS", 0)
    classes = {s: det_matmul_module.cuda_tile(*s) for s in [*smol.values(), *llama8b]}
    monkeypatch.setattr(det_matmul_module, "MIN_PROGRAMS", 48)
    for n, k in llama8b:
        assert det_matmul_module.cuda_tile(n, k) == classes[n, k]
    for n, k in smol.values():
        tile, base = det_matmul_module.cuda_tile(n, k), classes[n, k]
        assert tile[:1] + tile[2:] == base[:1] + base[2:] and 16 <= tile[1] <= base[1]
        programs = -(-n // tile[1]) * (tile[6] if len(tile) > 6 else 1)
        assert programs >= 48 or tile[1] == 16
    assert [det_matmul_module.cuda_tile(*s)[1] for s in smol.values()] == [16, 16, 64, 32]


def test_fit_stages_keeps_16_bit_tiles_and_fits_float32_ones() -> None:
    """The pipeline stages fit the GPU's shared memory (227 KiB on an H100, Triton's ``max_shared_mem``): every
    configured tile keeps its stages with 16-bit operands, and float32 operands (``model.dtype=float32``; twice the
    bytes) or two x tiles (the SiLU-mul's gate and up) get fewer, at least 1, where all of them would not fit (Triton
    refused 240 KiB at stages 3)."""
    limit = 232448
    for block_m, block_n, block_k, _, stages, *_ in [*det_matmul_module.CUDA_TILES.values(),
                                                     det_matmul_module.CUDA_TILE]:
        assert det_matmul_module.fit_stages(stages, block_k * (block_m + block_n) * 2, limit) == stages
        for x_tiles, size in [(2, 2), (1, 4), (2, 4)]:  # SiLU-mul's gate and up; float32
            per_stage = block_k * (x_tiles * block_m + block_n) * size
            fit = det_matmul_module.fit_stages(stages, per_stage, limit)
            assert 1 <= fit <= stages and (fit * per_stage <= limit or fit == 1)
            assert fit == stages or (fit + 1) * per_stage > limit  # the most that fit
    assert det_matmul_module.fit_stages(3, 256 * (16 * 4 + 64 * 4), limit) == 2  # the tile Triton refused


def test_min_split_k_drops_a_small_weights_split_only(monkeypatch) -> None:
    """``MIN_SPLIT_K``: a class's K split stays where each range keeps that many columns (Llama-3-8B's down
    projection, K 14336 in 4 ranges) and goes where it would not (SmolLM2's, K 1536: one kernel, no reduce), its
    tile then narrowed by ``MIN_PROGRAMS`` as any unsplit tile; off, every tile is the class's."""
    off = {s: det_matmul_module.cuda_tile(*s) for s in [(576, 1536), (4096, 14336), (6144, 4096)]}
    assert off[576, 1536][6] == 4 and off[4096, 14336][6] == 4  # both "tall": split in 4
    monkeypatch.setattr(det_matmul_module, "MIN_SPLIT_K", 2048)
    assert det_matmul_module.cuda_tile(4096, 14336) == off[4096, 14336]
    assert det_matmul_module.cuda_tile(6144, 4096) == off[6144, 4096]
    small = det_matmul_module.cuda_tile(576, 1536)
    assert small[6] == 1 and small[1] == 16  # 36 programs of 16 columns, K whole
    assert small[:1] + small[2:6] == off[576, 1536][:1] + off[576, 1536][2:6]


# ---- GPU -----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)])
@pytest.mark.parametrize("tile", [None, (16, 64, 128, 4, 3, True), (16, 32, 256, 4, 3, False, 4),
                                  (16, 16, 256, 4, 4, True, 1)],
                         ids=["default_tiles", "w_first", "split4", "narrow16"])
def test_det_matmul_gpu_bf16(n: int, k: int, tile, monkeypatch) -> None:
    """The 8B model's linears in bf16: close to cuBLAS, and a row the same bits at 1..300 rows, where cuBLAS's is
    not (asserted for the record only when it shows); with the configured tiles, the operands swapped, and K split."""
    if tile is not None:
        monkeypatch.setattr(det_matmul_module, "CUDA_TILES", {})
        monkeypatch.setattr(det_matmul_module, "CUDA_TILE", tile)
    w = randn(n, k, seed=17, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    x = randn(64, k, seed=18, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(det_matmul(x, w).float(), (x @ w.T).float(), atol=3e-2, rtol=3e-2)
    assert_rows_invariant(lambda x: det_matmul(x, w), x[5], k, [2, 8, 33, 300], "cuda", torch.bfloat16)
    assert det_matmul(x, w, out_float32=True).dtype == torch.float32
    res = randn(64, n, seed=21, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(det_matmul(x, w, residual=res).float(), (x @ w.T + res).float(), atol=5e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(192, 64), (576, 576), (3072, 576), (576, 1536), (28672, 4096)])
def test_det_matmul_gpu_float32_every_class(n: int, k: int) -> None:
    """float32 weights and rows (``model.dtype=float32``, e.g. a several-row verify through ``DET_MAX_ROWS``): the
    16-bit tiles' stages are cut to fit shared memory; equal to the reference, SiLU-mul and residual fused too."""
    w = randn(n, k, seed=40, device="cuda") / k ** 0.5
    x = randn(6, 2 * k, seed=41, device="cuda")
    res = randn(6, n, seed=42, device="cuda")
    torch.testing.assert_close(det_matmul(x[:, :k].contiguous(), w), x[:, :k] @ w.T, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(det_matmul(x, w, residual=res, silu_mul=True),
                               det_matmul_reference(x.cpu(), w.cpu(), residual=res.cpu(), silu_mul=True).cuda(),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_det_matmul_gpu_pdl_same_bits(monkeypatch) -> None:
    """A layer's chain of det_matmul calls (RMSNorm, residual and SiLU-mul fused; down's tile split) launched with
    programmatic dependent launch, eagerly and replayed in a CUDA graph, gives the plain launches' bits."""
    from tfs_kernels.pdl import pdl_supported

    if not pdl_supported(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0 and a Triton with grid dependency control")
    w_qkv, w_o = (randn(*s, seed=30 + i, device="cuda", dtype=torch.bfloat16) / 64 for i, s in
                  enumerate([(6144, 4096), (4096, 4096)]))
    w_up, w_down = (randn(*s, seed=32 + i, device="cuda", dtype=torch.bfloat16) / 64 for i, s in
                    enumerate([(28672, 4096), (4096, 14336)]))
    nw = (torch.rand(4096, device="cuda") + 0.5).to(torch.bfloat16)
    x = randn(8, 4096, seed=34, device="cuda", dtype=torch.bfloat16)

    def layer(x: torch.Tensor, pdl: bool) -> torch.Tensor:
        qkv = det_matmul(x, w_qkv, norm_weight=nw, eps=1e-5, pdl=pdl)
        x = det_matmul(qkv[:, :4096].contiguous(), w_o, residual=x, pdl=pdl)
        h = det_matmul(x, w_up, norm_weight=nw, eps=1e-5, pdl=pdl)
        return det_matmul(h, w_down, residual=x, silu_mul=True, pdl=pdl)

    plain = layer(layer(x, False), False)
    assert torch.equal(layer(layer(x, True), True), plain)
    with pytest.MonkeyPatch.context() as patch:  # down's split summed by its last range or a second kernel
        patch.setattr(det_matmul_module, "SPLIT_FIXUP", not det_matmul_module.SPLIT_FIXUP)
        assert torch.equal(layer(layer(x, True), True), plain)
    monkeypatch.setattr(det_matmul_module, "SPLIT_FIXUP", True)  # the graph below: the last range sums
    layer(layer(x, True), True)  # warm-up before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(layer(x, True), True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain)
    assert not det_matmul_module.fixup_counts(x.device).any()  # every split tile's count reset by its last range


@pytest.mark.gpu
def test_det_rmsnorm_gpu_bf16() -> None:
    weight = (torch.rand(4096, device="cuda") + 0.5).to(torch.bfloat16)
    x = randn(70, 4096, seed=19, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(det_rmsnorm(x, weight, 1e-5).float(), det_rmsnorm_reference(x, weight, 1e-5).float(),
                               atol=2e-2, rtol=2e-2)
    assert_rows_invariant(lambda x: det_rmsnorm(x, weight, 1e-5), x[3], 4096, [2, 8, 300], "cuda", torch.bfloat16)


@pytest.mark.gpu
def test_det_attention_gpu_bf16_token_invariant() -> None:
    """The 8B shape (32 heads, 8 KV heads, 128 dims) in bf16 over a pool of 16-slot pages: kernel vs reference,
    a verify row the same bits as the decode step at its position, and launched with PDL the same bits."""
    from tfs_kernels.pdl import pdl_supported

    seq = [700, 33, 1500]
    p = Paged(seq, heads=32, kv_heads=8, dim=128, page_size=16, width=2048, device="cuda", dtype=torch.bfloat16)
    q_len = 8
    qv = randn(3 * q_len, 32, 128, seed=20, device="cuda", dtype=torch.bfloat16)
    verify = p.run(qv, [0, 1, 2], seq, q_len)
    torch.testing.assert_close(verify.float(), p.run(qv, [0, 1, 2], seq, q_len, reference=True).float(),
                               atol=2e-2, rtol=2e-2)
    if pdl_supported(torch.device("cuda")):
        assert torch.equal(p.run(qv, [0, 1, 2], seq, q_len, pdl=True), verify)
    verify = verify.view(3, q_len, 32, 128)
    for b in range(3):
        for t in (0, q_len - 1):
            pos = seq[b] - q_len + t
            alone = p.run(qv.view(3, q_len, 32, 128)[b, t][None].contiguous(), [b], [pos + 1])[0]
            assert torch.equal(alone, verify[b, t]), (b, t)
