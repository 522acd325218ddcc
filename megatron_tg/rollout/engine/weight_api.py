"""The embedded engine's weight-update endpoints, enforcing SGLang's rules so that CPU
tests fail the way a real server would (read from sglang 0.5.20-0.5.23's
``managers/scheduler_components/weight_updater.py``, ``managers/scheduler.py`` and
``weight_sync/tensor_bucket.py``):

* from 0.5.21, ``update_weights_from_distributed`` / ``_from_tensor`` outside
  ``/begin_weight_update`` ... ``/end_weight_update`` answer 400 without receiving;
  a second begin, or an end without a begin, is refused;
* an update with ``flush_cache=true`` (SGLang's default) on a busy engine loads the
  weights, then answers 400 because the flush failed; a flush fails while requests run
  (``pause_mode=in_place`` keeps them running), and, before 0.5.21, while any wait;
* a flattened bucket whose tensor starts at a byte offset that is not a multiple of its
  element size is refused;
* a weight name the model does not have is skipped without an error (only the weight
  checker, snapshot -> reset_tensors -> update -> compare, notices).

``EngineServer(sglang_version=...)`` picks the release whose rules apply (default 0.5.23);
``/server_info`` reports it as ``version``, with pp/dp sizes of 1 and ``tp_size`` 1 unless
started with ``--tp-size N`` (then ``/update_weights_from_tensor`` takes N payloads: see
there).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from aiohttp import web
from packaging.version import Version

from megatron_tg.rollout import transport as T

from . import weights as W
from .errors import RequestError
from .memory import WEIGHTS, MemoryOccupation, MemoryStateError

log = logging.getLogger(__name__)

FLUSH_FAILED = ("Weights were updated, but the cache was not flushed because requests are still running "
                "or queued. Retract or finish them, then call /flush_cache.")


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.json_response(obj, status=status)


class SGLangRules:
    """Which of SGLang's weight-update rules hold at one release."""

    def __init__(self, version: str = "0.5.23"):
        self.version = version
        v = Version(version)
        self.begin_end_required = v >= Version("0.5.21")
        self.paused_flush_ignores_waiting = v >= Version("0.5.21")


class WeightEndpoints:
    """Mixed into ``EngineServer``: needs scheduler, loader, checker, groups, rules, _call, _body."""

    rules: SGLangRules
    memory: MemoryOccupation
    update_open: bool
    tp_size: int
    tensor_payloads: "W.PayloadAccounting"
    groups: dict[str, T.WeightUpdateGroup]

    def add_weight_routes(self, r: web.UrlDispatcher) -> None:
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        if self.rules.begin_end_required:
            r.add_post("/begin_weight_update", self.begin_weight_update)
            r.add_post("/end_weight_update", self.end_weight_update)
        for method in ("GET", "POST"):
            r.add_route(method, "/weights_checker", self.weights_checker)
            r.add_route(method, "/get_weights_by_name", self.get_weights_by_name)

    def flush_busy(self) -> bool:
        """SGLang's ``not is_fully_idle(ignore_waiting=paused)``; call on the scheduler thread."""
        s = self.scheduler
        waiting = bool(s.waiting) and not (s.paused is not None and self.rules.paused_flush_ignores_waiting)
        return s.holds_kv() or bool(s.running) or waiting

    # ---- versions ----------------------------------------------------------------------
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

    # ---- begin / end ---------------------------------------------------------------------
    # Messages below are SGLang 0.5.23's own wording.
    async def begin_weight_update(self, request: web.Request) -> web.Response:
        await self._body(request)
        if self.update_open:
            return _json({"success": False, "message": "a weight-update session is already open; "
                          "call end_weight_update() first"}, 400)
        self.update_open = True
        return _json({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await self._body(request)
        if not self.update_open:
            return _json({"success": False, "message": "no weight-update session is open; "
                          "call begin_weight_update() first"}, 400)
        self.update_open = False
        return _json({"success": True, "message": "Success"})

    def _outside_begin_end(self, what: str) -> web.Response | None:
        if self.rules.begin_end_required and not self.update_open:
            return _json({"success": False, "message": f"{what} must run between begin_weight_update() "
                          "and end_weight_update()"}, 400)
        return None

    # ---- loading -----------------------------------------------------------------------
    async def _apply(self, named_tensors_fn: Callable[[], list], body: dict, what: str) -> tuple[bool, str]:
        """Load tensors on the scheduler thread and bump the version there, atomically
        with respect to generation steps, so meta_info.weight_version is exact; then flush
        if asked (SGLang's default), failing the call when requests hold the cache."""
        if body.get("abort_all_requests"):
            self.scheduler.abort("", True)
        new = body.get("weight_version")

        def load():
            if WEIGHTS in self.memory.released:
                # Their storage is freed (SGLang would write into unmapped memory).
                raise MemoryStateError("the weights' memory is released: call /resume_memory_occupation "
                                       "with tags ['weights'] before updating them")
            n, skipped = self.loader.load(named_tensors_fn())
            self.num_updates += 1
            self.weight_version = str(new) if new is not None else str(self.num_updates)
            flushed = not (body.get("flush_cache", True) and self.flush_busy())
            return n, flushed

        try:
            n, flushed = await self._call(load, drain=True)
        except Exception as exc:
            log.exception("%s failed", what)
            return False, f"Failed to update weights: {exc}"
        if not flushed:
            return False, FLUSH_FAILED
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
        """SGLang's body: ``serialized_named_tensors`` holds one MultiprocessingSerializer
        payload per engine TP rank (``tp_size`` of them: a list of another length means the
        sender mapped its ranks to another engine layout, refused here though SGLang would read
        entry tp_rank and ignore the rest). ``load_format`` ``"flattened_bucket"`` carries
        {flattened_tensor, metadata}, None or ``"direct"`` a list of (name, tensor).

        With ``--tp-size N`` the engine stands in for SGLang's N ranks, each of which opens
        only its own entry: it opens every entry (from N processes, each payload's memory
        belonging to the trainer rank on that engine rank's GPU), refuses them unless all are
        bit-identical (every SGLang rank takes its own shard of the same full tensors), and
        loads one. The shared tensors are copied into the model and dropped before the reply,
        so the senders may free them once they have it."""
        body = await self._body(request)
        if (refused := self._outside_begin_end("update_weights_from_tensor")) is not None:
            return refused
        payloads, fmt = body.get("serialized_named_tensors"), body.get("load_format")
        if not isinstance(payloads, list) or len(payloads) != self.tp_size:
            n = len(payloads) if isinstance(payloads, list) else payloads
            return _json({"success": False, "message": "serialized_named_tensors must hold one payload per TP rank "
                          f"of this engine (tp_size={self.tp_size}), got {n!r}"}, 400)
        if fmt not in (None, "direct", T.LOAD_FORMAT_BUCKET):
            return _json({"success": False, "message": f"Unknown load_format={fmt}"}, 400)
        objs: list = []
        ranks: list[list[tuple[str, Any]]] = []
        tensors: list[tuple[str, Any]] = []
        opened: list[list[str]] = []
        try:
            for r, payload in enumerate(payloads):
                names: list[str] = []
                opened.append(names)
                try:
                    objs.append(await asyncio.to_thread(T.deserialize_payload, payload, names))
                    ranks.append(T.reconstruct_bucket(objs[-1]) if fmt == T.LOAD_FORMAT_BUCKET
                                 else [(str(n), t) for n, t in objs[-1]])
                except Exception as exc:
                    return _json({"success": False, "message": f"cannot deserialize serialized_named_tensors[{r}] "
                                  f"(TP rank {r}): {exc}"}, 400)
            self.tensor_payloads.record(opened)
            for r in range(1, len(ranks)):
                if (why := W.first_difference(ranks[0], ranks[r])) is not None:
                    return _json({"success": False, "message": f"serialized_named_tensors[{r}] (TP rank {r}) differs "
                                  f"from TP rank 0's: {why}; every TP rank must receive the same full "
                                  f"tensors"}, 400)
            tensors = ranks[0]
            ok, msg = await self._apply(lambda: tensors, body, "update_weights_from_tensor")
        finally:
            del objs, ranks, tensors  # close the shared-memory files before answering
        return _json({"success": ok, "message": msg}, 200 if ok else 400)

    # ---- the weight-update group ----------------------------------------------------------
    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if self.tp_size != 1:  # its N ranks are a stand-in for /update_weights_from_tensor only
            return _json({"success": False, "message": f"Failed to initialize custom process group: the "
                          f"embedded engine joins as one rank, but was started with --tp-size "
                          f"{self.tp_size} (a stand-in for update_weights_from_tensor only)."}, 400)
        try:
            name = body.get("group_name", "weight_update_group")
            # One GPU (tp_rank 0): SGLang's rank is rank_offset + tp_rank.
            args = (body["master_address"], int(body["master_port"]), int(body["rank_offset"]),
                    int(body["world_size"]), name, body.get("backend", "nccl"))
        except (KeyError, ValueError) as exc:
            return _json({"success": False, "message": f"bad request: {exc}"}, 400)
        if args[5] != "gloo":
            return _json({"success": False, "message": f"Failed to initialize custom process group: the embedded "
                          f"CPU engine supports backend='gloo' only, got {args[5]!r}."}, 400)
        if name in self.groups:
            return _json({"success": False, "message": f"Failed to initialize custom process group: "
                          f"group {name!r} exists."}, 400)
        try:
            # The rendezvous blocks until every member joins: keep it off the event loop.
            group = await asyncio.to_thread(T.init_weight_update_group, *args)
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
        if (refused := self._outside_begin_end("update_weights_from_distributed")) is not None:
            return refused  # before joining the broadcast, as SGLang: the sender's broadcast then hangs
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

    # ---- inspection ----------------------------------------------------------------------
    async def weights_checker(self, request: web.Request) -> web.Response:
        body = await self._body(request) if request.method == "POST" else dict(request.query)
        action = str(body.get("action", "checksum"))
        try:
            ranks = await self._call(lambda: self.checker.handle(action, body.get("skip_tensor_list")),
                                     drain=False)
        except ValueError as exc:
            return _json({"success": False, "message": str(exc)}, 400)
        out: dict[str, Any] = {"success": True, "message": "Success."}
        if ranks is not None:  # SGLang's reply to checksum: the ranks and their combined hash
            import hashlib

            out["ranks"] = ranks
            out["per_engine_checksum"] = hashlib.sha256(
                "".join(r["per_gpu_checksum"] for r in ranks).encode()).hexdigest()
        return _json(out)

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await self._body(request) if request.method == "POST" else dict(request.query)
        t = self.loader.target(str(body.get("name")))
        if t is None:
            return _json({"error": {"message": f"no parameter matches weight name {body.get('name')!r}"}}, 400)
        n = int(body.get("truncate_size", 100))
        return _json(t.detach()[:n].tolist() if t.dim() else t.item())
