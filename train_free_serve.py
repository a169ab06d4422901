"""Entry point: compose the config with Hydra, build the engine, run the chosen job.

    python train_free_serve.py model=tiny_llama attention=sdpa compile=eager kv.page_size=16
    python train_free_serve.py -m kv.page_size=1,16          # a Hydra multirun sweep

A bad option, key or value, or a missing or damaged weights file (not GGUF, truncated, tensors missing, unexpected
or mis-shaped), stops here with one line on stderr and exit code 2. In a multirun sweep every combination is checked
before the first job starts; a job that still fails (on a value only the built engine can judge, or a missing or
damaged file) prints its line, records it in its ``metrics.json`` and lets the other jobs and the sweep summary run;
the process then exits with code 1.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from framework.config import ConfigError, register_schemas, to_config
from framework.config.cli import precheck_overrides
from framework.jobs.sweep import FAILED_JOBS

log = logging.getLogger("train_free_serve")
register_schemas()


def in_multirun() -> bool:
    """True inside a job of a Hydra multirun sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def job_failed(line: str) -> int:
    """Report a job's error as one line on stderr. A single run exits with code 2; a sweep job writes
    ``{"error": line}`` as its metrics.json and returns 2, so that the sweep goes on."""
    print(line, file=sys.stderr)
    if not in_multirun():
        sys.exit(2)
    from hydra.core.hydra_config import HydraConfig

    job_dir = Path(HydraConfig.get().runtime.output_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "metrics.json").write_text(json.dumps({"error": line}) + "\n")
    return 2


def first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__


@hydra.main(config_path="conf", config_name="config", version_base=None)
def hydra_main(cfg: DictConfig) -> int:
    from framework.jobs import JOBS
    from framework.models import ModelNotInstalled, WeightsError
    from framework.parallel import TensorParallelError

    try:
        config = to_config(cfg)
    except ConfigError as err:
        return job_failed(f"config error: {err}")
    logging.getLogger().setLevel(config.log_level)
    try:
        return JOBS.get(config.run.name)(config)
    except ConfigError as err:  # a value that only the built engine can judge (e.g. a backend's device)
        return job_failed(f"config error: {err}")
    # a missing package, weights file, tokenizer or prompts file, or weights that are not what they claim to be
    except (ModelNotInstalled, WeightsError, OSError) as err:
        return job_failed(f"error: {first_line(err)}")
    except TensorParallelError as err:  # a rank died or hung: the engine is down
        return job_failed(f"error: {first_line(err)}")


def main() -> None:
    precheck_overrides(sys.argv[1:])
    FAILED_JOBS.clear()
    hydra_main()
    if FAILED_JOBS:  # filled by the sweep summary callback when a multirun ends
        print(f"error: {len(FAILED_JOBS)} sweep job(s) failed: {', '.join(FAILED_JOBS)} (see sweep_summary.md)",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
