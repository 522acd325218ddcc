"""aiohttp server exposing SGLang's native HTTP API over the embedded CPU engine.

Routes, bodies and replies follow sglang 0.5.x ``srt/entrypoints/http_server.py``.
The HTTP thread only parses, validates and waits; all model work runs on the
scheduler thread (see ``scheduler.py``), so a long generation never blocks /health.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

from aiohttp import web

from megatron_tg.auth import aiohttp_middleware

from megatron_tg.rollout import transport as T

from . import weights as W
from .weight_api import SGLangRules, WeightEndpoints
from .model_runner import ModelRunner
from .errors import RequestError
from .memory import MemoryOccupation
from .memory_api import MemoryEndpoints
from .protocol import GenRequest, SamplingParams, build_response, parse_generate
from .scheduler import Scheduler

log = logging.getLogger(__name__)

# SGLang's own switches (same names and defaults as sglang 0.5.23's environ.py and
# http_server.py): /health generates one token unless the first is off, and gives up
# with 503 after the second's seconds.
HEALTH_GENERATES = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower() not in ("0", "false", "no")
HEALTH_CHECK_TIMEOUT = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))

# The routes here that sglang 0.5.23 marks ADMIN_OPTIONAL (http_server.py): with an
# --admin-api-key they take only that key; every other route takes --api-key.
ADMIN_OPTIONAL = frozenset((
    "/flush_cache", "/abort_request", "/pause_generation", "/continue_generation",
    "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed",
    "/init_weights_update_group", "/destroy_weights_update_group", "/begin_weight_update",
    "/end_weight_update", "/update_weight_version", "/get_weights_by_name", "/weights_checker",
    "/release_memory_occupation", "/resume_memory_occupation",
))


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.json_response(obj, status=status)


def _error(message: str, status: int = 400) -> web.Response:
    return _json({"error": {"message": message}}, status=status)


class EngineServer(WeightEndpoints, MemoryEndpoints):
    def __init__(
        self,
        model_path: str,
        max_running: int = 64,
        seed: int = 0,
        weight_version: str = "default",
        attn_implementation: str | None = None,
        sglang_version: str = "0.5.23",
        enable_return_routed_experts: bool = False,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        enable_memory_saver: bool = False,
        enable_weights_cpu_backup: bool = False,
        tp_size: int = 1,
    ):
        if tp_size < 1:
            raise ValueError(f"tp_size must be at least 1, got {tp_size}")
        # SGLang's --tp-size: here a stand-in for N ranks reading their own payload of
        # /update_weights_from_tensor (weight_api.py); the model itself is one process.
        self.tp_size = tp_size
        self.tensor_payloads = W.PayloadAccounting()
        # SGLang's --api-key / --admin-api-key, enforced by SGLang's rule (megatron_tg.auth).
        self.api_key, self.admin_api_key = api_key or None, admin_api_key or None
        self.model_path = model_path
        self.runner = ModelRunner(model_path, attn_implementation=attn_implementation,
                                  capture_routing=enable_return_routed_experts)
        self.loader = W.WeightLoader(self.runner.model)
        self.tokenizer = _load_tokenizer(model_path)
        cfg = self.runner.config
        self.context_len = getattr(cfg, "max_position_embeddings", None)
        self.scheduler = Scheduler(
            self.runner,
            _eos_ids(self.runner.model, self.tokenizer),
            tokenizer=self.tokenizer,
            max_running=max_running,
            seed=seed,
            context_len=self.context_len,
        )
        self.weight_version = weight_version
        # SGLang leaves the version alone unless a request sets it; we also bump it on
        # updates that do not, to the count of updates so far ("1", "2", ...), so every
        # update is visible in meta_info and versions never repeat.
        self.num_updates = 0
        self.groups: dict[str, T.WeightUpdateGroup] = {}
        self.rules = SGLangRules(sglang_version)  # the release whose weight-update rules apply
        self.update_open = False  # between /begin_weight_update and /end_weight_update
        self.checker = W.WeightChecker(self.runner.model)
        # SGLang's --enable-memory-saver / --enable-weights-cpu-backup (memory.py).
        self.memory = MemoryOccupation(self.runner.model, enable_memory_saver, enable_weights_cpu_backup)
        self.started = time.time()

    # ---- plumbing between the event loop and the scheduler thread -----------------------
    async def _call(self, fn, drain: bool = True):
        """Run ``fn`` on the scheduler thread between steps (after in-flight requests finish if drain)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(result, err):
            def settle():
                if fut.done():
                    return
                fut.set_exception(err) if err is not None else fut.set_result(result)

            loop.call_soon_threadsafe(settle)

        self.scheduler.call(fn, drain, done)
        return await fut

    async def _signal(self, submit) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        submit(lambda: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None)))
        await fut

    def _finished(self, loop, fut, req: GenRequest) -> None:
        # Runs on the scheduler thread: the version read here is the one the last
        # token was sampled under (updates run on this same thread).
        req.weight_version = self.weight_version
        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(req))

    def app(self) -> web.Application:
        mw = [aiohttp_middleware(self.api_key, self.admin_api_key, ADMIN_OPTIONAL)] \
            if self.api_key or self.admin_api_key else []
        app = web.Application(client_max_size=1 << 30, middlewares=mw)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/ready", self.ready)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.server_info)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_post("/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        self.add_memory_routes(r)
        self.add_weight_routes(r)
        app.on_startup.append(self._startup)
        app.on_shutdown.append(self._shutdown)
        return app

    async def _startup(self, app) -> None:
        self.scheduler.start()

    async def _shutdown(self, app) -> None:
        self.scheduler.stop()
        for g in self.groups.values():
            g.close()
        self.groups.clear()

    async def _body(self, request: web.Request) -> dict:
        if not request.can_read_body:
            return {}
        try:
            body = await request.json()
        except ValueError as exc:
            raise RequestError(f"invalid JSON body: {exc}") from exc
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        return body

    # ---- generation --------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        try:
            reqs, single = parse_generate(await self._body(request), self.tokenizer)
            vocab = getattr(self.runner.config, "vocab_size", None)
            for r in reqs:
                if vocab is not None and any(not 0 <= t < vocab for t in r.input_ids):
                    raise RequestError(f"input_ids must be in [0, {vocab}) for this model")
                if self.context_len is not None:
                    if len(r.input_ids) >= self.context_len:
                        raise RequestError(
                            f"The input ({len(r.input_ids)} tokens) is longer than the model's context length "
                            f"({self.context_len} tokens)."
                        )
        except RequestError as exc:
            return _error(str(exc))
        if (why := self.memory.refusal()) is not None:
            return _error(why)
        loop = asyncio.get_running_loop()
        futs = []
        for r in reqs:
            fut = loop.create_future()
            futs.append(fut)
            self.scheduler.submit(r, lambda req, f=fut: self._finished(loop, f, req))
        pending = set(futs)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=1.0)
            transport = request.transport
            if pending and (transport is None or transport.is_closing()):
                # The client went away (timeout, crash): free the batch slots, as SGLang does.
                for r in reqs:
                    self.scheduler.abort(r.rid)
                await asyncio.wait(pending)
                raise web.HTTPBadRequest(text="client disconnected")
        for f in futs:
            fr = f.result().finish_reason or {}
            if fr.get("type") == "abort" and (fr.get("status_code") or 0) >= 400:
                return _error(fr.get("message", "engine error"), status=int(fr["status_code"]))
        outs = [build_response(f.result(), f.result().weight_version, self.tokenizer) for f in futs]
        return _json(outs[0] if single else outs)

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        rid, abort_all = str(body.get("rid") or ""), bool(body.get("abort_all", False))
        if rid or abort_all:  # an empty rid would prefix-match everything; SGLang ignores it
            self.scheduler.abort(rid, abort_all)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await self._body(request)).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _error(f"unknown pause mode {mode!r}")
        await self._signal(lambda cb: self.scheduler.pause(mode, cb))
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._signal(self.scheduler.resume)
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        # No prefix cache to flush; like SGLang, refuse while requests hold KV (or wait,
        # unless paused on a release whose paused flush ignores the waiting queue).
        if await self._call(self.flush_busy, drain=False):
            return web.Response(
                text="Flush cache failed: there are running or waiting requests.\n", status=400
            )
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )

    # ---- info --------------------------------------------------------------------------
    async def ready(self, request: web.Request) -> web.Response:
        # SGLang: 200 when up and not paused (no generation).
        return web.Response(status=200 if self.scheduler.alive and self.scheduler.paused is None else 503)

    async def health(self, request: web.Request) -> web.Response:
        if HEALTH_GENERATES:
            return await self.health_generate(request)
        return web.Response(status=200 if self.scheduler.alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Generate one token through the scheduler, as SGLang's /health and
        /health_generate do: 200 once it is generated, 503 after HEALTH_CHECK_TIMEOUT
        seconds. While paused nothing is generated, so the answer is 503 after the
        timeout, as on SGLang (a client must not read that as a dead server)."""
        if not self.scheduler.alive or self.memory.refusal() is not None:
            return web.Response(status=503)  # released memory cannot generate the token
        deadline = time.monotonic() + HEALTH_CHECK_TIMEOUT
        # SGLang holds a request at the tokenizer while paused (outside the scheduler, so
        # it blocks no flush); so does this, polling for the continue.
        while self.scheduler.paused is not None:
            if time.monotonic() >= deadline:
                return web.Response(status=503)
            await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        req = GenRequest(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0],
                         params=SamplingParams.from_dict({"max_new_tokens": 1, "temperature": 0}))
        self.scheduler.submit(req, lambda r: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r)))
        try:
            await asyncio.wait_for(fut, timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            self.scheduler.abort(req.rid)
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.runner.config
        # The keys of sglang 0.5.23's /model_info (checked by tests/sglang/test_requests.py).
        return _json(
            {
                "model_path": self.model_path,
                "served_model_name": self.model_path,
                "tokenizer_path": self.model_path if self.tokenizer is not None else None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(cfg, "model_type", None),
                "architectures": getattr(cfg, "architectures", None),
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        s = self.scheduler
        occ = await self._call(self._occupation, drain=False)
        return _json(
            {
                "model_path": self.model_path,
                "weight_version": self.weight_version,
                "max_running_requests": s.max_running,
                "context_length": self.context_len,
                "internal_states": [
                    {"num_running": len(s.running), "num_waiting": len(s.waiting), "paused": s.paused,
                     "decode_steps": s.steps,
                     # SGLang's keys (GB, 3 decimals), here measured now rather than at startup.
                     "memory_usage": {"weight": round(occ["weights_bytes"] / 2**30, 3),
                                      "kvcache": round(occ["kv_cache_bytes"] / 2**30, 3)}}
                ],
                "memory_occupation": occ,  # exact bytes (not an SGLang key)
                "tensor_payloads": self.tensor_payloads.as_dict(),  # not an SGLang key
                "startup_time": self.started,
                "version": self.rules.version,  # the SGLang release whose rules it follows
                "frontend": "embedded-cpu",
                "tp_size": self.tp_size,
                "pp_size": 1,
                "dp_size": 1,
            }
        )

def _load_tokenizer(path: str):
    import glob
    import os

    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")) and not glob.glob(
        os.path.join(path, "*.model")
    ):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception:  # a broken tokenizer must not stop an input_ids-only engine
        log.exception("could not load tokenizer from %s; serving input_ids only", path)
        return None


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
