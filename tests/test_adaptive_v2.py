"""``speculative.adaptive=true`` in speculation v2 (tiny_llama, CPU): the host picks each iteration's verify width
(1 .. num_steps + 1) and the device runs it.

- version resolution: auto and v2 run n-gram's adaptive depth in v2; a drafter that does not draft on the device
  falls back to v1 with a reason naming adaptive;
- lossless: greedy output equals plain decoding and v1 (adaptive and not), overlapped or not, batch 1 and 8;
- a width of 1 (k = 0, the root alone) is a plain decode step: greedy and seeded sampling give plain decoding's
  tokens; always the largest width gives the fixed-depth worker's seeded samples (same draws);
- forced exploration runs every width through the verify forward, costs are measured per (batch size, depth), the
  metrics report the chosen depths, and the KV contract holds at every width (no page an in-flight iteration may
  write is freed, nothing leaks, with preemption);
- on CUDA an iteration's cost is the longer of its GPU time and the host's own time per iteration (HostClock).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from framework import LLM
from framework.batch import ForwardMode
from framework.config import SpeculativeConfig
from framework.kv import DUMMY_ROW
from framework.speculative.adaptive import DraftLengthController
from framework.speculative.adaptive_v2 import HostClock, ShadowAcceptance
from framework.speculative.ngram import ngram_chain_device
from framework.speculative.version import resolve_version
from tests.conftest import TINY
from tests.test_speculative_lossless import items

NGRAM = ["speculative=ngram", "speculative.num_steps=4"]
ADAPTIVE = NGRAM + ["speculative.adaptive=true"]
SAMPLED = [dict(it, max_tokens=8, temperature=0.8, seed=i, **({"top_k": 5, "top_p": 0.9} if i % 2 else {}))
           for i, it in enumerate(items(3))]  # (sampling over tiny_llama's vocabulary is slow on the CPU: few tokens)


@pytest.fixture(scope="module")
def reference():
    return [o.token_ids for o in LLM(TINY + ["scheduler.max_running_requests=8"]).generate(items())]


def test_version_resolution(caplog):
    with caplog.at_level(logging.INFO, logger="framework.engine"):
        auto = LLM(TINY + ADAPTIVE)
        v2 = LLM(TINY + ADAPTIVE + ["speculative.version=v2"])
    assert auto.engine.spec_version == v2.engine.spec_version == "v2"
    assert auto.engine.spec_worker.widths == [1, 2, 3, 4, 5]
    assert not any("running v1" in r.getMessage() for r in caplog.records)
    assert LLM(TINY + ADAPTIVE + ["speculative.version=v1"]).engine.spec_version == "v1"
    # (config validation refuses adaptive with model drafters; the resolution still names the reason)
    version, reason = resolve_version(SpeculativeConfig(name="layer_skip", num_steps=2, adaptive=True))
    assert version == "v1" and "speculative.adaptive=true" in reason and "layer_skip" in reason


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_equals_plain_and_v1(reference, batch):
    count = len(reference) if batch > 1 else 3
    common = [f"scheduler.max_running_requests={batch}"]
    outs = {}
    specs = {"v1": ADAPTIVE + ["speculative.version=v1"], "v1 fixed": NGRAM + ["speculative.version=v1"],
             "v2": ADAPTIVE + ["scheduler.overlap=off"], "v2 overlap": ADAPTIVE + ["scheduler.overlap=on"]}
    for name, spec in specs.items():
        llm = LLM(TINY + spec + common)
        outs[name] = [o.token_ids for o in llm.generate(items(count))]
        llm.engine.allocator.assert_all_free()
        if name.startswith("v2"):
            assert llm.engine.spec_version == "v2"
            assert len(llm.engine.spec_worker.stats.summary()["chosen_draft_lengths"]) >= 2
    assert all(o == reference[:count] for o in outs.values()), {k: o == reference[:count] for k, o in outs.items()}


def forced(llm: LLM, depth: int) -> LLM:
    llm.engine.spec_worker.adaptive.choose = lambda bs, rows=None: depth
    return llm


@pytest.mark.parametrize("page_size", [1, 16])
def test_width_one_is_a_plain_decode_step(reference, page_size):
    """k = 0 every iteration: the root alone is verified and its bonus token is the next token, greedy and sampled
    (the same draw as plain decoding's: no draft, so no acceptance draws)."""
    common = ["scheduler.max_running_requests=8", f"kv.page_size={page_size}"]
    llm = forced(LLM(TINY + ADAPTIVE + common), 0)
    assert [o.token_ids for o in llm.generate(items())] == reference
    if page_size == 1:
        plain = [o.token_ids for o in LLM(TINY + common).generate(SAMPLED)]
        assert [o.token_ids for o in llm.generate(SAMPLED)] == plain
    assert llm.engine.spec_worker.stats.summary()["chosen_draft_lengths"].keys() == {"0"}
    llm.engine.allocator.assert_all_free()


def test_shadow_drafts_are_compared_position_by_position_as_the_tokens_arrive():
    sh = ShadowAcceptance(num_rows=4, depth=3, device=torch.device("cpu"))
    tokens = torch.zeros(4, 16, dtype=torch.int64)
    tokens[1, 5:8] = torch.tensor([7, 8, 5])
    tokens[2, 5:8] = torch.tensor([6, 8, 9])
    rows = torch.tensor([1, 2, DUMMY_ROW])
    drafts = torch.tensor([[7, 8, 9], [7, 8, 9], [7, 8, 9]])
    valid = torch.tensor([[True, True, True], [True, True, False], [True, True, True]])
    sh.update(rows, tokens, torch.tensor([5, 5, 1]), drafts, valid)  # drafted at length 5: nothing known yet
    assert sh.counts.tolist() == [0] * 6 and sh.at.tolist() == [-1, 5, 5, -1]
    sh.update(rows, tokens, torch.tensor([7, 6, 1]), drafts, valid)  # row 1 knows 2 positions, row 2 one
    assert sh.counts.tolist() == [2, 1, 0, 1, 1, 0]  # reached: position 0 twice, 1 once; agreed: 0 once, 1 once
    assert sh.per_row(rows[:2]).tolist() == [1, 1, 0, 1, 1, 0] + [1, 0, 0, 0, 0, 0]  # the same, per request
    assert sh.at.tolist() == [-1, 5, 6, -1] and sh.upto.tolist() == [0, 2, 0, 0]  # row 2 settled (0 deep): anew
    sh.update(rows, tokens, torch.tensor([8, 6, 1]), drafts, valid)  # row 1's third position: 5, not 9
    assert sh.counts.tolist() == [2, 1, 1, 1, 1, 0] and sh.at.tolist() == [-1, 8, 6, -1]
    assert sh.per_row(rows[:2]).tolist() == [0, 0, 1, 0, 0, 0] + [0] * 6  # row 1's third position, this update
    sh.reset([1])
    assert sh.at.tolist() == [-1, -1, 6, -1]
    sh.drop(torch.tensor([2, DUMMY_ROW]))  # an iteration of the deepest drafts: nothing pending any more
    assert sh.at.tolist() == [-1, -1, -1, -1]
    # verified chains that accepted 0, 2 and all 3 drafts: positions reached, then agreed
    assert ShadowAcceptance.verified([0, 2, 3], 3).tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1] * 6]


def test_plain_steps_measure_acceptance_from_unverified_drafts():
    """k = 0 every iteration: nothing is verified, yet every request's n-gram chain is drafted and compared with the
    tokens that followed, a position at a time, a new one drafted where it settles (the counts equal a brute force
    over the outputs)."""
    llm = forced(LLM(TINY + ADAPTIVE + ["scheduler.max_running_requests=8"]), 0)
    outs = llm.generate(items())
    worker = llm.engine.spec_worker
    depth = worker.cfg.num_steps
    reached, agreed = [0] * depth, [0] * depth
    for item, out in zip(items(), outs):
        seq = llm.engine.make_request(item).prompt_ids + out.token_ids
        at = out.num_prompt_tokens + 1  # the first draft: after the prefill's token
        while True:
            drafts, valid = ngram_chain_device(torch.tensor([seq[:at]]), torch.tensor([at]), depth,
                                               worker.cfg.ngram_min, worker.cfg.ngram_max)
            known = min(depth, len(seq) - 1 - at)  # positions known by the request's last iteration
            for i in range(known):
                reached[i] += 1
                if not (valid[0, i] and drafts[0, i] == seq[at + i]):
                    at += i + 1  # settled where position i differs: the next draft starts after it
                    break
                agreed[i] += 1
            else:
                if known < depth:
                    break
                at += depth
    assert worker.shadow.counts.tolist() == reached + agreed and agreed[0] > 0
    assert worker.adaptive.shadow_reached[0] == pytest.approx(reached[0], rel=0.2)  # (decayed)


def test_largest_width_samples_as_the_fixed_depth_worker():
    """Always k = num_steps: the same iterations and draws as speculative.adaptive=false, so the same samples."""
    common = ["scheduler.max_running_requests=8"]
    fixed = [o.token_ids for o in LLM(TINY + NGRAM + common).generate(SAMPLED)]
    llm = forced(LLM(TINY + ADAPTIVE + common), 4)
    assert [o.token_ids for o in llm.generate(SAMPLED)] == fixed
    assert llm.engine.spec_worker.stats.summary()["chosen_draft_lengths"].keys() == {"4"}


def spy_shadow(llm: LLM) -> list[np.ndarray]:
    """The per-request shadow counts each iteration hands the controller, as they arrive."""
    worker, seen = llm.engine.spec_worker, []
    real = worker.adaptive.record

    def record(bs, k, emitted, seconds, shadow=None, rows=None, host_s=None):
        seen.append(np.asarray(shadow).copy())
        real(bs, k, emitted, seconds, shadow, rows, host_s)

    worker.adaptive.record = record
    return seen


def test_the_deepest_drafts_count_their_verified_chains_and_compare_nothing():
    """k = num_steps every iteration: each verify's outcome is that of the chain a shadow draft would take there, so
    the iteration's program compares no shadow draft (the device's counts stay zero) and the controller learns every
    position from the accept lengths: every verified chain reaches position 0 once, reaches position i + 1 where it
    agreed at i, and the totals are those of shadow drafts compared in plain steps over the same requests, but for
    each request's last chain (verified past its end) and the start after a whole chain agreed (a verify's next chain
    starts after its bonus token)."""
    deep = forced(LLM(TINY + ADAPTIVE + ["scheduler.max_running_requests=8"]), 4)
    seen = spy_shadow(deep)
    deep.generate(items())
    worker = deep.engine.spec_worker
    assert worker.shadow.counts.tolist() == [0] * 8
    counts = np.concatenate(seen)  # [request iterations, 2 * depth]
    reached, agreed = counts[:, :4].sum(axis=0), counts[:, 4:].sum(axis=0)
    assert reached[0] == len(counts) and (reached[1:] == agreed[:-1]).all() and agreed[0] > 0
    assert worker.adaptive.expected_tokens(4) > 1.0
    plain = forced(LLM(TINY + ADAPTIVE + ["scheduler.max_running_requests=8"]), 0)
    plain_seen = spy_shadow(plain)
    plain.generate(items())
    shadow = np.concatenate(plain_seen).sum(axis=0)
    assert np.abs(np.concatenate([reached, agreed]) - shadow).max() <= len(items())


class CycleDepths(DraftLengthController):
    """Every depth in turn, the deepest first (the KV contract at every width, whatever the policy would pick)."""

    def choose(self, bs: int, rows=None) -> int:
        self.iterations += 1
        return (self.max_depth + 1 - self.iterations) % (self.max_depth + 1)


def test_forced_exploration_runs_every_width_within_the_kv_contract(reference, monkeypatch):
    small = ["kv.page_size=1", "scheduler.max_context=64", "kv.max_total_tokens=150"]  # preemption too
    llm = LLM(TINY + ADAPTIVE + small + ["scheduler.max_running_requests=8", "scheduler.overlap=on"])
    engine, alloc, worker = llm.engine, llm.engine.allocator, llm.engine.spec_worker
    worker.adaptive = CycleDepths(4)
    widths, truncate, forward = [], alloc.truncate, engine.runner.forward

    def checked_truncate(row, num_tokens):
        req = next(r for r in engine.scheduler.running if r.row == row)
        if req.spec_inflight:  # an in-flight iteration of any width writes positions below kv_len + num_steps + 1
            assert num_tokens >= req.kv_len + 5, (row, num_tokens, req.kv_len)
        truncate(row, num_tokens)
        alloc.check_invariants()

    def spy(batch, *args, **kwargs):
        if batch.mode is ForwardMode.TARGET_VERIFY:
            widths.append(batch.q_len)
        return forward(batch, *args, **kwargs)

    monkeypatch.setattr(alloc, "truncate", checked_truncate)
    monkeypatch.setattr(engine.runner, "forward", spy)
    assert [o.token_ids for o in llm.generate(items())] == \
        [o.token_ids for o in LLM(TINY + small + ["scheduler.max_running_requests=8"]).generate(items())]
    assert engine.scheduler.num_preemptions > 0
    alloc.assert_all_free()
    assert set(widths) == {1, 2, 3, 4, 5}
    depths = worker.stats.summary()["chosen_draft_lengths"]
    assert depths.keys() == {"0", "1", "2", "3", "4"} and sum(depths.values()) == len(widths)
    assert {k for _, k in worker.adaptive.cost} == {0, 1, 2, 3, 4} and min(worker.adaptive.cost.values()) > 0


def test_each_width_compiles_apart_with_its_width_a_constant():
    """The compiled programs' mechanism (speculation v2 on CUDA; here with dynamo's eager backend): a code object per
    width, so every width keeps its width static and adds only its batch-size families (size 1, then a dynamic
    size), instead of turning the width into a symbolic size and sharing one recompile limit."""
    import torch

    from framework.speculative.adaptive_v2 import program_for_width

    def program(rows: torch.Tensor, q: int) -> torch.Tensor:
        return rows[:, None] * q + torch.arange(q)[None, :]  # [bs, q]

    graphs = []

    def backend(gm, example_inputs):
        graphs.append([n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"])
        return gm.forward

    torch._dynamo.reset()
    compiled = {q: torch.compile(program_for_width(program, q, pass_width=True), backend=backend, fullgraph=True)
                for q in range(1, 6)}
    for q in range(1, 6):
        for bs in (1, 2, 4, 8):
            rows = torch.arange(bs)
            torch._dynamo.maybe_mark_dynamic(rows, 0)
            assert torch.equal(compiled[q](rows), program(rows, q))
    assert len(graphs) == 10  # widths x (batch size 1, a dynamic batch size)
    # each width: rows [1], then (the batch size, rows [s]); a symbolic width would be one more input
    assert [len(inputs) for inputs in graphs] == [1, 2] * 5


def test_host_clock_costs_the_longer_of_gpu_and_host_time():
    """The host's own time per iteration is launch to next launch less the time blocked on results; a stretch with a
    prefill step in it, or the first one, counts nothing, and an iteration without a host time of its own takes the
    latest measured. A depth costs the longer of its GPU time and the batch size's host time averaged over every
    depth: host-bound, the depth that emits the most wins, whatever the noise in each iteration's host time."""
    clock = HostClock()
    assert clock.launch(0.0) is None  # nothing launched before
    clock.waited(0.3)
    assert clock.launch(1.0) == pytest.approx(0.7)
    clock.dirty()  # a prefill step between two iterations
    assert clock.launch(2.0) is None
    assert clock.launch(2.5) == pytest.approx(0.5)
    assert clock.host_time(None) == pytest.approx(0.5) and clock.host_time(0.4) == 0.4
    assert HostClock().host_time(None) is None  # no host time yet
    ctl = DraftLengthController(max_depth=4, explore_every=0, shadow=True, cost_alpha=0.5)
    for k, gpu, host in ((0, 0.3, 0.9), (1, 0.4, 1.1), (3, 0.6, 0.8), (4, 0.7, 1.0), (4, 1.2, 1.0)):
        ctl.record(8, k, [1] * 8, gpu, shadow=[[1] * 4 + [1] * 4] * 8, rows=range(8), host_s=host)
    assert ctl.host_cost(8) == pytest.approx(0.975) and ctl.host_cost(16) == ctl.host_cost(8)
    costs = ctl.costs(8)
    assert costs[0] == costs[1] == costs[3] == pytest.approx(0.975)  # host-bound: one cost
    assert costs[4] == pytest.approx(1.2)  # device-bound: its GPU time
    assert DraftLengthController(max_depth=1).host_cost(8) is None  # the CPU: no host time, wall time is the cost