"""``speculative=mtp``: draft with the model's own multi-token-prediction layer (DeepSeek-V3 / V3.2, GLM-5): the
EAGLE-style loop of :mod:`framework.speculative.eagle` (catch-up extend after prefill and verification, chain or
tree draft steps, v1 and v2) with the checkpoint's MTP layer as the head (:class:`MtpLayer`: its own MLA, DSA
indexer and KV pool). A model whose checkpoint has no MTP tensors (the random test models) gets a seeded random
layer: lossless, with a low acceptance.

Top-k index reuse (the seeds' contract): where the model declares ``index_share_for_mtp_iteration`` (GLM-5's
config.json does; ``model.index_share_for_mtp_iteration`` overrides it) and ``topk == 1``, the first draft step's
indexer top-k is stored on the iteration's speculative state (:class:`IndexReuse`, a fixed device buffer, so a
CUDA-graph step can read what the one before wrote) and the later steps of the same draft forward attend that
selection instead of running the indexer. The state is cleared after every draft forward, also when a step raises.
With ``topk > 1`` reuse stays off (tree selection re-picks the hidden rows, so carried indices would no longer match
the rows) and one log line says so. v1 and v2 share this code: both draft through :meth:`propose`.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from framework.config import ConfigError, SpeculativeConfig
from framework.models.deepseek_v32 import DsaForCausalLM, MtpLayer
from framework.models.dsa_loader import _fill, keep_fp32, random_weights
from framework.models.mla import IndexReuse
from framework.speculative import DRAFTERS
from framework.speculative.base import DraftTree, SpecContext
from framework.speculative.eagle import EagleDrafter
from framework.speculative.model_drafter import ModelDrafter

log = logging.getLogger(__name__)


def build_mtp(target: DsaForCausalLM, seed: int) -> MtpLayer:
    """The target's MTP layer from its checkpoint's tensors, or seeded random weights where it has none."""
    device, dtype = target.embed_tokens.weight.device, target.embed_tokens.weight.dtype
    head = MtpLayer(target)
    tensors = getattr(target, "mtp_tensors", None)
    if tensors is not None and "head.weight" in tensors:
        head.head = torch.nn.Linear(target.args.hidden_size, target.args.vocab_size, bias=False)
    head = head.to(device=device, dtype=dtype)
    keep_fp32(head)
    if tensors is not None:
        _fill(head, tensors, "the checkpoint's MTP layer")
    else:
        log.info("speculative=mtp: the checkpoint has no MTP layer; drafting with a seeded random one (seed=%d)",
                 seed)
        random_weights(head, seed, 1.0, 8.0)
    return head.eval().requires_grad_(False)


@DRAFTERS.register("mtp")
class MtpDrafter(EagleDrafter):
    name = "mtp"

    def __init__(self, engine, cfg: SpeculativeConfig) -> None:
        ModelDrafter.__init__(self, engine, cfg)
        target = engine.model
        if not isinstance(target, DsaForCausalLM):
            raise ConfigError(f"speculative=mtp is not allowed for model={engine.config.model.name!r}: it has no MTP "
                              f"layer (the DeepSeek-V3.2 family has one, e.g. model=dsa_tiny)")
        a = target.args
        self.head = build_mtp(target, cfg.seed)
        self.own_runner(self.head, 1, a.num_heads, 1, a.head_dim)
        self.init_page_carry()
        self.reuse_topk = a.index_share_for_mtp_iteration and cfg.topk == 1
        if a.index_share_for_mtp_iteration and cfg.topk > 1:
            log.info("speculative=mtp: indexer top-k reuse is off for topk=%d (tree selection reorders the hidden "
                     "rows, so carried indices would no longer match)", cfg.topk)
        rows = max(engine.runner.batch_sizes) + 1
        buffer = torch.full((rows, a.index_topk), -1, dtype=torch.int64, device=engine.device)
        if engine.device.type == "cuda":
            torch._dynamo.mark_static_address(buffer)
        self.head.reuse = IndexReuse(buffer)
        self.draft_indexer_calls = 0  # indexer top-k computations in draft (DRAFT_DECODE) forwards

    def propose(self, ctx: SpecContext) -> Optional[DraftTree]:
        try:
            return super().propose(ctx)
        finally:  # the stored selection belongs to this draft forward only
            self.head.reuse.mode = None
            self.head.reuse.stored = False

    def step_forward(self, ctx: SpecContext, tokens: torch.Tensor, depth: int, col: int,
                     mask: Optional[torch.Tensor], parent_hidden: Optional[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        reuse = self.head.reuse
        if self.reuse_topk:
            reuse.mode = "reuse" if reuse.stored else "store"
        if reuse.mode != "reuse":
            self.draft_indexer_calls += 1
        try:
            out = super().step_forward(ctx, tokens, depth, col, mask, parent_hidden)
        finally:
            stored = reuse.mode in ("store", "reuse")
            reuse.mode = None  # the catch-up extends run the indexer
        reuse.stored = stored
        return out
