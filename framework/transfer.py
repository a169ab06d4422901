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


class PinnedStaging:
    """Host-to-device copies of a fixed-size host array through a few pinned buffers taken in turn.

    ``tensor.pin_memory()`` per copy asks torch's caching host allocator for a block every time; here each buffer is
    written again only once the copy that last read it has run (its event, queried: never waited for). Where every
    buffer is still in flight (the GPU ``slots`` copies behind), the copy goes through ``pin_memory()`` as before."""

    def __init__(self, size: int, dtype: torch.dtype, slots: int = 4) -> None:
        self._buffers = [torch.empty(size, dtype=dtype, pin_memory=True) for _ in range(slots)]
        self._views = [b.numpy() for b in self._buffers]
        self._events: list[Optional[torch.cuda.Event]] = [None] * slots
        self._next = 0

    def copy(self, dst: torch.Tensor, src: np.ndarray) -> None:
        """Queue ``dst.copy_(src)`` (``src``: the host array, as long as ``dst``) without blocking the host."""
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        event = self._events[i]
        if event is not None and not event.query():  # that buffer's copy has not run yet
            dst.copy_(torch.from_numpy(src).pin_memory(), non_blocking=True)
            return
        self._views[i][:] = src
        dst.copy_(self._buffers[i], non_blocking=True)
        if event is None:
            event = self._events[i] = torch.cuda.Event()
        event.record()
