"""``speculative.adaptive=true``: the goodput model picks the depth with the most tokens per second from measured
acceptance and cost, explores what it has not measured, follows a changing workload, and the engine's output stays
token-identical to plain decoding with the chosen depths reported (n-gram in speculation v2: test_adaptive_v2.py)."""

from __future__ import annotations

import logging
from typing import Optional

import pytest

from framework import LLM
from framework.errors import ConfigError
from framework.speculative.adaptive import REFRESH, DraftLengthController
from tests.conftest import TINY
from tests.test_speculative_lossless import items


def feed(ctl: DraftLengthController, bs: int, accept_depth: int, cost, rounds: int) -> list[int]:
    """Run ``rounds`` iterations where every request accepts ``accept_depth`` drafts (capped by the chosen k) and
    an iteration at depth k costs ``cost(k)`` seconds; returns the depths chosen."""
    chosen = []
    for _ in range(rounds):
        k = ctl.choose(bs)
        ctl.record(bs, k, [1 + min(k, accept_depth)] * bs, cost(k))
        chosen.append(k)
    return chosen


def feed_shadow(ctl: DraftLengthController, bs: int, shadow: list[float], cost, rounds: int,
                rows: Optional[range] = None) -> list[int]:
    """Run ``rounds`` iterations where every request's unverified draft counts ``shadow`` (``[2 * max_depth]``:
    positions compared, then agreed) and an iteration at depth k costs ``cost(k)`` seconds; ``rows``: the requests'
    rows (their own counts). Returns the depths chosen."""
    chosen = []
    for _ in range(rounds):
        k = ctl.choose(bs, rows)
        ctl.record(bs, k, [1] * bs, cost(k), shadow=[shadow] * bs, rows=rows)
        chosen.append(k)
    return chosen


def test_picks_the_depth_with_the_most_tokens_per_second():
    ctl = DraftLengthController(max_depth=4, explore_every=0)
    chosen = feed(ctl, 8, accept_depth=2, cost=lambda k: 1.0 + 0.1 * k, rounds=30)
    assert chosen[:2] == [4, 0]  # the deepest drafts first (every position's acceptance), then a plain step
    assert set(chosen[2:]) == {2}  # 3 tokens for 1.2 s beats 2 tokens / 1.1 s and 3 tokens / 1.3 s
    assert ctl.estimated_cost(8, 2) == pytest.approx(1.2)  # interpolated between depths 0 and 4
    assert ctl.expected_tokens(4) == pytest.approx(3.0)


def test_plain_decoding_when_drafts_do_not_pay():
    ctl = DraftLengthController(max_depth=4, explore_every=0)
    chosen = feed(ctl, 32, accept_depth=0, cost=lambda k: 1.0 + 0.5 * k, rounds=20)
    assert set(chosen[2:]) == {0}


def test_a_batch_size_takes_another_ones_relative_cost():
    """Depth 3 measured only at batch 1 (1.2x a plain step there): at batch 32, whose plain step costs 4.0, it is
    estimated at 1.2x that, not at batch 1's absolute cost, and the depths between are interpolated."""
    ctl = DraftLengthController(max_depth=3, explore_every=0)
    ctl.record(1, 3, [4], 1.2)
    ctl.record(1, 0, [1], 1.0)
    ctl.record(32, 0, [1] * 32, 4.0)
    assert ctl.estimated_cost(32, 3) == pytest.approx(4.8)
    assert ctl.estimated_cost(32, 1) == pytest.approx(4.0 + 0.8 / 3)
    assert ctl.estimated_cost(20, 3) == pytest.approx(4.8)  # nothing measured at 20: as at the nearest, 32


def test_costs_within_a_batch_size_come_before_another_batch_sizes():
    """Depths 0 and 5 measured at batch 1: depth 1 there is interpolated between them, not scaled from batch 7's
    (noisy) depth-1 cost; past the deepest measured depth a cost is extrapolated from the deepest two."""
    ctl = DraftLengthController(max_depth=5, explore_every=0)
    for bs, k, seconds in ((1, 0, 1.0), (1, 5, 2.0), (7, 1, 1.0), (7, 5, 1.05), (8, 0, 3.0), (8, 1, 3.3)):
        ctl.record(bs, k, [1] * bs, seconds)
    assert ctl.estimated_cost(1, 1) == pytest.approx(1.2)
    assert ctl.estimated_cost(8, 5) == pytest.approx(3.0 + 5 * 0.3)


def test_shadow_acceptance_and_plain_steps_first():
    """With acceptance measured from unverified drafts: plain steps first, then depth 1 (its cost); until a draft
    position is compared no speculation is assumed; r_d is the product of each position's chance given the ones
    before it agreed, a position not reached yet taking the last measured chance."""
    ctl = DraftLengthController(max_depth=5, explore_every=0, shadow=True)
    assert ctl.choose(8) == 0
    ctl.record(8, 0, [1] * 8, 1.0, shadow=[[0] * 10])
    assert ctl.expected_tokens(5) == 1.0 and ctl.choose(8) == 1
    # 8 drafts: position 0 agreed for 4 of them, position 1 for 2 of those 4; nothing deeper reached yet
    # (half of the drafts settle 0 deep, a quarter 1 deep, ...)
    ctl.record(8, 1, [1] * 8, 1.1, shadow=[[8, 4, 0, 0, 0, 4, 2, 0, 0, 0]])
    deepest = 1 + 0.5 + 0.25 + 0.125 + 0.0625 + 0.03125  # positions 2 .. 4 take position 1's chance, 0.5
    assert ctl.expected_tokens(5) == pytest.approx(deepest)
    # depth 1's iterations visit the drafts' positions reweighted: P(m) (1 + min(m, 5)) / (1 + min(m, 1))
    p = [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.03125]
    visits = sum(q * (1 + m) / (1 + min(m, 1)) for m, q in enumerate(p))
    assert ctl.expected_tokens(1) == pytest.approx(deepest / visits)
    assert ctl.estimated_cost(8, 3) == pytest.approx(1.3)  # extrapolated from depths 0 and 1
    assert ctl.choose(8) == 2  # 1.83 / 1.2 beats 1.60 / 1.1, 1.92 / 1.3, 1.97 / 1.5
    assert ctl.choose(32) == 0  # a batch size whose plain step was not measured: a plain step first
    assert ctl.choose(9) == 2  # ... unless one within 1.25x of it was: its costs serve as they are


def test_shadow_acceptance_of_the_batchs_own_requests():
    """Rows 0-7 copy whole drafts, rows 8-15 never agree: over all 16 the shared estimate pays a middling depth,
    but a batch of the 8 that never agree (a long request's tail) decodes plainly and the 8 that copy draft the
    deepest; a row a new request takes starts from the shared estimate again."""
    ctl = DraftLengthController(max_depth=4, explore_every=0, shadow=True)
    copying, never = [1, 1, 1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0, 0, 0]  # per draft: reached [4], agreed [4]
    cost = {0: 1.0, 1: 1.3, 2: 1.6, 3: 1.9, 4: 2.2}  # (per iteration, at every batch size)
    for k in cost:
        ctl.record(16, k, [1] * 16, cost[k])
    for _ in range(30):
        ctl.record(16, 0, [1] * 16, 1.0, shadow=[copying] * 8 + [never] * 8, rows=range(16))
    assert 0 < ctl.choose(16, range(16)) < 4
    assert ctl.choose(16, range(8, 16)) == 0 and ctl.choose(16, range(8)) == 4
    assert ctl.choose(16, [*range(8, 16), 99]) == 0  # a row with nothing counted yet adds nothing to the pool
    ctl.forget(range(8))
    assert ctl.choose(16, range(8)) == ctl.choose(16) == 2


def test_shadow_acceptance_explores_only_depths_that_could_pay():
    """Drafts never agree (open-ended prompts): plain steps, the depth-1 probe, and explorations that stay at depth
    1 (at depth-1's cost deeper drafts cannot pay: only their cost was unknown, and it is no lower)."""
    ctl = DraftLengthController(max_depth=4, explore_every=4, shadow=True)
    chosen = feed_shadow(ctl, 8, [1, 0, 0, 0, 0, 0, 0, 0], lambda k: 1.0 + 0.1 * k, rounds=40)
    assert chosen[:2] == [0, 1] and set(chosen) == {0, 1} and chosen.count(1) <= 4


def test_a_cold_first_sample_does_not_stick():
    ctl = DraftLengthController(max_depth=2, cost_alpha=0.2)
    for seconds in (5.0, 1.0, 2.0):  # a new shape's first run, then two warm ones
        ctl.record(4, 2, [3] * 4, seconds)
    assert ctl.cost[(4, 2)] == pytest.approx(0.8 * 1.0 + 0.2 * 2.0)


def test_costs_are_per_batch_size_and_exploration_follows_a_changing_workload():
    ctl = DraftLengthController(max_depth=3, explore_every=4, decay=0.9)
    early = feed(ctl, 1, accept_depth=3, cost=lambda k: 1.0, rounds=40)  # batch 1: drafts are free and accepted
    assert early[:2] == [3, 0] and early[2:].count(3) == 38 - 3
    # explorations 4, 8 and 16 iterations apart (iterations 7, 15, 31: the gap doubles): the depths measured fewer
    # than twice, nearest the choice first
    assert [(i + 1, k) for i, k in enumerate(early) if k != 3][1:] == [(7, 2), (15, 2), (31, 1)]
    assert ctl.cost.keys() == {(1, k) for k in range(4)}
    assert ctl.estimated_cost(8, 2) == ctl.cost[(1, 2)]  # an unmeasured batch size: the nearest measured one's
    assert ctl.estimated_cost(8, 1) == pytest.approx(1.0)  # an unmeasured depth: between depths 0 and 2
    late = feed(ctl, 1, accept_depth=0, cost=lambda k: 1.0 + k, rounds=80)  # then nothing is accepted any more
    assert late[-3:].count(0) >= 2  # back to plain steps (one in four explores)
    assert ctl.expected_tokens(3) < 2.0  # (it was 4: the old observations decay, the deeper ones with them)
    assert max(late[-20:]) <= 1  # exploring next to the best depth: never the deepest drafts again


@pytest.mark.parametrize("drafter", [["speculative=ngram", "speculative.num_steps=4"],
                                     ["speculative=suffix", "speculative.num_steps=4"]])
@pytest.mark.parametrize("batch", [1, 8])
def test_adaptive_output_equals_plain_and_reports_depths(drafter, batch):
    count = 8 if batch > 1 else 3
    plain = [o.token_ids for o in LLM(TINY + ["scheduler.max_running_requests=8"]).generate(items(count))]
    llm = LLM(TINY + drafter + ["speculative.adaptive=true", f"scheduler.max_running_requests={batch}"])
    assert llm.engine.spec_version == ("v2" if "speculative=ngram" in drafter else "v1")  # (suffix drafts trees)
    assert [o.token_ids for o in llm.generate(items(count))] == plain
    summary = llm.engine.spec_worker.stats.summary()
    depths = summary["chosen_draft_lengths"]  # suffix trees: a verify width's draft tokens (num_draft_tokens 8)
    allowed = range(5) if "speculative=ngram" in drafter else (0, 1, 3, 7)
    assert set(depths) <= {str(k) for k in allowed} and len(depths) >= 2  # measured several
    llm.engine.allocator.assert_all_free()


def test_adaptive_with_a_model_drafter_fails_in_one_line_and_trees_fall_back_to_v1(caplog):
    with pytest.raises(ConfigError) as err:
        LLM(TINY + ["speculative=eagle", "speculative.num_steps=2", "speculative.adaptive=true"])
    assert "speculative.adaptive" in str(err.value) and "ngram, suffix" in str(err.value)
    with caplog.at_level(logging.INFO, logger="framework.engine"):
        llm = LLM(TINY + ["speculative=ngram", "speculative.adaptive=true", "speculative.version=v2",
                          "speculative.topk=2", "speculative.num_draft_tokens=6"])
    assert llm.engine.spec_version == "v1"  # (ngram chains run v2: tests/test_adaptive_v2.py)
    assert any("topk=2" in r.getMessage() and "running v1" in r.getMessage() for r in caplog.records)


def test_shadow_acceptance_does_not_explore_a_verify_that_cannot_pay():
    """Drafts never agree and a verify of two tokens per request costs 1.6 plain steps (a CPU): after the depth-1
    probe, no iteration drafts (an exploration would cost 60% of a step for nothing)."""
    ctl = DraftLengthController(max_depth=4, explore_every=4, shadow=True)
    cost = lambda k: 1.0 + 0.6 * k  # noqa: E731
    chosen = feed_shadow(ctl, 8, [1, 0, 0, 0, 0, 0, 0, 0], cost, rounds=200)
    assert chosen[:2] == [0, 1] and chosen.count(1) == 1 and set(chosen) == {0, 1}
    # new requests whose drafts agree: depth pays, and is found without exploring
    later = feed_shadow(ctl, 8, [1] * 8, cost, rounds=20, rows=range(8, 16))
    assert later[-1] == 4, later


def test_shadow_acceptance_tries_a_deeper_depth_that_would_clearly_pay():
    """Depths 0-3 measured, depth 3 once at a noisy 1.5x its true cost: extrapolated, depths 4-5 look too dear to
    beat depth 2, though every draft agrees. The controller measures them at once (their lower bound, depth 3's
    cost, already pays clearly), not at its next exploration, and settles at depth 5."""
    ctl = DraftLengthController(max_depth=5, explore_every=16, max_explore_gap=256, shadow=True)
    cost = lambda k: 1.0 + 0.05 * k  # noqa: E731
    for k, seconds in ((0, 1.0), (1, cost(1)), (2, cost(2)), (2, cost(2)), (3, 1.5 * cost(3)), (3, 1.5 * cost(3))):
        ctl.record(1, k, [1 + k], seconds, shadow=[[1] * 5 + [1] * 5], rows=[1])
    chosen = feed_shadow(ctl, 1, [1] * 10, cost, rounds=8, rows=range(1, 2))
    assert 4 in chosen[:3] or 5 in chosen[:3], chosen
    assert chosen[-1] == 5, chosen


def test_shadow_acceptance_bounds_a_deep_verify_by_the_slope_of_two_verifies():
    """A CPU at batch 64: a verify's cost grows with its rows (depth 1: 1.6, depth 2: 2.2 plain steps), and drafts
    agree 80% a position. Depths 4-5 could pay at depth 2's cost, but not at 2.2 + 0.6 a depth: not explored (depth
    3 may be, as a neighbour of the choice)."""
    ctl = DraftLengthController(max_depth=5, explore_every=4, shadow=True)
    cost = lambda k: 1.0 + 0.6 * k  # noqa: E731
    agree = [1.0] * 5 + [0.8] * 5  # per request an iteration: positions 0-4 compared, 0.8 of each agreed
    chosen = feed_shadow(ctl, 64, agree, cost, rounds=120)
    assert max(chosen) <= 3, chosen


def test_the_choice_stands_for_refresh_iterations_and_follows_a_new_batch_at_once(monkeypatch):
    """The goodput model runs once every ``REFRESH`` iterations of the same batch (its Python costs the host more than
    a small model's iteration leaves to spare), at once for other rows or a forgotten row, and acceptance that falls
    still brings the choice down, step by step, to a depth of 1 or less."""
    ctl = DraftLengthController(max_depth=4, explore_every=0, shadow=True)
    cost = lambda k: 1.0 + 0.1 * k  # noqa: E731
    feed_shadow(ctl, 8, [1] * 8, cost, rounds=40, rows=range(8))  # every draft agrees: the deepest
    runs = []
    real = ctl.expected_tokens_by_depth
    monkeypatch.setattr(ctl, "expected_tokens_by_depth", lambda rows=None: runs.append(rows) or real(rows))
    chosen = feed_shadow(ctl, 8, [1] * 8, cost, rounds=8 * REFRESH, rows=range(8))
    assert set(chosen) == {4} and len(runs) == 8
    ctl.choose(8, range(1, 9))  # other requests
    ctl.forget([3])
    ctl.choose(8, range(1, 9))
    assert len(runs) == 10
    # the rows stop agreeing: the choice falls as their counts decay (per draft they start), never standing still
    # longer than REFRESH iterations of a changing estimate
    chosen = feed_shadow(ctl, 8, [1, 0, 0, 0, 0, 0, 0, 0], cost, rounds=6 * REFRESH, rows=range(1, 9))
    assert chosen == sorted(chosen, reverse=True) and chosen[-1] <= 1, chosen
