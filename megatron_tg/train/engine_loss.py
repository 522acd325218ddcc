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

import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import torch.distributed as dist

from megatron_tg.parallel.ports import free_port

if TYPE_CHECKING:
    from megatron_tg.train.protocols import WeightTarget
    from megatron_tg.train.weight_sync import SyncStats

log = logging.getLogger(__name__)

GROUP_NAME = "tg-weights"


def agree(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (a no-op outside a distributed run)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _next_name(target: "WeightTarget") -> str:
    """A fresh group name per formation: engines key their groups by name."""
    target.formations += 1
    return f"{GROUP_NAME}-{target.formations}"


async def drop_engines(target: "WeightTarget", lost: list[str]) -> None:
    """Rank 0: re-form the weight-update group without ``lost``."""
    live = [u for u in target.group.servers if u not in lost]
    log.warning("weight sync: engine(s) %s lost; re-forming the weight-update group with %s", lost, live)
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


async def admit_returned(trainer, target: "WeightTarget | None", checks, push_into) -> int:
    """Collective, after a sync: each engine outside the group that answers again gets the
    current weights alone, is checked by the log-prob probe, then gets the version and joins
    the group. ``push_into(group, admitting=True)`` pushes the trainer's weights into a group.
    Returns the number admitted; one that fails the check stays out (logged)."""
    from megatron_tg.train.weight_sync import SyncCheckError, compare_logprobs, engine_logprobs, \
        probe_tokens, trainer_logprobs

    client = target.client if target is not None else None
    back: list[str] = []
    if client is not None:
        outside = [u for u in client.admin_urls if u not in target.group.servers]
        if outside:
            from megatron_tg.rollout.client import SGLangClientError

            try:  # non-strict: the ones still dead are left out of the answer
                info = await client.get_model_info(servers=outside)
            except SGLangClientError:  # none of them answers
                info = {}
            back = [u for u in outside if u in info]
    admitted = 0
    for url in agree(back):
        solo = None
        if client is not None:
            solo = await client.init_weights_update_group(
                target.group.master_address, free_port(), f"{GROUP_NAME}-admit", target.group.backend,
                servers=[url], timeout_s=target.group.timeout_s)
        stats = await push_into(solo, admitting=True)
        failed = agree(bool(stats.lost) if client is not None else None)
        verdict = None
        if not failed and trainer.ctx.dims.pp == 1:  # the probe runs the forward in one stage
            tokens = probe_tokens(trainer.arch.vocab_size, checks.probe_tokens)
            mine = trainer_logprobs(trainer.model, trainer.arch, trainer.ctx, tokens)
            if client is not None:
                try:
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
                log.warning("engine %s is back at weight version %d", url, trainer.step)
        admitted += int(not failed and not verdict)
    return admitted
