"""A Llama-family decoder in plain torch (SmolLM2, Llama 3, Qwen2-style without biases): RMSNorm, RoPE with
Llama-3 scaling, GQA, SwiGLU, tied or untied embeddings. Tokens are flat (``[num_tokens]``), ragged across
requests; attention goes through the configured backend, which reads ``meta`` for the batch layout.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from framework.kv.pool import KVPool
from framework.models.regions import run_layers
from framework.parallel.comm import all_reduce, embed_vocab, gather_vocab
from tfs_kernels.det_matmul import det_matmul
from tfs_kernels.det_rmsnorm import det_rmsnorm
from tfs_kernels.gemv import MAX_ROWS as GEMV_MAX_ROWS
from tfs_kernels.gemv import gemv
from tfs_kernels.lm_head import lm_head
from tfs_kernels.rope_store import Rope, apply_rope, rope_at


# the fused decode path's tail as one kernel (tfs::lm_head) instead of inductor's norm, tfs::gemv and inductor's
# float32 conversion; a constant so that bench/knobs.py --set can turn it off to compare in one commit
FUSED_LM_HEAD = True
# The fused decode path (tfs::gemv and friends) for forwards of at most this many token rows: one row streams the
# weights near the HBM floor, but the several-row tile is untuned and slow (Llama-3-8B shape, H200, bench/e2e.py:
# a batch-8 decode forward 19.0 ms on it against 4.0 ms at batch 1 and 6.2 ms at batch 64 on cuBLAS), so more rows
# go to cuBLAS and inductor's kernels
FUSED_MAX_ROWS = 1
# Compiled uniform forwards of 2 to this many token rows on CUDA (a small batch's decode, a batch-1 verify) run each
# layer as the deterministic mode's four tfs::det_matmul launches (tensor-core tiles per weight-shape class, the
# norms, residual adds and SiLU-mul folded in) and the LM head through it too, while attention stays the backend's
# default kernels, instead of cuBLAS plus inductor's elementwise kernels (305 kernels for SmolLM2 at batch 8, 245
# this way). H100: SmolLM2's batch-8 decode forward 886 -> 787 us; with it and the fused greedy finish (not timed
# apart) the Llama-3-8B shape's batch-1 n-gram iteration (a 5-row verify) costs 1.09x a plain step, 1.19x before
# (docs/PERFORMANCE.md). 16 rather than 8: a batch-1 speculation v2 iteration runs padded to batch size 2, so n-gram's
# 5-token verify is a 10-row forward, and through det_matmul (whose 16-row tile costs the same at 10 rows as at 8)
# SmolLM2's iteration took 0.72-0.76 ms of GPU time against 0.905 on cuBLAS (H100); widths whose batch-2 verify newly
# fits (5-8 tokens) compile once more at start-up, once on each side of the row guard below (H100, width 5 at batch
# sizes [1, 2, 4]: tests/test_spec_v2_gpu.py). 0: off. Not batch-invariant (one row takes tfs::gemv).
DET_MAX_ROWS = 16
# ... with the qkv projection's RoPE and K/V store as that launch's epilogue (the attention backend's
# forward_projection(det=True): tfs::det_qkv_rope_store on attention=triton), one kernel a layer fewer. H100:
# SmolLM2's batch-8 decode forward 767 -> 689 us, the user's batch-8 job 9377 -> 9697 tok/s (docs/PERFORMANCE.md).
DET_QKV_ROPE_STORE = True


@dataclass
class LlamaArgs:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # Llama 3: rope_type=llama3, factor, low/high_freq_factor, ...
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_heads


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]``, with Llama-3 frequency scaling when configured."""
    dim = args.head_dim
    # float32 like the reference implementation, so that fp32 logits match it bit for bit where possible
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "factors":  # per-frequency divisors, as GGUF files store them (rope_freqs.weight)
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=inv_freq.dtype)
    elif kind not in ("default", None):
        raise ValueError(f"rope scaling type {kind!r} is not supported; supported: default, linear, llama3, factors")
    return inv_freq.float()


def project(linear: nn.Linear, x: torch.Tensor, deterministic: bool) -> torch.Tensor:
    """``linear(x)``; batch-invariant (``tfs::det_matmul``: a row's result whatever the row count) when
    ``deterministic``."""
    return det_matmul(x, linear.weight) if deterministic else linear(x)


class RMSNorm(nn.Module):
    deterministic = False  # model.deterministic: tfs::det_rmsnorm (set by LlamaForCausalLM.set_deterministic)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.deterministic:
            return det_rmsnorm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    deterministic = False  # model.deterministic: projections through tfs::det_matmul

    def __init__(self, args: LlamaArgs, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, q_size + 2 * kv_size, bias=False)  # fused wq | wk | wv
        self.o_proj = nn.Linear(q_size, args.hidden_size, bias=False)
        self.split = (q_size, kv_size, kv_size)
        self.backend: Any = None  # set by the model runner
        self.tp: Any = None  # tensor parallelism: this rank's TPInfo (heads and sizes above are its share)

    def forward(self, x: torch.Tensor, rope: Rope, meta: Any) -> torch.Tensor:
        det = self.deterministic
        out = project(self.o_proj, self.attend(project(self.qkv_proj, x, det), rope, meta), det)
        return out if self.tp is None else all_reduce(out, self.tp)  # row-parallel: partial sums

    def attend(self, qkv: torch.Tensor, rope: Rope, meta: Any) -> torch.Tensor:
        """qkv ``[n, q_size + 2 * kv_size]`` -> attention output ``[n, heads * head_dim]`` (before o_proj)."""
        fused = self.backend.forward_qkv(qkv, rope, self.layer_id, meta)
        if fused is not None:
            return fused
        n = qkv.shape[0]
        q, k, v = qkv.split(self.split, dim=-1)
        q = apply_rope(q.view(n, self.num_heads, self.head_dim), rope.cos, rope.sin)  # [n, heads, head_dim]
        k = apply_rope(k.view(n, self.num_kv_heads, self.head_dim), rope.cos, rope.sin)  # [n, kv_heads, head_dim]
        v = v.view(n, self.num_kv_heads, self.head_dim)
        return self.backend.forward(q, k, v, self.layer_id, meta)


class MLP(nn.Module):
    deterministic = False  # model.deterministic: projections through tfs::det_matmul

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)  # fused gate | up
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.tp: Any = None  # tensor parallelism: this rank's TPInfo (its share of the intermediate columns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        det = self.deterministic
        gate, up = project(self.gate_up_proj, x, det).chunk(2, dim=-1)
        out = project(self.down_proj, F.silu(gate) * up, det)
        return out if self.tp is None else all_reduce(out, self.tp)  # row-parallel: partial sums


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_id)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, rope: Rope, meta: Any, fused: bool = False, pdl: bool = False,
                det: bool = False) -> torch.Tensor:
        """``fused``: run the four linears as ``tfs::gemv`` with the norms, SiLU-mul and residual adds folded in
        (a decode-sized batch on the GPU: 4 weight-streaming kernels instead of cuBLAS plus 5 elementwise ones);
        ``det``: the same folds as ``tfs::det_matmul`` (deterministic mode, or ``DET_MAX_ROWS``; one process);
        ``pdl``: their programmatic-dependent-launch variant (tfs_kernels/pdl.py). Tensor-parallel: o_proj's and
        down_proj's partial products are all-reduced before the residual add (not fused into their gemv)."""
        if fused:
            attn, mlp = self.self_attn, self.mlp
            tp = mlp.tp
            norm = self.input_layernorm
            out = attn.backend.forward_projection(x, attn.qkv_proj.weight, norm.weight, norm.eps, rope, attn.layer_id,
                                                  meta)
            if out is None:  # the backend does not fuse the projection: tfs::gemv, then RoPE and attention
                qkv = gemv(x, attn.qkv_proj.weight, norm_weight=norm.weight, eps=norm.eps, pdl=pdl)
                out = attn.attend(qkv, rope, meta)
            if tp is None:
                x = gemv(out, attn.o_proj.weight, residual=x, pdl=pdl)
            else:
                x = x + all_reduce(gemv(out, attn.o_proj.weight, pdl=pdl), tp)
            h = gemv(x, mlp.gate_up_proj.weight, norm_weight=self.post_attention_layernorm.weight,
                     eps=self.post_attention_layernorm.eps, pdl=pdl)
            if tp is None:
                return gemv(h, mlp.down_proj.weight, residual=x, silu_mul=True, pdl=pdl)
            return x + all_reduce(gemv(h, mlp.down_proj.weight, silu_mul=True, pdl=pdl), tp)
        if det or self.mlp.deterministic:  # the norms, residual adds and SiLU-mul in tfs::det_matmul
            attn, mlp = self.self_attn, self.mlp
            norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
            out = None
            if DET_QKV_ROPE_STORE and not mlp.deterministic:  # RoPE and the K/V store in the projection's kernel
                out = attn.backend.forward_projection(x, attn.qkv_proj.weight, norm1.weight, norm1.eps, rope,
                                                      attn.layer_id, meta, det=True)
            if out is None:
                qkv = det_matmul(x, attn.qkv_proj.weight, norm_weight=norm1.weight, eps=norm1.eps, pdl=pdl)
                out = attn.attend(qkv, rope, meta)
            x = det_matmul(out, attn.o_proj.weight, residual=x, pdl=pdl)
            h = det_matmul(x, mlp.gate_up_proj.weight, norm_weight=norm2.weight, eps=norm2.eps, pdl=pdl)
            return det_matmul(h, mlp.down_proj.weight, residual=x, silu_mul=True, pdl=pdl)
        x = x + self.self_attn(self.input_layernorm(x), rope, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def pre_attention(self, x: torch.Tensor, delta: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The unfused layer (one process, not deterministic) up to attention, on the input ``x + delta`` (``x``
        where ``delta`` is None) ``[n, hidden]``: returns that input and the qkv projection of its norm."""
        if delta is not None:
            x = x + delta
        return x, self.self_attn.qkv_proj(self.input_layernorm(x))

    def post_attention(self, x: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of the layer after attention ``attn`` ``[n, heads * head_dim]``: returns the residual after
        attention and the MLP's output, whose sum is the layer's output (see framework/models/regions.py)."""
        x = x + self.self_attn.o_proj(attn)
        return x, self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Flat-token Llama: ``forward(input_ids [n], positions [n], meta, logits_index [m]) -> (logits, hidden)``."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.fused_decode = True  # compiled decode-sized batches on CUDA use tfs::gemv (see DecoderLayer.forward)
        self.pdl = False  # ... launched with programmatic dependent launch (set by the model runner: compile.pdl)
        # tensor parallelism (framework/parallel/shard.py): this rank's TPInfo; embed_tokens / lm_head then hold its
        # vocabulary rows, each layer its heads and intermediate columns; ``args`` keep the whole model's sizes
        self.tp: Any = None
        self.deterministic = False  # model.deterministic: see set_deterministic
        self.regional = False  # compile.regional: the layers as nested compile regions (set by the model runner)
        half = args.head_dim // 2
        self.register_buffer("rope_cos", torch.empty(args.max_position_embeddings, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_position_embeddings, half), persistent=False)
        if self.rope_cos.device.type != "meta":
            self.init_rope()

    def init_rope(self, num_positions: int = 0) -> None:
        """Fill the float32 rope tables ``[num_positions, head_dim // 2]`` (after allocation on a real device);
        at least ``max_position_embeddings`` rows, more when speculation's discarded draft nodes run past the
        window (Engine)."""
        num_positions = max(num_positions, self.args.max_position_embeddings, self.rope_cos.shape[0])
        positions = torch.arange(num_positions, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(self.args)).to(self.rope_cos.device)
        self.rope_cos = freqs.cos()
        self.rope_sin = freqs.sin()

    def kv_pool(self, num_slots: int, dtype: torch.dtype, device: torch.device, scratch_rows: int = 0) -> KVPool:
        """The paged K/V pool this model's layers attend over (``scratch_rows``: see :class:`KVPool`)."""
        a = self.attention_args
        return KVPool(a.num_layers, num_slots, a.num_kv_heads, a.head_dim, dtype, device, scratch_rows)

    @property
    def attention_args(self) -> LlamaArgs:
        """``args`` with the head counts this rank's attention runs (all of them without tensor parallelism)."""
        if self.tp is None:
            return self.args
        attn = self.layers[0].self_attn
        return dataclasses.replace(self.args, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads)

    def set_deterministic(self) -> None:
        """model.deterministic: every linear (``tfs::det_matmul``, the LM head with float32 logits) and RMSNorm
        (``tfs::det_rmsnorm``) computes a token row's result in an order that does not depend on the forward's row
        count, and the fused decode path (tfs::gemv, a kernel for one row only) is off. Attention is the backend's
        part (AttentionBackend.set_deterministic)."""
        self.deterministic = True
        self.fused_decode = False
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.deterministic = True

    def set_attention_backend(self, backend: Any) -> None:
        for layer in self.layers:
            layer.self_attn.backend = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, logits_index: torch.Tensor,
                layer_ids: Optional[Sequence[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns logits ``[m, vocab]`` (float32) of the rows ``logits_index`` and the final-norm hidden states
        ``[n, hidden]`` of every token. ``layer_ids`` runs a subset of the layers (self-speculative drafting). The
        fused path (compiled, uniform batches) computes every row's logits: there ``logits_index`` is every token in
        order (ModelRunner pads it so)."""
        tp = self.tp
        # [n, hidden]
        x = self.embed_tokens(input_ids) if tp is None else embed_vocab(self.embed_tokens.weight, input_ids, tp)
        rope = rope_at(self.rope_cos, self.rope_sin, positions)
        layers = self.layers if layer_ids is None else [self.layers[i] for i in layer_ids]
        # NOTE: only in compiled CUDA graphs, where a kernel launch costs nothing on the host: eagerly, a Python
        # launch per linear would cost more than cuBLAS's (and under TRITON_INTERPRET=1 every linear would run in
        # the interpreter; the kernel's interpreted tests and DecoderLayer.forward(fused=True) cover that instead)
        # and only in uniform batches (a compiled prefill's metadata says it is not one)
        fused = (self.fused_decode and x.is_cuda and torch.compiler.is_compiling() and getattr(meta, "uniform", True)
                 and x.shape[0] <= min(FUSED_MAX_ROWS, GEMV_MAX_ROWS))
        det_rows = (DET_MAX_ROWS > 1 and not fused and not self.deterministic and tp is None and x.is_cuda
                    and torch.compiler.is_compiling() and getattr(meta, "uniform", True)
                    and 1 < x.shape[0] <= DET_MAX_ROWS)  # (off: nothing read, no guard on the row count)
        det = self.deterministic or det_rows
        x = run_layers(layers, x, rope, meta, fused, (fused or det) and self.pdl, self.regional, det)
        if fused and FUSED_LM_HEAD:  # the final norm, the lm_head and .float() in one kernel, for every row: the
            # batches that run fused are uniform, where logits_index selects every token in order (ModelRunner)
            torch._check(logits_index.shape[0] == x.shape[0], lambda: "fused lm_head: logits of every row only")
            logits, hidden = lm_head(x, self.norm.weight, self.norm.eps, self.lm_head.weight, self.pdl)
            return (logits, hidden) if tp is None else (gather_vocab(logits, tp), hidden)
        hidden = self.norm(x)  # [n, hidden]
        rows = hidden[logits_index]  # [m <= n, hidden]
        if det:
            return det_matmul(rows, self.lm_head.weight, out_float32=True, pdl=self.pdl), hidden
        logits = gemv(rows, self.lm_head.weight, pdl=self.pdl) if fused else self.lm_head(rows)
        logits = logits.float()  # [m, vocab] (tensor-parallel: [m, vocab / N], this rank's rows, then gathered)
        return (logits, hidden) if tp is None else (gather_vocab(logits, tp), hidden)
