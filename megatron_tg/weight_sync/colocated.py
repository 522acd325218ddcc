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
                    format, each engine TP rank's payload from the trainer rank on its GPU
                    (:mod:`~megatron_tg.weight_sync.colocated_push`) -> resume ``kv_cache``
                    and ``cuda_graph``; then the log-prob probe, which needs the trainer's
                    parameters
      save          onload the trainer's state, save, wait for the write
      before_generate  offload the parameters (and whatever ``save`` brought back)

  The parameters stay on the device through the sync: the HF tensors are gathered from them
  over TP/EP/PP with the device's collectives (:func:`~megatron_tg.weight_sync.sync.iter_hf_weights`,
  one pass per push, every rank packing its own buckets), so while the engines' weights are
  resumed the GPU holds both copies, but neither KV cache nor gradients nor optimizer state. Engine loss and return are not handled here: a lost
  engine fails the step (the disaggregated path re-forms its group instead).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

import torch.distributed as dist

from megatron_tg.train.offload import KINDS, TrainerOffload
from megatron_tg.weight_sync.checks import SyncChecks, SyncStats
from megatron_tg.weight_sync.colocated_push import LockstepPush, check_engine_layout, check_senders, report_rank
from megatron_tg.weight_sync.sync import coverage_check, coverage_reset, probe_engines, sync_to_engines

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
        ctx, tp = trainer.ctx, trainer.cfg.rollout.engine_tp
        # Object collectives only (payload strings, verdicts): gloo, whatever the trainer's
        # backend (NCCL refuses host tensors).
        self.objects = None if ctx.backend == "gloo" else dist.new_group(backend="gloo")
        reports: list | None = [None] * dist.get_world_size() if self.rank0 else None
        dist.gather_object(report_rank(ctx), reports, dst=0, group=self.objects)
        self.reports = reports  # rank 0: where every rank runs
        self.senders: dict[str, list[int]] = {}  # rank 0: who made each engine's payloads
        urls, error = None, None
        if self.rank0:
            if trainer.ctx.device.type == "cpu":  # CPU payloads are shared-memory files
                from megatron_tg.rollout.transport import start_shm_manager

                start_shm_manager()
            urls = list(side.client.admin_urls)
            try:  # an engine that does not answer stops every rank now, not at a collective's timeout
                infos = side.call(side.client.get_server_info(strict=True))
            except Exception as exc:  # noqa: BLE001
                infos, error = {}, f"rollout.placement='colocated': reading the engines' /server_info failed: {exc}"
            bare = [u for u in urls if not _uses_memory_saver(infos.get(u))]
            if error is not None:
                pass
            elif bare:
                error = (f"rollout.placement='colocated': engines {bare} run without "
                         f"--enable-memory-saver; releasing their memory would free nothing")
            else:
                sizes = {u: i.get("tp_size") for u, i in infos.items() if isinstance(i, dict)}
                error = check_engine_layout(urls, tp, reports, tp_sizes=sizes) or preflight(side)
        self.urls = self._agree(error, urls)
        self.pusher = LockstepPush(trainer, self.urls, tp, self.objects, side.client if self.rank0 else None)

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

    def sync(self, restart: bool = False) -> dict[str, float]:
        self.checks.syncs += 1
        coverage = self.checks.coverage_due()  # the same on every rank
        trainer, push = self.trainer, self.pusher
        if not self.rank0:  # the same collectives as rank 0, in the same order
            stats = asyncio.run(self._push_all(coverage))
            push.agree(None)
        else:
            entered, finished = False, False

            async def run() -> SyncStats:
                nonlocal entered, finished
                entered = True
                stats = await self._push_all(coverage)
                finished = True
                return stats

            try:
                stats = self.side.run_sync(run, trainer.step, restart=restart)
            except Exception as exc:
                # The other ranks wait at the push's first agreement (it never started) or at
                # the last one below (it was done); else they stopped with it at its agreement.
                if not entered or finished:
                    push.agree(("error", f"colocated weight sync to version {trainer.step} failed: {exc}"))
                raise
            push.agree(None)
        metrics = {k: float(v) for k, v in stats.as_metrics().items()}
        if self.checks.probe_due():
            metrics.update(probe_engines(trainer, self.side.call if self.rank0 else None,
                                         self.side.client if self.rank0 else None, self.checks,
                                         self.urls))
        metrics["sync/engines"] = float(len(self.urls))
        if self.senders:  # the evidence: each engine TP rank read its own trainer rank's memory
            metrics["colocated/payload_senders"] = float(len({p for v in self.senders.values() for p in v}))
            if self.checks.syncs == 1:
                print(f"[colocated] the engines' TP ranks read payloads made by trainer processes "
                      f"{self.senders}", flush=True)
        return metrics

    async def _push_all(self, coverage: bool) -> SyncStats:
        """Resume ``weights``, push, (coverage: checksum -> reset -> push -> checksum), resume
        the rest; collective, the engine calls on rank 0 (inside the manager's pause there)."""
        t0 = time.perf_counter()
        trainer, push, client = self.trainer, self.pusher, self.side.client if self.rank0 else None
        kw = dict(bucket_bytes=trainer.cfg.rollout.sync_bucket_mb << 20, version=str(trainer.step))

        async def resume_weights() -> None:
            if "weights" in self.released:
                await client.resume_memory_occupation(["weights"])
                self.released.discard("weights")

        async def senders() -> None:  # where the engines report it (the embedded engine)
            self.senders = check_senders(await client.get_server_info(strict=True), self.urls,
                                         trainer.cfg.rollout.engine_tp, self.reports)

        stats = SyncStats()
        await push.push(stats, before=resume_weights, after=senders, **kw)
        if coverage:  # every engine weight written: checksum -> reset -> send -> checksum
            before: dict[str, Any] = {}

            async def reset() -> None:
                before.update(await coverage_reset(client, self.urls))

            await push.push(SyncStats(), before=reset, after=lambda: coverage_check(client, self.urls, before),
                            **kw)

        async def resume_rest() -> None:  # KV cache last: it is not needed to load weights
            if self.released:
                await client.resume_memory_occupation(sorted(self.released))
                self.released.clear()

        await push.step("resuming the engines' memory", resume_rest)
        stats.seconds = time.perf_counter() - t0
        return stats

    def save(self, extra: dict[str, Any]) -> None:
        self.state.onload(KINDS)  # a checkpoint reads the parameters and the optimizer state
        self.trainer.save(extra)
        # before_generate frees what the writer reads: the write completes first
        self.trainer.checkpointer.finalize(blocking=True)

