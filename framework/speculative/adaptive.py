"""``speculative.adaptive=true``: the draft length of each iteration, chosen for the batch by a goodput model.

For a batch of ``bs`` requests and a draft depth ``k`` (0 = a plain decode step) the expected tokens a request
emits are ``E(k) = 1 + r_1 + ... + r_k``, with ``r_d`` the measured fraction of requests that accepted at least
``d`` draft tokens in iterations that drafted ``d`` deep (requests without a draft count as misses); the cost
``T(bs, k)`` is the measured wall time of such iterations (an exponential average per batch size and depth). The
controller takes the ``k`` with the most tokens per second, ``E(k) / T(bs, k)``. A batch size not measured at a
depth takes the nearest measured batch size's cost; depths never measured are tried once each, and every
``explore_every``-th iteration tries the depths in turn, so acceptance at the deeper positions and the cost of
every depth stay current as the workload changes (both decay).
"""

from __future__ import annotations


class DraftLengthController:
    """Chooses ``k`` in ``0 .. max_depth`` per iteration; :meth:`record` feeds back what the iteration gave."""

    def __init__(self, max_depth: int, explore_every: int = 16, decay: float = 0.995, cost_alpha: float = 0.2) -> None:
        self.max_depth = max_depth
        self.explore_every = explore_every
        self.decay = decay
        self.cost_alpha = cost_alpha
        self.seen = [0.0] * (max_depth + 1)  # [d]: requests verified with drafts d deep (decayed)
        self.hits = [0.0] * (max_depth + 1)  # [d]: those that accepted at least d draft tokens
        self.cost: dict[tuple[int, int], float] = {}  # (bs, k) -> seconds per iteration
        self.iterations = 0

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens a request emits per iteration at depth ``k`` (unmeasured depths: optimistic 1)."""
        return 1.0 + sum(self.hits[d] / self.seen[d] if self.seen[d] > 0 else 1.0 for d in range(1, k + 1))

    def choose(self, bs: int) -> int:
        self.iterations += 1
        if self.explore_every > 0 and self.iterations % self.explore_every == 1:
            turn = (self.iterations // self.explore_every) % (self.max_depth + 1)
            return self.max_depth - turn  # max_depth first: it measures the acceptance of every depth
        costs = [self.estimated_cost(bs, k) for k in range(self.max_depth + 1)]
        for k in range(self.max_depth, -1, -1):
            if costs[k] is None:
                return k
        return max(range(self.max_depth + 1), key=lambda k: self.expected_tokens(k) / costs[k])

    def estimated_cost(self, bs: int, k: int) -> float | None:
        """T(bs, k): measured at this batch size, else at the nearest one measured (None: never measured)."""
        if (bs, k) in self.cost:
            return self.cost[(bs, k)]
        near = [b for b, d in self.cost if d == k]
        return self.cost[(min(near, key=lambda b: abs(b - bs)), k)] if near else None

    def record(self, bs: int, k: int, emitted: list[int], seconds: float) -> None:
        """An iteration of ``bs`` requests at depth ``k`` emitted ``emitted[b]`` tokens each in ``seconds``."""
        key = (bs, k)
        old = self.cost.get(key)
        self.cost[key] = seconds if old is None else (1 - self.cost_alpha) * old + self.cost_alpha * seconds
        if k == 0:
            return
        for d in range(1, self.max_depth + 1):
            self.seen[d] *= self.decay
            self.hits[d] *= self.decay
        for d in range(1, k + 1):
            self.seen[d] += len(emitted)
            self.hits[d] += sum(1 for n in emitted if n - 1 >= d)


def record_iteration(controller: DraftLengthController, draft_lengths: dict[int, int], bs: int, k: int,
                     emitted: list[int], seconds: float) -> None:
    """What an iteration of ``bs`` requests drafted ``k`` deep gave (``emitted[b]`` tokens each, bonus included, in
    ``seconds``), for the controller's next choices; ``draft_lengths`` (the metrics' ``chosen_draft_lengths``: depth
    -> iterations) counts it."""
    controller.record(bs, k, emitted, seconds)
    draft_lengths[k] = draft_lengths.get(k, 0) + 1
