"""``speculative=draft_model``: a separate small model drafts. It has its own KV pool but uses the target's
allocator, so a token's draft K/V sit at the same slot index as its target K/V.

Per request the drafter remembers how many positions of its own pool are valid (``drafter_state``). Each
iteration first catches up on the tokens accepted since (a ragged forward ending at the root), then drafts. After
a chain verify its K/V stay valid along the accepted path; after a tree verify only the root's do (the tree's
layout differs from the drafting scratch), and the next catch-up re-extends the accepted tokens.

Prefix cache: the tree takes a request's pages only below its valid draft length (:meth:`kv_valid_len`), so the
draft pool holds every cached page's K/V too; a request that takes a cached prefix prefills only the rest, in both
pools (its prefill chunks run in the draft model as they run in the target)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from framework.batch import ForwardBatch, ForwardMode
from framework.config import ConfigError, ModelConfig, SpeculativeConfig
from framework.config.load import model_option
from framework.models.checks import WeightsError
from framework.models.llama import LlamaForCausalLM
from framework.models.loader import gguf_args, hf_args, load_model, model_file
from framework.speculative import DRAFTERS
from framework.speculative.base import DraftTree, SpecContext
from framework.speculative.model_drafter import ModelDrafter
from framework.tokenizer import tokenizer_path


def draft_vocab_size(mcfg: ModelConfig) -> int:
    """The vocabulary size of the model ``mcfg`` describes, read from its config or its file's header only."""
    if mcfg.source in ("gguf", "gguf_package"):
        return gguf_args(model_file(mcfg)).vocab_size
    if mcfg.source == "hf":
        return hf_args(model_file(mcfg)).vocab_size
    return mcfg.arch.vocab_size


@DRAFTERS.register("draft_model")
class DraftModelDrafter(ModelDrafter):
    name = "draft_model"
    own_kv = True
    drafts_in_v2 = True  # v2: prefill chunks at launch, then num_steps + 1 uniform steps (the last for its K/V)

    def __init__(self, engine, cfg: SpeculativeConfig) -> None:
        super().__init__(engine, cfg)
        mcfg = model_option(cfg.draft_model)
        try:
            self.model = self._load(mcfg, engine, cfg.draft_model)
        except WeightsError as err:  # the draft's own model.path: say which option it came from
            raise WeightsError(f"speculative.draft_model={cfg.draft_model!r}: {err}") from None
        self.model.init_rope(engine.max_context + engine.spec_width)  # its window may be shorter than the target's
        self.model.fused_decode = engine.model.fused_decode  # model.fused_decode applies to both models
        a = self.model.args
        self.own_runner(self.model, a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim)

    @staticmethod
    def _load(mcfg: ModelConfig, engine, name: str) -> LlamaForCausalLM:
        # NOTE: random weights carry no tokenizer of their own (they pair with any of the vocabulary's size)
        if mcfg.source != "random" and tokenizer_path(mcfg) != tokenizer_path(engine.config.model):
            raise ConfigError(f"speculative.draft_model={name!r} is not allowed; its tokenizer differs "
                              f"from the target's ({tokenizer_path(mcfg)} vs {tokenizer_path(engine.config.model)})")
        # NOTE: checked before loading: a mismatched draft can be far larger than the target (an 8B-shaped one)
        vocab_size = draft_vocab_size(mcfg)
        if vocab_size != engine.model.args.vocab_size:
            raise ConfigError(f"speculative.draft_model={name!r} is not allowed; vocabulary "
                              f"{vocab_size} != the target's {engine.model.args.vocab_size}")
        return load_model(mcfg, engine.dtype, engine.device)

    def on_prefill(self, batch: ForwardBatch, step, hidden: torch.Tensor, roots: list[Optional[int]]) -> None:
        self.runner.forward(batch)  # the same prompt chunk into the draft pool, at the same slots
        for req in step.reqs:
            req.drafter_state = req.kv_len  # (the chunk's positions are committed already)

    def on_prefill_launch(self, step, batch: ForwardBatch, hidden: torch.Tensor, sampled: torch.Tensor) -> None:
        self.runner.forward(batch)  # (v2) the same prompt chunk into the draft pool, at the same slots

    def use_v2(self) -> None:
        super().use_v2()
        self.forward_last = True

    def kv_valid_len(self, req) -> int:
        """v2 writes every committed token's K/V (forward_last); v1 catches up at the next iteration."""
        return req.kv_len if self.v2 else (req.drafter_state or 0)

    def first_forward(self, ctx: SpecContext) -> tuple[torch.Tensor, torch.Tensor]:
        if self.v2:  # every accepted token's K/V is in the pool (forward_last): only the root is new
            return self.step_forward(ctx, ctx.roots[:, None], 0, 0, None, None)
        starts = [r.drafter_state for r in ctx.reqs]
        if all(s == L for s, L in zip(starts, ctx.kv_lens)):  # only the root is new: a uniform decode step
            return self.step_forward(ctx, ctx.roots[:, None], 0, 0, None, None)
        table = self.engine.allocator.req_to_token_host
        ids, positions, slots, lens = [], [], [], []
        for req, start, L in zip(ctx.reqs, starts, ctx.kv_lens):
            ids.append(req.token_slice(start, L + 1))
            positions.append(np.arange(start, L + 1))
            slots.append(table[req.row, start: L + 1])
            lens.append(L + 1 - start)
        parts = [np.concatenate(ids), np.concatenate(positions), np.concatenate(slots), np.cumsum(lens) - 1]
        packed = torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(ctx.roots.device)
        n = len(parts[0])
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=packed[:n], positions=packed[n:2 * n],
            out_cache_loc=packed[2 * n:3 * n], req_pool_indices=ctx.rows_t, seq_lens=ctx.kv_lens_t + 1,
            seq_lens_cpu=[L + 1 for L in ctx.kv_lens], extend_lens_cpu=lens, logits_index=packed[3 * n:])
        logits, hidden = self.runner.forward(batch)
        return logits, hidden[batch.logits_index]

    def step_forward(self, ctx: SpecContext, tokens: torch.Tensor, depth: int, col: int,
                     mask: Optional[torch.Tensor], parent_hidden: Optional[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.runner.forward(self.draft_batch(ctx, tokens, depth, col, mask), **self.forward_kwargs)

    def on_accept(self, ctx: SpecContext, tree: DraftTree, accept_index: list[list[int]],
                  hidden: torch.Tensor, new_roots: list[int]) -> None:
        for req, L, path in zip(ctx.reqs, ctx.kv_lens, accept_index):
            valid = min(len(path) - 1, self.cfg.num_steps - 1) if self.cfg.topk == 1 else 0
            req.drafter_state = L + valid + 1
