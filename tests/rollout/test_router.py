"""SGLangClient through the real sglang-router (PyPI ``sglang-router==0.3.2``, a CPU binary)
in front of two embedded engines: generation, abort of an in-flight request, health while
paused, and a worker killed and restarted on its port; and the same with the job's API key
on the router and both engines (started the way slurm/task.sh starts them).

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

from megatron_tg.auth import read_key, write_key_dir
from megatron_tg.rollout.client import SGLangClient, SGLangClientError, SGLangRequestError
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
                   "--worker-startup-timeout-secs", "120", "--log-level", "warn",
                   # its metrics port (default 29000) would collide with any other router here
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                  rport, logs / "router.log", env)
    try:
        for w in workers:
            w.wait_up(http_call)
        router.start().wait_up(http_call, "/readiness")
        # The router registers its workers one by one (a workflow per worker), and is ready
        # with the first: wait for both, healthy.
        deadline = time.monotonic() + 120
        while True:
            listed = http_call(router.url, "/workers")[1].get("workers", [])
            if len(listed) == 2 and all(w["is_healthy"] for w in listed):
                break
            assert time.monotonic() < deadline, f"router lists {listed}:\n{router.log.read_text()[-3000:]}"
            time.sleep(0.2)
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
            with pytest.raises(SGLangClientError, match="HTTP 404.*sglang-router"):
                await c.pause_generation(mode="retract")  # admin calls must go to the workers
            assert not c.paused  # nothing was paused
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


# ---- with the job's API key ---------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_cluster(model_plain, tmp_path_factory, http_call):
    """Two embedded engines given the key by SGLang's --config YAML, behind the real router
    given it by file (megatron_tg.launch.router): what slurm/task.sh starts."""
    d = tmp_path_factory.mktemp("router_auth")
    key_file, sglang_yaml = write_key_dir(d / "secret")
    env = dict(os.environ, OMP_NUM_THREADS="1", ENGINE_LOG_LEVEL="INFO")
    workers = []
    for i in range(2):
        port = free_port()
        workers.append(Proc([sys.executable, "-m", "megatron_tg.rollout.engine", "--model", str(model_plain),
                             "--config", str(sglang_yaml), "--port", str(port), "--host", "127.0.0.1",
                             "--threads", "1"], port, d / f"engine{i}.log", env).start())
    rport = free_port()
    router = Proc([sys.executable, "-m", "megatron_tg.launch.router", "--api-key-file", str(key_file),
                   "--worker-urls", *[w.url for w in workers], "--host", "127.0.0.1", "--port", str(rport),
                   "--policy", "round_robin", "--health-check-interval-secs", "1",
                   "--worker-startup-timeout-secs", "120", "--log-level", "info",
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                  rport, d / "router.log", env)
    try:
        for w in workers:
            w.wait_up(http_call, timeout_s=300)  # /health: open without the key
        router.start().wait_up(http_call, "/health", timeout_s=300)
        key = read_key(key_file)
        deadline = time.monotonic() + 120
        while True:
            listed = keyed_get(router.url, "/workers", key)[1].get("workers", [])
            if len(listed) == 2 and all(w["is_healthy"] for w in listed):
                break
            assert time.monotonic() < deadline, f"router lists {listed}:\n{router.log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield router, workers, key
    finally:
        router.stop()
        for w in workers:
            w.stop()


def keyed_get(url, path, key=None, body=None):
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            data = r.read()
            return r.status, json.loads(data) if data.startswith((b"{", b"[")) else data
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_keyed_router_refuses_callers_without_the_key(keyed_cluster):
    router, workers, key = keyed_cluster
    gen = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
    for sent in (None, "x" * 43):
        assert keyed_get(router.url, "/generate", sent, gen)[0] == 401  # the router's own check
        assert keyed_get(router.url, "/workers", sent)[0] == 401
        for w in workers:
            assert keyed_get(w.url, "/generate", sent, gen) == (401, b'{"error": "Unauthorized"}')
    # Forwarded requests the router itself does not check reach a worker that does.
    assert keyed_get(router.url, "/get_model_info")[0] == 401
    assert keyed_get(router.url, "/health")[0] == 200  # probes stay open
    code, out = keyed_get(router.url, "/generate", key, gen)
    assert code == 200 and len(out["output_ids"]) == 2


def test_keyed_router_serves_the_client_and_its_aborts(keyed_cluster, http_call):
    router, workers, key = keyed_cluster

    async def main():
        async with SGLangClient([router.url], admin_urls=[w.url for w in workers], api_key=key,
                                backoff_s=0.1) as c:
            rs = await asyncio.gather(*(c.generate(PROMPT, {"temperature": 0, "max_new_tokens": 3}, rid=f"k{i}")
                                        for i in range(2)))
            task = asyncio.ensure_future(c.generate(PROMPT, {"max_new_tokens": 5000, "ignore_eos": True}, rid="klong"))
            t0 = time.monotonic()
            while not any(keyed_get(w.url, "/server_info", key)[1]["internal_states"][0]["num_running"]
                          for w in workers) and time.monotonic() - t0 < 30:
                await asyncio.sleep(0.05)
            await c.abort("klong")  # via the router's /workers list and the workers, keyed
            result = await asyncio.wait_for(task, 30)
            return rs, result, c.stats

    rs, result, stats = asyncio.run(main())
    assert [r.meta_info["id"] for r in rs] == ["k0@0", "k1@0"] and all(len(r.output_ids) == 3 for r in rs)
    assert result.finish_type == "abort" and stats.abort_failures == 0

    async def keyless():
        async with SGLangClient([router.url], admin_urls=[w.url for w in workers], max_retries=0) as c:
            await c.generate(PROMPT, {"max_new_tokens": 1})

    with pytest.raises(SGLangRequestError, match="HTTP 401"):
        asyncio.run(keyless())


def test_keyed_router_and_engines_keep_the_key_off_argv_and_logs(keyed_cluster):
    router, workers, key = keyed_cluster
    for p in (router, *workers):
        with open(f"/proc/{p.proc.pid}/cmdline", "rb") as f:
            assert key.encode() not in f.read()
        assert key not in p.log.read_text(errors="replace")


def test_router_launcher_answers_help_without_a_key_file():
    """``--help`` needs no key: it prints the launcher's own option, then the router's."""
    run = subprocess.run([sys.executable, "-m", "megatron_tg.launch.router", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "--api-key-file" in run.stdout
    assert "--worker-urls" in run.stdout  # the router's own arguments follow


def test_router_launcher_refuses_a_key_on_the_command_line(tmp_path):
    key_file, _ = write_key_dir(tmp_path / "secret")
    run = subprocess.run([sys.executable, "-m", "megatron_tg.launch.router", "--api-key-file", str(key_file),
                          "--api-key", "visible-in-ps"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "--api-key-file only" in run.stderr


def test_a_router_without_health_checks_keeps_a_released_engine(model_plain, tmp_path, http_call):
    """Colocated engines are released for a whole train phase (/health answers 503 there): a
    router started with --disable-health-check keeps routing to them afterwards, while one
    with 1 s checks drops the worker within seconds (the control). What
    router_health(cfg).flags() gives a colocated recipe."""
    env = dict(os.environ, OMP_NUM_THREADS="1", ENGINE_LOG_LEVEL="WARNING",
               SGLANG_HEALTH_CHECK_TIMEOUT=str(HEALTH_TIMEOUT_S))
    port = free_port()
    engine = Proc([sys.executable, "-m", "megatron_tg.rollout.engine", "--model", str(model_plain),
                   "--port", str(port), "--host", "127.0.0.1", "--threads", "1", "--enable-memory-saver"],
                  port, tmp_path / "engine.log", env).start()
    checks = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1",
              "--health-success-threshold", "1", "--health-check-timeout-secs", "3"]
    routers = {}
    for name, extra in (("off", ["--disable-health-check"]), ("on", [])):
        rport = free_port()
        routers[name] = Proc([sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", engine.url,
                              "--host", "127.0.0.1", "--port", str(rport), "--policy", "round_robin",
                              *checks, *extra, "--worker-startup-timeout-secs", "120", "--log-level", "warn",
                              "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                             rport, tmp_path / f"router-{name}.log", env)

    def healthy(router) -> list[bool]:
        return [w["is_healthy"] for w in http_call(router.url, "/workers")[1].get("workers", [])]

    try:
        engine.wait_up(http_call)
        for r in routers.values():
            r.start().wait_up(http_call, "/readiness")
            deadline = time.monotonic() + 60
            while healthy(r) != [True]:
                assert time.monotonic() < deadline, r.log.read_text()[-3000:]
                time.sleep(0.2)
        # the KV cache only: released weights come back undefined without a CPU backup
        assert http_call(engine.url, "/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
        assert http_call(engine.url, "/health", timeout=30)[0] == 503
        deadline = time.monotonic() + 30
        while healthy(routers["on"]) != [False]:  # the control: 1 s checks drop it
            assert time.monotonic() < deadline, routers["on"].log.read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(3)
        assert healthy(routers["off"]) == [True]
        assert http_call(engine.url, "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
        status, out = http_call(routers["off"].url, "/generate",
                                {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert status == 200 and out["meta_info"]["completion_tokens"] >= 1, out
    finally:
        for r in routers.values():
            r.stop()
        engine.stop()
