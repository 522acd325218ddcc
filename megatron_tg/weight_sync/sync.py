"""Weight sync: the trainer's weights -> every rollout engine, in Hugging Face names.

The one owner of the protocol (the loop, the preflight and later scale work call into
here). One sync, while the rollout manager holds the engines paused (``retract`` by
default, so in-flight requests keep their tokens and recompute their KV):

    begin_weight_update -> N x update_weights_from_distributed (flattened buckets,
    flush_cache=false) -> end_weight_update -> update_weight_version -> flush_cache

The engines' version changes only after every bucket has loaded, and the prefix cache
(built by the old weights) is flushed once, while paused (SGLang >= 0.5.21 lets a paused
engine flush with retracted requests waiting). With ``pause_mode=in_place`` requests keep
their KV in the running batch, where SGLang refuses any flush: the flush is skipped and
cached prefixes of the old weights stay in use.

**Streaming.** Collective over the trainer's ranks, one parameter at a time: it is
all-gathered over its TP group (expert-TP for experts), merged with the mapping's
:func:`merge_tp_shards`, all-gathered over EP for experts, converted to HF tensors, and
copied into the one preallocated bucket on global rank 0, which broadcasts the bucket when
the next tensor does not fit. A later pipeline stage streams its parameters to rank 0 the
same way, point to point over the PP group (NCCL on GPU) into receive buffers on rank 0's
device, one parameter at a time (docs/weight-sync-pipeline.md: why a relay and not one
sender per stage). Peak extra memory per rank: one merged parameter (all experts of one
weight kind under EP) with its gather buffers, plus one bucket (rank 0 only). The colocated
push walks the same tensors on every rank instead (``iter_hf_weights(everywhere=True)``: a
later stage's tensors broadcast over each PP group), since there every rank packs the buckets
of the engine rank on its GPU (:mod:`~megatron_tg.weight_sync.colocated_push`).

**Proof the engines serve the new weights** (:class:`SyncChecks`): once, SGLang's weight
checker runs checksum -> reset_tensors -> sync -> checksum, which names every weight the
engine's loader skipped (SGLang's loader drops names it does not know without an error); and
every ``rollout.sync_probe_interval`` syncs, each engine's log-probs of a fixed sequence are
compared with the trainer's own, stopping with :class:`SyncCheckError` naming the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist

from megatron_tg.models.qwen3_moe.config import Qwen3Arch
from megatron_tg.models.qwen3_moe.mapping import current_layout, merge_tp_shards, param_info, to_hf
from megatron_tg.parallel.dims import Axis
from megatron_tg.rollout.transport import FlatBucket
from megatron_tg.train.policy import unwrap
from megatron_tg.weight_sync.checks import (SyncCheckError, SyncChecks, SyncStats, compare_logprobs,
                                           engine_logprobs, probe_tokens, trainer_logprobs)
from megatron_tg.weight_sync.engine_loss import admit_returned, push_to_live_engines

if TYPE_CHECKING:
    from megatron_tg.sampling.protocols import RolloutSource

log = logging.getLogger(__name__)


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    size = dist.get_world_size(group)
    if size == 1:
        return [t]
    t = t.contiguous()  # gloo corrupts non-contiguous tensors silently
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t, group=group)
    return out


def _param_to_hf(name, p, arch, layout, ctx, ep_group, keep: bool) -> list[tuple[str, torch.Tensor]]:
    """One megatron parameter, gathered over TP (and EP for experts), as HF tensors
    (``keep``: on the rank that sends them; elsewhere only the gathers run)."""
    info = param_info(name, arch, layout)
    full = merge_tp_shards(name, _all_gather(p.detach(), ctx.group(Axis.ETP if info.is_expert else Axis.TP)),
                           arch, layout)
    if info.is_expert and dist.get_world_size(ep_group) > 1:
        gathered = _all_gather(full, ep_group)
        del full
        return [hf for r, t in enumerate(gathered) for hf in to_hf(name, t, arch, replace(layout, ep_rank=r))] \
            if keep else []
    return list(to_hf(name, full, arch, layout)) if keep else []


@torch.no_grad()
def iter_hf_weights(model: torch.nn.Module, arch: Qwen3Arch, ctx, *,
                    everywhere: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of the model, one parameter at a time; yielded on global rank 0 only,
    or with ``everywhere`` on every rank, in the same order (:func:`_iter_everywhere`).

    Collective: every rank iterates it to the end in lock-step."""
    from megatron.core import parallel_state as mps

    gpt = unwrap(model)
    layout = current_layout(model=gpt)
    ep_group, pp_group = ctx.group(Axis.EP), ctx.group(Axis.PP)
    pp_size, pp_rank = dist.get_world_size(pp_group), mps.get_pipeline_model_parallel_rank()
    if everywhere:
        yield from _iter_everywhere(gpt, arch, layout, ctx, ep_group, pp_group, pp_size, pp_rank)
        return
    # A later stage reaches rank 0 point to point, from the member of rank 0's PP group.
    on_path = pp_size > 1 and 0 in dist.get_process_group_ranks(pp_group)
    for stage in range(pp_size):
        mine = stage == pp_rank
        relay = on_path and stage > 0 and (ctx.rank == 0 or mine)  # this rank sends or receives
        if not (mine or relay):
            continue
        params = dict(gpt.named_parameters()) if mine else {}
        src = dist.get_global_rank(pp_group, stage) if on_path else None
        names = list(params) if mine else None
        if relay:
            names = _p2p_object(names, src, pp_group)
        for name in names:
            keep = ctx.rank == 0 or (relay and mine)
            pieces = _param_to_hf(name, params[name], arch, layout, ctx, ep_group, keep) if mine else []
            if relay:
                pieces = _p2p_tensors(pieces, src, pp_group, ctx.device)
            if ctx.rank == 0:
                yield from pieces
            del pieces


def _iter_everywhere(gpt, arch, layout, ctx, ep_group, pp_group, pp_size: int, pp_rank: int
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor on every rank, the same sequence everywhere: what the colocated push
    needs, since each rank packs the buckets its engine rank opens (colocated_push.py).

    A stage's ranks get its tensors from their own TP/EP gathers, which already leave the
    merged parameter on every member; the other stages' tensors come broadcast over the PP
    group from the member of that stage, one parameter at a time into buffers on the
    context's device (NCCL moves device memory only). So every rank walks every stage's
    parameters in step, and each rank's peak stays one merged parameter."""
    for stage in range(pp_size):
        mine = stage == pp_rank
        params = dict(gpt.named_parameters()) if mine else {}
        names = list(params) if mine else None
        src = dist.get_global_rank(pp_group, stage) if pp_size > 1 else ctx.rank
        if pp_size > 1:
            names = _bcast_object(names, src, pp_group)
        for name in names:
            pieces = _param_to_hf(name, params[name], arch, layout, ctx, ep_group, True) if mine else []
            if pp_size > 1:
                pieces = _bcast_tensors(pieces, src, pp_group, ctx.device)
            yield from pieces
            del pieces


def _bcast_object(obj, src: int, group):
    """``obj`` from global rank ``src`` to every member of ``group``."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _bcast_tensors(pieces, src: int, group, device: torch.device):
    """One parameter's HF tensors from global rank ``src`` to every member of ``group``,
    received into buffers on ``device``."""
    meta = _bcast_object([(n, t.dtype, tuple(t.shape)) for n, t in pieces] if dist.get_rank() == src else None,
                         src, group)
    out = []
    for i, (n, dtype, shape) in enumerate(meta):
        if dist.get_rank() == src:
            t = pieces[i][1].contiguous()  # gloo corrupts non-contiguous tensors silently
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=src, group=group)
        out.append((n, t))
    return out


def _p2p_object(obj, src: int, group):
    """``obj`` from global rank ``src`` to global rank 0 over ``group`` (the PP group both
    are in; the caller is one of the two)."""
    box = [obj]
    if dist.get_rank() == src:
        dist.send_object_list(box, dst=0, group=group)
    else:
        dist.recv_object_list(box, src=src, group=group)
    return box[0]


def _p2p_tensors(pieces, src: int, group, device: torch.device):
    """One parameter's HF tensors from global rank ``src`` to global rank 0 over ``group``.

    The receive buffers are on ``device`` (the parallel context's: the GPU under NCCL, which
    refuses host tensors); rank 0 then packs them into its bucket, so it holds one relayed
    parameter at a time, like the parameters of its own stage."""
    meta = _p2p_object([(n, t.dtype, tuple(t.shape)) for n, t in pieces] if pieces else None, src,
                       group)
    out = []
    for i, (n, dtype, shape) in enumerate(meta):
        if dist.get_rank() == src:
            dist.send(pieces[i][1].contiguous(), dst=0, group=group)
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(t, src=src, group=group)
            out.append((n, t))
    return out


async def push_weights(client, group, model: torch.nn.Module, arch: Qwen3Arch, ctx, *,
                       version: int, bucket_bytes: int = 512 * 2**20,
                       dtype: torch.dtype | None = None, flush: bool = True,
                       admitting: bool = False, check_versions: bool = True) -> SyncStats:
    """Collective: all trainer ranks call it; rank 0 (the sender) needs ``client``/``group``
    (``None`` elsewhere). The caller holds the engines paused (the rollout manager does).

    ``dtype``: convert while packing (e.g. bf16 engines from fp32 trainer weights).
    ``flush``: flush the engines' cache at the end (False for ``pause_mode=in_place``).
    ``admitting``: a returned engine alone; its version is set only once a check passed.
    ``check_versions``: a member reporting another version than the last synced is lost (a
    restarted process); off when redoing a push whose first try loaded part of the weights.

    Before each bucket the sender asks which members are lost (:meth:`lost_members`); once
    one is, it stops sending (the other ranks' gathers go on to the end) and returns with
    ``stats.lost`` set, and the caller re-forms the group and pushes again."""
    start = time.perf_counter()
    stats = SyncStats()
    sender = client is not None
    bucket = FlatBucket(bucket_bytes, group.group.device) if sender else None

    begun = False  # versions are compared before the push only: loading a bucket may change them

    async def lost() -> bool:
        if not stats.lost:
            stats.lost = await client.lost_members(group, versions=check_versions and not
                                                   (admitting or begun))
        return bool(stats.lost)

    async def send(what) -> None:
        if await lost():
            return  # draining: nothing more goes into a group with a dead member
        try:
            await client.update_weights_from_distributed(group, what, flush_cache=False)
        except Exception:
            if not await lost():  # a failure with every member alive is not an engine loss
                raise
            return
        stats.buckets += 1

    async def pack(name: str, t: torch.Tensor) -> None:
        d = dtype or t.dtype
        stats.tensors += 1
        stats.bytes += t.numel() * d.itemsize
        if not sender or stats.lost:
            return
        if not bucket.fits(t, d) and bucket.names:
            await send(bucket)
            bucket.clear()
        if bucket.fits(t, d):
            bucket.add(name, t, d)
        else:  # larger than a bucket: goes alone, as a plain per-tensor broadcast
            await send([(name, t.to(device=bucket.device, dtype=d).contiguous())])

    if sender and not await lost():
        begun = True
        try:
            await client.begin_weight_update(group)
        except Exception:
            if not await lost():
                raise
    for item in iter_hf_weights(model, arch, ctx):
        await pack(*item)
        del item  # else it pins the previous parameter while the next one is gathered
    if sender:
        if bucket.names:
            await send(bucket)
        bucket.release()
        if not stats.lost:
            await client.end_weight_update(group)
            if not admitting:
                await client.update_weight_version(str(version), servers=group.servers)
            if flush:
                await client.flush_cache(servers=group.servers, strict=True)
    stats.seconds = time.perf_counter() - start
    return stats


# ---- proof that the engines serve what was sent ------------------------------------------
def _rank_checksums(url: str, reply: Any) -> dict[tuple, dict[str, str]]:
    """SGLang's ``/weights_checker`` checksum reply -> {(tp, pp, dp rank): {tensor: hash}}."""
    ranks = reply.get("ranks") if isinstance(reply, dict) else None
    if not isinstance(ranks, list) or not ranks:
        raise SyncCheckError(f"engine {url}: /weights_checker checksum returned no per-rank checksums "
                             f"({str(reply)[:200]}); the coverage check needs SGLang >= 0.5.23's reply")
    out = {}
    for r in ranks:
        info = r.get("parallelism_info") or {}
        info = info[0] if isinstance(info, list) and info else info
        out[(info.get("tp_rank", 0), info.get("pp_rank", 0), info.get("dp_rank", 0))] = dict(r["checksums"])
    return out


def coverage_gaps(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[str]]:
    """Per engine, the tensors whose checksum after reset -> push differs from before it (the
    push did not write them, so they kept the reset's noise), named ``tp<i>:<name>``."""
    gaps: dict[str, list[str]] = {}
    for url in before:
        b, a = _rank_checksums(url, before[url]), _rank_checksums(url, after.get(url))
        bad = [f"tp{k[0]}:{n}" for k in sorted(b) for n, h in b[k].items() if a.get(k, {}).get(n) != h]
        if bad:
            gaps[url] = bad
    return gaps


async def verify_coverage(client, group, push) -> None:
    """SGLang's weight checker around a second push of the weights the engines already hold:
    checksum -> reset_tensors -> push -> checksum. A weight the push does not write keeps the
    reset's noise, its checksum changes, and the error names it.

    Checksums, not SGLang's snapshot -> compare: a snapshot copies every TP rank's weights
    into host memory (the whole model per engine, ~240 GB per rollout node at 30B), while a
    checksum is a hash per tensor; both see the same tensors (SGLang skips the same names in
    reset, compare and checksum). ``megatron-tg memory`` prints both figures."""
    before = await coverage_reset(client, group.servers)
    await push()
    await coverage_check(client, group.servers, before)


async def coverage_reset(client, servers) -> dict[str, Any]:
    """The first half of :func:`verify_coverage`: the engines' checksums, then their weights
    overwritten with noise; returns the checksums."""
    before = await client.weights_checker("checksum", servers=servers)
    await client.weights_checker("reset_tensors", servers=servers)
    return before


async def coverage_check(client, servers, before: dict[str, Any]) -> None:
    """The second half, after the push: raises naming every weight whose checksum changed."""
    after = await client.weights_checker("checksum", servers=servers)
    gaps = coverage_gaps(before, after)
    if gaps:
        detail = "; ".join(f"{url}: {len(names)} tensor(s), e.g. {', '.join(names[:8])}"
                           for url, names in gaps.items())
        raise SyncCheckError(f"a weight sync leaves engine weights unwritten (their checksums changed "
                             f"after reset_tensors and a second push): {detail}")


def probe_engines(trainer, call, client, checks: SyncChecks, servers=None) -> dict[str, float]:
    """Collective: the trainer's log-probs of the probe sequence against each engine's
    (``servers``: the weight-update group's members; default every admin URL).

    Rank 0 asks every engine (``call`` runs a coroutine on the rollout side's loop); the
    verdict is broadcast so that every rank stops together when an engine is wrong."""
    tokens, mine = trainer_probe(trainer, checks)
    return engine_probe(trainer, call, client, checks, tokens, mine, servers)


def trainer_probe(trainer, checks: SyncChecks) -> tuple[list[int], torch.Tensor]:
    """Collective: the probe sequence and the trainer's log-probs of it (the first half of
    :func:`probe_engines`; colocated runs it before the parameters leave the GPU)."""
    tokens = probe_tokens(trainer.arch.vocab_size, checks.probe_tokens)
    return tokens, trainer_logprobs(trainer.model, trainer.arch, trainer.ctx, tokens)


def engine_probe(trainer, call, client, checks: SyncChecks, tokens: list[int], mine: torch.Tensor,
                 servers=None) -> dict[str, float]:
    """Collective: each engine's log-probs of ``tokens`` against the trainer's ``mine`` (the
    second half of :func:`probe_engines`; needs engines that can generate)."""
    ctx = trainer.ctx
    verdict: float | str | None = None
    if ctx.rank == 0:
        url = None
        try:
            worst = 0.0
            for url in (servers if servers is not None else client.admin_urls):
                engine = call(engine_logprobs(client, url, tokens))
                worst = max(worst, compare_logprobs(url, engine, mine, checks.probe_tol, trainer.step))
            verdict = worst
        except SyncCheckError as exc:
            verdict = str(exc)
        except Exception as exc:  # an engine that cannot answer after a sync is not serving
            verdict = f"engine {url} failed the log-prob probe after the sync to version {trainer.step}: {exc}"
    box = [verdict]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise SyncCheckError(box[0])
    return {"sync/probe_logprob_diff": float(box[0])}


def sync_to_engines(trainer, side: "RolloutSource | None", checks: SyncChecks, *,
                    restart: bool = False) -> dict[str, float]:
    """Collective: the trainer's weights -> every live engine, as policy version
    ``trainer.step``, then the checks that prove the engines serve them, then the return of
    engines that were lost and answer again (:mod:`megatron_tg.weight_sync.engine_loss`).

    ``side`` is global rank 0's rollout side (None on the other ranks, which take part in the
    gathers only). ``restart``: the engines just started on the base weights while the
    manager (restored from the checkpoint) already counts ``trainer.step``; nothing is
    generating yet, so the push goes straight to the engines without a version bump."""
    r, checks.syncs = trainer.cfg.rollout, checks.syncs + 1
    target = side.weight_target() if side is not None else None
    client = target.client if target is not None else None

    async def push_into(group, admitting: bool = False, check_versions: bool = True, flush=None):
        # flush: an admitted engine is paused with abort, so idle (engine_loss._drain)
        return await push_weights(client, group, trainer.model, trainer.arch, trainer.ctx,
                                  version=trainer.step, bucket_bytes=r.sync_bucket_mb << 20,
                                  flush=r.pause_mode != "in_place" if flush is None else flush,
                                  admitting=admitting, check_versions=check_versions)

    async def push(check_versions: bool = True):  # into the group as it is now (a loss replaces it)
        return await push_into(target.group if target is not None else None,
                               check_versions=check_versions)

    lost = 0

    async def push_and_verify():
        nonlocal lost
        stats, lost = await push_to_live_engines(push, target)
        if checks.coverage_due():  # all ranks agree: the second push is collective too
            await (verify_coverage(client, target.group, push) if client else push())
        return stats

    if side is None:
        stats = asyncio.run(push_and_verify())
    else:  # the side pauses its engines around the push and sets their version
        stats = side.run_sync(push_and_verify, trainer.step, restart=restart)
    metrics = stats.as_metrics()
    if checks.probe_due():
        metrics.update(probe_engines(trainer, None if side is None else side.call, client, checks,
                                     None if target is None else target.group.servers))
    run = asyncio.run if side is None else side.call
    admitted = run(admit_returned(trainer, target, checks, push_into))
    metrics.update({"sync/engines_lost": float(lost), "sync/engines_admitted": float(admitted)})
    if target is not None:
        metrics["sync/engines"] = float(len(target.group.servers))
    return metrics
