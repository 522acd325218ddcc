"""slurm/tg_tiny.sh end to end against the local Slurm controller, with nothing faked.

The job runs what a lab runs on a GPU cluster, on CPU: the plan, an embedded CPU engine
started as a server step (SGLang's HTTP API) on the rollout node, the rollout service (the
manager, agent harness and judge) as its own step there too, the real trainer
(``python -m megatron_tg.train``, the script's default TRAINER_CMD) on the trainer node,
generating through the engine and pushing its weights to it over gloo. Then the time-limit
path: USR1 to the batch shell (what ``--signal=B:USR1@N`` does) once the first step is
logged and checkpointed -> the trainer finishes its step, checkpoints and exits 75 -> the
job requeues itself -> engines restart, the trainer resumes from the checkpoint and
finishes -> COMPLETED.

50-100 s on 2 shared cores (4 steps of 2 prompts x 2 rollouts, 48 new tokens).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 4


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """The tiny random Qwen3-MoE policy + tokenizer (megatron_tg.models.tiny, recipes/tiny_cpu.yaml)."""
    from megatron_tg.models.tiny import build_tiny_policy

    return build_tiny_policy(tmp_path_factory.mktemp("policy"))


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return rows


def _evidence(tmp_path: Path) -> str:
    """The job log and the tail of every per-role log, for assertion messages."""
    parts = []
    for path in [tmp_path / "job.log", *sorted((tmp_path / "job" / "logs").glob("*.log"))]:
        if path.exists():
            parts.append(f"==> {path.name}\n{path.read_text()[-3000:]}")
    return "\n".join(parts)


def test_tiny_job_trains_requeues_on_usr1_and_resumes(slurm_cluster, tiny_job, tmp_path, policy_dir):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    job = tiny_job(
        "slurm/tg_tiny.sh",
        f"model.hf_config={policy_dir}", f"model.hf_checkpoint={policy_dir}",
        f"logging.run_dir={run_dir}", f"checkpoint.dir={run_dir}/ckpt",
        f"steps={STEPS}", "checkpoint.interval=1", "logging.progress_bar=false",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.buffer_size=2",
        "rollout.max_new_tokens=48", "rollout.max_turns=2", "rollout.max_staleness=1",
        # Empty = the scripts' defaults: the real trainer and the embedded engine server.
        env={"TRAINER_CMD": "", "ENGINE_CMD": "", "ROUTER_CMD": "", "JUDGE_CMD": "", "SERVICE_CMD": "",
             "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
             "HEALTH_POLL": "0.5", "HEALTH_TIMEOUT": "180", "TEARDOWN_GRACE": "15"})

    # The time-limit warning once step 1 is logged and checkpointed (steps 2..4 still to go).
    # After a checkpoint on purpose: Slurm signals every process of the trainer's step, and
    # the first save leaves a helper process behind (megatron's writer results queue).
    latest = run_dir / "ckpt" / "latest"
    deadline = time.monotonic() + 240
    while not (_rows(run_dir) and latest.exists()):
        state = slurm_cluster.job(job).get("JobState")
        assert state in {"PENDING", "CONFIGURING", "RUNNING"}, f"job {state}\n{_evidence(tmp_path)}"
        assert time.monotonic() < deadline, f"no checkpointed step in 240 s\n{_evidence(tmp_path)}"
        time.sleep(0.5)
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job)
    try:
        info = slurm_cluster.wait_done(job, timeout=300)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_evidence(tmp_path)}") from None
    elapsed = time.monotonic() - t0
    text = (tmp_path / "job.log").read_text()
    evidence = _evidence(tmp_path)

    # requeued once, then finished
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", evidence
    assert info["Restarts"] == "1", evidence
    assert "SIGUSR1: forwarding to the trainer" in text, evidence
    assert "trainer checkpointed and exited 75" in text and f"requeued job {job}" in text, evidence
    assert "SLURM_RESTART_COUNT=1" in text and "trainer finished all steps" in text, evidence
    assert text.count("-m megatron_tg.train --recipe recipes/tiny_cpu.yaml") == 2, evidence  # the default

    # the trainer: exit 75 at a checkpoint, resumed from exactly that step, exit 0 at the end
    logs = tmp_path / "job" / "logs"
    trainer_log = (logs / "step-tg-train.log").read_text()
    stops = re.findall(r"stop requested: checkpointed step (\d+), exiting 75", trainer_log)
    resumes = re.findall(rf"resumed from checkpoint step (\d+) of {STEPS}", trainer_log)
    assert len(stops) == 1 and resumes == stops, evidence
    stopped_at = int(stops[0])
    assert 1 <= stopped_at < STEPS, evidence
    assert trainer_log.index(f"starting at step 0 of {STEPS}") < trainer_log.index("stop requested") \
        < trainer_log.index("resumed from") < trainer_log.index(f"done: step {STEPS} of {STEPS}"), evidence

    # every step logged exactly once; weights reached the engine; the last checkpoint is the last step
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
    assert any(r.get("sync/bytes", 0) > 0 for r in rows), rows
    assert latest.read_text().strip() == f"step_{STEPS:08d}"
    assert (run_dir / "config.yaml").exists()

    # one log per role, both launches in each
    engine_log = (logs / "engine0.log").read_text()
    assert engine_log.count("restart 0,") == 1 and engine_log.count("restart 1,") == 1, evidence
    assert engine_log.count("engine INFO serving") == 2, evidence
    assert {p.name for p in logs.glob("*.log")} >= {"engine0.log", "step-tg-train.log",
                                                    "step-tg-engines-n2.log", "rollout_service.log"}
    # the rollout side ran as its own step on the rollout node, once per launch, and the
    # trainer took every batch from it (the manifest names it)
    service_log = (logs / "rollout_service.log").read_text()
    assert service_log.count("[rollout service] pid") == 2, evidence
    assert re.findall(r"rollout_service node rank 0 on (\S+),", service_log) == ["n2", "n2"], evidence
    starts = json.loads((run_dir / "manifest.json").read_text())["starts"]
    pids = [s["rollout_service"]["pid"] for s in starts]
    assert len(starts) == 2 and pids[0] != pids[1], starts  # a fresh service per launch
    assert all(r["service/next_batch_s"] >= 0 and "capacity/inflight_limit" in r for r in rows), rows
    print(f"tg_tiny end to end: {elapsed:.0f} s, stopped at step {stopped_at}")
