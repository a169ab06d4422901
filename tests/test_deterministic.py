"""model.deterministic on the CPU (fp32, attention=sdpa): a token's logits are the same bits whether a decode step,
a verify or a prefill computed them, alone or beside other requests (in the default mode they are not: CPU GEMMs
and SDPA block their sums by the row count); the real SmolLM2's greedy output is token-identical across
{no speculation, ngram, layer_skip} x {batch 1, 8}; the switch's configuration errors; and the default mode keeps
its own kernels. The GPU path's kernels (``tfs::det_matmul``, ``tfs::det_attention``, ``tfs::det_rmsnorm`` with
``attention=triton``) are also run in the engine by the Triton interpreter, in a ``TRITON_INTERPRET=1`` subprocess:
a token's logits have the same bits from every kind of forward, and a small random model's greedy output is the
same with and without n-gram speculation, at other batch and page sizes.

One engine per drafter serves both batch sizes (the scheduler's running limit is set per run), so the second run
also prefills over the first run's cached prompts. The kernels' row invariance itself is in
tests/test_kernels_det.py.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from framework import LLM
from framework.attention import sdpa
from framework.batch import ForwardBatch, ForwardMode
from framework.config import ConfigError
from tests.helpers import run_token_prompts
from tests.interpreted_runner import interpreted_subprocess
from tests.test_smollm2_golden import CHATS
from tfs_kernels.dispatch import interpreter_active

slow = pytest.mark.slow
MAX_TOKENS = 6
BASE = ["model=smollm2_135m", "compile=eager", "model.deterministic=true", "scheduler.max_context=256",
        "scheduler.max_running_requests=8"]
SPECS = {"none": ["kv.page_size=1"], "ngram": ["speculative=ngram", "speculative.num_steps=4", "kv.page_size=16"],
         "layer_skip": ["speculative=layer_skip", "speculative.num_steps=2", "kv.page_size=1"]}


BATCH1_CHATS = 4  # batch-1 runs take the first chats only: they are sequential, and the token sums they would
# differ in (a request alone against beside others) are the same for each chat


def items(batch: int) -> list[dict]:
    chats = CHATS if batch > 1 else CHATS[:BATCH1_CHATS]
    return [{"messages": [{"role": "user", "content": c}], "max_tokens": MAX_TOKENS, "ignore_eos": True}
            for c in chats]


@functools.cache
def engine(spec: str) -> LLM:
    return LLM(BASE + SPECS[spec])


@functools.cache
def outputs(spec: str, batch: int) -> list[list[int]]:
    llm = engine(spec)
    llm.engine.scheduler.cfg.max_running_requests = batch
    out = [o.token_ids for o in llm.generate(items(batch))]
    llm.engine.allocator.assert_all_free()
    return out


@slow
@pytest.mark.parametrize("spec,batch", [("none", 1), ("ngram", 1), ("ngram", 8), ("layer_skip", 1),
                                        ("layer_skip", 8)])
def test_greedy_identical_across_speculation_and_batch(spec: str, batch: int) -> None:
    ref = outputs("none", 8)  # a batch of 8 without speculation; batch-1 runs cover its first chats
    assert all(len(ids) == MAX_TOKENS for ids in ref)
    assert outputs(spec, batch) == ref[:len(items(batch))]
    if spec != "none":  # the verify path ran
        assert engine(spec).engine.spec_worker.stats.num_verify_steps > 0


@slow
def test_switch_sets_the_kernels() -> None:
    llm = engine("none")
    model, backend = llm.engine.model, llm.engine.backend
    assert model.deterministic and not model.fused_decode and backend.deterministic
    assert all(layer.mlp.deterministic and layer.input_layernorm.deterministic for layer in model.layers)
    plain = LLM(["model=tiny_llama", "compile=eager"]).engine
    assert not plain.model.deterministic and not plain.backend.deterministic
    assert not plain.model.layers[0].self_attn.deterministic


@pytest.mark.parametrize("overrides,message", [
    (["speculative=ngram", "speculative.num_steps=3", "speculative.topk=2"], "speculative.topk=2"),
    (["speculative=suffix", "speculative.num_steps=3"], "speculative.topk=4"),  # (suffix's trees)
    (["attention=flex"], "attention=flex has no batch-invariant mode"),
    (["model=dsa_tiny", "attention=nsa"], "Llama-family models only"),
])
def test_unsupported_combinations_fail_with_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        LLM(["model=tiny_llama", "compile=eager", "model.deterministic=true", *overrides])


# ---- a token's logits from different forwards -------------------------------------------------------------------
SLOTS_PER_ROW = 256


def run_forward(engine, mode: ForwardMode, reqs: list[tuple[int, list[int], int]], chain_mask: bool = False):
    """One forward of ``reqs`` = (request row, the request's tokens, how many of them are in the KV already) straight
    through the engine's model and attention backend; slots ``row * SLOTS_PER_ROW + position``. Returns the logits
    of every new token, float32 ``[n, vocab]``."""
    table = engine.allocator.req_to_token
    ids, positions, slots = [], [], []
    for row, tokens, start in reqs:
        table[row, : len(tokens)] = row * SLOTS_PER_ROW + torch.arange(len(tokens))
        ids += tokens[start:]
        positions += range(start, len(tokens))
        slots += [row * SLOTS_PER_ROW + p for p in range(start, len(tokens))]
    lens = [len(tokens) for _, tokens, _ in reqs]
    new = [len(tokens) - start for _, tokens, start in reqs]
    mask = None
    if chain_mask:  # what a chain's verify passes: causal over the draft tokens, everything before visible
        mask = torch.ones(len(reqs), new[0], new[0], dtype=torch.bool).tril()
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    batch = ForwardBatch(mode, t(ids), t(positions), t(slots), t([r for r, _, _ in reqs]), t(lens), lens, new,
                         t(list(range(len(ids)))), custom_mask=mask)
    meta = engine.backend.init_metadata(batch)
    with torch.inference_mode():
        logits, _ = engine.model(batch.input_ids, batch.positions, meta, batch.logits_index)
    return logits


def last_token_logits(engine, vocab: int = 49152) -> list[torch.Tensor]:
    """The logits at position 23 of one sequence computed by: a decode step alone after a prefill; a decode step
    beside two other requests; the last row of a 4-token verify (chain mask) beside another request; the last row of
    a whole-prompt prefill beside another request; and a prefill over 19 cached tokens."""
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, vocab, (24,), generator=gen).tolist()
    other = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (30, 9)]
    run_forward(engine, ForwardMode.EXTEND, [(1, seq[:23], 0)])
    decode_alone = run_forward(engine, ForwardMode.DECODE, [(1, seq, 23)])[0]
    run_forward(engine, ForwardMode.EXTEND, [(2, other[0][:-1], 0), (3, other[1][:-1], 0)])
    decode_batch = run_forward(engine, ForwardMode.DECODE, [(2, other[0], 29), (1, seq, 23), (3, other[1], 8)])[1]
    run_forward(engine, ForwardMode.EXTEND, [(4, seq[:20], 0), (5, other[0][:26], 0)])
    verify = run_forward(engine, ForwardMode.TARGET_VERIFY, [(5, other[0], 26), (4, seq, 20)], chain_mask=True)[-1]
    prefill = run_forward(engine, ForwardMode.EXTEND, [(6, other[1], 0), (7, seq, 0)])[-1]
    cached = run_forward(engine, ForwardMode.EXTEND, [(4, seq, 19)])[-1]
    return [decode_alone, decode_batch, verify, prefill, cached]


@pytest.mark.parametrize("deterministic", [True, False])
def test_token_logits_same_bits_from_every_forward(deterministic: bool) -> None:
    llm = LLM(["model=smollm2_135m_random", "model.arch.num_layers=4", "compile=eager", "scheduler.max_context=256",
               "scheduler.max_running_requests=8", f"model.deterministic={str(deterministic).lower()}"])
    got = last_token_logits(llm.engine)
    same = [torch.equal(g, got[0]) for g in got[1:]]
    if deterministic:
        assert all(same), same
    else:  # why the switch exists: the same token's logits from other forwards differ in their last bits
        assert not all(same)
        assert all(torch.allclose(g, got[0], atol=1e-3, rtol=1e-4) for g in got[1:])


# ---- the GPU path's kernels in the engine, interpreted on the CPU --------------------------------------------------
interpreted = pytest.mark.skipif(not interpreter_active(), reason="run by the TRITON_INTERPRET=1 subprocess")
KERNEL_MODEL = ["model=tiny_llama", "model.arch.vocab_size=512", "compile=eager", "attention=triton",
                "model.deterministic=true"]
KERNEL_BASE = KERNEL_MODEL + ["scheduler.max_context=96", "scheduler.max_running_requests=3"]
KERNEL_SPECS = {"none": ["kv.page_size=1"],
                "ngram": ["speculative=ngram", "speculative.num_steps=3", "kv.page_size=16"]}
# repeated patterns, so that n-gram drafts and verifies; the last prompt shares the first one's start (prefix cache)
KERNEL_PROMPTS = [[7, 8, 9, 10, 11] * 5, [300, 301, 302] * 6 + [5], [7, 8, 9, 10, 11] * 3 + [40, 41, 42, 43] * 3]
KERNEL_TOKENS = 6


@functools.cache
def kernel_engine(spec: str) -> LLM:
    return LLM(KERNEL_BASE + KERNEL_SPECS[spec])


def kernel_outputs(spec: str, batch: int) -> list[list[int]]:
    engine = kernel_engine(spec).engine
    engine.scheduler.cfg.max_running_requests = batch
    reqs = run_token_prompts(engine, KERNEL_PROMPTS, max_tokens=KERNEL_TOKENS)
    engine.allocator.assert_all_free()
    return [r.output_ids for r in reqs]


@interpreted
def test_interpreted_kernels_identical_across_speculation_batch_and_pages() -> None:
    """No speculation at batch 3 and page size 1 against n-gram (chains verified: several rows a request; v2) at
    batch 1 and page size 16: the same greedy tokens from the kernels that a CUDA GPU runs (fp32 here). (layer_skip's
    draft forwards run these kernels over fewer layers; its output is checked with the references above.)"""
    ref = kernel_outputs("none", 3)
    assert all(len(ids) == KERNEL_TOKENS for ids in ref)
    assert kernel_outputs("ngram", 1) == ref
    assert kernel_engine("ngram").engine.spec_worker.stats.num_verify_steps > 0


@interpreted
def test_interpreted_kernels_token_logits_same_bits() -> None:
    """The kernels a CUDA GPU runs give a token's logits the same bits from a decode step alone or in a batch, a
    verify row, a prefill row and a prefill over cached tokens."""
    llm = LLM(KERNEL_MODEL + ["scheduler.max_context=256", "scheduler.max_running_requests=8"])
    got = last_token_logits(llm.engine, vocab=512)
    assert all(torch.equal(g, got[0]) for g in got[1:]), [torch.equal(g, got[0]) for g in got[1:]]


@pytest.mark.skipif(interpreter_active() or torch.cuda.is_available(), reason="interpreted tests run in this process")
@interpreted_subprocess("-k", "interpreted_kernels_identical or interpreted_kernels_token", timeout=900)
def test_interpreted_kernels_in_a_subprocess() -> None:
    """This file's interpreted tests, in a ``TRITON_INTERPRET=1`` subprocess (tests/interpreted_runner.py)."""


def test_row_by_row_attention_gives_the_same_bits_in_chunks(monkeypatch) -> None:
    """The CPU's deterministic attention makes its products a few rows at a time where a batch's would be large
    (``sdpa.ROWWISE_BYTES``): one row a time gives every forward's logits the same bits as one product does."""
    overrides = ["model=smollm2_135m_random", "model.arch.num_layers=2", "compile=eager", "scheduler.max_context=256",
                 "scheduler.max_running_requests=8", "model.deterministic=true"]
    whole = last_token_logits(LLM(overrides).engine)
    monkeypatch.setattr(sdpa, "ROWWISE_BYTES", 1)
    rows = last_token_logits(LLM(overrides).engine)
    assert all(torch.equal(a, b) for a, b in zip(whole, rows))
    assert all(torch.equal(g, rows[0]) for g in rows[1:])
