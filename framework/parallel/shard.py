"""Which slice of each Llama weight a tensor-parallel rank keeps (Megatron-style):

- q/k/v (fused ``qkv_proj``) and gate/up (fused ``gate_up_proj``): column-parallel, by output rows: rank r keeps
  query heads ``[r * H/N, (r + 1) * H/N)``, its KV heads (``KV/N`` of them, or, with fewer KV heads than ranks, the
  one KV head its query heads share: replicated over ``N/KV`` ranks) and intermediate columns ``[r * I/N, ...)``;
- o_proj and down_proj: row-parallel, by input columns (the matching heads / intermediate columns); each rank's
  product is a partial sum, all-reduced once per projection;
- embed_tokens and lm_head: vocab-parallel, by vocabulary rows ``[r * V/N, (r + 1) * V/N)`` (a tied head stays
  tied to the embedding's shard).

Norms and the rope tables are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from framework.errors import ConfigError


@dataclass
class TPInfo:
    """A rank's place in the tensor-parallel group, as the model's layers see it."""

    rank: int
    size: int
    group: Any  # the torch.distributed process group of the model's collectives
    vocab_start: int  # this rank's vocabulary rows: [vocab_start, vocab_start + vocab_size / size)


def check_tp_sizes(args: Any, size: int) -> None:
    """Raise :class:`ConfigError` (one line) unless a Llama of ``args`` splits evenly over ``size`` ranks."""
    key = f"parallel.tensor_parallel_size={size}"
    for name, value in (("num_heads", args.num_heads), ("intermediate_size", args.intermediate_size),
                        ("vocab_size", args.vocab_size)):
        if value % size:
            raise ConfigError(f"{key} is not allowed: it must divide the model's {name} ({value})")
    kv = args.num_kv_heads
    if kv % size and size % kv:
        raise ConfigError(f"{key} is not allowed: it must divide the model's num_kv_heads ({kv}) or be a multiple "
                          f"of it")


def kv_heads_of(rank: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    """(first KV head, KV heads) that ``rank`` holds: its share, or the one head its query heads use."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return rank * per, per
    return rank // (size // num_kv_heads), 1


def _own(weight: torch.Tensor) -> torch.Tensor:
    """A contiguous copy (never a view: the whole weight's storage must be freed)."""
    return weight.clone(memory_format=torch.contiguous_format)


def _keep(linear: nn.Linear, weight: torch.Tensor) -> None:
    linear.weight = nn.Parameter(_own(weight), requires_grad=False)
    linear.out_features, linear.in_features = weight.shape


@torch.no_grad()
def shard_llama(model: Any, rank: int, size: int, group: Any) -> None:
    """Replace ``model``'s weights with rank ``rank``'s slices (in place) and give its layers ``model.tp``; the
    model's ``args`` keep the whole model's sizes."""
    a = model.args
    check_tp_sizes(a, size)
    d = a.head_dim
    heads = a.num_heads // size
    kv_first, kv_heads = kv_heads_of(rank, size, a.num_kv_heads)
    inter = a.intermediate_size // size
    q_size, kv_size = a.num_heads * d, a.num_kv_heads * d
    q_rows = slice(rank * heads * d, (rank + 1) * heads * d)
    kv_rows = slice(kv_first * d, (kv_first + kv_heads) * d)
    i_rows = slice(rank * inter, (rank + 1) * inter)
    vocab = a.vocab_size // size
    info = TPInfo(rank, size, group, rank * vocab)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = attn.qkv_proj.weight.split([q_size, kv_size, kv_size])
        _keep(attn.qkv_proj, torch.cat([q[q_rows], k[kv_rows], v[kv_rows]]))
        _keep(attn.o_proj, attn.o_proj.weight[:, q_rows])
        gate, up = mlp.gate_up_proj.weight.chunk(2)
        _keep(mlp.gate_up_proj, torch.cat([gate[i_rows], up[i_rows]]))
        _keep(mlp.down_proj, mlp.down_proj.weight[:, i_rows])
        attn.num_heads, attn.num_kv_heads = heads, kv_heads
        attn.split = (heads * d, kv_heads * d, kv_heads * d)
        attn.tp = mlp.tp = info
    rows = slice(rank * vocab, (rank + 1) * vocab)
    embed = _own(model.embed_tokens.weight[rows])
    model.embed_tokens.weight = nn.Parameter(embed, requires_grad=False)
    model.embed_tokens.num_embeddings = vocab
    if a.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        model.lm_head.out_features = vocab
    else:
        _keep(model.lm_head, model.lm_head.weight[rows])
    model.tp = info
