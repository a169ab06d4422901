"""tfs_kernels/inductor_fallbacks.py: the tfs ops get inductor's fallback lowering before a compile, and a compiled graph
through a pre-registered opaque op computes what eager code does."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config
from torch._inductor.lowering import lowerings

import tfs_kernels.decode_attention  # noqa: F401  (registers tfs::decode_attention[_pdl])
import tfs_kernels.gemv  # noqa: F401
from tfs_kernels.inductor_fallbacks import register_inductor_fallbacks


@torch.library.custom_op("tfs::test_fallback_layer", mutates_args=())
def _layer(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An opaque op (inductor cannot trace into a custom_op, as into the *_pdl ops): x * w + residual."""
    return x * w + residual


@_layer.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("tfs::test_fallback_tail", mutates_args=())
def _tail(x: torch.Tensor) -> torch.Tensor:
    """An opaque op that a graph meets only after a deep chain of opaque ops, as the step's last kernels are."""
    return x * 2


@_tail.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_every_imported_tfs_op_gets_a_lowering_once() -> None:
    register_inductor_fallbacks()
    for name in ("decode_attention_pdl", "gemv_pdl", "test_fallback_layer", "test_fallback_tail"):
        assert getattr(torch.ops.tfs, name).default in lowerings, name
    assert register_inductor_fallbacks() == []  # idempotent


def _layers(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    # each layer's output feeds the next op twice (input and residual), as the fused decoder layers' kernels do:
    # an external kernel's IR text embeds its inputs' texts, so the text of the chain's end doubles per layer
    for w in ws:
        x = torch.ops.tfs.test_fallback_layer(x, x, w)
    return x


def _chain(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    return torch.ops.tfs.test_fallback_tail(_layers(x, ws))  # the tail op is met only here, after every layer


def test_compiled_chain_through_a_preregistered_opaque_op_matches_eager() -> None:
    register_inductor_fallbacks()
    assert torch.ops.tfs.test_fallback_layer.default in lowerings

    x = torch.randn(4, 8)
    ws = [torch.randn(8) for _ in range(6)]
    torch.testing.assert_close(torch.compile(_layers, fullgraph=True)(x, ws), _layers(x, ws))


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
def test_an_op_first_met_after_a_deep_chain_compiles() -> None:
    """Torch <= 2.12 formats an implicit fallback's arguments for a log line: without the registration, the tail op
    after 40 layers would stringify ~2^40 nodes (2026-12-01: the 8B step's compile never ended). Torch 2.13
    formats it lazily, so there this test checks only the compiled result."""
    register_inductor_fallbacks()
    x = torch.randn(2, 4) / 8
    ws = [torch.randn(4) / 8 for _ in range(40)]
    with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph would skip the lowering
        torch.testing.assert_close(torch.compile(_chain, fullgraph=True)(x, ws), _chain(x, ws))
