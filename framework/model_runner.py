"""ModelRunner: pads batches to captured sizes and runs the (optionally compiled) model forward."""

from __future__ import annotations

import bisect
import contextlib
import logging
from typing import Any, Optional

import numpy as np

import torch
import torch._inductor.config  # noqa: F401  (config.patch for CPU freezing)

from framework.attention.base import AttentionBackend
from framework.batch import ForwardBatch, ForwardMode
from framework import compile_guards
from framework.compile_guards import CAN_SKIP_GUARDS, full_guards, guarded_if_skipping, input_signature
from framework.graph_inputs import StaticInputs, extend_graph_shape, pad_extend, pad_uniform
from framework.kv import DUMMY_ROW, DUMMY_SLOT
from framework.models.llama import LlamaForCausalLM
import tfs_kernels.det_matmul as det_matmul
from tfs_kernels.inductor_fallbacks import register_inductor_fallbacks

log = logging.getLogger(__name__)

# compiled forwards also return their logits' argmax (the greedy tokens), so that an all-greedy step samples inside
# the graph instead of launching an eager argmax after it (ModelRunner.take_greedy). With graph_inputs.STAGING_RING:
# SmolLM2-shaped plain decode on an H100, batch 1, 1751 / 1806 -> 1961 / 1966 tok/s, batch 8 even (docs/PERFORMANCE.md).
# Every compiled forward computes it (about 10 us of GPU time on SmolLM2), also those whose callers do not use it
# (verify, drafts): making it depend on the mode could recompile graphs that modes share. A constant so that
# bench/knobs.py --set can compare the two in one commit
GREEDY_IN_GRAPH = True


def resolve_future_tokens(input_ids: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """``input_ids`` with each placeholder ``-1 - row`` replaced by ``next_tokens[row]``: the token that a launched
    step sampled for that request, which the host has not seen yet (the overlapped loop's future map)."""
    return torch.where(input_ids >= 0, input_ids, next_tokens[(-1 - input_ids).clamp(min=0)])


def configure_dynamo() -> None:
    """One compiled graph per (mode, shape family) is expected; leave room for the captured batch sizes."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 64))
    # floats read by compiled code are model constants (attention scales, norm eps) that differ between the models of
    # one process (a draft model, another engine): unspecialized (specialize_float=False in torch 2.11 and 2.13) the
    # second value seen becomes a graph input read with .item(), which a nested compile region (compile.regional)
    # cannot take in
    # (torch 2.13: "lift_tracked_freevar_to_input should not be called on root SubgraphTracer")
    if hasattr(cfg, "specialize_float"):
        cfg.specialize_float = True
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 1024)


class ModelRunner:
    """Owns the model and its compiled forward.

    EXTEND (ragged prefill) runs eagerly. Uniform modes (DECODE, TARGET_VERIFY, DRAFT_*) run through
    ``torch.compile(mode="reduce-overhead", fullgraph=True)`` when ``compiled``: the batch is padded to the next
    captured size with dummy requests (reserved req row and KV slot), so CUDA graphs are replayed, not re-recorded.
    """

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, compiled: bool,
                 batch_sizes: list[int], device: torch.device, skip_guards: bool = False,
                 pdl: bool = False, compile_extend: bool = False, extend_graph_tokens: int = 0,
                 freeze: bool = True, regional: bool = False) -> None:
        """``freeze=False``: on the CPU, compile without inductor's freezing, for a model whose weights change in
        place between calls (freezing folds them into the graph as constants). ``regional``: compile.regional (the
        model's layers as nested compile regions: framework/models/regions.py)."""
        self.model = model
        self.backend = backend
        self.device = device
        if compiled and device.type == "cuda" and det_matmul.SPLIT_FIXUP:  # its split-tile counts, outside the
            det_matmul.fixup_counts(device)  # CUDA graphs' pool (made lazily, they came from it)
        # compile.pdl, resolved: a compiling runner's kernels launch with PDL (its eager prefill's too)
        self.pdl = pdl and compiled
        model.pdl = backend.pdl = self.pdl
        self.regional = regional and compiled
        model.regional = self.regional
        self.compiled = compiled
        self.skip_guards = skip_guards and CAN_SKIP_GUARDS and compiled
        self._guarded: set = set()  # input signatures the compiled forward has run with full guards
        if self.skip_guards:
            compile_guards.skip_guards_process_wide()  # see _guard_stance
        self.batch_sizes = sorted(set(batch_sizes))
        # prefill steps of up to this many tokens run from CUDA graphs (padded: graph_inputs.pad_extend); 0: never
        self.extend_graph_tokens = min(extend_graph_tokens, backend.allocator.max_context) \
            if compiled and device.type == "cuda" else 0
        self.graph_shapes: set[tuple] = set()  # (mode, padded_bs, q_len) seen by the compiled forward
        self._static: dict[tuple, StaticInputs] = {}  # CUDA: (mode, padded_bs, q_len) -> the graph's int inputs
        model.set_attention_backend(backend)
        # [req_to_token rows] the latest token sampled for each request row, written on the device after every
        # sampling: the inputs of a step launched before the last one's tokens reached the host read it
        self.next_tokens = torch.zeros(backend.allocator.req_to_token.shape[0], dtype=torch.int64, device=device)
        self.req_to_token = backend.allocator.req_to_token  # [rows, positions] written by staged decode forwards
        if device.type == "cuda":
            torch._dynamo.mark_static_address(self.next_tokens)  # read inside graphs, written outside them
            torch._dynamo.mark_static_address(self.req_to_token)  # (a graph that mutates a plain input is skipped)
        # tensor parallelism, rank 0 (framework/parallel/leader.py): every forward and K/V copy is broadcast to the
        # other ranks first; None: one process (and on the other ranks, which follow)
        self.tp: Any = None
        self.greedy_in_graph = GREEDY_IN_GRAPH and compiled
        self._greedy: Optional[torch.Tensor] = None  # the last forward's in-graph argmax (take_greedy)
        self._compiled_forward = None
        self._compiled_extend = None  # EXTEND (ragged prefill): inductor with dynamic sizes, no CUDA graphs
        if compiled:
            configure_dynamo()
            register_inductor_fallbacks()  # before inductor meets an opaque tfs op deep in the graph: see that module
            if device.type == "cuda":
                self._compiled_forward = torch.compile(self._forward, mode="reduce-overhead", fullgraph=True)
                if compile_extend:
                    self._compiled_extend = torch.compile(self._extend_forward, dynamic=True, fullgraph=True)
            else:
                # NOTE: there are no CUDA graphs on the CPU; freezing instead lets inductor constant-fold the
                # weights and pre-pack them for the CPU GEMM library (measured: 1.4x faster decode at batch 8)
                compiled_forward = torch.compile(self._forward, fullgraph=True)

                def frozen_forward(*args: Any) -> Any:
                    with torch._inductor.config.patch(freezing=True):
                        return compiled_forward(*args)

                self._compiled_forward = frozen_forward if freeze else compiled_forward

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                 logits_index: torch.Tensor, extra: Any = None,
                 slot_writes: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                 greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Logits, hidden states, and with ``greedy`` the logits' argmax ``[rows]`` (else None).
        ``extra``: the model's extra input (a Llama's layer subset, an EAGLE head's input hidden states).
        ``slot_writes``: (req_pool_indices ``[bs]``, out_cache_loc ``[bs]``) of a batch of one token per request whose
        slots are not in the device's ``req_to_token`` yet (``ForwardBatch.write_slots``): written before attention
        reads the table."""
        if slot_writes is not None:
            rows, slots = slot_writes
            self.req_to_token[rows, positions] = slots
        input_ids = resolve_future_tokens(input_ids, self.next_tokens)
        logits, hidden = self.model(input_ids, positions, meta, logits_index, extra)
        return logits, hidden, (torch.argmax(logits, dim=-1) if greedy else None)

    def _extend_forward(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """:meth:`_forward` under a code object of its own, so that dynamo keeps its compiled entries apart from
        the CUDA-graph ones."""
        return self._forward(*args)

    @torch.inference_mode()
    def warmup(self, mode: ForwardMode, q_len: int, layer_ids: Any = None) -> None:
        """Compile (and on CUDA record graphs) for every captured batch size ahead of serving, with batches made
        only of dummy requests, so that no request waits for a compilation."""
        if not self.compiled:
            return
        dev = next(self.model.parameters()).device
        for bs in self.batch_sizes:
            n = bs * q_len
            zeros = torch.zeros(n, dtype=torch.int64, device=dev)
            causal = torch.ones(bs, q_len, q_len, dtype=torch.bool, device=dev).tril()
            batch = ForwardBatch(
                mode=mode, input_ids=zeros, positions=torch.arange(q_len, device=dev).repeat(bs),
                out_cache_loc=torch.full_like(zeros, DUMMY_SLOT),
                req_pool_indices=torch.full((bs,), DUMMY_ROW, dtype=torch.int64, device=dev),
                seq_lens=torch.full((bs,), q_len, dtype=torch.int64, device=dev), seq_lens_cpu=[q_len] * bs,
                extend_lens_cpu=[q_len] * bs, logits_index=torch.arange(n, device=dev),
                custom_mask=causal if mode is not ForwardMode.DECODE and q_len > 1 else None,
                write_slots=mode is ForwardMode.DECODE and self.stages_inputs)  # as the scheduler's decode batches
            if getattr(self.model, "takes_hidden_in", False):
                batch.hidden_in = torch.zeros(n, self.model.args.hidden_size, dtype=self.model.dtype, device=dev)
            self.forward(batch, layer_ids)

    def padded_size(self, bs: int) -> int:
        i = bisect.bisect_left(self.batch_sizes, bs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else bs

    def pad(self, batch: ForwardBatch) -> ForwardBatch:
        """``batch`` padded to the next captured batch size (:func:`pad_uniform`; on CUDA into the static buffers of
        the graph that will run it)."""
        padded_bs = self.padded_size(batch.bs)
        static = self._static_inputs((batch.mode, padded_bs, batch.q_len)) if self.device.type == "cuda" else None
        return pad_uniform(batch, padded_bs, static)

    def _static_inputs(self, key: tuple) -> StaticInputs:
        if key not in self._static:
            self._static[key] = StaticInputs(key[1], key[2], self.device)
        return self._static[key]

    @property
    def stages_inputs(self) -> bool:
        """True when compiled forwards run from static buffers that :meth:`stage` can fill (CUDA graphs)."""
        return self.compiled and self.device.type == "cuda"

    def stage(self, mode: ForwardMode, q_len: int, ints: list[np.ndarray]) -> Optional[list[torch.Tensor]]:
        """For the scheduler: write a uniform batch's integer inputs (host arrays in ``int_inputs``' order; no custom
        mask) straight into the static buffers of the CUDA graph that will run it, with one host-to-device copy, so
        that :meth:`forward` copies nothing. Returns the device views for its ForwardBatch (then its logits_index),
        valid until the next stage or fill of that shape; None where forwards do not run from static buffers."""
        if not (self.stages_inputs and mode.uniform):
            return None
        bs = len(ints[3])  # dummy_len = q_len, as :meth:`pad` has it for a batch without a custom mask
        return self._static_inputs((mode, self.padded_size(bs), q_len)).stage(ints, q_len)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, layer_ids: Any = None,
                new_step: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[len(batch.logits_index), vocab]`` (float32) and hidden states ``[num_tokens, hidden]``.

        In uniform modes ``batch.logits_index`` must select every token (rows in token order). ``new_step=False``:
        the forward belongs to the caller's CUDA-graph step (outputs of graphs replayed since the caller marked it
        stay valid; speculation v2 marks one step per iteration). Tensor-parallel (rank 0): the batch goes to the
        other ranks first, with its future-token placeholders resolved here (they do not hold ``next_tokens``).
        """
        if self.tp is None:
            return self._forward_batch(batch, layer_ids, new_step)
        return self.tp.run(self._forward_tp, batch, layer_ids, new_step)

    def _forward_tp(self, batch: ForwardBatch, layer_ids: Any, new_step: bool) -> tuple[torch.Tensor, torch.Tensor]:
        self.tp.send_forward(batch, resolve_future_tokens(batch.input_ids, self.next_tokens), self.req_to_token,
                             layer_ids)
        return self._forward_batch(batch, layer_ids, new_step)

    @torch.inference_mode()
    def copy_kv(self, index: torch.Tensor) -> None:
        """Copy K/V of every layer from slots ``index[0]`` to slots ``index[1]`` (``[2, n]``; every rank's shard)."""
        if self.tp is not None:
            self.tp.run(self.tp.send_copy_kv, index)
        pool = self.backend.pool
        for layer in range(pool.num_layers):
            pool.k[layer][index[1]] = pool.k[layer][index[0]]
            pool.v[layer][index[1]] = pool.v[layer][index[0]]

    def _forward_batch(self, batch: ForwardBatch, layer_ids: Any, new_step: bool) -> tuple[torch.Tensor, torch.Tensor]:
        self._greedy = None
        extra = batch.hidden_in if batch.hidden_in is not None else layer_ids
        # a staged batch's new slots: written inside the forward where the backend reads the table there, else
        # now, before its metadata gathers from the table
        in_forward = batch.write_slots and self.backend.reads_table_in_forward
        if batch.write_slots and not in_forward:
            self.req_to_token[batch.req_pool_indices, batch.positions] = batch.out_cache_loc
        graph_shape = self._extend_graph_shape(batch, extra)
        if not (self.compiled and batch.mode.uniform) and graph_shape is None:
            batch.attn = self.backend.init_metadata(batch)
            forward = self._forward
            if batch.mode is ForwardMode.EXTEND and self._compiled_extend is not None and extra is None:
                forward = self._compiled_extend
            writes = (batch.req_pool_indices, batch.out_cache_loc) if in_forward else None
            with guarded_if_skipping():  # (a backend may compile parts of its eager path)
                logits, hidden, _ = forward(batch.input_ids, batch.positions, batch.attn, batch.logits_index, extra,
                                            writes)
            return logits, hidden
        padded = self.pad(batch) if graph_shape is None else pad_extend(batch, *graph_shape, self.extend_graph_tokens)
        padded.attn = self.backend.init_metadata(padded)
        # NOTE: batch and key-width dims are dynamic in the compiled graph (one compile serves every captured
        # size; size 1 is specialised by dynamo); reduce-overhead still records one CUDA graph per concrete shape
        dynamic = [(padded.input_ids, 0), (padded.positions, 0), (padded.logits_index, 0),
                   *self.backend.dynamic_dims(padded.attn)]
        if padded.hidden_in is not None:
            dynamic.append((padded.hidden_in, 0))
        for tensor, dim in dynamic:  # (a no-op on a static buffer marked before)
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        self.graph_shapes.add((batch.mode, padded.padded_bs, padded.q_len if graph_shape is None else graph_shape[1]))
        if new_step:
            torch.compiler.cudagraph_mark_step_begin()
        extra = padded.hidden_in if padded.hidden_in is not None else layer_ids
        writes = (padded.req_pool_indices, padded.out_cache_loc) if in_forward else None
        args = (padded.input_ids, padded.positions, padded.attn, padded.logits_index, extra, writes,
                self.greedy_in_graph)
        try:
            with self._guard_stance(args):
                logits, hidden, greedy = self._compiled_forward(*args)
        except RuntimeError as err:  # torch refused to recompile without guards: run this call with them
            if "skip_guard_eval_unsafe" not in str(err):
                raise
            log.warning("compiled forward recompiled for an input signature it had seen; ran it with full guards")
            with full_guards():
                logits, hidden, greedy = self._compiled_forward(*args)
        self._greedy = greedy[: batch.logits_index.shape[0]] if greedy is not None else None
        hidden = hidden[: batch.input_ids.shape[0]]
        if graph_shape is not None:  # NOTE: the graph's next replay overwrites it, and a v1 drafter's on_prefill
            hidden = hidden.clone()  # reads a prefill's hidden states after the next step was launched
        return logits[: batch.logits_index.shape[0]], hidden

    def take_greedy(self) -> Optional[torch.Tensor]:
        """The argmax of the last forward's logits ``[rows]``, computed inside its compiled graph (``GREEDY_IN_GRAPH``);
        None where that forward did not compute it (eager forwards). Cleared by the call: valid until the next
        forward's graph replays."""
        greedy, self._greedy = self._greedy, None
        return greedy

    def _extend_graph_shape(self, batch: ForwardBatch, extra: Any) -> Optional[tuple[int, int]]:
        """(padded requests, padded tokens) when ``batch`` is a prefill step that runs from a CUDA graph."""
        if batch.mode is not ForwardMode.EXTEND or not self.extend_graph_tokens or extra is not None \
                or batch.custom_mask is not None:
            return None
        return extend_graph_shape(batch.input_ids.shape[0], batch.bs, self.extend_graph_tokens)

    def _guard_stance(self, args: tuple) -> Any:
        """Dynamo evaluates a guard per parameter and input on every call of the compiled forward (estimated at
        ~0.3-0.4 ms when this was added; on 2026-12-04 skipping them measured no gain: docs/PERFORMANCE.md). With
        ``compile.skip_guards`` the process runs in
        torch's ``skip_guard_eval_unsafe`` stance (set when the runner is built: switching it per call costs as much
        as the guards), which evaluates only the guards that tell compiled entries apart. The first call with each
        input signature (every shape, dtype and metadata value the guards look at, plus the grad mode) and every
        eager forward run with full guards, so that whatever must compile does so with them."""
        if not self.skip_guards:
            return guarded_if_skipping()
        key = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), input_signature(args))
        if key in self._guarded:
            return contextlib.nullcontext()
        self._guarded.add(key)
        return full_guards()
