"""Sampling is lossless: with temperature > 0 the tokens speculative decoding emits have exactly the target's
distribution. A tiny-vocabulary model (8 tokens) makes the exact distribution enumerable; 20k seeded requests
give the empirical one; a chi-square test compares them (chain with sampled drafts, tree with top-k drafts,
n-gram chains in speculation v2 and v1, and in v2 with the adaptive depth, suffix trees in v1 and chains in v2), and
the same test rejects a deliberately broken verifier."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import framework.speculative.verify as verify_module
from framework import LLM
from framework.request import Request
from framework.sampling import SamplingParams
from framework.speculative.adaptive import DraftLengthController
from tests.helpers import to_hf_llama

VOCAB, TEMPERATURE, SAMPLES = 8, 0.9, 20000
PROMPT = [1, 3, 5]
TINY_VOCAB = ["model=tiny_llama", "compile=eager", f"model.arch.vocab_size={VOCAB}", "model.arch.hidden_size=32",
              "model.arch.logit_scale=2.0", "model.arch.init_std=3.0", "scheduler.max_running_requests=1024", "scheduler.max_context=16",
              "kv.page_size=1"]  # init_std 3: the 1-layer draft differs a lot from the target (TV ~ 0.8)
SPECS = {
    "chain_sampled_drafts": ["speculative=layer_skip", "speculative.exit_layer=1", "speculative.num_steps=2"],
    "chain_sampled_drafts_v2": ["speculative=layer_skip", "speculative.exit_layer=1", "speculative.num_steps=2",
                                "speculative.version=v2"],
    "tree_topk_drafts": ["speculative=layer_skip", "speculative.exit_layer=1", "speculative.num_steps=2",
                         "speculative.topk=2", "speculative.num_draft_tokens=5"],
    "ngram_chain": ["speculative=ngram", "speculative.num_steps=2", "speculative.ngram_min=1"],  # v2
    "ngram_chain_v1": ["speculative=ngram", "speculative.num_steps=2", "speculative.ngram_min=1",
                       "speculative.version=v1"],
    # deterministic tree drafts from the other requests' outputs (the global suffix tree)
    "suffix_tree": ["speculative=suffix", "speculative.num_steps=2", "speculative.topk=2",
                    "speculative.num_draft_tokens=5", "speculative.min_token_prob=0"],
    # the same in speculation v2: chains drafted on the device from a small ring of finished requests' tokens
    "suffix_chain_v2": ["speculative=suffix", "speculative.num_steps=2", "speculative.topk=1",
                        "speculative.num_draft_tokens=0", "speculative.min_token_prob=0", "speculative.version=v2",
                        "speculative.suffix_max_depth=8", "speculative.suffix_cache_tokens=256"],
}


@pytest.fixture(scope="module")
def exact_joint():
    """P(t1, t2) of the 2nd and 3rd generated tokens ``[VOCAB, VOCAB]``, t0 marginalised, by enumeration."""
    llm = LLM(TINY_VOCAB)
    hf = to_hf_llama(llm.engine.model)
    seqs = [PROMPT + list(t) for t in itertools.product(range(VOCAB), repeat=2)]  # prompt + t0 + t1
    with torch.no_grad():
        logits = hf(torch.tensor(seqs)).logits.double() / TEMPERATURE  # [64, len, vocab]
    probs = logits.softmax(-1)
    p_t0 = probs[0, len(PROMPT) - 1]  # [vocab]
    p_t1 = probs[::VOCAB, len(PROMPT)]  # [t0, vocab]
    p_t2 = probs[:, len(PROMPT) + 1].view(VOCAB, VOCAB, VOCAB)  # [t0, t1, vocab]
    joint = torch.einsum("a,ab,abc->bc", p_t0, p_t1, p_t2)
    return joint.numpy()


def sample_pairs(overrides: list[str]) -> np.ndarray:
    """(t1, t2) of SAMPLES seeded requests ``[SAMPLES, 2]``."""
    llm = LLM(TINY_VOCAB + overrides)
    engine = llm.engine
    reqs = [Request(rid=i, prompt_ids=list(PROMPT), seed=i, max_new_tokens=3,
                    params=SamplingParams(max_tokens=3, temperature=TEMPERATURE, ignore_eos=True))
            for i in range(SAMPLES)]
    for req in reqs:
        engine.submit(req)
    while engine.has_work():
        engine.step()
    engine.allocator.assert_all_free()
    assert engine.spec_worker.stats.num_verify_steps > 0
    return np.asarray([r.output_ids[1:3] for r in reqs])


def chi_square_p(pairs: np.ndarray, joint: np.ndarray) -> float:
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    expected = joint.reshape(-1) * len(pairs)
    observed = counts.reshape(-1)
    small = expected < 5  # pool sparse cells so the test's approximation holds
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    return chisquare(observed, expected * observed.sum() / expected.sum())[1]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_emitted_distribution_equals_target(name, exact_joint):
    pairs = sample_pairs(SPECS[name])
    assert chi_square_p(pairs, exact_joint) >= 0.01


def test_adaptive_widths_keep_the_distribution(monkeypatch, exact_joint):
    """speculative.adaptive=true in v2, its depth cycling through 2, 1, 0 (widths 3, 2, 1) from one iteration to the
    next: every iteration draws from its own first token's stream, whatever the width."""
    depths = itertools.cycle([2, 1, 0])
    monkeypatch.setattr(DraftLengthController, "choose", lambda self, bs, rows=None: next(depths))
    pairs = sample_pairs(SPECS["ngram_chain"] + ["speculative.adaptive=true"])
    assert chi_square_p(pairs, exact_joint) >= 0.01


def test_broken_verifier_fails(monkeypatch, exact_joint):
    """The classic bug: after a rejection, draw the bonus from p instead of normalise(max(0, p - q))."""
    monkeypatch.setattr(verify_module, "residual_after_rejection", lambda p, q: p)
    pairs = sample_pairs(SPECS["chain_sampled_drafts"])
    assert chi_square_p(pairs, exact_joint) < 0.01
