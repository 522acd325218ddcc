"""slurm/tg_tiny.sh with ``rollout.placement=colocated``, end to end against the local Slurm
controller, with nothing faked: the plan puts the embedded CPU engine (started with
--enable-memory-saver), the rollout service and the real trainer on ONE node, the engine's
and the trainer's steps sharing it (``srun --overlap``); each step the trainer releases the
engine, trains, and writes its weights back through ``/update_weights_from_tensor``.

The same seeded job disaggregated (engine and service on a second node, weights over the
gloo broadcast), both at ``max_staleness=0``, trains to the same losses; the colocated job
also takes the time-limit path (USR1 -> checkpoint -> exit 75 -> requeue -> resume).

Two jobs, ~150 s on 2 shared cores.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.slurm.test_tg_tiny_e2e import _rows, policy_dir  # noqa: F401 (fixture)
from tests.train.test_kill_resume import RUBRIC

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 3
ENV = {"TRAINER_CMD": "", "ENGINE_CMD": "", "ROUTER_CMD": "", "JUDGE_CMD": "", "SERVICE_CMD": "",
       "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
       "HEALTH_POLL": "0.5", "HEALTH_TIMEOUT": "180", "TEARDOWN_GRACE": "15"}


def _evidence(job_dir, log) -> str:
    parts = []
    for path in [log, *sorted((job_dir / "logs").glob("*.log"))]:
        if path.exists():
            parts.append(f"==> {path.name}\n{path.read_text()[-3000:]}")
    return "\n".join(parts)


def test_tiny_job_colocated_trains_to_the_disaggregated_losses_and_resumes(
        slurm_cluster, tiny_job, tmp_path, policy_dir):  # noqa: F811
    rubric = tmp_path / "coin_flips.yaml"  # rewards that differ within a group: a loss to compare
    rubric.write_text(RUBRIC.replace("scope: final_turn", "scope: every_turn"))
    jobs = {}
    for placement in ("disaggregated", "colocated"):
        run_dir, job_dir, log = tmp_path / placement, tmp_path / f"job-{placement}", tmp_path / f"{placement}.log"
        colocated = placement == "colocated"
        job = tiny_job(
            "slurm/tg_tiny.sh",
            f"model.hf_config={policy_dir}", f"model.hf_checkpoint={policy_dir}",
            f"logging.run_dir={run_dir}", f"checkpoint.dir={run_dir}/ckpt",
            f"steps={STEPS}", "checkpoint.interval=1", "logging.progress_bar=false",
            "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.buffer_size=2",
            "rollout.max_new_tokens=24", "rollout.max_turns=2", "rollout.max_staleness=0",
            f"judge.rubric={rubric}", "objective.primary_criteria=[has_e]",
            "rollout.sampling_seed=1234", f"rollout.placement={placement}",
            env={**ENV, "JOB_DIR": str(job_dir), **({"ROLLOUT_NODES": "0"} if colocated else {})},
            sbatch=(f"--output={log}", *(("--nodes=1",) if colocated else ())))
        if colocated:  # the time-limit warning once step 1 is logged and checkpointed
            deadline = time.monotonic() + 240
            while not (_rows(run_dir) and (run_dir / "ckpt" / "latest").exists()):
                state = slurm_cluster.job(job).get("JobState")
                assert state in {"PENDING", "CONFIGURING", "RUNNING"}, f"job {state}\n{_evidence(job_dir, log)}"
                assert time.monotonic() < deadline, f"no checkpointed step in 240 s\n{_evidence(job_dir, log)}"
                time.sleep(0.5)
            slurm_cluster.run("scancel", "--signal=USR1", "--batch", job)
        info = slurm_cluster.wait_done(job, timeout=300)
        evidence = _evidence(job_dir, log)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", evidence
        jobs[placement] = (info, _rows(run_dir), job_dir, log.read_text(), evidence)

    info, rows, job_dir, text, evidence = jobs["colocated"]
    # one node: the engine, the service and the trainer there, sharing it
    assert info["NumNodes"] == "1" and info["Restarts"] == "1", evidence
    logs = job_dir / "logs"
    assert re.findall(r"engine0 node rank 0 on (\S+),", (logs / "engine0.log").read_text()) == ["n1", "n1"], evidence
    assert "--enable-memory-saver" in (logs / "engine0.log").read_text()
    assert re.findall(r"rollout_service node rank 0 on (\S+),",
                      (logs / "rollout_service.log").read_text()) == ["n1", "n1"], evidence
    assert "--overlap" in text.split("start tg-train")[1].splitlines()[0], evidence
    # the time-limit path: exit 75 at a checkpoint, requeued, resumed from exactly that step
    trainer_log = (logs / "step-tg-train.log").read_text()
    # the engine ran first (as SGLang servers do): released before the trainer built its model,
    # at each launch, then written with the trainer's weights before the first rollout
    assert trainer_log.count("released every tag of engines") == 2, evidence
    stops = re.findall(r"stop requested: checkpointed step (\d+), exiting 75", trainer_log)
    assert len(stops) == 1 and re.findall(rf"resumed from checkpoint step (\d+) of {STEPS}", trainer_log) == stops
    assert f"requeued job" in text and "trainer finished all steps" in text, evidence
    # every step trained on an engine holding 0 bytes, and its weights went back by tensor
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
    for r in rows:
        assert r["colocated/engine_bytes_at_train"] == 0.0 and r["colocated/onload_bytes"] > 0, r
        assert r["sync/buckets"] >= 1 and r["sync/probe_logprob_diff"] < 0.1, r
    # the same rollouts and losses as the disaggregated job (the engine's log-probs round with
    # its batch composition: tests/train/test_loop_colocated.py measures the same bound)
    base = jobs["disaggregated"][1]
    assert [r["step"] for r in base] == list(range(1, STEPS + 1)), jobs["disaggregated"][4]
    assert all("colocated/onload_bytes" not in r for r in base)
    for k in ("rollout/response_tokens", "rollout/turns", "reward/mean", "kl/frac_gated"):
        assert [r[k] for r in rows] == [r[k] for r in base], k
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(rows, base))
    print(f"\ntg_tiny colocated vs disaggregated: max |step loss difference| {diff}; "
          f"losses {[r['loss'] for r in base]}")
    assert diff <= 2e-7
    assert len({r["loss"] for r in base}) > 1 and any(r["optim/grad_norm"] > 0 for r in base), base
    for x, y in zip(base, rows):
        assert y["optim/grad_norm"] == pytest.approx(x["optim/grad_norm"], rel=1e-6, abs=1e-9)
