"""The remote-sandbox protocol: environment workers on CPU nodes hold the workspaces, run the
tools and grade; the rollout side (GPU nodes) only sends tool calls.

    python -m megatron_tg.agent.remote serve --recipe recipes/tg_30b.yaml --token-file T \\
        --host 0.0.0.0 --port 8765 [rollout.KEY=VALUE ...]

and on the trainer ``rollout.sandbox_url=http://cpu-node:8765 rollout.sandbox_token_file=T``.

HTTP/1.1, JSON bodies, every request carrying ``Authorization: Bearer <token>`` (the
worker runs model-written code: an unauthenticated caller gets 401 and nothing else):

=======================================  ==================================  ================================
request                                  body                                answer
=======================================  ==================================  ================================
``GET /v1/health``                       -                                   ``{"tasks", "sandbox", "episodes"}``
``POST /v1/episodes``                    ``{"task_id", "task_digest"}``      ``{"episode"}``
``POST /v1/episodes/{id}/call``          ``{"name", "arguments": {str: str}}``  ``{"name", "output", "ok", "meta"}``
``POST /v1/episodes/{id}/grade``         -                                   grading metadata (``tests_passed``, ``tests``)
``DELETE /v1/episodes/{id}``             -                                   ``{"closed": true}``
=======================================  ==================================  ================================

Errors are ``{"error": message}`` with 400 (malformed request), 401, 404 (unknown task or
episode), 409 (the task differs from the worker's: ``task_digest`` is the sha256 of the
task's canonical JSON, so trainer and worker must read the same task file) or 503 (the
worker holds ``max_episodes`` already). Tasks travel by id only: hidden tests, test patches
and reference solutions never leave the worker. A tool's failure is a normal answer
(``ok: false``), as locally.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import sys
from typing import Any

import aiohttp
from aiohttp import web

from megatron_tg.agent.environment import LocalEnvironment
from megatron_tg.agent.tasks import Task
from megatron_tg.agent.tools import ToolResult

log = logging.getLogger(__name__)


def task_digest(task: Task) -> str:
    d = task.to_dict()
    d.update(test_patch=task.test_patch, pass_to_pass=task.pass_to_pass)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


class RemoteEnvironmentError(RuntimeError):
    pass


def _error(status: int, msg: str) -> web.Response:
    return web.json_response({"error": msg}, status=status)


class EnvironmentServer:
    """Serves a :class:`LocalEnvironment` over the protocol above."""

    def __init__(self, env: LocalEnvironment, tasks: list[Task], token: str, max_episodes: int = 256):
        if len(token) < 16:
            raise ValueError("the token must be at least 16 characters (it guards model-code execution)")
        self.env, self.token, self.max_episodes = env, token, max_episodes
        self.tasks = {t.id: t for t in tasks}
        self.episodes: dict[str, Any] = {}

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=64 << 20)
        app.add_routes([web.get("/v1/health", self.health), web.post("/v1/episodes", self.open),
                        web.post("/v1/episodes/{id}/call", self.call),
                        web.post("/v1/episodes/{id}/grade", self.grade),
                        web.delete("/v1/episodes/{id}", self.close)])
        app.on_shutdown.append(self._close_all)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        got = request.headers.get("Authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode()):
            return _error(401, "missing or wrong bearer token")
        return await handler(request)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise web.HTTPBadRequest(text=json.dumps({"error": f"body is not JSON: {e}"}),
                                     content_type="application/json") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text=json.dumps({"error": "body must be a JSON object"}),
                                     content_type="application/json")
        return body

    def _episode(self, request: web.Request):
        ep = self.episodes.get(request.match_info["id"])
        if ep is None:
            raise web.HTTPNotFound(text=json.dumps({"error": f"no episode {request.match_info['id']!r}"}),
                                   content_type="application/json")
        return ep

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"tasks": len(self.tasks), "sandbox": self.env.sandbox.mode,
                                  "episodes": len(self.episodes)})

    async def open(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        task = self.tasks.get(body.get("task_id"))
        if task is None:
            return _error(404, f"task_id {body.get('task_id')!r} is not in this worker's task file")
        if body.get("task_digest") != task_digest(task):
            return _error(409, f"task {task.id!r} differs from this worker's copy (task_digest mismatch): "
                               "trainer and worker must read the same task file")
        if len(self.episodes) >= self.max_episodes:
            return _error(503, f"this worker holds {self.max_episodes} episodes already")
        ep = await self.env.open(task)
        eid = secrets.token_hex(12)
        self.episodes[eid] = ep
        return web.json_response({"episode": eid})

    async def call(self, request: web.Request) -> web.Response:
        ep = self._episode(request)
        body = await self._body(request)
        name, args = body.get("name"), body.get("arguments", {})
        if not isinstance(name, str) or not isinstance(args, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in args.items()):
            return _error(400, "call needs name: str and arguments: {str: str}")
        res = await ep.call(name, args)
        return web.json_response({"name": res.name, "output": res.output, "ok": res.ok, "meta": res.meta})

    async def grade(self, request: web.Request) -> web.Response:
        return web.json_response(await self._episode(request).grade())

    async def close(self, request: web.Request) -> web.Response:
        ep = self._episode(request)
        del self.episodes[request.match_info["id"]]
        await ep.close()
        return web.json_response({"closed": True})

    async def _close_all(self, app) -> None:
        for ep in list(self.episodes.values()):
            await ep.close()
        self.episodes.clear()


class RemoteEpisode:
    def __init__(self, env: "RemoteEnvironment", eid: str):
        self.env, self.id = env, eid

    async def call(self, name: str, arguments: dict[str, str]) -> ToolResult:
        r = await self.env.request("POST", f"/v1/episodes/{self.id}/call",
                                   {"name": name, "arguments": {k: str(v) for k, v in arguments.items()}})
        return ToolResult(r["name"], r["output"], bool(r["ok"]), r.get("meta") or {})

    async def grade(self) -> dict[str, Any]:
        return await self.env.request("POST", f"/v1/episodes/{self.id}/grade", {})

    async def close(self) -> None:
        await self.env.request("DELETE", f"/v1/episodes/{self.id}")


class RemoteEnvironment:
    """The client side: an :class:`~megatron_tg.agent.environment.Environment` whose
    episodes live on a worker."""

    def __init__(self, url: str, token: str, timeout_s: float = 600.0):
        self.url, self.token, self.timeout_s = url.rstrip("/"), token, timeout_s
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    @classmethod
    def from_config(cls, cfg) -> "RemoteEnvironment":
        with open(cfg.sandbox_token_file, encoding="utf-8") as f:
            token = f.read().strip()
        # a grading can take the test timeout plus copying; a tool call its own timeout
        return cls(cfg.sandbox_url, token, timeout_s=max(cfg.tool_timeout_s, cfg.test_timeout_s) + 120)

    def _session(self) -> aiohttp.ClientSession:
        loop = id(asyncio.get_running_loop())  # a session belongs to one event loop
        s = self._sessions.get(loop)
        if s is None or s.closed:
            s = self._sessions[loop] = aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return s

    async def request(self, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
        try:
            async with self._session().request(method, self.url + path, json=body) as r:
                try:
                    data = await r.json(content_type=None)
                except (json.JSONDecodeError, aiohttp.ContentTypeError):
                    data = {"error": (await r.text())[:300]}
                if r.status != 200:
                    raise RemoteEnvironmentError(f"{method} {self.url}{path}: {r.status} "
                                                 f"{data.get('error', data) if isinstance(data, dict) else data}")
                return data
        except aiohttp.ClientError as e:
            raise RemoteEnvironmentError(f"{method} {self.url}{path}: {type(e).__name__}: {e}") from e

    async def health(self) -> dict[str, Any]:
        return await self.request("GET", "/v1/health")

    async def open(self, task: Task) -> RemoteEpisode:
        r = await self.request("POST", "/v1/episodes", {"task_id": task.id, "task_digest": task_digest(task)})
        return RemoteEpisode(self, r["episode"])

    async def aclose(self) -> None:
        for s in self._sessions.values():
            await s.close()
        self._sessions.clear()


def serve(argv: list[str] | None = None) -> int:
    from megatron_tg.agent.runtimes import sandbox_from_config
    from megatron_tg.agent.tasks import load_tasks
    from megatron_tg.config import load_config

    ap = argparse.ArgumentParser(prog="python -m megatron_tg.agent.remote serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", help="recipe whose rollout.* settings (tasks, sandbox, limits) the worker uses")
    ap.add_argument("--token-file", required=True, help="file holding the shared secret")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--max-episodes", type=int, default=256)
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. rollout.tasks=FILE")
    a = ap.parse_args(argv)
    from megatron_tg.config.base import ConfigError

    try:
        cfg = load_config(a.recipe, list(a.overrides)).rollout
    except ConfigError as e:
        if not str(e).startswith("model.hf_config: required"):
            raise
        # The worker reads only rollout.*; the schema's one mandatory model field is not its
        # business, so a worker started without the trainer's recipe gets a stand-in.
        cfg = load_config(a.recipe, ["model.hf_config=not-read-by-the-environment-worker", *a.overrides]).rollout
    if not cfg.tasks:
        ap.error("rollout.tasks must name the task file (the same one the trainer reads)")
    tasks = load_tasks(cfg.tasks, repos_root=cfg.repos_root)
    with open(a.token_file, encoding="utf-8") as f:
        token = f.read().strip()
    env = LocalEnvironment.from_config(cfg, sandbox_from_config(cfg))
    server = EnvironmentServer(env, tasks, token, a.max_episodes)
    log.info("environment worker: %d tasks, sandbox %s, on %s:%d", len(tasks), cfg.sandbox, a.host, a.port)
    web.run_app(server.app(), host=a.host, port=a.port, print=None)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        sys.exit(serve(sys.argv[2:]))
    print(__doc__)
    sys.exit(2)
