"""Engine: builds the components from a Config and runs the generation loop."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from framework import compile_state, heap
from framework.attention import build_backend
from framework.batch import ForwardBatch, ForwardMode
from framework.config import Config, ConfigError
from framework.detokenizer import IncrementalDetokenizer
from framework.kv import KVAllocator
from framework.graph_warmup import warmup_extend, warmup_extend_graphs
from framework.model_runner import ModelRunner
from framework.models.loader import load_model
from framework.parallel.leader import TPLeader, check_parallel
from framework.request import Request, RequestOutput
from framework.request_parsing import parse_request
from framework.resolve import resolve_device, resolve_dtype, resolve_overlap, resolve_pdl, resolve_regional
from framework.sampling import RequestError, sample
from framework.scheduler import ScheduledStep, Scheduler
from framework.speculative import DRAFTERS
from framework.speculative.version import resolve_version
from framework.speculative.worker import SpecWorker, spec_kv_width
from framework.speculative.worker_v2 import SpecLaunched, SpecV2Worker, v2_kv_width
from framework.tokenizer import load_tokenizer
from framework.transfer import AsyncCopy

log = logging.getLogger(__name__)


@dataclass
class Launched:
    """A step whose forward and sampling are queued on the device: its tokens are on their way to the host."""

    step: ScheduledStep
    batch: ForwardBatch
    tokens: AsyncCopy  # [bs] the sampled tokens (one per request; used where step.samples says so)
    hidden: Optional[torch.Tensor] = None  # the forward's hidden states, kept for a drafter's on_prefill


@dataclass
class EngineStats:
    """The batch job's wall time: first admission to last finish."""

    first_admit_s: Optional[float] = None
    last_finish_s: Optional[float] = None

    @property
    def wall_s(self) -> float:
        if self.first_admit_s is None or self.last_finish_s is None:
            return 0.0
        return self.last_finish_s - self.first_admit_s


class Engine:
    """Owns the model runner, KV pool and allocator, scheduler and tokenizer.

    Use :meth:`submit` + :meth:`step` for a serving loop, or :meth:`generate` for a whole batch.
    """

    def __init__(self, config: Config) -> None:
        t0 = time.perf_counter()
        heap.thaw()  # an earlier engine's frozen start-up heap is collectable again (framework/heap.py)
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.tp: Optional[TPLeader] = None  # tensor parallelism: rank 0's side (the engine starts the other ranks)
        tp_size = check_parallel(config, self.device)
        self.tokenizer = load_tokenizer(config.model)
        self.model = load_model(config.model, self.dtype, self.device)
        if tp_size > 1:  # the other ranks load it too; every rank keeps its slices
            self.tp = TPLeader.start(config, self.model, self.device)
        try:
            self._build(config, t0)
        except BaseException:
            self.close()
            raise

    def _build(self, config: Config, t0: float) -> None:
        args = self.model.args
        sc, spec = config.scheduler, config.speculative
        # NOTE: speculation writes up to spec_width positions past a request's committed length, so the
        # req_to_token rows and the rope tables are that much longer; draft nodes past the context window only
        # lead to tokens past max_new_tokens, which are discarded, so the window itself is the same as without
        self.spec_version: Optional[str] = None  # v1 | v2 with a drafter
        if spec.name != "none":
            self.spec_version, reason = resolve_version(spec)
            if reason is not None:
                log.info("speculative.version=%s: running v1, %s", spec.version, reason)
        self.spec_width = {None: 0, "v1": spec_kv_width, "v2": v2_kv_width}[self.spec_version]
        if self.spec_width:
            self.spec_width = self.spec_width(spec)
        self.max_context = min(sc.max_context, args.max_position_embeddings)
        self.model.init_rope(self.max_context + self.spec_width)
        num_tokens = config.kv.max_total_tokens or sc.max_running_requests * (self.max_context + self.spec_width)
        if num_tokens < self.max_context + self.spec_width:
            raise ConfigError(f"kv.max_total_tokens={num_tokens} is not allowed; one full-length request needs "
                              f"{self.max_context + self.spec_width} tokens")
        self.allocator = KVAllocator(num_tokens, config.kv.page_size, sc.max_running_requests,
                                     self.max_context + self.spec_width, self.device, config.kv.prefix_cache)
        scratch = DRAFTERS.get(spec.name).pool_scratch_rows(spec) if spec.name != "none" else 0
        if scratch and getattr(args, "model_type", "llama") != "llama":
            raise ConfigError(f"speculative.skip_search=true is not allowed for model type "
                              f"{args.model_type!r}; it runs on Llama-family models")
        self.pool = self.model.kv_pool(self.allocator.num_slots, self.dtype, self.device,
                                       **({"scratch_rows": scratch} if scratch else {}))
        attention_args = getattr(self.model, "attention_args", args)  # (a tensor-parallel rank's share of heads)
        self.backend = build_backend(config.attention.name, self.pool, self.allocator, attention_args)
        if config.model.deterministic:  # batch-invariant kernels on the whole forward path (README)
            if not hasattr(self.model, "set_deterministic"):
                raise ConfigError(f"model.deterministic=true: not available for {config.model.name} "
                                  f"({type(self.model).__name__}); Llama-family models only")
            self.model.set_deterministic()
            self.backend.set_deterministic()
        mode = config.compile.mode
        compiled = mode == "reduce_overhead" or (mode == "auto" and self.device.type == "cuda")
        if compiled and self.device.type == "cuda":  # start from clean compile state (framework/compile_state.py)
            compile_state.claim(self)
        batch_sizes = [b for b in config.compile.batch_sizes if b < sc.max_running_requests]
        pdl = resolve_pdl(config.compile.pdl, self.device)
        compile_extend = compiled and self.device.type == "cuda" and config.compile.prefill and \
            self.backend.compiles_extend
        runner_settings = dict(compiled=compiled, batch_sizes=batch_sizes + [sc.max_running_requests],
                               skip_guards=config.compile.skip_guards, pdl=pdl, compile_extend=compile_extend,
                               regional=resolve_regional(config.compile.regional, compiled, self.model),
                               extend_graph_tokens=config.compile.prefill_graph_tokens if compile_extend else 0)
        self.runner = ModelRunner(self.model, self.backend, device=self.device, **runner_settings)
        if self.tp is not None:  # the other ranks build the same pool (their KV heads) and runner, then follow
            self.tp.setup(dict(num_tokens=num_tokens, page_size=config.kv.page_size,
                               max_requests=sc.max_running_requests, width=self.max_context + self.spec_width,
                               rope_positions=self.max_context + self.spec_width, attention=config.attention.name,
                               **runner_settings))
            self.runner.tp = self.tp
        eos = set(config.model.eos_token_ids) or {self.tokenizer.eos_token_id}
        self.eos_ids = {e for e in eos if e is not None}
        self.scheduler = Scheduler(sc, self.allocator, self.eos_ids, self.new_detokenizer, self.device,
                                   reserve_tokens=max(1, self.spec_width))
        self.overlap = resolve_overlap(sc.overlap, self.device, self.spec_version)
        self._inflight: Optional[Launched] = None  # the launched step whose tokens the host has not taken yet
        if self.runner.stages_inputs:  # decode batches go straight into the CUDA graphs' static buffers
            self.scheduler.stage_inputs = self.runner.stage
        self.drafter = DRAFTERS.build(spec.name, self, spec)
        if self.drafter is not None and self.drafter.own_kv:  # its pool may lag: cache only what it holds too
            self.scheduler.prefix.kv_valid_len = self.drafter.kv_valid_len
            self.scheduler.prefix.share_at_launch = self.spec_version == "v2"  # (v1 fills it in on_prefill)
        worker = SpecV2Worker if self.spec_version == "v2" else SpecWorker
        self.spec_worker = worker(self, self.drafter, spec) if self.drafter is not None else None
        if self.spec_version != "v2":  # (v2 runs every decode step as its own iterations: no plain decode forward)
            self.runner.warmup(ForwardMode.DECODE, 1)
        warmup_extend(self.runner, [[5], [40], [3, 4], [20, 30]])
        warmup_extend_graphs(self.runner, sc.max_running_requests, sc.mixed_prefill)
        if self.spec_version == "v1":
            for width in self.drafter.verify_widths(spec):
                self.runner.warmup(ForwardMode.TARGET_VERIFY, width)
            self.drafter.warmup()
        elif self.spec_version == "v2":
            self.drafter.warmup()
            self.spec_worker.warmup()
        self.stats = EngineStats()
        heap.settle(self.device)  # the start-up heap out of the collector's scans while serving (framework/heap.py)
        self.startup_s = time.perf_counter() - t0
        log.info("engine ready in %.1fs: %s on %s/%s%s, %d KV slots, page_size %d, prefix_cache=%s, compile=%s, "
                 "overlap=%s%s", self.startup_s, config.model.name, self.device, self.dtype,
                 f", tensor_parallel_size={self.tp.size}" if self.tp is not None else "", self.allocator.num_slots,
                 config.kv.page_size, "on" if config.kv.prefix_cache else "off",
                 "reduce_overhead" if compiled else "eager", "on" if self.overlap else "off",
                 f", speculative={spec.name} {self.spec_version}" if self.spec_version else "")

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do for one process) and give up torch's compile state to the next
        engine (framework/compile_state.py); the engine cannot run afterwards."""
        compile_state.release(self)
        heap.thaw()
        if self.tp is not None:
            self.tp.close()

    # ---- requests -------------------------------------------------------------------------------------
    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def new_detokenizer(self) -> IncrementalDetokenizer:
        """A detokenizer for one request whose text is needed while it grows (stop strings, streaming)."""
        return IncrementalDetokenizer(self.tokenizer)

    def make_request(self, item: dict[str, Any], rid: Any = None) -> Request:
        """Validate and tokenize one request dict (``prompt`` or ``messages`` plus sampling fields).
        Raises :class:`RequestError` with a one-line reason."""
        return parse_request(item, rid, self.tokenizer, self.model.args.vocab_size, self.max_context,
                             self.config.sampling)

    def submit(self, req: Request) -> None:
        self.scheduler.add(req)

    def abort(self, rid: Any) -> Optional[Request]:
        return self.scheduler.abort(rid)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def output(self, req: Request) -> RequestOutput:
        text = self.detokenize(req.output_ids)
        if req.stop_text_len is not None:
            text = text[: req.stop_text_len]
        spec = None
        if self.spec_worker is not None:
            steps = req.spec_verify_steps
            spec = {"num_verify_steps": steps,
                    "mean_accept_len": round(req.spec_accepted_tokens / steps, 4) if steps else 0.0}
        return RequestOutput(id=req.rid, text=text, token_ids=list(req.output_ids),
                             finish_reason=req.finish_reason or "abort", num_prompt_tokens=len(req.prompt_ids),
                             spec=spec, num_cached_tokens=req.num_cached_tokens)

    # ---- the loop -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Run one forward (prefill or decode) and return the requests that finished.

        With ``scheduler.overlap`` the forward is launched before the previous step's tokens are taken from the
        device: the requests returned are those that finished in the previous step, and the host's work on them
        (stop checks, detokenization, the caller's streaming and admission) runs while the GPU computes."""
        finished: list[Request] = []
        step = self.scheduler.schedule(allow_preempt=self._inflight is None)
        if step is None and self._inflight is not None:  # nothing can be planned before its tokens arrive
            finished = self.drain()
            step = self.scheduler.schedule()
        if step is not None:
            if self.stats.first_admit_s is None:
                self.stats.first_admit_s = time.perf_counter()
            if step.mode is ForwardMode.DECODE and self.spec_version == "v1":
                finished += self.spec_worker.step(step)  # (never overlapped: see resolve_overlap)
            elif self.overlap:
                launched = self.launch_step(step)
                finished += self.drain()
                self._inflight = launched
            else:
                finished += self.complete(self.launch_step(step))
        if finished:
            self.stats.last_finish_s = time.perf_counter()
        return finished

    def drain(self) -> list[Request]:
        """Apply the launched step whose tokens the host has not taken yet (overlap); returns the requests that
        finished in it. Afterwards the host's view of every request is exact."""
        launched, self._inflight = self._inflight, None
        return self.complete(launched) if launched is not None else []

    def launch_step(self, step: ScheduledStep) -> "Launched | SpecLaunched":
        """Queue a step: a v2 speculative iteration for a decode step, else :meth:`launch`."""
        if step.mode is ForwardMode.DECODE and self.spec_version == "v2":
            return self.spec_worker.launch(step)
        return self.launch(step)

    def launch(self, step: ScheduledStep) -> Launched:
        """Queue the step's target forward and sampling on the device and commit its positions; the sampled
        tokens go to ``runner.next_tokens`` (for the next step's inputs) and, without blocking, to the host."""
        batch = self.scheduler.build_batch(step)
        logits, hidden = self.runner.forward(batch)
        greedy = self.runner.take_greedy()  # (sampled inside the compiled graph, where it was)
        if greedy is not None and batch.sampling.all_greedy:
            # NOTE: graph memory, valid until the next replay: read below before any; a drafter's prefill hooks may
            # replay graphs of their own before they read it, so they get a copy
            tokens = greedy if self.spec_worker is None else greedy.clone()
        else:
            tokens = sample(logits, batch.sampling)
        self.runner.next_tokens[batch.req_pool_indices] = tokens
        if step.mode is ForwardMode.EXTEND and self.spec_worker is not None:
            self.spec_worker.on_extend_launch(step, batch, hidden, tokens)
        self.scheduler.commit_launch(step)
        return Launched(step, batch, AsyncCopy(tokens), hidden if self.drafter is not None else None)

    def complete(self, launched: "Launched | SpecLaunched") -> list[Request]:
        """Take a launched step's tokens (waiting for them if they are not there yet) and apply them."""
        if isinstance(launched, SpecLaunched):
            return self.spec_worker.complete(launched)
        step, tokens = launched.step, launched.tokens.numpy().tolist()
        if step.mode is ForwardMode.EXTEND and self.spec_version == "v1":
            # the root of a request whose prefill completes: the sampled token, or after a preemption's
            # re-prefill its last generated token
            roots = [token if gets else (r.output_ids[-1] if r.prefilled else None)
                     for r, gets, token in zip(step.reqs, step.samples, tokens)]
            self.drafter.on_prefill(launched.batch, step, launched.hidden, roots)
        return self.scheduler.process(step, tokens)

    def plain_step(self, step: ScheduledStep) -> list[Request]:
        """One target forward for the step (prefill or decode), sample, apply; returns finished requests."""
        return self.complete(self.launch(step))

    def generate(self, items: Iterable[dict[str, Any]],
                 on_finish: Optional[Callable[[RequestOutput], None]] = None) -> list[RequestOutput]:
        """Generate for every item; one output per item, in order. Bad items get finish_reason "error"."""
        outputs: list[Optional[RequestOutput]] = []
        pending: dict[int, int] = {}  # id(Request) -> output position
        for i, item in enumerate(items):
            try:
                req = self.make_request(item, rid=item.get("id", i) if isinstance(item, dict) else i)
            except RequestError as err:
                out = RequestOutput(id=item.get("id", i) if isinstance(item, dict) else i, text="", token_ids=[],
                                    finish_reason="error", num_prompt_tokens=0, error=str(err))
                outputs.append(out)
                if on_finish:
                    on_finish(out)
                continue
            pending[id(req)] = len(outputs)
            outputs.append(None)
            self.submit(req)
        while self.has_work():
            for req in self.step():
                out = self.output(req)
                outputs[pending.pop(id(req))] = out
                if on_finish:
                    on_finish(out)
        return outputs  # type: ignore[return-value]
