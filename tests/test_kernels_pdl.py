"""Programmatic dependent launch (tfs_kernels/pdl.py, ``compile.pdl``): each ``tfs::*_pdl`` op gives bit for bit what
its plain op gives, alone and chained in a compiled CUDA graph (where a kernel that read its predecessor's output
before ``gdc_wait`` could read stale memory), and a model decodes, plainly and speculatively, the same tokens with
PDL on and off.

CPU: how ``compile.pdl`` resolves. GPU (``pytest -m gpu``; the PDL cases need compute capability >= 9.0): the rest.
"""

from __future__ import annotations

import pytest
import torch

from framework.config import ConfigError
from framework.resolve import resolve_pdl
from tfs_kernels.decode_attention import decode_attention
from tfs_kernels.gemv import (CUDA_LAUNCH, PDL_PREFETCH_K, PDL_PRELOAD, PREFETCH_CHOICES, gemv, gemv_reference,
                          launch_class, launch_gemv, pdl_options)
from tfs_kernels.mask_bits import pack_mask_bits
from tfs_kernels.pdl import pdl_supported
from tfs_kernels.qkv_rope_store import qkv_rope_store
from tfs_kernels.rope_store import rope_store_kv
from tfs_kernels.split_kv_attention import split_policy
from tfs_kernels.verify_attention import verify_attention
from tests.kernel_checks import paged_table, random_pool, tree_mask
from tests.test_kernels_gemv import gemv_args
from tests.test_kernels_rope_store import rope_args


def test_pdl_setting_resolves_per_device() -> None:
    cpu = torch.device("cpu")
    assert resolve_pdl("auto", cpu) is False and resolve_pdl("off", cpu) is False
    with pytest.raises(ConfigError) as err:
        resolve_pdl("on", cpu)
    assert str(err.value).startswith("compile.pdl=on is not allowed on cpu") and "\n" not in str(err.value)


# one-row Llama-3-8B and SmolLM2 layer shapes (qkv, o, gate_up, down, lm_head), and shapes that are not multiples of
# any tile (N, K) or shorter than the widest prefetch window
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (960, 576), (576, 576),
          (3072, 576), (576, 1536), (49152, 576), (300, 300), (604, 500), (300, 1100), (1, 64)]


def test_pdl_options_are_launches_the_kernel_accepts() -> None:
    """Whatever the tuned tables say, every product the model's PDL ops can launch gets options that
    ``launch_gemv`` accepts: a launch class with tuned parameters, a prefetch window that is 0 or an allowed one (a
    power of two from 64 that the kernel can unroll in 128-byte lines), none for a weight that is not 16-bit, and
    neither a prefetch nor a preload without PDL. A typo in a table would otherwise turn a launch off silently or
    fail only on the GPU."""
    assert set(PDL_PRELOAD) <= set(CUDA_LAUNCH) and set(PDL_PREFETCH_K) >= set(CUDA_LAUNCH)
    assert all(c >= 64 and c & (c - 1) == 0 for c in PREFETCH_CHOICES)
    for rows in (1, 2, 4, 16):
        for n, k in SHAPES:
            assert launch_class(rows, n, k) in CUDA_LAUNCH
            for element_size in (2, 4):
                prefetch_k, preload = pdl_options(rows, n, k, element_size)
                assert prefetch_k == 0 or (element_size == 2 and prefetch_k in PREFETCH_CHOICES), (rows, n, k)
                assert isinstance(preload, bool)
                assert pdl_options(rows, n, k, element_size, pdl=False) == (0, False)


# ---- GPU ----------------------------------------------------------------------------------------------------------
needs_pdl = pytest.mark.skipif(not (torch.cuda.is_available() and pdl_supported(torch.device("cuda"))),
                               reason="PDL needs a CUDA GPU of compute capability >= 9.0")


def attention_args(q_len: int, masked: bool, seed: int) -> tuple:
    """bf16 paged attention arguments: 4 requests of mixed lengths (some split many ways), 32 query heads over 8."""
    lens = [5, 700, 3000, 64]
    table, rpi, num_slots = paged_table(lens, 16, 3100, "cuda", seed)
    k_cache, v_cache = random_pool(num_slots, 8, 128, torch.bfloat16, "cuda", seed + 1)
    q = torch.randn(4 * q_len, 32, 128, generator=torch.Generator().manual_seed(seed + 2)).to("cuda", torch.bfloat16)
    seq = torch.tensor(lens, device="cuda")
    mask = tree_mask(4, q_len, q_len + 3, seed + 3).to("cuda") if masked else None
    return q, k_cache, v_cache, table, rpi, seq, mask


@pytest.mark.gpu
@needs_pdl
def test_pdl_ops_equal_plain_ops() -> None:
    # the 8B layer's shapes, then one-row shapes of each preloading class with N not a multiple of BLOCK_N and K
    # shorter than BLOCK_K or not a multiple of it (the preloaded chunk is masked, the loop after it short or empty)
    for (n, k), fusion in [((6144, 4096), "norm"), ((4096, 4096), "residual"), ((4096, 14336), "silu_mul+residual"),
                           ((1000, 576), "norm+residual"), ((300, 300), "residual"), ((604, 500), "norm"),
                           ((300, 1100), "silu_mul+residual")]:
        for rows, dtype in ((1, torch.bfloat16), (4, torch.bfloat16), (1, torch.float32)):
            args = gemv_args(rows, n, k, fusion, "cuda", dtype, seed=rows)
            assert torch.equal(gemv(*args, pdl=True), gemv(*args)), (n, k, fusion, rows, dtype)
    torch.library.opcheck(torch.ops.tfs.gemv_pdl, gemv_args(2, 256, 512, "norm+residual", "cuda", torch.bfloat16, 0))

    args = rope_args(4, 32, 8, 128, "cuda", torch.bfloat16, seed=1)
    caches = [a.clone() for a in args[4:6]]
    q = rope_store_kv(*args, pdl=True)
    k_pdl, v_pdl = args[4].clone(), args[5].clone()
    args[4].copy_(caches[0])
    args[5].copy_(caches[1])
    assert torch.equal(q, rope_store_kv(*args)) and torch.equal(k_pdl, args[4]) and torch.equal(v_pdl, args[5])
    torch.library.opcheck(torch.ops.tfs.rope_store_kv_pdl, args)

    policy = split_policy(torch.device("cuda"), 1)
    q, k_cache, v_cache, table, rpi, seq, _ = attention_args(1, False, 5)
    decode = (q, k_cache, v_cache, table, rpi, seq, 128 ** -0.5, *policy)
    assert torch.equal(decode_attention(*decode, pdl=True), decode_attention(*decode))
    torch.library.opcheck(torch.ops.tfs.decode_attention_pdl, decode)
    policy = split_policy(torch.device("cuda"), 8)
    for masked, packed in ((False, False), (True, False), (True, True)):
        q, k_cache, v_cache, table, rpi, seq, mask = attention_args(8, masked, 7)
        verify = (q, k_cache, v_cache, table, rpi, seq, mask, 8, 128 ** -0.5, *policy,
                  pack_mask_bits(mask) if packed else None)
        assert torch.equal(verify_attention(*verify[:-1], pdl=True, mask_bits=verify[-1]),
                           verify_attention(*verify[:-1], mask_bits=verify[-1]))
        torch.library.opcheck(torch.ops.tfs.verify_attention_pdl, verify)


@pytest.mark.gpu
@needs_pdl
def test_every_prefetch_window_and_preload_give_the_plain_result() -> None:
    """Any value a retune may pick is safe: each allowed L2 prefetch window, with and without the preloaded first
    chunk, gives bit for bit the plain launch's product (and so the reference's, within its tolerance); on a
    one-row shape whose K (500) is shorter than most windows and not a multiple of BLOCK_K, so that the prefetch
    is clamped to the row's end and the preloaded chunk masked, and on several rows (the tl.dot path), where the
    tuned tables preload nothing."""
    for rows, (n, k), fusion in ((1, (604, 500), "norm+residual"), (4, (600, 1100), "silu_mul+residual")):
        args = gemv_args(rows, n, k, fusion, "cuda", torch.bfloat16, seed=rows)
        plain = gemv(*args)
        torch.testing.assert_close(plain.float(), gemv_reference(*args).float(), atol=4e-2, rtol=4e-2)
        for prefetch_k in (0, *PREFETCH_CHOICES):
            for preload in (False, True):
                got = launch_gemv(*args, pdl=True, prefetch_k=prefetch_k, preload=preload)
                assert torch.equal(got, plain), (rows, prefetch_k, preload)


@pytest.mark.gpu
@needs_pdl
@pytest.mark.parametrize("lens", [[900, 17], [900]], ids=["batch2", "batch1"])
def test_pdl_chain_in_a_cuda_graph_equals_plain(lens: list[int]) -> None:
    """Four decoder-layer-shaped steps (qkv with RMSNorm and RoPE + K/V store, as two kernels or one; split-K
    decode; o with residual; the MLP's two gemvs), each kernel reading what the one before wrote: every replay's
    output and KV cache are bit-identical eagerly (one launch at a time) and compiled with reduce-overhead, with
    PDL and without. At batch 1 the gemvs take their one-row launches, where those of the classes in
    tfs_kernels/gemv.py PDL_PRELOAD preload their first weight chunk before the wait and o launches before the merge's
    wait."""
    from framework.kv import KVPool

    hidden, heads, kv_heads, dim, inter, layers = 2048, 16, 4, 128, 4096, 4
    table, rpi, num_slots = paged_table(lens, 16, 1000, "cuda", 11)
    torch._dynamo.mark_static_address(table)
    seq = torch.tensor(lens, device="cuda")
    slots = table[rpi, seq - 1]
    positions = seq - 1
    gen = torch.Generator().manual_seed(12)
    weights = [[(torch.randn(*shape, generator=gen) / shape[1] ** 0.5).to("cuda", torch.bfloat16)
                for shape in (((heads + 2 * kv_heads) * dim, hidden), (hidden, heads * dim), (2 * inter, hidden),
                              (hidden, inter))] for _ in range(layers)]
    norms = [(torch.rand(hidden, generator=gen) + 0.5).to("cuda", torch.bfloat16) for _ in range(2)]
    if len(lens) == 1:  # the chain covers preloading launches (the classes in PDL_PRELOAD)
        assert any(pdl_options(1, *w.shape, 2)[1] for w in weights[0])
    for t in [*norms, *(w for ws in weights for w in ws)]:
        torch._dynamo.mark_static_address(t)  # as the engine's parameters: not copied on every replay
    _, cos, sin, *_ = rope_args(2, heads, kv_heads, dim, "cuda", torch.bfloat16, seed=13)
    policy = split_policy(torch.device("cuda"), 1)
    stale_k, stale_v = random_pool(num_slots, kv_heads, dim, torch.bfloat16, "cuda", 14)
    results = []
    for compiled, pdl in ((False, False), (True, False), (True, True)):
        pool = KVPool(layers, num_slots, kv_heads, dim, torch.bfloat16, torch.device("cuda"))

        def step(x: torch.Tensor, pool=pool, pdl=pdl) -> torch.Tensor:
            for i, (w_qkv, w_o, w_gu, w_down) in enumerate(weights):
                if i % 2:  # the projection, RoPE and the K/V store in one kernel, as attention=triton runs them
                    q = qkv_rope_store(x, w_qkv, norms[0], 1e-5, cos, sin, positions, pool.k[i], pool.v[i], slots,
                                       heads, kv_heads, dim, pdl)
                else:
                    qkv = gemv(x, w_qkv, norm_weight=norms[0], eps=1e-5, pdl=pdl)
                    q = rope_store_kv(qkv, cos, sin, positions, pool.k[i], pool.v[i], slots, heads, kv_heads, dim,
                                      pdl)
                attn = decode_attention(q, pool.k[i], pool.v[i], table, rpi, seq, dim ** -0.5, *policy, pdl=pdl)
                x = gemv(attn.reshape(x.shape[0], heads * dim), w_o, residual=x, pdl=pdl)
                h = gemv(x, w_gu, norm_weight=norms[1], eps=1e-5, pdl=pdl)
                x = gemv(h, w_down, residual=x, silu_mul=True, pdl=pdl)
            return x

        fn = torch.compile(step, mode="reduce-overhead", fullgraph=True) if compiled else step
        outs = []
        for rep in range(4):
            for i in range(layers):
                pool.k[i].copy_(stale_k)
                pool.v[i].copy_(stale_v)
            x = torch.randn(len(lens), hidden, generator=torch.Generator().manual_seed(rep)).to("cuda", torch.bfloat16)
            torch.compiler.cudagraph_mark_step_begin()
            outs.append((fn(x).clone(), [pool.k[i].clone() for i in range(layers)]))
        results.append(outs)
    # eager launches, the compiled plain ops (inductor launches them) and the compiled PDL ops: bit for bit
    for (eager, eager_k), *others in zip(*results):
        for out, ks in others:
            assert torch.equal(eager, out)
            assert all(torch.equal(a, b) for a, b in zip(eager_k, ks))


@pytest.mark.gpu
@needs_pdl
@pytest.mark.parametrize("spec", [[], ["speculative=ngram", "speculative.num_steps=4"],
                                  ["speculative=layer_skip", "speculative.num_steps=3", "speculative.topk=4",
                                   "speculative.num_draft_tokens=8", "speculative.exit_layer=2"]])
def test_model_tokens_same_with_pdl_on_and_off(spec: list[str]) -> None:
    """SmolLM2-shaped bf16 (8 layers), attention=triton, compiled with CUDA graphs: the same kernels in the same
    order, so the same greedy tokens, for plain decoding and for chain / tree verification."""
    from framework import LLM
    from tests.test_attention_backends import BF16_PROMPTS
    from tests.test_gpu import cuda_overrides

    outs = []
    for pdl in ("off", "on"):
        llm = LLM(cuda_overrides("model=smollm2_135m_random", "model.arch.num_layers=8", "attention=triton",
                                 "compile=reduce_overhead", "scheduler.max_running_requests=2",
                                 "compile.batch_sizes=[1,2]", f"compile.pdl={pdl}", *spec))
        assert llm.engine.runner.pdl == (pdl == "on")
        outs.append([o.token_ids for o in llm.generate(BF16_PROMPTS)])
        llm.engine.allocator.assert_all_free()
    assert outs[0] == outs[1]
