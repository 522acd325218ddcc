"""Engine loss and return around a weight sync: the group is re-formed, never waited on.

A weight-update group is one communicator whose members are fixed when it is formed
(SGLang's ``init_weights_update_group``), so an engine that dies takes every later broadcast
into that communicator down with it: the sync would wait for the collective timeout and the
job die. What happens instead, always collectively over the trainer's ranks (rank 0 decides,
:func:`agree` tells the others, so all of them run the same number of pushes):

* **Loss.** Before each bucket the sender asks which members are lost
  (:meth:`~megatron_tg.rollout.weight_client.WeightUpdateCalls.lost_members`); a push that
  finds one stops sending and reports it. The group is then destroyed and formed again with
  the live engines (``destroy_weights_update_group`` -> ``init_weights_update_group``, the
  endpoints the client already uses) and the whole push is redone into it, so every live
  engine gets every tensor of the version. The dead engine's rollouts are retried on the
  others by the client (connection refused marks it unhealthy at once).
* **Return.** After a sync, an engine outside the group that answers again (restarted, on
  its base weights) is brought to the current weights alone: a group of the trainer and it,
  a push without a version, the log-prob probe of :func:`~.weight_sync.probe_engines`
  against the trainer's, and only then its weight version and a place in the main group.
  Until its version is the expected one the client does not route to it (its health probe
  checks the version), so it never serves the base weights to a rollout.

Residual: an engine that dies *inside* a bucket's broadcast (after the check) leaves the
broadcast to fail or time out (``timeouts.weight_sync_s``); the push then reports it lost
as above, but the live members wait that long first.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import torch.distributed as dist

from megatron_tg.parallel.ports import free_port

if TYPE_CHECKING:
    from megatron_tg.sampling.protocols import WeightTarget
    from megatron_tg.weight_sync.checks import SyncStats

log = logging.getLogger(__name__)

GROUP_NAME = "tg-weights"


def agree(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (a no-op outside a distributed run)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _next_name(target: "WeightTarget", kind: str = "") -> str:
    """A fresh group name per formation, never reused within a run nor across trainer
    processes (``run_id``): engines key their groups by name, and an engine that missed a
    destroy (it was unreachable then) still holds the old one."""
    target.formations += 1
    return f"{GROUP_NAME}-{target.run_id}-{kind}{target.formations}"


def form_target(call: Callable[[Awaitable[Any]], Any], client, master_address: str, backend: str,
                timeout_s: float, router: str | None = None) -> "WeightTarget":
    """The run's weight target: the first group of the trainer and every engine, formed with
    ``call`` (the rollout side's event loop), each rendezvous and broadcast limited to
    ``timeout_s`` (``timeouts.weight_sync_s``). The caller keeps it for the whole run, since
    engine loss and return replace its group and count its names in place. ``router``: the
    sglang-router in front of the engines (``rollout.router_url``), or None."""
    from megatron_tg.sampling.protocols import WeightTarget

    target = WeightTarget(client, None, router=router or None)  # type: ignore[arg-type]
    target.group = call(client.init_weights_update_group(
        master_address, free_port(), _next_name(target), backend, timeout_s=timeout_s))
    return target


async def _out_of_router(target: "WeightTarget", url: str) -> None:
    """Take ``url`` out of the router (a lost engine the router would re-admit on whatever
    weights it restarts with). A router that cannot be reached is logged, not fatal: the
    trainer's own client keeps off an engine at another weight version, and the rollouts
    discard answers from one (``rollout/context.py``)."""
    if target.router is None:
        return
    from megatron_tg.rollout.client import SGLangClientError
    from megatron_tg.rollout.router_admin import remove_worker

    try:
        await remove_worker(target.client, target.router, url)
    except (SGLangClientError, OSError, asyncio.TimeoutError) as exc:
        log.warning("could not take %s out of router %s: %s", url, target.router, exc)


async def drop_engines(target: "WeightTarget", lost: list[str]) -> None:
    """Rank 0: re-form the weight-update group without ``lost``, and take them out of the
    router."""
    live = [u for u in target.group.servers if u not in lost]
    log.warning("weight sync: engine(s) %s lost; re-forming the weight-update group with %s", lost, live)
    for url in lost:
        await _out_of_router(target, url)
    target.group = await target.client.reform_weights_update_group(target.group, live, free_port(),
                                                                   _next_name(target))


async def push_to_live_engines(push: Callable[..., Awaitable["SyncStats"]], target: "WeightTarget | None"
                               ) -> tuple["SyncStats", int]:
    """Collective: ``push`` until it reaches every member of the group, dropping the members
    it finds lost in between. Returns the last push's stats and how many engines were lost.
    A redone push does not compare versions: the members kept may have loaded part of the
    aborted one (an engine may count loads as versions)."""
    dropped = 0
    while True:
        stats = await push(check_versions=not dropped)
        lost = agree(stats.lost if target is not None else None)
        if not lost:
            return stats, dropped
        dropped += len(lost)
        if target is not None:
            await drop_engines(target, lost)


async def _returned(target: "WeightTarget") -> list[str]:
    """Rank 0: the engines outside the group that answer again."""
    from megatron_tg.rollout.client import SGLangClientError

    outside = [u for u in target.client.admin_urls if u not in target.group.servers]
    if not outside:
        return []
    try:  # non-strict: the ones still dead are left out of the answer
        info = await target.client.get_model_info(servers=outside)
    except SGLangClientError:  # none of them answers
        return []
    return [u for u in outside if u in info]


async def _drain(target: "WeightTarget", url: str) -> None:
    """Rank 0: no request reaches ``url`` or runs there while its weights load: out of the
    router, then paused with ``abort`` (what it generated on its base weights is cut; the
    rollouts resubmit those turns elsewhere), so the push does not wait on SGLang's model
    lock behind running requests, no request runs on half-loaded weights, and the flush
    finds it idle."""
    await _out_of_router(target, url)
    await target.client.broadcast("POST", "/pause_generation", {"mode": "abort"}, servers=[url], strict=True)


async def admit_returned(trainer, target: "WeightTarget | None", checks, push_into) -> int:
    """Collective, after a sync: each engine outside the group that answers again is drained
    (:func:`_drain`), gets the current weights alone and a flush while idle, is resumed for
    the log-prob probe against the trainer's (at every pipeline size: the trainer's forward
    is collective), then gets the version, joins the group and goes back into the router.
    ``push_into(group, admitting=True)`` pushes the trainer's weights into a group. Returns
    the number admitted; one that fails stays out of the group and the router (logged)."""
    from megatron_tg.weight_sync.checks import SyncCheckError, compare_logprobs, engine_logprobs, \
        probe_tokens, trainer_logprobs

    client = target.client if target is not None else None
    admitted = 0
    for url in agree(await _returned(target) if client is not None else []):
        solo, verdict = None, None
        if client is not None:
            try:
                await _drain(target, url)
                solo = await client.init_weights_update_group(
                    target.group.master_address, free_port(), _next_name(target, "admit-"),
                    target.group.backend, servers=[url], timeout_s=target.group.timeout_s)
            except Exception as exc:  # noqa: BLE001 - it stays out; the others go on
                verdict = f"could not be drained or grouped: {exc}"
        if agree(verdict) is not None:
            log.warning("engine %s came back but is not admitted: %s", url, verdict)
            continue
        stats = await push_into(solo, admitting=True, flush=True)
        failed = agree(bool(stats.lost) if client is not None else None)
        if not failed:
            tokens = probe_tokens(trainer.arch.vocab_size, checks.probe_tokens)
            mine = trainer_logprobs(trainer.model, trainer.arch, trainer.ctx, tokens)
            if client is not None:
                try:
                    await client.broadcast("POST", "/continue_generation", {}, servers=[url], strict=True)
                    compare_logprobs(url, await engine_logprobs(client, url, tokens), mine,
                                     checks.probe_tol, trainer.step)
                except (SyncCheckError, Exception) as exc:  # noqa: BLE001 - it stays out
                    verdict = str(exc)
            verdict = agree(verdict)
        if client is not None:
            await client.destroy_weights_update_group(solo)
            if failed or verdict:
                log.warning("engine %s came back but is not admitted: %s", url,
                            verdict or "it was lost again during its sync")
            else:
                await client.update_weight_version(str(trainer.step), servers=[url])
                target.group = await client.reform_weights_update_group(
                    target.group, [*target.group.servers, url], free_port(), _next_name(target))
                if target.router is not None:
                    from megatron_tg.rollout.client import SGLangClientError
                    from megatron_tg.rollout.router_admin import add_worker

                    try:
                        await add_worker(client, target.router, url)
                    except (SGLangClientError, OSError, asyncio.TimeoutError) as exc:
                        log.warning("engine %s is in the group but not back in router %s: %s",
                                    url, target.router, exc)
                log.warning("engine %s is back at weight version %d", url, trainer.step)
        admitted += int(not failed and not verdict)
    return admitted
