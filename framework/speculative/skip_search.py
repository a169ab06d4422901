"""The skip-set search of ``speculative.skip_search`` (SWIFT-style, on the fly): which K of the target's layers the
draft runs, chosen from the target's own verified tokens while serving.

A round proposes ``candidates`` layer sets, and the caller scores them together with the current set on the same
recent context (the fraction of the last ``search_window`` committed positions where the draft's prediction equals
the token the target produced: :meth:`LayerSkipDrafter._scores`). The best of the round replaces the current set
when it scores more than ``margin`` higher (the drafter's: two of the round's positions, so that noise alone
rarely switches). Proposals: the first ``random_rounds`` rounds draw random sets (exploration, as SWIFT starts); later
rounds come from a surrogate, a ridge regression of round-relative scores on the kept-layer masks of every set
scored so far (each layer's estimated worth), half as the surrogate's best K layers under noise and half as
mutations of the current set that swap one or two of its least useful layers for the most promising skipped ones.
Rounds that change nothing double the interval to the next one (up to ``max_backoff`` times), a switch resets it:
the search costs most while it still finds better sets, and its time is serving time (counted in the reported
speed). The first and last layers stay kept when K >= 3 (a draft without them is rarely useful).
"""

from __future__ import annotations

import random
from typing import Optional

import numpy as np


class SkipSearch:
    """Proposes candidate kept-layer sets and keeps the best; deterministic for a seed."""

    def __init__(self, num_layers: int, initial: list[int], seed: int = 0, candidates: int = 4, interval: int = 16,
                 random_rounds: int = 2, max_backoff: int = 8, ridge: float = 1.0, history: int = 256,
                 margin: float = 0.0) -> None:
        self.num_layers = num_layers
        self.keep = len(initial)
        self.best: tuple[int, ...] = tuple(sorted(initial))
        self.rng = random.Random(seed)
        self.candidates = candidates
        self.interval = interval
        self.random_rounds = random_rounds
        self.max_backoff = max_backoff
        self.ridge = ridge
        self.history = history  # scored sets the surrogate fits (the most recent)
        self.margin = margin  # a candidate replaces the current set only when it scores more than this higher
        self.pinned = {0, num_layers - 1} if self.keep >= 3 else set()
        self.masks: list[np.ndarray] = []  # [num_layers] kept mask of every scored set
        self.rel_scores: list[float] = []  # its score minus its round's mean
        self.rounds = 0
        self.switches = 0
        self.backoff = 1
        self.next_round = interval  # iteration count of the next round
        self.last_scores: dict[str, float] = {}

    def due(self, iteration: int) -> bool:
        return iteration >= self.next_round

    # ---- proposals --------------------------------------------------------------------------------------
    def propose(self) -> list[tuple[int, ...]]:
        """This round's candidates (distinct, none equal to the current set)."""
        seen = {self.best}
        out: list[tuple[int, ...]] = []
        for i in range(self.candidates * 8):
            if len(out) == self.candidates:
                break
            if self.rounds < self.random_rounds or len(self.masks) < 2:
                cand = self._random()
            elif i % 2 == 0:
                cand = self._from_surrogate()
            else:
                cand = self._mutate()
            if cand not in seen:
                seen.add(cand)
                out.append(cand)
        return out

    def _free(self) -> list[int]:
        return [i for i in range(self.num_layers) if i not in self.pinned]

    def _random(self) -> tuple[int, ...]:
        return tuple(sorted(self.pinned | set(self.rng.sample(self._free(), self.keep - len(self.pinned)))))

    def worth(self) -> np.ndarray:
        """Each layer's estimated contribution to the score when kept ``[num_layers]`` (ridge regression)."""
        x = np.stack(self.masks).astype(np.float64)  # [n, num_layers]
        y = np.asarray(self.rel_scores, dtype=np.float64)
        x = x - x.mean(0, keepdims=True)
        return np.linalg.solve(x.T @ x + self.ridge * np.eye(self.num_layers), x.T @ y)

    def _from_surrogate(self) -> tuple[int, ...]:
        w = self.worth()
        noise = np.asarray([self.rng.gauss(0.0, 1.0) for _ in range(self.num_layers)]) * (w.std() + 1e-6)
        order = [i for i in np.argsort(-(w + noise)).tolist() if i not in self.pinned]
        return tuple(sorted(self.pinned | set(order[: self.keep - len(self.pinned)])))

    def _mutate(self) -> tuple[int, ...]:
        w = self.worth() if len(self.masks) >= 2 else np.zeros(self.num_layers)
        kept = [i for i in self.best if i not in self.pinned]
        skipped = [i for i in range(self.num_layers) if i not in self.best]
        if not kept or not skipped:
            return self._random()
        swaps = min(self.rng.choice([1, 1, 2]), len(kept), len(skipped))
        # sample without replacement, favouring low-worth kept layers and high-worth skipped ones
        drop = self._weighted(kept, [-w[i] for i in kept], swaps)
        add = self._weighted(skipped, [w[i] for i in skipped], swaps)
        return tuple(sorted((set(self.best) - set(drop)) | set(add)))

    def _weighted(self, items: list[int], scores: list[float], n: int) -> list[int]:
        s = np.asarray(scores, dtype=np.float64)
        p = np.exp((s - s.max()) / (s.std() + 1e-9))
        picks: list[int] = []
        pool = list(range(len(items)))
        for _ in range(n):
            weights = [p[j] for j in pool]
            j = self.rng.choices(pool, weights=weights)[0]
            pool.remove(j)
            picks.append(items[j])
        return picks

    # ---- results ----------------------------------------------------------------------------------------
    def record(self, iteration: int, sets: list[tuple[int, ...]], scores: list[float]) -> Optional[tuple[int, ...]]:
        """Scores of ``sets`` on one context (``sets[0]`` the current set); returns the new set, or None to keep."""
        self.rounds += 1
        mean = sum(scores) / len(scores)
        for s, score in zip(sets, scores):
            mask = np.zeros(self.num_layers)
            mask[list(s)] = 1.0
            self.masks.append(mask)
            self.rel_scores.append(score - mean)
        del self.masks[: -self.history], self.rel_scores[: -self.history]
        best_i = max(range(len(sets)), key=lambda i: (scores[i], i == 0))  # ties keep the current set
        if scores[best_i] <= scores[0] + self.margin:
            best_i = 0
        self.last_scores = {"current": round(scores[0], 4), "best_candidate": round(max(scores[1:], default=0.0), 4)}
        if best_i != 0:
            self.best = sets[best_i]
            self.switches += 1
            self.backoff = 1
        else:
            self.backoff = min(self.backoff * 2, self.max_backoff)
        self.next_round = iteration + self.interval * self.backoff
        return self.best if best_i != 0 else None
