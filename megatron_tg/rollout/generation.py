"""The SGLang client's ``generate`` (mixed into
:class:`~megatron_tg.rollout.client.SGLangClient` over its
:class:`~megatron_tg.rollout.server_pool.ServerPool`), and the aborts of its attempts.

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
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import aiohttp

from .errors import SGLangClientError, SGLangRequestError
from .responses import GenerateResult, auth_hint, decode_generate
from .server_pool import ServerPool, ServerState

log = logging.getLogger(__name__)


class _RetryableHTTP(Exception):
    pass


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


class GenerationCalls(ServerPool):
    """``generate`` and ``abort`` over the pool (the arguments are
    :class:`~megatron_tg.rollout.client.SGLangClient`'s)."""

    def __init__(self, urls: Sequence[str], *, timeout_s: float, max_retries: int, backoff_s: float,
                 hedge_after_s: float | None, **pool: Any):
        super().__init__(urls, **pool)
        self.timeout_s = timeout_s  # per attempt
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.hedge_after_s = hedge_after_s
        self.stats = ClientStats()
        self._active: dict[str, _Logical] = {}
        self._router_workers: dict[str, tuple[float, list[str]]] = {}  # router -> (time, worker URLs)

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
                        f"{body[:1000]}{auth_hint(r.status, bool(self._headers))}", rid
                    )
                data = json.loads(body)
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
        return decode_generate(data, rid, s.url)

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
