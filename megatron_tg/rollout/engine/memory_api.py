"""The embedded engine's memory endpoints (mixed into ``EngineServer``), SGLang's
``/release_memory_occupation`` and ``/resume_memory_occupation`` over
:class:`~megatron_tg.rollout.engine.memory.MemoryOccupation`, and the bytes its tensors hold
now (``/server_info``'s ``memory_occupation``).

Release needs an idle engine (SGLang's ``is_fully_idle``); while weights or the KV cache are
released the scheduler admits no request. Errors answer as SGLang's do: 400 with
``{"error": {"message": ...}}``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from .errors import RequestError
from .memory import KV_CACHE, NOT_IDLE, WEIGHTS, MemoryOccupation, MemoryStateError, kv_cache_bytes, parse_tags


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.json_response(obj, status=status)


def _error(message: str, status: int = 400) -> web.Response:
    return _json({"error": {"message": message}}, status=status)


class MemoryEndpoints:
    """Mixed into ``EngineServer``: needs memory, scheduler, flush_busy, _call, _body."""

    memory: MemoryOccupation

    def add_memory_routes(self, r: web.UrlDispatcher) -> None:
        for method in ("GET", "POST"):  # SGLang's api_route(methods=["GET", "POST"])
            r.add_route(method, "/release_memory_occupation", self.release_memory_occupation)
            r.add_route(method, "/resume_memory_occupation", self.resume_memory_occupation)

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        async def change(tags: list[str]) -> None:
            def release():
                if self.flush_busy():  # SGLang's is_fully_idle(ignore_waiting=paused)
                    raise MemoryStateError(NOT_IDLE)
                self.memory.release(tags)
                self.scheduler.hold_admission = self._holds_admission()

            await self._call(release, drain=False)

        return await self._memory_call(request, change)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        async def change(tags: list[str]) -> None:
            def resume():
                self.memory.resume(tags)
                self.scheduler.hold_admission = self._holds_admission()

            await self._call(resume, drain=False)

        return await self._memory_call(request, change)

    async def _memory_call(self, request: web.Request, change) -> web.Response:
        try:
            await change(parse_tags((await self._body(request)).get("tags")))
        except (RequestError, MemoryStateError) as exc:
            return _error(str(exc))  # SGLang's _create_error_response: 400, {"error": {"message"}}
        return _json(None)  # SGLang's route returns None: 200 with the body null

    def _holds_admission(self) -> bool:
        return WEIGHTS in self.memory.released or KV_CACHE in self.memory.released

    def _occupation(self) -> dict[str, Any]:
        """Runs on the scheduler thread: bytes the engine's tensors hold now."""
        return {"weights_bytes": self.memory.weights_bytes(), "kv_cache_bytes": kv_cache_bytes(self.scheduler.batch),
                "weights_backup_bytes": self.memory.backup_bytes(), "released": sorted(self.memory.released),
                "enable_memory_saver": self.memory.enable_memory_saver}

