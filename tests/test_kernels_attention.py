"""The attention kernels of ``tfs_kernels/`` against their plain-torch references, on fresh random inputs.

CPU: the Triton interpreter, small fp32 shapes (the interpreter is slow, and it mishandles bf16 loads).
``TRITON_INTERPRET=1`` must be in the environment before triton is first imported (triton.language's own jitted
helpers are decorated then, and conftest imports triton through torch._inductor), so under a plain ``pytest`` the
interpreted tests run in one subprocess (:func:`test_interpreted_kernels_in_a_subprocess`); with
``TRITON_INTERPRET=1 pytest ...`` they run in-process. GPU (``pytest -m gpu``): native kernels on Llama-3-8B
attention shapes in bf16, torch.compile with CUDA graphs, and ``torch.library.opcheck`` in full.
"""

from __future__ import annotations

import pytest
import torch

from tfs_kernels.decode_attention import decode_attention, decode_attention_reference
from tfs_kernels.dispatch import interpreter_active
from tfs_kernels.mask_bits import pack_mask_bits
from tfs_kernels.split_kv_attention import split_policy, split_slots
from tfs_kernels.store_kv import store_kv, store_kv_reference
from tfs_kernels.verify_attention import verify_attention, verify_attention_reference
from tests.interpreted_runner import interpreted_subprocess
from tests.kernel_checks import (check_extend, check_split_kv, paged_table, random_pool,
                                 run_opcheck_without_interpreter, tree_mask)

INTERPRETED = interpreter_active()
interpreted = pytest.mark.skipif(not INTERPRETED, reason="interpreter tests: run by the TRITON_INTERPRET=1 subprocess")
MANY_SPLITS = (8, 1024, 16)  # (max_splits, target_programs, min_split_len): every request splits as far as it can
ONE_SPLIT = (4, 1, 1 << 20)


# ---- CPU: Triton interpreter ------------------------------------------------------------------------------------
@interpreted
def test_store_kv_writes_the_slots_and_nothing_else():
    k_cache, v_cache = random_pool(300, 3, 24, torch.float32, "cpu", 0)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(300)[:37]
    k = torch.randn(37, 3, 24)
    v = torch.randn(37, 9, 24)[:, 2:5]  # rows strided like the v of a fused qkv projection
    store_kv(k_cache, v_cache, slots, k, v)
    store_kv_reference(expected_k, expected_v, slots, k, v)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@interpreted
@pytest.mark.parametrize("heads,kv_heads,dim,page_size,policy", [
    (4, 4, 16, 1, MANY_SPLITS),  # MHA, one slot per page
    (6, 2, 16, 16, MANY_SPLITS),  # GQA group 3 (rows not a power of two)
    (8, 2, 24, 16, ONE_SPLIT),  # head_dim not a power of two; no split
    (4, 1, 32, 4, MANY_SPLITS),  # MQA
])
def test_decode_matches_reference(heads, kv_heads, dim, page_size, policy):
    check_split_kv(heads, kv_heads, dim, page_size, [1, 17, 64, 250], 1, None, policy, seed=heads + page_size)


@interpreted
@pytest.mark.parametrize("q_len,mask_width", [(4, None), (4, 4), (3, 12), (1, 6)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_matches_reference(q_len, mask_width, page_size):
    """Causal (no mask), a tree over the new tokens, and a mask reaching into earlier draft tokens."""
    check_split_kv(6, 2, 16, page_size, [12, 40, 130], q_len, mask_width, MANY_SPLITS, seed=q_len + page_size)


def verify_with_byte_mask(fn) -> None:
    """``fn`` (the verify op or its reference) gives the same output for a tree mask as bool and as uint8 0 / 1
    (attention=triton converts the mask once per step: TritonBackend.init_metadata)."""
    table, rpi, num_slots = paged_table([12, 40], 4, 48, "cpu", 21)
    k_cache, v_cache = random_pool(num_slots, 2, 16, torch.float32, "cpu", 22)
    q = torch.randn(2 * 3, 4, 16, generator=torch.Generator().manual_seed(23))
    mask = tree_mask(2, 3, 6, 24)
    args = (q, k_cache, v_cache, table, rpi, torch.tensor([12, 40]))
    as_bool = fn(*args, mask, 3, 0.25, *MANY_SPLITS)
    assert torch.equal(fn(*args, mask.to(torch.uint8), 3, 0.25, *MANY_SPLITS), as_bool)
    assert not torch.equal(fn(*args, torch.ones_like(mask), 3, 0.25, *MANY_SPLITS), as_bool)  # the mask matters


@interpreted
def test_verify_kernel_takes_a_byte_mask_interpreted():
    verify_with_byte_mask(verify_attention)


def test_verify_reference_takes_a_byte_mask():
    verify_with_byte_mask(verify_attention_reference)


def test_pack_mask_bits_sets_bit_i_for_key_i():
    mask = tree_mask(3, 5, 64, 31)
    mask[0, 0, 63] = True  # bit 63: the sign bit
    words = pack_mask_bits(mask.to(torch.uint8))  # bool and uint8 pack alike
    assert words.shape == (3, 5) and words.dtype == torch.int64
    assert torch.equal(words, pack_mask_bits(mask))
    unpacked = (words[..., None] >> torch.arange(64)) & 1
    assert torch.equal(unpacked.bool(), mask) and words[0, 0] < 0


@interpreted
@pytest.mark.parametrize("q_len,mask_width,page_size,policy", [(4, 4, 1, MANY_SPLITS), (3, 12, 16, MANY_SPLITS),
                                                               (8, 64, 16, MANY_SPLITS), (8, 64, 16, ONE_SPLIT)])
def test_verify_reads_the_packed_mask(q_len, mask_width, page_size, policy):
    """The kernel reading ``pack_mask_bits(mask)``: the same result as the reference, up to a 64-key mask
    (whose last key is bit 63) that spans several checked tiles in one split, a request shorter than the mask
    included."""
    check_split_kv(6, 2, 16, page_size, [70, 40, 130], q_len, mask_width, policy, seed=q_len + mask_width,
                   bits=True)


@interpreted
def test_verify_tiles_many_query_rows():
    """q_len * group = 96 rows: the rows of one KV head span two tiles."""
    check_split_kv(12, 1, 16, 16, [20, 90], 8, 8, MANY_SPLITS, seed=5)


@interpreted
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_matches_reference(page_size):
    """Ragged: an empty prefix, one new token, new runs longer than one tile, prefix longer than the run, and
    prefixes that put the diagonal right at a key-tile boundary (prefix + tile start = 30, 31, 32 mod 32)."""
    check_extend(6, 2, 16, page_size, [0, 5, 37, 100, 30, 15, 48], [7, 1, 40, 33, 17, 34, 20], seed=page_size)


def test_split_slots_are_a_power_of_two_without_specialising_the_batch():
    """The partial buffers' split slots: at most what fills the device, rounded down to a power of two; with a
    symbolic batch size (torch.compile) no guard pins the batch's exact split count, so one graph serves the
    batch sizes that share a power of two."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    for max_splits, target, per_split, want in [(64, 528, 8, 64), (64, 264, 8, 32), (64, 528, 256, 2),
                                                (64, 528, 1024, 1), (4, 16, 1, 4), (64, 136, 8, 16)]:
        assert split_slots(max_splits, target, per_split) == want
    env = ShapeEnv()
    bs = env.create_symintnode(env.create_symbol(3, ConstantSource("bs")), hint=3)
    slots = split_slots(64, 528, bs * 8)  # cdiv(528, 24) = 22 -> 16
    assert slots == 16 and isinstance(slots, int)
    assert not [g for g in env.guards if "Eq" in str(g.expr)]  # ranges only: bs 3 and 4 (17 -> 16) share it


@interpreted
def test_split_count_does_not_change_the_result():
    seq_lens = [3, 300]
    results = []
    for policy in (ONE_SPLIT, MANY_SPLITS, (3, 1024, 1)):
        table, rpi, slots = paged_table(seq_lens, 16, 310, "cpu", 1)
        k_cache, v_cache = random_pool(slots, 2, 16, torch.float32, "cpu", 2)
        q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(3))
        results.append(decode_attention(q, k_cache, v_cache, table, rpi, torch.tensor(seq_lens), 0.25, *policy))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0], results[2], rtol=1e-5, atol=1e-5)


def check_merge_ignores_stale_partials(device: str, use_pdl: bool = False, early_trigger: bool = False) -> None:
    """The merge kernel (``use_pdl``: its PDL variant, ``early_trigger``: letting the next kernel launch before its
    wait) reads every split's slot of the partial buffers. The slots of splits a request did not use (here NaN
    outputs with a large log-sum-exp, as stale memory may hold) must not reach the output; an empty split that was
    used (lse -inf, output 0) weighs nothing, also when the first ones are; a row whose splits are all empty gives
    zeros."""
    import triton

    from tfs_kernels.split_kv_merge import split_kv_merge_kernel

    gen = torch.Generator().manual_seed(4)
    q_len, heads, dim, max_splits = 2, 3, 16, 8
    seq_lens = torch.tensor([5, 40, 1000])  # with 16-key splits and 8 programs: 1, 3 and 8 splits
    used = torch.tensor([1, 3, 8]).repeat_interleave(q_len)  # [n]
    n = len(used)
    mid_o = torch.randn(n, heads, max_splits, dim, generator=gen)
    mid_lse = torch.randn(n, heads, max_splits, generator=gen)
    stale = torch.arange(max_splits)[None, None, :] >= used[:, None, None]  # [n, 1, max_splits]
    mid_lse = mid_lse.masked_fill(stale, 100.0)
    mid_o = mid_o.masked_fill(stale[..., None], float("nan"))
    mid_lse[2:4, :, 1], mid_o[2:4, :, 1] = float("-inf"), 0.0  # an empty split of the second request
    mid_lse[4:6, :, :2], mid_o[4:6, :, :2] = float("-inf"), 0.0  # the third's first two splits: empty
    mid_lse[5, 1], mid_o[5, 1] = float("-inf"), 0.0  # a row with every split empty
    w = torch.softmax(mid_lse.masked_fill(stale, float("-inf")) * torch.log(torch.tensor(2.0)), -1)  # base 2
    expected = (w[..., None] * mid_o.nan_to_num(0.0)).sum(2).nan_to_num(0.0)  # [n, heads, dim]; empty row: 0
    mid_o, mid_lse, seq = mid_o.to(device), mid_lse.to(device), seq_lens.to(device)
    out = torch.empty(n, heads, dim, device=device)
    split_kv_merge_kernel[(n, heads)](
        mid_o, mid_lse, out, seq, 1, max_splits, max_splits, 16,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), Q_LEN=q_len, HEAD_DIM=dim, BLOCK_D=dim,
        BLOCK_S=triton.next_power_of_2(max_splits * 2),  # > max_splits: masked loads too
        USE_PDL=use_pdl, EARLY_TRIGGER=early_trigger,
        num_warps=4)  # (launched without the PDL attribute, the kernel's wait returns at once)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


@interpreted
def test_merge_ignores_stale_partials_interpreted():
    check_merge_ignores_stale_partials("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("use_pdl,early_trigger", [(False, False), (True, False), (True, True)])
def test_merge_ignores_stale_partials_on_cuda(use_pdl, early_trigger):
    from tfs_kernels.pdl import HAS_GDC

    if use_pdl and not HAS_GDC:
        pytest.skip("this Triton has no grid dependency control")
    check_merge_ignores_stale_partials("cuda", use_pdl, early_trigger)


def test_compiled_cpu_code_runs_the_references():
    """torch.compile on the CPU traces the reference (tracing into a triton_op body would need a GPU driver)."""
    table, rpi, slots = paged_table([9, 33], 4, 40, "cpu", 7)
    k_cache, v_cache = random_pool(slots, 2, 16, torch.float32, "cpu", 8)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    new_slots = table[rpi, torch.tensor([8, 32])]
    seq = torch.tensor([9, 33])

    def step(q, k, v, k_cache, v_cache):
        store_kv(k_cache, v_cache, new_slots, k, v)
        return decode_attention(q, k_cache, v_cache, table, rpi, seq, 0.25, *ONE_SPLIT)

    caches = k_cache.clone(), v_cache.clone()
    out = torch.compile(step, fullgraph=True)(q, k, v, *caches)
    expected = step(q, k, v, k_cache, v_cache)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[0], k_cache) and torch.equal(caches[1], v_cache)


def op_args(device: str) -> dict:
    """One small argument tuple per op (fp32), keyed by the op's name (``/`` and a variant after it)."""
    table, rpi, slots = paged_table([5, 20], 4, 24, device, 9)
    k_cache, v_cache = random_pool(slots, 2, 16, torch.float32, device, 10)
    seq = torch.tensor([5, 20], device=device)
    q2, q6 = torch.randn(2, 4, 16, device=device), torch.randn(6, 4, 16, device=device)
    mask = tree_mask(2, 3, 5, 11).to(device)
    lens = torch.tensor([2, 4], device=device)
    return {
        "store_kv": (k_cache, v_cache, torch.tensor([3, 7], device=device), torch.randn(2, 2, 16, device=device),
                     torch.randn(2, 2, 16, device=device)),
        "decode_attention": (q2, k_cache, v_cache, table, rpi, seq, 0.25, *MANY_SPLITS),
        "verify_attention": (q6, k_cache, v_cache, table, rpi, seq, mask, 3, 0.25, *MANY_SPLITS),
        "verify_attention/bits": (q6, k_cache, v_cache, table, rpi, seq, mask, 3, 0.25, *MANY_SPLITS,
                                  pack_mask_bits(mask)),
        "extend_attention": (q6, k_cache, v_cache, table, rpi, seq, torch.cumsum(lens, 0) - lens, lens, 4, 0.25),
    }


@interpreted
def test_opcheck_interpreted():
    """Schema and autograd registration with the interpreted kernels (the fake-tensor checks cannot run an
    interpreted kernel; they run in the next test and on the GPU)."""
    for name, args in op_args("cpu").items():
        torch.library.opcheck(getattr(torch.ops.tfs, name.split("/")[0]), args,
                              test_utils=("test_schema", "test_autograd_registration"))


def test_opcheck_fake_tensors_without_interpreter():
    """Without the interpreter the CPU kernel is the reference and the fake kernel is the triton_op body: opcheck
    compares the two (shapes, dtypes, strides) and the schema's mutation claims."""
    run_opcheck_without_interpreter("from tests.test_kernels_attention import op_args\n"
                                    "cases = [(getattr(torch.ops.tfs, name.split('/')[0]), args) for name, args in "
                                    "op_args('cpu').items()]\n")


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(), reason="the interpreted tests run in this process")
@interpreted_subprocess("-k", "not subprocess and not without_interpreter and not compiled_cpu_code")
def test_interpreted_kernels_in_a_subprocess() -> None:
    """This file's interpreted tests, in a ``TRITON_INTERPRET=1`` subprocess (tests/interpreted_runner.py)."""


# ---- GPU: native kernels ------------------------------------------------------------------------------------------
LLAMA = dict(heads=32, kv_heads=8, dim=128)  # Llama-3-8B attention
BF16 = dict(device="cuda", dtype=torch.bfloat16, tol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_on_cuda(page_size):
    gen = torch.Generator().manual_seed(page_size)
    lens = torch.randint(1, 4096, (32,), generator=gen).tolist()
    check_split_kv(**LLAMA, page_size=page_size, seq_lens=lens, q_len=1, mask_width=None,
                   policy=split_policy(torch.device("cuda"), 1), **BF16)
    check_split_kv(**LLAMA, page_size=page_size, seq_lens=[32768], q_len=1, mask_width=None,
                   policy=split_policy(torch.device("cuda"), 1), **BF16)


@pytest.mark.gpu
def test_decode_on_cuda_float32_is_exact():
    check_split_kv(**LLAMA, page_size=16, seq_lens=[1, 100, 3000, 9000], q_len=1, mask_width=None,
                   policy=split_policy(torch.device("cuda"), 1), device="cuda", tol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("q_len,mask_width,bits", [(8, 8, False), (8, 8, True), (4, 12, False), (8, 64, True),
                                                   (8, None, False)])
def test_verify_on_cuda(q_len, mask_width, bits):
    lens = torch.randint(16, 4096, (32,), generator=torch.Generator().manual_seed(q_len)).tolist()
    check_split_kv(**LLAMA, page_size=16, seq_lens=lens, q_len=q_len, mask_width=mask_width,
                   policy=split_policy(torch.device("cuda"), q_len), bits=bits, **BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_on_cuda(page_size):
    gen = torch.Generator().manual_seed(page_size)
    prefix = [0] + torch.randint(0, 2048, (7,), generator=gen).tolist()
    new = [1000] + torch.randint(1, 600, (7,), generator=gen).tolist()
    check_extend(**LLAMA, page_size=page_size, prefix_lens=prefix, new_lens=new, **BF16)


@pytest.mark.gpu
def test_store_kv_on_cuda():
    k_cache, v_cache = random_pool(200_000, 8, 128, torch.bfloat16, "cuda", 0)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(200_000, device="cuda")[:4096]
    k = torch.randn(4096, 8, 128, device="cuda")  # float32 in, cast to the cache dtype
    v = torch.randn(4096, 24, 128, device="cuda")[:, 8:16]
    store_kv(k_cache, v_cache, slots, k, v)
    store_kv_reference(expected_k, expected_v, slots, k, v)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.gpu
def test_opcheck_on_cuda():
    for name, args in op_args("cuda").items():
        torch.library.opcheck(getattr(torch.ops.tfs, name.split("/")[0]), args)


@pytest.mark.gpu
def test_store_and_decode_in_a_cuda_graph():
    """torch.compile(mode="reduce-overhead", fullgraph=True) over store + decode with the cache as static module
    buffers (as the engine holds them): replays write the pool in place and match the reference."""
    from framework.kv import KVPool

    lens = [5, 700, 3000, 64]
    table, rpi, num_slots = paged_table(lens, 16, 3100, "cuda", 3)
    pool = KVPool(1, num_slots, 8, 128, torch.bfloat16, torch.device("cuda"))
    ref_k, ref_v = random_pool(num_slots, 8, 128, torch.bfloat16, "cuda", 4)
    pool.k[0].copy_(ref_k)
    pool.v[0].copy_(ref_v)
    torch._dynamo.mark_static_address(table)
    seq = torch.tensor(lens, device="cuda")
    new_slots = table[rpi, seq - 1]
    policy = split_policy(torch.device("cuda"), 1)

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        store_kv(pool.k[0], pool.v[0], new_slots, k, v)
        return decode_attention(q, pool.k[0], pool.v[0], table, rpi, seq, 128 ** -0.5, *policy)

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for i in range(3):
        gen = torch.Generator().manual_seed(i)
        q, k, v = (torch.randn(4, h, 128, generator=gen).to("cuda", torch.bfloat16) for h in (32, 8, 8))
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(q, k, v).clone()
        store_kv_reference(ref_k, ref_v, new_slots, k, v)
        assert torch.equal(pool.k[0], ref_k) and torch.equal(pool.v[0], ref_v)
        expected = decode_attention_reference(q, ref_k, ref_v, table, rpi, seq, 128 ** -0.5, *policy)
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
