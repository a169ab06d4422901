"""bench/suffix_replay.py: the replay counts tokens per iteration as the engine does, and its bound is a bound."""

import importlib.util
import os
import random

import pytest


_PATH = os.path.join(os.path.dirname(__file__), "..", "bench", "suffix_replay.py")
_spec = importlib.util.spec_from_file_location("suffix_replay", _PATH)
replay = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replay)


def _pairs(seed: int) -> list[tuple[list[int], list[int]]]:
    """Requests over a small vocabulary whose outputs share a skeleton with fresh tokens in it."""
    rng = random.Random(seed)
    skeleton = [rng.randrange(20) for _ in range(12)]
    pairs = []
    for _ in range(5):
        out = [t if rng.random() < 0.7 else 20 + rng.randrange(200) for t in skeleton * 3]
        pairs.append(([rng.randrange(220) for _ in range(8)], out))
    return pairs


@pytest.mark.parametrize("knobs", ["", "max_spec_factor=4 topk=1", "num_steps=3 min_token_prob=0.3"])
def test_bound_is_at_least_what_the_drafter_accepts(knobs):
    for seed in range(3):
        pairs = _pairs(seed)
        k = replay.parse_knobs(knobs)
        got = replay.suffix_run(pairs, k, 2)
        bound = replay.suffix_run(pairs, k, 2, bound=True)
        assert all(1.0 <= g <= b + 1e-9 for g, b in zip(got, bound)), (got, bound)
    assert got[1] > got[0]  # the repeat pass draws on the first pass's outputs


@pytest.mark.parametrize("knobs,shape", [("topk=1 num_draft_tokens=0", (1, 8)), ("topk=0 num_draft_tokens=0", (4, 8)),
                                         ("topk=0 num_draft_tokens=16", (4, 16)),
                                         ("topk=2 num_draft_tokens=0", (2, 8))])
def test_auto_knobs_resolve_as_the_cpu_config_does(knobs, shape):
    k = replay.parse_knobs(knobs)
    assert (k["topk"], k["num_draft_tokens"]) == shape
    assert replay.suffix_run(_pairs(0), k, 1)[0] >= 1.0


def test_a_repeated_request_is_drafted_whole():
    out = list(range(100, 140))
    got = replay.suffix_run([([1, 2, 3], out)], replay.parse_knobs("num_steps=8 num_draft_tokens=16"), 2)
    # first sight: nothing to draw on (all tokens distinct); repeat: 8-deep drafts of the remembered output
    assert got[0] == 1.0
    assert got[1] == pytest.approx(39 / 5)  # 39 tokens after the prefill's, in 4 steps of 9 and one of 3


def test_ngram_replay_matches_its_chain():
    out = [5, 6, 7, 8] * 6  # periodic: the chain is always right
    got = replay.ngram_run([([5, 6, 7, 8], out)], 1)[0]
    # the most recent match sits one period back, so every chain has 4 tokens: 23 tokens after the prefill's in
    # iterations of 5, 5, 5, 5 and 3
    assert got == pytest.approx(23 / 5)


@pytest.mark.parametrize("knobs", ["topk=1", "max_spec_factor=4 num_draft_tokens=8 topk=1"])
def test_merged_drafts_replay_the_drafter_and_stay_within_the_bound(knobs):
    k = replay.parse_knobs(knobs)
    for seed in range(3):
        pairs = _pairs(seed)
        one = replay.merged_run(pairs, k, 1, 2)
        assert one == replay.suffix_run(pairs, k, 2)  # one match merged: a chain's own draft (the best match)
        bound = replay.suffix_run(pairs, k, 2, bound=True)
        tree = replay.parse_knobs(knobs.replace("topk=1", "topk=4"))
        assert all(1.0 <= m <= b + 1e-9 for m, b in zip(replay.merged_run(pairs, tree, 4, 2), bound))
