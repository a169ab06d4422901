"""Prefix caching (``kv.prefix_cache``) end to end on tiny_llama: outputs token-identical with the cache on and off
(greedy and seeded sampling) for shared system prompts, multi-turn continuations, identical prompts, prompts that
diverge mid-page, chunked prefill, the overlapped loop, eviction and preemption in a small pool, every drafter (v1
and v2) and a compiled engine; how many tokens each request took from the cache; metrics, config, and the
cache-off path unchanged. The allocator's invariants are checked after every engine step (tests.helpers)."""

from __future__ import annotations

import random

import pytest

from framework import LLM
from framework.config import ConfigError, compose
from tests.conftest import TINY
from tests.helpers import run_token_prompts

MAX_TOKENS = 10


def workload(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Turn-one prompts (a shared system prompt with distinct questions, an identical pair, a pair that diverges at
    token 40, short prompts) and a function of their outputs for turn two."""
    rng = random.Random(seed)
    toks = lambda n: [rng.randrange(100, 5000) for _ in range(n)]  # noqa: E731
    system = toks(70)
    common = toks(40)
    same = toks(37)
    prompts = [system + toks(9), system + toks(23), system + toks(1), same, same, common + toks(10),
               common + toks(5), toks(2), toks(1), toks(33)]
    return prompts, [toks(6) for _ in prompts]


def two_turns(engine, seed: int = 0, temperature: float = 0.0) -> tuple[list, list]:
    """Turn one, then turn two: each conversation continued (prompt + output + a new user turn), on one engine."""
    prompts, follow = workload(seed)
    first = run_token_prompts(engine, prompts, MAX_TOKENS, temperature)
    second = run_token_prompts(engine, [r.prompt_ids + r.output_ids + f for r, f in zip(first, follow)], MAX_TOKENS,
                               temperature, seed=100)
    return first, second


def tokens(reqs: list) -> list[list[int]]:
    return [r.output_ids for r in reqs]


def assert_turn_two_hits(first: list, second: list, page_size: int, lag: int = 0) -> None:
    """Turn two takes the whole earlier conversation from the cache, in whole pages (the last generated token of
    turn one never had its K/V written; a drafter's own pool may hold ``lag`` tokens fewer)."""
    for r, before in zip(second, first):
        written = len(before.prompt_ids) + len(before.output_ids) - 1 - lag
        assert r.num_cached_tokens >= written // page_size * page_size


@pytest.fixture(scope="module", params=[1, 16])
def page_size(request):
    return request.param


@pytest.fixture(scope="module")
def reference(page_size):
    """Greedy outputs with the cache off."""
    engine = LLM(TINY + ["kv.prefix_cache=false", f"kv.page_size={page_size}"]).engine
    assert engine.allocator.cache is None
    first, second = two_turns(engine)
    assert all(r.num_cached_tokens == 0 for r in first + second)
    return tokens(first), tokens(second)


def test_cache_on_equals_off_and_counts_cached_tokens(page_size, reference):
    engine = LLM(TINY + [f"kv.page_size={page_size}", "scheduler.max_running_requests=4"]).engine
    first, second = two_turns(engine)
    assert (tokens(first), tokens(second)) == reference
    cached = [r.num_cached_tokens for r in first]
    ps = page_size
    # the first request computes the system prompt; the rest take its full pages (admitted a step later)
    assert cached[0] == 0 and cached[1] == cached[2] == 70 // ps * ps
    assert cached[4] == 36 // ps * ps  # the identical prompt: all but its last token, in whole pages
    assert cached[6] == 40 // ps * ps  # diverges at token 40: only the pages before it (mid-page: recomputed)
    assert cached[7] == cached[8] == 0  # (too short to share a page, or nothing to share)
    assert_turn_two_hits(first, second, ps)
    sched = engine.scheduler
    assert sched.num_cached_prompt_tokens == sum(r.num_cached_tokens for r in first + second)
    assert sched.num_prefill_tokens == sched.num_prompt_tokens - sched.num_cached_prompt_tokens
    engine.allocator.assert_all_free()
    assert engine.allocator.num_cached_pages > 0


def test_seeded_sampling_is_identical_with_the_cache(page_size):
    runs = []
    for on in ("true", "false"):
        engine = LLM(TINY + [f"kv.prefix_cache={on}", f"kv.page_size={page_size}"]).engine
        runs.append([tokens(t) for t in two_turns(engine, seed=1, temperature=0.9)])
    assert runs[0] == runs[1]


def test_chunked_prefill_and_the_overlapped_loop(reference, page_size):
    engine = LLM(TINY + [f"kv.page_size={page_size}", "scheduler.max_prefill_tokens=16", "scheduler.overlap=on",
                         "scheduler.mixed_prefill=true"]).engine
    first, second = two_turns(engine)
    assert (tokens(first), tokens(second)) == reference
    assert sum(r.num_cached_tokens for r in first) > 0
    assert_turn_two_hits(first, second, page_size)


def test_eviction_and_preemption_in_a_small_pool():
    """A pool of about two requests: cached pages are evicted (least recently used first) and requests preempted;
    a preempted request re-runs from its own cached pages; nothing changes in the output."""
    small = ["kv.page_size=4", "scheduler.max_context=160", "kv.max_total_tokens=200",
             "scheduler.max_running_requests=4"]
    prompts, _ = workload(2)
    outs = {}
    for on in ("true", "false"):
        engine = LLM(TINY + small + [f"kv.prefix_cache={on}"]).engine
        reqs = run_token_prompts(engine, prompts * 2, 40)
        outs[on] = tokens(reqs)
        assert engine.scheduler.num_preemptions > 0
        if on == "true":
            assert engine.allocator.cache.num_evicted > 0
            assert sum(r.num_cached_tokens for r in reqs) > 0
            assert sum(r.num_admissions > 1 for r in reqs) > 0
    assert outs["true"] == outs["false"]


def test_eviction_comes_before_preemption():
    """Cached pages nobody holds count as free: a pool full of them preempts nobody."""
    engine = LLM(TINY + ["kv.page_size=4", "scheduler.max_context=128", "kv.max_total_tokens=128"]).engine
    rng = random.Random(3)
    for _ in range(4):  # each leaves ~60 tokens of cached pages: the pool fills with them
        run_token_prompts(engine, [[rng.randrange(100, 5000) for _ in range(50)]], 12)
    assert engine.allocator.num_cached_pages > 20 and engine.scheduler.num_preemptions == 0
    run_token_prompts(engine, [[rng.randrange(100, 5000) for _ in range(60)]], 60)
    assert engine.scheduler.num_preemptions == 0 and engine.allocator.cache.num_evicted > 0


SPEC = [
    ["speculative=ngram", "speculative.num_steps=3", "speculative.version=v1"],
    ["speculative=ngram", "speculative.num_steps=3", "speculative.version=v2"],
    ["speculative=ngram", "speculative.num_steps=2", "speculative.topk=2"],
    ["speculative=suffix", "speculative.num_steps=3"],
    ["speculative=layer_skip", "speculative.num_steps=2", "speculative.version=v1"],
    ["speculative=layer_skip", "speculative.num_steps=2", "speculative.version=v2"],
    ["speculative=draft_model", "speculative.draft_model=tiny_llama", "speculative.num_steps=2",
     "speculative.version=v1"],
    ["speculative=draft_model", "speculative.draft_model=tiny_llama", "speculative.num_steps=2",
     "speculative.topk=2"],
    ["speculative=draft_model", "speculative.draft_model=tiny_llama", "speculative.num_steps=2",
     "speculative.version=v2"],
    ["speculative=eagle", "speculative.num_steps=2", "speculative.version=v1"],
    ["speculative=eagle", "speculative.num_steps=2", "speculative.topk=2"],
    ["speculative=eagle", "speculative.num_steps=2", "speculative.version=v2"],
]


@pytest.mark.parametrize("spec", SPEC, ids=lambda s: "-".join(x.split("=")[1] for x in s[:1] + s[2:]))
def test_speculation_with_the_cache_equals_plain_decoding(spec, reference, page_size):
    engine = LLM(TINY + spec + [f"kv.page_size={page_size}", "scheduler.max_running_requests=4"]).engine
    first, second = two_turns(engine)
    assert (tokens(first), tokens(second)) == reference
    lag = 3 if "speculative=draft_model" in spec and "speculative.version=v2" not in spec else 0  # (v1 catches up late)
    assert_turn_two_hits(first, second, page_size, lag)


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("turn", ["shared_prompt", "next_turn"])
def test_a_head_drafters_state_after_a_cached_prefix_equals_a_full_prefill(version, turn):
    """EAGLE's first draft after a cached prefix: the head's logits at the root equal those of a full prefill
    (its K/V of the cached pages come from its own pool, the target's hidden state at the boundary from the
    page table: written by a prefill for a shared prompt, by a verify step for the next turn of a conversation)."""
    from framework.request import Request
    from framework.sampling import SamplingParams

    prompts, follow = workload(0)
    roots = {}
    for on in ("true", "false"):
        engine = LLM(TINY + ["speculative=eagle", "speculative.num_steps=2", f"speculative.version={version}",
                             f"kv.prefix_cache={on}", "kv.page_size=16", "scheduler.max_context=256"]).engine
        first = run_token_prompts(engine, prompts[:1], 4 if turn == "shared_prompt" else 40)[0]  # cached
        prompt = prompts[1] if turn == "shared_prompt" else first.prompt_ids + first.output_ids + follow[0]
        seen, launch = [], engine.drafter.on_prefill_launch

        def spy(step, *args) -> None:  # v2: the head's state at the root, by request row
            launch(step, *args)
            seen.append(engine.drafter.root_logits[step.reqs[0].row].clone())

        engine.drafter.on_prefill_launch = spy
        req = Request(rid=0, prompt_ids=prompt, params=SamplingParams(max_tokens=1), seed=0, max_new_tokens=1)
        engine.submit(req)
        while engine.has_work():  # it finishes right after its prefill
            engine.step()
        logits = req.drafter_state.logits if version == "v1" else seen[-1]
        assert logits.abs().max() > 0
        roots[on] = (req.num_cached_tokens, logits.clone())
    assert roots["true"][0] == (64 if turn == "shared_prompt" else 112) and roots["false"][0] == 0
    assert (roots["true"][1] - roots["false"][1]).abs().max() < 1e-4


def test_mtp_with_the_cache_equals_plain_decoding():
    base = ["model=dsa_tiny", "compile=eager", "model.device=cpu", "kv.page_size=16"]
    prompts, follow = workload(4)
    ref = LLM(base + ["kv.prefix_cache=false"]).engine
    want = tokens(run_token_prompts(ref, prompts[:4], 8))
    for version in ("v1", "v2"):
        engine = LLM(base + ["speculative=mtp", "speculative.num_steps=2", f"speculative.version={version}"]).engine
        reqs = run_token_prompts(engine, prompts[:4], 8)
        assert tokens(reqs) == want and reqs[1].num_cached_tokens == 64


def test_compiled_engine_with_the_cache():
    eager = LLM(TINY + ["kv.prefix_cache=false"]).engine
    engine = LLM(["model=tiny_llama", "compile=reduce_overhead", "compile.batch_sizes=[1,2,4]",
                  "scheduler.max_running_requests=4"]).engine
    first, second = two_turns(engine)
    assert [tokens(t) for t in two_turns(eager)] == [tokens(first), tokens(second)]
    assert_turn_two_hits(first, second, 16)


def test_cache_off_keeps_the_old_bookkeeping():
    engine = LLM(TINY + ["kv.prefix_cache=false", "kv.page_size=4"]).engine
    prompts, _ = workload(0)
    reqs = run_token_prompts(engine, prompts + prompts, 6)
    assert engine.allocator.cache is None and all(r.num_cached_tokens == 0 for r in reqs)
    assert engine.scheduler.num_prefill_tokens == engine.scheduler.num_prompt_tokens
    assert engine.allocator.num_free_pages == engine.allocator.num_pages  # every page back on the free list
    engine.allocator.assert_all_free()


def test_config_value_is_checked():
    assert compose(["model=tiny_llama"]).kv.prefix_cache is True
    with pytest.raises(ConfigError, match=r"^kv\.prefix_cache: Value 'maybe' is not a valid bool"):
        compose(["model=tiny_llama", "kv.prefix_cache=maybe"])
    from framework.config.load import to_config

    with pytest.raises(ConfigError, match=r"^kv\.prefix_cache='x' is not allowed; expected true or false$"):
        to_config({"kv": {"prefix_cache": "x"}})


def test_outputs_and_metrics_report_cached_tokens():
    from framework.jobs.generate import metrics

    llm = LLM(TINY)
    system = "You are a terse assistant who answers in one word. " * 6
    outs = llm.generate([{"prompt": system + q, "max_tokens": 4} for q in ("Sky?", "Grass?", "Snow?")])
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens > 0
    assert outs[1].to_json()["num_cached_tokens"] == outs[1].num_cached_tokens
    m = metrics(llm.engine, outs)
    assert m["prefix_cache"] is True and m["num_cached_prompt_tokens"] == sum(o.num_cached_tokens for o in outs)
    assert m["prefix_cache_hit_rate"] == round(m["num_cached_prompt_tokens"] / m["num_prompt_tokens"], 4) > 0.5
    assert m["num_prefill_tokens"] == m["num_prompt_tokens"] - m["num_cached_prompt_tokens"]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [[], ["speculative=ngram", "speculative.num_steps=3"],
                                  ["speculative=eagle", "speculative.num_steps=3"],
                                  ["speculative=draft_model", "speculative.draft_model=smollm2_135m_random",
                                   "speculative.num_steps=3", "speculative.version=v2"]], ids=["none", "ngram", "eagle",
                                                                                              "draft_model"])
def test_cache_on_equals_off_on_cuda(spec):
    """CUDA graphs, the overlapped loop, Triton attention and v2 speculation: the cache changes no token."""
    from tests.test_gpu import cuda_overrides

    base = ["model=smollm2_135m_random", "attention=triton", "scheduler.max_running_requests=4",
            "compile.batch_sizes=[1,2,4]", "kv.page_size=16", *spec]
    runs = {}
    for on in ("true", "false"):
        engine = LLM(cuda_overrides(*base, f"kv.prefix_cache={on}")).engine
        assert engine.overlap or engine.spec_version == "v1"
        runs[on] = two_turns(engine)
    assert [tokens(t) for t in runs["true"]] == [tokens(t) for t in runs["false"]]
    assert_turn_two_hits(*runs["true"], 16)
