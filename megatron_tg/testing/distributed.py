"""Run a function on N gloo ranks in fresh processes and collect what each returns.

Every multi-rank test goes through :func:`run_distributed` so that they all share one
way of launching (spawned processes, a free loopback port, one intra-op thread per rank
because these machines have 2 cores) and one way of reporting a failure (the failing
rank's traceback is re-raised in the parent, naming the rank).

The function must be importable at module level (spawn pickles it by reference). It is
called as ``fn(rank, world_size, *args)`` after ``torch.distributed`` is initialised;
whatever it returns must be picklable (tensors are moved to CPU and detached).

``comm_rules="nccl"`` (default: the ``MEGATRON_TG_COMM_RULES`` environment variable, else
plain gloo) runs every rank under :mod:`megatron_tg.testing.nccl_rules`, so that a
collective NCCL would refuse on GPU fails the test here.
"""

from __future__ import annotations

import datetime
import io
import os
import queue as queue_mod
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_tg.parallel.ports import free_port


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _worker(rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple,
            queue: "mp.Queue", threads: int, pg_timeout_s: float | None = None,
            comm_rules: str = "gloo") -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(threads)
    try:
        extra = {} if pg_timeout_s is None else {"timeout": datetime.timedelta(seconds=pg_timeout_s)}
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **extra)
        if comm_rules == "nccl":
            from megatron_tg.testing import nccl_rules

            nccl_rules.enable()
        result = fn(rank, world_size, *args)
        # Plain bytes, not tensors: torch's queue pickling shares tensor storage through file
        # descriptors that die with this process, which may exit before the parent reads.
        buf = io.BytesIO()
        torch.save(_to_cpu(result), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything, the parent re-raises
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _reap(p, timeout: float) -> None:
    """Wait up to ``timeout`` for ``p`` to exit, by its exit status (``waitpid``), not
    ``join``: ``join`` waits for a pipe to close that the rank's ``torch_shm_manager`` inherits,
    and that manager lives as long as any process that opened one of its shared-memory files
    (libshm keeps one connection per manager for a process's lifetime), e.g. an engine that
    read this rank's weight payloads."""
    deadline = time.monotonic() + timeout
    while p.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if p.exitcode is not None:
        p.join()  # returns at once: the status is known


def run_distributed(fn: Callable, world_size: int, *args: Any, backend: str = "gloo",
                    timeout: float = 600.0, threads_per_rank: int = 1,
                    pg_timeout_s: float | None = None, comm_rules: str | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return results by rank.

    Raises ``RuntimeError`` carrying the first failing rank's traceback, or on timeout.
    """
    from megatron_tg.testing.nccl_rules import from_env

    rules = from_env(comm_rules)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, queue,
                                          threads_per_rank, pg_timeout_s, rules), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, status, payload = queue.get(timeout=timeout)
            except queue_mod.Empty as exc:
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode]
                raise RuntimeError(
                    f"run_distributed: no result within {timeout:.0f}s "
                    f"(ranks that died: {dead or 'none'}; results so far: {sorted(results)})"
                ) from exc
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break  # the other ranks are likely blocked in a collective
    finally:
        for p in procs:
            _reap(p, 5 if errors else 60)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
