"""The collectives inside a tensor-parallel model forward. Eagerly they are torch.distributed's in-place ops; under
torch.compile the functional collectives (``torch.distributed._functional_collectives``), which dynamo traces and
CUDA graphs capture."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from framework.parallel.shard import TPInfo


def all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """The sum of ``x`` over the ranks (a row-parallel projection's partial products)."""
    if torch.compiler.is_compiling():
        return funcol.all_reduce(x, "sum", tp.group)
    dist.all_reduce(x, group=tp.group)
    return x


def gather_vocab(logits: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """``[m, vocab / N]`` logits of this rank's vocabulary rows -> ``[m, vocab]``, ranks in order."""
    m, part = logits.shape
    if torch.compiler.is_compiling():
        gathered = funcol.all_gather_tensor(logits.contiguous(), 0, tp.group)  # [N * m, part]
    else:
        gathered = logits.new_empty(tp.size * m, part)
        dist.all_gather(list(gathered.chunk(tp.size)), logits.contiguous(), group=tp.group)
    return gathered.view(tp.size, m, part).transpose(0, 1).reshape(m, tp.size * part)


def embed_vocab(weight: torch.Tensor, input_ids: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Vocab-parallel embedding: each rank looks up the ids in its rows (zeros elsewhere), summed over the ranks
    (exact: one rank contributes each row)."""
    local = input_ids - tp.vocab_start
    inside = (local >= 0) & (local < weight.shape[0])
    x = F.embedding(local.clamp(0, weight.shape[0] - 1), weight)  # [n, hidden]
    return all_reduce(torch.where(inside[:, None], x, torch.zeros_like(x)), tp)
