"""The cost side of ``speculative.adaptive=true``'s goodput model: the measured seconds an iteration of ``bs``
requests drafted ``k`` deep takes, ``T(bs, k)``, and the estimates for what was not measured
(:class:`~framework.speculative.adaptive.DraftLengthController` takes the depth with the most tokens per second)."""

from __future__ import annotations

from typing import Optional


class IterationCosts:
    """``T(bs, k)``: per batch size and depth an exponential average of the iterations' seconds (on CUDA their GPU
    time; on the CPU their wall time), and per batch size the host's own seconds per iteration averaged over every
    depth (CUDA): a depth costs the longer of the two."""

    def __init__(self, max_depth: int, alpha: float) -> None:
        self.max_depth = max_depth
        self.alpha = alpha
        self._by_bs: dict[int, dict[int, float]] = {}  # bs -> {k: seconds per iteration}
        self._samples: dict[tuple[int, int], int] = {}  # (bs, k) -> iterations measured
        self.depth_samples = [0] * (max_depth + 1)  # [k]: iterations measured at depth k, all batch sizes
        self._host: dict[int, float] = {}  # bs -> the host's own seconds per iteration (all depths; CUDA)

    @property
    def cost(self) -> dict[tuple[int, int], float]:
        """(bs, k) -> the measured seconds per iteration."""
        return {(b, k): c for b, costs in self._by_bs.items() for k, c in costs.items()}

    def record(self, bs: int, k: int, seconds: float, host_s: Optional[float] = None) -> bool:
        """An iteration of ``bs`` requests at depth ``k`` took ``seconds`` (``host_s``: the host's own time for it,
        where measured). True where this was the first or second sample of ``(bs, k)``: a new cost, not a drift."""
        samples = self._samples.get((bs, k), 0)
        costs = self._by_bs.setdefault(bs, {})
        # the second sample replaces the first, which may have been a cold one (a new shape's first run)
        costs[k] = seconds if samples < 2 else (1 - self.alpha) * costs[k] + self.alpha * seconds
        if host_s is not None:
            last = self._host.get(bs)
            self._host[bs] = host_s if last is None else (1 - self.alpha) * last + self.alpha * host_s
        self._samples[(bs, k)] = samples + 1
        self.depth_samples[k] += 1
        return samples < 2

    def plain_near(self, bs: int, factor: float) -> bool:
        """Whether a plain step (k = 0) was measured at ``bs`` or at a batch size within ``factor`` of it."""
        return 0 in self._by_bs.get(bs, {}) or \
            any(0 in c and max(b, bs) <= factor * min(b, bs) for b, c in self._by_bs.items())

    def measured(self, bs: int, k: int) -> float | None:
        """T(bs, k) measured at this batch size (where nothing was: at the nearest batch size measured); else the
        nearest batch size's T(b, k), scaled by T(bs, d) / T(b, d) at a depth ``d`` measured at both (the nearest to
        ``k``: the ratio of two depths' costs changes slowly with the batch size, the costs themselves do not), or
        unscaled where there is none. None: depth ``k`` never measured."""
        if not self._by_bs:
            return None
        if bs not in self._by_bs:
            bs = min(self._by_bs, key=lambda b: abs(b - bs))
        here = self._by_bs[bs]
        if k in here:
            return here[k]
        others = sorted((b for b, costs in self._by_bs.items() if k in costs), key=lambda b: abs(b - bs))
        for b in others:
            common = [d for d in here if d in self._by_bs[b]]
            if common:
                d = min(common, key=lambda d: abs(d - k))
                return self._by_bs[b][k] * here[d] / self._by_bs[b][d]
        return self._by_bs[others[0]][k] if others else None

    def estimate(self, bs: int) -> list[float | None]:
        """T(bs, k) for every depth. Where two or more depths were measured at ``bs``: those, and between them
        interpolated linearly in ``k``, past the deepest extrapolated from the deepest two (the slope at least 0),
        below the shallowest as the shallowest. Else the same over :meth:`measured` (None: nothing measured)."""
        here = self._by_bs.get(bs, {})
        known = dict(here) if len(here) >= 2 else \
            {d: c for d in range(self.max_depth + 1) if (c := self.measured(bs, d)) is not None}
        out: list[float | None] = []
        for k in range(self.max_depth + 1):
            below, above = sorted(d for d in known if d <= k), [d for d in known if d >= k]
            if not below and not above:
                out.append(None)
            elif not below:
                out.append(known[min(above)])
            elif not above:
                hi = below[-1]
                slope = (known[hi] - known[below[-2]]) / (hi - below[-2]) if len(below) >= 2 else 0.0
                out.append(known[hi] + max(slope, 0.0) * (k - hi))
            else:
                lo, hi = below[-1], min(above)
                out.append(known[lo] if lo == hi else known[lo] + (known[hi] - known[lo]) * (k - lo) / (hi - lo))
        host = self.host(bs)
        return out if host is None else [c if c is None else max(c, host) for c in out]

    def host(self, bs: int) -> float | None:
        """The host's own seconds per iteration of ``bs`` requests (at the nearest batch size measured; None: none
        measured, as on the CPU, where an iteration's measured cost is its wall time)."""
        if not self._host:
            return None
        return self._host[bs] if bs in self._host else self._host[min(self._host, key=lambda b: abs(b - bs))]
