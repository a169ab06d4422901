"""Drafter interface and the DraftTree it proposes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from framework.batch import ForwardBatch
    from framework.config import SpeculativeConfig
    from framework.request import Request
    from framework.scheduler import ScheduledStep


@dataclass
class DraftTree:
    """A draft tree per request, ``n`` = num_draft_tokens nodes, node 0 the root (the last emitted token).

    Parents come before children. Chains are trees with ``parents[i] = i - 1``.
    """

    tokens: torch.Tensor  # [bs, n] int64
    parents: torch.Tensor  # [bs, n] int64, -1 for the root
    depths: torch.Tensor  # [bs, n] int64, 0 for the root
    valid: torch.Tensor  # [bs, n] bool: padding nodes are False and never accepted
    # [bs, n, vocab]: the distribution node i's children were *sampled* from (q for rejection sampling);
    # None when children were chosen deterministically (top-k, n-gram lookup): verification then uses q = one-hot
    draft_probs: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None  # [bs, n, n] bool ancestor mask, once known (tree.tree_mask)

    @property
    def bs(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


@dataclass
class SpecContext:
    """What a drafter gets for one iteration: the requests, their committed lengths and the iteration's slots."""

    reqs: list["Request"]
    kv_lens: list[int]  # [bs] committed target KV length L; the root token sits at position L
    slots: torch.Tensor  # [bs, width] slots of row positions L .. L + width - 1 (device)
    roots: torch.Tensor  # [bs] int64 root tokens (device)
    kv_lens_t: torch.Tensor  # [bs] int64 L on the device
    rows_t: torch.Tensor  # [bs] int64 req_to_token rows on the device
    sampling: Any  # SamplingBatch for the requests
    max_depth: Optional[int] = None  # speculative.adaptive: draft at most this deep (None: num_steps)
    width: Optional[int] = None  # speculative.adaptive, drafters with adaptive_widths: the batch's verify width


class Drafter:
    """Proposes draft trees; keeps whatever state it needs across iterations."""

    name = "base"
    max_children = 1  # siblings per node in the proposed trees (topk for tree drafters)
    drafts_on_device = False  # True: propose_device drafts chains from the device token history (speculation v2)
    # True: propose() of a chain works from a SpecContext of device tensors alone and its forwards take
    # ``new_step=False`` through ``forward_kwargs`` (speculation v2 runs it inside its CUDA-graph step)
    drafts_in_v2 = False
    v2_by_default = False  # speculative.version=auto takes v2 (its v2 iteration has run on a GPU too)
    v2 = False  # set by use_v2
    forward_kwargs: dict = {}
    own_kv = False  # True: a KV pool of its own (draft_model, eagle, mtp), whose valid length kv_valid_len gives

    @classmethod
    def scratch_width(cls, cfg: "SpeculativeConfig") -> int:
        """KV row positions (from L on) the drafter's own forwards write while drafting: none without a model."""
        return 0

    @classmethod
    def pool_scratch_rows(cls, cfg: "SpeculativeConfig") -> int:
        """Rows per layer past the allocator's slots that the drafter needs in the target's K/V pool (none)."""
        return 0

    @classmethod
    def verify_widths(cls, cfg: "SpeculativeConfig") -> list[int]:
        """The TARGET_VERIFY widths (tree nodes per request) the drafter's trees take: compiled ahead of serving."""
        return [cfg.num_draft_tokens]

    def on_prefill(self, batch: "ForwardBatch", step: "ScheduledStep", hidden: torch.Tensor,
                   roots: list[Optional[int]]) -> None:
        """After a target EXTEND forward (``hidden`` [num_tokens, hidden]), its positions already committed
        (``req.kv_len`` includes the chunk); ``roots[i]`` is request i's next decode input when this chunk completes
        its prefill, else None."""

    def kv_valid_len(self, req: "Request") -> int:
        """Positions of ``req`` whose K/V (and per-page state) the drafter's own pool holds, from 0 (drafters with
        ``own_kv``). The prefix cache shares only pages below it: a request that takes a cached prefix finds the
        drafter's K/V of it there too, and the drafter prefills only the rest, as the target does."""
        raise NotImplementedError

    def use_v2(self) -> None:
        """Called by the v2 worker that drives this drafter: its forwards belong to the iteration's CUDA-graph
        step (``new_step=False``)."""
        self.v2 = True
        self.forward_kwargs = {"new_step": False}

    extends_after_verify = False  # v2: extend_v2 runs after every verification (head drafters)

    def on_prefill_launch(self, step: "ScheduledStep", batch: "ForwardBatch", hidden: torch.Tensor,
                          sampled: torch.Tensor) -> None:
        """v2: a target EXTEND forward was just queued; a drafter with a KV pool of its own queues the same chunk
        into it here, so that every later iteration finds it there (nothing waits for the host). ``hidden`` the
        target's states over the chunk, ``sampled`` ``[len(step.reqs)]`` the tokens the step samples (device)."""

    def extend_v2(self, rows: torch.Tensor, committed: torch.Tensor, accept_tokens: torch.Tensor,
                  accept_lens: torch.Tensor, hidden: torch.Tensor, bounds: list[int]) -> None:
        """v2, drafters with ``extends_after_verify``: DRAFT_EXTEND_V2 over each request's emitted tokens."""
        raise NotImplementedError

    def warmup(self) -> None:
        """Compile the drafter's own graphs ahead of serving (model drafters)."""

    def on_finished(self, reqs: list["Request"]) -> None:
        """v2: the host has applied the last iteration of ``reqs`` (finished); their tokens are final."""

    def adaptive_widths(self) -> Optional[list[int]]:
        """speculative.adaptive: the verify widths (root included) among which the controller picks by the drafter's
        own estimate of its acceptance (:meth:`expected_tokens`); None: it picks a depth from measured acceptance."""
        return None

    def expected_tokens(self, ctx: SpecContext) -> list[float]:
        """With :meth:`adaptive_widths`: tokens a request of ``ctx.reqs`` emits per iteration at level k = 0 (a plain
        step) .. len(widths) (the width ``widths[k - 1]``), called before :meth:`propose` in the same iteration."""
        raise NotImplementedError

    def propose(self, ctx: SpecContext) -> "DraftTree | None":
        """The draft tree for ``ctx.reqs``, or None when nothing could be drafted for any of them."""
        raise NotImplementedError

    def propose_device(self, history: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chain drafts ``[bs, num_steps]`` and their validity, from each request's tokens ``history`` ``[bs,
        width]`` (``lens`` ``[bs]`` known), as tensor operations that a CUDA graph can hold (v2)."""
        raise NotImplementedError

    def on_accept(self, ctx: SpecContext, tree: DraftTree, accept_index: list[list[int]],
                  hidden: torch.Tensor, new_roots: list[int]) -> None:
        """After verification: ``accept_index[b]`` = accepted path nodes (root first), ``hidden`` the target's
        ``[bs * n, hidden]`` states over the tree, ``new_roots[b]`` the bonus token (the next root)."""
