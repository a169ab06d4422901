"""ForwardBatch: the one object passed from the scheduler to the model runner and everything below it."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Optional

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill: the new prompt tokens of each request (prefix already in KV skipped)
    DECODE = "decode"  # one token per request
    TARGET_VERIFY = "target_verify"  # the draft tokens of each request, tree mask, one target forward
    DRAFT_DECODE = "draft_decode"  # the drafter's own decode steps
    DRAFT_EXTEND = "draft_extend"  # v1: a head drafter catching up on the accepted tokens (ragged: accept lengths vary)
    # v2: the head drafter over every request's num_steps + 1 emitted tokens, padded (graph-static; its next inputs
    # are picked at arange(bs) * (num_steps + 1) + accept_len - 1)
    DRAFT_EXTEND_V2 = "draft_extend_v2"

    @property
    def uniform(self) -> bool:
        """True when every request contributes the same number of tokens (graph-capturable)."""
        return self not in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND)


@dataclass
class SamplingBatch:
    """Per-request sampling parameters as device tensors, plus host flags that pick the code path."""

    temperatures: torch.Tensor  # [bs] float32; 0 = greedy
    top_ps: torch.Tensor  # [bs] float32
    top_ks: torch.Tensor  # [bs] int64; 0 = off
    seeds: torch.Tensor  # [bs] int64
    steps: torch.Tensor  # [bs] int64: index of the token being sampled (keys the per-request random stream)
    all_greedy: bool = True
    need_top_k_top_p: bool = False


@dataclass
class ForwardBatch:
    """Everything one forward needs. Built by the scheduler; the runner pads it; the backend fills ``attn``.

    Device tensors have the padded batch size once the runner pads; host lists always describe real requests.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64: slots that receive this forward's K/V
    req_pool_indices: torch.Tensor  # [bs] int64: rows of req_to_token
    seq_lens: torch.Tensor  # [bs] int64: KV length after this forward
    seq_lens_cpu: list[int]  # [bs] host copy of seq_lens (known to the scheduler, never read back)
    extend_lens_cpu: list[int]  # [bs] tokens each request adds in this forward
    logits_index: torch.Tensor  # [num_logit_rows] int64: token rows whose logits the caller wants
    bs: int = 0
    padded_bs: int = 0
    seq_lens_sum: int = 0
    # [bs, q_len, mask_width] bool over each request's last mask_width keys (mask_width >= q_len; earlier keys are
    # all visible); None: causal among this forward's tokens. Tree masks for TARGET_VERIFY / DRAFT_* modes.
    custom_mask: Optional[torch.Tensor] = None
    hidden_in: Optional[torch.Tensor] = None  # [num_tokens, hidden]: per-token input states (EAGLE heads)
    # the slots of this forward's tokens are in the allocator's host mirror only: the forward writes out_cache_loc
    # into req_to_token at (req_pool_indices, positions) before attending (staged decode batches, one token each)
    write_slots: bool = False
    # EXTEND run from a CUDA graph (padded): the new tokens per request the graph is captured for, an upper bound of
    # extend_lens_cpu that attention metadata uses instead of their maximum; 0: not padded
    extend_width: int = 0
    sampling: Optional[SamplingBatch] = None
    spec: Any = None  # drafter / verifier state
    attn: Any = None  # attention-backend metadata, filled by AttentionBackend.init_metadata

    def __post_init__(self) -> None:
        if not self.bs:
            self.bs = len(self.seq_lens_cpu)
        if not self.padded_bs:
            self.padded_bs = self.bs
        if not self.seq_lens_sum:
            self.seq_lens_sum = sum(self.seq_lens_cpu)

    @property
    def q_len(self) -> int:
        """Tokens per request in a uniform mode (DECODE: 1, TARGET_VERIFY: num_draft_tokens)."""
        assert self.mode.uniform
        return self.extend_lens_cpu[0] if self.extend_lens_cpu else 1

    def replace(self, **changes: Any) -> "ForwardBatch":
        return dataclasses.replace(self, **changes)
