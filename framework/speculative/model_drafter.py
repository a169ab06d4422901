"""Chain and tree drafting shared by the drafters that run a model forward per draft step (layer_skip,
draft_model, eagle).

Chain (topk = 1): the root's forward gives the first draft token, each draft token's forward the next; greedy
rows take the argmax, sampled rows draw from the draft distribution q (kept for rejection sampling).

Tree (topk > 1): every step expands each kept path by its topk children, scores paths by cumulative log
probability and keeps the best topk as the next frontier; rows (and hidden states) are re-picked by parent, so
row order changes between steps. Step d's frontier is forwarded at scratch positions ``L + 1 + (d - 1) * topk``
onwards with a mask over the root, its ancestors and itself. At the end the best ``num_draft_tokens - 1``
candidates form the tree (parents before children).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch
from torch import nn

from framework.attention import build_backend
from framework.batch import ForwardBatch, ForwardMode
from framework.config import SpeculativeConfig
from framework.kv import KVPool
from framework.model_runner import ModelRunner
from framework.sampling import probs_from_logits, sample_from_probs
from framework.speculative.base import DraftTree, Drafter, SpecContext
from framework.speculative.tree import chain_tree, select_tree

SALT_DRAFT = 307  # + depth: draft-token draws


class ModelDrafter(Drafter):
    def __init__(self, engine, cfg: SpeculativeConfig) -> None:
        self.engine = engine
        self.cfg = cfg
        self.max_children = cfg.topk
        self.runner: ModelRunner = engine.runner  # drafters with a model of their own replace it (own_runner)
        self.layer_ids: Any = None  # layer_skip: the target's layers a draft forward runs
        # a chain's last draft token also gets a forward, for its K/V: v2 drafters with a pool of their own that
        # must hold every accepted token (v1 catches them up with an EXTEND instead)
        self.forward_last = False

    @classmethod
    def scratch_width(cls, cfg: SpeculativeConfig) -> int:
        """The root, then topk positions per later draft step."""
        return 1 + (cfg.num_steps - 1) * cfg.topk

    def own_runner(self, model: nn.Module, num_layers: int, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> None:
        """Run drafts on ``model`` with a KV pool of its own (``num_layers`` layers) that uses the target's slot
        indices, an attention backend of the configured kind over it, and the target's compile settings."""
        eng = self.engine
        if hasattr(model, "kv_pool"):  # a model with a pool layout of its own (an MTP layer's MLA pool)
            self.pool = model.kv_pool(eng.allocator.num_slots, eng.dtype, eng.device)
        else:
            self.pool = KVPool(num_layers, eng.allocator.num_slots, num_kv_heads, head_dim, eng.dtype, eng.device)
        backend = build_backend(eng.config.attention.name, self.pool, eng.allocator, SimpleNamespace(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            model_type=getattr(model.args, "model_type", "llama")))
        self.runner = ModelRunner(model, backend, eng.runner.compiled, eng.runner.batch_sizes, eng.device,
                                  eng.runner.skip_guards, eng.runner.pdl, regional=eng.runner.regional)

    def warmup(self) -> None:
        """Compile the draft-step shapes ahead of serving: one token per request, and topk for trees."""
        for q_len in sorted({1, self.cfg.topk}):
            self.runner.warmup(ForwardMode.DRAFT_DECODE, q_len, self.layer_ids)

    # ---- hooks for subclasses ---------------------------------------------------------------------------
    def first_forward(self, ctx: SpecContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The root's forward (plus any catch-up): logits ``[bs, vocab]`` and hidden ``[bs, hidden]``."""
        return self.step_forward(ctx, ctx.roots[:, None], 0, 0, None, None)

    def step_forward(self, ctx: SpecContext, tokens: torch.Tensor, depth: int, col: int,
                     mask: Optional[torch.Tensor], parent_hidden: Optional[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward ``tokens`` ``[bs, q]`` at position ``L + depth``, written at row positions ``L + col ..
        L + col + q - 1``, attending the prefix plus (``mask`` ``[bs, q, col + q]``, None = causal) the
        speculative region. ``parent_hidden`` ``[bs, q, hidden]``: the drafter's hidden state of each token's
        parent. Returns logits ``[bs * q, vocab]`` and hidden ``[bs * q, hidden]``."""
        raise NotImplementedError

    # ---- shared helpers -----------------------------------------------------------------------------------
    def draft_batch(self, ctx: SpecContext, tokens: torch.Tensor, depth: int, col: int,
                    mask: Optional[torch.Tensor]) -> ForwardBatch:
        """A DRAFT_DECODE ForwardBatch for :meth:`step_forward`'s arguments."""
        bs, q = tokens.shape
        end = col + q
        return ForwardBatch(
            mode=ForwardMode.DRAFT_DECODE, input_ids=tokens.reshape(-1),
            positions=(ctx.kv_lens_t + depth)[:, None].expand(bs, q).reshape(-1),
            out_cache_loc=ctx.slots[:, col:end].reshape(-1), req_pool_indices=ctx.rows_t,
            seq_lens=ctx.kv_lens_t + end, seq_lens_cpu=[L + end for L in ctx.kv_lens], extend_lens_cpu=[q] * bs,
            logits_index=torch.arange(bs * q, device=tokens.device), custom_mask=mask)

    def propose(self, ctx: SpecContext) -> DraftTree:
        return self._chain(ctx) if self.cfg.topk == 1 else self._tree(ctx)

    def _pick(self, logits: torch.Tensor, ctx: SpecContext, depth: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Draft token per row (argmax for greedy rows, a draw from q for sampled rows) and q (or None)."""
        greedy = logits.argmax(-1)
        s = ctx.sampling
        if s.all_greedy:
            return greedy, None
        q = probs_from_logits(logits, s.temperatures, s.top_ks, s.top_ps, s.need_top_k_top_p)
        drawn = sample_from_probs(q, s.seeds, s.steps, salt=SALT_DRAFT + depth)
        return torch.where(s.temperatures > 0, drawn, greedy), q

    def _chain(self, ctx: SpecContext) -> DraftTree:
        steps = self.cfg.num_steps
        logits, hidden = self.first_forward(ctx)
        tokens, qs = [ctx.roots], []
        for depth in range(1, steps + 1):
            token, q = self._pick(logits, ctx, depth)
            tokens.append(token)
            qs.append(q)
            if depth < steps or self.forward_last:
                logits, hidden = self.step_forward(ctx, token[:, None], depth, depth, None, hidden[:, None])
        tokens_t = torch.stack(tokens, dim=1)  # [bs, steps + 1]
        draft_probs = None
        if qs[0] is not None:  # node i's children were drawn from q_{i+1}; the leaf has none
            draft_probs = torch.stack(qs + [torch.zeros_like(qs[0])], dim=1)
        return chain_tree(tokens_t, torch.ones_like(tokens_t, dtype=torch.bool), draft_probs)

    def _tree(self, ctx: SpecContext) -> DraftTree:
        k, steps = self.cfg.topk, self.cfg.num_steps
        bs, dev = len(ctx.reqs), ctx.roots.device
        logits, hidden = self.first_forward(ctx)
        top = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)  # children of the root
        cand_tokens, cand_scores = [top.indices], [top.values]
        cand_parents = [torch.full((bs, k), -1, dtype=torch.int64, device=dev)]
        cand_depths = [torch.ones(bs, k, dtype=torch.int64, device=dev)]
        frontier_ids = torch.arange(k, device=dev).expand(bs, k)
        frontier_tokens, frontier_scores = top.indices, top.values
        frontier_anc = torch.ones(bs, k, 1, dtype=torch.bool, device=dev)  # every frontier node sees the root
        frontier_hidden = hidden[:, None].expand(bs, k, hidden.shape[-1])
        eye = torch.eye(k, dtype=torch.bool, device=dev).expand(bs, k, k)
        num_cands = k
        for depth in range(1, steps):
            mask = torch.cat([frontier_anc, eye], dim=2)  # [bs, k, 1 + depth * k]
            col = 1 + (depth - 1) * k
            logits, hidden = self.step_forward(ctx, frontier_tokens, depth, col, mask, frontier_hidden)
            top = torch.log_softmax(logits.float(), -1).view(bs, k, -1).topk(k, dim=-1)
            scores = (frontier_scores[:, :, None] + top.values).reshape(bs, k * k)
            ids = num_cands + torch.arange(k * k, device=dev).expand(bs, k * k)
            cand_tokens.append(top.indices.reshape(bs, k * k))
            cand_scores.append(scores)
            cand_parents.append(frontier_ids.repeat_interleave(k, dim=1))
            cand_depths.append(torch.full((bs, k * k), depth + 1, dtype=torch.int64, device=dev))
            num_cands += k * k
            best = scores.topk(k, dim=-1).indices  # [bs, k] among the k * k expansions
            parent = best // k  # frontier row each survivor came from
            frontier_ids = torch.gather(ids, 1, best)
            frontier_tokens = torch.gather(cand_tokens[-1], 1, best)
            frontier_scores = torch.gather(scores, 1, best)
            frontier_anc = torch.gather(mask, 1, parent[:, :, None].expand(bs, k, mask.shape[-1]))
            frontier_hidden = torch.gather(hidden.view(bs, k, -1), 1,
                                           parent[:, :, None].expand(bs, k, hidden.shape[-1]))
        return select_tree(ctx.roots, torch.cat(cand_tokens, 1), torch.cat(cand_parents, 1),
                           torch.cat(cand_scores, 1), torch.cat(cand_depths, 1), self.cfg.num_draft_tokens)
