"""``run=generate`` through the command line: JSONL in, JSONL out in input order, metrics, bad lines, multirun."""

from __future__ import annotations

import json

from tests.test_config import run_cli

LINES = [
    '{"id": "a", "prompt": "The quick brown fox", "max_tokens": 6}',
    '{"id": "b", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4, "temperature": 0.7, "seed": 1}',
    '{"id": "c", "prompt": ""}',
    "this is not json",
    "",
    '{"id": "d", "prompt": "x", "temperature": -1}',
    '{"id": "e", "prompt": "Numbers: 1, 2, 3", "top_k": 5, "top_p": 0.9, "temperature": 1.0, "max_tokens": 5}',
    '["a list"]',
]


def test_jsonl_in_jsonl_out(tmp_path):
    src, dst, metrics = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "m.json"
    src.write_text("\n".join(LINES) + "\n")
    proc = run_cli("model=tiny_llama", "compile=eager", f"run.prompts_file={src}", f"run.output_file={dst}",
                   f"run.metrics_file={metrics}", "sampling.max_tokens=8", "kv.page_size=1")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b", "c", None, "d", "e", None]
    assert [r["finish_reason"] for r in rows] == ["length", "length", "error", "error", "error", "length", "error"]
    assert len(rows[0]["token_ids"]) == 6 and len(rows[1]["token_ids"]) == 4 and len(rows[5]["token_ids"]) == 5
    assert all(isinstance(t, int) for t in rows[0]["token_ids"]) and rows[0]["num_prompt_tokens"] == 4
    assert "malformed JSON" in rows[3]["error"] and "line 4" in rows[3]["error"]
    assert "temperature" in rows[4]["error"] and "error" not in rows[0]
    m = json.loads(metrics.read_text())
    assert {"num_requests", "num_output_tokens", "wall_s", "tokens_per_s", "startup_s"} <= set(m)
    assert m["num_requests"] == 7 and m["num_output_tokens"] == 15 and m["wall_s"] > 0
    assert "tokens/s" in proc.stdout


def test_builtin_samples_and_multirun(tmp_path):
    proc = run_cli("-m", "model=tiny_llama", "compile=eager", "kv.page_size=1,16", "sampling.max_tokens=4",
                   "run.progress=false", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("What is the capital of France?") == 2  # both sweep jobs printed the samples


def test_speculative_sweep_writes_table_and_plot(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"id": "r", "prompt": "a b c d a b c d a b c d a b", "max_tokens": 12}\n')
    proc = run_cli("-m", "model=tiny_llama", "compile=eager", "speculative=none,ngram", "speculative.num_steps=3",
                   f"run.prompts_file={src}", f"run.output_file={dst}", "run.progress=false",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 0, proc.stderr
    summary = (tmp_path / "sweep" / "sweep_summary.md").read_text()
    assert "| 1 | ngram | num_steps=3 topk=1 num_draft_tokens=4 ngram_min=1 ngram_max=6 |" in summary
    assert "| 0 | none | - |" in summary
    assert (tmp_path / "sweep" / "sweep_plot.png").read_bytes()[:4] == b"\x89PNG"
    row = json.loads(dst.read_text())  # the last job (ngram) wrote the output file
    assert set(row["spec"]) == {"num_verify_steps", "mean_accept_len"} and row["spec"]["num_verify_steps"] >= 1
    metrics = json.loads((tmp_path / "sweep" / "1" / "metrics.json").read_text())
    assert {"mean_accept_len", "accept_rate_per_position", "draft_time_share", "verify_time_share"} <= set(metrics)
    assert len(metrics["accept_rate_per_position"]) == 3
