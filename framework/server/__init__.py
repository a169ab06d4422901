"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine loop thread; see docs/SERVER.md.

app.py: routes; protocol.py: request parsing and errors; responses.py: response and chunk shapes;
loop.py: the engine thread; stream.py: streaming text deltas; metrics.py: Prometheus; runner.py: start-up.
"""

from framework.server.runner import ServerThread, serve

__all__ = ["ServerThread", "serve"]
