"""``speculative.adaptive=true``: the draft length of each iteration, chosen for the batch by a goodput model.

For a batch of ``bs`` requests and a draft depth ``k`` (0 = a plain decode step), ``E(k)`` is the tokens a request
emits per iteration. Without shadow acceptance ``E(k) = 1 + r_1 + ... + r_k``, with ``r_d`` the measured fraction of
requests that accepted at least ``d`` draft tokens in iterations that drafted ``d`` deep (requests without a draft
count as misses). With shadow acceptance (speculation v2's drafters on the device: ``adaptive_v2.ShadowAcceptance``)
every depth is measured in every iteration, plain steps included, from drafts that are never verified:
``P(m >= d)``, the chance that a draft's first ``d`` tokens would be accepted, is the product of the measured chances
that position ``i`` agrees with the target's token given that the positions before it did (``i < d``; a position not
yet reached takes the last measured one's chance). Those drafts are made where the previous one settled, which is
where iterations of the deepest drafts (``K``) would start; an iteration of depth ``k`` emits ``1 + min(m, k)`` and
a policy visits a stretch of positions in proportion to ``1 / (1 + min(m, k))``, so the drafts are reweighted to
depth ``k``'s iterations: ``E(k) = sum_m P(m) w_m / sum_m P(m) w_m / (1 + min(m, k))`` with ``w_m = 1 + min(m, K)``
(``E(K) = 1 + r_1 + ... + r_K``; where half the positions copy ``K`` deep and half nothing, depth 1 emits 1.33 an
iteration, not the 1 + 1/7 of depth ``K``'s positions). Until a first position is measured, ``E(k) = 1``. The
chances are those of the batch's own requests: each request's counts (decayed per draft it starts, so a request
that stops copying is seen to) are pooled over the batch, and each position's chance is drawn towards the shared
estimate over all requests by ``prior`` positions' worth (a new request, or one with few drafts, takes the shared
one). A batch's mix changes as requests finish: the last requests of a batch can accept nothing where the first
ones copied whole drafts, and a shared estimate, which weighs every request of the busy start, would keep drafting
deep for them.

The cost ``T(bs, k)`` is the measured time of such iterations (an exponential average per batch size and depth):
on CUDA the longer of their GPU time and the host's own time per iteration at that batch size (averaged over every
depth: the host's work does not depend on the depth, so where it bounds the loop the deeper drafts cost nothing more).
The controller takes the ``k`` with the most tokens per second, ``E(k) / T(bs, k)``, recomputed every ``REFRESH``
iterations of the same batch (sooner where a new depth or batch size was measured or an exploration is due).

Costs not measured: at a batch size with two or more depths measured, interpolated between the measured depths
around ``k``, or extrapolated linearly from the deepest two (never falling with depth). Else each depth takes the
nearest measured batch size's cost, scaled by the two batch sizes' costs at a depth measured at both, then
interpolated as above. A cost's second sample replaces its first (which may be a cold run of a new shape).

The first iterations measure two depths. Without shadow acceptance: the deepest first (it measures the acceptance
of every position at once), then plain steps. With it: plain steps first (they cost what plain decoding costs, and
their unverified drafts measure acceptance), then depth 1, the cheapest verify; and the first iteration at any batch
size with no plain step measured within 1.25x of it is a plain step (it anchors the costs scaled from other batch
sizes, where a verify of a few tokens may have cost what a plain step did; a nearer batch size's costs serve as
they are).

Every so often the controller explores: a depth measured fewer than twice, the nearest to its choice first
(interpolated costs can be wrong: on a CPU, verifying 2-4 drafts cost about what verifying 1 did), else a
neighbour of its choice, one deeper and one shallower in turn, so the acceptance one position past the choice and
the costs around it stay current as the workload changes (both decay) and the choice can climb or fall a depth at
a time. Explorations start ``explore_every`` iterations apart and the gap doubles, up to ``max_explore_gap``, while
the choice holds; a new choice resets it. Exploring costs little: a neighbour's iteration is never far from the
best one, and rarely run where the choice is stable (trying every depth in turn at a fixed rate spent whole
iterations at the deepest drafts where speculation did not pay). With shadow acceptance, where every depth's
acceptance is measured without verifying it, only costs are explored, and only where they could matter: a depth
whose cost's lower bound (a shallower depth's cost, also one scaled from another batch size) already loses, or a
neighbour whose estimated rate is far below the choice's, is not run; and a depth measured fewer than twice whose
lower bound already pays clearly (an extrapolated cost can be far too high) is run at once.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from framework.speculative.adaptive_costs import IterationCosts

# with shadow acceptance: a depth measured once is taken to cost at least this share of its measurement (a cold run
# may be slower), and a neighbour of the choice is explored only if its estimated rate is at least this share of the
# choice's (on open-ended prompts, where a draft is accepted one time in a hundred, the CPU lost 4-6% to plain
# decoding at batch 32-64 while depth 1 was explored in 10-14 of 70-133 iterations)
COLD_SLACK = 0.8
NEIGHBOUR_MARGIN = 0.75
# with shadow acceptance: a depth measured fewer than twice is tried at once, not at the next exploration, where even
# its cost's lower bound gives this many times the choice's rate (a noisy cost of depth 3 extrapolated to depths 4-5
# kept suffix chains at depth 2 for 364 iterations of requests that copied whole drafts)
PROMISE = 1.15
# with shadow acceptance: a batch size without a plain step measured within this factor of it starts with one (as
# requests finish, a batch of 64 passes through dozens of sizes, and a plain step at each would anchor costs that a
# neighbouring size's serve as well)
NEAR_BATCH = 1.25
# the model's choice for a batch (its size and rows) is recomputed every this many iterations, and at once where a
# depth's cost was measured for the first or second time at a batch size, a row was forgotten or an exploration is
# due; in between the choice stands (a choice cost 32 us of Python at batch 8 on the CPU machine, 6 us with this:
# bench/step_host_cost.py; where the host bounds a small model's loop, that is on the critical path)
REFRESH = 8


class DraftLengthController:
    """Chooses ``k`` in ``0 .. max_depth`` per iteration; :meth:`record` feeds back what the iteration gave."""

    def __init__(self, max_depth: int, explore_every: int = 16, decay: float = 0.995, cost_alpha: float = 0.2,
                 max_explore_gap: int = 256, shadow: bool = False, request_decay: float = 0.95,
                 prior: float = 4.0) -> None:
        self.max_depth = max_depth
        self.shadow = shadow  # acceptance also from unverified drafts (record's ``shadow``)
        self.explore_every = explore_every
        self.max_explore_gap = max_explore_gap
        self.decay = decay
        self.seen = [0.0] * (max_depth + 1)  # [d]: requests verified with drafts d deep (decayed)
        self.hits = [0.0] * (max_depth + 1)  # [d]: those that accepted at least d draft tokens
        self.shadow_reached = np.zeros(max_depth)  # [i]: unverified drafts whose position i was compared (decayed)
        self.shadow_agreed = np.zeros(max_depth)  # [i]: those whose position i agreed
        m = np.arange(max_depth + 1)
        # [k, m]: draft positions a depth-K iteration stands for, per iteration of depth k, when m drafts agree
        self._visits = (1 + m)[None, :] / (1 + np.minimum(m[None, :], m[:, None]))
        # per request, by its row: [row, 2 * max_depth] the same counts of its own drafts (reached, then agreed),
        # decayed by request_decay per draft it starts; prior: how many positions the shared estimate weighs as
        self.request_decay, self.prior = request_decay, prior
        self._rows = np.zeros((0, 2 * max_depth))
        self._costs = IterationCosts(max_depth, cost_alpha)
        self.iterations = 0
        self.explorations = 0
        self._best: int | None = None  # the model's last choice
        self._cached: Optional[tuple[tuple, int, int]] = None  # ((bs, rows), iteration, choice) while it stands
        self._stale = True  # something that can move the choice much changed since it was computed
        self._gap = explore_every  # iterations between explorations: doubles while the choice holds
        self._next_explore = explore_every

    @property
    def cost(self) -> dict[tuple[int, int], float]:
        """(bs, k) -> the measured seconds per iteration."""
        return self._costs.cost

    def expected_tokens(self, k: int, rows: Optional[Sequence[int]] = None) -> float:
        """E(k): tokens a request emits per iteration at depth ``k`` (:meth:`expected_tokens_by_depth`)."""
        return self.expected_tokens_by_depth(rows)[k]

    def expected_tokens_by_depth(self, rows: Optional[Sequence[int]] = None) -> list[float]:
        """E(k) for k = 0 .. max_depth. With shadow acceptance as above; ``rows``: of the batch of these requests
        (their own drafts' counts pooled, each position's chance drawn towards the shared estimate's by ``prior``
        positions). Else ``r_d`` is capped by ``r_(d-1)`` (accepting d drafts means accepting d - 1), also where it
        was measured longer ago; unmeasured: optimistic, ``r_(d-1)``."""
        top = self.max_depth
        if self.shadow:
            if self.shadow_reached[0] <= 0:
                return [1.0] * (top + 1)
            chances, chance = np.empty(top), 1.0  # [i]: position i agrees, given that 0 .. i - 1 did
            for i, (reached, agreed) in enumerate(zip(self.shadow_reached.tolist(), self.shadow_agreed.tolist())):
                chance = agreed / reached if reached > 0 else chance
                chances[i] = chance
            counted = [] if rows is None else [r for r in rows if r < self._rows.shape[0]]  # (others: none yet)
            if counted:
                pooled = self._rows[counted].sum(axis=0)  # [2 * K]
                chances = (pooled[top:] + self.prior * chances) / (pooled[:top] + self.prior)
            at_least = np.concatenate([[1.0], np.cumprod(chances)])  # P(m >= d), d = 0 .. K
            exactly = at_least - np.append(at_least[1:], 0.0)  # P(m)
            tokens = exactly @ np.arange(1.0, top + 2)  # per draft position at depth K's
            return (tokens / (self._visits @ exactly)).tolist()
        out, total, rate = [1.0], 1.0, 1.0
        for d in range(1, top + 1):
            rate = min(rate, self.hits[d] / self.seen[d] if self.seen[d] > 0 else 1.0)
            total += rate
            out.append(total)
        return out

    def choose(self, bs: int, rows: Optional[Sequence[int]] = None, tokens: Optional[Sequence[float]] = None) -> int:
        """The depth of the next iteration of ``bs`` requests (``rows``: theirs, for their own acceptance);
        ``tokens``: E(k) from the drafter's own estimate (with ``shadow``: suffix trees' verify widths, whose levels
        ``k`` stand for depths here) instead of the measured acceptance."""
        self.iterations += 1
        key, cached = (bs, None if rows is None else tuple(rows)), self._cached
        if tokens is None and cached is not None and not self._stale and cached[0] == key and \
                self.iterations - cached[1] < REFRESH and \
                (self.explore_every <= 0 or self.iterations < self._next_explore):
            return cached[2]
        self._cached = None
        for k in (0, 1) if self.shadow else (self.max_depth, 0):  # (the first probes: the module's docstring)
            if self.measured_cost(bs, k) is None:
                return k
        if self.shadow and not self._costs.plain_near(bs, NEAR_BATCH):
            return 0
        costs = self.costs(bs)
        tokens = self.expected_tokens_by_depth(rows) if tokens is None else list(tokens)
        best = max(range(self.max_depth + 1), key=lambda k: tokens[k] / costs[k])
        self._cached, self._stale = (key, self.iterations, best), False
        if self.explore_every <= 0:
            return best
        rate = tokens[best] / costs[best]
        sampled = self._costs.depth_samples
        if self.shadow:  # a depth barely measured that would pay clearly even at its cost's lower bound: try it now
            promising = [k for k in range(self.max_depth + 1)
                         if k != best and sampled[k] < 2 and self._could_pay(bs, k, tokens[k], PROMISE * rate)]
            if promising:
                self.explorations += 1
                return min(promising, key=lambda k: (abs(k - best), k))
        if best != self._best:  # a new choice: explore around it at the base rate again
            self._best, self._gap = best, self.explore_every
            self._next_explore = self.iterations + self._gap
        if self.iterations < self._next_explore:
            return best
        self._gap = min(2 * self._gap, self.max_explore_gap)
        self._next_explore = self.iterations + self._gap
        self.explorations += 1
        unsure = [k for k in range(self.max_depth + 1) if sampled[k] < 2 and self._could_pay(bs, k, tokens[k], rate)]
        if unsure:  # an interpolated or a single (cold) cost may hide a better depth: the one nearest the choice
            return min(unsure, key=lambda k: (abs(k - best), k))
        deeper = self.explorations % 2 == 1
        near = best + 1 if best == 0 or (deeper and best < self.max_depth) else best - 1
        if self.shadow and tokens[near] / costs[near] < NEIGHBOUR_MARGIN * rate:
            return best  # (its acceptance is measured anyway; its cost would have to be far off to pay)
        return near

    def _could_pay(self, bs: int, k: int, tokens: float, rate: float) -> bool:
        """Whether depth ``k`` (``tokens`` per request an iteration) could beat ``rate`` tokens per second. With shadow
        acceptance only its cost is unsure: a verify of more drafts costs at least what a shallower depth does
        (measured at this batch size or scaled from another, :meth:`measured_cost`), plus, where two verify depths
        below ``k`` were measured, the least slope between measured neighbours over the depths past the deepest (a
        verify's cost does not grow more slowly with its drafts further on; from a plain step to a verify it may
        jump, so depth 0 gives no slope), and a depth measured once (perhaps cold) at least ``COLD_SLACK`` of that
        cost. Where even the lower bound loses, exploring ``k`` is an iteration spent for nothing (open-ended
        prompts, where no depth pays; on a CPU, deep verifies of a large batch)."""
        if not self.shadow:
            return True
        below = {d: c for d in range(k) if (c := self.measured_cost(bs, d)) is not None}
        bounds = list(below.values())
        verifies = sorted(d for d in below if d >= 1)
        if len(verifies) >= 2:  # (the least slope between neighbours: one noisy cost does not make it steep)
            slope = min((below[b] - below[a]) / (b - a) for a, b in zip(verifies, verifies[1:]))
            bounds.append(below[verifies[-1]] + max(0.0, slope) * (k - verifies[-1]))
        if (measured := self.measured_cost(bs, k)) is not None:
            bounds.append(COLD_SLACK * measured)
        if bounds and (host := self.host_cost(bs)) is not None:
            bounds.append(host)
        return not bounds or tokens / max(bounds) > rate

    def measured_cost(self, bs: int, k: int) -> float | None:
        """T(bs, k) measured (:meth:`IterationCosts.measured`)."""
        return self._costs.measured(bs, k)

    def costs(self, bs: int) -> list[float | None]:
        """T(bs, k) for every depth (:meth:`IterationCosts.estimate`)."""
        return self._costs.estimate(bs)

    def host_cost(self, bs: int) -> float | None:
        """The host's own seconds per iteration of ``bs`` requests (:meth:`IterationCosts.host`)."""
        return self._costs.host(bs)

    def estimated_cost(self, bs: int, k: int) -> float | None:
        """T(bs, k) as :meth:`costs` gives it."""
        return self.costs(bs)[k]

    def forget(self, rows: Sequence[int]) -> None:
        """New requests take these rows: their counts start from nothing."""
        rows = [r for r in rows if r < self._rows.shape[0]]
        self._rows[rows] = 0.0
        self._stale = True

    def record(self, bs: int, k: int, emitted: list[int], seconds: float,
               shadow: Optional[np.ndarray] = None, rows: Optional[Sequence[int]] = None,
               host_s: Optional[float] = None) -> None:
        """An iteration of ``bs`` requests at depth ``k`` emitted ``emitted[b]`` tokens each in ``seconds`` (on CUDA
        its GPU time; ``host_s``: the host's own time for it, where measured: a depth costs the longer of its GPU
        time and the batch size's host time, which does not depend on the depth); ``shadow`` ``[n, 2 * max_depth]``:
        per request, the unverified drafts whose position ``i`` was compared in the iteration, then those that
        agreed there; ``rows`` ``[n]``: those requests' rows (their own counts)."""
        if self._costs.record(bs, k, seconds, host_s):
            self._stale = True
        if self.shadow:
            top = self.max_depth
            counts = np.zeros((0, 2 * top)) if shadow is None else np.asarray(shadow, dtype=float).reshape(-1, 2 * top)
            total = counts.sum(axis=0)  # [2 * K]
            self.shadow_reached = self.shadow_reached * self.decay + total[:top]
            self.shadow_agreed = self.shadow_agreed * self.decay + total[top:]
            if rows is not None and len(rows):
                if max(rows) >= self._rows.shape[0]:
                    grown = np.zeros((max(max(rows) + 1, 2 * self._rows.shape[0]), 2 * top))
                    grown[: self._rows.shape[0]] = self._rows
                    self._rows = grown
                index = list(rows)
                fade = self.request_decay ** counts[:, 0]  # [n] per draft a request started comparing
                self._rows[index] = self._rows[index] * fade[:, None] + counts
            return
        if k == 0:
            return
        for d in range(1, self.max_depth + 1):
            self.seen[d] *= self.decay
            self.hits[d] *= self.decay
        for d in range(1, k + 1):
            self.seen[d] += len(emitted)
            self.hits[d] += sum(1 for n in emitted if n - 1 >= d)


def record_iteration(controller: DraftLengthController, draft_lengths: dict[int, int], bs: int, k: int,
                     emitted: list[int], seconds: float, shadow: Optional[np.ndarray] = None,
                     rows: Optional[Sequence[int]] = None, reported: Optional[int] = None,
                     host_s: Optional[float] = None) -> None:
    """What an iteration of ``bs`` requests drafted ``k`` deep gave (``emitted[b]`` tokens each, bonus included, in
    ``seconds``; ``shadow``, ``rows``, ``host_s``: :meth:`DraftLengthController.record`'s), for the controller's
    next choices; ``draft_lengths`` (the metrics' ``chosen_draft_lengths``: depth, or ``reported``, -> iterations)
    counts it."""
    controller.record(bs, k, emitted, seconds, shadow, rows, host_s)
    key = k if reported is None else reported
    draft_lengths[key] = draft_lengths.get(key, 0) + 1
