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
    '{"id": "f", "prompt": "x", "seed": 18446744073709551616}',  # an int64 overflow once failed the whole batch
    '{"id": "g", "prompt": "bad \\ud800 char"}',  # a lone surrogate: the tokenizer raised TypeError
    '"a string"',
    '{"id": "h", "prompt": "caf\xe9"}',  # written as Latin-1 below: not UTF-8
    '{"id": "i", "prompt": "x", "max_token": 2, "max_tokens": 3}',  # a typo: warned about, ignored
]


def test_jsonl_in_jsonl_out(tmp_path):
    src, dst, metrics = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "m.json"
    src.write_bytes(("\n".join(LINES) + "\n").encode("latin-1"))
    proc = run_cli("model=tiny_llama", "compile=eager", f"run.prompts_file={src}", f"run.output_file={dst}",
                   f"run.metrics_file={metrics}", "sampling.max_tokens=8", "kv.page_size=1")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b", "c", None, "d", "e", None, "f", "g", None, None, "i"]
    assert [r["finish_reason"] for r in rows] == ["length", "length", "error", "error", "error", "length"] + \
        ["error"] * 5 + ["length"]
    assert "line 8: a request must be a JSON object, got list" == rows[6]["error"]
    assert "seed=" in rows[7]["error"] and "64 bits" in rows[7]["error"]
    assert "prompt is not valid Unicode text" in rows[8]["error"]
    assert rows[9]["error"] == "line 11: a request must be a JSON object, got str"
    assert rows[10]["error"].startswith("line 12: not UTF-8 text") and len(rows[11]["token_ids"]) == 3
    assert "unknown field 'max_token'" in proc.stdout + proc.stderr
    assert len(rows[0]["token_ids"]) == 6 and len(rows[1]["token_ids"]) == 4 and len(rows[5]["token_ids"]) == 5
    assert all(isinstance(t, int) for t in rows[0]["token_ids"]) and rows[0]["num_prompt_tokens"] == 4
    assert "malformed JSON" in rows[3]["error"] and "line 4" in rows[3]["error"]
    assert "temperature" in rows[4]["error"] and "error" not in rows[0]
    m = json.loads(metrics.read_text())
    assert {"num_requests", "num_output_tokens", "wall_s", "tokens_per_s", "startup_s"} <= set(m)
    assert m["num_requests"] == 12 and m["num_output_tokens"] == 18 and m["wall_s"] > 0
    assert "tokens/s" in proc.stdout


def test_unreadable_input_or_unwritable_output_fails_before_the_model_loads(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for args, needle in [([f"run.prompts_file={tmp_path / 'nope.jsonl'}"], "expected an existing file"),
                         ([f"run.prompts_file={tmp_path}"], "expected an existing file"),
                         ([f"run.output_file={blocker / 'out.jsonl'}"], "run.output_file="),
                         ([f"run.metrics_file={tmp_path}"], "run.metrics_file=")]:
        proc = run_cli("model=tiny_llama", "compile=eager", "run.progress=false", *args)
        assert proc.returncode == 2, proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr, proc.stderr


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
