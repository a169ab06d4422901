"""``speculative.skip_search``: the search proposes valid sets deterministically and keeps the best it scored; on a
small random model it finds a better draft than a bad starting set; changing the set never recompiles the draft's
compiled forward, whose outputs follow the set (equal to an eager forward of the same layers); metrics show it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from framework import LLM
from framework.batch import ForwardMode
from framework.kv import DUMMY_ROW
from framework.model_runner import ModelRunner
from framework.speculative.layer_skip import initial_layers
from framework.speculative.skip_search import SkipSearch
from tests.conftest import TINY

SIX = ["model.arch.num_layers=6"]
SKIP = ["speculative=layer_skip", "speculative.num_steps=3", "speculative.skip_search=true",
        "speculative.skip_ratio=0.34", "speculative.search_window=16", "speculative.search_interval=4"]  # 4 of 6 kept
GROUNDED = Path(__file__).resolve().parents[1] / "bench" / "prompts" / "grounded.jsonl"
PROMPTS = ["The quick brown fox", "1, 2, 3, 1, 2, 3, 1, 2,", "hello hello hello hello", "def f(x):\n    return",
           "Once upon a time", "import numpy as np\nimport"]


def test_proposals_are_valid_distinct_and_seeded():
    cfg = _cfg(skip_ratio=0.4)
    a, b = SkipSearch(30, initial_layers(30, cfg), seed=3), SkipSearch(30, initial_layers(30, cfg), seed=3)
    assert len(a.best) == 18 and a.best[0] == 0 and a.best[-1] == 29
    for _ in range(4):  # random rounds, then surrogate and mutation rounds
        cands = a.propose()
        assert cands == b.propose()
        assert len(set(cands)) == len(cands) == 4 and a.best not in cands
        assert all(len(c) == 18 and list(c) == sorted(set(c)) and {0, 29} <= set(c) for c in cands)
        sets = [a.best] + cands
        scores = [float(len(set(s) & set(range(12)))) for s in sets]  # a score that favours the early layers
        for s in (a, b):
            s.record(a.rounds * 16, sets, scores)
        assert set(a.best) & set(range(12)) == max((set(s) & set(range(12)) for s in sets), key=len)
    worth = a.worth()
    assert worth[1:12].mean() > worth[12:29].mean()  # the surrogate learned which layers score


def test_rounds_that_keep_the_set_back_off():
    s = SkipSearch(8, [0, 3, 7], seed=0, interval=4)
    s.record(4, [s.best, (0, 1, 7)], [0.5, 0.4])
    assert s.best == (0, 3, 7) and s.next_round == 4 + 8
    s.record(12, [s.best, (0, 1, 7)], [0.5, 0.6])
    assert s.best == (0, 1, 7) and s.switches == 1 and s.next_round == 12 + 4


def _cfg(**kw):
    from framework.config import SpeculativeConfig
    return SpeculativeConfig(name="layer_skip", skip_search=True, **kw)


def test_search_beats_a_bad_initial_set_on_smollm2():
    """The real SmolLM2 (30 layers): an early exit at layer 24 drafts worse than a set that skips 6 layers spread
    through the model; the search starting from the early exit finds better sets while serving (seeded)."""
    pytest.importorskip("transformers")
    items = [dict(json.loads(line), max_tokens=40) for line in open(GROUNDED) if line.strip()][:4]
    for item in items:
        item.pop("id", None)
    base = ["model=smollm2_135m", "compile=eager", "scheduler.max_running_requests=4", "speculative=layer_skip",
            "speculative.num_steps=3", "speculative.exit_layer=24"]
    fixed = LLM(base)
    ref = [o.token_ids for o in fixed.generate(items)]
    searched = LLM(base + ["speculative.skip_search=true", "speculative.search_interval=8"])
    assert [o.token_ids for o in searched.generate(items)] == ref
    m = searched.engine.drafter.search_metrics()
    assert m["switches"] >= 1 and len(m["kept_layers"]) == 24 and m["kept_layers"] != list(range(24))
    got = searched.engine.spec_worker.stats.summary()["mean_accept_len"]
    want = fixed.engine.spec_worker.stats.summary()["mean_accept_len"]
    assert got > want + 0.2, (got, want, m)


def test_metrics_file_shows_the_chosen_set(tmp_path):
    from framework.jobs.generate import metrics
    llm = LLM(TINY + SIX + SKIP + ["scheduler.max_running_requests=2"])
    outs = llm.generate([{"prompt": p, "max_tokens": 40} for p in PROMPTS[:2]])
    m = metrics(llm.engine, outs)
    assert m["spec_params"]["version"] == "v1" and m["spec_params"]["draft_layers"] == 4
    assert len(m["skip_search"]["kept_layers"]) == 4 and m["skip_search"]["rounds"] >= 1
    assert sorted(m["skip_search"]["kept_layers"] + m["skip_search"]["skipped_layers"]) == list(range(6))
    assert m["mean_accept_len"] >= 1.0


@torch.inference_mode()
def test_changing_the_set_does_not_recompile():
    """The draft's forward compiled once (CPU inductor, as compile=reduce_overhead builds it); switching sets
    between calls adds no compiled graph and each call's logits equal an eager forward of that set."""
    from torch._dynamo.utils import counters

    llm = LLM(TINY + SIX + SKIP + ["scheduler.max_running_requests=2"])
    drafter = llm.engine.drafter
    eager = drafter.runner
    compiled = ModelRunner(drafter.draft_model, eager.backend, True, [2], llm.engine.device, freeze=False)
    batch = drafter._score_batch([DUMMY_ROW] * 2, [16] * 2, [[(7 * i + j) % 500 for j in range(16)] for i in range(2)])
    sets = [(0, 1, 2, 3), (2, 3, 4, 5), (0, 2, 4, 5), (0, 1, 2, 3)]
    drafter.draft_model.set_layers(list(sets[0]))
    compiled.forward(batch)  # compiles
    graphs = counters["stats"]["unique_graphs"]
    outs = []
    for layers in sets:
        drafter.draft_model.set_layers(list(layers))
        got, _ = compiled.forward(batch)
        want, _ = eager.forward(batch)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        outs.append(got.clone())
    assert counters["stats"]["unique_graphs"] == graphs
    assert not torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[3])
    # a draft step (one token per request) follows the set too, through the same compiled runner
    compiled.warmup(ForwardMode.DRAFT_DECODE, 1)
    graphs = counters["stats"]["unique_graphs"]
    drafter.draft_model.set_layers([1, 2, 3, 4])
    compiled.warmup(ForwardMode.DRAFT_DECODE, 1)
    assert counters["stats"]["unique_graphs"] == graphs


def test_only_layer_skip_searches():
    from framework.config import ConfigError, compose
    with pytest.raises(ConfigError, match="speculative.skip_search"):
        compose(TINY + ["speculative=ngram", "speculative.skip_search=true"])


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["triton", "sdpa"])
def test_cuda_graphs_lossless_and_set_changes_add_no_graph(attention):
    """On the GPU (CUDA graphs; the target's pool in the stacked layout): greedy output equals plain decoding while
    the search switches sets, and a second run of the same prompts (more rounds, other sets) compiles nothing."""
    from torch._dynamo.utils import counters

    prompts = [{"prompt": p, "max_tokens": 48} for p in PROMPTS[:4]]
    base = ["model.device=cuda", "model=tiny_llama", "model.dtype=float32", "compile=reduce_overhead",
            f"attention={attention}", "scheduler.max_running_requests=4"] + SIX
    plain = [o.token_ids for o in LLM(base).generate(prompts)]
    llm = LLM(base + SKIP + ["speculative.search_window=8", "speculative.search_interval=2"])
    assert [o.token_ids for o in llm.generate(prompts)] == plain
    graphs, rounds = counters["stats"]["unique_graphs"], llm.engine.drafter.search.rounds
    assert [o.token_ids for o in llm.generate(prompts)] == plain
    assert llm.engine.drafter.search.rounds > rounds and counters["stats"]["unique_graphs"] == graphs
