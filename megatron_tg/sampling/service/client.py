"""The trainer's end of the rollout service: a :class:`~megatron_tg.sampling.protocols.
RolloutSource` whose rollout side runs in another process (docs/rollout-service.md).

:func:`rollout_source` picks the placement ``rollout.service`` names: the side in rank 0's
own process (``in_process``), a service process rank 0 starts beside itself (``local``), or a
running service at ``rollout.service_url`` (``remote``: the Slurm scripts start one). The
loop cannot tell them apart.

Weight sync stays trainer -> engines: the service reports the engines' admin URLs, and this
client forms the weight-update group with them itself, so the tensors never pass through the
service. The service only holds the engines paused around the push (``sync_begin`` /
``sync_end``: the manager's version gate and pause), as the in-process side does.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable
from urllib.parse import urlparse

import torch

from megatron_tg.auth import KEY_FILE_ENV, bearer, resolve_key, write_key_dir
from megatron_tg.rollout.client import SGLangClient
from megatron_tg.sampling.protocols import MakeRolloutSource, RolloutSource, SyncResult, WeightTarget
from megatron_tg.sampling.service.server import FactorySpec
from megatron_tg.sampling.service.wire import PROTOCOL, config_fingerprint, decode_batch, dumps, loads
from megatron_tg.weight_sync.engine_loss import form_target

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class RolloutServiceError(RuntimeError):
    """The rollout service refused a call, failed it, or cannot be reached."""


@dataclass
class ServiceProcess:
    """A service this trainer started (``rollout.service=local``)."""

    proc: subprocess.Popen
    log_path: Path

    def exited(self, grace_s: float = 0.0) -> int | None:
        """The exit status, or None while running (``grace_s``: wait that long for an exit
        under way, e.g. a killed process whose socket closed before it was reaped)."""
        try:
            return self.proc.wait(timeout=grace_s) if grace_s else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


class RolloutServiceClient:
    """Rank 0's rollout side as calls to a rollout service at ``url``."""

    def __init__(self, url: str, cfg, *, process: ServiceProcess | None = None) -> None:
        self.url, self.cfg, self.process = url.rstrip("/"), cfg, process
        self.poll_s = cfg.rollout.service_poll_s
        self._auth = bearer(resolve_key(cfg.rollout.api_key_file))  # the job's key, if any
        self.last_judged: list = []
        self.info = self._call("hello", protocol=PROTOCOL, config=config_fingerprint(cfg))
        urls = self.info["admin_urls"]
        if (process is None and self.info.get("engines_started")
                and any(urlparse(u).hostname in _LOOPBACK for u in urls)):
            raise RolloutServiceError(
                f"rollout service {self.url} started its own engines at {urls}: loopback "
                "addresses a trainer on another host cannot reach (start the engines as "
                "servers and give rollout.server_urls, or use rollout.service=local)")
        # The trainer's own engine client, for the weight push and the engine probes only.
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="service-client", daemon=True)
        self._thread.start()
        r, t = cfg.rollout, cfg.timeouts
        # The same limits as the in-process side's client (timeouts.*).
        self.client = SGLangClient(urls, timeout_s=r.request_timeout_s, max_retries=r.max_retries,
                                   admin_timeout_s=t.http_admin_s, connect_timeout_s=t.http_connect_s,
                                   probe_interval_s=t.health_interval_s, health_timeout_s=t.health_s,
                                   api_key=resolve_key(r.api_key_file))
        self.weight_target_: WeightTarget | None = None

    # ---- RPC ----------------------------------------------------------------------------
    def _post(self, method: str, body: dict[str, Any]) -> tuple[int, Any]:
        req = urllib.request.Request(f"{self.url}/v1/{method}", data=dumps(body), method="POST",
                                     headers={"Content-Type": "application/json", **self._auth})
        try:
            with urllib.request.urlopen(req, timeout=self.poll_s + 30) as resp:
                return resp.status, loads(resp.read(), f"{method}: reply")
        except urllib.error.HTTPError as exc:
            data = exc.read()
            try:
                return exc.code, loads(data, f"{method}: reply")
            except ValueError:
                return exc.code, {"error": {"type": "HTTPError", "message": data[:500].decode(errors="replace")}}
        except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, reset, timed out, cut
            raise self._unreachable(method, exc) from exc

    def _unreachable(self, method: str, exc: BaseException) -> RolloutServiceError:
        code = self.process.exited(grace_s=3.0) if self.process is not None else None
        if code is not None:
            return RolloutServiceError(
                f"rollout service (pid {self.process.proc.pid}) exited with status {code} "
                f"during {method}; last lines of {self.process.log_path}:\n{self.process.log_tail()}")
        return RolloutServiceError(f"rollout service {self.url} did not answer {method}: "
                                   f"{type(exc).__name__}: {exc}")

    def _call(self, method: str, **args: Any) -> Any:
        """One call, polled until done: each request returns within ``service_poll_s``, so a
        service that dies or stops answering is noticed within one poll."""
        body = {"args": args, "call_id": uuid.uuid4().hex, "wait_s": self.poll_s}
        while True:
            status, reply = self._post(method, body)
            if status == 200 and isinstance(reply, dict) and reply.get("status") == "pending":
                if self.process is not None and self.process.exited() is not None:
                    raise self._unreachable(method, RuntimeError("exited"))
                continue
            if status == 200 and isinstance(reply, dict) and reply.get("status") == "done":
                return reply.get("result")
            err = reply.get("error", {}) if isinstance(reply, dict) else {}
            if not isinstance(err, dict):  # the key check's {"error": "Unauthorized"} (401)
                err = {"type": str(err), "message": "this client's API key was refused or missing "
                       "(rollout.api_key_file: the service's key)" if status == 401 else str(err)}
            raise RolloutServiceError(f"rollout service {self.url}: {method} failed (HTTP {status}): "
                                      f"{err.get('type', '?')}: {err.get('message', reply)}")

    # ---- RolloutSource ------------------------------------------------------------------
    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def next_batch(self, version: int):
        t0 = time.perf_counter()
        batch = self._call("next_batch", version=version)
        t1 = time.perf_counter()
        samples, self.last_judged, metrics = decode_batch(batch)
        metrics["service/decode_s"] = time.perf_counter() - t1
        metrics["service/next_batch_s"] = t1 - t0
        return samples, metrics

    def weight_target(self) -> WeightTarget:
        """The weight-update group between trainer rank 0 and the engines, formed here (the
        engines connect to this host): ``rollout.sync_master_address``, else loopback when
        the service started embedded engines beside this trainer, else this host's name."""
        if self.weight_target_ is None:
            r = self.cfg.rollout
            local = self.process is not None and self.info.get("engines_started")
            host = r.sync_master_address or ("127.0.0.1" if local else socket.gethostname())
            backend = r.sync_backend if r.sync_backend != "auto" else (
                "nccl" if r.engine == "sglang" and torch.cuda.is_available() else "gloo")
            # One target for the run, as in process: engine loss and return replace its
            # group and count its group names in place (weight_sync/engine_loss.py).
            self.weight_target_ = form_target(self.call, self.client, host, backend,
                                              self.cfg.timeouts.weight_sync_s, r.router_url)
        return self.weight_target_

    def run_sync(self, push: Callable[[], Awaitable[SyncResult]], version: int, *,
                 restart: bool = False) -> SyncResult:
        if restart:  # the engines just started: nothing generates; serve the pushed version
            stats = self.call(push())
            self._call("adopt_version", version=version)  # as the in-process side adopts it
            return stats
        self._call("sync_begin", version=version)
        try:
            stats = self.call(push())
        except BaseException as exc:
            self._call("sync_end", ok=False, error=f"{type(exc).__name__}: {exc}")
            raise
        self._call("sync_end", ok=True, error=None)
        return stats

    def probe_metrics(self, step: int) -> dict[str, float]:
        return self._call("probe_metrics", step=step)

    def identity(self) -> dict[str, Any]:
        return {**self._call("identity"), "rollout_service": {
            "url": self.url, "pid": self.info.get("pid"), "host": self.info.get("host"),
            "protocol": self.info.get("protocol")}}

    def stats(self) -> dict[str, Any]:
        """The manager's counters and the tool slots now (tests, monitoring)."""
        return self._call("stats")

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state=state)

    def close(self) -> None:
        try:
            if self.weight_target_ is not None:
                self.call(self.client.destroy_weights_update_group(self.weight_target_.group))
            if self.process is None or self.process.exited() is None:
                self._call("close")
        finally:
            self.call(self.client.close())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            if self.process is not None:
                self.process.stop()


def start_local_service(cfg, spec: FactorySpec, *, timeout_s: float | None = None
                        ) -> RolloutServiceClient:
    """Start ``python -m megatron_tg.sampling.service`` beside this trainer (its config is this
    one's, resolved to ``RUN_DIR/rollout_service/config.yaml``) and connect to it. Its log is
    ``RUN_DIR/rollout_service/service.log``; it gets SIGTERM if this process dies."""
    from megatron_tg.config import save_resolved
    from megatron_tg.rollout.engine.launch import _die_with_parent

    d = Path(cfg.logging.run_dir) / "rollout_service"
    if not (cfg.rollout.api_key_file or os.environ.get(KEY_FILE_ENV)):
        # No job key: the service and its engines get one of their own (its path, not the
        # key, goes into the resolved config both sides read).
        cfg.rollout.api_key_file = str(write_key_dir(d / "secret")[0])
    recipe = save_resolved(cfg, d)
    ready = d / "ready.json"
    ready.unlink(missing_ok=True)
    log_path = d / "service.log"
    cmd = [sys.executable, "-m", "megatron_tg.sampling.service", "--recipe", str(recipe),
           "--factory", spec.target, "--host", "127.0.0.1", "--port", "0", "--ready-file", str(ready)]
    if spec.kwargs is not None:
        cmd += ["--factory-kwargs", json.dumps(spec.kwargs)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=_die_with_parent)
    process = ServiceProcess(proc, log_path)
    timeout_s = cfg.rollout.service_start_timeout_s if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if process.exited() is not None:
            raise RolloutServiceError(f"rollout service exited with status {proc.returncode} while "
                                      f"starting; last lines of {log_path}:\n{process.log_tail()}")
        if time.monotonic() > deadline:
            process.stop()
            raise RolloutServiceError(f"rollout service not ready after {timeout_s} s "
                                      f"(rollout.service_start_timeout_s); see {log_path}")
        time.sleep(0.1)
    url = json.loads(ready.read_text())["url"]
    try:
        return RolloutServiceClient(url, cfg, process=process)
    except BaseException:
        process.stop()
        raise


def rollout_source(spec: FactorySpec) -> MakeRolloutSource:
    """``make_rollout_side(trainer)`` for the loop, placed as ``rollout.service`` says."""
    def make(trainer) -> RolloutSource:
        r = trainer.cfg.rollout
        if r.service == "in_process":
            return spec.resolve()(trainer)
        if r.service == "local":
            return start_local_service(trainer.cfg, spec)
        return RolloutServiceClient(r.service_url, trainer.cfg)
    return make
