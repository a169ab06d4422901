"""DeepSeek-V3's mixture of experts in plain torch: a sigmoid router with a score-correction bias and group-limited
top-k (the best ``topk_group`` of ``n_group`` expert groups, groups scored by their two best experts), routed
experts as stacked ``[E, ...]`` weights, and shared experts that every token goes through."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate | up fused in one weight ``[2 * inter, hidden]``."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MoE(nn.Module):
    """``forward(x [n, hidden]) -> [n, hidden]``. The router runs in float32 (its weight and bias are float32, as
    transformers keeps them)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 n_shared: int, norm_topk_prob: bool, routed_scaling_factor: float) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.scaling = norm_topk_prob, routed_scaling_factor
        self.gate_weight = nn.Parameter(torch.empty(num_experts, hidden))  # [E, hidden] float32
        self.gate_bias = nn.Parameter(torch.empty(num_experts))  # [E] e_score_correction_bias, float32
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))  # [E, 2 * inter, hidden]
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden, inter))  # [E, hidden, inter]
        self.shared_experts = SwiGLU(hidden, inter * n_shared)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids ``[n, top_k]`` and their weights ``[n, top_k]`` (float32)."""
        scores = F.linear(x.float(), self.gate_weight.float()).sigmoid()  # [n, E]
        choice = scores + self.gate_bias.float()
        n = x.shape[0]
        per_group = self.num_experts // self.n_group
        group_scores = choice.view(n, self.n_group, per_group).topk(2, dim=-1)[0].sum(-1)  # [n, n_group]
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask[:, :, None].expand(n, self.n_group, per_group).reshape(n, self.num_experts)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]  # [n, top_k]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        # every expert's weights over every token, weighted by its routing weight (0 where not routed): static
        # shapes, no host sync, fine for the small expert counts of the test and timing models
        # NOTE: a grouped GEMM over the routed tokens is what large expert counts need
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=torch.float32, device=x.device)
        dense.scatter_(1, ids, weights)  # [n, E]
        gate, up = torch.einsum("nh,eih->nei", x, self.experts_gate_up).chunk(2, dim=-1)  # [n, E, inter] each
        out = torch.einsum("nei,ehi->neh", F.silu(gate) * up, self.experts_down)  # [n, E, hidden]
        routed = (out.float() * dense[:, :, None]).sum(1)
        return routed.to(x.dtype) + self.shared_experts(x)
