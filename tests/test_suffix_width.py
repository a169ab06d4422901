"""``speculative=suffix`` trees with ``speculative.adaptive=true``: the verify width comes from the trees' path
probabilities, calibrated by what verification accepted, and the measured cost of each width: wide trees where a
wide verify costs what a narrow one does (a GPU at small batch), narrow ones or plain steps where it does not (a CPU),
and the engine's output stays token-identical to plain decoding."""

from __future__ import annotations

import random

import pytest

from framework import LLM
from framework.speculative.adaptive import DraftLengthController
from framework.speculative.suffix_width import WidthEstimate, rank_bucket
from tests.conftest import TINY

WIDTHS = [2, 4, 8, 16, 32]


def test_rank_buckets_are_the_nodes_each_width_adds():
    assert [rank_bucket(r) for r in range(8)] == [0, 1, 1, 2, 2, 2, 2, 3]


def test_uncalibrated_estimate_is_one_plus_the_verified_nodes_probabilities():
    est = WidthEstimate([2, 4, 8])
    probs = [[0.9, 0.5, 0.4, 0.2, 0.1, 0.1, 0.05], [0.5]]
    tokens = est.expected_tokens(probs)
    assert tokens[0] == 1.0  # a plain step
    assert tokens[1:] == pytest.approx([1 + (0.9 + 0.5) / 2, 1 + (1.8 + 0.5) / 2, 1 + (2.25 + 0.5) / 2])


def simulate(true_scale: list[float], cost, rounds: int, decay: float = 0.95,
             seed: int = 0) -> tuple[DraftLengthController, list[int]]:
    """Requests whose tree nodes claim path probabilities ``p = decay ** (rank + 1)`` (best first) but are accepted
    with probability ``p * true_scale[bucket]``; an iteration at level k costs ``cost(k)``. Returns the controller and
    the levels chosen."""
    rng = random.Random(seed)
    est, ctl = WidthEstimate(WIDTHS), DraftLengthController(len(WIDTHS), shadow=True)
    claimed = [decay ** (1 + r) for r in range(max(WIDTHS) - 1)]
    chosen, bs = [], 4
    for _ in range(rounds):
        probs = [claimed] * bs
        k = ctl.choose(bs, tokens=est.expected_tokens(probs))
        emitted, accepted = [], []
        for _ in range(bs):  # the accepted nodes: a chain through ranks in order (the tree's best path)
            nodes = [0]
            if k:
                for rank in range(WIDTHS[k - 1] - 1):
                    if rng.random() >= claimed[rank] * true_scale[rank_bucket(rank)] / (
                            claimed[rank - 1] * true_scale[rank_bucket(rank - 1)] if rank else 1.0):
                        break
                    nodes.append(rank + 1)
            accepted.append(nodes)
            emitted.append(len(nodes))
        if k:
            est.record(probs, WIDTHS[k - 1], accepted)
        ctl.record(bs, k, emitted, cost(k))
        chosen.append(k)
    return ctl, chosen


def test_a_cheap_wide_verify_takes_the_widest_trees():
    """Verifying 32 tokens costs 1.1x a plain step (a small model on a GPU) and the trees' claims hold: the widest."""
    _, chosen = simulate([1.0] * 5, cost=lambda k: 1.0 + 0.02 * k, rounds=80)
    assert chosen[-20:].count(len(WIDTHS)) >= 15


def test_a_dear_wide_verify_takes_narrow_trees():
    """A verify costs in proportion to its width (a CPU): the width with the most tokens per second is narrow
    (here width 4: 2.95 tokens for 1.6 plain steps, against 1.8 for 1.1 and 4.16 for 2.6)."""
    _, chosen = simulate([1.0] * 5, cost=lambda k: 1.0 if k == 0 else 0.6 + 0.25 * WIDTHS[k - 1], rounds=120,
                         decay=0.8)
    assert chosen[-40:].count(2) >= 30 and len(WIDTHS) not in chosen[-40:]


def test_overclaimed_wide_nodes_are_calibrated_down():
    """Nodes past rank 2 are accepted a twentieth as often as claimed: the estimate learns it and stops paying for
    the widths that add them (width 8: 3.86 tokens for 1.45 plain steps, width 4: 3.71 for 1.3)."""
    ctl, chosen = simulate([1.0, 1.0, 0.05, 0.05, 0.05], cost=lambda k: 1.0 + 0.15 * k, rounds=150)
    assert chosen[-30:].count(2) >= 20  # width 4: ranks 0-2, the claims that hold


def test_adaptive_trees_are_lossless_and_report_widths():
    prompts = [{"prompt": p, "max_tokens": 24} for p in ["The quick brown fox", "def f(x):\n    return",
                                                          "Once upon a time", "1, 2, 3, 4, 5,"]]
    plain = [o.token_ids for o in LLM(TINY + ["scheduler.max_running_requests=4"]).generate(prompts)]
    llm = LLM(TINY + ["speculative=suffix", "speculative.num_steps=6", "speculative.num_draft_tokens=16",
                      "speculative.adaptive=true", "scheduler.max_running_requests=4"])
    for _ in range(2):  # the second pass drafts from the global tree
        assert [o.token_ids for o in llm.generate(prompts)] == plain
    widths = llm.engine.spec_worker.stats.summary()["chosen_draft_lengths"]
    assert set(widths) <= {"0", "1", "3", "7", "15"} and len(widths) >= 2
    llm.engine.allocator.assert_all_free()
