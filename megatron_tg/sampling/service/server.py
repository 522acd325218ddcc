"""The rollout service: a rollout side (manager, environment workers, judge client) in its
own process, serving judged batches over HTTP (docs/rollout-service.md).

    python -m megatron_tg.sampling.service --recipe R [--factory MOD:ATTR] [--port P] [k=v ...]

It builds the same side the trainer would build in-process (the factory of ``--factory``,
given a :class:`ServiceHost` in place of the trainer) and answers ``POST /v1/<method>``
calls with JSON. A call that takes longer than the caller's ``wait_s`` answers
``{"status": "pending", "call_id": ...}`` and keeps running; the caller asks again with the
same ``call_id``. So no request is held open longer than a few seconds, and a trainer
notices a dead service within one poll instead of hanging on a socket.

The side's calls run one at a time, in the order they arrive (one worker thread), exactly as
the trainer's main thread makes them in-process; ``hello``, ``info``, ``stats`` and
``/health`` answer at once, even while a batch is being generated.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import importlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from megatron_tg.auth import aiohttp_middleware, redact_logs, resolve_key
from megatron_tg.sampling.service.wire import (PROTOCOL, WireError, config_fingerprint, config_mismatch,
                                               dumps, encode_batch, loads)

log = logging.getLogger(__name__)

DEFAULT_FACTORY = "megatron_tg.train.command:default_rollout_side"
MAX_WAIT_S = 60.0


class RequestError(Exception):
    """A call the service refuses (its HTTP status and a message naming what is wrong)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ServiceHost:
    """What a rollout-side factory may use of the trainer, in a process without one: the
    config and the tokenizer (loaded on first use, by the Trainer's directory rule)."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    @functools.cached_property
    def tokenizer(self):
        return load_tokenizer(self.cfg)


@dataclass
class FactorySpec:
    """An importable rollout-side factory: ``target`` = "module:attr" naming
    ``factory(trainer) -> side``, or, with ``kwargs``, a maker ``attr(**kwargs) -> factory``
    (e.g. ``megatron_tg.demo.rl:make_rollout_side`` with its probe settings)."""

    target: str = DEFAULT_FACTORY
    kwargs: dict[str, Any] | None = field(default=None)

    def resolve(self) -> Callable:
        mod, sep, attr = self.target.partition(":")
        if not sep or not mod or not attr:
            raise ValueError(f"rollout-side factory {self.target!r}: expected module:attr")
        fn = getattr(importlib.import_module(mod), attr)
        return fn(**self.kwargs) if self.kwargs is not None else fn


# name -> {argument: accepted types}; every argument is required, no other is accepted.
_INT, _BOOL, _STR_OR_NONE, _DICT = (int,), (bool,), (str, type(None)), (dict,)
METHODS: dict[str, dict[str, tuple[type, ...]]] = {
    "hello": {"protocol": (str,), "config": _DICT},
    "info": {}, "stats": {},
    "next_batch": {"version": _INT},
    "sync_begin": {"version": _INT},
    "sync_end": {"ok": _BOOL, "error": _STR_OR_NONE},
    "adopt_version": {"version": _INT},
    "probe_metrics": {"step": _INT},
    "identity": {}, "state_dict": {}, "load_state_dict": {"state": _DICT},
    "close": {},
}
_IMMEDIATE = ("hello", "info", "stats")


def check_args(method: str, args: Any) -> dict[str, Any]:
    """``args`` if they are exactly ``method``'s arguments with the right types, else a 400."""
    spec = METHODS[method]
    if not isinstance(args, dict):
        raise RequestError(400, f"{method}: args must be an object, got {type(args).__name__}")
    missing = [k for k in spec if k not in args]
    extra = [k for k in args if k not in spec]
    if missing or extra:
        raise RequestError(400, f"{method}: takes arguments {sorted(spec) or 'none'}"
                           + (f"; missing {missing}" if missing else "")
                           + (f"; unexpected {extra}" if extra else ""))
    for k, types in spec.items():
        v = args[k]
        # bool is an int in Python; a version of True is a caller's bug, not version 1
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise RequestError(400, f"{method}: argument {k!r} must be {want}, got "
                               f"{type(v).__name__} {v!r}"[:300])
    return args


class RolloutService:
    """A built rollout side (``RolloutSide``) behind the HTTP methods of :data:`METHODS`."""

    def __init__(self, side, cfg, api_key: str | None = None) -> None:
        self.side, self.cfg = side, cfg
        self.api_key = api_key  # the job's key (megatron_tg.auth): every call but /health needs it
        self.fingerprint = config_fingerprint(cfg)
        self._serial = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="side")
        self._jobs: dict[str, concurrent.futures.Future] = {}
        self._sync: tuple[concurrent.futures.Future, concurrent.futures.Future] | None = None
        self.side_closed = False
        self.closed: asyncio.Event | None = None  # made on the serving loop (serve)

    # ---- HTTP ---------------------------------------------------------------------------
    def app(self) -> web.Application:
        mw = [aiohttp_middleware(self.api_key)] if self.api_key else []
        app = web.Application(client_max_size=64 * 2**20, middlewares=mw)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/{method}", self._handle)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "protocol": PROTOCOL})

    async def _handle(self, request: web.Request) -> web.Response:
        method = request.match_info["method"]
        try:
            if method not in METHODS:
                raise RequestError(404, f"unknown method {method!r}; the service has "
                                   f"{', '.join(sorted(METHODS))}")
            body = await request.read()
            d = loads(body, f"{method}: request body") if body else {}
            if not isinstance(d, dict):
                raise RequestError(400, f"{method}: request body must be a JSON object")
            unknown = set(d) - {"args", "call_id", "wait_s"}
            if unknown:
                raise RequestError(400, f"{method}: unknown request keys {sorted(unknown)} "
                                   "(expected args, call_id, wait_s)")
            args = check_args(method, d.get("args", {}))
            wait_s = d.get("wait_s", 1.0)
            if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or wait_s < 0:
                raise RequestError(400, f"{method}: wait_s must be a number >= 0, got {wait_s!r}")
            if method in _IMMEDIATE:
                result = getattr(self, f"_{method}")(**args)
                return self._reply(200, {"status": "done", "result": result})
            call_id = d.get("call_id") or uuid.uuid4().hex
            if not isinstance(call_id, str):
                raise RequestError(400, f"{method}: call_id must be a string")
            job = self._jobs.get(call_id)
            if job is None:
                job = self._jobs[call_id] = self._serial.submit(getattr(self, f"_{method}"), **args)
            await asyncio.wait([asyncio.wrap_future(job)], timeout=min(float(wait_s), MAX_WAIT_S))
            if not job.done():
                return self._reply(200, {"status": "pending", "call_id": call_id})
            del self._jobs[call_id]
            result = job.result()
            if method == "close":
                asyncio.get_running_loop().call_later(0.1, self.closed.set)
            return self._reply(200, {"status": "done", "result": result})
        except (RequestError, WireError) as exc:
            status = exc.status if isinstance(exc, RequestError) else 400
            return self._reply(status, {"error": {"type": type(exc).__name__, "message": str(exc)}})
        except Exception as exc:  # the side failed: the trainer gets its type and message
            log.exception("rollout service: %s failed", method)
            return self._reply(500, {"error": {"type": type(exc).__name__, "message": str(exc)}})

    @staticmethod
    def _reply(status: int, obj: Any) -> web.Response:
        return web.Response(status=status, body=dumps(obj), content_type="application/json")

    # ---- methods ------------------------------------------------------------------------
    def _hello(self, protocol: str, config: dict) -> dict[str, Any]:
        if protocol != PROTOCOL:
            raise RequestError(409, f"hello: the trainer speaks {protocol!r}, this service {PROTOCOL!r}")
        diff = config_mismatch(self.fingerprint, config)
        if diff:
            raise RequestError(409, "hello: the trainer's config and the service's differ (they "
                               "must generate the same batches): " + "; ".join(diff[:10])
                               + (f"; and {len(diff) - 10} more" if len(diff) > 10 else ""))
        return self._info()

    def _info(self) -> dict[str, Any]:
        client = self.side.client
        return {"protocol": PROTOCOL, "pid": os.getpid(), "host": socket.gethostname(),
                "admin_urls": list(client.admin_urls),
                "engines_started": bool(getattr(self.side, "engines", [])),
                "env_workers": self.side.manager.tool_slots.limit}

    def _stats(self) -> dict[str, Any]:
        async def read():
            return {**self.side.manager.counters(), **self.side.manager.tool_slots.peek()}
        return self.side.call(read())

    def _next_batch(self, version: int) -> dict[str, Any]:
        samples, metrics = self.side.next_batch(version)
        return encode_batch(samples, self.side.last_judged, metrics)

    def _sync_begin(self, version: int) -> dict[str, Any]:
        """Close the version gate and pause the engines (the manager's update_weights), and
        hold them paused until ``sync_end``: the trainer pushes the weights meanwhile."""
        if self._sync is not None:
            raise RequestError(409, "sync_begin: a weight sync is already in progress (no sync_end)")
        paused, release = threading.Event(), concurrent.futures.Future()

        async def hold() -> None:
            paused.set()
            await asyncio.wrap_future(release)

        update = asyncio.run_coroutine_threadsafe(
            self.side.manager.update_weights(hold, version=version), self.side.loop)
        while not paused.wait(0.05):
            if update.done():
                update.result()  # the pause failed or the version is not newer: say why
        self._sync = (update, release)
        return {"paused": True, "version": version}

    def _sync_end(self, ok: bool, error: str | None) -> dict[str, Any]:
        if self._sync is None:
            raise RequestError(409, "sync_end: no weight sync in progress (sync_begin first)")
        update, release = self._sync
        self._sync = None
        if ok:
            release.set_result(None)
            update.result()
        else:  # the push failed: generation resumes on the old weights, version unchanged
            release.set_exception(RuntimeError(f"the trainer's weight push failed: {error}"))
            try:
                update.result()
            except RuntimeError:
                pass
        return {"version": self.side.manager.version}

    def _adopt_version(self, version: int) -> dict[str, Any]:
        """The trainer pushed ``version`` straight into the engines (a restart): serve it."""
        manager = self.side.manager

        async def adopt() -> None:
            manager.adopt_version(version)

        asyncio.run_coroutine_threadsafe(adopt(), self.side.loop).result()
        return {"version": manager.version}

    def _probe_metrics(self, step: int) -> dict[str, float]:
        return self.side.probe_metrics(step)

    def _identity(self) -> dict[str, Any]:
        return self.side.identity()

    def _state_dict(self) -> dict[str, Any]:
        return self.side.state_dict()

    def _load_state_dict(self, state: dict) -> dict[str, Any]:
        self.side.load_state_dict(state)
        return {}

    def _close(self) -> dict[str, Any]:
        if not self.side_closed:
            self.side_closed = True
            self.side.close()
        return {}


def load_tokenizer(cfg):
    """The tokenizer the trainer loads (the same directory rule as the Trainer's)."""
    from transformers import AutoTokenizer

    tok_dir = cfg.model.tokenizer or cfg.model.hf_checkpoint or cfg.model.hf_config
    return AutoTokenizer.from_pretrained(tok_dir if os.path.isdir(tok_dir) else os.path.dirname(tok_dir))


async def serve(service: RolloutService, host: str, port: int, ready_file: str | None) -> None:
    service.closed = asyncio.Event()
    runner = web.AppRunner(service.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{bound}"
    print(f"[rollout service] pid {os.getpid()} serving {url} ({PROTOCOL})", flush=True)
    if ready_file:  # written last and renamed: the spawner reads a whole file or none
        tmp = Path(f"{ready_file}.tmp")
        tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}))
        tmp.rename(ready_file)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.closed.set)
    try:
        await service.closed.wait()
    finally:
        await runner.cleanup()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_tg.sampling.service", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", help="YAML recipe merged over the defaults (the trainer's)")
    ap.add_argument("--factory", default=DEFAULT_FACTORY, help="module:attr of the rollout-side factory")
    ap.add_argument("--factory-kwargs", help="JSON object: call the factory's maker with these first")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: any free port (see --ready-file)")
    ap.add_argument("--ready-file", help="write {url, pid} here once serving")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from megatron_tg.config import load_config

    cfg = load_config(a.recipe, list(a.overrides))
    api_key = resolve_key(cfg.rollout.api_key_file)  # its engines get the same key (RolloutSide)
    redact_logs(api_key)
    if api_key is None:
        log.warning("rollout service: no API key (rollout.api_key_file, $TG_API_KEY_FILE): anyone "
                    "who reaches %s:%s can take batches and drive weight syncs", a.host, a.port)
    spec = FactorySpec(a.factory, json.loads(a.factory_kwargs) if a.factory_kwargs else None)
    side = spec.resolve()(ServiceHost(cfg))
    service = RolloutService(side, cfg, api_key)
    try:
        asyncio.run(serve(service, a.host, a.port, a.ready_file))
    finally:
        try:  # SIGTERM (Slurm teardown, a dead trainer): stop engines and sandboxes too
            service._close()
        except Exception:  # noqa: BLE001 - the process is ending either way
            log.warning("rollout service: closing the side failed", exc_info=True)
    if service._jobs:  # a call still blocked in the side's worker thread would block exit
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
