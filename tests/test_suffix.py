"""``speculative=suffix``: the suffix trees count every substring exactly (also after evictions), drafts follow the
counts, the match length and the knobs, finished requests feed the global tree (bounded), and output is
token-identical to plain decoding (the lossless matrix in test_speculative_lossless.py covers it too; v2's chains:
test_suffix_v2.py)."""

from __future__ import annotations

import logging
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from framework import LLM
from framework.errors import ConfigError
from framework.request import Request
from framework.sampling import SamplingParams
from framework.speculative.suffix import SuffixDrafter
from framework.speculative.suffix_tree import ROOT, SuffixTree, grow_draft
from tests.conftest import TINY

SUFFIX = ["speculative=suffix", "speculative.num_steps=4"]


def substring_counts(seqs: list[list[int]], depth: int) -> Counter:
    counts: Counter = Counter()
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + depth) + 1):
                counts[tuple(seq[i:j])] += 1
    return counts


def tree_counts(tree: SuffixTree) -> Counter:
    counts: Counter = Counter()
    stack = [((), ROOT)]
    while stack:
        path, node = stack.pop()
        for token, child in (tree.kids[node] or {}).items():
            counts[path + (token,)] = tree.counts[child]
            stack.append((path + (token,), child))
    return counts


@pytest.mark.parametrize("seed", range(5))
def test_tree_counts_every_substring_and_removal_is_exact(seed):
    rng = random.Random(seed)
    depth = rng.randint(2, 7)
    seqs = [[rng.randrange(4) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    tree = SuffixTree(depth)
    active = None
    for part in (seqs[0][:10], seqs[0][10:]):  # incremental: one sequence in two calls
        active = tree.add(part, active)
    for seq in seqs[1:]:
        tree.add(seq)
    assert tree_counts(tree) == substring_counts(seqs, depth)
    tree.add(seqs[1], sign=-1)
    tree.add(seqs[3], sign=-1)
    assert tree_counts(tree) == substring_counts([seqs[0], seqs[2]], depth)
    tree.add(seqs[0], sign=-1)
    tree.add(seqs[2], sign=-1)
    assert tree.num_nodes() == 0


def test_removed_nodes_are_recycled():
    """A tree that adds and evicts sequences for long (the global tree) keeps its id lists as long as the most nodes
    it held at once, and counts its nodes right throughout."""
    rng = random.Random(0)
    tree, held, peak = SuffixTree(6), [], 0
    for _ in range(300):
        seq = [rng.randrange(5) for _ in range(rng.randint(1, 30))]
        tree.add(seq)
        held.append(seq)
        peak = max(peak, tree.num_nodes())
        while len(held) > 4:
            tree.add(held.pop(0), sign=-1)
        assert tree.num_nodes() == len(tree_counts(tree)) == len(substring_counts(held, 6))
        assert tree_counts(tree) == substring_counts(held, 6)
    assert len(tree.kids) == len(tree.counts) <= peak + 1
    for seq in held:
        tree.add(seq, sign=-1)
    assert tree.num_nodes() == 0 and not tree.kids[ROOT] and set(tree.counts) == {0}


@pytest.mark.parametrize("seed", range(5))
def test_a_requests_matches_come_from_its_suffix_nodes(seed):
    """The request's own matches, read off its suffix nodes, are its tree's walks from the root."""
    rng = random.Random(seed)
    d = drafter(suffix_max_depth=rng.randint(2, 9))
    req = request([rng.randrange(4) for _ in range(rng.randint(1, 5))])
    for _ in range(40):
        state = d._state(req)
        tail = state.sync(req)
        assert state.matches() == state.tree.matches(tail)
        req.output_ids += [rng.randrange(4) for _ in range(rng.randint(1, 4))]


def test_match_is_the_longest_suffix_with_a_continuation():
    tree = SuffixTree(8)
    tree.add([1, 2, 3, 4, 9, 2, 3, 5, 2, 3])
    node, length = tree.matches([7, 1, 2, 3])[0]
    assert length == 3 and set(tree.kids[node]) == {4}  # "1 2 3" occurred once, followed by 4
    found = tree.matches([8, 2, 3])
    assert [length for _, length in found] == [2, 1]  # every matched length, longest first
    node, length = found[0]
    assert length == 2 and {t: tree.counts[c] for t, c in tree.kids[node].items()} == {4: 1, 5: 1}
    assert tree.matches([6]) == []


def test_draft_follows_the_counts_the_threshold_and_the_limits():
    tree = SuffixTree(10)
    # after "7 0": 1 twice (then 2 2), 3 once
    tree.add([0, 1, 2, 2, 7, 0, 1, 2, 2, 7, 0, 1, 2, 2, 7, 0, 3])
    node, _ = tree.matches([7, 0])[0]
    nodes, probs = grow_draft([(tree, node, 1.0)], budget=8, max_depth=3, max_children=2, min_prob=0.0)
    assert nodes[0] == (1, 0, 1)  # the most probable child first (2 of 3)
    assert all(parent < i for i, (_, parent, _) in enumerate(nodes, start=1))  # parents first
    assert max(d for _, _, d in nodes) <= 3 and len(nodes) <= 8
    assert sum(probs) == pytest.approx(3 * 2 / 3 + 1 / 3)  # 1, 1 2, 1 2 2; 3
    assert probs == sorted(probs, reverse=True)  # best first
    nodes, _ = grow_draft([(tree, node, 1.0)], budget=8, max_depth=3, max_children=2, min_prob=0.5)
    assert [t for t, _, _ in nodes] == [1, 2, 2]  # 3 (1/3) is dropped
    nodes, _ = grow_draft([(tree, node, 1.0)], budget=2, max_depth=3, max_children=1, min_prob=0.0)
    assert nodes == [(1, 0, 1), (2, 1, 2)]


def test_a_tree_backs_off_from_the_longest_match_to_shorter_ones():
    """Several matches: a token's probability is their length-weighted mean over those that continue the path, so
    what only a shorter context has seen still drafts, and a longer context's continuation ranks first."""
    tree = SuffixTree(10)
    tree.add([5, 7, 0, 1, 9, 9, 9, 6, 0, 2, 3, 8, 0, 2, 3])  # after "7 0": 1 (then 9); after "0": 1 once, 2 twice
    (long, two), (short, one) = tree.matches([7, 0])
    assert (two, one) == (2, 1)
    nodes, probs = grow_draft([(tree, long, 2.0), (tree, short, 1.0)], budget=8, max_depth=3, max_children=2, min_prob=0.0)
    tokens = {(t, d) for t, _, d in nodes}  # (token, depth)
    # depth 1: 1 = (2 * 1 + 1 * 1/3) / 3 = 7/9 first, 2 = (1 * 2/3) / 3 = 2/9
    assert nodes[0] == (1, 0, 1) and (2, 1) in tokens
    # below "1": only the longer context has been further ("7 0 1" -> 9); below "2": the shorter one ("0 2" -> 3)
    assert (9, 2) in tokens and (3, 2) in tokens
    assert sum(probs) == pytest.approx(7 / 9 + 2 / 9 + 7 / 9 + 2 / 9 + 7 / 9 + 2 / 9)  # 1, 2; 1 9, 2 3; 1 9 9, 2 3 8
    alone, _ = grow_draft([(tree, long, 1.0)], budget=8, max_depth=3, max_children=2, min_prob=0.0)
    assert [t for t, _, _ in alone] == [1, 9, 9]  # one match: its own counts only


def test_tree_drafts_merge_every_match_and_chains_keep_the_best_one():
    seq = [4, 1, 2, 3, 9, 4, 1, 2, 5, 9, 4, 1, 2, 3, 9, 4, 1]  # after "4 1": 2, then 3 twice and 5 once
    tree = drafter(topk=2, num_draft_tokens=12, max_spec_factor=4.0).draft(request(seq))
    chain = drafter(topk=1, num_draft_tokens=12, max_spec_factor=4.0).draft(request(seq))
    assert tree[0] == (2, 0, 1) and {t for t, _, d in tree if d == 2} == {3, 5}  # both continuations of "4 1 2"
    assert [t for t, _, _ in chain][:3] == [2, 5, 9]  # "2 3 9 4 1" (the longest match) went on 2 5 9


def test_a_short_tree_fills_the_rows_its_batch_verifies_anyway():
    """Trees: a draft grows into the batch's verify width past the match-length budget and min_token_prob, its own
    nodes first and unchanged; chains do not (they stay what the device drafts in speculation v2)."""
    seq = list(range(20)) + [50] + list(range(20)) + [51] + [0, 1]  # "0 1" matched: a 2-token budget
    d = drafter(max_spec_factor=1.0, min_token_prob=0.6, num_draft_tokens=16)
    short = request(seq)
    own = d.draft(short)
    assert len(own) == 2
    filled = d.draft(short, fill=7)
    assert filled[:2] == own and len(filled) == 6  # as far as num_steps (6) goes down the one path
    rows, n = d.batch_drafts([short, request(seq[:32])])  # the second: "0 .. 10" matched, 6 deep
    assert n == 8 and rows[0] == filled and rows[1] == d.draft(request(seq[:32])) and len(rows[1]) == 6
    chains = drafter(topk=1, max_spec_factor=1.0)
    assert chains.batch_drafts([request(seq), request(seq[:32])])[0][0] == chains.draft(request(seq))


def test_one_growth_gives_the_draft_and_its_fill():
    """A tree's draft (the match-length budget, ``min_token_prob``) is the first nodes of its growth past both, the
    same nodes a growth bounded by both drafts: one growth serves the draft and the rows its batch fills."""
    rng = random.Random(7)
    for _ in range(40):
        seq = [rng.randrange(6) for _ in range(rng.randrange(8, 80))]
        d = drafter(min_token_prob=rng.choice([0.0, 0.1, 0.3]), max_spec_factor=rng.choice([0.5, 1.0, 2.0]))
        req = request(seq)
        own = d.draft(req)
        matches = [(tree, node, length) for tree in (req.drafter_state.tree, d.global_tree)
                   for node, length in tree.matches(d._state(req).sync(req))]
        if not matches:
            assert own == [] and d.draft(req, fill=5) == []
            continue
        budget = min(11, int(d.cfg.max_spec_factor * max(n for _, _, n in matches)))
        states = [(tree, node, float(length)) for tree, node, length in matches]
        assert own == (grow_draft(states, budget, 6, 2, d.cfg.min_token_prob)[0] if budget >= 1 else [])
        filled = d.draft(req, fill=9)
        assert filled[: len(own)] == own and len(filled) <= 9
        assert filled == (grow_draft(states, 9, 6, 2, 0.0)[0] if len(own) < 9 else own)


def drafter(**cfg) -> SuffixDrafter:
    base = dict(topk=2, num_steps=6, num_draft_tokens=12, suffix_max_depth=12, suffix_cache_tokens=64,
                max_spec_factor=1.0, max_spec_offset=0.0, min_token_prob=0.1)
    return SuffixDrafter(SimpleNamespace(device="cpu"), SimpleNamespace(**{**base, **cfg}))


def request(prompt: list[int], output: list[int] = (), reason=None) -> Request:
    req = Request(rid=0, prompt_ids=list(prompt), params=SamplingParams(), seed=0, max_new_tokens=99)
    req.output_ids = list(output)
    req.finish_reason = reason
    return req


def test_draft_size_follows_the_match_length():
    d = drafter(max_spec_factor=1.0)
    seq = list(range(20)) + [50] + list(range(20))  # the second copy repeats the first
    assert len(d.draft(request(seq[:22]))) == 1  # "0" matched: 1 token
    assert len(d.draft(request(seq[:26]))) == 5  # "0 1 2 3 4" matched: 5 tokens
    assert len(drafter(max_spec_factor=0.5).draft(request(seq[:26]))) == 2
    assert len(drafter(max_spec_factor=0.0, max_spec_offset=3).draft(request(seq[:26]))) == 3
    assert drafter(max_spec_factor=0.0).draft(request(seq[:26])) == []


def test_finished_requests_feed_the_bounded_global_tree():
    d = drafter(suffix_cache_tokens=64)
    done = request([5, 6, 7], [8, 9, 10, 11, 12], reason="stop")
    d.draft(done)
    d._retire_finished()
    assert d._cached_tokens == 8 and done.drafter_state is None
    fresh = request([1, 5, 6, 7])  # a new request whose prompt ends like the finished one's
    assert [t for t, _, _ in d.draft(fresh)] == [8, 9, 10]  # from the global tree (3 tokens matched)
    for i in range(20):  # more finished requests than the cache holds: the oldest go first
        d.remember([100 + i] * 7)
        assert d._cached_tokens <= 64
    assert d._cached[0] != [5, 6, 7, 8, 9, 10, 11, 12] and d.global_tree.matches([5, 6, 7]) == []
    assert sum(map(len, d._cached)) == d._cached_tokens
    errored = request([1, 2], [3], reason="error")
    d.draft(errored)
    cached = list(d._cached)
    d._retire_finished()
    assert list(d._cached) == cached and errored.drafter_state is None  # a failed request's tokens are not kept


def test_repeated_requests_accept_more_and_stay_lossless(caplog):
    prompts = [{"prompt": p, "max_tokens": 24} for p in ["The quick brown fox", "def f(x):\n    return",
                                                          "Once upon a time"]]
    plain = [o.token_ids for o in LLM(TINY + ["scheduler.max_running_requests=4"]).generate(prompts)]
    with caplog.at_level(logging.INFO, logger="framework.engine"):
        llm = LLM(TINY + SUFFIX + ["scheduler.max_running_requests=4", "speculative.version=v2", "speculative.topk=4"])
    assert llm.engine.spec_version == "v1"  # v2 runs chains; trees (topk=4) run v1: one log line says why
    assert sum("speculative.version=v2: running v1" in r.getMessage() for r in caplog.records) == 1
    first = llm.generate(prompts)
    second = llm.generate(prompts)
    assert [o.token_ids for o in first] == plain == [o.token_ids for o in second]
    accept = [sum(o.spec["mean_accept_len"] for o in outs) / len(outs) for outs in (first, second)]
    assert accept[1] > 1.5 * accept[0]  # the same requests again: drafted from the global tree
    llm.engine.allocator.assert_all_free()


def test_the_default_shape_is_trees_on_the_cpu():
    llm = LLM(TINY + ["speculative=suffix", "scheduler.max_running_requests=2"])
    spec = llm.engine.config.speculative
    assert (spec.topk, spec.num_draft_tokens, llm.engine.spec_version) == (4, 8, "v1")
    llm.close()


@pytest.mark.parametrize("device,knobs,shape", [
    ("cuda", {}, (1, 0)),  # chains, drafted on the device in v2 (num_draft_tokens: the chain's, resolved later)
    ("cpu", {}, (4, 8)),
    ("cuda", {"version": "v1"}, (4, 8)),  # v1's host-drafted iteration: trees
    ("cpu", {"version": "v2"}, (1, 0)),  # v2 runs chains
    ("cuda", {"num_draft_tokens": 16}, (4, 16)),  # a tree's budget asks for a tree
    ("cuda", {"num_draft_tokens": 8}, (1, 8)),  # a chain's num_steps + 1 does not
    ("cuda", {"topk": 2}, (2, 8)),  # an explicit topk stays; a tree's auto budget is TREE_DRAFT_TOKENS
    ("cpu", {"topk": 1}, (1, 0)),
])
def test_auto_shape(device, knobs, shape):
    from framework.speculative.suffix import resolve_auto_shape
    cfg = SimpleNamespace(**{"topk": 0, "num_draft_tokens": 0, "num_steps": 7, "version": "auto", **knobs})
    resolve_auto_shape(cfg, device)
    assert (cfg.topk, cfg.num_draft_tokens) == shape


@pytest.mark.parametrize("override,allowed", [("speculative.min_token_prob=1.5", "a number in [0, 1]"),
                                              ("speculative.topk=-1", "0 (auto) or an integer >= 1"),
                                              ("speculative.suffix_max_depth=1", "an integer >= 2"),
                                              ("speculative.max_spec_factor=-1", "a number >= 0")])
def test_bad_knobs_fail_in_one_line(override, allowed):
    with pytest.raises(ConfigError) as err:
        LLM(TINY + SUFFIX + [override])
    assert allowed in str(err.value) and "\n" not in str(err.value)
