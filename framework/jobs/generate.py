"""``run=generate``: scripted batch generation, JSONL prompts in, JSONL completions and a metrics summary out."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from framework.config import Config, ConfigError
from framework.jobs import JOBS
from framework.request import RequestOutput
from framework.sampling import SamplingParams

log = logging.getLogger(__name__)

SAMPLE_PROMPTS: list[dict[str, Any]] = [
    {"id": "capital", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"id": "haiku", "messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
    {"id": "code", "messages": [{"role": "user", "content": "Write a Python function that reverses a string."}]},
    {"id": "raw", "prompt": "The three primary colors are"},
]


REQUEST_FIELDS = ("id", "prompt", "messages") + SamplingParams.FIELDS


def read_prompts(path: str) -> list[dict[str, Any] | str]:
    """One entry per non-blank line: the parsed object, or a one-line error string for a bad line (not UTF-8,
    malformed JSON, not an object). Unknown fields are ignored with one warning per field name."""
    items: list[dict[str, Any] | str] = []
    unknown: set[str] = set()
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                items.append(f"line {lineno}: not UTF-8 text (byte {raw[err.start]:#04x} at column {err.start + 1})")
                continue
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                items.append(f"line {lineno}: malformed JSON ({err.msg} at column {err.colno})")
                continue
            if not isinstance(item, dict):
                items.append(f"line {lineno}: a request must be a JSON object, got {type(item).__name__}")
                continue
            for key in sorted(set(item) - set(REQUEST_FIELDS) - unknown):
                log.warning("line %d: ignoring the unknown field %r (request fields: %s)", lineno, key,
                            ", ".join(REQUEST_FIELDS))
                unknown.add(key)
            items.append(item)
    return items


def check_paths(run: Any) -> None:
    """Fail before the model loads, with one line, when the prompts cannot be read or an output cannot be
    written (rather than after generating everything)."""
    if run.prompts_file and not Path(run.prompts_file).is_file():
        raise ConfigError(f"run.prompts_file={run.prompts_file!r} is not allowed; expected an existing file")
    for key in ("output_file", "metrics_file"):
        path = getattr(run, key)
        if not path:
            continue
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8"):  # NOTE: "a" proves it writable without emptying it yet
                pass
        except OSError as err:
            raise ConfigError(f"run.{key}={path!r} cannot be written: {err.strerror or err}") from None


def generate_items(engine, items: list[dict[str, Any] | str], progress: bool) -> list[RequestOutput]:
    """Run every item; malformed ones (strings) become error outputs in place."""
    from tqdm import tqdm

    bar = tqdm(total=len(items), desc="requests", unit="req", disable=not progress, file=sys.stderr)
    good = [(i, it) for i, it in enumerate(items) if isinstance(it, dict)]
    outputs: list[RequestOutput | None] = [None] * len(items)
    for i, it in enumerate(items):
        if not isinstance(it, dict):
            outputs[i] = RequestOutput(id=None, text="", token_ids=[], finish_reason="error", num_prompt_tokens=0,
                                       error=it if isinstance(it, str) else "a request must be a JSON object")
            bar.update(1)
    results = engine.generate([dict(it, id=it.get("id", i)) for i, it in good], on_finish=lambda _: bar.update(1))
    for (i, _), out in zip(good, results):
        outputs[i] = out
    bar.close()
    return outputs  # type: ignore[return-value]


def metrics(engine, outputs: list[RequestOutput]) -> dict[str, Any]:
    wall = engine.stats.wall_s
    tokens = sum(len(o.token_ids) for o in outputs)
    out = {"num_requests": len(outputs), "num_output_tokens": tokens, "wall_s": round(wall, 4),
           "tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0, "startup_s": round(engine.startup_s, 2),
           **prefix_cache_metrics(engine)}
    if engine.spec_worker is not None:
        out.update(engine.spec_worker.stats.summary())
        sp = engine.config.speculative
        out["spec_params"] = {"num_steps": sp.num_steps, "topk": sp.topk, "num_draft_tokens": sp.num_draft_tokens,
                              "version": engine.spec_version, "adaptive": sp.adaptive}
        layers = getattr(engine.drafter, "layer_ids", None)
        if layers is not None:  # layer_skip: how many of the target's layers the resolved draft runs
            out["spec_params"]["draft_layers"] = len(layers)
        if getattr(engine.drafter, "search", None) is not None:  # layer_skip, skip_search: the set it chose
            out["skip_search"] = engine.drafter.search_metrics()
            out["spec_params"]["draft_layers"] = len(out["skip_search"]["kept_layers"])
        calls = getattr(engine.drafter, "draft_indexer_calls", None)
        if calls is not None:  # mtp: indexer top-k computations in draft forwards (fewer with index reuse)
            out["draft_indexer_calls"] = calls
            out["spec_params"]["index_reuse"] = engine.drafter.reuse_topk
    return out


def prefix_cache_metrics(engine) -> dict[str, Any]:
    """Prompt tokens admitted, those the prefix cache served, the hit rate (their ratio) and the tokens prefilled
    (re-prefills after preemption included)."""
    sched = engine.scheduler
    prompt, cached = sched.num_prompt_tokens, sched.num_cached_prompt_tokens
    return {"prefix_cache": engine.config.kv.prefix_cache, "num_prompt_tokens": prompt,
            "num_cached_prompt_tokens": cached, "prefix_cache_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "num_prefill_tokens": sched.num_prefill_tokens}


def hydra_job_dir() -> Path | None:
    """The Hydra job's output directory when running under Hydra (multirun sweeps read metrics from there)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


@JOBS.register("generate")
def run_generate(config: Config) -> int:
    from framework.engine import Engine

    run = config.run
    check_paths(run)
    engine = Engine(config)
    try:
        items: list[dict[str, Any] | str] = read_prompts(run.prompts_file) if run.prompts_file else list(SAMPLE_PROMPTS)
        outputs = generate_items(engine, items, run.progress)
        if run.output_file:  # NOTE: backslashreplace: an id holding a lone surrogate must not lose the whole file
            with open(run.output_file, "w", encoding="utf-8", errors="backslashreplace") as fh:
                for out in outputs:
                    fh.write(json.dumps(out.to_json(), ensure_ascii=False) + "\n")
        elif not run.prompts_file:
            for item, out in zip(items, outputs):
                prompt = item.get("prompt") or item["messages"][-1]["content"]  # type: ignore[union-attr]
                print(f"\n### {prompt}\n{out.text}  [{out.finish_reason}, {len(out.token_ids)} tokens]")
        else:
            for out in outputs:
                print(json.dumps(out.to_json(), ensure_ascii=False))
        summary = metrics(engine, outputs)
        job_dir = hydra_job_dir()
        for path in filter(None, [run.metrics_file, job_dir and job_dir / "metrics.json"]):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(summary, indent=2) + "\n")
        errors = sum(o.finish_reason == "error" for o in outputs)
        spec = "mean_accept_len" in summary
        print(f"\n{'requests':>10} {'errors':>7} {'out tokens':>11} {'wall s':>8} {'tokens/s':>9} {'startup s':>10}"
              + (f"{'accept len':>11}" if spec else ""))
        print(f"{summary['num_requests']:>10} {errors:>7} {summary['num_output_tokens']:>11} {summary['wall_s']:>8.2f} "
              f"{summary['tokens_per_s']:>9.1f} {summary['startup_s']:>10.1f}"
              + (f"{summary['mean_accept_len']:>11.2f}" if spec else ""))
        engine.allocator.assert_all_free()
        return 0
    finally:
        engine.close()  # (the tensor-parallel ranks, if any)
