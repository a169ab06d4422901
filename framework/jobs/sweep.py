"""A Hydra callback that, at the end of a multirun sweep, writes one comparison table (drafter, params,
mean_accept_len, tokens/s) and a PNG plot of tokens/s against mean_accept_len into the sweep directory.

Each ``run=generate`` job writes ``metrics.json`` into its own output directory; this reads them back. A job that
failed (a value only the built engine can judge, a missing file) wrote ``{"error": "<one line>"}`` there instead:
the table lists it with its error, the plot leaves it out, and :data:`FAILED_JOBS` names it so that the entry
point can exit non-zero once the sweep is over."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)

PARAMS = ("num_steps", "topk", "num_draft_tokens")
DRAFTER_PARAMS = {"ngram": ("ngram_min", "ngram_max"), "layer_skip": ("exit_layer", "skip_layers", "draft_layers"),
                  "draft_model": ("draft_model",), "eagle": ("checkpoint",)}

# The job numbers that failed in the last sweep this process ran (filled by SweepSummary.on_multirun_end).
FAILED_JOBS: list[str] = []


def param_text(spec: dict[str, Any]) -> str:
    """``num_steps=.. topk=.. num_draft_tokens=..`` plus the drafter's own settings; ``-`` without speculation."""
    name = spec.get("name", "none")
    if name == "none":
        return "-"
    keys = PARAMS + tuple(k for k in DRAFTER_PARAMS.get(name, ()) if spec.get(k) not in (None, [], 0))
    return " ".join(f"{k}={spec.get(k)}" for k in keys)


def _read_yaml(path: Path, default: Any) -> Any:
    return (yaml.safe_load(path.read_text()) or default) if path.exists() else default


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job that wrote metrics: the drafter, its parameters, the job's overrides and its metrics, or
    its ``error`` (None for a job that finished)."""
    rows = []
    for metrics_file in sorted(sweep_dir.glob("*/metrics.json"), key=lambda p: int(p.parent.name)
                               if p.parent.name.isdigit() else 0):
        job = metrics_file.parent
        metrics = json.loads(metrics_file.read_text())
        cfg = _read_yaml(job / ".hydra" / "config.yaml", {})
        overrides = _read_yaml(job / ".hydra" / "overrides.yaml", [])
        spec = {**cfg.get("speculative", {}), **metrics.get("spec_params", {})}  # resolved values win
        rows.append({"job": job.name, "drafter": spec.get("name", "none"),
                     "params": param_text(spec),
                     "overrides": " ".join(overrides), "mean_accept_len": metrics.get("mean_accept_len", 1.0),
                     "tokens_per_s": metrics.get("tokens_per_s", 0.0), "error": metrics.get("error")})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table, one line per row; an ``error`` column appears when some job failed."""
    failed = any(r.get("error") for r in rows)
    head = "| job | drafter | params | mean_accept_len | tokens/s | overrides |" + (" error |" if failed else "")
    lines = [head, "|---|---|---|---|---|---|" + ("---|" if failed else "")]
    for r in rows:
        if r.get("error"):
            error = str(r["error"]).replace("|", "\\|")
            lines.append(f"| {r['job']} | {r['drafter']} | {r['params']} | failed | - | {r['overrides']} | {error} |")
            continue
        lines.append(f"| {r['job']} | {r['drafter']} | {r['params']} | {r['mean_accept_len']:.3f} | "
                     f"{r['tokens_per_s']:.1f} | {r['overrides']} |" + (" |" if failed else ""))
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Scatter tokens/s against mean_accept_len, one colour per drafter; failed jobs are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r.get("error")]
    fig, ax = plt.subplots(figsize=(7, 5))
    for drafter in sorted({r["drafter"] for r in rows}):
        pts = [r for r in rows if r["drafter"] == drafter]
        ax.scatter([r["mean_accept_len"] for r in pts], [r["tokens_per_s"] for r in pts], label=drafter)
        for r in pts:
            ax.annotate(r["job"], (r["mean_accept_len"], r["tokens_per_s"]), fontsize=7)
    ax.set_xlabel("mean accepted length (tokens per verify step)")
    ax.set_ylabel("tokens/s")
    ax.set_title("speculative decoding sweep")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class SweepSummary(Callback):
    """Writes ``sweep_summary.md`` and ``sweep_plot.png`` into the sweep directory when a multirun ends."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        FAILED_JOBS.clear()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect(sweep_dir)
        FAILED_JOBS[:] = [r["job"] for r in rows if r.get("error")]
        if not rows:
            return
        text = table(rows)
        (sweep_dir / "sweep_summary.md").write_text(text)
        if len(FAILED_JOBS) < len(rows):
            plot(rows, sweep_dir / "sweep_plot.png")
        print(f"\nsweep summary ({sweep_dir}):\n{text}")
