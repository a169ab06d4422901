"""``compile.regional``: the parts of a compiled forward's decoder layers around attention as nested compile regions
(``torch.compiler.nested_compile_region``, torch >= 2.8).

Without regions dynamo inlines every layer into one flat graph, and AOTAutograd and inductor then work through all of
them: compile time grows with the depth of the model, and every program that holds the model (decode, prefill, each
verify width) pays it again. With regions, identical region graphs are installed once, so AOTAutograd and inductor
compile one layer's code and call it for every layer, and dynamo does not trace a region again whose inputs are of the
same kinds (tensors, modules, constants). Start-up times with and without: docs/PERFORMANCE.md ("Nested compile
regions").

A layer is three parts: before attention (the residual add, the input norm, the qkv projection), attention (the
backend's ops, which write the layer's K/V: outside the regions, as torch 2.11 and 2.13 refuse a custom op that
writes an input inside one), and after it (o_proj, the residual add, the post-attention norm, the MLP). Regions are
fusion boundaries, so the part after attention hands on ``(residual, delta)`` instead of their sum (as vLLM's layers
do): the next layer's first part adds them, keeping the residual add and the RMSNorm that reads it in one region (one
fused kernel, as in the flat graph), and the last delta is added outside, beside the final norm. The first layer's
first part (no delta yet) runs inline.

The fused decode path (``tfs::gemv`` with the norms and residual adds folded in), the deterministic path
(``tfs::det_matmul``, the same) and tensor parallelism (all-reduces inside the layer) run whole layers, flat: their
layers are chains of opaque ops, with little for inductor to do.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch._inductor.config  # noqa: F401  (freezing, read while tracing)
from torch import nn

_nested_region = getattr(torch.compiler, "nested_compile_region", None)


def regions_available() -> bool:
    """Whether this torch has ``torch.compiler.nested_compile_region``."""
    return _nested_region is not None


class _Traced:
    """The type of an extra region argument that dynamo's region-reuse fast path (a region called again with inputs of
    the same kinds is not traced again) does not accept, so that every region is traced and identical graphs are
    deduplicated. Passed under inductor's freezing (the CPU runner's compiles), where dynamo holds the weights as graph
    attributes and that path fails (torch 2.13: "Freevar has no source")."""


_TRACED = _Traced()


def _pre(layer: nn.Module, x: torch.Tensor, delta: Optional[torch.Tensor],
         traced: Optional[_Traced] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.pre_attention(x, delta)


def _post(layer: nn.Module, x: torch.Tensor, attn: torch.Tensor,
          traced: Optional[_Traced] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.post_attention(x, attn)


_REGIONS = (_nested_region(_pre), _nested_region(_post)) if _nested_region is not None else None


def run_layers(layers: Sequence[nn.Module], x: torch.Tensor, rope: Any, meta: Any, fused: bool, pdl: bool,
               regional: bool, det: bool = False) -> torch.Tensor:
    """``x`` ``[n, hidden]`` through ``layers`` (Llama decoder layers) in order (``fused``, ``pdl``, ``det``: see
    ``DecoderLayer.forward``); ``regional``: the parts around attention as nested compile regions while dynamo
    traces (eagerly, or without the torch support, plain calls)."""
    first = layers[0] if len(layers) else None
    if first is None or fused or det or first.mlp.tp is not None:
        for layer in layers:  # whole layers (residual adds folded into their kernels; all-reduces)
            x = layer(x, rope, meta, fused, pdl, det)
        return x
    # [n, q_size + 2 * kv_size] -> [n, heads * head_dim]
    return run_split_layers(layers, x, lambda layer, qkv: layer.self_attn.attend(qkv, rope, meta), regional)


def run_split_layers(layers: Sequence[nn.Module], x: torch.Tensor,
                     attend: Callable[[nn.Module, torch.Tensor], torch.Tensor], regional: bool) -> torch.Tensor:
    """``x`` ``[n, hidden]`` through ``layers`` in order, each as ``layer.pre_attention(x, delta) -> (x, h)``,
    ``attend(layer, h) -> a`` and ``layer.post_attention(x, a) -> (x, delta)`` (the residual stream and what the
    layer adds to it); ``regional``: the two parts around attention as nested compile regions while dynamo traces."""
    pre, post, traced = _pre, _post, None
    if regional and _REGIONS is not None and torch.compiler.is_compiling():
        pre, post = _REGIONS
        traced = _TRACED if torch._inductor.config.freezing else None
    delta = None
    for layer in layers:
        # (the first layer's first part inline: a region may not return its input)
        x, h = (_pre if delta is None else pre)(layer, x, delta, traced)
        x, delta = post(layer, x, attend(layer, h), traced)
    return x if delta is None else x + delta
