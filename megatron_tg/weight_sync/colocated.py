"""The phases of a step around training, by ``rollout.placement`` (docs/colocated.md).

The loop calls the same verbs whatever the placement (:class:`Phases`): ``start`` once, then
per step ``before_generate`` -> (generate + judge) -> ``before_train`` -> train ->
``after_train`` -> ``sync`` -> ``save`` when a checkpoint is due -> ``after_sync`` -> (probes,
log).

* **disaggregated** (:class:`Disaggregated`): the engines have GPUs of their own; only
  ``sync`` does anything (:func:`~megatron_tg.weight_sync.sync.sync_to_engines`, the
  broadcast), and ``start`` after a restart.
* **colocated** (:class:`Colocated`): the engines and the trainer take turns on the same GPUs::

      generate      engines hold weights + KV; the trainer's state is offloaded
      before_train  release the engines (all tags; they are idle: at max_staleness=0 the
                    batch was the last thing they generated), check that they hold 0 bytes,
                    onload the trainer
      after_train   offload the trainer's gradients and optimizer state
      sync          resume ``weights`` -> the new weights through ``/update_weights_from_tensor``,
                    bucketed, SGLang's ``flattened_bucket`` format, each engine TP rank's payload
                    from the trainer rank on its GPU (:mod:`~megatron_tg.weight_sync.colocated_push`);
                    the trainer's half of the log-prob probe. Nothing generates: the manager
                    serves the new version only in ``after_sync``, and at max_staleness=0 it
                    generates nothing for it before then
      save          onload the parameters' optimizer state, save, wait for the write (the
                    engines hold their weights only: no KV cache, no CUDA graphs)
      after_sync    offload the trainer's state -> resume ``kv_cache`` and ``cuda_graph`` ->
                    the engines' half of the probe -> the manager serves the new version
      start         (after a restart, or engines released before the model was built:
                    :class:`~megatron_tg.weight_sync.colocated_start.StartupRelease`) offload
                    the gradients and optimizer state, then ``sync`` and ``after_sync``

  So the engines' KV cache and the trainer's optimizer state are never on a GPU together, and
  the KV cache comes back only after the trainer's parameters have left. The parameters stay
  on the device through the sync: the HF tensors are gathered from them over TP/EP/PP with
  the device's collectives (:func:`~megatron_tg.weight_sync.sync.iter_hf_weights`, one pass
  per push, every rank packing its own buckets), so while the engines' weights are resumed
  the GPU holds both copies. Engine loss and return are not handled here: a lost engine fails
  the step (the disaggregated path re-forms its group instead).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

import torch.distributed as dist

from megatron_tg.train.offload import KINDS, TrainerOffload
from megatron_tg.weight_sync.checks import SyncChecks, SyncStats
from megatron_tg.weight_sync.colocated_push import LockstepPush, check_engine_layout, check_senders, report_rank
from megatron_tg.weight_sync.colocated_start import ALL_TAGS, StartupRelease  # noqa: F401 (re-exported)
from megatron_tg.weight_sync.sync import (coverage_check, coverage_reset, engine_probe, sync_to_engines,
                                          trainer_probe)


class Phases(Protocol):
    """What the loop calls around generation and training (collective: every rank calls each)."""

    save_before_serving: bool
    """A due checkpoint is written between ``sync`` and ``after_sync`` (colocated: while the
    engines hold no KV cache), else after the step's metrics are logged."""

    def start(self) -> dict[str, float]:
        """Once, before the first step: the engines serve the trainer's weights (a restart:
        the checkpoint's; colocated engines released at start: any)."""

    def before_generate(self) -> None: ...

    def before_train(self) -> dict[str, float]: ...

    def after_train(self) -> dict[str, float]: ...

    def sync(self, restart: bool = False) -> dict[str, float]:
        """The trainer's weights -> the engines as version ``trainer.step``; ``restart``: the
        engines just started on the base weights and nothing generates yet."""

    def save(self, extra: dict[str, Any]) -> None: ...

    def after_sync(self) -> dict[str, float]:
        """After ``sync`` and any ``save``: the engines ready to generate the next batch."""


class Disaggregated:
    save_before_serving = False

    def __init__(self, trainer, side, checks: SyncChecks, released_at_start: bool = False) -> None:
        self.trainer, self.side, self.checks = trainer, side, checks

    def start(self) -> dict[str, float]:
        if self.trainer.step > 0:  # the engines serve the base weights: bring them to the checkpoint's
            return self.sync(restart=True)
        return {}

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

    def after_sync(self) -> dict[str, float]:
        return {}


def make_phases(trainer, side, checks: SyncChecks, released_at_start: bool = False) -> Phases:
    """The phases ``rollout.placement`` asks for (``side``: rank 0's rollout side, else None;
    ``released_at_start``: the engines gave their memory back before the model was built)."""
    cls = Colocated if trainer.cfg.rollout.placement == "colocated" else Disaggregated
    return cls(trainer, side, checks, released_at_start)


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


async def _nothing() -> SyncStats:
    """The weights are already in the engines (``sync``): the manager's update only serves them."""
    return SyncStats()


def _still_held(infos: dict[str, Any]) -> str | None:
    """Engines released before the model was built that report holding memory (the embedded
    engine reports its bytes; SGLang does not)."""
    held = {u: b for u, b in _held_bytes(infos).items() if b}
    return (f"rollout.placement='colocated': engines released at start still hold memory (bytes): {held}"
            if held else None)


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

    save_before_serving = True

    def __init__(self, trainer, side, checks: SyncChecks, released_at_start: bool = False) -> None:
        self.trainer, self.side, self.checks = trainer, side, checks
        self.rank0 = trainer.ctx.rank == 0
        self.state = TrainerOffload(trainer)
        self.released_at_start = released_at_start
        # rank 0: the engines' released tags (all of them when released before the model was built)
        self.released: set[str] = set(ALL_TAGS) if released_at_start else set()
        self.probe: tuple | None = None  # the trainer's half of the probe, for after_sync
        self.restarting = False  # the pending version is served by adoption (no manager pause)
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
                error = check_engine_layout(urls, tp, reports, tp_sizes=sizes) or (
                    _still_held(infos) if released_at_start else preflight(side))
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
        self.state.offload(KINDS)  # after_sync has; a no-op unless something onloaded since

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

    def start(self) -> dict[str, float]:
        if not (self.released_at_start or self.trainer.step > 0):
            return {}  # the engines serve the base weights, as the trainer holds them
        self.state.offload(["grads", "optimizer"])  # the push needs the parameters only
        metrics = self.sync(restart=True)
        metrics.update(self.after_sync())
        return metrics

    def sync(self, restart: bool = False) -> dict[str, float]:
        """The push, outside the manager's pause: at max_staleness=0 nothing generates until
        ``after_sync`` serves the new version (``restart``: by adoption, the engines having
        just started)."""
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
                stats = self.side.call(run())
            except Exception as exc:
                # The other ranks wait at the push's first agreement (it never started) or at
                # the last one below (it was done); else they stopped with it at its agreement.
                if not entered or finished:
                    push.agree(("error", f"colocated weight sync to version {trainer.step} failed: {exc}"))
                raise
            push.agree(None)
        self.restarting = restart
        metrics = {k: float(v) for k, v in stats.as_metrics().items()}
        # the trainer's half of the probe while its parameters are on the GPU; the engines'
        # half once their KV cache is back (after_sync)
        self.probe = trainer_probe(trainer, self.checks) if self.checks.probe_due() else None
        metrics["sync/engines"] = float(len(self.urls))
        if self.senders:  # the evidence: each engine TP rank read its own trainer rank's memory
            metrics["colocated/payload_senders"] = float(len({p for v in self.senders.values() for p in v}))
            if self.checks.syncs == 1:
                print(f"[colocated] the engines' TP ranks read payloads made by trainer processes "
                      f"{self.senders}", flush=True)
        return metrics

    async def _push_all(self, coverage: bool) -> SyncStats:
        """Resume ``weights``, push, (coverage: checksum -> reset -> push -> checksum);
        collective, the engine calls on rank 0. The KV cache stays released (after_sync)."""
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
        stats.seconds = time.perf_counter() - t0
        return stats

    def save(self, extra: dict[str, Any]) -> None:
        """Between ``sync`` and ``after_sync``: the engines hold their weights and no KV cache."""
        self.state.onload(["params", "optimizer"])  # what a checkpoint reads (not the gradients)
        self.trainer.save(extra)
        # after_sync frees what the writer reads: the write completes first
        self.trainer.checkpointer.finalize(blocking=True)

    def after_sync(self) -> dict[str, float]:
        """Offload the trainer, give the engines their KV cache and CUDA graphs back, run the
        engines' half of the probe, and let the manager serve the new version."""
        t0 = time.perf_counter()
        self.state.offload(KINDS)
        t1 = time.perf_counter()
        error, step = None, self.trainer.step
        if self.rank0:
            try:
                if self.released:
                    self.side.call(self.side.client.resume_memory_occupation(sorted(self.released)))
                    self.released.clear()
            except Exception as exc:  # every rank stops, not only rank 0
                error = f"resuming the engines' memory after the sync to version {step} failed: {exc}"
        self._agree(error)
        metrics = {"colocated/offload_s": t1 - t0, "colocated/resume_s": time.perf_counter() - t1}
        if self.probe is not None:
            tokens, mine = self.probe
            self.probe = None
            metrics.update(engine_probe(self.trainer, self.side.call if self.rank0 else None,
                                        self.side.client if self.rank0 else None, self.checks,
                                        tokens, mine, self.urls))
        error = None
        if self.rank0:  # the manager serves the new weights: generation for them may start
            try:
                self.side.run_sync(_nothing, step, restart=self.restarting)
            except Exception as exc:
                error = f"serving version {step} after the colocated sync failed: {exc}"
        self._agree(error)
        self.restarting = False
        return metrics

