"""Entry point: compose the config with Hydra, build the engine, run the chosen job.

    python train_free_serve.py model=tiny_llama attention=sdpa compile=eager kv.page_size=16
    python train_free_serve.py -m kv.page_size=1,16          # a Hydra multirun sweep

A bad option, key or value stops here with one line on stderr and exit code 2.
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

from framework.config import ConfigError, register_schemas, to_config
from framework.config.cli import precheck_overrides

log = logging.getLogger("train_free_serve")
register_schemas()


@hydra.main(config_path="conf", config_name="config", version_base=None)
def hydra_main(cfg: DictConfig) -> int:
    from framework.jobs import JOBS
    from framework.models.loader import ModelNotInstalled

    try:
        config = to_config(cfg)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    logging.getLogger().setLevel(config.log_level)
    try:
        return JOBS.get(config.run.name)(config)
    except ConfigError as err:  # a value that only the built engine can judge (e.g. a backend's device)
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    except ModelNotInstalled as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    precheck_overrides(sys.argv[1:])
    hydra_main()


if __name__ == "__main__":
    main()
