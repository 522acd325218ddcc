"""The rollout service as its own process, against the in-process side it wraps.

- batches served over the RPC equal the in-process side's (samples, judge results, metrics,
  manager state), weight syncs included (the engines are held paused during the push);
- a dead service is a clear error within a poll, not a hang; bad requests get 4xx naming
  what is wrong; a failure of the side reaches the trainer with its message.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from megatron_tg.auth import read_key
from megatron_tg.config import load_config
from megatron_tg.sampling.service.client import (RolloutServiceClient, RolloutServiceError,
                                                 start_local_service)
from megatron_tg.sampling.service.server import FactorySpec, ServiceHost
from tests.sampling.service.fake_side import FakeEngine

TIMING = ("rollout/gen_seconds", "manager/update_seconds", "capacity/", "turn/", "service/")
# How far the background producer got when the batch returned (it starts the next step's
# groups at once): a snapshot of timing, in either placement, not part of the batch.
LIVE = ("taken", "in_flight", "queued", "generating", "buffered", "rollouts_generating",
        "data_position", "rollouts", "turns", "tokens_generated")


@pytest.fixture(scope="module")
def engine():
    e = FakeEngine()
    yield e
    e.close()


def _cfg(engine, run_dir, *extra):
    return load_config("recipes/tiny_cpu.yaml", [
        "rollout.engine=sglang", f"rollout.server_urls=[{engine.url}]", f"logging.run_dir={run_dir}",
        "rollout.group_size=2", "rollout.prompts_per_step=2", "rollout.buffer_size=2",
        "rollout.max_staleness=0", "rollout.service=local", "rollout.service_poll_s=1",
        "rollout.routing_replay=false", *extra])


def _spec(**kw):
    return FactorySpec("tests.sampling.service.fake_side:make", kw)


def _plain(samples, judged, metrics):
    """A batch as comparable values (timing metrics left out: they differ run to run)."""
    return ([(s.rollout.to_dict(), s.advantage, s.feedback_by_turn, s.reward) for s in samples],
            [(ro.to_dict(), res.to_dict() if res is not None else None) for ro, res in judged],
            {k: v for k, v in metrics.items()
             if not k.startswith(TIMING) and k.removeprefix("manager/") not in LIVE})


def _drive(side, steps=2):
    """What the loop does with a side: batch, weight sync, probes, state; returns it all."""
    out = []
    for step in range(steps):
        samples, metrics = side.next_batch(step)
        out.append(_plain(samples, side.last_judged, metrics))

        async def push():
            return {"pushed": step + 1}

        out.append(side.run_sync(push, step + 1))
        out.append(side.probe_metrics(step + 1))
    state = side.state_dict()
    state["counters"] = {k: v for k, v in state["counters"].items()
                         if k != "update_seconds" and k not in LIVE}
    assert state["next_index"] == steps * 2 + len(state["pending"])  # delivered + in flight
    out.append({k: v for k, v in state.items() if k not in ("next_index", "pending")})
    out.append(side.identity()["judge"])
    return out


def test_service_batches_equal_in_process_and_syncs_hold_engines_paused(engine, tmp_path):
    cfg = _cfg(engine, tmp_path / "a")
    local = _spec().resolve()(ServiceHost(cfg))
    try:
        expected = _drive(local)
    finally:
        local.close()
    engine.calls.clear()
    client = start_local_service(_cfg(engine, tmp_path / "b"), _spec())
    try:
        assert client.process.proc.pid != os.getpid()
        got = _drive(client)
        assert client.identity()["rollout_service"]["pid"] == client.process.proc.pid
    finally:
        client.close()
    assert client.process.exited() == 0  # closed by the trainer, not killed
    assert json.loads(json.dumps(got)) == json.loads(json.dumps(expected))  # tuples -> lists
    samples = expected[0][0]
    assert len(samples) == 4 and len({s[1] for s in samples}) > 1  # non-trivial advantages
    posts = [p for m, p in engine.calls if m == "POST"]
    assert posts == ["/pause_generation", "/continue_generation"] * 2  # one pause per sync


def test_loads_state_and_refuses_a_config_that_differs(engine, tmp_path):
    cfg = _cfg(engine, tmp_path)
    client = start_local_service(cfg, _spec())
    try:
        client.next_batch(0)
        state = client.state_dict()
        with pytest.raises(RolloutServiceError, match="load_state_dict before start"):
            client.load_state_dict(state)  # the manager has started: a clear refusal
        other = _cfg(engine, tmp_path, "rollout.group_size=4", "rollout.max_inflight_rollouts=8")
        with pytest.raises(RolloutServiceError, match=r"HTTP 401\): Unauthorized: this client's API key was "
                                                      r"refused or missing \(rollout.api_key_file"):
            RolloutServiceClient(client.url, other)  # the key is checked before anything else
        other.rollout.api_key_file = cfg.rollout.api_key_file
        with pytest.raises(RolloutServiceError, match=r"rollout.group_size: service 2, trainer 4"):
            RolloutServiceClient(client.url, other)
    finally:
        client.close()


def _post_with_key(url, method, body, raw=None, key=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(f"{url}/v1/{method}", data=data, method="POST",
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_bad_requests_get_clear_errors(engine, tmp_path):
    client = start_local_service(_cfg(engine, tmp_path), _spec())
    url = client.url
    _post = functools.partial(_post_with_key, key=read_key(client.cfg.rollout.api_key_file))
    try:
        code, r = _post(url, "next_btch", {})
        assert code == 404 and "unknown method 'next_btch'" in r["error"]["message"]
        assert "next_batch" in r["error"]["message"]
        code, r = _post(url, "next_batch", None, raw=b"{not json")
        assert code == 400 and "request body is not JSON" in r["error"]["message"]
        code, r = _post(url, "next_batch", {"args": {"version": "3"}})
        assert code == 400 and "argument 'version' must be int, got str '3'" in r["error"]["message"]
        code, r = _post(url, "next_batch", {"args": {"version": True}})
        assert code == 400 and "must be int, got bool" in r["error"]["message"]
        code, r = _post(url, "next_batch", {"args": {}})
        assert code == 400 and "missing ['version']" in r["error"]["message"]
        code, r = _post(url, "probe_metrics", {"args": {"step": 1, "x": 2}})
        assert code == 400 and "unexpected ['x']" in r["error"]["message"]
        code, r = _post(url, "next_batch", {"argz": {}})
        assert code == 400 and "unknown request keys ['argz']" in r["error"]["message"]
        code, r = _post(url, "sync_end", {"args": {"ok": True, "error": None}})
        assert code == 409 and "no weight sync in progress" in r["error"]["message"]
        code, r = _post(url, "hello", {"args": {"protocol": "tg-rollout/0", "config": {}}})
        assert code == 409 and "speaks 'tg-rollout/0'" in r["error"]["message"]
        # the side's own refusal reaches the trainer with its message (HTTP 500)
        with pytest.raises(RolloutServiceError, match=r"HTTP 500.*trainer at version 5 but engines at 0"):
            client.next_batch(5)
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            assert r.status == 200
    finally:
        client.close()


def test_every_call_needs_the_jobs_key_and_only_the_path_is_saved(engine, tmp_path):
    # No key configured: the trainer makes one for the service it starts (0600), the service
    # refuses every call without it (401, SGLang's body), /health stays open for probes.
    client = start_local_service(_cfg(engine, tmp_path), _spec())
    try:
        key_file = client.cfg.rollout.api_key_file
        key = read_key(key_file)
        assert oct(os.stat(key_file).st_mode & 0o777) == "0o600"
        for method, body in (("info", {}), ("next_batch", {"args": {"version": 0}}),
                             ("sync_begin", {"args": {"version": 1}}), ("close", {})):
            assert _post_with_key(client.url, method, body) == (401, {"error": "Unauthorized"})
            assert _post_with_key(client.url, method, body, key="x" * 43) == (401, {"error": "Unauthorized"})
        code, r = _post_with_key(client.url, "info", {}, key=key)
        assert code == 200 and r["status"] == "done"
        with urllib.request.urlopen(f"{client.url}/health", timeout=10) as r:
            assert r.status == 200
        client.next_batch(0)  # the client sends it: calls work
        # The key itself is in no file of the run but its own, nor on the service's argv.
        pid = client.process.proc.pid
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert key.encode() not in f.read()
    finally:
        client.close()
    secret_dir = os.path.dirname(key_file)  # the key file and SGLang's --config copy of it
    leaks = [str(p) for p in tmp_path.rglob("*") if p.is_file() and str(p.parent) != secret_dir
             and key.encode() in p.read_bytes()]
    assert leaks == []
    assert key_file in (tmp_path / "rollout_service" / "config.yaml").read_text()


def test_a_dead_service_is_a_clear_error_not_a_hang(engine, tmp_path):
    # A call pending while the service dies: noticed within one poll (service_poll_s=1).
    client = start_local_service(_cfg(engine, tmp_path, "rollout.max_staleness=1"),
                                 _spec(rollout_delay=60.0))
    errors = []

    def pull():
        try:
            client.next_batch(0)
        except RolloutServiceError as exc:
            errors.append(exc)

    t = threading.Thread(target=pull)
    t.start()
    time.sleep(1.5)
    os.kill(client.process.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    t.join(timeout=30)
    assert not t.is_alive() and time.monotonic() - t0 < 10
    assert errors and "exited with status -9 during next_batch" in str(errors[0])
    assert "service.log" in str(errors[0])
    with pytest.raises(RolloutServiceError, match="exited with status -9 during probe_metrics"):
        client.probe_metrics(1)
    client.close()  # does not hang either
    # A remote service that is not there: named, with the cause.
    cfg = _cfg(engine, tmp_path, "rollout.service=remote", f"rollout.service_url={client.url}")
    with pytest.raises(RolloutServiceError, match=rf"rollout service {client.url} did not answer hello"):
        RolloutServiceClient(cfg.rollout.service_url, cfg)


def test_back_pressure_bounds_in_flight_rollouts_buffer_and_tool_slots(engine, tmp_path):
    """A slow consumer: production stops at the bounds instead of growing."""
    cfg = _cfg(engine, tmp_path, "rollout.group_size=4", "rollout.prompts_per_step=1",
               "rollout.buffer_size=2", "rollout.max_inflight_rollouts=8", "rollout.max_staleness=100",
               "rollout.env_workers_per_node=2")
    client = start_local_service(cfg, _spec(rollout_delay=0.05, tool_delay=0.1))
    try:
        _, metrics = client.next_batch(0)
        seen = []
        t_end = time.monotonic() + 4.0
        while time.monotonic() < t_end:  # the consumer does not ask for 4 s
            seen.append(client.stats())
            time.sleep(0.05)
        # The manager's bound (rollout/manager.py): no new group while the buffer is full;
        # groups already generating finish into it: buffer_size + 8 / group_size groups.
        cap = 2 + 8 // 4
        assert max(s["rollouts_generating"] for s in seen) <= 8
        assert max(s["buffered"] + s["generating"] for s in seen) <= cap
        assert max(s["tool_slots_busy"] for s in seen) <= 2 and seen[-1]["tool_slots_peak"] == 2
        last = seen[-1]
        # full and idle: nothing generating, the buffer at least full, no prompt taken since
        assert 2 <= last["buffered"] <= cap and last["rollouts_generating"] == 0
        assert [s["taken"] for s in seen[-10:]] == [last["taken"]] * 10
        assert last["taken"] <= 1 + cap  # delivered + what the bound lets wait
        _, metrics = client.next_batch(1)
        assert metrics["capacity/queue_depth"] <= 2 and metrics["capacity/inflight_limit"] == 8
        assert metrics["capacity/tool_slots"] == 2 and metrics["capacity/tool_calls"] > 0
        assert 0 < metrics["capacity/sandbox_utilisation"] <= 1
        assert metrics["capacity/tool_wait_s"] > 0  # 8 rollouts in flight queue for 2 slots
        assert "turn/tool_s" not in metrics  # per generated turn: these rollouts generate none
    finally:
        client.close()


def test_the_service_client_implements_the_loops_interface():
    """Same methods with the same parameters as the protocol (the in-process side's twin test
    is in tests/sampling/test_rollouts.py)."""
    import inspect

    from megatron_tg.sampling.protocols import RolloutSource

    wanted = {n: f for n, f in vars(RolloutSource).items() if callable(f) and not n.startswith("_")}
    for name, proto in wanted.items():
        impl = getattr(RolloutServiceClient, name)
        assert list(inspect.signature(impl).parameters) == list(inspect.signature(proto).parameters), name
