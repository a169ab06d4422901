"""Engine and scheduler behaviour on tiny_llama (eager): batching, joins, finishes, limits, bad input."""

from __future__ import annotations

import pytest

from framework import LLM
from tests.conftest import TINY

PROMPTS = ["The quick brown fox", "Once upon a time in a land far away, there lived", "1, 2, 3,",
           "def fibonacci(n):", "Q: What is the capital of Italy?\nA:", "hello " * 30, "x", "Dear Sir or Madam,"]


def reqs(max_tokens: int = 24, **extra) -> list[dict]:
    return [{"prompt": p, "max_tokens": max_tokens, **extra} for p in PROMPTS]


@pytest.fixture(scope="module")
def solo():
    """Batch-1 engine: the reference for batching behaviour."""
    return LLM(TINY + ["scheduler.max_running_requests=1"])


@pytest.fixture(scope="module")
def solo_outputs(solo):
    return [o.token_ids for o in solo.generate(reqs())]


def test_batched_equals_batch_one(tiny_llm, solo_outputs):
    outs = tiny_llm.generate(reqs())
    assert [o.token_ids for o in outs] == solo_outputs
    assert all(o.finish_reason == "length" and len(o.token_ids) == 24 for o in outs)


def test_new_requests_join_a_running_batch(tiny_llm, solo_outputs):
    engine = tiny_llm.engine
    first = engine.make_request({"prompt": PROMPTS[0], "max_tokens": 24}, rid="first")
    engine.submit(first)
    for _ in range(5):
        engine.step()
    assert len(first.output_ids) == 5
    late = engine.make_request({"prompt": PROMPTS[1], "max_tokens": 24}, rid="late")
    engine.submit(late)
    engine.step()  # the late request's prefill
    assert late.output_ids and len(first.output_ids) == 5
    engine.step()  # one decode step serves both
    assert len(first.output_ids) == 6 and len(late.output_ids) == 2
    while engine.has_work():
        engine.step()
    assert first.output_ids == solo_outputs[0] and late.output_ids == solo_outputs[1]


def test_stop_token_finishes_with_stop(tiny_llm, solo_outputs):
    target = solo_outputs[2][6]
    cut = solo_outputs[2].index(target) + 1
    out = tiny_llm.generate([{"prompt": PROMPTS[2], "max_tokens": 24, "stop_token_ids": [target]}])[0]
    assert out.finish_reason == "stop" and out.token_ids == solo_outputs[2][:cut]


def test_eos_from_config_and_ignore_eos(solo_outputs):
    target = solo_outputs[3][4]
    cut = solo_outputs[3].index(target) + 1
    llm = LLM(TINY + [f"model.eos_token_ids=[{target}]"])
    out = llm.generate([{"prompt": PROMPTS[3], "max_tokens": 24}])[0]
    assert out.finish_reason == "stop" and out.token_ids == solo_outputs[3][:cut]
    out = llm.generate([{"prompt": PROMPTS[3], "max_tokens": 24, "ignore_eos": True}])[0]
    assert out.finish_reason == "length" and out.token_ids == solo_outputs[3]


def test_stop_string_cuts_text(tiny_llm):
    full = tiny_llm.generate([{"prompt": PROMPTS[4], "max_tokens": 24}])[0]
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 4]
    out = tiny_llm.generate([{"prompt": PROMPTS[4], "max_tokens": 24, "stop": [stop]}])[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.find(stop)]
    assert full.token_ids[: len(out.token_ids)] == out.token_ids and len(out.token_ids) < 24


def test_length_and_context_window():
    llm = LLM(TINY + ["scheduler.max_context=40"])
    prompt_ids = llm.tokenizer("word " * 30)["input_ids"]
    out = llm.generate([{"prompt": "word " * 30, "max_tokens": 100}])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 40 - len(prompt_ids)
    too_long = llm.generate([{"prompt": "word " * 60, "max_tokens": 5}, {"prompt": "ok", "max_tokens": 3}])
    assert too_long[0].finish_reason == "error" and "context window" in too_long[0].error
    assert too_long[1].finish_reason == "length" and len(too_long[1].token_ids) == 3


def test_chunked_prefill_gives_the_same_tokens(solo_outputs):
    llm = LLM(TINY + ["scheduler.max_prefill_tokens=7", "scheduler.max_running_requests=4"])
    assert [o.token_ids for o in llm.generate(reqs())] == solo_outputs


def test_small_kv_pool_queues_requests(solo_outputs):
    # the prompts together need more pages than the pool has: admission makes the rest wait
    llm = LLM(TINY + ["scheduler.max_context=64", "kv.max_total_tokens=72", "kv.page_size=4"])
    scheduler, peak = llm.engine.scheduler, []
    schedule = scheduler.schedule
    scheduler.schedule = lambda **kw: (peak.append((len(scheduler.running), len(scheduler.waiting))), schedule(**kw))[1]
    outs = llm.generate(reqs())
    assert [o.token_ids for o in outs] == solo_outputs
    assert max(r for r, _ in peak) < len(PROMPTS) and any(w and r for r, w in peak)


def test_bad_requests_fail_alone(tiny_llm, solo_outputs):
    items = [{"prompt": PROMPTS[0], "max_tokens": 24}, {"prompt": ""}, {"prompt": "a", "temperature": -1},
             {"prompt": "a", "top_p": 1.5}, {"prompt": "a", "top_p": 0}, {"prompt": "a", "max_tokens": 0},
             {"prompt": "a " * 5000}, {"prompt": 42}, {"messages": "hi"}, {"foo": "bar"},
             {"prompt": PROMPTS[1], "max_tokens": 24}]
    outs = tiny_llm.generate(items)
    assert [o.finish_reason for o in outs] == ["length"] + ["error"] * 9 + ["length"]
    for o in outs[1:-1]:
        assert o.error and "\n" not in o.error
    for o, field in zip(outs[1:7], ["empty", "temperature", "top_p", "top_p", "max_tokens", "context window"]):
        assert field in o.error
    assert outs[0].token_ids == solo_outputs[0] and outs[-1].token_ids == solo_outputs[1]


def test_abort_frees_kv(tiny_llm):
    engine = tiny_llm.engine
    req = engine.make_request({"prompt": PROMPTS[1], "max_tokens": 50}, rid="abort-me")
    engine.submit(req)
    engine.step()
    engine.step()
    assert engine.allocator.num_used_slots > 0
    assert engine.abort("abort-me") is req and req.finish_reason == "abort"
    assert not engine.has_work()
    engine.allocator.assert_all_free()


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_llm, solo):
    item = {"prompt": PROMPTS[5], "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 1234}
    alone = solo.generate([item])[0].token_ids
    mixed = tiny_llm.generate(reqs(8)[:3] + [item] + reqs(8)[3:])[3].token_ids
    assert alone == mixed
    other_seed = tiny_llm.generate([dict(item, seed=99)])[0].token_ids
    assert other_seed != alone


def test_temperature_below_the_float_range_is_greedy(tiny_llm, solo_outputs):
    # logits / 1e-40 overflow float32 (NaN probabilities): such temperatures are treated as 0
    out = tiny_llm.generate([{"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 1e-40, "seed": 1}])[0]
    assert out.token_ids == solo_outputs[0]


def test_chat_messages_use_the_template(tiny_llm):
    msgs = [{"role": "user", "content": "Hi there"}]
    text = tiny_llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    out = tiny_llm.generate([{"messages": msgs, "max_tokens": 3}])[0]
    assert out.num_prompt_tokens == len(tiny_llm.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert text.endswith("<|im_start|>assistant\n")
    # a message's other fields (not role or content) may be anything: they once reached a str-only check
    extra = tiny_llm.generate([{"messages": [dict(msgs[0], name=None)], "max_tokens": 3}])[0]
    assert extra.finish_reason == "length" and extra.num_prompt_tokens == out.num_prompt_tokens


@pytest.mark.parametrize("spec", [[], ["speculative=ngram", "speculative.num_steps=3"],
                                  ["speculative=eagle", "speculative.num_steps=2"],
                                  ["speculative=draft_model", "speculative.draft_model=tiny_llama"]])
def test_preemption_loses_nothing(solo_outputs, spec):
    """A pool that holds about two full requests: the newest are preempted and re-run; output is unchanged."""
    llm = LLM(TINY + spec + ["scheduler.max_context=96", "kv.max_total_tokens=112", "kv.page_size=4"])
    outs = llm.generate(reqs())
    assert [o.token_ids for o in outs] == solo_outputs
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("spec", [[], ["speculative=ngram", "speculative.num_steps=3"]])
def test_chunked_prefill_in_a_small_pool_loses_nothing(solo_outputs, spec):
    """Chunks continue only as far as the free pages reach, and when no request can run the newest is preempted:
    a continued chunk once asked for pages that decoding requests held, and the step failed."""
    llm = LLM(TINY + spec + ["scheduler.max_context=96", "kv.max_total_tokens=112", "kv.page_size=4",
                             "scheduler.max_prefill_tokens=8"])
    outs = llm.generate(reqs())
    assert [o.token_ids for o in outs] == solo_outputs
    assert llm.engine.scheduler.num_preemptions > 0


def test_a_continued_chunk_waits_for_pages_a_decoding_request_holds():
    """A pool of one full request; the second prompt's next chunk needs more pages than the first request's
    decode leaves free: the chunk shrinks or waits (it once raised MemoryError and failed the whole step)."""
    llm = LLM(TINY + ["scheduler.max_context=128", "kv.max_total_tokens=128", "kv.page_size=16",
                      "scheduler.max_prefill_tokens=64", "scheduler.max_running_requests=4"])
    items = [{"prompt": "word " * 59, "max_tokens": 20, "ignore_eos": True},
             {"prompt": "word " * 99, "max_tokens": 20, "ignore_eos": True}]
    solo = LLM(TINY + ["scheduler.max_running_requests=1"])
    assert [o.token_ids for o in llm.generate(items)] == [o.token_ids for o in solo.generate(items)]


def test_chunked_prefills_holding_each_others_pages_preempt_the_newer():
    """No request decodes and no chunk can grow: the newest is preempted so that the oldest can go on (without
    that, schedule() would find nothing to run and the engine would spin)."""
    import torch

    from framework.config import SchedulerConfig
    from framework.kv import KVAllocator
    from framework.request import Request
    from framework.sampling import SamplingParams
    from framework.scheduler import Scheduler

    alloc = KVAllocator(64, 16, 4, 64, torch.device("cpu"))  # 4 pages
    sched = Scheduler(SchedulerConfig(max_prefill_tokens=64, max_running_requests=4, max_context=64), alloc, set(),
                      lambda: None, torch.device("cpu"))
    old, new = (Request(rid=i, prompt_ids=[1] * 40, params=SamplingParams(), seed=0, max_new_tokens=8)
                for i in range(2))
    for req in (old, new):  # each holds 2 of the 4 pages, 32 of its 40 prompt tokens in them
        req.row = alloc.alloc_request()
        alloc.assign([req.row], [0], [32])
        req.kv_len = 32
        sched.running.append(req)
    step = sched.schedule()
    assert step.reqs == [old] and step.extend_lens == [8]
    assert list(sched.waiting) == [new] and new.row == -1 and sched.num_preemptions == 1
