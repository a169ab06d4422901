"""The speculation contracts (from SGLang's spec-v2 fixes), against v1 and v2 where both apply, on tiny_llama (CPU):

- ``speculative.version`` resolves: auto takes v2 for n-gram chains, v2 runs every drafter's chains, and where v2 is
  not taken v1 runs with one log line naming the reason (topk > 1, a drafter whose v2 is opt-in); v2 runs the
  overlapped loop, v1 does not;
- DRAFT_EXTEND (v1, ragged) and DRAFT_EXTEND_V2 (graph-static: num_steps + 1 tokens per request, the page table's
  whole width) stay two modes; token ids entering draft extend are int64 whatever their producer's dtype; the head's
  state after either is the same (the same drafts);
- token ids entering the target's verify forward are int64, and v2's drafts come from the device token history;
- a batch padded to a captured size: the metadata sees ``seq_lens_sum`` of the padded ``seq_lens``, the caller's
  batch keeps its raw value;
- committed lengths change only when an iteration's result is applied; speculative KV allocation is monotonic: no
  page that an in-flight iteration may write is freed (checked on every ``truncate``), nothing leaks;
- ``tfs::fill_bonus_tokens`` output is the next root on the device: after every v2 iteration the token history ends
  with the last emitted token;
- v2 is lossless: greedy output equals plain decoding and v1, seeded sampling equals v1 token for token.
"""

from __future__ import annotations

import logging

import pytest
import torch

from framework import LLM
from framework.batch import ForwardBatch, ForwardMode
from tests.conftest import TINY
from tests.test_speculative_lossless import DRAFTERS, items

NGRAM = DRAFTERS["ngram"] + ["scheduler.max_running_requests=8"]


@pytest.fixture(scope="module")
def reference():
    return [o.token_ids for o in LLM(TINY + ["scheduler.max_running_requests=8"]).generate(items())]


def test_version_resolution_and_fallback(caplog):
    with caplog.at_level(logging.INFO, logger="framework.engine"):
        v2 = LLM(TINY + NGRAM + ["scheduler.overlap=on"])
        tree = LLM(TINY + NGRAM + ["speculative.topk=4", "speculative.num_draft_tokens=8", "speculative.version=v2"])
        opt_in = LLM(TINY + DRAFTERS["draft_model"])
    chains = [LLM(TINY + DRAFTERS[d] + ["speculative.version=v2"]) for d in ("layer_skip", "draft_model", "eagle")]
    chains += [LLM(TINY + DRAFTERS[d]) for d in ("layer_skip", "eagle")]  # auto: v2 (run on a GPU too)
    assert v2.engine.spec_version == "v2" and v2.engine.spec_worker.version == "v2" and v2.engine.overlap
    assert tree.engine.spec_version == "v1" and opt_in.engine.spec_version == "v1"
    assert all(c.engine.spec_version == "v2" for c in chains)
    reasons = [r.getMessage() for r in caplog.records if "running v1" in r.getMessage()]
    assert len(reasons) == 2 and "topk=4" in reasons[0] and "speculative.version=v2" in reasons[1]
    assert LLM(TINY + NGRAM + ["speculative.version=v1"]).engine.spec_version == "v1"


def test_v1_refuses_the_overlapped_loop():
    with pytest.raises(Exception, match="scheduler.overlap"):
        LLM(TINY + NGRAM + ["speculative.version=v1", "scheduler.overlap=on"])


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_verify_inputs_are_int64(version):
    llm = LLM(TINY + NGRAM + [f"speculative.version={version}"])
    runner, seen = llm.engine.runner, []
    forward = runner.forward

    def spy(batch, *args, **kwargs):
        if batch.mode is ForwardMode.TARGET_VERIFY:
            seen.append((batch.input_ids.dtype, batch.positions.dtype, batch.out_cache_loc.dtype))
        return forward(batch, *args, **kwargs)

    runner.forward = spy
    llm.generate(items(3))
    assert seen and all(d == (torch.int64,) * 3 for d in seen)


def test_padded_batch_sees_the_padded_seq_lens_sum():
    llm = LLM(TINY + ["compile.batch_sizes=[4]", "scheduler.max_running_requests=8"])
    runner, dev = llm.engine.runner, llm.engine.device
    q, lens = 3, [7, 9, 11]
    n = len(lens) * q
    batch = ForwardBatch(mode=ForwardMode.TARGET_VERIFY, input_ids=torch.zeros(n, dtype=torch.int64),
                         positions=torch.arange(n), out_cache_loc=torch.zeros(n, dtype=torch.int64),
                         req_pool_indices=torch.zeros(3, dtype=torch.int64), seq_lens=torch.tensor(lens),
                         seq_lens_cpu=list(lens), extend_lens_cpu=[q] * 3, logits_index=torch.arange(n).to(dev))
    padded = runner.pad(batch)
    assert padded.padded_bs == 4 and padded.seq_lens.shape[0] == 4
    assert padded.seq_lens_sum == sum(padded.seq_lens_cpu) == int(padded.seq_lens.sum())
    assert batch.seq_lens_sum == sum(lens) and batch.bs == 3  # the caller's raw values


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_committed_lengths_and_monotonic_allocation(version, overlap, reference, monkeypatch):
    if version == "v1" and overlap == "on":
        pytest.skip("v1 runs the synchronous loop")
    small = ["kv.page_size=1", "scheduler.max_context=64", "kv.max_total_tokens=150"]  # preemption too
    llm = LLM(TINY + NGRAM + small + [f"speculative.version={version}", f"scheduler.overlap={overlap}"])
    engine, alloc = llm.engine, llm.engine.allocator
    worker = engine.spec_worker
    q = engine.config.speculative.num_steps + 1
    truncate = alloc.truncate

    def checked_truncate(row, num_tokens):
        req = next(r for r in engine.scheduler.running if r.row == row)
        if req.spec_inflight:  # an in-flight iteration writes positions [kv_len, kv_len + q)
            assert num_tokens >= req.kv_len + q, (row, num_tokens, req.kv_len)
        truncate(row, num_tokens)

    monkeypatch.setattr(alloc, "truncate", checked_truncate)
    if version == "v2":  # committed lengths do not move at launch
        launch = worker.launch

        def checked_launch(step):
            before = [r.kv_len for r in step.reqs]
            launched = launch(step)
            assert [r.kv_len for r in step.reqs] == before
            return launched

        monkeypatch.setattr(worker, "launch", checked_launch)
    ref = LLM(TINY + ["scheduler.max_running_requests=8"] + small).generate(items())
    outs = llm.generate(items())
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert engine.scheduler.num_preemptions > 0
    alloc.assert_all_free()


def test_bonus_token_is_the_next_root_on_the_device():
    llm = LLM(TINY + NGRAM)
    engine = llm.engine
    worker, history = engine.spec_worker, engine.spec_worker.history
    complete = worker.complete

    def checked_complete(launched):
        finished = complete(launched)
        for req in launched.step.reqs:
            if not req.finished:
                n = len(req.prompt_ids) + len(req.output_ids)
                assert int(history.lens[req.row]) == n
                assert history.tokens[req.row, :n].tolist() == req.prompt_ids + req.output_ids
        return finished

    worker.complete = checked_complete
    outs = llm.generate(items())
    assert sum(o.spec["num_verify_steps"] for o in outs) > 0


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("drafter", ["ngram", "layer_skip", "draft_model", "eagle"])
def test_v2_equals_plain_and_v1(reference, drafter, batch, page_size):
    common = DRAFTERS[drafter] + [f"scheduler.max_running_requests={batch}", f"kv.page_size={page_size}"]
    count = len(reference) if batch > 1 else 3
    outs = {}
    for version, overlap in (("v1", "off"), ("v2", "off"), ("v2", "on")):
        llm = LLM(TINY + common + [f"speculative.version={version}", f"scheduler.overlap={overlap}"])
        outs[version, overlap] = [o.token_ids for o in llm.generate(items(count))]
        llm.engine.allocator.assert_all_free()
    assert all(o == reference[:count] for o in outs.values())


@pytest.mark.parametrize("drafter", ["ngram", "layer_skip", "draft_model", "eagle"])
def test_v2_seeded_sampling_equals_v1(drafter):
    """Same draws (draft, acceptance, residual) in both iterations: the same tokens, with and without top-k / top-p."""
    reqs = [dict(it, temperature=0.8, seed=i, **({"top_k": 5, "top_p": 0.9} if i % 2 else {}))
            for i, it in enumerate(items())]
    common = DRAFTERS[drafter] + ["scheduler.max_running_requests=8"]
    got = {v: [o.token_ids for o in LLM(TINY + common + [f"speculative.version={v}"]).generate(reqs)]
           for v in ("v1", "v2")}
    assert got["v1"] == got["v2"]


def head_batches(llm: LLM) -> list:
    """(mode, extend_lens, input dtype, key width of the metadata) of every forward of the EAGLE head."""
    runner, seen = llm.engine.drafter.runner, []
    forward = runner.forward

    def spy(batch, *args, **kwargs):
        out = forward(batch, *args, **kwargs)
        width = batch.attn.kv_slots.shape[1] if hasattr(batch.attn, "kv_slots") else None
        seen.append((batch.mode, list(batch.extend_lens_cpu), batch.input_ids.dtype, width))
        return out

    runner.forward = spy
    return seen


def test_draft_extend_modes_stay_apart():
    """v1 catches the head up with the ragged DRAFT_EXTEND; v2 with DRAFT_EXTEND_V2: every request feeds num_steps + 1
    int64 tokens, over the page table's whole width (never a host-derived length); prefill chunks stay ragged."""
    eagle = DRAFTERS["eagle"] + ["scheduler.max_running_requests=4", "scheduler.max_prefill_tokens=5"]
    q = 4  # num_steps 3
    v1 = LLM(TINY + eagle + ["speculative.version=v1"])
    seen = head_batches(v1)
    v1.generate(items(4))
    modes = {m for m, *_ in seen}
    assert ForwardMode.DRAFT_EXTEND in modes and ForwardMode.DRAFT_EXTEND_V2 not in modes
    assert not ForwardMode.DRAFT_EXTEND.uniform and ForwardMode.DRAFT_EXTEND_V2.uniform
    v2 = LLM(TINY + eagle + ["speculative.version=v2"])
    seen = head_batches(v2)
    v2.generate(items(4))
    extends = [s for s in seen if s[0] is ForwardMode.DRAFT_EXTEND_V2]
    assert extends and all(set(lens) == {q} and dtype == torch.int64 for _, lens, dtype, _ in extends)
    assert all(width == v2.engine.allocator.req_to_token.shape[1] for *_, width in extends)
    ragged = [s for s in seen if s[0] is ForwardMode.DRAFT_EXTEND]  # the prefill chunks (and their roots)
    assert ragged and all(max(lens) <= 6 for _, lens, _, _ in ragged)


def test_draft_extend_v2_takes_int64_whatever_the_producer_gave():
    llm = LLM(TINY + DRAFTERS["eagle"] + ["scheduler.max_running_requests=4", "speculative.version=v2"])
    drafter, dev = llm.engine.drafter, llm.engine.device
    seen = head_batches(llm)
    rows = torch.zeros(2, dtype=torch.int64, device=dev)  # dummy rows: nothing of a request is touched
    hidden = torch.zeros(8, llm.engine.model.args.hidden_size, dtype=llm.engine.dtype, device=dev)
    drafter.extend_v2(rows, torch.zeros(2, dtype=torch.int64), torch.ones(2, 4, dtype=torch.int32),
                      torch.ones(2, dtype=torch.int64), hidden, [4, 4])
    assert seen == [(ForwardMode.DRAFT_EXTEND_V2, [4, 4], torch.int64, llm.engine.allocator.req_to_token.shape[1])]


@pytest.mark.parametrize("page_size", [1, 16])
def test_eagle_v2_drafts_what_v1_drafts(page_size):
    """The head's state after DRAFT_EXTEND_V2 (picked at arange(bs) * q + accept_len - 1) and after a chunked
    prefill is v1's: the same draft tokens in every verify batch."""
    common = DRAFTERS["eagle"] + ["scheduler.max_running_requests=4", "scheduler.max_prefill_tokens=3",
                                  f"kv.page_size={page_size}"]
    got = {}
    for version in ("v1", "v2"):
        llm = LLM(TINY + common + [f"speculative.version={version}"])
        runner, seen = llm.engine.runner, []
        forward = runner.forward

        def spy(batch, *args, **kwargs):
            if batch.mode is ForwardMode.TARGET_VERIFY:
                seen.append(batch.input_ids.tolist())
            return forward(batch, *args, **kwargs)

        runner.forward = spy
        llm.generate(items())
        llm.engine.allocator.assert_all_free()
        got[version] = seen
    assert got["v1"] and got["v1"] == got["v2"]


@pytest.mark.parametrize("drafter", ["ngram", "eagle"])
def test_v2_neither_records_nor_runs_a_plain_decode_forward(drafter, monkeypatch):
    """v2 runs every decode step as its own iterations, so the target's runner records no plain DECODE graphs at
    start-up (v1, which falls back to plain steps, does) and runs none while serving."""
    from framework.model_runner import ModelRunner

    calls: list[tuple] = []
    warmup, forward = ModelRunner.warmup, ModelRunner.forward

    def record_warmup(self, mode, *args, **kwargs):
        calls.append((self, mode))
        return warmup(self, mode, *args, **kwargs)

    def record_forward(self, batch, *args, **kwargs):
        calls.append((self, batch.mode))
        return forward(self, batch, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "warmup", record_warmup)
    monkeypatch.setattr(ModelRunner, "forward", record_forward)
    modes = {}
    for version in ("v1", "v2"):
        calls.clear()
        llm = LLM(TINY + DRAFTERS[drafter] + ["scheduler.max_running_requests=8", f"speculative.version={version}"])
        llm.generate(items(3))
        modes[version] = {mode for runner, mode in calls if runner is llm.engine.runner}
    assert ForwardMode.DECODE in modes["v1"]
    assert ForwardMode.DECODE not in modes["v2"] and ForwardMode.TARGET_VERIFY in modes["v2"]
