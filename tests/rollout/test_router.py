"""SGLangClient through the real sglang-router (PyPI ``sglang-router==0.3.2``, a CPU binary)
in front of two embedded engines: generation, abort of an in-flight request, health while
paused, and a worker killed and restarted on its port.

The router forwards ``/generate`` and keeps ``rid``, but answers 404 to the abort and admin
endpoints (asserted below, so a router release that changes this shows up here); the
client therefore aborts an attempt sent through the router on every worker behind it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_tg.rollout.client import SGLangClient, SGLangClientError
from megatron_tg.testing.distributed import free_port

pytest.importorskip("sglang_router", reason="the test extra installs sglang-router==0.3.2")

PROMPT = [5, 17, 42, 7, 99]
# SGLang's /health generates one token and gives up after SGLANG_HEALTH_CHECK_TIMEOUT
# seconds (20 by default); the engines here use 2 so the paused case takes 2 s, not 20.
HEALTH_TIMEOUT_S = 2
ROUTER_ENDPOINTS_404 = ("/abort_request", "/pause_generation", "/continue_generation",
                        "/update_weights_from_disk", "/update_weights_from_distributed",
                        "/init_weights_update_group", "/begin_weight_update")


class Proc:
    """One subprocess on a fixed port, stoppable and restartable (same port, same log)."""

    def __init__(self, argv: list[str], port: int, log: Path, env: dict[str, str]):
        self.argv, self.port, self.log, self.env = argv, port, log, env
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Proc":
        self.proc = subprocess.Popen(self.argv, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=self.env)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def wait_up(self, http, path: str = "/health", timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[:4]} exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if http(self.url, path, timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.url}{path} not up after {timeout_s}s:\n{self.log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def cluster(model_plain, tmp_path_factory, http_call):
    """Two embedded engines behind a real sglang-router (round robin, 1 s health checks)."""
    logs = tmp_path_factory.mktemp("router_logs")
    env = dict(os.environ, OMP_NUM_THREADS="1", ENGINE_LOG_LEVEL="WARNING",
               SGLANG_HEALTH_CHECK_TIMEOUT=str(HEALTH_TIMEOUT_S))
    workers = []
    for i in range(2):
        port = free_port()
        workers.append(Proc([sys.executable, "-m", "megatron_tg.rollout.engine", "--model", str(model_plain),
                             "--port", str(port), "--host", "127.0.0.1", "--threads", "1"],
                            port, logs / f"engine{i}.log", env).start())
    rport = free_port()
    router = Proc([sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *[w.url for w in workers],
                   "--host", "127.0.0.1", "--port", str(rport), "--policy", "round_robin",
                   "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                   "--health-success-threshold", "1", "--health-check-timeout-secs", "10",
                   "--worker-startup-timeout-secs", "120", "--log-level", "warn"],
                  rport, logs / "router.log", env)
    try:
        for w in workers:
            w.wait_up(http_call)
        router.start().wait_up(http_call, "/readiness")
        yield router, workers
    finally:
        router.stop()
        for w in workers:
            w.stop()


def client_for(router, workers, **kw) -> SGLangClient:
    return SGLangClient([router.url], admin_urls=[w.url for w in workers], backoff_s=0.1, **kw)


def num_running(http_call, worker) -> int:
    return http_call(worker.url, "/server_info")[1]["internal_states"][0]["num_running"]


def test_router_proxies_generate_and_answers_404_to_admin(cluster, http_call):
    router, workers = cluster
    status, listing = http_call(router.url, "/workers")
    assert status == 200 and sorted(w["url"] for w in listing["workers"]) == sorted(w.url for w in workers)
    for path in ROUTER_ENDPOINTS_404:
        assert http_call(router.url, path, {})[0] == 404, path
    assert http_call(router.url, "/server_info")[0] == 404

    async def main():
        async with client_for(router, workers) as c:
            rs = await asyncio.gather(*(c.generate(PROMPT, {"temperature": 0, "max_new_tokens": 4}, rid=f"g{i}")
                                        for i in range(4)))
            info = await c.get_model_info()  # to the workers, by the new name
            return rs, info

    rs, info = asyncio.run(main())
    assert [r.meta_info["id"] for r in rs] == [f"g{i}@0" for i in range(4)]  # the router keeps rid
    assert all(len(r.output_ids) == 4 and r.server == router.url for r in rs)
    assert len({tuple(r.output_ids) for r in rs}) == 1  # same weights, greedy
    assert set(info) == {w.url for w in workers} and all(v["weight_version"] == "default" for v in info.values())
    # round robin spread the four over both workers: each generated some
    assert all(http_call(w.url, "/server_info")[1]["internal_states"][0]["decode_steps"] > 0 for w in workers)


def test_abort_through_router_stops_the_engine(cluster, http_call):
    router, workers = cluster

    async def main():
        async with client_for(router, workers) as c:
            task = asyncio.ensure_future(c.generate(PROMPT, {"max_new_tokens": 5000, "ignore_eos": True}, rid="long"))
            t0 = time.monotonic()
            while sum(num_running(http_call, w) for w in workers) == 0 and time.monotonic() - t0 < 30:
                await asyncio.sleep(0.05)
            running_before = sum(num_running(http_call, w) for w in workers)
            await c.abort("long")
            result = await asyncio.wait_for(task, 30)
            return running_before, result, c.stats

    running_before, result, stats = asyncio.run(main())
    assert running_before == 1
    assert result.finish_type == "abort" and 0 < len(result.output_ids) < 5000
    assert sum(num_running(http_call, w) for w in workers) == 0  # the engine stopped generating it
    assert stats.abort_failures == 0


def test_abort_answered_404_is_an_error(cluster, http_call):
    """A client that takes the router for a server (no admin_urls) must not report the
    abort as done: the router answers 404 and the engine keeps generating."""
    router, workers = cluster

    async def main():
        async with SGLangClient([router.url]) as c:
            task = asyncio.ensure_future(c.generate(PROMPT, {"max_new_tokens": 5000, "ignore_eos": True}, rid="deaf"))
            t0 = time.monotonic()
            while sum(num_running(http_call, w) for w in workers) == 0 and time.monotonic() - t0 < 30:
                await asyncio.sleep(0.05)
            with pytest.raises(SGLangClientError) as ei:
                await c.abort("deaf")
            still = sum(num_running(http_call, w) for w in workers)
            for w in workers:  # clean up by hand, on the workers
                http_call(w.url, "/abort_request", {"rid": "deaf@0"})
            result = await asyncio.wait_for(task, 30)
            return str(ei.value), still, result

    msg, still, result = asyncio.run(main())
    assert "HTTP 404" in msg and router.url in msg and "sglang-router" in msg
    assert still == 1 and result.finish_type == "abort"


def test_paused_workers_are_not_dead(cluster, http_call):
    """SGLang's /health generates a token, so it answers 503 while paused; the client
    keeps the paused servers, and generation resumes after the continue."""
    router, workers = cluster

    async def main():
        async with SGLangClient([w.url for w in workers], backoff_s=0.1) as c:
            await c.pause_generation(mode="retract")
            raw = [http_call(w.url, "/health", timeout=30)[0] for w in workers]
            ready = [http_call(w.url, "/ready")[0] for w in workers]
            health = await c.health()
            await c.continue_generation()
            r = await c.generate(PROMPT, {"temperature": 0, "max_new_tokens": 2})
            return raw, ready, health, r, [s.healthy for s in c.servers]

    raw, ready, health, r, healthy = asyncio.run(main())
    assert raw == [503, 503] and ready == [503, 503]  # what SGLang answers while paused
    assert all(health.values()) and all(healthy)
    assert len(r.output_ids) == 2
    assert [http_call(w.url, "/health")[0] for w in workers] == [200, 200]


def test_worker_killed_and_restarted(cluster, http_call):
    """Runs last: kills worker 1, generates through the router while it is down, restarts
    it on its port and sees the router route to it again."""
    router, workers = cluster

    def router_view() -> dict[str, bool]:
        return {w["url"]: w["is_healthy"] for w in http_call(router.url, "/workers")[1]["workers"]}

    def wait_for(pred, timeout_s=60.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pred():
                return True
            time.sleep(0.2)
        return False

    victim = workers[1]
    victim.kill()
    assert wait_for(lambda: router_view()[victim.url] is False)

    async def burst(tag: str):
        async with client_for(router, workers) as c:
            rs = await asyncio.gather(*(c.generate(PROMPT, {"temperature": 0, "max_new_tokens": 3}, rid=f"{tag}{i}")
                                        for i in range(4)))
            return rs, c.stats

    steps_0 = http_call(workers[0].url, "/server_info")[1]["internal_states"][0]["decode_steps"]
    down, stats = asyncio.run(burst("down"))
    assert all(len(r.output_ids) == 3 for r in down) and stats.failed == 0
    assert http_call(workers[0].url, "/server_info")[1]["internal_states"][0]["decode_steps"] > steps_0

    victim.start().wait_up(http_call)
    assert wait_for(lambda: router_view()[victim.url] is True)
    up, _ = asyncio.run(burst("up"))
    assert all(len(r.output_ids) == 3 for r in up)
    # the restarted engine serves again: round robin gave it part of the burst
    assert http_call(victim.url, "/server_info")[1]["internal_states"][0]["decode_steps"] > 0
