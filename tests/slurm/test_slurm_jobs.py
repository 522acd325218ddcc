"""slurm/*.sh against a real Slurm controller (tests/slurm/cluster.sh), with fake servers
and a stand-in trainer honouring the trainer contract (tests/slurm/fake_*.py).

What runs here is the production code path minus SGLang and Megatron: the wrappers'
#SBATCH headers, node resolution, the plan, srun steps with (fake) GPUs, the /health wait,
signal forwarding, requeue with SLURM_RESTART_COUNT, resume, and teardown by step id.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.conftest import ROOT

pytestmark = pytest.mark.slurm


def launches(tmp_path: Path) -> list[dict]:
    """What every trainer rank was given, one dict per rank per launch."""
    path = tmp_path / "ckpt" / "launches.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def servers(tmp_path: Path) -> dict[int, dict]:
    """Fake-server records (node rank 0) by port."""
    return {int(p.name.split("-")[0]): json.loads(p.read_text())
            for p in sorted((tmp_path / "servers").glob("*-rank0.json"))}


def stopped(tmp_path: Path) -> set[int]:
    """Ports of the fake servers that received SIGTERM."""
    return {int(p.name.split("-")[0]) for p in (tmp_path / "servers").glob("*.stopped")}


def progress(tmp_path: Path) -> int:
    path = tmp_path / "ckpt" / "progress"
    try:
        return int(path.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} not seen in {timeout} s")


def log(tmp_path: Path) -> str:
    return (tmp_path / "job.log").read_text()


def test_cluster_has_three_idle_nodes_with_gpus(slurm_cluster):
    out = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N %T %G").stdout.split("\n")
    rows = sorted(line.split() for line in out if line)
    assert [r[0] for r in rows] == ["n1", "n2", "n3"], out
    assert all(r[2].startswith("gpu:8") for r in rows), out


def test_cluster_start_is_idempotent(slurm_cluster):
    args = slurm_cluster.args
    before = slurm_cluster.run("bash", *args[:1], "status", *args[1:]).stdout
    again = slurm_cluster.run("bash", *args[:1], "start", *args[1:])
    assert again.stdout.strip() == f"export SLURM_CONF={slurm_cluster.env['SLURM_CONF']}"
    assert slurm_cluster.run("bash", *args[:1], "status", *args[1:]).stdout == before  # same pids
    assert len(before.splitlines()) == 2 + 3  # munged, slurmctld, 3 x slurmd


def test_lib_pieces_resolve_nodes_start_wait_and_tear_down(slurm_cluster, tiny_job, tmp_path):
    job = tiny_job("tests/slurm/pieces_job.sh")
    info = slurm_cluster.wait_done(job, timeout=60)
    text = log(tmp_path)
    assert info["JobState"] == "COMPLETED", text
    checks = dict(line[len("check: "):].split("=", 1) for line in text.splitlines()
                  if line.startswith("check: ") and "=" in line)
    assert checks["hosts"] == "n1 n2"
    assert checks["addrs"] == "127.0.0.1 127.0.0.1"  # NodeAddr, not the unresolvable names
    assert checks["train"].startswith("n1 rollout=n2 master=127.0.0.1:")
    assert checks["servers"].startswith("engine0 urls=http://127.0.0.1:")
    assert checks["healthy"] == "yes"
    assert checks["steps_running"] == "1" and checks["steps_after_teardown"] == "0"
    (port,) = servers(tmp_path)
    assert servers(tmp_path)[port]["node"] == "n2" and stopped(tmp_path) == {port}


def test_dry_run_job_prints_the_plan_and_starts_nothing(slurm_cluster, tiny_job, tmp_path):
    job = tiny_job(env={"DRY_RUN": "1"})
    info = slurm_cluster.wait_done(job, timeout=60)
    text = log(tmp_path)
    assert info["JobState"] == "COMPLETED", text
    assert "train        1     0  n1" in text and "rollout      1     0  n2" in text, text
    assert "DRY_RUN=1: plan only, nothing started" in text
    assert (tmp_path / "job" / "plan.env").exists() and (tmp_path / "job" / "plan.json").exists()
    assert not list((tmp_path / "job" / "logs").iterdir()) and not (tmp_path / "servers").exists()


def test_tiny_job_runs_servers_then_trainer_then_tears_down(slurm_cluster, tiny_job, tmp_path):
    job = tiny_job("slurm/tg_tiny.sh", "steps=5")
    info = slurm_cluster.wait_done(job, timeout=60)
    text = log(tmp_path)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text
    assert "trainer finished all steps" in text
    recs = servers(tmp_path)
    (port,) = [p for p, r in recs.items() if "--recipe" not in r["argv"]]
    (svc_port,) = [p for p, r in recs.items() if "--recipe" in r["argv"]]
    engine, service = recs[port], recs[svc_port]
    assert engine["node"] == "n2" and engine["model"] == "models/tiny-qwen3-moe"
    # the rollout service: its own step on the rollout node, started before the trainer
    assert service["node"] == "n2" and service["SLURM_STEP_ID"] != engine["SLURM_STEP_ID"]
    (rank0,) = launches(tmp_path)
    assert rank0["node"] == "n1" and rank0["SLURM_NTASKS"] == "1"
    assert rank0["MASTER_ADDR"] == "127.0.0.1" and rank0["MASTER_PORT"].isdigit()
    url = f"http://127.0.0.1:{port}"
    assert f"rollout.server_urls=[{url}]" in rank0["argv"]
    assert rank0["healthy_servers"] == [url]  # the trainer started only once its server answered
    assert {"rollout.engine=sglang", "parallel.backend=gloo", "parallel.nodes=1"} <= set(rank0["argv"])
    svc_url = f"http://127.0.0.1:{svc_port}"
    assert {"rollout.service=remote", f"rollout.service_url={svc_url}"} <= set(rank0["argv"])
    assert {"rollout.service=in_process", f"rollout.server_urls=[{url}]"} <= set(service["argv"])
    assert stopped(tmp_path) == {port, svc_port}  # teardown reached both servers
    job_dir = tmp_path / "job"
    assert (job_dir / "logs" / "engine0.log").read_text().count("serving on") == 1
    assert "done at step 5" in (job_dir / "logs" / "step-tg-train.log").read_text()
    assert (job_dir / "job.log").resolve() == (tmp_path / "job.log").resolve()


def test_gpu_path_of_tg_30b_on_fake_gpus(slurm_cluster, tiny_job, tmp_path):
    """The real tg_30b.sh (its #SBATCH header, --gpus-per-node=8) on 3 nodes: 1 train,
    1 rollout (4 engines x TP2 + the router), 1 judge."""
    job = tiny_job("slurm/tg_30b.sh", "steps=3", sbatch=("--nodes=3",),
                   env={"TRAIN_NODES": "1", "ROLLOUT_NODES": "1", "JUDGE_MODEL": "models/fake-judge"})
    info = slurm_cluster.wait_done(job, timeout=90)
    text = log(tmp_path)
    assert info["JobState"] == "COMPLETED", text
    recs = servers(tmp_path)
    engines = [r for r in recs.values() if r["model"] == "models/Qwen3-Coder-30B-A3B-Instruct"]
    (router,) = [r for r in recs.values() if r["worker_urls"]]
    (judge,) = [r for r in recs.values() if r["served_model_name"]]
    # each packed engine owns 2 GPUs of its own (srun --gpus-per-task binds them)
    assert sorted(e["cuda_visible_devices"] for e in engines) == ["0,1", "2,3", "4,5", "6,7"]
    assert {e["node"] for e in engines} == {"n2"} and "--tp-size" in engines[0]["argv"]
    # the CPU-only router overlaps the engines' node without taking their GPUs
    assert router["node"] == "n2" and not router["cuda_visible_devices"]
    assert sorted(router["worker_urls"]) == sorted(f"http://127.0.0.1:{e['port']}" for e in engines)
    assert judge["node"] == "n3" and judge["cuda_visible_devices"] == "0,1,2,3,4,5,6,7"
    assert judge["served_model_name"] == "fake-judge" and judge["model"] == "models/fake-judge"
    # one trainer rank per GPU; each sees its node's GPUs and picks SLURM_LOCALID
    ranks = launches(tmp_path)
    assert sorted(int(r["SLURM_LOCALID"]) for r in ranks) == list(range(8))
    assert {r["node"] for r in ranks} == {"n1"}
    assert {r["cuda_visible_devices"] for r in ranks} == {"0,1,2,3,4,5,6,7"}
    argv = ranks[0]["argv"]
    assert f"judge.endpoint=http://127.0.0.1:{judge['port']}" in argv and "judge.model=fake-judge" in argv
    assert ranks[0]["TG_ROUTER_URL"] == f"http://127.0.0.1:{router['port']}"
    assert stopped(tmp_path) == set(recs)  # the redacting pipe of the SGLang servers let TERM through
    # The job's key: SGLang servers get its --config YAML, the router the key file, the trainer
    # rollout.api_key_file and judge.api_key_file; the key itself is in no argv and no log.
    secret = tmp_path / "job" / "secret"
    key = (secret / "api_key").read_text().strip()
    assert (secret / "api_key").stat().st_mode & 0o777 == 0o600 and secret.stat().st_mode & 0o777 == 0o700
    for r in (*engines, judge):
        assert r["argv"][r["argv"].index("--config") + 1] == str(secret / "sglang_auth.yaml")
    assert router["argv"][router["argv"].index("--api-key-file") + 1] == str(secret / "api_key")
    assert {f"rollout.api_key_file={secret / 'api_key'}", f"judge.api_key_file={secret / 'api_key'}"} <= set(argv)
    assert not any(key in a for r in (*recs.values(), *ranks) for a in r["argv"])
    assert not [p for p in tmp_path.rglob("*.log") if key in p.read_text(errors="replace")]


def test_usr1_checkpoints_requeues_and_resumes(slurm_cluster, tiny_job, tmp_path):
    steps = 25
    job = tiny_job("slurm/tg_tiny.sh", f"steps={steps}")
    wait_for(lambda: progress(tmp_path) >= 3, 60, "trainer progress")
    # What --signal=B:USR1@N does before the time limit: USR1 to the batch shell only.
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job)
    info = slurm_cluster.wait(job, lambda i: i["JobState"] == "COMPLETED", timeout=90, what="COMPLETED")
    text = log(tmp_path)
    assert info["Restarts"] == "1", text
    assert "SIGUSR1: forwarding to the trainer" in text
    assert "trainer checkpointed and exited 75" in text and f"requeued job {job}" in text
    assert "SLURM_RESTART_COUNT=1" in text and "trainer finished all steps" in text
    first, second = launches(tmp_path)
    assert (first["restart"], second["restart"]) == (0, 1)
    assert first["start"] == 0 and second["start"] >= 3  # resumed from the checkpointed counter
    assert (tmp_path / "ckpt" / "counter").read_text() == str(steps)
    engine_log = (tmp_path / "job" / "logs" / "engine0.log").read_text()
    assert engine_log.count("restart 0,") == 1 and engine_log.count("restart 1,") == 1


def test_scancel_is_not_undone_by_the_requeue_path(slurm_cluster, tiny_job, tmp_path):
    job = tiny_job("slurm/tg_tiny.sh", "steps=200")
    wait_for(lambda: progress(tmp_path) >= 2, 60, "trainer progress")
    slurm_cluster.run("scancel", job)
    # The trainer still checkpoints and exits 75, but the job is being cancelled: no requeue.
    wait_for(lambda: "not requeueing" in log(tmp_path), 30, "the batch script's decision")
    # COMPLETING until slurmctld has reaped every step (a second or more on a busy machine)
    info = slurm_cluster.wait(job, lambda i: i["JobState"] != "COMPLETING", timeout=30,
                              what="the end of COMPLETING")
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", log(tmp_path)


def test_server_that_dies_is_named_with_host_and_log(slurm_cluster, tiny_job, tmp_path):
    fake = f"{sys.executable} {ROOT}/tests/slurm/fake_server.py --mode exit"
    job = tiny_job("slurm/tg_tiny.sh", env={"ENGINE_CMD": fake})
    info = slurm_cluster.wait_done(job, timeout=60)
    text = log(tmp_path)
    assert info["JobState"] == "FAILED", text
    engine_log = tmp_path / "job" / "logs" / "engine0.log"
    assert ("engine engine0 on n2 (http://127.0.0.1:" in text and "exited before it became healthy"
            in text and f"log: {engine_log}" in text), text
    assert "failing on purpose" in text  # the log's tail is in the job log
    assert not launches(tmp_path)  # no trainer without its servers


def test_server_that_never_answers_times_out_and_is_stopped(slurm_cluster, tiny_job, tmp_path):
    fake = f"{sys.executable} {ROOT}/tests/slurm/fake_server.py --record {tmp_path}/servers --mode hang"
    job = tiny_job("slurm/tg_tiny.sh", env={"ENGINE_CMD": fake, "HEALTH_TIMEOUT": "3"})
    info = slurm_cluster.wait_done(job, timeout=60)
    text = log(tmp_path)
    assert info["JobState"] == "FAILED", text
    assert "engine0 on n2" in text and "not healthy after 3 s (HEALTH_TIMEOUT)" in text, text
    assert stopped(tmp_path) == set(servers(tmp_path))  # torn down, not left running
    assert not launches(tmp_path)


def test_usr1_while_servers_load_requeues_without_a_trainer(slurm_cluster, tiny_job, tmp_path):
    """The time-limit warning can come while the engines still load: nothing to checkpoint,
    so the job requeues straight away (and here, stuck loading again, is cancelled)."""
    fake = f"{sys.executable} {ROOT}/tests/slurm/fake_server.py --record {tmp_path}/servers --mode hang"
    job = tiny_job("slurm/tg_tiny.sh", env={"ENGINE_CMD": fake, "HEALTH_TIMEOUT": "120"})
    wait_for(lambda: servers(tmp_path), 60, "the engine starting")
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job)
    slurm_cluster.wait(job, lambda i: i["Restarts"] == "1", timeout=60, what="a requeue")
    slurm_cluster.run("scancel", job)
    slurm_cluster.wait_done(job, timeout=30)
    text = log(tmp_path)
    assert "SIGUSR1 before the trainer started" in text and f"requeued job {job}" in text, text
    assert not launches(tmp_path)
