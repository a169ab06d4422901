"""``speculative.adaptive=true`` in speculation v2: each iteration's verify width, chosen on the host, run from
programs captured at start-up for every width.

An iteration that drafts ``k`` deep (``k`` in ``0 .. num_steps``) verifies ``q = k + 1`` tokens per request: the
root and ``k`` drafts; ``k = 0`` is a plain decode step (the root alone, whose bonus token is the target's next
token). The host's :class:`~framework.speculative.adaptive.DraftLengthController` picks ``k`` for the batch when
:class:`~framework.speculative.worker_v2.SpecV2Worker` launches an iteration, from what it has learnt so far:
iteration N's accept lengths and cost reach the host while N+1 runs, so the choice lags one iteration behind. The
cost of an iteration is, on CUDA, the longer of its GPU time (its CUDA events, from drafting to the end of
acceptance) and the host's own time per iteration at that batch size (:class:`HostClock`, averaged over every depth:
it does not depend on the depth, and where it bounds the loop the depth that emits the most tokens wins, not one whose
noisy host time came out lower), and its wall time on the CPU (where launching it computes it). The KV contract does not change with the width: slots are
assigned through the largest width, ``num_steps + 1``, so a pending iteration of any width is covered.

The prepare-and-verify program, which holds the model, is a program per width (:func:`width_programs`):
compiled, a function per width whose code object is its own. Dynamo keeps compiled entries, recompile limits and automatic-dynamic state per code object: one function
called at several widths turns the width into a symbolic size at the second width seen (observed on torch 2.13 for
an int held in a closure), and widths x batch sizes x greedy / sampling would share one recompile limit, past which
dynamo silently runs the function eagerly. With a code object per width each width compiles with its width a
constant, one entry per batch-size family, as a fixed-width worker does. Start-up records every width at every
captured batch size (:func:`capture_widths`, under :func:`loud_recompile_limit`: start-up fails rather than leave a
program to run eagerly if a limit is reached anyway). The finishes, small programs, are compiled once for every
width (:func:`any_width_program`: the width a dynamic dimension, marked before the first call), which on the CPU
probe took the adaptive engine's compiles from 20 to 16.
"""

from __future__ import annotations

import contextlib
import types
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
import torch

from framework.batch import ForwardMode, SamplingBatch
from framework.config import SpeculativeConfig
from framework.kv import DUMMY_ROW
from framework.scheduler import ScheduledStep
from framework.transfer import upload

if TYPE_CHECKING:
    from framework.speculative.worker_v2 import SpecV2Worker


def iteration_widths(cfg: SpeculativeConfig) -> list[int]:
    """The verify widths (tokens per request) a v2 worker runs: ``1 .. num_steps + 1`` with ``adaptive``, else
    ``num_steps + 1``."""
    return list(range(1, cfg.num_steps + 2)) if cfg.adaptive else [cfg.num_steps + 1]


def program_for_width(fn: Callable, q: int, pass_width: bool) -> Callable:
    """``fn(*args, q)`` (``fn(*args)`` without ``pass_width``) under a code object of its own, named for ``q``."""

    def program(*args: Any) -> Any:
        return fn(*args, q) if pass_width else fn(*args)

    name = f"{getattr(fn, '__name__', 'program')}_q{q}"
    code = program.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=name)
    return types.FunctionType(code, program.__globals__, name, None, program.__closure__)


def width_programs(fn: Callable, widths: list[int], compiled: bool, pass_width: bool) -> dict[int, Callable]:
    """width -> ``fn`` for iterations of that width: ``fn(*args, width)`` where ``pass_width`` (else the width is in
    the arguments' shapes); compiled (``torch.compile(mode="reduce-overhead", fullgraph=True)``) a program per width
    with a code object of its own."""
    if not compiled:
        return {q: (lambda *args, q=q: fn(*args, q)) if pass_width else fn for q in widths}
    return {q: torch.compile(program_for_width(fn, q, pass_width), mode="reduce-overhead", fullgraph=True)
            for q in widths}


def any_width_program(fn: Callable, compiled: bool) -> Callable:
    """``fn`` for iterations of every width: compiled (``torch.compile(mode="reduce-overhead", fullgraph=True)``)
    once, with the width a dynamic dimension of its inputs (:func:`mark_any_width`). For programs that do not hold
    the model (speculation v2's finishes): dynamo compiles them once for widths of 3 and more at batch sizes of 2 and
    more, and again where a size of 1 appears (width 1, a width-2 iteration's one draft column, batch size 1: it
    specialises sizes of 1): 4 compiles where a program per width compiled one or two per width."""
    return torch.compile(fn, mode="reduce-overhead", fullgraph=True) if compiled else fn


def mark_any_width(batch: list[Optional[torch.Tensor]], width: list[Optional[torch.Tensor]]) -> None:
    """Mark the batch dimension (0) of ``batch`` and the width dimension (1) of ``width`` dynamic (Nones skipped):
    an :func:`any_width_program`'s inputs, before each call."""
    for dim, tensors in ((0, batch), (1, width)):
        for t in tensors:
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, dim)


def loud_recompile_limit() -> contextlib.AbstractContextManager:
    """A context in which dynamo raises when a function reaches its recompile limit, instead of running it eagerly
    from then on (start-up: every program is compiled there)."""
    cfg = torch._dynamo.config
    for name in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
        if hasattr(cfg, name):
            return cfg.patch(**{name: True})
    return contextlib.nullcontext()


def capture_widths(worker: "SpecV2Worker", cases: list[tuple[bool, bool]]) -> None:
    """Start-up: run the worker's iteration for every width and captured batch size with dummy requests only, once
    per ``(greedy, top-k / top-p)`` case, so that each program compiles and records its CUDA graphs here; a
    recompile limit reached here fails start-up."""
    dev = worker.device
    with loud_recompile_limit():
        # the widest first: an any-width program's first compile must not meet a batch size equal to the width
        # (dynamo would give the two one symbol, and compile again for the first batch where they differ)
        for q in sorted(worker.widths, reverse=True):
            for padded_bs in sorted({worker.padded_size(b, q) for b in worker.engine.runner.batch_sizes}):
                rows = torch.full((padded_bs,), DUMMY_ROW, dtype=torch.int64, device=dev)
                zeros = torch.zeros(padded_bs, dtype=torch.int64, device=dev)
                for greedy, filtered in cases:
                    temps = torch.full((padded_bs,), 0.0 if greedy else 1.0, device=dev)
                    top_ps = torch.full_like(temps, 0.9 if filtered else 1.0)
                    sampling = SamplingBatch(temperatures=temps, top_ps=top_ps, top_ks=zeros, seeds=zeros,
                                             steps=zeros, all_greedy=greedy, need_top_k_top_p=filtered)
                    launched = worker._run(ScheduledStep(ForwardMode.DECODE, [], [], []), rows, [q] * padded_bs,
                                           sampling, q)
                    launched.result.numpy()
                    worker._inflight.remove(launched)


class ShadowAcceptance:
    """The acceptance of every draft depth, measured from drafts that are never verified (``speculative.adaptive``
    with a drafter that drafts on the device).

    Every iteration, plain steps included, a request without a pending shadow draft gets the full ``num_steps``
    chain its drafter proposes at its current length ``L`` (for positions ``L, L + 1, ...``). As the request learns
    those positions, each is compared with the target's token there, in order, until one differs or all agree: the
    draft is then settled (its first ``m`` tokens would have been accepted) and the next iteration drafts anew, where
    an iteration of the deepest drafts would have continued. A drafted position counts once, when it is first known
    and every position before it agreed: ``counts[i]`` (``i < num_steps``) such positions, ``counts[num_steps + i]``
    those that agreed too. So the chance that position ``i`` is accepted after ``0 .. i - 1`` were is measured
    from every draft that reached it, settled or not (greedy; with sampling, the chance that a sampled token equals
    the drafted one is the chance that rejection sampling accepts a one-token draft), also while the controller
    decodes plainly, without a verify spent on it. An iteration of the deepest drafts verifies the very chain a
    shadow draft would take there: its accept lengths are that draft's outcome (:meth:`verified`, on the host), and
    its program only drops the rows' pending drafts (:meth:`drop`) instead of comparing them, so the shadow costs
    nothing where the controller drafts deepest. Each iteration's counts per request (``row_counts[row]``, written
    in the iteration's graph) reach the host with the iteration's result (:meth:`per_row`); ``counts`` accumulates
    them over all requests on the device (the compared drafts only: not the verified ones).
    """

    def __init__(self, num_rows: int, depth: int, device: torch.device) -> None:
        self.depth = depth
        self.drafts = torch.full((num_rows, depth), -1, dtype=torch.int64, device=device)  # [rows, depth]; -1: none
        self.at = torch.full((num_rows,), -1, dtype=torch.int64, device=device)  # [rows] L of the draft; -1: none
        self.upto = torch.zeros(num_rows, dtype=torch.int64, device=device)  # [rows] positions already counted
        self.counts = torch.zeros(2 * depth, dtype=torch.int64, device=device)  # [2 * depth] cumulative
        self.row_counts = torch.zeros(num_rows, 2 * depth, dtype=torch.int64, device=device)  # the last update's
        if device.type == "cuda":  # read and written inside captured graphs
            for t in (self.drafts, self.at, self.upto, self.counts, self.row_counts):
                torch._dynamo.mark_static_address(t)

    def reset(self, rows: list[int]) -> None:
        """Rows that a new request takes (its prefill completes): no pending draft."""
        self.at[upload(np.asarray(rows, dtype=np.int64), self.at.device)] = -1  # (never waits for the device)

    def update(self, rows: torch.Tensor, tokens: torch.Tensor, lens: torch.Tensor, drafts: torch.Tensor,
               valid: torch.Tensor) -> None:
        """In the iteration's prepare (device): rows ``[bs]`` (padded with DUMMY_ROW), the token history ``[rows,
        width]``, lens ``[bs]`` the rows' known tokens, drafts / valid ``[bs, depth]`` the chain drafted now."""
        at, upto = self.at[rows], self.upto[rows]  # [bs]
        pos = torch.arange(self.depth, device=rows.device)[None, :]  # [1, depth]
        actual = tokens[rows[:, None], (at[:, None] + pos).clamp(0, tokens.shape[1] - 1)]  # [bs, depth]
        pending = (rows != DUMMY_ROW) & (at >= 0)
        known = torch.where(pending, (lens - at).clamp(0, self.depth), torch.zeros_like(at))  # [bs]
        agree = self.drafts[rows] == actual  # [bs, depth]
        # position i counts where it is newly known and positions 0 .. i - 1 agreed
        reached = torch.cumprod(torch.cat([torch.ones_like(agree[:, :1]), agree[:, :-1]], dim=1).to(torch.int64), 1)
        counted = (pos >= upto[:, None]) & (pos < known[:, None]) & reached.bool()  # [bs, depth]
        new = torch.cat([counted, counted & agree], dim=1).to(torch.int64)  # [bs, 2 * depth]
        self.counts += new.sum(dim=0)
        self.row_counts[rows] = new
        settled = pending & ((known == self.depth) | (counted & ~agree).any(dim=1))  # [bs]
        fresh = (rows != DUMMY_ROW) & ((at < 0) | settled)  # [bs] takes the chain drafted now
        self.drafts[rows] = torch.where(fresh[:, None], torch.where(valid, drafts, -1), self.drafts[rows])
        self.at[rows] = torch.where(fresh, lens, at)
        self.upto[rows] = torch.where(fresh, torch.zeros_like(known), known)

    def drop(self, rows: torch.Tensor) -> None:
        """In an iteration of the deepest drafts (device): rows ``[bs]`` have no pending draft any more (the verify
        measures the chain drafted now; the next shallower iteration drafts anew)."""
        self.at[rows] = -1

    @staticmethod
    def verified(accepted: np.ndarray, depth: int) -> np.ndarray:
        """Host: the counts ``[n, 2 * depth]`` of chains verified whole, from their accepted drafts ``[n]``: a chain
        that accepted ``m`` reached positions ``0 .. min(m, depth - 1)`` and agreed at ``0 .. m - 1``."""
        pos = np.arange(depth)[None, :]  # [1, depth]
        m = np.asarray(accepted, dtype=np.int64)[:, None]  # [n, 1]
        return np.concatenate([pos <= m, pos < m], axis=1).astype(np.int64)

    def per_row(self, rows: torch.Tensor) -> torch.Tensor:
        """In the iteration's finish (device): what the rows' last update counted, ``[bs * 2 * depth]`` (a row's
        positions reached, then those that agreed), for the iteration's result."""
        return self.row_counts[rows].reshape(-1)

    def split(self, tail: np.ndarray, padded_bs: int) -> np.ndarray:
        """Host: the end of an iteration's result -> its per-request counts ``[padded_bs, 2 * depth]``."""
        return tail[-padded_bs * 2 * self.depth:].reshape(padded_bs, 2 * self.depth)


class HostClock:
    """The host's own time per iteration, for the adaptive depth's costs on CUDA: from one iteration's launch to
    the next one's, less the time the host spent blocked on results in between (:meth:`waited`).

    An iteration's GPU time alone (its CUDA events) undercounts where the host limits the loop (a small model: the
    host's launch, result handling and scheduling take longer than the device's work), and there a plain step costs
    the user what a deeper verify does. The cost the controller takes is therefore ``max(GPU time, host time)``,
    the period of the overlapped loop at that depth (the host time averaged per batch size over every depth:
    :meth:`DraftLengthController.host_cost`). A stretch in which a prefill step was launched (:meth:`dirty`),
    or that began before anything was launched, gives no host time; an iteration without one of its own (the last
    before a prefill; without overlap, the host applies an iteration before it launches the next) takes the latest
    measured."""

    def __init__(self) -> None:
        self._t0: Optional[float] = None  # the last launch's start
        self._waited = 0.0
        self._clean = False
        self.latest: Optional[float] = None  # the latest host time measured

    def launch(self, t0: float) -> Optional[float]:
        """An iteration's launch starts at ``t0``: returns the host time of the previous one (None where unknown)."""
        host = max(0.0, t0 - self._t0 - self._waited) if self._clean and self._t0 is not None else None
        if host is not None:
            self.latest = host
        self._t0, self._waited, self._clean = t0, 0.0, True
        return host

    def waited(self, seconds: float) -> None:
        """The host was blocked on a result for ``seconds``."""
        self._waited += seconds

    def dirty(self) -> None:
        """Something other than an iteration was launched (a prefill step): the current stretch is not one."""
        self._clean = False

    def host_time(self, host_s: Optional[float]) -> Optional[float]:
        """An iteration's host time: its own, else the latest measured (None: none yet)."""
        return host_s if host_s is not None else self.latest
