"""Jobs the entry point can run, chosen by ``run=<name>``."""

from framework.registry import Registry

JOBS: Registry = Registry("job", lazy={"generate": "framework.jobs.generate", "server": "framework.jobs.server"})

__all__ = ["JOBS"]
