"""Host <-> device copies that never make the host wait for the GPU.

A blocking ``tensor.to("cuda")`` of host memory synchronizes the stream (torch waits for the copy, so for every
kernel queued before it): one such copy on the decode path and the host can no longer run ahead of the GPU.
Here uploads go through pinned memory with ``non_blocking=True`` (torch's caching host allocator reuses a pinned
block only after the copy that read it has run), and downloads land in pinned memory with an event the host
waits on only when it needs the values.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a tensor on ``device``, copied without blocking the host (on the CPU: shares its memory)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class AsyncCopy:
    """A device tensor's values on their way to the host: :meth:`numpy` waits for them (and only for them).

    The pinned buffer and the event come from a free list per (shape, dtype) and go back once the values are read:
    a decode step's copy reuses the last step's instead of allocating pinned memory and an event of its own."""

    _free: dict[tuple, list[tuple[torch.Tensor, torch.cuda.Event]]] = {}

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event: Optional[torch.cuda.Event] = None
        self._values: Optional[np.ndarray] = None
        if tensor.device.type == "cuda":
            self._key = (tuple(tensor.shape), tensor.dtype)
            free = AsyncCopy._free.get(self._key)
            if free:
                self._host, self._event = free.pop()
            else:
                self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                self._event = torch.cuda.Event()
            self._host.copy_(tensor, non_blocking=True)
            self._event.record()
        else:
            self._values = tensor.numpy()

    def ready(self) -> bool:
        """True once the values have arrived (never waits)."""
        return self._event is None or self._event.query()

    def numpy(self) -> np.ndarray:
        """The values; waits for the copy (not for the GPU work queued after it)."""
        if self._values is None:
            self._event.synchronize()
            # NOTE: a copy of the values, so that the pinned buffer can serve the next transfer at once
            self._values = self._host.numpy().copy()
            AsyncCopy._free.setdefault(self._key, []).append((self._host, self._event))
            self._event = None
        return self._values
