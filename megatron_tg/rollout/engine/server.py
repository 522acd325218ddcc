"""aiohttp server exposing SGLang's native HTTP API over the embedded CPU engine.

Routes, bodies and replies follow sglang 0.5.x ``srt/entrypoints/http_server.py``.
The HTTP thread only parses, validates and waits; all model work runs on the
scheduler thread (see ``scheduler.py``), so a long generation never blocks /health.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from . import weights as W
from .model_runner import ModelRunner
from .protocol import GenRequest, RequestError, SamplingParams, build_response, parse_generate
from .scheduler import Scheduler

log = logging.getLogger(__name__)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.json_response(obj, status=status)


def _error(message: str, status: int = 400) -> web.Response:
    return _json({"error": {"message": message}}, status=status)


class EngineServer:
    def __init__(
        self,
        model_path: str,
        max_running: int = 64,
        seed: int = 0,
        weight_version: str = "default",
        attn_implementation: str | None = None,
        enable_return_routed_experts: bool = False,
    ):
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
        self.groups: dict[str, W.WeightUpdateGroup] = {}
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
        app = web.Application(client_max_size=1 << 30)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/ready", self.health)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.server_info)
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_post("/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_route("GET", "/get_weights_by_name", self.get_weights_by_name)
        r.add_post("/get_weights_by_name", self.get_weights_by_name)
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
        # No prefix cache to flush; like SGLang, refuse while requests hold KV.
        busy = await self._call(lambda: self.scheduler.holds_kv() or bool(self.scheduler.waiting), drain=False)
        if busy:
            return web.Response(
                text="Flush cache failed: there are running or waiting requests.\n", status=400
            )
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )

    # ---- info --------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        # SGLang's /health is a liveness check unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION.
        return web.Response(status=200 if self.scheduler.alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Generate one token through the scheduler, as SGLang does (20 s budget).

        Deviation: while paused it answers 200 at once (SGLang would wait and time out),
        so a paused-for-weight-sync server is not mistaken for a dead one.
        """
        if not self.scheduler.alive:
            return web.Response(status=503)
        if self.scheduler.paused is not None:
            return web.Response(status=200)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        req = GenRequest(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0],
                         params=SamplingParams.from_dict({"max_new_tokens": 1, "temperature": 0}))
        self.scheduler.submit(req, lambda r: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r)))
        try:
            await asyncio.wait_for(fut, timeout=20)
        except asyncio.TimeoutError:
            self.scheduler.abort(req.rid)
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.runner.config
        return _json(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path if self.tokenizer is not None else None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(cfg, "model_type", None),
                "architectures": getattr(cfg, "architectures", None),
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        s = self.scheduler
        return _json(
            {
                "model_path": self.model_path,
                "weight_version": self.weight_version,
                "max_running_requests": s.max_running,
                "context_length": self.context_len,
                "internal_states": [
                    {"num_running": len(s.running), "num_waiting": len(s.waiting), "paused": s.paused,
                     "decode_steps": s.steps}
                ],
                "startup_time": self.started,
                "version": "megatron-tg-embedded",
                "frontend": "embedded-cpu",
            }
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return _json({"weight_version": self.weight_version})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if "new_version" not in body:
            return _json({"success": False, "message": "new_version is required"}, 400)
        if body.get("abort_all_requests", True):
            self.scheduler.abort("", True)
        self.weight_version = str(body["new_version"])
        return _json({"success": True, "message": f"Weight version updated to {self.weight_version}",
                      "new_version": self.weight_version})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await self._body(request) if request.method == "POST" else dict(request.query)
        try:
            t = self.loader._target(str(body["name"]))
        except KeyError as exc:
            return _error(str(exc))
        n = int(body.get("truncate_size", 100))
        return _json(t.detach()[:n].tolist() if t.dim() else t.item())

    # ---- weight updates ---------------------------------------------------------------
    async def _apply(self, named_tensors_fn, body: dict, what: str) -> tuple[bool, str]:
        """Load tensors on the scheduler thread and bump the version there, atomically
        with respect to generation steps, so meta_info.weight_version is exact."""
        if body.get("abort_all_requests"):
            self.scheduler.abort("", True)
        new = body.get("weight_version")

        def load():
            n = self.loader.load(named_tensors_fn())
            self.num_updates += 1
            self.weight_version = str(new) if new is not None else str(self.num_updates)
            return n

        try:
            n = await self._call(load, drain=True)
        except Exception as exc:
            log.exception("%s failed", what)
            return False, f"Failed to update weights: {exc}"
        return True, f"Succeeded to update model weights ({n} tensors)."

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            path = str(body["model_path"])
        except (RequestError, KeyError) as exc:
            return _json({"success": False, "message": f"bad request: {exc}", "num_paused_requests": 0}, 400)
        ok, msg = await self._apply(lambda: list(W.iter_checkpoint(path)), body, "update_weights_from_disk")
        if ok:
            self.model_path = path
        return _json({"success": ok, "message": msg, "num_paused_requests": 0}, 200 if ok else 400)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            tensors = [nt for s in body["serialized_named_tensors"] for nt in W.decode_named_tensors(s)]
        except Exception as exc:
            return _json({"success": False, "message": f"cannot decode serialized_named_tensors: {exc}"}, 400)
        ok, msg = await self._apply(lambda: tensors, body, "update_weights_from_tensor")
        return _json({"success": ok, "message": msg}, 200 if ok else 400)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            name = body.get("group_name", "weight_update_group")
            args = (body["master_address"], int(body["master_port"]), int(body["rank_offset"]),
                    int(body["world_size"]), name, body.get("backend", "nccl"))
        except (KeyError, ValueError) as exc:
            return _json({"success": False, "message": f"bad request: {exc}"}, 400)
        if args[5] != "gloo":
            return _json({"success": False, "message": f"Failed to initialize custom process group: the embedded "
                          f"CPU engine supports backend='gloo' only, got {args[5]!r}."}, 400)
        try:
            # The rendezvous blocks until the trainer (rank 0) joins: keep it off the loop.
            group = await asyncio.to_thread(W.create_weight_update_group, *args)
        except Exception as exc:
            return _json({"success": False, "message": f"Failed to initialize custom process group: {exc}."}, 400)
        self.groups[name] = group
        return _json({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        name = (await self._body(request)).get("group_name", "weight_update_group")
        group = self.groups.pop(name, None)
        if group is None:
            return _json({"success": False, "message": "The group to be destroyed does not exist."}, 400)
        group.close()
        return _json({"success": True, "message": "Succeeded to destroy custom process group."})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        name = body.get("group_name", "weight_update_group")
        group = self.groups.get(name)
        if group is None:
            return _json({"success": False, "message": f"Group {name} not in {list(self.groups)}. "
                          "Please call `init_weights_update_group` first."}, 400)
        try:
            # Receive right away (the trainer is already broadcasting); load between steps.
            received = await asyncio.to_thread(
                W.receive_broadcast, group, body["names"], body["dtypes"], body["shapes"], body.get("load_format")
            )
        except Exception as exc:
            return _json({"success": False, "message": f"Failed to receive weights: {exc}"}, 400)
        ok, msg = await self._apply(lambda: received, body, "update_weights_from_distributed")
        return _json({"success": ok, "message": msg}, 200 if ok else 400)


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
