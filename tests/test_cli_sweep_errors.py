"""Errors in multirun sweeps and at start-up: a bad pairing of sweep values is refused before any job runs; a job
that fails only once its engine is built (or on a missing file) is reported in the sweep summary while the other
jobs still run; a missing weights file is one line; a draft model with another vocabulary is refused before its
weights are built."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from framework.config.cli import expand_sweeps
from tests.test_config import run_cli

ENTRY = Path(__file__).resolve().parents[1] / "train_free_serve.py"
FAST = ["model=tiny_llama", "compile=eager", "sampling.max_tokens=2", "run.progress=false"]


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.strip()]


def one_prompt(tmp_path: Path) -> str:
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "r", "prompt": "a b c a b c"}\n')
    return f"run.prompts_file={src}"


def test_expand_sweeps_cross_product_and_cap():
    full = expand_sweeps(["speculative=none,ngram", "speculative.num_steps=4,0", "compile=eager"])
    assert full == [["speculative=none", "speculative.num_steps=4", "compile=eager"],
                    ["speculative=none", "speculative.num_steps=0", "compile=eager"],
                    ["speculative=ngram", "speculative.num_steps=4", "compile=eager"],
                    ["speculative=ngram", "speculative.num_steps=0", "compile=eager"]]
    capped = expand_sweeps(["kv.page_size=1,2,3", "sampling.max_tokens=4,5"], limit=5)  # 6 > 5: base + singles
    assert capped == [["kv.page_size=1", "sampling.max_tokens=4"], ["kv.page_size=2", "sampling.max_tokens=4"],
                      ["kv.page_size=3", "sampling.max_tokens=4"], ["kv.page_size=1", "sampling.max_tokens=5"]]


@pytest.mark.parametrize("sweeps", [["speculative=none,ngram", "speculative.num_steps=4,0"],
                                    ["speculative.num_steps=4,0", "speculative=none,ngram"]])
def test_bad_combination_refused_before_any_job(tmp_path, sweeps):
    proc = run_cli("-m", *FAST, *sweeps, f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert not (tmp_path / "sweep" / "0").exists(), "a job ran before the bad combination was refused"
    assert proc.returncode == 2, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("config error: speculative.num_steps=0 is not allowed"), lines
    assert "speculative=ngram" in lines[0]  # names the combination


def test_job_failing_at_engine_build_does_not_stop_the_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", *FAST, one_prompt(tmp_path), "speculative=layer_skip", "speculative.exit_layer=5,1",
                   f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 1, proc.stderr  # the sweep ran to its end, but a job failed
    assert "config error: speculative.exit_layer=5 is not allowed; expected 1..2" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads((sweep / "0" / "metrics.json").read_text()) == \
        {"error": "config error: speculative.exit_layer=5 is not allowed; expected 1..2"}
    assert "mean_accept_len" in json.loads((sweep / "1" / "metrics.json").read_text())  # the later job ran
    summary = (sweep / "sweep_summary.md").read_text()
    failed = next(ln for ln in summary.splitlines() if ln.startswith("| 0 |"))
    assert "| failed |" in failed and "exit_layer=5 is not allowed" in failed
    assert next(ln for ln in summary.splitlines() if ln.startswith("| 1 | layer_skip |"))
    assert (sweep / "sweep_plot.png").read_bytes()[:4] == b"\x89PNG"


def test_missing_gguf_file_is_one_line(tmp_path):
    proc = run_cli(*FAST, "model.source=gguf", "model.path=/nonexistent.gguf")
    assert proc.returncode == 2, proc.stderr
    assert error_lines(proc) == ["error: model.path='/nonexistent.gguf' does not exist"], proc.stderr


def test_missing_gguf_file_in_a_sweep_job(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", *FAST, "model.source=gguf", "model.path=/nonexistent.gguf", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    error = "error: model.path='/nonexistent.gguf' does not exist"
    assert json.loads((sweep / "0" / "metrics.json").read_text()) == {"error": error}
    assert error in (sweep / "sweep_summary.md").read_text()
    assert not (sweep / "sweep_plot.png").exists()  # nothing to plot


def _cap_memory() -> None:
    # NOTE: a regression would build the 8B-shaped draft (32 GB in fp32): fail fast instead of taking the machine.
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def test_draft_model_vocab_mismatch_refused_before_loading():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(ENTRY), *FAST, "speculative=draft_model",
                           "speculative.draft_model=llama3_8b_random"],
                          capture_output=True, text=True, timeout=120, preexec_fn=_cap_memory)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("config error: speculative.draft_model='llama3_8b_random'"), lines
    assert "128256" in lines[0] and "49152" in lines[0]
    assert elapsed < 60
