"""Engine loss and return in service mode behind the real sglang-router: training goes on, no
rollout is lost, none is trained at the wrong version, and the re-grouped sync leaves both
engines bit-identical.

One trainer rank with ``rollout.service=local`` (the rollout side in its own process), two
embedded engines started by the test, and sglang-router 0.3.2 (the test extra's binary) in
front of them (``rollout.router_url``; admin calls go to the engines). Engine B is SIGKILLed
once step 1 is logged and restarted on its base weights once step 2 is logged, as in
tests/weight_sync/test_engine_loss_loop.py. The router would re-admit B as soon as its /health
passes, on its base weights; the trainer takes B out of the router when its sync finds it
lost and puts it back only after B is admitted at the current version.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from megatron_tg.rollout.engine.launch import restart_engine, start_engines
from tests.rollout.test_router import Proc
from tests.train.test_kill_resume import RUBRIC, _rows, _tail, policy_dir  # noqa: F401
from tests.weight_sync.test_engine_loss_loop import N, _wait_row

pytest.importorskip("sglang_router", reason="the test extra installs sglang-router==0.3.2")
REPO = Path(__file__).resolve().parents[2]


def _get(url: str, path: str, body=None):
    req = urllib.request.Request(f"{url}{path}", data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _http(url, path, timeout=5):
    with urllib.request.urlopen(f"{url}{path}", timeout=timeout) as r:
        return r.status, None


def _start(policy_dir, run_dir: Path, rubric: Path, urls, router: str) -> subprocess.Popen:
    from megatron_tg.parallel.ports import free_port

    overrides = [f"model.hf_config={policy_dir}", f"model.hf_checkpoint={policy_dir}",
                 f"logging.run_dir={run_dir}", f"checkpoint.dir={run_dir}/ckpt", f"steps={N}",
                 "checkpoint.interval=100", f"judge.rubric={rubric}", "objective.primary_criteria=[has_e]",
                 "rollout.engine=sglang", f"rollout.server_urls=[{','.join(urls)}]", f"rollout.router_url={router}",
                 "rollout.service=local", "rollout.service_poll_s=1",
                 "rollout.sync_master_address=127.0.0.1", "rollout.max_staleness=0",
                 "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.buffer_size=2",
                 "rollout.max_new_tokens=24", "rollout.max_turns=2", "rollout.max_retries=6",
                 "timeouts.health_interval_s=0.5", "logging.progress_bar=false",
                 # sglang-router 0.3.2 drops return_routed_experts from /generate (the engine
                 # then returns no routed experts): routing replay cannot run through it
                 "rollout.routing_replay=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        env.pop(k, None)
    log = open(run_dir / "trainer.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "megatron_tg.train", "--recipe",
                             "recipes/tiny_cpu.yaml", *overrides],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_service_mode_behind_the_router_through_an_engines_loss_and_return(policy_dir, tmp_path):  # noqa: F811
    from megatron_tg.parallel.ports import free_port

    rubric = tmp_path / "coin_flips.yaml"
    rubric.write_text(RUBRIC)
    run = tmp_path / "run"
    run.mkdir()
    engines = start_engines([policy_dir, policy_dir], tmp_path / "engines", timeout_s=300)
    port = free_port()
    # Checks every second so that dead B leaves rotation fast; 60 failures in a row before a
    # worker is dropped, so a paused engine (its /health 503 after SGLang's 20 s) never is:
    # the flags router_health derives, scaled to this test's short syncs.
    router = Proc([sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *[e.url for e in engines],
                   "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                   "--health-check-interval-secs", "1", "--health-check-timeout-secs", "25",
                   "--health-failure-threshold", "60", "--health-success-threshold", "1",
                   "--worker-startup-timeout-secs", "300", "--log-level", "warn"],
                  port, tmp_path / "router.log", dict(os.environ, OMP_NUM_THREADS="1"))
    proc = None
    try:
        router.start().wait_up(_http, "/readiness", timeout_s=300)
        proc = _start(policy_dir, run, rubric, [e.url for e in engines], router.url)
        deadline = time.monotonic() + 1800
        _wait_row(proc, run, 1, deadline)
        engines[1].kill()                        # B dies while step 2 generates
        _wait_row(proc, run, 2, deadline)
        listed = {w["url"] for w in _get(router.url, "/workers")["workers"]}
        engines[1] = restart_engine(engines[1], timeout_s=300)  # back, on its base weights
        back_at = max(r["step"] for r in _rows(run))
        assert back_at < N, f"B came back after the last step ({back_at}); nothing could admit it"
        assert proc.wait(timeout=1800) == 0, _tail(run)
        b_version = _get(engines[1].url, "/model_info")["weight_version"]
        sums = [_get(e.url, "/weights_checker", {"action": "checksum"})["per_engine_checksum"] for e in engines]
        workers = {w["url"]: w["is_healthy"] for w in _get(router.url, "/workers")["workers"]}
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        router.stop()
        for e in engines:
            e.stop()
    a, b = (e.url for e in engines)
    assert listed == {a}  # the sync that found B lost took it out of the router
    assert workers == {a: True, b: True}  # and the admission put it back
    rows = {r["step"]: r for r in _rows(run)}
    assert sorted(rows) == list(range(1, N + 1))
    assert sum(rows[s]["sync/engines_lost"] for s in rows) == 1
    assert sum(rows[s]["sync/engines_admitted"] for s in rows) == 1
    assert rows[N]["sync/engines"] == 2 and b_version == str(N)
    assert sums[0] == sums[1]  # B, admitted alone and re-grouped, holds A's weights bit for bit
    assert all(rows[s]["sync/probe_logprob_diff"] <= 1e-3 for s in rows)
    # no rollout lost or doubled, and every turn trained as the version its engine served
    from megatron_tg.train.samples import read_samples

    seen = set()
    for s in range(1, N + 1):
        recs = read_samples(run, s)
        ids = [r["rollout_id"] for r in recs]
        assert len(ids) == len(set(ids)) == 2 * 4, (s, ids)
        assert not seen & set(ids)
        seen |= set(ids)
        for r in recs:
            for t in r["turns"]:
                v, w = t["policy_version"], t["weight_version"]
                assert w == str(v) or (v == 0 and w == "default"), (s, r["rollout_id"], t)
    assert rows[N]["manager/dropped"] == 0 and rows[N]["manager/trained"] == N * 2
    assert rows[N]["manager/wrong_version"] == 0  # B never answered from its base weights
