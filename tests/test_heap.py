"""The start-up heap out of the garbage collector's scans while an engine serves (framework/heap.py): frozen at the
end of a CUDA engine's start-up, collectable again when it closes or the next engine starts; never on the CPU."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from framework import LLM, heap


@pytest.fixture(autouse=True)
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


class _Node:
    """A cycle's member (weakly referenceable)."""


def test_settle_freezes_what_survives_a_collection_on_cuda_only_and_thaw_undoes_it():
    assert heap.settle(torch.device("cpu")) == 0 and gc.get_freeze_count() == 0
    kept, dropped = _Node(), _Node()
    kept.self, dropped.self = kept, dropped  # two reference cycles; one is garbage when start-up ends
    gone = weakref.ref(dropped)
    del dropped
    frozen = heap.settle(torch.device("cuda"))  # (no GPU needed: gc only)
    assert frozen > 0 and gc.get_freeze_count() == frozen
    assert gone() is None  # collected before the freeze, not frozen with the heap
    heap.thaw()
    assert gc.get_freeze_count() == 0 and kept.self is kept


def test_an_engine_thaws_an_earlier_engines_heap_at_start_and_at_close():
    gc.freeze()  # as a CUDA engine leaves the heap
    assert gc.get_freeze_count() > 0
    llm = LLM(["model=tiny_llama", "compile=eager"])
    assert gc.get_freeze_count() == 0  # thawed at start; the CPU engine freezes nothing
    gc.freeze()
    llm.close()
    assert gc.get_freeze_count() == 0


@pytest.mark.gpu
def test_a_cuda_engine_serves_with_its_start_up_heap_frozen_and_thaws_it_at_close():
    from tests.test_gpu import cuda_overrides

    config = cuda_overrides("model=smollm2_135m_random", "model.arch.num_layers=2", "attention=triton",
                            "scheduler.max_running_requests=2", "compile.batch_sizes=[1,2]")
    llm = LLM(config)
    frozen = gc.get_freeze_count()
    assert frozen > 0
    out = llm.generate([{"prompt": "The history of the city begins", "max_tokens": 8, "ignore_eos": True}])
    assert len(out[0].token_ids) == 8 and gc.get_freeze_count() == frozen  # serving leaves the frozen heap alone
    llm.close()
    assert gc.get_freeze_count() == 0
