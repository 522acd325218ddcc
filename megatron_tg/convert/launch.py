"""Run a converter's worker on ``world`` gloo ranks (spawned processes, loopback, free port).

Differs from :func:`megatron_tg.testing.distributed.run_distributed` in what a user needs:
a worker's :class:`ConversionError` (or a config / mapping / layout error) comes back as
the same exception with the same message, not a traceback; the first failure stops every
other rank at once (they may be blocked in a collective); a rank that dies without a word
(out of memory, killed) is reported with its exit code.
"""

from __future__ import annotations

import logging
import os
import queue as queue_mod
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from megatron_tg.convert.common import ConversionError, silence_known_warnings, worker_threads
from megatron_tg.parallel.ports import free_port

# Errors whose message is the whole story; anything else is reported with its traceback.
_CLEAN = ("ConversionError", "UnsupportedConfigError", "MappingError", "LayoutError")


def _entry(rank: int, world: int, port: int, fn: Callable, job: Any, q, threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS=str(threads))
    silence_known_warnings()
    logging.getLogger("megatron").setLevel(logging.ERROR)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        result = fn(rank, world, job)
        q.put((rank, "ok", result))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        q.put((rank, type(exc).__name__, f"{exc}\n" if type(exc).__name__ in _CLEAN
               else traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable, world: int, job: Any, *, timeout_s: float | None = None) -> list[Any]:
    """``fn(rank, world, job)`` on each rank; returns the results by rank or raises."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    threads = worker_threads(world)
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, job, q, threads))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failure: tuple[int, str, str] | None = None
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while len(results) < world and failure is None:
            try:
                rank, status, payload = q.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs)
                        if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    failure = (dead[0][0], "died", f"exited with code {dead[0][1]} "
                               "(killed for memory?)")
                elif deadline is not None and time.monotonic() > deadline:
                    failure = (-1, "timeout", f"no result within {timeout_s:.0f} s")
                continue
            if status == "ok":
                results[rank] = payload
            else:
                failure = (rank, status, payload)
    except BaseException:
        failure = failure or (-1, "interrupted", "")
        raise
    finally:
        for p in procs:
            if failure is not None and p.is_alive():
                p.kill()  # peers of a failed rank may wait in a collective forever
            p.join()
    if failure is not None:
        rank, kind, message = failure
        where = f"rank {rank}" if rank >= 0 else "workers"
        if kind in _CLEAN:
            raise ConversionError(f"{message.strip()} ({where})")
        raise RuntimeError(f"conversion worker failed ({where}, {kind}):\n{message}")
    return [results[r] for r in range(world)]
