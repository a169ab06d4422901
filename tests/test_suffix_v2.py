"""``speculative=suffix`` in speculation v2 (chains drafted on the device): the batched drafting equals its host
reference on fresh random inputs and v1's chain drafts where it counts every occurrence; the corpus of finished
requests stays within ``suffix_cache_tokens`` and evicts the oldest; v2 output is token-identical to plain decoding and
to v1, repeated requests accept far more than n-gram, and no KV slot leaks."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest
import torch

from framework import LLM
from framework.request import Request
from framework.sampling import SamplingParams
from framework.speculative.suffix import SuffixDrafter
from framework.speculative.suffix_corpus import SuffixCorpus
from framework.speculative.suffix_device import SEP, chain_limits, suffix_chain_device, suffix_chain_reference
from tests.conftest import TINY
from tests.test_speculative_lossless import items

CHAIN = ["speculative=suffix", "speculative.num_steps=4", "speculative.topk=1", "speculative.num_draft_tokens=0"]
CPU = torch.device("cpu")


def random_case(rng: random.Random, capacity: int, bs: int = 4, width: int = 40):
    """Knobs, a corpus of random sequences (``capacity`` slots) and histories that end with pieces of them."""
    knobs = dict(num_steps=rng.randint(1, 6), max_depth=rng.randint(2, 9), factor=rng.choice([0.5, 1.0, 2.0, 3.0]),
                 offset=rng.choice([0.0, 1.0, -1.0]), min_prob=rng.choice([0.0, 0.1, 0.3, 0.6]))
    vocab = rng.randint(2, 6)
    seqs = [[rng.randrange(vocab) for _ in range(rng.randint(1, 20))] for _ in range(rng.randint(0, 6))]
    corpus = SuffixCorpus(capacity, CPU)
    corpus.add(seqs)
    rows = []
    for _ in range(bs):
        row = [rng.randrange(vocab) for _ in range(rng.randint(1, width))]
        if seqs and rng.random() < 0.6:  # a planted repeat: the request ends like a finished one began
            seq = rng.choice(seqs)
            row = (row + seq[:rng.randint(1, len(seq))])[-width:]
        rows.append(row)
    history = torch.zeros(bs, width, dtype=torch.int64)
    for b, row in enumerate(rows):
        history[b, :len(row)] = torch.tensor(row)
    lens = torch.tensor([len(r) for r in rows])
    return knobs, seqs, corpus, rows, history, lens


def device_drafts(knobs: dict, corpus: SuffixCorpus, history: torch.Tensor, lens: torch.Tensor,
                  max_occurrences: int) -> list[list[int]]:
    limits = chain_limits(knobs["num_steps"], knobs["max_depth"], knobs["factor"], knobs["offset"])
    drafts, valid = suffix_chain_device(history, lens, corpus.tokens, corpus.start, torch.tensor(limits),
                                        knobs["num_steps"], knobs["min_prob"], max_occurrences)
    assert drafts.shape == valid.shape == (history.shape[0], knobs["num_steps"]) and drafts.dtype == torch.int64
    assert bool((drafts >= 0).all())  # token ids even where invalid: the verify forward embeds them
    assert torch.equal(valid, torch.cummin(valid.to(torch.int64), dim=1).values.bool())  # a prefix of each row
    window = corpus.window()  # eager drafting scans the filled slots only: the same drafts
    drafts_w, valid_w = suffix_chain_device(history, lens, window[0] if window else None,
                                            window[1] if window else None, torch.tensor(limits), knobs["num_steps"],
                                            knobs["min_prob"], max_occurrences)
    assert torch.equal(valid_w, valid) and torch.equal(drafts_w[valid], drafts[valid])
    # the form compiled graphs take with suffix_device.FUSED_GRAPH (both sources as one batch, the ring rotated to its
    # oldest slot, the shorter source padded; each step's counts as a reduction): the same drafts over the ring, over
    # the window, and without a corpus
    for ring, start in ((corpus.tokens, corpus.start), window or (None, None)):
        drafts_b, valid_b = suffix_chain_device(history, lens, ring, start, torch.tensor(limits), knobs["num_steps"],
                                                knobs["min_prob"], max_occurrences, fused_graph=True)
        assert torch.equal(valid_b, valid) and torch.equal(drafts_b, drafts)
    return [d[v].tolist() for d, v in zip(drafts, valid)]


@pytest.mark.parametrize("seed", range(6))
def test_device_chain_equals_the_host_reference(seed):
    """Random histories and corpora (small rings that evict, few counted occurrences): the reference's drafts."""
    rng = random.Random(seed)
    for _ in range(8):
        occurrences = rng.choice([3, 8, 64])
        knobs, _, corpus, rows, history, lens = random_case(rng, capacity=rng.randint(2, 60))
        limits = chain_limits(knobs["num_steps"], knobs["max_depth"], knobs["factor"], knobs["offset"])
        want = [suffix_chain_reference(row, corpus.sequences(), knobs["num_steps"], knobs["max_depth"], limits,
                                       knobs["min_prob"], occurrences) for row in rows]
        assert device_drafts(knobs, corpus, history, lens, occurrences) == want


def test_device_chain_equals_v1_chain_drafts():
    """Where every occurrence is counted and nothing was evicted, the draft is v1's (SuffixDrafter, topk=1)."""
    rng = random.Random(0)
    drafted = 0
    for _ in range(60):
        knobs, seqs, corpus, rows, history, lens = random_case(rng, capacity=200, bs=1)
        cfg = SimpleNamespace(topk=1, num_steps=knobs["num_steps"], num_draft_tokens=knobs["num_steps"] + 1,
                              suffix_max_depth=knobs["max_depth"], suffix_cache_tokens=10_000,
                              max_spec_factor=knobs["factor"], max_spec_offset=knobs["offset"],
                              min_token_prob=knobs["min_prob"])
        v1 = SuffixDrafter(SimpleNamespace(device="cpu"), cfg)
        for seq in seqs:
            v1.remember(seq)
        req = Request(rid=0, prompt_ids=rows[0][:1], params=SamplingParams(), seed=0, max_new_tokens=99)
        req.output_ids = rows[0][1:]
        want = [token for token, _, _ in v1.draft(req)]
        drafted += bool(want)
        assert device_drafts(knobs, corpus, history, lens, max_occurrences=200) == [want]
    assert drafted > 30


def test_corpus_is_bounded_and_evicts_the_oldest():
    corpus = SuffixCorpus(20, CPU)
    corpus.add([[1, 2, 3], [4, 5, 6, 7]])
    assert corpus.sequences() == [[1, 2, 3], [4, 5, 6, 7]] and corpus.num_tokens == 7
    corpus.add([list(range(10, 40))])  # longer than the ring: its last 19 tokens, everything older evicted
    assert corpus.sequences() == [list(range(21, 40))]
    for i in range(12):  # more requests than the ring holds: the oldest go first, whole
        corpus.add([[100 + i] * 4])
        held = corpus.sequences()
        assert held[-1] == [100 + i] * 4 and corpus.num_tokens + len(held) <= 20
        assert [s[0] for s in held] == sorted(s[0] for s in held)  # oldest first, contiguous in age
        tokens = corpus.tokens.tolist()  # the device ring: the held tokens, a separator after each, nothing else
        assert sorted(t for t in tokens if t != SEP) == sorted(t for s in held for t in s)
        assert tokens.count(SEP) == 20 - corpus.num_tokens
    assert corpus.sequences() == [[108] * 4, [109] * 4, [110] * 4, [111] * 4]
    # an evicted request no longer drafts; a held one does
    history = torch.tensor([[7, 107, 107, 0], [7, 111, 111, 0]])
    knobs = dict(num_steps=3, max_depth=8, factor=3.0, offset=0.0, min_prob=0.1)
    assert device_drafts(knobs, corpus, history, torch.tensor([2, 2]), 64) == [[], [111, 111, 111]]


def mean_accept(outs) -> float:
    return sum(o.spec["mean_accept_len"] for o in outs) / len(outs)


def test_version_auto_runs_chains_in_v2_and_trees_in_v1(caplog):
    with caplog.at_level(logging.INFO, logger="framework.engine"):
        trees = LLM(TINY + ["speculative=suffix"])
    assert trees.engine.spec_version == "v1"  # (the yaml's trees: v2 runs chains only, and the log line says so)
    assert any("speculative.version=auto: running v1" in r.getMessage() and "topk=1" in r.getMessage()
               for r in caplog.records)
    auto = LLM(TINY + CHAIN)
    assert auto.engine.spec_version == "v2"  # (its chains have given v1's tokens on a GPU: v2_by_default)
    v2 = LLM(TINY + CHAIN + ["speculative.version=v2", "scheduler.overlap=on"])
    assert v2.engine.spec_version == "v2" and v2.engine.spec_worker.version == "v2" and v2.engine.overlap
    assert v2.engine.drafter.corpus is not None and v2.engine.drafter.corpus.capacity == 16384


@pytest.fixture(scope="module")
def reference():
    return [o.token_ids for o in LLM(TINY + ["scheduler.max_running_requests=8"]).generate(items())]


@pytest.mark.parametrize("batch,page_size", [(1, 1), (8, 16)])
def test_v2_equals_plain_and_v1(reference, batch, page_size):
    common = CHAIN + [f"scheduler.max_running_requests={batch}", f"kv.page_size={page_size}"]
    count = len(reference) if batch > 1 else 3
    for version, overlap in (("v1", "off"), ("v2", "off"), ("v2", "on")):
        llm = LLM(TINY + common + [f"speculative.version={version}", f"scheduler.overlap={overlap}"])
        assert llm.engine.spec_version == version
        for _ in range(2):  # the second time, the first time's requests are in the corpus (v2) / global tree (v1)
            assert [o.token_ids for o in llm.generate(items(count))] == reference[:count]
        assert llm.engine.spec_worker.stats.num_verify_steps > 0
        llm.engine.allocator.assert_all_free()


def test_repeated_requests_accept_more_than_ngram(reference):
    """The same requests a second time draft from the corpus: at least 1.5x the tokens per step of v2 n-gram.
    A small corpus keeps the last requests only, and holds exactly their prompt + output."""
    common = ["scheduler.max_running_requests=8", "speculative.version=v2"]
    ngram = LLM(TINY + ["speculative=ngram", "speculative.num_steps=4"] + common)
    ngram.generate(items())
    ngram_accept = mean_accept(ngram.generate(items()))
    llm = LLM(TINY + CHAIN + common)
    first = llm.generate(items())
    second = llm.generate(items())
    assert [o.token_ids for o in first] == reference == [o.token_ids for o in second]
    assert mean_accept(second) >= 1.5 * ngram_accept
    llm.engine.allocator.assert_all_free()
    small = LLM(TINY + CHAIN + common + ["speculative.suffix_cache_tokens=64"])
    reqs = [small.engine.make_request(it, rid=i) for i, it in enumerate(items())]
    for req in reqs:
        small.engine.submit(req)
    while small.engine.has_work():
        small.engine.step()
    corpus = small.engine.drafter.corpus
    held = corpus.sequences()
    assert held and corpus.num_tokens + len(held) <= 64
    drafted = sorted((r for r in reqs if r.spec_verify_steps), key=lambda r: r.finish_s)  # (v2 applied them)
    done = [(r.prompt_ids + r.output_ids)[-63:] for r in drafted]
    assert held == done[len(done) - len(held):]  # the last finished, in order; the oldest evicted
    assert len(held) < len(done)
    small.engine.allocator.assert_all_free()
