"""The DeepSeek-V3.2 family in plain torch (``deepseek_v32``; ``glm_moe_dsa`` where it differs): MLA with the DSA
indexer (framework/models/mla.py), dense SwiGLU layers then DeepSeek MoE layers (framework/models/moe.py), and the
MTP ("next-n") layer that ``speculative=mtp`` drafts with. Tokens are flat (``[num_tokens]``) as in the Llama model;
the attention backend reads ``meta`` for the batch layout and owns the latent and index-key caches
(:class:`framework.kv.MLAPool`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import nn

from framework.kv import MLAPool
from framework.models.llama import RMSNorm
from framework.models.mla import IndexReuse, MLAttention
from framework.models.moe import MoE, SwiGLU
from framework.models.regions import run_split_layers
from tfs_kernels.rope_store import Rope, rope_at


@dataclass
class DsaArgs:
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    intermediate_size: int
    moe_intermediate_size: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1
    rope_theta: float = 10000.0
    rope_inv_freq: list = field(default_factory=list)  # empty: plain RoPE over rope_theta (else e.g. YaRN's)
    rope_attention_factor: float = 1.0  # YaRN: cos / sin scaled by it
    softmax_scale: float = 0.0  # 0: qk_head_dim ** -0.5 (YaRN checkpoints give their mscale-corrected value)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    indexer_types: list = field(default_factory=list)  # per layer "full" | "shared" (GLM-MoE-DSA); empty: all full
    indexer_interleaved_rope: bool = False  # GLM-MoE-DSA's indexer ropes interleaved pairs
    index_share_for_mtp_iteration: bool = False  # the checkpoint allows reusing the first MTP step's top-k
    model_type: str = "deepseek_v32"

    def __post_init__(self) -> None:
        if not self.softmax_scale:
            self.softmax_scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if not self.indexer_types:
            self.indexer_types = ["full"] * self.num_layers
        # what the generic parts of the engine read: MLA attends one latent "head" per token
        self.num_kv_heads = 1
        self.head_dim = self.kv_lora_rank + self.qk_rope_head_dim


def rope_tables(args: DsaArgs, num_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos / sin ``[num_positions, qk_rope_head_dim // 2]`` (scaled by the rope attention factor)."""
    dim = args.qk_rope_head_dim
    if args.rope_inv_freq:
        inv_freq = torch.tensor(args.rope_inv_freq, dtype=torch.float32)
    else:
        inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq).to(device)
    return freqs.cos() * args.rope_attention_factor, freqs.sin() * args.rope_attention_factor


def mla_attention(args: DsaArgs, layer_id: int, has_indexer: bool = True) -> MLAttention:
    return MLAttention(args.hidden_size, args.num_heads, args.q_lora_rank, args.kv_lora_rank, args.qk_nope_head_dim,
                       args.qk_rope_head_dim, args.v_head_dim, args.softmax_scale, args.index_n_heads,
                       args.index_head_dim, args.index_topk, layer_id, has_indexer, args.indexer_interleaved_rope,
                       args.rms_norm_eps)


class DsaDecoderLayer(nn.Module):
    def __init__(self, args: DsaArgs, layer_id: int, dense: bool, has_indexer: bool = True) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = mla_attention(args, layer_id, has_indexer)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = SwiGLU(args.hidden_size, args.intermediate_size) if dense else MoE(
            args.hidden_size, args.moe_intermediate_size, args.n_routed_experts, args.num_experts_per_tok,
            args.n_group, args.topk_group, args.n_shared_experts, args.norm_topk_prob, args.routed_scaling_factor)

    def forward(self, x: torch.Tensor, rope: Rope, meta: Any, prev_topk: Optional[torch.Tensor] = None,
                reuse: Optional[IndexReuse] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        out, topk = self.self_attn(self.input_layernorm(x), rope, meta, prev_topk, reuse)
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x)), topk

    def pre_attention(self, x: torch.Tensor, delta: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream with the last layer's ``delta`` added, its input norm) ``[n, hidden]`` each: the
        part before attention (framework/models/regions.py)."""
        if delta is not None:
            x = x + delta
        return x, self.input_layernorm(x)

    def post_attention(self, x: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream with attention's output ``attn`` added, what the MLP adds to it) ``[n, hidden]``
        each: the part after attention."""
        x = x + attn
        return x, self.mlp(self.post_attention_layernorm(x))


class DsaForCausalLM(nn.Module):
    """``forward(input_ids [n], positions [n], meta, logits_index [m], layer_ids) -> (logits [m, vocab] float32,
    final-norm hidden [n, hidden])``, as :class:`framework.models.llama.LlamaForCausalLM`."""

    def __init__(self, args: DsaArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            DsaDecoderLayer(args, i, i < args.first_k_dense_replace, args.indexer_types[i] == "full")
            for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.fused_decode = False  # (the Llama model's tfs::gemv decode path has no MLA counterpart)
        self.regional = False  # compile.regional: the layers' parts around attention as nested compile regions
        self.pdl = False
        half = args.qk_rope_head_dim // 2
        self.register_buffer("rope_cos", torch.empty(args.max_position_embeddings, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_position_embeddings, half), persistent=False)
        if self.rope_cos.device.type != "meta":
            self.init_rope()

    def init_rope(self, num_positions: int = 0) -> None:
        """Fill the rope tables for at least ``max_position_embeddings`` positions (or ``num_positions``)."""
        num_positions = max(num_positions, self.args.max_position_embeddings, self.rope_cos.shape[0])
        self.rope_cos, self.rope_sin = rope_tables(self.args, num_positions, self.rope_cos.device)

    def kv_pool(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> MLAPool:
        a = self.args
        return MLAPool(a.num_layers, num_slots, a.head_dim, a.index_head_dim, dtype, device)

    def set_attention_backend(self, backend: Any) -> None:
        for layer in self.layers:
            layer.self_attn.backend = backend
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.backend = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, logits_index: torch.Tensor,
                layer_ids: Optional[Sequence[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed_tokens(input_ids)  # [n, hidden]
        rope = rope_at(self.rope_cos, self.rope_sin, positions)
        topk: list[Optional[torch.Tensor]] = [None]  # the last indexer's top-k, for layers that reuse it

        def attend(layer: DsaDecoderLayer, h: torch.Tensor) -> torch.Tensor:
            out, topk[0] = layer.self_attn(h, rope, meta, topk[0], None)  # [n, hidden]
            return out

        layers = self.layers if layer_ids is None else [self.layers[i] for i in layer_ids]
        x = run_split_layers(layers, x, attend, self.regional)
        hidden = self.norm(x)  # [n, hidden]
        return self.lm_head(hidden[logits_index]).float(), hidden


class MtpLayer(nn.Module):
    """DeepSeek-V3's multi-token-prediction layer: at position p, ``eh_proj([enorm(embed(x_p)) | hnorm(h_{p-1})])``
    through one decoder layer (its own MLA, indexer and KV cache) and ``shared_head.norm``; logits by
    ``shared_head.head``. ``h_{p-1}``: the target's final hidden state of p - 1, or this layer's own while drafting.
    ``forward(input_ids [n], positions [n], meta, logits_index [m], hidden_in [n, hidden])``."""

    takes_hidden_in = True

    def __init__(self, target: DsaForCausalLM) -> None:
        super().__init__()
        a = target.args
        self.args = a
        self.enorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.hnorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * a.hidden_size, a.hidden_size, bias=False)
        self.layer = DsaDecoderLayer(a, layer_id=0, dense=a.first_k_dense_replace > a.num_layers)
        self.shared_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.target = [target]  # embedding, LM head (unless the checkpoint has its own) and rope tables: shared
        self.head: Optional[nn.Linear] = None  # shared_head.head where the checkpoint stores it
        self.reuse: Optional[IndexReuse] = None  # set by the MTP drafter

    @property
    def dtype(self) -> torch.dtype:
        return self.eh_proj.weight.dtype

    def kv_pool(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> MLAPool:
        return MLAPool(1, num_slots, self.args.head_dim, self.args.index_head_dim, dtype, device)

    def set_attention_backend(self, backend: Any) -> None:
        self.layer.self_attn.backend = self.layer.self_attn.indexer.backend = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, logits_index: torch.Tensor,
                hidden_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        target = self.target[0]
        x = torch.cat([self.enorm(target.embed_tokens(input_ids)), self.hnorm(hidden_in.to(self.dtype))], dim=-1)
        x, _ = self.layer(self.eh_proj(x), rope_at(target.rope_cos, target.rope_sin, positions), meta, None,
                          self.reuse)
        hidden = self.shared_norm(x)  # [n, hidden]
        head = self.head if self.head is not None else target.lm_head
        return head(hidden[logits_index]).float(), hidden
