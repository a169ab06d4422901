"""Ranks 1..N-1 of a tensor-parallel engine: a spawned process that loads the model, keeps its slices, builds a KV
pool shard and a model runner like rank 0's, then runs every forward rank 0 broadcasts (and every K/V copy) until
rank 0 says stop or goes away. It samples nothing: rank 0 samples from the gathered logits."""

from __future__ import annotations

import datetime
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from framework.parallel.protocol import HeaderChannel, payload_size, unpack_forward

log = logging.getLogger(__name__)


def worker_main(config: Any, rank: int, size: int, port: int, conn: Any) -> None:
    """The process body; any failure is sent to rank 0 as one line before the process exits with code 1."""
    from framework.parallel.leader import HEADER_TIMEOUT
    from framework.parallel.shard import shard_llama

    logging.basicConfig(level=config.log_level, format=f"[tp rank {rank}] %(levelname)s %(name)s: %(message)s")
    code = 0
    try:
        from framework.models.loader import load_model
        from framework.resolve import resolve_device, resolve_dtype

        device = resolve_device(config.model.device)
        if device.type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        else:  # the ranks share the machine's cores
            torch.set_num_threads(max(1, torch.get_num_threads() // size))
        dtype = resolve_dtype(config.model.dtype, device)
        model = load_model(config.model, dtype, device)
        conn.send(("loaded",))
        timeout = datetime.timedelta(seconds=config.parallel.timeout_s)
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=size,
                                timeout=timeout)
        channel = HeaderChannel(dist.new_group(backend="gloo", timeout=HEADER_TIMEOUT))
        shard_llama(model, rank, size, dist.group.WORLD)
        follow(model, config, device, dtype, channel)
    except BaseException as err:  # noqa: BLE001 - reported to rank 0, which fails the engine with it
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        try:
            conn.send(("error", f"{type(err).__name__}: {lines[0] if lines else ''}"[:500]))
        except (OSError, ValueError):
            pass
        log.exception("tensor parallel rank %d failed", rank)
        code = 1
    finally:
        conn.close()
    if code == 0 and dist.is_initialized():
        dist.destroy_process_group()
    try:  # inductor's compile workers, which os._exit would leave to the resource tracker
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()
    except Exception:  # noqa: BLE001 - (older or newer torch without it)
        pass
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)  # NOTE: skips interpreter teardown, where compiled-code threads have aborted the process


@torch.inference_mode()
def follow(model: Any, config: Any, device: torch.device, dtype: torch.dtype, channel: HeaderChannel) -> None:
    """Build the KV pool shard and the runner from rank 0's settings, then run what rank 0 broadcasts."""
    from framework.attention import build_backend
    from framework.kv import KVAllocator
    from framework.model_runner import ModelRunner

    setup = channel.recv()
    if setup["kind"] == "stop":
        return
    model.init_rope(setup["rope_positions"])
    # (the allocator only holds this rank's req_to_token table; rank 0's allocator hands out the slots)
    allocator = KVAllocator(setup["num_tokens"], setup["page_size"], setup["max_requests"], setup["width"], device)
    pool = model.kv_pool(allocator.num_slots, dtype, device)
    backend = build_backend(setup["attention"], pool, allocator, model.attention_args)
    runner = ModelRunner(model, backend, setup["compiled"], setup["batch_sizes"], device, setup["skip_guards"],
                         setup["pdl"], setup["compile_extend"], setup["extend_graph_tokens"],
                         regional=setup["regional"])
    group = dist.group.WORLD
    while True:
        msg = channel.recv()
        kind = msg["kind"]
        if kind == "stop":
            return
        if kind == "forward":
            payload = torch.empty(payload_size(msg), dtype=torch.int64, device=device)
            dist.broadcast(payload, 0, group=group)
            batch = unpack_forward(msg, payload, allocator.req_to_token)
            runner.forward(batch, msg["layer_ids"])
        elif kind == "copy_kv":
            index = torch.empty(2, msg["n"], dtype=torch.int64, device=device)
            dist.broadcast(index, 0, group=group)
            runner.copy_kv(index)
        else:
            raise RuntimeError(f"unknown tensor parallel message {kind!r}")
