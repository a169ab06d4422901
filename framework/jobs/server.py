"""``run=server``: serve the model over an OpenAI-compatible HTTP API until interrupted (see docs/SERVER.md)."""

from __future__ import annotations

from framework.config import Config
from framework.jobs import JOBS


@JOBS.register("server")
def run_server(config: Config) -> int:
    from framework.server import serve

    serve(config)
    return 0
