"""Rank 0's side of tensor parallelism: start the other ranks (spawned processes), shard rank 0's model, broadcast
every forward and K/V copy, watch the other processes, and stop them.

Failure handling: a rank that dies breaks the next collective at once (gloo notices the closed connection; NCCL
ranks are also watched here), and :meth:`TPLeader.run` turns that into one :class:`TensorParallelError` line naming
the rank, its exit code or signal and its own last error. The watchdog thread notices a death within a second even
while rank 0 waits on the device, logs that line, aborts the NCCL group (so that nothing waits on the dead rank
forever) and, if the engine is not closed within ``parallel.timeout_s`` after that, ends the process with it.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import wait as wait_ready
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from framework.config import Config, ConfigError
from framework.parallel import TensorParallelError
from framework.parallel.protocol import HeaderChannel, pack_forward
from framework.parallel.shard import check_tp_sizes, shard_llama

log = logging.getLogger(__name__)

HEADER_TIMEOUT = datetime.timedelta(days=365)  # the other ranks wait for rank 0's next batch as long as it idles
UNSUPPORTED_DRAFTERS = ("eagle", "mtp")  # their heads use the target's embedding and LM head, which are sharded


def check_parallel(config: Config, device: torch.device) -> int:
    """``parallel.tensor_parallel_size`` against the machine and the drafter, before anything loads."""
    n = config.parallel.tensor_parallel_size
    key = f"parallel.tensor_parallel_size={n}"
    if n < 1:
        raise ConfigError(f"{key} is not allowed; expected an integer >= 1")
    if n > 1 and device.type == "cuda" and n > torch.cuda.device_count():
        raise ConfigError(f"{key} is not allowed: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if n > 1 and config.speculative.name in UNSUPPORTED_DRAFTERS:
        raise ConfigError(f"speculative={config.speculative.name} is not allowed with {key}; with tensor "
                          f"parallelism choose one of: none, ngram, suffix, layer_skip, draft_model")
    return n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(rank: int, proc: Any, message: Optional[str]) -> str:
    code = proc.exitcode
    how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited (code {code})"
    return f"tensor parallel rank {rank} (pid {proc.pid}) {how}" + (f": {message}" if message else "") + \
        "; the engine has stopped"


class TPLeader:
    """Rank 0 of a tensor-parallel group of ``parallel.tensor_parallel_size`` processes."""

    def __init__(self, config: Config, procs: list[Any], conns: list[Any]) -> None:
        self.size = config.parallel.tensor_parallel_size
        self.timeout_s = config.parallel.timeout_s
        self.procs, self.conns = procs, conns  # index i: rank i + 1
        self.errors: dict[int, str] = {}  # rank -> the error it reported before exiting
        self.failure: Optional[str] = None
        self.closed = False
        self.header: Optional[HeaderChannel] = None
        self.group: Any = None
        self._watchdog: Optional[threading.Thread] = None
        self._threads: Optional[int] = None  # CPU: rank 0's torch threads before the ranks shared the cores
        atexit.register(self.close)

    # ---- start-up ------------------------------------------------------------------------------------------
    @classmethod
    def start(cls, config: Config, model: Any, device: torch.device) -> "TPLeader":
        """Check the model splits evenly, start ranks 1..N-1 (each loads the model and keeps its slices), join
        the process groups and shard rank 0's ``model`` in place."""
        from framework.models.llama import LlamaForCausalLM
        from framework.parallel.worker import worker_main

        n = config.parallel.tensor_parallel_size
        if not isinstance(model, LlamaForCausalLM):
            raise ConfigError(f"parallel.tensor_parallel_size={n} is not allowed for model={config.model.name}: "
                              f"tensor parallelism supports the Llama family")
        check_tp_sizes(model.args, n)
        if dist.is_initialized():
            raise ConfigError(f"parallel.tensor_parallel_size={n} is not allowed here: this process already runs a "
                              f"tensor-parallel engine (close it first)")
        timeout = datetime.timedelta(seconds=config.parallel.timeout_s)
        port = _free_port()
        store = dist.TCPStore("127.0.0.1", port, n, is_master=True, timeout=timeout, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for rank in range(1, n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(config, rank, n, port, child), name=f"tp-rank-{rank}")
            proc.start()
            child.close()
            procs.append(proc), conns.append(parent)
        leader = cls(config, procs, conns)
        if device.type == "cpu":  # N processes share the cores (the other ranks take their share likewise)
            leader._threads = torch.get_num_threads()
            torch.set_num_threads(max(1, leader._threads // n))
        try:
            leader._await_loaded()
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=store, rank=0, world_size=n, timeout=timeout)
            leader.group = dist.group.WORLD
            leader.header = HeaderChannel(dist.new_group(backend="gloo", timeout=HEADER_TIMEOUT))
            shard_llama(model, 0, n, leader.group)
        except BaseException:
            leader.close()
            raise
        leader._watchdog = threading.Thread(target=leader._watch, name="tp-watchdog", daemon=True)
        leader._watchdog.start()
        log.info("tensor parallel: %d ranks (%s), rank 0 pid %d, ranks 1..%d pids %s", n, backend, os.getpid(), n - 1,
                 [p.pid for p in procs])
        return leader

    def _await_loaded(self) -> None:
        """Wait until every other rank has loaded its shard, or raise its failure."""
        pending = set(range(1, self.size))
        deadline = time.monotonic() + self.timeout_s
        while pending:
            ready = wait_ready([*self.conns, *(p.sentinel for p in self.procs)], timeout=1.0)
            for rank in sorted(pending):
                conn, proc = self.conns[rank - 1], self.procs[rank - 1]
                if conn in ready or conn.poll():
                    msg = self._receive(rank)
                    if msg is not None and msg[0] == "loaded":
                        pending.discard(rank)
                        continue
                if proc.sentinel in ready or not proc.is_alive():
                    proc.join(5)
                    raise TensorParallelError(describe_exit(rank, proc, self.errors.get(rank)))
            if pending and time.monotonic() > deadline:
                raise TensorParallelError(f"tensor parallel ranks {sorted(pending)} did not load the model within "
                                          f"parallel.timeout_s={self.timeout_s:g}")

    def _receive(self, rank: int) -> Optional[tuple]:
        try:
            msg = self.conns[rank - 1].recv()
        except (EOFError, OSError):
            return None
        if msg[0] == "error":
            self.errors[rank] = msg[1]
        return msg

    def setup(self, settings: dict) -> None:
        """The sizes and compile settings of rank 0's KV pool and runner: the other ranks build theirs alike."""
        self.run(self.header.send, {"kind": "setup", **settings})

    # ---- per step -----------------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` (a part of a step with collectives in it), with a failing rank as one clear error."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        try:
            return fn(*args)
        except TensorParallelError:
            raise
        except Exception as err:
            reason = self._dead_rank(wait_s=3.0)
            text = " ".join(str(err).split())
            if reason is None and not any(w in text for w in ("gloo", "NCCL", "Timed out", "timed out", "c10d")):
                raise
            self.failure = reason or f"tensor parallel collective failed: {text[:300]}; the engine has stopped"
            raise TensorParallelError(self.failure) from err

    def send_forward(self, batch: Any, input_ids: torch.Tensor, table: torch.Tensor, layer_ids: Any) -> None:
        """Broadcast a forward (the other ranks run the same forward on their shards next)."""
        header, payload = pack_forward(batch, input_ids, table, layer_ids)
        self.header.send(header)
        dist.broadcast(payload, 0, group=self.group)

    def send_copy_kv(self, index: torch.Tensor) -> None:
        """Broadcast a K/V copy ``index`` ``[2, n]`` (source slots, destination slots) for every rank's pool."""
        self.header.send({"kind": "copy_kv", "n": index.shape[1]})
        dist.broadcast(index.contiguous(), 0, group=self.group)

    # ---- failure and shutdown -----------------------------------------------------------------------------
    def _dead_rank(self, wait_s: float) -> Optional[str]:
        """The description of a rank that has exited (waiting up to ``wait_s`` for one to be seen), or None."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.procs, 1):
                if not proc.is_alive():
                    if self.conns[rank - 1].poll(0.2):
                        self._receive(rank)
                    return describe_exit(rank, proc, self.errors.get(rank))
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _watch(self) -> None:
        """The watchdog: a rank that exits while the engine runs fails the engine (see the module's notes)."""
        while not self.closed:
            wait_ready([p.sentinel for p in self.procs], timeout=0.5)
            if self.closed:
                return
            reason = self._dead_rank(wait_s=0.0)
            if reason is None:
                continue
            self.failure = self.failure or reason
            log.error("%s", self.failure)
            self._abort_nccl()
            deadline = time.monotonic() + self.timeout_s
            while not self.closed and time.monotonic() < deadline:
                time.sleep(0.2)
            if not self.closed:  # the engine's thread is stuck or nobody noticed: do not hang
                print(f"error: {self.failure}", file=sys.stderr, flush=True)
                os._exit(1)
            return

    def _abort_nccl(self) -> None:
        """Abort the NCCL communicators, so that a collective waiting on the dead rank returns (with an error)."""
        if self.group is None or dist.get_backend(self.group) != "nccl":
            return
        try:
            self.group.abort()
        except Exception as err:  # noqa: BLE001 - best effort: the exit after parallel.timeout_s still comes
            log.warning("could not abort the NCCL group: %s", err)

    def close(self) -> None:
        """Stop the other ranks and leave the process groups (idempotent; also at interpreter exit)."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if self.header is not None and self.failure is None:
            try:
                self.header.send({"kind": "stop"})
            except Exception:  # noqa: BLE001 - a rank is gone: terminated below
                pass
        for proc in self.procs:
            proc.join(timeout=10 if self.failure is None else 1)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - after a failure the groups may be half gone
                pass
        if self._threads is not None:
            torch.set_num_threads(self._threads)
