"""The Triton-interpreter subprocesses of the CPU suite, started in the background as soon as the session's tests are
collected (tests/conftest.py), one at a time beside the main process, so that they run while the other tests do.

A test declares its subprocess with :func:`interpreted_subprocess`; its body then waits for the background run (or
runs the subprocess itself where none was started: a single test, ``-p no:...``, a machine with one core)."""

from __future__ import annotations

import functools
import inspect
import os
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]

Job = tuple[str, tuple[str, ...], int]  # (test file, pytest arguments, timeout in seconds)
_futures: dict[Job, Future] = {}
_stopping = threading.Event()
_current: list[subprocess.Popen] = []


def interpreted_subprocess(*pytest_args: str, timeout: int = 600) -> Callable:
    """Decorator: the test runs its file's CPU tests selected by ``pytest_args`` in a fresh ``TRITON_INTERPRET=1``
    process (and fails with its report)."""
    def wrap(fn: Callable) -> Callable:
        job: Job = (inspect.getfile(fn), tuple(pytest_args), timeout)

        @functools.wraps(fn)
        def test() -> None:
            check(*result(job))

        test.interpreted_job = job  # type: ignore[attr-defined]
        return test
    return wrap


def _run(job: Job) -> tuple[int, str, str]:
    test_file, pytest_args, timeout = job
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-m", "not gpu", *pytest_args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _current.append(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\n(stopped after {timeout} s)"
    finally:
        _current.remove(proc)
    return proc.returncode, out, err


def check(returncode: int, out: str, err: str) -> None:
    """Fail with the subprocess's report unless every selected test passed (none skipped)."""
    assert returncode == 0, out[-6000:] + err[-3000:]
    lines = out.splitlines()
    assert " passed" in out and lines and "skipped" not in lines[-1], out[-2000:]


def result(job: Job) -> tuple[int, str, str]:
    """The job's (return code, stdout, stderr): from its background run, else run now."""
    future = _futures.get(job)
    return future.result() if future is not None else _run(job)


def start(jobs: list[Job]) -> None:
    """Run ``jobs`` one after another in a background thread (each result kept for its test)."""
    if not jobs:
        return
    pending = [(job, _futures.setdefault(job, Future())) for job in jobs]

    def worker() -> None:
        for job, future in pending:
            if _stopping.is_set():
                future.set_result((1, "", "the test session ended before this subprocess ran"))
                continue
            try:
                future.set_result(_run(job))
            except BaseException as err:  # noqa: BLE001 - handed to the test
                future.set_exception(err)

    threading.Thread(target=worker, name="interpreted-subprocesses", daemon=True).start()


def stop() -> None:
    """End the background runs (the session is over: their tests will not ask for them)."""
    _stopping.set()
    for proc in list(_current):
        proc.kill()


def job_of(item) -> Optional[Job]:
    """The item's subprocess job, unless a skipif marker with a true condition skips it."""
    job = getattr(getattr(item, "function", None), "interpreted_job", None)
    if job is None or any(m.args and m.args[0] is True for m in item.iter_markers("skipif")) \
            or item.get_closest_marker("skip") is not None:
        return None
    return job
