"""Shared fixtures: the KV-leak check after every test, GPU skipping, cached engines, and the Triton-interpreter
subprocesses started in the background."""

from __future__ import annotations

import os
import sys
import weakref
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from framework.engine import Engine  # noqa: E402

_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()
_original_init = Engine.__init__


def _tracking_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    _ENGINES.add(self)


Engine.__init__ = _tracking_init


@pytest.fixture(autouse=True)
def kv_slots_all_free():
    """NOTE: the invariant every generation test relies on: once an engine has no work, every KV slot and
    request row is free again (or, with the prefix cache, cached with no request holding it); and at any time
    between steps the prefix cache's reference counts equal the requests holding each page, no page is both free
    and cached, and free + cached + held pages are all pages (``KVAllocator.check_invariants``)."""
    yield
    for engine in list(_ENGINES):
        engine.allocator.check_invariants()
        if not engine.has_work():
            engine.allocator.assert_all_free()


def pytest_collection_finish(session):
    """Start the Triton-interpreter subprocesses of the collected tests in the background, one at a time beside
    this process (tests/interpreted_runner.py): on a machine of two or more cores they run while the other tests do."""
    from tests import interpreted_runner

    if session.config.option.collectonly or (os.cpu_count() or 1) < 2:
        return
    interpreted_runner.start([job for item in session.items if (job := interpreted_runner.job_of(item)) is not None])


def pytest_sessionfinish(session, exitstatus):
    from tests import interpreted_runner

    interpreted_runner.stop()


def pytest_collection_modifyitems(config, items):
    from tests import interpreted_runner

    # the tests that wait for a Triton-interpreter subprocess go last, so that every subprocess has had the whole
    # session to run in the background (pytest_collection_finish)
    items.sort(key=lambda item: interpreted_runner.job_of(item) is not None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TINY = ["model=tiny_llama", "compile=eager"]


@pytest.fixture(scope="session")
def tiny_llm():
    """A shared eager tiny_llama engine (tests must leave it idle)."""
    from framework import LLM

    return LLM(TINY + ["scheduler.max_running_requests=8"])
