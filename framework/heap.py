"""The Python heap an engine's start-up leaves behind, kept out of the garbage collector's way while it serves.

Start-up on CUDA compiles and records programs: dynamo's and inductor's objects, CUDA-graph trees, the model. That
heap is about a million objects that live as long as the engine (958k for SmolLM2's shape compiled on the CPU), and
CPython's collector rescans the whole oldest generation when enough objects have been promoted into it since its
last full collection (25% of it, counted from whenever that collection happened during start-up): a full collection
in the serving loop then stops the host for as long as one takes (0.2 s for a 449k-object heap on the CPU machine:
docs/PERFORMANCE.md), hundreds of a small model's steps, at a moment nobody chose. As SGLang and vLLM do after
capturing their CUDA graphs, the engine collects once at the end of its start-up and freezes what survives
(``gc.freeze``: moved to a permanent generation that collections do not scan); what the serving loop allocates is
collected as before. An engine's close(), and the start of the next engine, unfreeze it (``gc.unfreeze``), so an
engine that is dropped can be collected (tests build many engines in one process).

On the CPU nothing is frozen: there the forward, not the host, bounds a step, and the full collection would add to
every engine's start-up (hundreds of engines in the test suite).
"""

from __future__ import annotations

import gc

import torch

# False: nothing is frozen (a constant so that bench/knobs.py --set can compare the two in one commit)
FREEZE = True


def settle(device: torch.device) -> int:
    """End of an engine's start-up: on CUDA collect, then freeze the surviving heap; returns the objects frozen."""
    if device.type != "cuda" or not FREEZE:
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """An engine starts or closes: the heap frozen by :func:`settle` is collectable again."""
    gc.unfreeze()


__all__ = ["settle", "thaw"]
