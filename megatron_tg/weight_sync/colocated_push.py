"""The colocated weight push at any engine TP size (docs/colocated.md, "The mapping").

**The mapping.** Engine e's TP rank r sits on the GPU of global trainer rank ``e * tp + r``:
the engines are packed on the trainer's nodes in order, ``tp`` GPUs each. SGLang makes TP
rank r open ``serialized_named_tensors[r]`` and nothing else, and on GPU a payload is CUDA
IPC handles, which only a process on the same node can open. So each of an engine's payloads
comes from the trainer rank on that engine rank's GPU, and :func:`check_engine_layout` checks
once, at start, that those ranks share the engine's host. Ranks past ``num_engines * tp``
(possible on CPU only: on GPU the planner makes the two equal) host no engine rank and take
part in the collectives only.

**One push** (:class:`LockstepPush`), collective over every trainer rank:

* every rank walks the HF tensors in the same order (``iter_hf_weights(everywhere=True)``)
  and packs its own ``rollout.sync_bucket_mb`` bucket on its own device. The TP/EP gathers
  already leave each merged parameter on every member, so no rank needs a copy of rank 0's
  bucket (a broadcast would move the model's bytes once more per sync), and since every rank
  sees the same sizes, every rank knows where a bucket ends: the flushes need no agreement;
* at each flush each engine-hosting rank serialises its bucket (one payload: handles or a
  shared-memory name, not data) and the payloads are gathered on rank 0 over a gloo group
  (Python objects only; no tensor goes through it). Rank 0 sends engine e the payloads of
  ranks ``e * tp .. e * tp + tp - 1``, waits for every engine's reply, and broadcasts its
  verdict; every rank keeps its bucket alive until then, then reuses (host) or frees (CUDA)
  it, or every rank raises with rank 0's error;
* rank 0's own steps between collectives (resuming weights, begin/end weight update, flush,
  version, the coverage checksums) end at an agreement too, so a failure there stops every
  rank at the same point instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from megatron_tg.rollout.transport import FlatBucket, serialize_bucket
from megatron_tg.weight_sync.checks import SyncCheckError, SyncStats
from megatron_tg.weight_sync.sync import iter_hf_weights

_LOOPBACK = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "")


@dataclass(frozen=True)
class RankReport:
    """Where one trainer rank runs, as the mapping check needs it."""

    rank: int
    host: str
    addresses: tuple[str, ...] = ()
    device: str = "cpu"
    local_index: int | None = None
    uuid: str | None = None  # CUDA: torch.cuda.get_device_properties(dev).uuid
    pid: int = 0  # the process whose memory its payloads carry (check_senders)


def report_rank(ctx) -> RankReport:
    """This rank's host (name and addresses) and, on CUDA, its device's UUID and local index
    (the UUID names the GPU whatever ``CUDA_VISIBLE_DEVICES`` each process sees)."""
    host = socket.gethostname()
    try:
        addresses = tuple(sorted(set(socket.gethostbyname_ex(host)[2])))
    except OSError:  # a host whose own name does not resolve: matched by name only
        addresses = ()
    dev = ctx.device
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return RankReport(ctx.rank, host, addresses, str(dev), index, uuid, os.getpid())
    return RankReport(ctx.rank, host, addresses, str(dev), pid=os.getpid())


def resolve(host: str) -> set[str]:
    """The addresses a URL's host name resolves to (empty if it does not)."""
    try:
        return {str(a[4][0]) for a in socket.getaddrinfo(host, None)}
    except OSError:
        return set()


def _is_loopback(host: str) -> bool:
    return host.lower() in _LOOPBACK or host.startswith("127.")


def _same_host(url_host: str, report: RankReport, resolver: Callable[[str], set[str]]) -> bool:
    if url_host.lower() == report.host.lower():
        return True
    if url_host.lower().split(".")[0] == report.host.lower().split(".")[0] and \
            not url_host.replace(".", "").isdigit():  # short and full names of one host
        return True
    return bool(resolver(url_host) & set(report.addresses)) or url_host in report.addresses


def check_engine_layout(urls: Sequence[str], engine_tp: int, reports: Sequence[RankReport], *,
                        tp_sizes: Mapping[str, Any] | None = None,
                        resolver: Callable[[str], set[str]] = resolve) -> str | None:
    """None if every engine TP rank has its trainer rank on the engine's host, else what is
    wrong, naming the engine, the ranks and the hosts. ``reports``: every trainer rank's
    :class:`RankReport`, by rank; ``tp_sizes``: each engine's reported ``tp_size``."""
    why = "rollout.placement='colocated'"
    need = len(urls) * engine_tp
    if need > len(reports):
        return (f"{why}: {len(urls)} engines x rollout.engine_tp={engine_tp} = {need} engine GPUs, but the "
                f"trainer has {len(reports)} ranks; each engine TP rank takes its weights from the trainer "
                f"rank on its GPU")
    for e, url in enumerate(urls):
        reported = (tp_sizes or {}).get(url)
        if reported is not None and int(reported) != engine_tp:
            return (f"{why}: engine {e} ({url}) reports tp_size={reported}, but rollout.engine_tp="
                    f"{engine_tp}; the trainer ranks would hand it {engine_tp} payloads")
        ranks = list(range(e * engine_tp, (e + 1) * engine_tp))
        hosts = {k: reports[k].host for k in ranks}
        if len(set(hosts.values())) > 1:
            return (f"{why}: engine {e} ({url}) has its TP ranks on the GPUs of trainer ranks {ranks}, "
                    f"which are on different hosts {hosts}; one engine's TP ranks share a host")
        url_host = urlparse(url).hostname or ""
        # The engines' URLs are what rank 0 calls: loopback means rank 0's own host.
        where = reports[0] if _is_loopback(url_host) else None
        first = reports[ranks[0]]
        ok = (where.host == first.host) if where is not None else _same_host(url_host, first, resolver)
        if not ok:
            shown = f"{url_host} (rank 0's host, {reports[0].host})" if where is not None else url_host
            return (f"{why}: engine {e} ({url}) is on host {shown}, but trainer ranks {ranks}, whose "
                    f"GPUs its TP ranks use and which hand it their tensors (CUDA IPC handles or "
                    f"shared memory: same host only), are on {first.host}")
    seen: dict[tuple[str, str], int] = {}
    for rep in reports[:need]:
        if rep.uuid is None:
            continue
        other = seen.setdefault((rep.host, rep.uuid), rep.rank)
        if other != rep.rank:
            return (f"{why}: trainer ranks {other} and {rep.rank} on {rep.host} share GPU {rep.uuid} "
                    f"(local index {reports[other].local_index} and {rep.local_index}); each engine TP "
                    f"rank needs the GPU of one trainer rank")
    return None


def check_senders(infos: Mapping[str, Any], urls: Sequence[str], engine_tp: int,
                  reports: Sequence[RankReport]) -> dict[str, list[int]]:
    """Where an engine reports which processes made the shared memory of each TP rank's
    payload in its last from-tensor update (the embedded engine's ``tensor_payloads``; SGLang
    reports none): engine e's rank r must have read trainer rank ``e * tp + r``'s. Returns
    {url: the processes, by engine rank} for those engines; raises naming a mismatch."""
    out: dict[str, list[int]] = {}
    for e, url in enumerate(urls):
        info = infos.get(url)
        acc = info.get("tensor_payloads") if isinstance(info, dict) else None
        if not isinstance(acc, dict) or "last_senders" not in acc:
            continue
        ranks = list(range(e * engine_tp, (e + 1) * engine_tp))
        want = [[reports[k].pid] for k in ranks]
        if acc["last_senders"] != want:
            raise RuntimeError(f"engine {e} ({url}): its TP ranks read payloads made by processes "
                               f"{acc['last_senders']}, but trainer ranks {ranks} are processes {want}")
        out[url] = [k[0] for k in want]
    return out


class LockstepPush:
    """One colocated push, collective over every trainer rank (module docstring). Rank 0
    holds ``client`` (the engines' client, on the rollout side's event loop); every other
    rank passes None."""

    def __init__(self, trainer, urls: Sequence[str], engine_tp: int, group, client=None) -> None:
        self.trainer, self.urls, self.tp, self.group, self.client = trainer, list(urls), engine_tp, group, client
        self.rank0 = trainer.ctx.rank == 0
        self.hosting = trainer.ctx.rank < len(self.urls) * engine_tp  # serialises payloads

    def agree(self, error: tuple[str, str] | None) -> None:
        """Rank 0's verdict on every rank (``(kind, message)`` or None): all raise together."""
        box = [error]
        dist.broadcast_object_list(box, src=0, group=self.group)
        if box[0] is not None:
            kind, message = box[0]
            raise (SyncCheckError if kind == "check" else RuntimeError)(message)

    async def attempt(self, what: str, step: Callable[[], Awaitable[None]] | None) -> tuple[str, str] | None:
        """Rank 0 runs ``step``; its error as a verdict (None elsewhere, or when it worked)."""
        if not self.rank0 or step is None:
            return None
        try:
            await step()
        except SyncCheckError as exc:
            return "check", str(exc)
        except Exception as exc:  # noqa: BLE001 -- every rank stops with the reason
            return "error", f"colocated weight sync: {what} failed: {exc}"
        return None

    async def step(self, what: str, step: Callable[[], Awaitable[None]] | None) -> None:
        """A rank-0 step between collectives, then the agreement (collective)."""
        self.agree(await self.attempt(what, step))

    async def push(self, stats: SyncStats, *, bucket_bytes: int, version: str | None,
                   before: Callable[[], Awaitable[None]] | None = None,
                   after: Callable[[], Awaitable[None]] | None = None) -> None:
        """Every HF tensor into every engine, in buckets of ``bucket_bytes`` (collective).
        Rank 0 runs ``before`` ahead of the engines' ``/begin_weight_update`` and ``after``
        once they have flushed and serve ``version``. ``stats``: tensors and bytes on every
        rank, requests on rank 0, whose figures are the ones reported."""
        client = self.client

        async def begin() -> None:
            if before is not None:
                await before()
            await client.begin_tensor_update(self.urls)

        await self.step("starting the weight update", begin)
        device = self.trainer.ctx.device if self.hosting else torch.device("meta")  # sizes only
        bucket = FlatBucket(bucket_bytes, device)
        trainer = self.trainer
        try:
            for name, t in iter_hf_weights(trainer.model, trainer.arch, trainer.ctx, everywhere=True):
                stats.tensors += 1
                stats.bytes += t.numel() * t.element_size()
                if not bucket.fits(t) and bucket.names:  # the same answer on every rank: the same sizes
                    await self._flush(bucket, stats)
                if bucket.fits(t):
                    bucket.add(name, t)
                else:  # larger than a bucket (the 30B model's embedding, 594 MiB > 512): alone
                    solo = FlatBucket(t.numel() * t.element_size(), device)
                    solo.add(name, t)
                    try:
                        await self._flush(solo, stats)
                    finally:
                        solo.release()
                del t  # else it pins this parameter while the next one is gathered
            if bucket.names:
                await self._flush(bucket, stats)
        except BaseException:
            bucket.recycle()  # every engine has answered (or none was asked)
            bucket.release()
            if self.rank0:  # the engines' open updates are ended; the first error is raised
                await client.end_tensor_update(self.urls, strict=False)
            raise
        bucket.release()

        async def finish() -> None:
            await client.end_tensor_update(self.urls)
            await client.finish_tensor_update(self.urls, version)
            if after is not None:
                await after()

        await self.step("ending the weight update", finish)

    async def _flush(self, bucket: FlatBucket, stats: SyncStats) -> None:
        payload = serialize_bucket(bucket) if self.hosting else None
        payloads: list[str | None] | None = [None] * dist.get_world_size(self.group) if self.rank0 else None
        dist.gather_object(payload, payloads, dst=0, group=self.group)
        sent = 0

        async def send() -> None:
            nonlocal sent
            for e, url in enumerate(self.urls):
                await self.client.send_tensor_payloads(url, payloads[e * self.tp:(e + 1) * self.tp])
                sent += 1

        # Every rank's bucket stays untouched until every engine has answered.
        verdict = await self.attempt(f"a bucket of {len(bucket.names)} tensors", send)
        stats.buckets += sent
        self.agree(verdict)
        bucket.recycle()
