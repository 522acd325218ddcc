"""Taking an engine out of an sglang-router and putting it back (sglang-router 0.3.2's worker
API, run against the real binary in ``tests/rollout/test_router.py``).

``GET /workers`` lists ``{"id", "url", "is_healthy", ...}`` per worker; ``DELETE
/workers/{id}`` and ``POST /workers {"url": ...}`` answer 202 and do the work in the
background, so both calls here wait until the listing shows it. Why: the router re-admits a
restarted worker as soon as its ``/health`` passes, on whatever weights it holds, while the
trainer still has to push the current ones into it; an engine the trainer found lost is taken
out at once and put back only once it serves the current version
(:mod:`megatron_tg.weight_sync.engine_loss`).

Calls go through the client's ``_call`` (its timeouts, and any credentials it sends).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any
from urllib.parse import quote

log = logging.getLogger(__name__)


async def router_workers(client, router: str) -> dict[str, dict[str, Any]]:
    """url -> the router's entry for it."""
    from .client import SGLangClientError

    body = await client.request(router, "GET", "/workers")
    if not isinstance(body, dict) or not isinstance(body.get("workers"), list):
        raise SGLangClientError(f"{router}/workers: expected {{'workers': [...]}}, got {body!r:.200}")
    return {str(w["url"]).rstrip("/"): w for w in body["workers"] if isinstance(w, dict) and w.get("url")}


async def _until(client, router: str, done, what: str, timeout_s: float) -> dict[str, dict[str, Any]]:
    from .client import SGLangClientError

    deadline = time.monotonic() + timeout_s
    while True:
        workers = await router_workers(client, router)
        if done(workers):
            return workers
        if time.monotonic() > deadline:
            raise SGLangClientError(f"router {router}: {what} not done after {timeout_s:g} s "
                                    f"(it lists {sorted(workers)})")
        await asyncio.sleep(0.2)


async def remove_worker(client, router: str, url: str, timeout_s: float = 60.0) -> bool:
    """Take ``url`` out of the router (no new request goes to it once this returns).
    False when the router did not list it."""
    url = url.rstrip("/")
    entry = (await router_workers(client, router)).get(url)
    if entry is None:
        return False
    await client.request(router, "DELETE", f"/workers/{quote(str(entry['id']), safe='')}")
    await _until(client, router, lambda w: url not in w, f"removing {url}", timeout_s)
    log.info("router %s: %s removed", router, url)
    return True


async def add_worker(client, router: str, url: str, timeout_s: float = 120.0) -> None:
    """Put ``url`` back behind the router and wait until the router lists it healthy."""
    url = url.rstrip("/")
    if url not in await router_workers(client, router):
        await client.request(router, "POST", "/workers", {"url": url})
    await _until(client, router, lambda w: bool(w.get(url, {}).get("is_healthy")),
                 f"adding {url}", timeout_s)
    log.info("router %s: %s added", router, url)
