"""The servers one SGLang client talks to, and one HTTP call to them (the base of
:class:`~megatron_tg.rollout.client.SGLangClient`).

It owns the HTTP session (with the job's key on every request), each server's state
(:class:`ServerState`: health, requests in flight, failures), the choice of the server for a
request (the healthy one with the fewest requests in flight, ties rotate), marking servers
unhealthy and probing them back, and one call to one server (:meth:`ServerPool.request`) or to
every server (:meth:`ServerPool.broadcast`).

Health. SGLang 0.5.23 answers ``/health`` by generating one token, so while paused it
waits 20 s (``SGLANG_HEALTH_CHECK_TIMEOUT``) and answers 503. While this client has the servers paused it checks
liveness with ``/model_info`` instead (no generation), so a paused engine is never taken
for a dead one. After a weight update a server must also report the expected weight version
(``expected_weight_version``) before it gets traffic again, so a server that missed an update
never serves stale weights.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Sequence

import aiohttp

from .errors import SGLangClientError
from .responses import auth_hint, decode_body

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    url: str
    router: bool = False  # an sglang-router: aborts go to the workers behind it
    healthy: bool = True
    in_flight: int = 0
    consecutive_failures: int = 0
    failures: int = 0
    completed: int = 0
    next_probe: float = 0.0
    last_error: str = ""


class ServerPool:
    def __init__(
        self,
        urls: Sequence[str],
        *,
        connect_timeout_s: float = 5.0,
        unhealthy_after: int = 2,
        probe_interval_s: float = 5.0,
        admin_timeout_s: float = 1800.0,
        admin_urls: Sequence[str] | None = None,
        health_timeout_s: float | None = None,
        api_key: str | None = None,
    ):
        # Where admin calls (pause, weight updates) go. Default: the generation URLs. With
        # an sglang-router, generate through the router and pass the workers here: every
        # generation URL not among them is then a router.
        gen = [u.rstrip("/") for u in urls]
        self.admin_urls = [u.rstrip("/") for u in admin_urls] if admin_urls else list(gen)
        self.servers = [ServerState(u, router=u not in self.admin_urls) for u in gen]
        self.connect_timeout_s = connect_timeout_s
        self.unhealthy_after = unhealthy_after
        self.probe_interval_s = probe_interval_s
        self.admin_timeout_s = admin_timeout_s
        self.health_timeout_s = health_timeout_s or max(2.0, connect_timeout_s)  # one probe
        # SGLang's --api-key (the job's key, megatron_tg.auth): sent on every request, to
        # the engines and to the router alike. Kept off repr and logs.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.expected_weight_version: str | None = None
        self._rr = itertools.count()
        self._background: set[asyncio.Task] = set()
        self._probing: set[str] = set()
        self._session: aiohttp.ClientSession | None = None
        # Set from the moment a pause is sent until generation is continued: SGLang's
        # /health answers 503 then, which must not read as "dead".
        self.paused = False

    # ---- lifecycle ----------------------------------------------------------------------
    async def close(self) -> None:
        for t in list(self._background):
            t.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # limit=0: rollouts keep thousands of long requests open at once.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=self._headers)
        return self._session

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def wait_until_ready(self, timeout_s: float = 120.0) -> None:
        """Wait until every server answers /health with 200."""
        deadline = time.monotonic() + timeout_s
        pending = [s.url for s in self.servers]
        while pending:
            ok = await asyncio.gather(*(self._probe_url(u) for u in pending))
            pending = [u for u, good in zip(pending, ok) if not good]
            if pending and time.monotonic() > deadline:
                raise SGLangClientError(f"servers not ready after {timeout_s:.0f}s: {sorted(pending)}")
            if pending:
                await asyncio.sleep(0.2)

    # ---- server choice and health --------------------------------------------------------
    def _pick(self, avoid: set[str]) -> ServerState | None:
        now = time.monotonic()
        for s in self.servers:
            if not s.healthy and now >= s.next_probe and s.url not in self._probing:
                self._spawn(self._probe(s))
        healthy = [s for s in self.servers if s.healthy]
        pool = [s for s in healthy if s.url not in avoid] or healthy
        if not pool:
            return None
        low = min(s.in_flight for s in pool)
        ties = [s for s in pool if s.in_flight == low]
        return ties[next(self._rr) % len(ties)]

    async def _probe_url(self, url: str) -> bool:
        try:
            timeout = aiohttp.ClientTimeout(total=self.health_timeout_s)
            if self.paused:
                # /health would generate and answer 503 after its own 20 s budget; a paused
                # server that answers /model_info is alive (and gets traffic once continued).
                return (await self._model_info(url, timeout)) is not None
            async with self._http().get(f"{url}/health", timeout=timeout) as r:
                if r.status != 200:
                    return False
            if self.expected_weight_version is not None and url in self.admin_urls:
                version = (await self._model_info(url, timeout) or {}).get("weight_version")
                if str(version) != self.expected_weight_version:
                    log.warning("%s is up but at weight version %s (expected %s); kept out of rotation",
                                url, version, self.expected_weight_version)
                    return False
            return True
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return False

    async def _model_info(self, url: str, timeout: aiohttp.ClientTimeout) -> dict[str, Any] | None:
        """GET /model_info (SGLang's current name), else the deprecated /get_model_info
        (older SGLang; the sglang-router proxies only that one). None when neither answers 200."""
        for path in ("/model_info", "/get_model_info"):
            async with self._http().get(f"{url}{path}", timeout=timeout) as r:
                if r.status == 404:
                    continue
                if r.status != 200:
                    return None
                data = await r.json(content_type=None)
                return data if isinstance(data, dict) else None
        return None

    async def _probe(self, s: ServerState) -> bool:
        self._probing.add(s.url)
        try:
            if await self._probe_url(s.url):
                if not s.healthy:
                    log.info("server %s is healthy again", s.url)
                s.healthy, s.consecutive_failures = True, 0
                return True
            s.next_probe = time.monotonic() + self.probe_interval_s
            return False
        finally:
            self._probing.discard(s.url)

    def _failed(self, s: ServerState, exc: BaseException, hard: bool) -> None:
        s.failures += 1
        s.consecutive_failures += 1
        s.last_error = repr(exc)
        if s.healthy and (hard or s.consecutive_failures >= self.unhealthy_after):
            log.warning("marking %s unhealthy after %r", s.url, exc)
            s.healthy = False
            s.next_probe = time.monotonic() + self.probe_interval_s

    async def health(self) -> dict[str, bool]:
        urls = [s.url for s in self.servers]
        return dict(zip(urls, await asyncio.gather(*(self._probe_url(u) for u in urls))))

    # ---- one call, to one server or to each ----------------------------------------------
    async def request(self, url: str, method: str, path: str, body: Any = None,
                      timeout_s: float | None = None) -> Any:
        """One admin call to one server (an engine, or an sglang-router's own ``/workers``
        API), with the job's key and the admin timeout: the decoded JSON body (text where
        the endpoint answers plain text, None when empty). HTTP errors raise
        :class:`SGLangClientError` naming the call and the status."""
        return await self._call(url, method, path, body, timeout_s)

    async def _call(self, url: str, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.admin_timeout_s, sock_connect=self.connect_timeout_s)
        async with self._http().request(method, f"{url}{path}", json=body, timeout=timeout) as r:
            text = await r.text()
            if r.status >= 400:
                hint = (" (not served there; an sglang-router answers 404 to admin calls: send them to its "
                        "workers, admin_urls / rollout.server_urls)" if r.status == 404
                        else auth_hint(r.status, bool(self._headers)))
                raise SGLangClientError(f"{method} {url}{path} -> HTTP {r.status}: {text[:1000]}{hint}")
            return decode_body(text)

    async def broadcast(
        self, method: str, path: str, body: Any = None, servers: Iterable[str] | None = None, strict: bool = False
    ) -> dict[str, Any]:
        """Send one admin call to every server (all of them, healthy or not: a server
        coming back must not miss a pause or a weight update it could still take).

        Returns {url: reply} for the servers that succeeded. Servers that fail are marked
        unhealthy; raises if none succeeded, or if any failed and ``strict``.
        """
        return await self._each(f"{method} {path}", lambda u: self._call(u, method, path, body), servers, strict)

    async def _each(self, what: str, call: Callable[[str], Awaitable[Any]], servers: Iterable[str] | None,
                    strict: bool) -> dict[str, Any]:
        urls = list(servers) if servers is not None else list(self.admin_urls)
        replies = await asyncio.gather(*(call(u) for u in urls), return_exceptions=True)
        ok, errors = {}, []
        for url, rep in zip(urls, replies):
            if isinstance(rep, BaseException):
                errors.append((url, rep))
                state = next((s for s in self.servers if s.url == url), None)
                if state is not None:
                    self._failed(state, rep, hard=isinstance(rep, aiohttp.ClientConnectorError))
            else:
                ok[url] = rep
        if errors and (strict or not ok):
            detail = "; ".join(f"{u}: {type(e).__name__}: {e}" for u, e in errors)
            raise SGLangClientError(f"{what} failed on {len(errors)}/{len(urls)} servers: {detail}",
                                    errors=errors)
        for url, e in errors:
            log.warning("%s failed on %s: %r", what, url, e)
        return ok
