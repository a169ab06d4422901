"""Engines that compile on CUDA start from clean compile state (framework/compile_state.py): the policy on any
machine, and on a GPU (marked ``gpu``) that a second engine in a process records its own CUDA graphs, not on top
of the first one's, and gives the same tokens."""

from __future__ import annotations

import logging
import weakref

import pytest
import torch

from framework import LLM, compile_state


class _Engine:
    """Stands in for an Engine: the policy only needs identity and liveness."""


@pytest.fixture
def fresh_state(monkeypatch):
    resets: list[int] = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    monkeypatch.setattr(compile_state, "_claimed", False)
    monkeypatch.setattr(compile_state, "_live", weakref.WeakSet())
    return resets


def test_an_engine_resets_what_a_gone_engine_left_and_never_what_a_live_one_uses(fresh_state, caplog):
    resets = fresh_state
    first = _Engine()
    compile_state.claim(first)
    assert resets == []  # the process's first compiled engine: nothing of ours to reset
    with caplog.at_level(logging.WARNING, logger="framework.compile_state"):
        second = _Engine()
        compile_state.claim(second)  # the first is alive: resetting would strand its programs
    assert resets == [] and "another engine compiled on CUDA is alive" in caplog.text
    compile_state.release(first)
    compile_state.release(second)
    third = _Engine()
    compile_state.claim(third)  # both closed
    assert resets == [1]
    third.cycle = third  # dropped without close(), held only by a reference cycle
    del third
    compile_state.claim(_Engine())
    assert resets == [1, 1]


def test_compiled_engines_off_cuda_leave_compile_state_alone(fresh_state):
    """On the CPU an engine neither claims nor resets torch's compile state (its runner's compiles are guarded on its
    own frozen weights, and the CUDA-graph trees that a reset clears do not exist there)."""
    for _ in range(2):
        LLM(["model=tiny_llama", "compile=reduce_overhead", "compile.batch_sizes=[1]",
             "scheduler.max_running_requests=2"]).close()
    assert fresh_state == [] and not compile_state._claimed


def _graph_nodes() -> int:
    """CUDA graphs recorded in this thread's cudagraph tree for the current device."""
    from torch._inductor.cudagraph_trees import get_container

    manager = get_container(torch.cuda.current_device()).tree_manager
    if manager is None:
        return 0
    count, todo = 0, [n for nodes in manager.roots.values() for n in nodes]
    while todo:
        node = todo.pop()
        count += 1
        todo.extend(n for nodes in node.children.values() for n in nodes)
    return count


@pytest.mark.gpu
def test_second_engine_in_a_process_records_its_own_graphs_and_gives_the_same_tokens():
    from tests.test_gpu import compile_names, cuda_overrides, forget_compiles

    config = cuda_overrides("model=smollm2_135m_random", "model.arch.num_layers=4", "attention=triton",
                            "scheduler.max_running_requests=2", "compile.batch_sizes=[1,2]")
    reqs = [{"prompt": "The history of the city begins", "max_tokens": 16, "ignore_eos": True},
            {"prompt": "def main():", "max_tokens": 16, "ignore_eos": True}]
    runs = []
    for _ in range(2):
        forget_compiles()
        llm = LLM(config)
        compiles = len(compile_names())
        tokens = [o.token_ids for o in llm.generate(reqs)]
        runs.append((compiles, tokens, _graph_nodes()))
        llm.close()
        del llm
    (compiles_a, tokens_a, nodes_a), (compiles_b, tokens_b, nodes_b) = runs
    assert compiles_a > 0 and compiles_b > 0  # the second engine compiled its own programs
    assert nodes_b == nodes_a  # and recorded its graphs in a tree of its own
    assert tokens_b == tokens_a
