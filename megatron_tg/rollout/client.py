"""Async client for SGLang's native HTTP API (real SGLang servers, an sglang-router URL,
or the embedded CPU engine in ``megatron_tg.rollout.engine`` -- they look the same).

:class:`SGLangClient` is one object made of these parts:

* the servers and one call to them (:mod:`~megatron_tg.rollout.server_pool`): the HTTP
  session with the job's key, each server's health, the choice of a server, probes that
  take a paused engine for alive, ``request`` (one call to one server) and ``broadcast``;
* ``generate`` and ``abort`` (:mod:`~megatron_tg.rollout.generation`): load balancing,
  failover with retries and hedging, exactly one answer per logical request, aborts that
  reach every worker behind an sglang-router;
* what a server's answer holds (:mod:`~megatron_tg.rollout.responses`: ``GenerateResult``);
* the weight-update calls SGLang accepts (:mod:`~megatron_tg.rollout.weight_client`);
* here: the admin calls (pause/continue/flush, model and server info, weight updates from
  disk, releasing and resuming memory), broadcast to every server.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Sequence

from .errors import SGLangClientError, SGLangRequestError  # noqa: F401 (re-exported)
from .generation import GenerationCalls
from .weight_client import TrainerWeightGroup, WeightUpdateCalls  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)


class SGLangClient(GenerationCalls, WeightUpdateCalls):
    def __init__(
        self,
        urls: Sequence[str],
        timeout_s: float = 3600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        *,
        connect_timeout_s: float = 5.0,
        unhealthy_after: int = 2,
        probe_interval_s: float = 5.0,
        hedge_after_s: float | None = None,
        admin_timeout_s: float = 1800.0,
        admin_urls: Sequence[str] | None = None,
        health_timeout_s: float | None = None,
        api_key: str | None = None,
    ):
        if not urls:
            raise ValueError("SGLangClient needs at least one server URL")
        super().__init__(urls, timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s,
                         hedge_after_s=hedge_after_s, connect_timeout_s=connect_timeout_s,
                         unhealthy_after=unhealthy_after, probe_interval_s=probe_interval_s,
                         admin_timeout_s=admin_timeout_s, admin_urls=admin_urls,
                         health_timeout_s=health_timeout_s, api_key=api_key)
        self._engine_infos: dict = {}  # url -> EngineInfo, read once (weight_client)

    async def __aenter__(self) -> "SGLangClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- admin (broadcast) ---------------------------------------------------------------
    async def health_generate(self, **kw) -> dict[str, Any]:
        return await self.broadcast("GET", "/health_generate", **kw)

    async def get_model_info(self, servers: Iterable[str] | None = None, strict: bool = False) -> dict[str, Any]:
        """``/model_info`` of every server; ``/get_model_info`` (deprecated in SGLang) where
        a server answers 404 to the new name (older SGLang, the sglang-router)."""
        async def one(url: str) -> Any:
            try:
                return await self._call(url, "GET", "/model_info")
            except SGLangClientError as exc:
                if "HTTP 404" not in str(exc):
                    raise
                return await self._call(url, "GET", "/get_model_info")

        return await self._each("GET /model_info", one, servers, strict)

    async def _server_info(self, url: str) -> Any:
        try:
            return await self._call(url, "GET", "/server_info")
        except SGLangClientError as exc:
            if "HTTP 404" not in str(exc):
                raise
            return await self._call(url, "GET", "/get_server_info")  # before /server_info existed

    async def get_server_info(self, servers: Iterable[str] | None = None, strict: bool = False) -> dict[str, Any]:
        """``/server_info`` of every server; ``/get_server_info`` where a server answers 404
        to the new name (releases before it existed)."""
        return await self._each("GET /server_info", self._server_info, servers, strict)

    async def get_weight_version(self) -> dict[str, str]:
        return {u: r.get("weight_version") for u, r in (await self.get_model_info()).items()}

    async def flush_cache(self, **kw) -> dict[str, Any]:
        return await self.broadcast("POST", "/flush_cache", **kw)

    async def pause_generation(self, mode: str = "abort", **kw) -> dict[str, Any]:
        targets = list(kw.pop("servers", None) or self.admin_urls)
        self.paused = True  # before sending: a probe racing the pause must not see "dead"
        try:
            return await self.broadcast("POST", "/pause_generation", {"mode": mode}, servers=targets, **kw)
        except SGLangClientError as exc:
            if len(exc.errors) == len(targets):
                self.paused = False  # nobody paused
            raise

    async def continue_generation(self, **kw) -> dict[str, Any]:
        ok = await self.broadcast("POST", "/continue_generation", {}, **kw)
        self.paused = False
        return ok

    async def abort_request(self, rid: str = "", abort_all: bool = False, **kw) -> dict[str, Any]:
        """Raw server-side abort by rid prefix (see :meth:`abort` for logical requests)."""
        return await self.broadcast("POST", "/abort_request", {"rid": rid, "abort_all": abort_all}, **kw)

    async def _after_weight_update(self, ok: dict[str, Any], weight_version: str | None) -> None:
        """Remember the version servers must report to get traffic again."""
        if weight_version is not None:
            self.expected_weight_version = str(weight_version)
            return
        versions = {u: v for u, v in (await self.get_weight_version()).items() if u in ok}
        distinct = set(versions.values())
        self.expected_weight_version = str(distinct.pop()) if len(distinct) == 1 else None
        if self.expected_weight_version is None:
            log.warning("servers disagree on weight version after an update: %s", versions)
        for s in self.servers:
            if s.url in self.admin_urls and s.url not in ok:
                s.healthy = False  # missed the update; rejoins only at the expected version

    async def generate_on(self, url: str, body: dict[str, Any]) -> Any:
        """POST ``body`` to ``url``'s ``/generate`` (one server, no routing or retries) and return
        its JSON answer: a question to one engine in particular, such as the weight sync's
        log-prob probe, which compares each engine's prompt log-probs with the trainer's."""
        return await self._call(url, "POST", "/generate", body)

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None, **fields) -> dict:
        body = {"model_path": model_path, **fields}
        if weight_version is not None:
            body["weight_version"] = weight_version
        ok = await self.broadcast("POST", "/update_weights_from_disk", body)
        await self._after_weight_update(ok, weight_version)
        return ok

    async def release_memory_occupation(self, tags: Sequence[str] | None = None,
                                        servers: Iterable[str] | None = None) -> dict[str, Any]:
        """SGLang's ``/release_memory_occupation`` on every server (strict): free the memory
        tagged ``weights`` / ``kv_cache`` / ``cuda_graph`` (None: all). Engines must be idle
        (pause with ``retract`` or let requests finish first) and started with
        ``--enable-memory-saver`` for anything to be freed."""
        body = {"tags": list(tags) if tags is not None else None}
        return await self.broadcast("POST", "/release_memory_occupation", body, servers=servers, strict=True)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None,
                                       servers: Iterable[str] | None = None) -> dict[str, Any]:
        """SGLang's ``/resume_memory_occupation`` on every server (strict): reallocate what
        ``tags`` released (None: all). Without ``--enable-weights-cpu-backup`` resumed weights
        hold nothing meaningful until an update writes them."""
        body = {"tags": list(tags) if tags is not None else None}
        return await self.broadcast("POST", "/resume_memory_occupation", body, servers=servers, strict=True)
