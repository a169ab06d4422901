"""``speculative=eagle``: an EAGLE-style head. Input at position p: the target's embedding of token x_p
concatenated with a hidden state for position p - 1 (the target's, or the head's own while drafting), projected
back to the hidden size, one decoder layer, a norm, and the target's LM head. Random (seeded) weights unless
``speculative.checkpoint`` names a safetensors file with ``fc.weight``, ``layer.*`` and ``norm.weight``.

The head keeps its own one-layer KV pool (slot indices shared with the target). After the target's prefill and
after every verify it runs DRAFT_EXTEND over the new tokens with the target's hidden states, which leaves it at the
next root with its logits and hidden state ready for the first draft step.

Speculation v2 (:meth:`EagleDrafter.use_v2`): the head's state at each request's root lives in device buffers by
request row; the prefill chunk goes to the head when it is launched, and after every verify one DRAFT_EXTEND_V2
forward (graph-static: all num_steps + 1 emitted tokens of every request, padded) leaves the state at
``arange(bs) * (num_steps + 1) + accept_len - 1``.

Prefix cache: the tree takes pages only below the head's valid length (:meth:`EagleDrafter.kv_valid_len`), so the
head's pool holds the K/V of every cached page; a request that takes a cached prefix runs the head over the rest
only, its first new token paired with the target's hidden state at the prefix's last position, kept per page
(:class:`framework.speculative.page_carry.PageCarry`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn

from framework.batch import ForwardBatch, ForwardMode
from framework.kv import DUMMY_ROW
from framework.transfer import upload
from framework.config import SpeculativeConfig
from framework.models.checks import load_safetensors_into
from framework.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm
from framework.speculative import DRAFTERS
from framework.speculative.base import DraftTree, SpecContext
from framework.speculative.model_drafter import ModelDrafter
from framework.speculative.page_carry import PageCarry
from tfs_kernels.rope_store import rope_at


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
    drafts_in_v2 = v2_by_default = True  # (its v2 iteration gives v1's tokens on a GPU: tests/test_spec_v2_gpu.py)
    extends_after_verify = True  # v2: DRAFT_EXTEND_V2 after every verification
    own_kv = True

    def __init__(self, engine, cfg: SpeculativeConfig) -> None:
        super().__init__(engine, cfg)
        self.head = build_head(engine.model, cfg.checkpoint, cfg.seed)
        a = engine.model.args
        self.own_runner(self.head, 1, a.num_heads, a.num_kv_heads, a.head_dim)
        self.init_page_carry()

    def init_page_carry(self) -> None:
        """With the prefix cache: the target's hidden state at every page's last position (see the module doc)."""
        eng = self.engine
        self.page_carry = None if eng.allocator.cache is None else PageCarry(
            eng.allocator, eng.model.args.hidden_size, eng.dtype, eng.device)

    def kv_valid_len(self, req) -> int:
        """v2: every committed position (and the root); v1: up to the last catch-up extend."""
        if self.v2:
            return req.kv_len
        return req.drafter_state.kv_len if isinstance(req.drafter_state, EagleState) else 0

    def _page_ends(self, row: int, start: int, end: int, first_row: int, pages: list[int], rows: list[int]) -> None:
        """Collect the positions of ``[start, end)`` that end a page (their hidden states at ``first_row + k``)."""
        if self.page_carry is not None:
            p, offsets = self.page_carry.page_ends(row, start, end)
            pages += p
            rows += [first_row + o for o in offsets]

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
            mode=ForwardMode.DRAFT_EXTEND, input_ids=packed[:n], positions=packed[n:2 * n],
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
        alloc, pc = self.engine.allocator, self.page_carry
        reqs, rows, starts, ids, hiddens, end_pages, end_rows = [], [], [], [], [], [], []
        offset = 0
        for req, n, root in zip(step.reqs, step.extend_lens, roots):
            s = req.kv_len - n  # the chunk's first position (its positions are committed already)
            chunk = hidden[offset: offset + n]
            self._page_ends(req.row, s, s + n, offset, end_pages, end_rows)
            offset += n
            state = req.drafter_state
            carry = state.carry if s > 0 and state is not None and state.carry is not None else None
            if pc is not None and 0 < s == req.prefix_len:  # the first chunk after a cached prefix
                carry = pc.states[pc.page_of(req.row, s - 1)]
            prev = carry if carry is not None else torch.zeros_like(chunk[0])
            done = root is not None
            seq = req.token_slice(s, s + n) + ([root] if done else [])
            h = torch.cat([prev[None], chunk[: len(seq) - 1]])
            if done:
                alloc.assign([req.row], [s + n], [s + n + 1])  # the root's slot in the head's pool
            req.drafter_state = EagleState(kv_len=s, carry=chunk[-1])
            reqs.append(req), rows.append(req.row), starts.append(s), ids.append(seq), hiddens.append(h)
        self._extend(reqs, rows, starts, ids, torch.cat(hiddens))
        if pc is not None:
            pc.store(end_pages, end_rows, hidden)

    def first_forward(self, ctx: SpecContext) -> tuple[torch.Tensor, torch.Tensor]:
        if self.v2:
            return self.root_logits[ctx.rows_t], self.root_hidden[ctx.rows_t]
        states = [r.drafter_state for r in ctx.reqs]
        return torch.stack([s.logits for s in states]), torch.stack([s.hidden for s in states])

    def step_forward(self, ctx: SpecContext, tokens: torch.Tensor, depth: int, col: int,
                     mask: Optional[torch.Tensor], parent_hidden: Optional[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.draft_batch(ctx, tokens, depth, col, mask)
        batch.hidden_in = parent_hidden.reshape(-1, parent_hidden.shape[-1])
        return self.runner.forward(batch, **self.forward_kwargs)

    def on_accept(self, ctx: SpecContext, tree: DraftTree, accept_index: list[list[int]],
                  hidden: torch.Tensor, new_roots: list[int]) -> None:
        """Catch up on the accepted path: positions L+1 .. L+k+1 get the accepted tokens and the bonus, each
        paired with the target's hidden state of the node before it."""
        n = tree.num_nodes
        tokens = tree.tokens.tolist()  # NOTE: one small read; the worker has synchronised already
        ids, rows_idx, end_pages, end_rows = [], [], [], []
        for b, (path, root) in enumerate(zip(accept_index, new_roots)):
            ids.append([tokens[b][node] for node in path[1:]] + [root])
            self._page_ends(ctx.reqs[b].row, ctx.kv_lens[b], ctx.kv_lens[b] + len(path), len(rows_idx), end_pages,
                            end_rows)
            rows_idx += [b * n + node for node in path]
        index = torch.tensor(rows_idx, dtype=torch.int64, device=hidden.device)
        if self.page_carry is not None:  # (the accepted path, compacted: node path[j] at position L + j)
            self.page_carry.store(end_pages, end_rows, hidden[index])
        self._extend(ctx.reqs, [r.row for r in ctx.reqs], [L + 1 for L in ctx.kv_lens], ids, hidden[index])

    # ---- speculation v2 -----------------------------------------------------------------------------------
    def use_v2(self) -> None:
        super().use_v2()
        eng = self.engine
        rows, hidden = eng.allocator.req_to_token.shape[0], eng.model.args.hidden_size
        self.root_logits = torch.zeros(rows, eng.model.args.vocab_size, device=eng.device)  # [rows, vocab]
        self.root_hidden = torch.zeros(rows, hidden, dtype=eng.dtype, device=eng.device)  # [rows, hidden]
        self.carry = torch.zeros(rows, hidden, dtype=eng.dtype, device=eng.device)  # last prefilled token's target h
        if eng.device.type == "cuda":
            for t in (self.root_logits, self.root_hidden, self.carry):
                torch._dynamo.mark_static_address(t)

    def on_prefill_launch(self, step, batch: ForwardBatch, hidden: torch.Tensor, sampled: torch.Tensor) -> None:
        """The chunk (and, where it completes the prompt, the root: the token the step samples, or a re-prefilled
        request's last token) into the head, each token paired with the target's hidden state of the one before;
        called before the chunk's positions are committed. Only the index arrays come from the host."""
        eng, table = self.engine, self.engine.allocator.req_to_token_host
        n_tok, bs = batch.input_ids.shape[0], len(step.reqs)
        ids, hs, positions, slots, lens, ends, done_rows, done_at, host_roots = [], [], [], [], [], [], [], [], []
        hit_pages, end_pages, end_rows = [], [], []  # prefix cache: the pages whose carry is read / written
        offset = 0
        for i, (req, n, gets) in enumerate(zip(step.reqs, step.extend_lens, step.samples)):
            s = req.kv_len
            done = not req.prefilled and s + n >= req.prefill_target
            ids += range(offset, offset + n)
            first = n_tok + i if s > 0 else n_tok + bs  # the row's carry, or zeros
            if self.page_carry is not None and 0 < s == req.prefix_len:  # the first chunk after a cached prefix
                first = n_tok + bs + 1 + len(hit_pages)
                hit_pages.append(self.page_carry.page_of(req.row, s - 1))
            self._page_ends(req.row, s, s + n, offset, end_pages, end_rows)
            hs += [first] + list(range(offset, offset + n - 1))
            if done:
                ids.append(n_tok + i if gets else n_tok + bs + len(host_roots))
                if not gets:
                    host_roots.append(req.output_ids[-1])
                hs.append(offset + n - 1)
                eng.allocator.assign([req.row], [s + n], [s + n + 1])  # the root's slot in the head's pool
            m = n + done
            positions += range(s, s + m)
            slots += table[req.row, s: s + m].tolist()
            lens.append(m), ends.append(s + m)
            if done:
                done_rows.append(req.row), done_at.append(sum(lens) - 1)
            offset += n
        parts = [ids, hs, positions, slots, [r.row for r in step.reqs], ends, np.cumsum(lens) - 1, done_rows, done_at,
                 host_roots, np.cumsum(step.extend_lens) - 1, hit_pages]
        packed = upload(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]), eng.device)
        views, at = [], 0
        for p in parts:
            views.append(packed[at: at + len(p)])
            at += len(p)
        ids_t, hs_t, pos_t, slots_t, rows_t, ends_t, last_t, done_rows_t, done_at_t, host_roots_t, chunk_last, \
            hit_pages_t = views
        rows_of_step = rows_t  # [bs]
        token_src = torch.cat([batch.input_ids, sampled.to(torch.int64), host_roots_t])
        hidden_src = [hidden, self.carry[rows_of_step], torch.zeros_like(hidden[:1])]
        if hit_pages:
            hidden_src.append(self.page_carry.states[hit_pages_t].to(hidden.dtype))
        hidden_src = torch.cat(hidden_src)
        head_batch = ForwardBatch(
            mode=ForwardMode.DRAFT_EXTEND, input_ids=token_src[ids_t], positions=pos_t, out_cache_loc=slots_t,
            req_pool_indices=rows_t, seq_lens=ends_t, seq_lens_cpu=ends, extend_lens_cpu=lens, logits_index=last_t,
            hidden_in=hidden_src[hs_t])
        logits, head_hidden = self.runner.forward(head_batch)
        self.carry[rows_of_step] = hidden[chunk_last]
        if self.page_carry is not None:
            self.page_carry.store(end_pages, end_rows, hidden)
        if done_rows:
            pick = torch.searchsorted(last_t, done_at_t)  # the completing requests' rows of logits
            self.root_logits[done_rows_t] = logits[pick]
            self.root_hidden[done_rows_t] = head_hidden[done_at_t]

    def extend_v2(self, rows: torch.Tensor, committed: torch.Tensor, accept_tokens: torch.Tensor,
                  accept_lens: torch.Tensor, hidden: torch.Tensor, bounds: list[int]) -> None:
        """DRAFT_EXTEND_V2 after a verification, all on the device: the emitted tokens ``accept_tokens`` ``[bs, q]``
        (the first ``accept_lens`` valid) at positions ``L + 1 ..`` paired with the target's states over the
        verified nodes ``hidden`` ``[bs * q, hidden]``; the state at each request's new root is kept."""
        bs, q = accept_tokens.shape
        table = self.engine.allocator.req_to_token
        positions = committed[:, None] + 1 + torch.arange(q, device=rows.device)[None, :]  # [bs, q]
        batch = ForwardBatch(
            mode=ForwardMode.DRAFT_EXTEND_V2, input_ids=accept_tokens.reshape(-1).to(torch.int64),
            positions=positions.reshape(-1), out_cache_loc=table[rows[:, None], positions].reshape(-1),
            req_pool_indices=rows, seq_lens=committed + 1 + q, seq_lens_cpu=[b + 1 for b in bounds],
            extend_lens_cpu=[q] * bs, logits_index=torch.arange(bs * q, device=rows.device), hidden_in=hidden)
        logits, head_hidden = self.runner.forward(batch, **self.forward_kwargs)
        pick = torch.arange(bs, device=rows.device) * q + accept_lens - 1  # the new root of each request
        real = (rows != DUMMY_ROW)[:, None]
        self.root_logits[rows] = torch.where(real, logits[pick], self.root_logits[rows])
        self.root_hidden[rows] = torch.where(real, head_hidden[pick], self.root_hidden[rows])
        if self.page_carry is not None:
            self.page_carry.store_verified(rows, committed, accept_lens, hidden)
