"""``speculative=suffix`` trees with ``speculative.adaptive=true``: the batch's verify width from the trees' own
path probabilities, calibrated by what verification accepted.

A suffix tree's draft comes with each node's path probability ``p`` (:func:`grow_draft`, best first), and the
expected number of draft tokens a greedy verification accepts is the sum of the drafted nodes' path probabilities
(each accepted depth is exactly one node of the accepted path). So a request drafted ``n - 1`` nodes (a verify width
``n``, the root included) emits ``E(n) = 1 + sum of its first n - 1 nodes' p`` tokens. The counts behind ``p`` are
small (a continuation seen once has probability 1), so ``p`` is scaled by a factor per rank bucket (node ranks
``[2^b - 1, 2^(b+1) - 1)``: the nodes a width of ``2^(b+1)`` adds to one of ``2^b``): accepted nodes over summed
``p`` of the verified nodes of that bucket (decayed), drawn towards the next shallower bucket's factor by one
token's worth of ``p`` (a bucket never verified takes it). The worker's :class:`DraftLengthController` then takes
the width (or a plain step) with the most tokens per second from these estimates and the measured cost of each
width at the batch size: ``level`` ``k`` is the width ``widths[k - 1]``, ``k = 0`` a plain step.
"""

from __future__ import annotations

import numpy as np


def rank_bucket(rank: int) -> int:
    """The bucket of a draft node's rank (0-based, best first): 0, 1-2, 3-6, 7-14, ..."""
    return (rank + 1).bit_length() - 1


class WidthEstimate:
    """Expected tokens per request at each verify width, from path probabilities and their calibration."""

    def __init__(self, widths: list[int], decay: float = 0.99) -> None:
        self.widths = widths  # ascending verify widths (root included)
        buckets = rank_bucket(max(widths) - 2) + 1
        self.decay = decay
        self.accepted = np.zeros(buckets)  # [b]: accepted nodes of rank bucket b (decayed)
        self.predicted = np.zeros(buckets)  # [b]: the summed path probabilities of the verified nodes there
        self._bucket = np.array([rank_bucket(r) for r in range(max(widths) - 1)], dtype=np.int64)  # [rank]

    def factors(self) -> np.ndarray:
        """[b] the calibration factor of each rank bucket."""
        out, prior = np.empty(len(self.accepted)), 1.0
        for b, (acc, pred) in enumerate(zip(self.accepted.tolist(), self.predicted.tolist())):
            prior = (acc + prior) / (pred + 1.0)
            out[b] = prior
        return out

    def expected_tokens(self, probs: list[list[float]]) -> list[float]:
        """``probs[r]``: request r's path probabilities, best first -> E per request at level k = 0 (a plain step)
        .. len(widths) (the width ``widths[k - 1]``), averaged over the batch."""
        top = max(self.widths) - 1
        scaled = np.zeros((len(probs), top))  # [bs, rank]
        for r, p in enumerate(probs):
            scaled[r, : min(len(p), top)] = p[:top]
        scaled *= self.factors()[self._bucket][None, :]
        cum = np.concatenate([np.zeros((len(probs), 1)), np.cumsum(scaled, axis=1)], axis=1)  # [bs, rank + 1]
        return [1.0] + [1.0 + float(cum[:, n - 1].mean()) if len(probs) else 1.0 for n in self.widths]

    def record(self, probs: list[list[float]], width: int, accepted_nodes: list[list[int]]) -> None:
        """A verify of ``width`` over requests drafted with path probabilities ``probs[r]`` (its first ``width - 1``
        nodes verified) accepted the tree nodes ``accepted_nodes[r]`` (node ``i >= 1`` is draft rank ``i - 1``)."""
        buckets = len(self.accepted)
        acc, pred = np.zeros(buckets), np.zeros(buckets)
        for p, nodes in zip(probs, accepted_nodes):
            verified = p[: width - 1]
            np.add.at(pred, self._bucket[: len(verified)], verified)
            ranks = [i - 1 for i in nodes if i >= 1]
            np.add.at(acc, self._bucket[ranks], 1.0)
        self.accepted = self.accepted * self.decay + acc
        self.predicted = self.predicted * self.decay + pred
