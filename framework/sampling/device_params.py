"""A batch's sampling parameters as device tensors, uploaded once while the batch's requests stay the same."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from framework.batch import SamplingBatch
from framework.request import Request
from framework.transfer import upload


class DeviceSamplingParams:
    """The last batch's :class:`SamplingBatch`, kept while the same request objects come in the same order with the
    same padding: then only the sampling steps are uploaded again when they change, and not even they for an
    all-greedy batch (greedy sampling does not read them). The requests are held, so their identities stay unique."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._last: Optional[tuple[list[Request], int, Optional[list[int]], SamplingBatch]] = None

    def get(self, reqs: list[Request], padded_bs: int = 0, steps: Optional[list[int]] = None) -> SamplingBatch:
        """Tensors ``[max(len(reqs), padded_bs)]`` (padding rows greedy); ``steps``: the index of the token each
        request samples next (None: zeros, for a caller that computes them on the device)."""
        extra = max(padded_bs - len(reqs), 0)
        last = self._last
        if last is not None and last[1] == extra and len(last[0]) == len(reqs) \
                and all(a is b for a, b in zip(last[0], reqs)):
            batch = last[3]
            if steps is not None and not batch.all_greedy and steps != last[2]:
                batch = dataclasses.replace(batch, steps=upload(np.asarray(steps + [0] * extra, dtype=np.int64),
                                                                self.device))
        else:
            p = [r.params for r in reqs]
            ints = upload(np.asarray([[x.top_k for x in p] + [0] * extra, [r.seed for r in reqs] + [0] * extra,
                                      (steps if steps is not None else [0] * len(reqs)) + [0] * extra],
                                     dtype=np.int64), self.device)
            floats = upload(np.asarray([[x.temperature for x in p] + [0.0] * extra, [x.top_p for x in p] + [1.0] * extra],
                                       dtype=np.float32), self.device)
            batch = SamplingBatch(temperatures=floats[0], top_ps=floats[1], top_ks=ints[0], seeds=ints[1],
                                  steps=ints[2], all_greedy=all(x.temperature == 0 for x in p),
                                  need_top_k_top_p=any(x.top_k > 0 or x.top_p < 1 for x in p if x.temperature > 0))
        self._last = (list(reqs), extra, steps, batch)
        return batch
