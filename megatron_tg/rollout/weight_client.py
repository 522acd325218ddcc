"""The client's weight-update calls, as SGLang accepts them (mixed into ``SGLangClient``).

What each engine is and can do is read once, from ``/server_info`` (``/get_server_info``
on servers that predate it): its SGLang version and its parallel sizes.

* **Versions.** ``update_weights_from_distributed`` is used from SGLang 0.5.21 on
  (:data:`MIN_SGLANG`): from 0.5.21 it must run inside ``/begin_weight_update`` ...
  ``/end_weight_update`` (a bare call is refused with HTTP 400 before the engine joins
  the broadcast), and from 0.5.21 a paused scheduler's ``/flush_cache`` ignores its
  waiting queue, which is what lets a sync pause with ``retract`` and still flush. Older
  servers are refused with an error naming the server and its version. 0.6 and later are
  untested: a warning, then the same protocol.
* **Group layout.** SGLang ranks each engine GPU ``rank_offset + tp_rank`` in the group,
  so the group counts GPUs, not servers: ``world_size = 1 + sum(GPUs per engine)`` and
  engine i gets ``rank_offset = 1 + GPUs of engines 0..i-1``. Engines with pipeline stages
  (only ``tp_rank`` offsets a rank, so stages would collide) or data-parallel replicas
  (SGLang asserts ``dp_size == 1`` for this call) are refused.
* **Transport.** NCCL with GPU tensors on clusters, gloo on CPU; the trainer's side is
  formed by :func:`~megatron_tg.rollout.transport.init_weight_update_group`, the same
  way SGLang forms the engines' side.
* **From tensors** (colocated engines, same host): ``/update_weights_from_tensor`` carries
  handles to tensors this process holds, one payload per engine TP rank, in SGLang's
  ``MultiprocessingSerializer`` / ``FlattenedTensorBucket`` format
  (:mod:`~megatron_tg.rollout.transport`); :meth:`WeightUpdateCalls.send_weights_from_tensor`
  packs buckets and sends them one at a time between one begin and one end call, every
  payload from this process. The colocated trainer sends each engine rank the payload of the
  trainer rank on its GPU (:mod:`megatron_tg.weight_sync.colocated_push`) through the same
  pieces: ``begin_tensor_update``, ``send_tensor_payloads``, ``end_tensor_update``,
  ``finish_tensor_update``.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlparse
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from packaging.version import InvalidVersion, Version

from .errors import SGLangClientError
from .transport import (LOAD_FORMAT_BUCKET, FlatBucket, WeightUpdateGroup, describe, init_weight_update_group,
                        send_tensors, serialize_bucket)

log = logging.getLogger(__name__)

MIN_SGLANG = Version("0.5.21")
"""Oldest SGLang whose weight-update rules this client follows (begin/end weight-update calls, a
paused flush that ignores retracted requests)."""
UNTESTED_FROM = Version("0.6")


@dataclass(frozen=True)
class EngineInfo:
    """One server's answer to /server_info, as far as weight sync needs it."""

    url: str
    version: str
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1

    @property
    def gpus(self) -> int:
        """Members this engine adds to the weight-update group."""
        return self.tp_size * self.pp_size * self.dp_size


@dataclass
class TrainerWeightGroup:
    """Trainer-side handle of the weight-update group (the trainer is rank 0)."""

    group: WeightUpdateGroup
    group_name: str
    servers: list[str]
    rank_offsets: list[int]
    master_address: str = "127.0.0.1"
    backend: str = "gloo"
    timeout_s: float = 300.0


def check_weight_sync(info: EngineInfo) -> None:
    """Raise if weights cannot be synced to this engine the way this client does it."""
    try:
        v = Version(info.version)
    except InvalidVersion:
        raise SGLangClientError(f"{info.url}: /server_info reports version {info.version!r}, not an SGLang "
                                f"release; cannot tell which weight-update rules it follows") from None
    if v < MIN_SGLANG:
        raise SGLangClientError(
            f"{info.url} runs SGLang {info.version}, older than {MIN_SGLANG}, the oldest release weight sync "
            f"supports (it has no begin/end weight-update calls, and its flush fails while retracted "
            f"requests wait); install sglang>={MIN_SGLANG},<{UNTESTED_FROM}")
    if v >= UNTESTED_FROM:
        log.warning("%s runs SGLang %s; weight sync was tested up to %s only", info.url, info.version, "0.5.23")
    if info.pp_size > 1:
        raise SGLangClientError(
            f"{info.url} runs pp_size={info.pp_size}: SGLang ranks weight-update group members "
            f"rank_offset + tp_rank only, so its pipeline stages would claim the same ranks; "
            f"start rollout engines with pp_size=1")
    if info.dp_size > 1:
        raise SGLangClientError(
            f"{info.url} runs dp_size={info.dp_size}: SGLang refuses update_weights_from_distributed with "
            f"data-parallel replicas; start one engine per replica instead")


def group_layout(infos: Sequence[EngineInfo]) -> tuple[int, list[int]]:
    """(world_size, rank_offset per engine) of a group of the trainer plus these engines."""
    offsets, nxt = [], 1
    for info in infos:
        offsets.append(nxt)
        nxt += info.gpus
    return nxt, offsets


class _AdminCalls(Protocol):
    admin_urls: list[str]
    health_timeout_s: float
    expected_weight_version: str | None

    async def _model_info(self, url: str, timeout: Any) -> dict[str, Any] | None: ...

    async def _call(self, url: str, method: str, path: str, body: Any = None,
                    timeout_s: float | None = None) -> Any: ...

    async def _server_info(self, url: str) -> Any: ...

    async def broadcast(self, method: str, path: str, body: Any = None, servers=None,
                        strict: bool = False) -> dict[str, Any]: ...

    async def _after_weight_update(self, ok: dict[str, Any], weight_version: str | None) -> None: ...


class WeightUpdateCalls:
    """Weight-update endpoints, mixed into ``SGLangClient`` (which provides what
    :class:`_AdminCalls` lists). Every call here is strict: an engine that misses one
    would serve other weights than the rest."""

    _engine_infos: dict[str, EngineInfo]

    async def engine_info(self, url: str) -> EngineInfo:
        """Version and parallel sizes of one server (read once, then cached)."""
        cache = self._engine_infos
        if url not in cache:
            body = await self._server_info(url)
            if not isinstance(body, dict) or "version" not in body:
                raise SGLangClientError(f"{url}/server_info: expected a JSON object with 'version', got {body!r:.200}")
            cache[url] = EngineInfo(url, str(body["version"]), int(body.get("tp_size") or 1),
                                    int(body.get("pp_size") or 1), int(body.get("dp_size") or 1))
        return cache[url]

    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        group_name: str = "weight_update_group", backend: str = "gloo",
                                        servers: Sequence[str] | None = None,
                                        timeout_s: float = 300.0) -> TrainerWeightGroup:
        """Form the trainer(rank 0)-to-engines group, laid out by each engine's GPU count."""
        urls = list(servers) if servers is not None else list(self.admin_urls)
        infos = [await self.engine_info(u) for u in urls]
        for info in infos:
            check_weight_sync(info)
        world, offsets = group_layout(infos)
        posts = [self._call(u, "POST", "/init_weights_update_group",
                            {"master_address": master_address, "master_port": int(master_port),
                             "rank_offset": off, "world_size": world, "group_name": group_name,
                             "backend": backend})
                 for u, off in zip(urls, offsets)]
        # The store admits the engines' hosts only (store_gate.py: TCPStore has no authentication).
        mine = asyncio.to_thread(init_weight_update_group, master_address, master_port, 0, world,
                                 group_name, backend, timeout_s, [urlparse(u).hostname for u in urls])
        results = await asyncio.gather(mine, *posts, return_exceptions=True)
        errors = [(u, r) for u, r in zip(["<trainer>"] + urls, results) if isinstance(r, BaseException)]
        if errors:
            if not isinstance(results[0], BaseException):
                results[0].close()
            raise SGLangClientError(f"init_weights_update_group failed: {errors}", errors=errors)
        return TrainerWeightGroup(results[0], group_name, urls, offsets, master_address, backend, timeout_s)

    async def begin_weight_update(self, group: TrainerWeightGroup) -> dict[str, Any]:
        return await self.broadcast("POST", "/begin_weight_update", {}, servers=group.servers, strict=True)

    async def end_weight_update(self, group: TrainerWeightGroup) -> dict[str, Any]:
        return await self.broadcast("POST", "/end_weight_update", {}, servers=group.servers, strict=True)

    async def update_weights_from_distributed(
        self, group: TrainerWeightGroup, tensors: FlatBucket | Sequence[tuple[str, Any]], *,
        weight_version: str | None = None, flush_cache: bool = False,
    ) -> dict[str, Any]:
        """Broadcast one bucket (``FlatBucket``: ``load_format="flattened_bucket"``) or a
        list of tensors (one broadcast each) while every engine's HTTP call is open.

        ``flush_cache`` defaults to False: a sync flushes once, after its last bucket
        (:meth:`flush_cache`); SGLang's default of True fails on a busy engine."""

        if isinstance(tensors, FlatBucket):
            fields = {"names": tensors.names, "dtypes": tensors.dtypes, "shapes": tensors.shapes,
                      "load_format": "flattened_bucket"}
            flat = tensors.flat()
            sent = asyncio.to_thread(group.group.broadcast, flat)
        else:
            fields = describe(tensors)
            sent = asyncio.to_thread(send_tensors, group.group, tensors)
        body = {**fields, "group_name": group.group_name, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = weight_version
        posts = [asyncio.ensure_future(self._call(u, "POST", "/update_weights_from_distributed", body))
                 for u in group.servers]
        results = await asyncio.gather(sent, *posts, return_exceptions=True)
        errors = [(u, r) for u, r in zip(["<trainer>"] + group.servers, results) if isinstance(r, BaseException)]
        if errors:
            raise SGLangClientError(f"update_weights_from_distributed failed: {errors}", errors=errors)
        ok = dict(zip(group.servers, results[1:]))
        if weight_version is not None:
            await self._after_weight_update(ok, weight_version)
        return ok

    async def update_weights_from_tensor(self, url: str, serialized_named_tensors: Sequence[str], *,
                                         load_format: str | None = LOAD_FORMAT_BUCKET, flush_cache: bool = False,
                                         abort_all_requests: bool = False,
                                         weight_version: str | None = None) -> dict[str, Any]:
        """One ``/update_weights_from_tensor`` to one engine: ``serialized_named_tensors[r]`` is
        what the engine's TP rank r opens, so its length must be the engine's tp_size (checked
        here: SGLang would index by rank and ignore extra entries). ``flush_cache`` defaults to
        False as for the broadcast path: a sync flushes once, after its last bucket."""
        info = await self.engine_info(url)
        if len(serialized_named_tensors) != info.tp_size:
            raise SGLangClientError(f"{url}: update_weights_from_tensor needs one payload per TP rank "
                                    f"(tp_size={info.tp_size}), got {len(serialized_named_tensors)}")
        body = {"serialized_named_tensors": list(serialized_named_tensors), "load_format": load_format,
                "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._call(url, "POST", "/update_weights_from_tensor", body)

    async def send_weights_from_tensor(self, url: str, named_tensors, *, bucket_bytes: int,
                                       weight_version: str | None = None) -> int:
        """Write ``named_tensors`` (HF names) into one engine from this process, in
        ``flattened_bucket`` requests of at most ``bucket_bytes``, inside one
        ``/begin_weight_update`` ... ``/end_weight_update`` pair; then flush, and set
        ``weight_version`` if given. Returns the number of requests sent.

        Peak extra memory is one bucket: each is packed, sent, and reused (CPU) or freed
        (GPU) only after the engine's reply, since the engine reads the bucket's memory itself
        while the request runs. Every TP rank gets its own payload of the same bucket, all
        from this process: right for an engine whose ranks can open this process's memory
        (one GPU, or the host). Colocated trainers send from every rank instead
        (:mod:`megatron_tg.weight_sync.colocated_push`), through the same calls below."""
        info = await self.engine_info(url)
        await self.begin_tensor_update([url])
        sent, bucket = 0, None
        try:
            for name, t in named_tensors:
                if bucket is None:
                    bucket = FlatBucket(bucket_bytes, t.device)
                if not bucket.fits(t) and bucket.names:
                    sent += await self._send_bucket(url, bucket, info.tp_size)
                if bucket.fits(t):
                    bucket.add(name, t)
                    continue
                # larger than a bucket: in a bucket of its own size, as the broadcast sends it alone
                solo = FlatBucket(t.numel() * t.element_size(), t.device)
                solo.add(name, t)
                try:
                    sent += await self._send_bucket(url, solo, info.tp_size)
                finally:
                    solo.release()
            if bucket is not None and bucket.names:
                sent += await self._send_bucket(url, bucket, info.tp_size)
        except BaseException:
            if bucket is not None:
                bucket.release()
            await self.end_tensor_update([url], strict=False)  # the first error is the one raised
            raise
        if bucket is not None:
            bucket.release()
        await self.end_tensor_update([url])
        await self.finish_tensor_update([url], weight_version)
        return sent

    async def _send_bucket(self, url: str, bucket: FlatBucket, tp_size: int) -> int:
        # One serialisation per rank: each takes one reference the opening rank gives back.
        await self.send_tensor_payloads(url, [serialize_bucket(bucket) for _ in range(tp_size)])
        bucket.recycle()  # the engine has answered
        return 1

    # The pieces of a from-tensor update, shared by the one-process path above and the
    # colocated trainer's push, in which every rank serialises its own copy of each bucket.
    async def begin_tensor_update(self, urls: Sequence[str]) -> None:
        """``/begin_weight_update`` on every engine (SGLang refuses a from-tensor update
        outside one); if one refuses, the ones already begun are ended again."""
        begun: list[str] = []
        try:
            for url in urls:
                await self._call(url, "POST", "/begin_weight_update", {})
                begun.append(url)
        except Exception:
            await self.end_tensor_update(begun, strict=False)
            raise

    async def send_tensor_payloads(self, url: str, payloads: Sequence[str]) -> None:
        """One bucket into one engine: ``payloads[r]`` is what its TP rank r opens. Raises
        unless the engine reports success; the bucket's memory must stay untouched until then."""
        reply = await self.update_weights_from_tensor(url, payloads)
        if not (isinstance(reply, dict) and reply.get("success")):
            raise SGLangClientError(f"{url}: update_weights_from_tensor failed: {reply!r:.500}")

    async def end_tensor_update(self, urls: Sequence[str], *, strict: bool = True) -> None:
        """``/end_weight_update`` on every engine, each tried even when one fails; ``strict``:
        raise naming those that failed (off when ending after another error, which wins)."""
        errors: list[tuple[str, BaseException]] = []
        for url in urls:
            try:
                await self._call(url, "POST", "/end_weight_update", {})
            except Exception as exc:  # noqa: BLE001 -- the others must still be ended
                errors.append((url, exc))
        if errors and strict:
            raise SGLangClientError(f"end_weight_update failed: {errors}", errors=errors)
        for url, exc in errors:
            log.warning("%s: end_weight_update after a failed update: %s", url, exc)

    async def finish_tensor_update(self, urls: Sequence[str], weight_version: str | None) -> None:
        """After every bucket has loaded: flush each engine's cache (built by the old weights),
        then set ``weight_version`` where given."""
        for url in urls:
            await self._call(url, "POST", "/flush_cache", {})
        if weight_version is not None:
            await self.update_weight_version(str(weight_version), servers=list(urls))

    async def update_weight_version(self, version: str, servers: Sequence[str] | None = None) -> dict[str, Any]:
        """Set the version engines report (requests keep running: abort_all_requests=False)."""
        ok = await self.broadcast("POST", "/update_weight_version",
                                  {"new_version": str(version), "abort_all_requests": False},
                                  servers=servers, strict=True)
        await self._after_weight_update(ok, str(version))
        return ok

    async def weights_checker(self, action: str, servers: Sequence[str] | None = None) -> dict[str, Any]:
        """SGLang's /weights_checker: "snapshot", "reset_tensors", "compare" or "checksum"."""
        return await self.broadcast("POST", "/weights_checker", {"action": action}, servers=servers, strict=True)

    async def destroy_weights_update_group(self, group: TrainerWeightGroup) -> None:
        try:
            await self.broadcast("POST", "/destroy_weights_update_group", {"group_name": group.group_name},
                                 servers=group.servers)
        finally:
            group.group.close()

    # ---- engine loss and return -------------------------------------------------------------
    async def lost_members(self, group: TrainerWeightGroup, versions: bool = True) -> list[str]:
        """Members of ``group`` that cannot take the next broadcast: not answering
        ``/model_info`` (dead, or the host is gone), or answering with a weight version other
        than the last one synced (a restarted process at the same URL: it left the group when
        its predecessor died; ``versions=False`` skips that test, for an engine being
        admitted). Asked before every bucket, so a sync stops between buckets
        instead of broadcasting into a communicator with a dead member."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.health_timeout_s)
        expected = self.expected_weight_version if versions else None

        async def lost(url: str) -> bool:
            try:
                info = await self._model_info(url, timeout)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                return True
            if info is None:
                return True
            return expected is not None and str(info.get("weight_version")) != expected

        flags = await asyncio.gather(*(lost(u) for u in group.servers))
        return [u for u, bad in zip(group.servers, flags) if bad]

    async def reform_weights_update_group(self, group: TrainerWeightGroup, servers: Sequence[str],
                                          master_port: int, group_name: str) -> TrainerWeightGroup:
        """Destroy ``group`` (closing any open weight-update on the members still there) and
        form a new one with ``servers``: SGLang's way to drop a dead member or add a returned
        one, since a communicator's members are fixed at its creation."""
        gone = [u for u in group.servers if u not in servers]
        keep = [u for u in group.servers if u not in gone]
        if keep:  # an aborted sync left /begin_weight_update open there; errors: none was open
            try:
                await self.broadcast("POST", "/end_weight_update", {}, servers=keep)
            except SGLangClientError:
                pass
        try:
            await self.destroy_weights_update_group(group)
        except SGLangClientError as exc:  # every member gone: only the trainer side closes
            log.warning("destroying weight-update group %s: %s", group.group_name, exc)
        if not servers:
            raise SGLangClientError(f"no rollout engine left for the weight-update group (lost {gone})")
        return await self.init_weights_update_group(group.master_address, master_port, group_name,
                                                    group.backend, servers=list(servers),
                                                    timeout_s=group.timeout_s)
