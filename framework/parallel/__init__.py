"""Tensor parallelism (``parallel.tensor_parallel_size=N``): N processes, one per device, each holding 1/N of the
model (attention heads, MLP columns, vocabulary) and of the KV heads. Rank 0 runs the engine; ranks 1..N-1 are
started by it and follow every forward it runs (:mod:`framework.parallel.worker`).

- :mod:`~framework.parallel.shard`: which slice of every weight a rank keeps, and the size checks;
- :mod:`~framework.parallel.comm`: the model's collectives (eager and traced by torch.compile);
- :mod:`~framework.parallel.protocol`: the messages rank 0 broadcasts (a forward's batch, a K/V copy, stop);
- :mod:`~framework.parallel.leader`: rank 0's side: start-up, broadcasting, the watchdog, shutdown;
- :mod:`~framework.parallel.worker`: the other ranks' process.
"""

from framework.parallel.shard import TPInfo, check_tp_sizes, shard_llama


class TensorParallelError(RuntimeError):
    """A rank died, hung past ``parallel.timeout_s`` or failed; ``str(err)`` is one line. The engine is down."""


__all__ = ["TPInfo", "TensorParallelError", "check_tp_sizes", "shard_llama"]
