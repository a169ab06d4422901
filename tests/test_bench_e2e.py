"""bench/e2e.py's engines in processes of their own: each child gets the parent's options for its one engine, and
the parent gathers the children's rows (a failed child is reported, the others' rows kept)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import e2e  # noqa: E402
import pytest  # noqa: E402

from framework import LLM  # noqa: E402
from framework.errors import ConfigError  # noqa: E402
from tests.conftest import TINY  # noqa: E402

OPTIONS = ["--cases", "smollm2:1", "smollm2:8", "8b:1", "--overlap", "on", "--new-tokens", "64", "--repeat", "12",
           "--prompts", "open", "--max-tokens", "256", "--kernels", "20", "--timeline", "40", "--rounds", "3", "--speculative", "none", "ngram,speculative.num_steps=2",
           "--set", "framework.models.llama.DET_MAX_ROWS=8", "--", "compile.batch_sizes=[1,8]", "attention=triton"]


def test_a_child_gets_the_parents_options_for_its_one_engine():
    parser = e2e.build_parser()
    args = parser.parse_args(OPTIONS)
    argv = e2e.child_argv(args, ["smollm2:1", "smollm2:8"], "ngram,speculative.num_steps=2", "/tmp/rows.json")
    assert argv[:2] == [sys.executable, os.path.realpath(e2e.__file__)]
    child = parser.parse_args(argv[2:])
    assert child.cases == ["smollm2:1", "smollm2:8"] and child.speculative == ["ngram,speculative.num_steps=2"]
    assert child.json == "/tmp/rows.json" and child.no_table and not child.one_process
    for key in ("overlap", "new_tokens", "repeat", "prompts", "max_tokens", "prompt_tokens", "profile", "kernels",
                "timeline", "rounds", "set", "extra"):
        assert getattr(child, key) == getattr(args, key), key
    plain = parser.parse_args(e2e.child_argv(args, ["8b:1"], None, "/tmp/rows.json")[2:])
    assert plain.speculative == [None] and plain.cases == ["8b:1"]


def test_rounds_report_the_median_round_with_every_rounds_tokens_per_s():
    rounds = [{"tokens_per_s": t, "step_ms": 1000 / t} for t in (7588.4, 10450.4, 9100.0)]
    row = e2e.median_round(rounds)
    assert row["tokens_per_s"] == 9100.0 and row["step_ms"] == 1000 / 9100.0  # the median round's own numbers
    assert row["rounds_tokens_per_s"] == [7588.4, 10450.4, 9100.0]
    assert e2e.median_round(rounds[:2])["tokens_per_s"] == 7588.4  # even: the lower middle
    assert e2e.median_round(rounds[:1]) == rounds[0]


def test_the_parent_gathers_rows_and_counts_failed_children(monkeypatch, capsys):
    args = e2e.build_parser().parse_args(OPTIONS)
    engines = [("smollm2", "none"), ("smollm2", "ngram,speculative.num_steps=2"), ("8b", "none"), ("8b", "ngram")]
    calls = []

    def fake_call(argv):
        calls.append(argv)
        child = e2e.build_parser().parse_args(argv[2:])
        if child.speculative == ["ngram"]:
            return 1  # a child that died: no rows
        rows = [{"case": c, "speculative": child.speculative[0]} for c in child.cases]
        with open(child.json, "w") as fh:
            json.dump(rows, fh)
        return 0

    monkeypatch.setattr(e2e.subprocess, "call", fake_call)
    rows, failed = e2e.run_in_processes(args, engines)
    assert len(calls) == 4 and failed == 1
    assert [(r["case"], r["speculative"]) for r in rows] == [
        ("smollm2:1", "none"), ("smollm2:8", "none"), ("smollm2:1", "ngram,speculative.num_steps=2"),
        ("smollm2:8", "ngram,speculative.num_steps=2"), ("8b:1", "none")]
    assert "8b ngram: failed (exit code 1)" in capsys.readouterr().out


def test_busy_time_is_the_union_of_kernel_intervals():
    from kernel_profile import busy_us

    assert busy_us([]) == 0.0
    # overlapping (PDL), nested, touching and separate kernels: [0, 10] u [12, 20] u [30, 31]
    assert busy_us([(12, 15), (0, 6), (4, 10), (5, 7), (14, 20), (30, 31)]) == 10 + 8 + 1


def test_the_timeline_is_a_stretch_from_the_middle_in_start_order_with_gaps():
    from kernel_profile import timeline

    spans = [("c", 20, 26), ("a", 0, 5), ("b", 7, 18), ("d", 25, 30), ("e", 31, 32)]  # d overlaps c (PDL)
    assert timeline(spans, 3) == [("b", 11, 0.0), ("c", 6, 2), ("d", 5, -1)]
    assert timeline(spans, 9)[0] == ("a", 5, 0.0) and len(timeline(spans, 9)) == 5
    assert timeline(spans, 0) == []


def test_a_v1_speculative_engine_runs_its_cases_without_overlap():
    """--overlap on with a v1 drafter (suffix trees) runs and is reported as off, as the config would have it:
    the v1 iteration drafts from the tokens the host has applied, so a prefill launched ahead broke it."""
    v1, v2 = LLM(TINY + ["speculative=suffix"]).engine, LLM(TINY + ["speculative=ngram"]).engine
    assert v1.spec_version == "v1" and v2.spec_version == "v2"
    assert e2e.engine_overlap(v1, "on") == "off" and e2e.engine_overlap(v2, "on") == "on"
    with pytest.raises(ConfigError, match="scheduler.overlap"):
        LLM(TINY + ["speculative=suffix", "scheduler.overlap=on"])
