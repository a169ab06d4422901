"""``attention=triton``: Triton kernels (``tfs_kernels/``) straight over the paged KV pool.

- every mode first applies RoPE to q and k and writes the new K/V into the pool at ``out_cache_loc``, in one kernel
  (``tfs::rope_store_kv``, through :meth:`forward_qkv`; :meth:`forward` takes roped q/k and uses ``tfs::store_kv``);
  a decode-sized batch on the model's fused path (``tfs::gemv``) folds the qkv projection into that kernel too
  (``tfs::qkv_rope_store``, through :meth:`forward_projection`);
- EXTEND (ragged prefill, eager): ``tfs::extend_attention``, causal over the new tokens, whole prefix visible;
- DECODE: ``tfs::decode_attention``, split-K over each request's keys (flash-decoding);
- DRAFT_EXTEND (ragged): as EXTEND;
- TARGET_VERIFY / DRAFT_EXTEND_V2 / DRAFT_DECODE: ``tfs::verify_attention``, the same split-K kernel with ``q_len``
  tokens per request and ``batch.custom_mask`` over the last ``mask_width`` keys (causal when there is none);
- model.deterministic: every mode through ``tfs::det_attention`` (a token's keys split by a length that depends on
  its position only, one token per program), so that a token's output is the same bits in a decode, a verify and a
  prefill.

The kernels read slots straight from the allocator's ``req_to_token`` table, so the metadata is the batch's own
tensors plus that table: no per-step gather, no host-computed width, nothing read back from the device. Its shapes
depend only on (mode, padded_bs, q_len) (and the custom mask's width), so compiled graphs replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from framework.attention import ATTENTION_BACKENDS
from framework.attention.base import AttentionBackend
from framework.batch import ForwardBatch
from framework.config import ConfigError
from framework.kv import KVAllocator, KVPool
from tfs_kernels.mask_bits import MASK_WORD_BITS, pack_mask_bits  # plain torch: no triton import

NEEDS_CUDA = "attention=triton needs a CUDA device (set TRITON_INTERPRET=1 to run the Triton interpreter on the CPU)"


@dataclass
class TritonMetadata:
    out_cache_loc: torch.Tensor  # [num_tokens] slots that receive the new K/V
    req_to_token: torch.Tensor  # [max_requests + 1, max_context] the allocator's slot table (read in place)
    req_pool_indices: torch.Tensor  # [bs] rows of req_to_token
    seq_lens: torch.Tensor  # [bs] keys of each request after this forward
    q_len: int  # uniform modes: tokens per request; EXTEND: the longest request's new tokens
    split_policy: tuple[int, int, int]  # (max_splits, target_programs, min_split_len) of the split-K kernel
    custom_mask: Optional[torch.Tensor] = None  # [bs, q_len, mask_width] over each request's last keys: uint8 0 / 1,
    # or the batch's bool mask when mask_bits holds it
    mask_bits: Optional[torch.Tensor] = None  # [bs, q_len] int64: custom_mask packed, bit i = key i (width <= 64)
    uniform: bool = True  # False for EXTEND: the model's fused decode path does not apply
    q_starts: Optional[torch.Tensor] = None  # EXTEND: [bs] first flat token of each request
    q_lens: Optional[torch.Tensor] = None  # EXTEND: [bs] new tokens of each request


@ATTENTION_BACKENDS.register("triton")
class TritonBackend(AttentionBackend):
    """Paged attention with Triton kernels; on the CPU only under ``TRITON_INTERPRET=1`` (tests)."""

    name = "triton"
    compiles_extend = True
    reads_table_in_forward = True

    def __init__(self, pool: KVPool, allocator: KVAllocator, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> None:
        super().__init__(pool, allocator, num_heads, num_kv_heads, head_dim)
        from tfs_kernels.dispatch import INTERPRET, interpreter_active  # triton-free module: checked before triton

        if allocator.device.type != "cuda":
            if not INTERPRET:
                raise ConfigError(NEEDS_CUDA)
            if not interpreter_active():
                raise ConfigError("attention=triton on the CPU: TRITON_INTERPRET=1 must be set before the process "
                                  "starts (triton was imported without it)")
        if num_heads % num_kv_heads:
            raise ConfigError(f"attention=triton: {num_heads} query heads are not a multiple of "
                              f"{num_kv_heads} KV heads")
        from tfs_kernels.decode_attention import decode_attention
        from tfs_kernels.det_qkv_rope_store import det_qkv_rope_store, det_qkv_rope_store_applies
        from tfs_kernels.extend_attention import extend_attention
        from tfs_kernels.qkv_rope_store import qkv_rope_store, qkv_rope_store_applies
        from tfs_kernels.rope_store import rope_store_kv
        from tfs_kernels.split_kv_attention import split_policy
        from tfs_kernels.store_kv import store_kv
        from tfs_kernels.verify_attention import verify_attention

        self._decode, self._extend, self._verify, self._store = decode_attention, extend_attention, \
            verify_attention, store_kv
        self._split_policy = split_policy
        self._rope_store = rope_store_kv
        self._qkv_rope_store, self._qkv_rope_store_applies = qkv_rope_store, qkv_rope_store_applies
        self._det_qkv_rope_store, self._det_qkv_rope_store_applies = det_qkv_rope_store, det_qkv_rope_store_applies
        self._policies: dict[int, tuple[int, int, int]] = {}
        if allocator.device.type == "cuda":
            # NOTE: the table is read inside captured graphs and updated outside them; a static address keeps
            # cudagraph trees from copying it into the graph on every replay
            torch._dynamo.mark_static_address(allocator.req_to_token)

    def set_deterministic(self) -> None:
        """Every mode through ``tfs::det_attention`` (splits of at least the device's ``min_split`` keys)."""
        from tfs_kernels.det_attention import det_attention, min_split

        self.deterministic = True
        self._det_attention = det_attention
        self._det_split = min_split(self.allocator.device.type)

    def expect_q_lens(self, q_lens: list[int]) -> None:
        for q_len in q_lens:
            self.policy(q_len)

    def policy(self, q_len: int) -> tuple[int, int, int]:
        """(max_splits, target_programs, min_split_len) of the split-K kernel for ``q_len`` tokens per request."""
        if q_len not in self._policies:
            self._policies[q_len] = self._split_policy(self.allocator.device, q_len)
        return self._policies[q_len]

    def init_metadata(self, batch: ForwardBatch) -> TritonMetadata:
        table = self.allocator.req_to_token
        if batch.mode.uniform:
            # the kernel reads the mask as one word per row (up to 64 keys wide) or as bytes: converted once per
            # step here, not once per layer in the graph
            mask, bits = batch.custom_mask, None
            if mask is not None and mask.shape[2] <= MASK_WORD_BITS:
                bits = pack_mask_bits(mask)  # the kernel reads only the bool mask's width
            elif mask is not None:
                mask = mask.to(torch.uint8)
            meta = self.uniform_metadata(batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens, batch.q_len)
            meta.custom_mask, meta.mask_bits = mask, bits
            return meta
        if batch.custom_mask is not None:
            raise NotImplementedError("attention=triton: EXTEND with a custom mask (masks are for uniform modes)")
        lens = list(batch.extend_lens_cpu)
        starts = [0] * len(lens)
        for i in range(1, len(lens)):
            starts[i] = starts[i - 1] + lens[i - 1]
        packed = torch.tensor(starts + lens, dtype=torch.int64).to(batch.input_ids.device, non_blocking=True)
        return TritonMetadata(batch.out_cache_loc, table, batch.req_pool_indices, batch.seq_lens,
                              batch.extend_width or max(lens),
                              self.policy(1), uniform=False, q_starts=packed[: len(lens)], q_lens=packed[len(lens):])

    def uniform_metadata(self, out_cache_loc: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                         q_len: int) -> TritonMetadata:
        return TritonMetadata(out_cache_loc, self.allocator.req_to_token, req_pool_indices, seq_lens, q_len,
                              self.policy(q_len))

    def dynamic_dims(self, meta: TritonMetadata) -> list[tuple[torch.Tensor, int]]:
        dims = [(meta.out_cache_loc, 0), (meta.req_pool_indices, 0), (meta.seq_lens, 0)]
        if meta.custom_mask is not None:  # batch and mask width (draft steps widen it) vary; q_len does not
            dims += [(meta.custom_mask, 0), (meta.custom_mask, 2)]
        if meta.mask_bits is not None:
            dims += [(meta.mask_bits, 0)]
        if meta.q_starts is not None:  # a prefill step run from a CUDA graph: one compile for every padded shape
            dims += [(meta.q_starts, 0), (meta.q_lens, 0)]
        return dims

    def forward_qkv(self, qkv: torch.Tensor, rope: Any, layer: int, meta: TritonMetadata) -> torch.Tensor:
        """RoPE (read from the tables at each token's position) and the K/V store in one kernel
        (``tfs::rope_store_kv``), then attention."""
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]  # [num_slots, kv_heads, head_dim]
        q = self._rope_store(qkv, rope.cos_table, rope.sin_table, rope.positions, k_cache, v_cache,
                             meta.out_cache_loc, self.num_heads, self.num_kv_heads, self.head_dim,
                             self.pdl)  # [n, heads, dim]
        return self._attend(q, k_cache, v_cache, meta)

    def forward_projection(self, x: torch.Tensor, w_qkv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           rope: Any, layer: int, meta: TritonMetadata, det: bool = False) -> Optional[torch.Tensor]:
        """The qkv projection, RoPE and the K/V store in one kernel (``tfs::qkv_rope_store``; ``det``:
        ``tfs::det_qkv_rope_store``), then attention."""
        fused, applies = (self._det_qkv_rope_store, self._det_qkv_rope_store_applies) if det else \
            (self._qkv_rope_store, self._qkv_rope_store_applies)
        if self.deterministic or not applies(x, w_qkv, self.head_dim):
            return None
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]  # [num_slots, kv_heads, head_dim]
        q = fused(x, w_qkv, norm_weight, eps, rope.cos_table, rope.sin_table, rope.positions, k_cache, v_cache,
                  meta.out_cache_loc, self.num_heads, self.num_kv_heads, self.head_dim, self.pdl)  # [n, heads, dim]
        return self._attend(q, k_cache, v_cache, meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                meta: TritonMetadata) -> torch.Tensor:
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]  # [num_slots, kv_heads, head_dim]
        self._store(k_cache, v_cache, meta.out_cache_loc, k, v)
        return self._attend(q, k_cache, v_cache, meta)

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: TritonMetadata) -> torch.Tensor:
        if self.deterministic:
            out = self._det_attention(q, k_cache, v_cache, meta.req_to_token, meta.req_pool_indices, meta.seq_lens,
                                      meta.q_starts, meta.q_lens, meta.custom_mask, meta.mask_bits, meta.q_len,
                                      self.scale, self._det_split, pdl=self.pdl)
        elif meta.q_starts is not None:
            out = self._extend(q, k_cache, v_cache, meta.req_to_token, meta.req_pool_indices, meta.seq_lens,
                               meta.q_starts, meta.q_lens, meta.q_len, self.scale)
        elif meta.q_len == 1 and meta.custom_mask is None:
            out = self._decode(q, k_cache, v_cache, meta.req_to_token, meta.req_pool_indices, meta.seq_lens,
                               self.scale, *meta.split_policy, pdl=self.pdl)
        else:
            out = self._verify(q, k_cache, v_cache, meta.req_to_token, meta.req_pool_indices, meta.seq_lens,
                               meta.custom_mask, meta.q_len, self.scale, *meta.split_policy, pdl=self.pdl,
                               mask_bits=meta.mask_bits)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)  # [num_tokens, heads * head_dim]
