"""The phases of a step around training, by ``rollout.placement`` (docs/colocated.md).

The loop calls the same five verbs whatever the placement (:class:`Phases`):
``before_generate`` -> (generate + judge) -> ``before_train`` -> train -> ``after_train`` ->
``sync`` -> (log) -> ``save`` when a checkpoint is due.

* **disaggregated** (:class:`Disaggregated`): the engines have GPUs of their own; only
  ``sync`` does anything (:func:`~megatron_tg.weight_sync.sync.sync_to_engines`, the
  broadcast).
* **colocated** (:class:`Colocated`): the engines and the trainer take turns on the same GPUs::

      generate      engines hold weights + KV; the trainer's state is offloaded
      before_train  release the engines (all tags; they are idle: at max_staleness=0 the
                    batch was the last thing they generated), check that they hold 0 bytes,
                    onload the trainer
      after_train   offload the trainer's gradients and optimizer state
      sync          (engines paused) resume ``weights`` -> the new weights through
                    ``/update_weights_from_tensor``, bucketed, SGLang's ``flattened_bucket``
                    format, one engine at a time -> resume ``kv_cache`` and ``cuda_graph``;
                    then the log-prob probe, which needs the trainer's parameters
      save          onload the trainer's state, save, wait for the write
      before_generate  offload the parameters (and whatever ``save`` brought back)

  The parameters stay on the device through the sync: the HF tensors are gathered from them
  over TP/EP/PP with the device's collectives (:func:`~megatron_tg.weight_sync.sync.iter_hf_weights`),
  so while the engines' weights are resumed the GPU holds both copies, but neither KV cache
  nor gradients nor optimizer state. Engine loss and return are not handled here: a lost
  engine fails the step (the disaggregated path re-forms its group instead).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.distributed as dist

from megatron_tg.train.offload import KINDS, TrainerOffload
from megatron_tg.weight_sync.checks import SyncChecks, SyncStats
from megatron_tg.weight_sync.sync import iter_hf_weights, probe_engines, sync_to_engines, verify_coverage

ALL_TAGS = ("cuda_graph", "kv_cache", "weights")  # SGLang's GPU_MEMORY_ALL_TYPES


class Phases(Protocol):
    """What the loop calls around generation and training (collective: every rank calls each)."""

    def before_generate(self) -> None: ...

    def before_train(self) -> dict[str, float]: ...

    def after_train(self) -> dict[str, float]: ...

    def sync(self, restart: bool = False) -> dict[str, float]:
        """The trainer's weights -> the engines as version ``trainer.step``; ``restart``: the
        engines just started on the base weights and nothing generates yet."""

    def save(self, extra: dict[str, Any]) -> None: ...


class Disaggregated:
    def __init__(self, trainer, side, checks: SyncChecks) -> None:
        self.trainer, self.side, self.checks = trainer, side, checks

    def before_generate(self) -> None:
        pass

    def before_train(self) -> dict[str, float]:
        return {}

    def after_train(self) -> dict[str, float]:
        return {}

    def sync(self, restart: bool = False) -> dict[str, float]:
        return sync_to_engines(self.trainer, self.side, self.checks, restart=restart)

    def save(self, extra: dict[str, Any]) -> None:
        self.trainer.save(extra)


def make_phases(trainer, side, checks: SyncChecks) -> Phases:
    """The phases ``rollout.placement`` asks for (``side``: rank 0's rollout side, else None)."""
    cls = Colocated if trainer.cfg.rollout.placement == "colocated" else Disaggregated
    return cls(trainer, side, checks)


def _uses_memory_saver(info: Any) -> bool:
    """Whether an engine's ``/server_info`` says it runs with ``--enable-memory-saver``
    (SGLang: a server argument at the top level; the embedded engine: ``memory_occupation``)."""
    if not isinstance(info, dict):
        return False
    occ = info.get("memory_occupation")
    return bool(occ.get("enable_memory_saver") if isinstance(occ, dict) else info.get("enable_memory_saver"))


def _held_bytes(infos: dict[str, Any]) -> dict[str, int]:
    """Bytes each engine's weights and KV cache hold, where it reports them exactly (the
    embedded engine's ``memory_occupation``; SGLang reports no such field)."""
    return {u: int(i["memory_occupation"]["weights_bytes"]) + int(i["memory_occupation"]["kv_cache_bytes"])
            for u, i in infos.items() if isinstance(i, dict) and isinstance(i.get("memory_occupation"), dict)}


def _released(infos: dict[str, Any]) -> dict[str, list]:
    """Each engine's released tags and KV-cache bytes, where it reports them (the embedded
    engine's ``memory_occupation``; SGLang reports neither)."""
    return {u: [sorted(i["memory_occupation"].get("released") or []), int(i["memory_occupation"]["kv_cache_bytes"])]
            for u, i in infos.items() if isinstance(i, dict) and isinstance(i.get("memory_occupation"), dict)}


def preflight(side: Any) -> str | None:
    """Release and resume every engine's KV cache once, before the first step; None when it
    worked, else what went wrong. Only the KV cache: resumed weights hold nothing until an
    update writes them, and the first rollouts are generated on the engines' own weights.
    An engine that refuses either call, or (where it reports them) still holds KV bytes after
    the release or still lists the tag released after the resume, is found before any
    rollout is generated, not a step later."""
    try:
        side.call(side.client.release_memory_occupation(["kv_cache"]))
        held = _released(side.call(side.client.get_server_info(strict=True)))
        side.call(side.client.resume_memory_occupation(["kv_cache"]))
        back = _released(side.call(side.client.get_server_info(strict=True)))
    except Exception as exc:  # noqa: BLE001 -- every rank stops with the reason
        return f"rollout.placement='colocated': the engines' release/resume preflight failed: {exc}"
    kept = {u: v for u, v in held.items() if v[1] or "kv_cache" not in v[0]}
    if kept:
        return f"rollout.placement='colocated': engines did not release their KV cache ([released tags, bytes]): {kept}"
    stuck = {u: v[0] for u, v in back.items() if "kv_cache" in v[0]}
    if stuck:
        return f"rollout.placement='colocated': engines still list their KV cache released after resuming it: {stuck}"
    return None


class Colocated:
    """Engines on the trainer's GPUs (module docstring). Rank 0 drives the engines; every
    rank offloads and onloads its own state and takes part in the weight gathers."""

    def __init__(self, trainer, side, checks: SyncChecks) -> None:
        self.trainer, self.side, self.checks = trainer, side, checks
        self.rank0 = trainer.ctx.rank == 0
        self.state = TrainerOffload(trainer)
        self.released: set[str] = set()  # rank 0: the engines' released tags
        urls, error = None, None
        if self.rank0:
            if trainer.ctx.device.type == "cpu":  # CPU payloads are shared-memory files
                from megatron_tg.rollout.transport import start_shm_manager

                start_shm_manager()
            urls = list(side.client.admin_urls)
            infos = side.call(side.client.get_server_info(strict=True))
            bare = [u for u in urls if not _uses_memory_saver(infos.get(u))]
            if bare:
                error = (f"rollout.placement='colocated': engines {bare} run without "
                         f"--enable-memory-saver; releasing their memory would free nothing")
            else:
                error = preflight(side)
        self.urls = self._agree(error, urls)

    def _agree(self, error: str | None, value: Any = None) -> Any:
        """Rank 0's verdict (and ``value``) on every rank: all of them raise together."""
        box = [(error, value)]
        dist.broadcast_object_list(box, src=0)
        if box[0][0] is not None:
            raise RuntimeError(box[0][0])
        return box[0][1]

    def before_generate(self) -> None:
        self.state.offload(KINDS)

    def before_train(self) -> dict[str, float]:
        t0 = time.perf_counter()
        error, held = None, None
        if self.rank0:
            try:
                self.side.call(self.side.client.release_memory_occupation(None))  # every tag
                self.released = set(ALL_TAGS)
                held = _held_bytes(self.side.call(self.side.client.get_server_info(strict=True)))
                if any(held.values()):
                    error = f"engines still hold memory after releasing every tag (bytes): {held}"
            except Exception as exc:  # every rank stops, not only rank 0
                error = f"releasing the engines' memory before training failed: {exc}"
        held = self._agree(error, held)  # no rank onloads before the engines are released
        t1 = time.perf_counter()
        restored = self.state.onload(KINDS)
        metrics = {"colocated/release_s": t1 - t0, "colocated/onload_s": time.perf_counter() - t1,
                   "colocated/onload_bytes": float(restored)}
        if held:  # the check above made it 0; logged as the evidence
            metrics["colocated/engine_bytes_at_train"] = float(sum(held.values()))
        return metrics

    def after_train(self) -> dict[str, float]:
        t0 = time.perf_counter()
        freed = self.state.offload(["grads", "optimizer"])
        return {"colocated/offload_state_s": time.perf_counter() - t0,
                "colocated/offload_state_bytes": float(freed)}

    def _weights(self, stats: SyncStats) -> Iterator[tuple[str, torch.Tensor]]:
        """One pass of the HF tensors (collective), counted on rank 0."""
        for name, t in iter_hf_weights(self.trainer.model, self.trainer.arch, self.trainer.ctx):
            stats.tensors += 1
            stats.bytes += t.numel() * t.element_size()
            yield name, t

    def sync(self, restart: bool = False) -> dict[str, float]:
        self.checks.syncs += 1
        coverage = self.checks.coverage_due()  # the same on every rank
        trainer, r = self.trainer, self.trainer.cfg.rollout
        if not self.rank0:  # the gathers only: once per engine, twice with the coverage check
            for _ in range(len(self.urls) * (2 if coverage else 1)):
                for _ in iter_hf_weights(trainer.model, trainer.arch, trainer.ctx):
                    pass
            stats = SyncStats()
        else:
            client = self.side.client

            async def send_all(stats: SyncStats) -> SyncStats:
                for url in self.urls:
                    stats.buckets += await client.send_weights_from_tensor(
                        url, self._weights(stats), bucket_bytes=r.sync_bucket_mb << 20,
                        weight_version=str(trainer.step))
                return stats

            async def push() -> SyncStats:
                t0 = time.perf_counter()
                if "weights" in self.released:
                    await client.resume_memory_occupation(["weights"])
                    self.released.discard("weights")
                stats = await send_all(SyncStats())
                if coverage:  # every engine weight written: checksum -> reset -> send -> checksum
                    await verify_coverage(client, SimpleNamespace(servers=self.urls),
                                          _discard(send_all, SyncStats))
                if self.released:  # KV cache last: it is not needed to load weights
                    await client.resume_memory_occupation(sorted(self.released))
                    self.released.clear()
                stats.seconds = time.perf_counter() - t0
                return stats

            stats = self.side.run_sync(push, trainer.step, restart=restart)
        metrics = {k: float(v) for k, v in stats.as_metrics().items()}
        if self.checks.probe_due():
            metrics.update(probe_engines(trainer, self.side.call if self.rank0 else None,
                                         self.side.client if self.rank0 else None, self.checks,
                                         self.urls))
        metrics["sync/engines"] = float(len(self.urls))
        return metrics

    def save(self, extra: dict[str, Any]) -> None:
        self.state.onload(KINDS)  # a checkpoint reads the parameters and the optimizer state
        self.trainer.save(extra)
        # before_generate frees what the writer reads: the write completes first
        self.trainer.checkpointer.finalize(blocking=True)


def _discard(send_all: Callable, make_stats: Callable) -> Callable:
    """``verify_coverage``'s push: a second send whose statistics are not reported."""
    async def again() -> None:
        await send_all(make_stats())
    return again
