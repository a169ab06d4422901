"""Who owns torch's process-wide compile state: an engine that compiles on CUDA starts from a clean one.

torch.compile keeps compiled code per Python code object, process-wide, and its CUDA graphs in one tree per device
and thread (inductor's cudagraph trees). A second engine built in the same process therefore reuses the first one's
compiled programs, and each of its graph replays first walks past the graphs that the first engine recorded, whose
static inputs (the first model's weights and buffers) are not its own; and where its pool differs in size, its
recompiles make the K/V caches' sizes dynamic. On an H100 that made the second engine's batch-1 steps about 2x as
long as the same engine's in a fresh process (docs/PERFORMANCE.md, "A second engine in one process"). The first
engine's recorded graphs also stay in the tree, with their memory pool.

So an engine that compiles on CUDA, built when an earlier such engine has gone (closed, or no longer referenced),
calls ``torch._dynamo.reset()``: as in a fresh process (inductor's on-disk caches stay, so its compiles are mostly
cache hits). While another such engine is alive the two keep sharing the state (resetting would strand its
programs), and one warning says so.
"""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any

import torch

log = logging.getLogger(__name__)

_live: "weakref.WeakSet[Any]" = weakref.WeakSet()  # engines compiled on CUDA that are not closed
_claimed = False  # an engine compiled on CUDA was built in this process (its state may still be in torch)


def claim(engine: Any) -> None:
    """Called by an engine that compiles on CUDA before it compiles anything: reset torch's compile state if an
    earlier such engine left it, unless one is still alive."""
    global _claimed
    if _claimed:
        gc.collect()  # an engine dropped without close() may be held only by reference cycles
        if len(_live):
            log.warning("another engine compiled on CUDA is alive in this process: the two share torch's compiled "
                        "programs and CUDA-graph trees, which slows both engines' steps; close() it (or drop "
                        "every reference to it) before building the next engine")
        else:
            torch._dynamo.reset()
    _live.add(engine)
    _claimed = True


def release(engine: Any) -> None:
    """The engine is closed: its compile state may be reset by the next engine."""
    _live.discard(engine)


__all__ = ["claim", "release"]
