"""framework/speculative/fused_iteration.py, run eagerly on the CPU (on CUDA it needs CUDA graphs and a backend
that builds uniform metadata from device tensors): prepare, the verify forward and the greedy finish as one
program. An all-greedy batch is finished inside it (no finish program runs) with plain decoding's tokens; in a batch
where some request samples, the program's token history update stays off and the sampling finish gives the unfused
iteration's tokens, also when batches of both kinds alternate; with the adaptive depth every width's program (1 to
num_steps + 1 verify tokens) finishes greedily inside itself."""

from __future__ import annotations

import pytest
import torch

from framework import LLM
from framework.batch import ForwardBatch, ForwardMode
from framework.speculative import fused_iteration
from framework.speculative.fused_iteration import FusedIteration
from tests.conftest import TINY
from tests.test_speculative_lossless import DRAFTERS, PROMPTS

BASE = TINY + DRAFTERS["ngram"] + ["speculative.version=v2", "scheduler.max_running_requests=4"]


def greedy_items(n: int) -> list[dict]:
    return [{"prompt": p, "max_tokens": 24, "ignore_eos": True} for p in PROMPTS[:n]]


def mixed_items(n: int) -> list[dict]:
    return [dict(it, **({"temperature": 0.9, "seed": 7 + i} if i % 2 else {})) for i, it in enumerate(greedy_items(n))]


def fused_llm(extra: tuple[str, ...] | list[str] = ()) -> tuple[LLM, dict]:
    """A v2 n-gram engine whose iterations take the fused program (eager), with its finish programs counted. sdpa
    builds its metadata on the host: here from the tensors the program computed (read back: eager, CPU)."""
    llm = LLM(BASE + list(extra))
    worker, backend = llm.engine.spec_worker, llm.engine.runner.backend
    assert worker._fused is None and not worker.graphs

    def uniform_metadata(out_cache_loc, rows, seq_lens, q):
        n = rows.shape[0] * q
        batch = ForwardBatch(mode=ForwardMode.TARGET_VERIFY, input_ids=torch.zeros(n, dtype=torch.int64),
                             positions=torch.zeros(n, dtype=torch.int64), out_cache_loc=out_cache_loc,
                             req_pool_indices=rows, seq_lens=seq_lens, seq_lens_cpu=seq_lens.tolist(),
                             extend_lens_cpu=[q] * rows.shape[0], logits_index=torch.arange(n))
        return backend.init_metadata(batch)

    backend.uniform_metadata = uniform_metadata
    worker._fused = FusedIteration(worker)
    calls = {"greedy_finish": 0, "sampling_finish": 0}

    def counted(name, fn):
        return lambda *a: calls.__setitem__(name, calls[name] + 1) or fn(*a)

    worker._greedy_fn = counted("greedy_finish", worker._greedy_fn)
    worker._sampling_fn = counted("sampling_finish", worker._sampling_fn)
    return llm, calls


@pytest.mark.parametrize("inside", [True, False])
def test_greedy_batches_finish_inside_the_program_with_plain_tokens(monkeypatch, inside):
    monkeypatch.setattr(fused_iteration, "GREEDY_FINISH", inside)  # (False: the finish a program of its own)
    plain = [o.token_ids for o in LLM(TINY + ["scheduler.max_running_requests=4"]).generate(greedy_items(6))]
    llm, calls = fused_llm()
    outs = llm.generate(greedy_items(6))
    assert [o.token_ids for o in outs] == plain
    assert (calls["greedy_finish"] == 0) == inside
    assert sum(o.spec["num_verify_steps"] for o in outs) < sum(len(o.token_ids) for o in outs)  # drafts accepted
    llm.engine.allocator.assert_all_free()


def test_sampling_batches_leave_the_history_to_the_sampling_finish():
    unfused = LLM(BASE)
    kinds = (mixed_items(4), greedy_items(4), mixed_items(4))
    want = [[o.token_ids for o in unfused.generate(items)] for items in kinds]
    llm, calls = fused_llm()
    assert [[o.token_ids for o in llm.generate(items)] for items in kinds] == want
    assert calls["sampling_finish"] > 0 and calls["greedy_finish"] == 0
    llm.engine.allocator.assert_all_free()


def test_every_width_of_the_adaptive_depth_finishes_inside_the_program():
    """``speculative.adaptive=true``: a program per verify width, 1 (a plain step) to num_steps + 1, each with the
    greedy finish."""
    from tests.test_adaptive_v2 import CycleDepths

    plain = [o.token_ids for o in LLM(TINY + ["scheduler.max_running_requests=4"]).generate(greedy_items(6))]
    llm, calls = fused_llm(["speculative.adaptive=true"])
    llm.engine.spec_worker.adaptive = CycleDepths(4)  # every depth in turn
    assert [o.token_ids for o in llm.generate(greedy_items(6))] == plain
    assert llm.engine.spec_worker.stats.summary()["chosen_draft_lengths"].keys() == {"0", "1", "2", "3", "4"}
    assert calls["greedy_finish"] == 0
