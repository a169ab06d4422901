"""``speculative=eagle``: an EAGLE-style head. Input at position p: the target's embedding of token x_p
concatenated with a hidden state for position p - 1 (the target's, or the head's own while drafting), projected
back to the hidden size, one decoder layer, a norm, and the target's LM head. Random (seeded) weights unless
``speculative.checkpoint`` names a safetensors file with ``fc.weight``, ``layer.*`` and ``norm.weight``.

The head keeps its own one-layer KV pool (slot indices shared with the target). After the target's prefill and
after every verify it runs DRAFT_EXTEND over the new tokens with the target's hidden states, which leaves it at the
next root with its logits and hidden state ready for the first draft step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn

from framework.batch import ForwardBatch, ForwardMode
from framework.config import SpeculativeConfig
from framework.models.checks import load_safetensors_into
from framework.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm
from framework.speculative import DRAFTERS
from framework.speculative.base import DraftTree, SpecContext
from framework.speculative.model_drafter import ModelDrafter
from kernels.rope_store import rope_at


class EagleHead(nn.Module):
    """``forward(input_ids [n], positions [n], meta, logits_index [m], hidden_in [n, hidden])``."""

    takes_hidden_in = True

    def __init__(self, target: LlamaForCausalLM) -> None:
        super().__init__()
        self.args = target.args
        hidden = target.args.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = DecoderLayer(target.args, layer_id=0)
        self.norm = RMSNorm(hidden, target.args.rms_norm_eps)
        self.target = [target]  # a list: shared embedding / LM head / rope, not registered as a submodule

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def set_attention_backend(self, backend) -> None:
        self.layer.self_attn.backend = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, logits_index: torch.Tensor,
                hidden_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        target = self.target[0]
        x = self.fc(torch.cat([target.embed_tokens(input_ids), hidden_in.to(self.dtype)], dim=-1))  # [n, hidden]
        hidden = self.norm(self.layer(x, rope_at(target.rope_cos, target.rope_sin, positions), meta))  # [n, hidden]
        return target.lm_head(hidden[logits_index]).float(), hidden


def build_head(target: LlamaForCausalLM, checkpoint: Optional[str], seed: int) -> EagleHead:
    device, dtype = target.embed_tokens.weight.device, target.embed_tokens.weight.dtype
    head = EagleHead(target)
    if checkpoint:
        load_safetensors_into(head, checkpoint, f"speculative.checkpoint={checkpoint!r}", "the head")
    else:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in head.named_parameters():
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if p.dim() == 1
                        else torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


@dataclass
class EagleState:
    kv_len: int  # positions of the head's pool that are valid (the root's included)
    logits: Optional[torch.Tensor] = None  # [vocab] the head's output at the root: the first draft's distribution
    hidden: Optional[torch.Tensor] = None  # [hidden] the head's state at the root
    carry: Optional[torch.Tensor] = None  # [hidden] the target's state of the last prefilled prompt token


@DRAFTERS.register("eagle")
class EagleDrafter(ModelDrafter):
    name = "eagle"

    def __init__(self, engine, cfg: SpeculativeConfig) -> None:
        super().__init__(engine, cfg)
        self.head = build_head(engine.model, cfg.checkpoint, cfg.seed)
        a = engine.model.args
        self.own_runner(self.head, 1, a.num_heads, a.num_kv_heads, a.head_dim)

    def _extend(self, reqs, rows: list[int], starts: list[int], ids: list[list[int]],
                hidden_in: torch.Tensor) -> None:
        """DRAFT_EXTEND: run the head over ``ids[i]`` at positions ``starts[i]..`` of each request (ragged) and
        keep its output at each request's last token. ``hidden_in`` ``[sum(len(ids)), hidden]``."""
        table = self.engine.allocator.req_to_token_host
        lens = [len(x) for x in ids]
        ends = [s + n for s, n in zip(starts, lens)]
        parts = [np.concatenate([np.asarray(x, dtype=np.int64) for x in ids]),
                 np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)]),
                 np.concatenate([table[r, s:e] for r, s, e in zip(rows, starts, ends)]),
                 np.asarray(rows), np.asarray(ends), np.cumsum(lens) - 1]
        packed = torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(self.engine.device)
        n, bs = len(parts[0]), len(rows)
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=packed[:n], positions=packed[n:2 * n],
            out_cache_loc=packed[2 * n:3 * n], req_pool_indices=packed[3 * n:3 * n + bs],
            seq_lens=packed[3 * n + bs:3 * n + 2 * bs], seq_lens_cpu=ends, extend_lens_cpu=lens,
            logits_index=packed[3 * n + 2 * bs:], hidden_in=hidden_in)
        logits, hidden = self.runner.forward(batch)
        last = hidden[batch.logits_index]
        for i, req in enumerate(reqs):
            req.drafter_state = EagleState(kv_len=ends[i], logits=logits[i], hidden=last[i],
                                           carry=req.drafter_state.carry if req.drafter_state else None)

    def on_prefill(self, batch: ForwardBatch, step, hidden: torch.Tensor, roots: list[Optional[int]]) -> None:
        """Positions [s, e) of each chunk, plus the root when the prefill is complete: token p pairs with the
        target's hidden state of p - 1 (zeros before the first token)."""
        alloc = self.engine.allocator
        reqs, rows, starts, ids, hiddens = [], [], [], [], []
        offset = 0
        for req, n, root in zip(step.reqs, step.extend_lens, roots):
            s = req.kv_len - n  # the chunk's first position (its positions are committed already)
            chunk = hidden[offset: offset + n]
            offset += n
            state = req.drafter_state
            carry = state.carry if s > 0 and state is not None and state.carry is not None else None
            prev = carry if carry is not None else torch.zeros_like(chunk[0])
            done = root is not None
            seq = req.token_slice(s, s + n) + ([root] if done else [])
            h = torch.cat([prev[None], chunk[: len(seq) - 1]])
            if done:
                alloc.assign([req.row], [s + n], [s + n + 1])  # the root's slot in the head's pool
            req.drafter_state = EagleState(kv_len=s, carry=chunk[-1])
            reqs.append(req), rows.append(req.row), starts.append(s), ids.append(seq), hiddens.append(h)
        self._extend(reqs, rows, starts, ids, torch.cat(hiddens))

    def first_forward(self, ctx: SpecContext) -> tuple[torch.Tensor, torch.Tensor]:
        states = [r.drafter_state for r in ctx.reqs]
        return torch.stack([s.logits for s in states]), torch.stack([s.hidden for s in states])

    def step_forward(self, ctx: SpecContext, tokens: torch.Tensor, depth: int, col: int,
                     mask: Optional[torch.Tensor], parent_hidden: Optional[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.draft_batch(ctx, tokens, depth, col, mask)
        batch.hidden_in = parent_hidden.reshape(-1, parent_hidden.shape[-1])
        return self.runner.forward(batch)

    def on_accept(self, ctx: SpecContext, tree: DraftTree, accept_index: list[list[int]],
                  hidden: torch.Tensor, new_roots: list[int]) -> None:
        """Catch up on the accepted path: positions L+1 .. L+k+1 get the accepted tokens and the bonus, each
        paired with the target's hidden state of the node before it."""
        n = tree.num_nodes
        tokens = tree.tokens.tolist()  # NOTE: one small read; the worker has synchronised already
        ids, rows_idx = [], []
        for b, (path, root) in enumerate(zip(accept_index, new_roots)):
            ids.append([tokens[b][node] for node in path[1:]] + [root])
            rows_idx += [b * n + node for node in path]
        index = torch.tensor(rows_idx, dtype=torch.int64, device=hidden.device)
        self._extend(ctx.reqs, [r.row for r in ctx.reqs], [L + 1 for L in ctx.kv_lens], ids, hidden[index])
