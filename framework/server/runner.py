"""Putting the server together: bind the socket, start the engine loop, build the app, run uvicorn.

:func:`serve` is what ``run=server`` runs (blocking, in the main thread). :class:`ServerThread` runs the same
server in background threads of the calling process: for tests, benchmarks and embedding.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Any, Callable, Optional

from framework.config import Config, ConfigError
from framework.server.app import create_app
from framework.server.engine_process import EngineProcess
from framework.server.loop import EngineLoop


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); a bad or busy address is a :class:`ConfigError` naming run.port."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"run.port={port!r} is not allowed; expected an integer in 0..65535 (0: any free port)")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as err:
        raise ConfigError(f"run.host={host!r} run.port={port}: cannot listen there "
                          f"({err.strerror or err}); choose another run.port or run.host") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def use_engine_process(config: Config) -> bool:
    """``run.engine_process``: auto is on where the model runs on CUDA (where the engine's host work is the step's
    critical path, and the HTTP side's per-token work must not share its GIL)."""
    setting = config.run.engine_process
    if setting not in ("auto", "on", "off"):
        raise ConfigError(f"run.engine_process={setting!r} is not allowed; expected auto, on or off")
    if setting == "auto":
        import torch

        return config.model.device in ("auto", "cuda") and torch.cuda.is_available()
    return setting == "on"


def build(config: Config, build_engine: Optional[Callable[[], Any]] = None) -> tuple[Any, Any]:
    """Start the engine loop (building the engine in its thread, or in its own process: ``run.engine_process``)
    and return (app, loop)."""
    from framework.engine import Engine

    loop: Any
    if build_engine is None and use_engine_process(config):
        loop = EngineProcess(config)
    else:
        loop = EngineLoop(build_engine or (lambda: Engine(config)), profile=config.run.profile)
    loop.start()
    run = config.run
    app = create_app(loop, run.served_model_name or config.model.name, config.sampling, run.api_key)
    return app, loop


def _uvicorn_server(app: Any, log_level: str) -> Any:
    import uvicorn

    # NOTE: no lifespan: the engine loop starts before uvicorn and stops after it
    return uvicorn.Server(uvicorn.Config(app, log_level=log_level.lower(), lifespan="off", timeout_keep_alive=30,
                                        timeout_graceful_shutdown=10))


def serve(config: Config) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM); prints the address once the server accepts connections."""
    run = config.run
    sock = bind_socket(run.host, run.port)
    app, loop = build(config)
    server = _uvicorn_server(app, "warning" if config.log_level == "INFO" else config.log_level)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    auth = "API key required" if run.api_key else "no API key"
    threading.Thread(target=_announce, args=(server, f"serving {run.served_model_name or config.model.name} on "
                                                    f"http://{shown}:{port}/v1 ({auth})"), daemon=True).start()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # uvicorn re-raises the signal it handled after shutting down
    loop.on_fatal = lambda err: setattr(server, "should_exit", True)  # the engine is down: stop serving
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # the Ctrl-C or SIGTERM that uvicorn handled: it has shut down cleanly
        pass
    finally:
        loop.stop()
        sock.close()
    if loop.fatal_error is not None:
        raise loop.fatal_error


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _announce(server: Any, line: str) -> None:
    while not server.started and not server.should_exit:
        time.sleep(0.05)
    if server.started:
        print(line, flush=True)


class ServerThread:
    """The whole server on a loopback port in background threads: ``with ServerThread(config) as s: s.url``."""

    def __init__(self, config: Config, host: str = "127.0.0.1", port: int = 0) -> None:
        self.config = config
        self.sock = bind_socket(host, port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.loop: Any = None  # an EngineLoop, or an EngineProcess with run.engine_process
        self._server: Any = None
        self._thread: Optional[threading.Thread] = None

    def start(self, timeout: float = 60.0) -> "ServerThread":
        app, self.loop = build(self.config)
        self._server = _uvicorn_server(app, "warning")
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]},
                                        name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server thread did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(30)
        if self.loop is not None:
            self.loop.stop()
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
