"""Async client for SGLang's native HTTP API (real SGLang servers, an sglang-router URL,
or the embedded CPU engine in ``megatron_tg.rollout.engine`` -- they look the same).

What it guarantees for ``generate``:

* **Load balancing**: each attempt goes to the healthy server with the fewest requests
  this client has in flight there (ties rotate). A router is just one more URL.
* **Fault tolerance**: a connection refused / reset, a server that dies mid-request,
  a 5xx, or a per-attempt timeout makes the attempt fail; the logical request is
  resubmitted (to another server when there is one) after ``backoff_s * 2**k``, up to
  ``max_retries`` resubmissions. Refused connections mark a server unhealthy at once,
  other failures after ``unhealthy_after`` in a row; unhealthy servers are re-probed
  with ``GET /health`` every ``probe_interval_s`` (and, after a weight update, must
  also report the expected weight version before they get traffic again, so a server
  that missed an update never serves stale weights). A 4xx is the caller's fault and
  is raised at once.
* **Exactly once**: every logical request has a client-side ``rid``; attempt k is sent
  as ``f"{rid}@{k}"``. The first successful answer wins; any other attempt still
  running (a hedge, see ``hedge_after_s``) is aborted on its server and its answer, if
  one arrives, is discarded and counted in ``stats.duplicates_discarded``.
* An ``abort`` finish reason (``/abort_request``, ``pause_generation(mode="abort")``)
  is a normal result with the tokens generated so far, not an error: the caller decides
  whether to resubmit (partial rollouts).

Routers. A generation URL that is not among ``admin_urls`` is an sglang-router. The
router forwards ``/generate`` (keeping ``rid``) but answers 404 to ``/abort_request``,
``/pause_generation``, ``/continue_generation``, the weight-update endpoints and
``/server_info`` (sglang-router 0.3.2, tests/rollout/test_router.py). So an attempt sent
through a router is aborted on every worker behind it (the router's ``GET /workers``
list plus ``admin_urls``): SGLang ignores an abort for a rid it does not hold, and the
router does not say which worker holds one. An abort answered with an HTTP error (a 404
from a router, say) is an error, never a silent success: :meth:`abort` raises, and the
aborts the client sends on its own (hedge losers, timed-out attempts) are logged and
counted in ``stats.abort_failures``.

Health. SGLang 0.5.23 answers ``/health`` by generating one token, so while paused it
waits 20 s (``SGLANG_HEALTH_CHECK_TIMEOUT``) and answers 503. While this client has the servers paused it checks
liveness with ``/model_info`` instead (no generation), so a paused engine is never taken
for a dead one.

Admin calls (pause/continue/flush/weight updates) are broadcast to every server; the
weight-update protocol SGLang accepts is in :mod:`megatron_tg.rollout.weight_client`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Sequence

import aiohttp

from .errors import SGLangClientError, SGLangRequestError  # noqa: F401 (re-exported)
from .weight_client import TrainerWeightGroup, WeightUpdateCalls  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)


class _RetryableHTTP(Exception):
    pass


def _auth_hint(status: int, sent_key: bool) -> str:
    if status not in (401, 403):
        return ""
    return (" (the server refused this client's API key: is it the job's key, rollout.api_key_file?)"
            if sent_key else " (the server requires an API key: set rollout.api_key_file)")


@dataclass
class GenerateResult:
    rid: str  # the logical request id (the server saw f"{rid}@{attempt}")
    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: dict[str, Any]
    weight_version: str | None
    server: str
    text: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    attempts: int = 1
    meta_info: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def finish_type(self) -> str:
        return str((self.finish_reason or {}).get("type"))


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


@dataclass
class ClientStats:
    submitted: int = 0
    completed: int = 0  # logical requests answered (exactly once each)
    failed: int = 0  # logical requests that raised
    attempts: int = 0
    resubmitted: int = 0  # attempts beyond the first (failover, retry or hedge)
    hedged: int = 0
    duplicates_discarded: int = 0  # answers that arrived for an already answered rid
    abort_failures: int = 0  # client-sent aborts a server answered with an error (logged)


class _Logical:
    def __init__(self, rid: str):
        self.rid = rid
        self.result: GenerateResult | None = None
        self.aborted = False
        self.live: dict[asyncio.Task, tuple[ServerState, str]] = {}


class SGLangClient(WeightUpdateCalls):
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
        # Where admin calls (pause, weight updates) go. Default: the generation URLs. With
        # an sglang-router, generate through the router and pass the workers here: every
        # generation URL not among them is then a router.
        gen = [u.rstrip("/") for u in urls]
        self.admin_urls = [u.rstrip("/") for u in admin_urls] if admin_urls else list(gen)
        self.servers = [ServerState(u, router=u not in self.admin_urls) for u in gen]
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.connect_timeout_s = connect_timeout_s
        self.unhealthy_after = unhealthy_after
        self.probe_interval_s = probe_interval_s
        self.hedge_after_s = hedge_after_s
        self.admin_timeout_s = admin_timeout_s
        self.health_timeout_s = health_timeout_s or max(2.0, connect_timeout_s)  # one probe
        self.stats = ClientStats()
        # SGLang's --api-key (the job's key, megatron_tg.auth): sent on every request, to
        # the engines and to the router alike. Kept off repr and logs.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.expected_weight_version: str | None = None
        self._engine_infos: dict = {}  # url -> EngineInfo, read once (weight_client)
        self._rr = itertools.count()
        self._active: dict[str, _Logical] = {}
        self._background: set[asyncio.Task] = set()
        self._probing: set[str] = set()
        self._session: aiohttp.ClientSession | None = None
        # Set from the moment a pause is sent until generation is continued: SGLang's
        # /health answers 503 then, which must not read as "dead".
        self.paused = False
        self._router_workers: dict[str, tuple[float, list[str]]] = {}  # router -> (time, worker URLs)

    # ---- lifecycle ----------------------------------------------------------------------
    async def __aenter__(self) -> "SGLangClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

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

    # ---- generation ---------------------------------------------------------------------
    async def generate(
        self,
        input_ids: Sequence[int] | None = None,
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = True,
        rid: str | None = None,
        *,
        text: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> GenerateResult:
        """One prompt -> one completion, answered exactly once (see module docstring)."""
        if (input_ids is None) == (text is None):
            raise ValueError("pass exactly one of input_ids or text")
        rid = rid or uuid.uuid4().hex
        if rid in self._active:
            raise ValueError(f"request {rid} is already in flight")
        payload: dict[str, Any] = dict(extra or {})
        payload.update({"sampling_params": dict(sampling_params or {}), "return_logprob": return_logprob})
        if input_ids is not None:
            payload["input_ids"] = [int(t) for t in input_ids]
        else:
            payload["text"] = text
        rec = _Logical(rid)
        self._active[rid] = rec
        self.stats.submitted += 1
        try:
            result = await self._run(rec, payload)
            self.stats.completed += 1
            return result
        except BaseException:
            self.stats.failed += 1
            raise
        finally:
            self._active.pop(rid, None)
            self._orphan(rec)

    async def abort(self, rid: str) -> None:
        """Abort a logical request: its attempts return finish_reason abort.

        Raises :class:`SGLangClientError` when a server (or a worker behind a router)
        answers the abort with an HTTP error: the attempt may still be generating.
        """
        rec = self._active.get(rid)
        if rec is None:
            return
        rec.aborted = True
        results = await asyncio.gather(*(self._abort_on(s, srid) for s, srid in rec.live.values()),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise SGLangClientError(f"abort of request {rid} failed: " + "; ".join(map(str, errors)), rid,
                                    [("<abort>", e) for e in errors])

    async def _run(self, rec: _Logical, payload: dict[str, Any]) -> GenerateResult:
        errors: list[tuple[str, BaseException]] = []
        avoid: set[str] = set()
        launched = 0
        hedged = False
        while True:
            if not rec.live:
                if rec.aborted:  # aborted by the caller, and the attempt died with its server
                    return GenerateResult(rec.rid, [], [], {"type": "abort", "message": "aborted by client; "
                                          "the server running it failed", "status_code": None, "err_type": None},
                                          None, "", attempts=launched)
                if launched > self.max_retries:
                    raise self._give_up(rec.rid, launched, errors)
                if launched:
                    await asyncio.sleep(min(self.backoff_s * 2 ** (launched - 1), 30.0))
                server = self._pick(avoid)
                if server is None:
                    # Nobody healthy: probe everyone now rather than waiting for the timer.
                    await asyncio.gather(*(self._probe(s) for s in self.servers if s.url not in self._probing))
                    server = self._pick(avoid)
                if server is None:
                    launched += 1  # counts as a failed attempt, so we give up eventually
                    errors.append(("<no healthy server>", ConnectionError("all servers unhealthy")))
                    continue
                self._launch(rec, server, launched, payload)
                launched += 1
            hedge_now = self.hedge_after_s is not None and not hedged and launched <= self.max_retries
            done, _ = await asyncio.wait(
                rec.live, timeout=self.hedge_after_s if hedge_now else None, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:  # slow attempt: race a second server against it
                busy = {s.url for s, _ in rec.live.values()}
                other = self._pick(avoid | busy)
                hedged = True
                if other is not None and other.url not in busy:
                    self.stats.hedged += 1
                    self._launch(rec, other, launched, payload)
                    launched += 1
                continue
            for task in done:
                server, srid = rec.live.pop(task)
                exc = task.exception()
                if exc is None:
                    res = task.result()
                    res.attempts = launched
                    if rec.result is None:
                        rec.result = res
                    else:
                        self.stats.duplicates_discarded += 1
                elif isinstance(exc, SGLangRequestError):
                    raise exc
                else:
                    errors.append((server.url, exc))
                    avoid.add(server.url)
            if rec.result is not None:
                return rec.result

    def _launch(self, rec: _Logical, server: ServerState, k: int, payload: dict[str, Any]) -> None:
        srid = f"{rec.rid}@{k}"
        if k:
            self.stats.resubmitted += 1
        self.stats.attempts += 1
        task = asyncio.ensure_future(self._attempt(server, rec.rid, srid, payload))
        rec.live[task] = (server, srid)
        if rec.aborted:  # abort() raced with a resubmission
            self._spawn(self._abort_logged(server, srid))

    def _orphan(self, rec: _Logical) -> None:
        """Attempts still running after the request was answered (or failed): abort them
        on their servers; an answer that still arrives is a discarded duplicate."""
        for task, (server, srid) in list(rec.live.items()):
            self._spawn(self._abort_logged(server, srid))

            def done(t: asyncio.Task) -> None:
                if not t.cancelled() and t.exception() is None:
                    self.stats.duplicates_discarded += 1

            task.add_done_callback(done)
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        rec.live.clear()

    async def _attempt(self, s: ServerState, rid: str, srid: str, payload: dict[str, Any]) -> GenerateResult:
        s.in_flight += 1
        try:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s)
            async with self._http().post(f"{s.url}/generate", json={**payload, "rid": srid}, timeout=timeout) as r:
                body = await r.text()
                if r.status in (408, 429) or r.status >= 500:
                    raise _RetryableHTTP(f"HTTP {r.status}: {body[:500]}")
                if r.status >= 400:
                    raise SGLangRequestError(
                        f"server {s.url} rejected request {rid} (attempt rid {srid}): HTTP {r.status}: "
                        f"{body[:1000]}{_auth_hint(r.status, bool(self._headers))}", rid
                    )
                data = _loads(body)
        except asyncio.TimeoutError as exc:
            self._failed(s, exc, hard=False)
            self._spawn(self._abort_logged(s, srid))  # it may still be generating
            raise TimeoutError(f"no answer from {s.url} within {self.timeout_s}s") from exc
        except aiohttp.ClientConnectorError as exc:  # refused / unreachable: the server is down
            self._failed(s, exc, hard=True)
            raise
        except (aiohttp.ClientError, _RetryableHTTP) as exc:  # reset, disconnect, 5xx
            self._failed(s, exc, hard=isinstance(exc, aiohttp.ServerDisconnectedError))
            raise
        finally:
            s.in_flight -= 1
        s.consecutive_failures = 0
        s.completed += 1
        if isinstance(data, list):  # a router may wrap single answers; take ours
            data = data[0]
        meta = data.get("meta_info", {})
        lps = meta.get("output_token_logprobs")
        return GenerateResult(
            rid=rid,
            output_ids=list(data.get("output_ids") or []),
            output_logprobs=None if lps is None else [float(x[0]) for x in lps],
            finish_reason=meta.get("finish_reason") or {},
            weight_version=meta.get("weight_version"),
            server=s.url,
            text=data.get("text"),
            prompt_tokens=int(meta.get("prompt_tokens") or 0),
            completion_tokens=int(meta.get("completion_tokens") or 0),
            meta_info=meta,
        )

    async def _abort_on(self, s: ServerState, srid: str) -> None:
        """Abort attempt ``srid`` where it runs: on ``s``, or on every worker behind the
        router ``s``. A refused connection is fine (a dead server has nothing left to
        abort); an HTTP error is raised, naming the URL."""
        urls = await self._workers_behind(s.url) if s.router else [s.url]
        results = await asyncio.gather(*(self._abort_url(u, srid) for u in urls), return_exceptions=True)
        errors = [f"{u}: {e}" for u, e in zip(urls, results) if isinstance(e, BaseException)]
        if errors:
            raise SGLangClientError(f"abort of attempt {srid} failed on " + "; ".join(errors), srid)

    async def _abort_url(self, url: str, srid: str) -> None:
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.connect_timeout_s))
        try:
            async with self._http().post(f"{url}/abort_request", json={"rid": srid}, timeout=timeout) as r:
                body = await r.text()
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError):
            return  # down: nothing running there
        if r.status >= 400:
            hint = (" (an sglang-router? It does not serve /abort_request: generate through it with "
                    "its workers as admin_urls / rollout.server_urls)" if r.status == 404 else "")
            raise SGLangClientError(f"POST {url}/abort_request -> HTTP {r.status}: {body[:300]}{hint}", srid)

    async def _abort_logged(self, s: ServerState, srid: str) -> None:
        """An abort nobody awaits (hedge loser, timed-out attempt): failures are logged and
        counted, since that attempt may keep generating."""
        try:
            await self._abort_on(s, srid)
        except (SGLangClientError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.stats.abort_failures += 1
            log.error("%s", exc)

    async def _workers_behind(self, router: str) -> list[str]:
        """The router's workers (``GET /workers``, cached for ``probe_interval_s``) plus
        ``admin_urls``: the router may know workers added after this client started."""
        now = time.monotonic()
        cached = self._router_workers.get(router)
        if cached is None or now - cached[0] > self.probe_interval_s:
            found: list[str] = []
            try:
                timeout = aiohttp.ClientTimeout(total=max(2.0, self.connect_timeout_s))
                async with self._http().get(f"{router}/workers", timeout=timeout) as r:
                    if r.status == 200:
                        data = await r.json(content_type=None)
                        found = [str(w["url"]).rstrip("/") for w in data.get("workers", []) if w.get("url")]
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, AttributeError) as exc:
                log.warning("cannot list the workers of router %s (%r); aborting on admin_urls only", router, exc)
            cached = (now, found)
            self._router_workers[router] = cached
        return list(dict.fromkeys([*cached[1], *(u for u in self.admin_urls if u != router)]))

    def _give_up(self, rid: str, attempts: int, errors: list[tuple[str, BaseException]]) -> SGLangClientError:
        detail = "; ".join(f"{url}: {type(e).__name__}: {e}" for url, e in errors[-8:])
        return SGLangClientError(f"request {rid} failed after {attempts} attempts on all servers: {detail}", rid, errors)

    # ---- admin (broadcast) ---------------------------------------------------------------
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
                        else _auth_hint(r.status, bool(self._headers)))
                raise SGLangClientError(f"{method} {url}{path} -> HTTP {r.status}: {text[:1000]}{hint}")
            try:
                return _loads(text) if text else None
            except ValueError:  # some endpoints (/flush_cache) answer plain text
                return text

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

    async def health(self) -> dict[str, bool]:
        urls = [s.url for s in self.servers]
        return dict(zip(urls, await asyncio.gather(*(self._probe_url(u) for u in urls))))

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


def _loads(text: str) -> Any:
    import json

    return json.loads(text)
