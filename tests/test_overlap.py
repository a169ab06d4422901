"""The overlapped engine loop (``scheduler.overlap=on``): the host plans and launches step N+1 before it takes
step N's tokens, and nothing a user sees changes: tokens, finish reasons, stop-string cuts, seeded sampling,
preemption, aborts, chunked and mixed prefill. On the CPU the forwards run synchronously, but the host's order of
work (and so every piece of bookkeeping) is the GPU's."""

from __future__ import annotations

import pytest

from framework import LLM
from framework.scheduler import Scheduler
from tests.conftest import TINY

PROMPTS = ["The quick brown fox", "Once upon a time in a land far away, there lived", "1, 2, 3,",
           "def fibonacci(n):", "Q: What is the capital of Italy?\nA:", "hello " * 30, "x", "Dear Sir or Madam,"]


def items(**extra) -> list[dict]:
    """Requests that end every way: by length (various max_tokens), a stop string, a stop token, seeded sampling."""
    out = [{"prompt": p, "max_tokens": 8 + 3 * i, **extra} for i, p in enumerate(PROMPTS)]
    out[1]["stop"] = [" the", "and"]
    out[2]["stop_token_ids"] = [11]
    out[3].update(temperature=0.9, top_p=0.9, seed=5)
    out[5].update(temperature=1.3, top_k=20, seed=11)
    return out


def outputs(llm: LLM, reqs: list[dict]) -> list[tuple]:
    return [(o.token_ids, o.finish_reason, o.text) for o in llm.generate(reqs)]


@pytest.fixture(scope="module")
def engines():
    common = TINY + ["scheduler.max_running_requests=4"]
    return LLM(common + ["scheduler.overlap=off"]), LLM(common + ["scheduler.overlap=on"])


def test_overlap_resolves_by_device_and_drafter():
    off, on = LLM(TINY), LLM(TINY + ["scheduler.overlap=on"])
    assert not off.engine.overlap and on.engine.overlap  # auto: off on the CPU
    spec = LLM(TINY + ["speculative=ngram", "speculative.num_steps=2"])
    assert not spec.engine.overlap


def test_overlap_gives_the_same_outputs(engines):
    off, on = engines
    reqs = items()
    want = outputs(off, reqs)
    assert outputs(on, reqs) == want
    reasons = {r for _, r, _ in want}
    assert reasons == {"stop", "length"}  # both kinds of finish happened


def test_a_finished_request_wastes_at_most_one_step(engines, monkeypatch):
    """A request that stops at step N was already in step N+1 (planned before its token arrived): that one slot
    is discarded; it is in no later step, and its token is not appended."""
    _, on = engines
    seen_after_finish: dict[int, int] = {}
    real = Scheduler.process

    def process(self, step, tokens):
        for req in step.reqs:
            if req.finished:
                seen_after_finish[id(req)] = seen_after_finish.get(id(req), 0) + 1
        return real(self, step, tokens)

    monkeypatch.setattr(Scheduler, "process", process)
    reqs = [{"prompt": p, "max_tokens": 30, "stop": [" "]} for p in PROMPTS]
    outs = on.generate(reqs)
    assert all(o.finish_reason == "stop" for o in outs)
    assert seen_after_finish and max(seen_after_finish.values()) == 1


def test_overlap_with_preemption_and_chunked_prefill():
    small = ["scheduler.max_context=96", "kv.max_total_tokens=112", "kv.page_size=4", "scheduler.max_prefill_tokens=8"]
    off = LLM(TINY + small + ["scheduler.overlap=off"])
    on = LLM(TINY + small + ["scheduler.overlap=on"])
    reqs = items()
    assert outputs(on, reqs) == outputs(off, reqs)
    assert on.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_prefill_gives_the_same_outputs(engines, page_size):
    """Decoding requests ride along in prefill steps (one token each): same tokens, with and without overlap."""
    off, _ = engines
    mixed = ["scheduler.max_running_requests=4", "scheduler.mixed_prefill=true", "scheduler.max_prefill_tokens=16",
             f"kv.page_size={page_size}"]
    reqs = items()
    want = outputs(off, reqs)
    for overlap in ("off", "on"):
        llm = LLM(TINY + mixed + [f"scheduler.overlap={overlap}"])
        steps = []
        real = llm.engine.scheduler.schedule
        llm.engine.scheduler.schedule = lambda **kw: (lambda s: steps.append(s) or s)(real(**kw))
        assert outputs(llm, reqs) == want
        mixed_steps = [s for s in steps if s is not None and s.mode.name == "EXTEND"
                       and any(r.prefilled and n == 1 and r.output_ids for r, n in zip(s.reqs, s.extend_lens))]
        assert mixed_steps  # some prefill step carried decoding requests


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_mixed_prefill_admits_a_request_next_to_decoding_ones(engines, overlap):
    """A request that arrives while others decode is prefilled in a step that also decodes them (one token each):
    the decoding requests do not lose a step to each admission. Same tokens as without mixing."""
    off, _ = engines
    llm = LLM(TINY + ["scheduler.max_running_requests=4", "scheduler.mixed_prefill=true",
                      f"scheduler.overlap={overlap}"])
    engine, steps = llm.engine, []
    real = engine.scheduler.schedule
    engine.scheduler.schedule = lambda **kw: (lambda s: steps.append(s) or s)(real(**kw))
    spec = [{"prompt": p, "max_tokens": 12, "ignore_eos": True} for p in PROMPTS[:3]]
    reqs = [engine.make_request(spec[i], rid=i) for i in range(3)]
    for req in reqs[:2]:
        engine.submit(req)
    while len(reqs[0].output_ids) < 3:
        engine.step()
    engine.submit(reqs[2])  # arrives while the first two decode
    while engine.has_work():
        engine.step()
    admission = next(s for s in steps if s is not None and reqs[2] in s.reqs)
    assert admission.mode.name == "EXTEND"
    riders = {r.rid: n for r, n in zip(admission.reqs, admission.extend_lens) if r is not reqs[2]}
    assert riders == {0: 1, 1: 1}
    want = [o.token_ids for o in off.generate(spec)]
    assert [r.output_ids for r in reqs] == want
    engine.allocator.assert_all_free()


def test_abort_while_a_step_is_in_flight(engines):
    off, on = engines
    engine = on.engine
    reqs = [engine.make_request({"prompt": p, "max_tokens": 40, "ignore_eos": True}, rid=i)
            for i, p in enumerate(PROMPTS[:4])]
    for req in reqs:
        engine.submit(req)
    for _ in range(6):
        engine.step()
    assert engine._inflight is not None  # a decode step is launched and not yet taken
    aborted = engine.abort(1)
    assert aborted is reqs[1] and aborted.finish_reason == "abort"
    n_at_abort = len(reqs[1].output_ids)
    while engine.has_work():
        engine.step()
    assert len(reqs[1].output_ids) == n_at_abort  # the in-flight token was dropped
    want = off.generate([{"prompt": p, "max_tokens": 40, "ignore_eos": True} for p in PROMPTS[:4]])
    for i in (0, 2, 3):
        assert reqs[i].output_ids == want[i].token_ids and reqs[i].finish_reason == "length"
    engine.allocator.assert_all_free()
