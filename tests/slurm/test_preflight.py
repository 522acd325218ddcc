"""slurm/preflight.sh on the local Slurm controller, CPU flavour: one emulated node split
into a trainer half and an engine half, embedded CPU engines started through slurm/task.sh
(SGLang's HTTP API), the real trainer for one TG step and a resume, the pass/fail table.

About 60-90 s on 2 shared cores; the failing case about 15 s.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

CHECKS = ["plan", "NCCL versions", "engines started", "router health", "engines answer /model_info", "generate with log-probs",
          "seeded sampling repeats", "trainer run (1 step)", "TG train step", "weight sync to engines", "checkpoint save",
          "trainer resume run", "checkpoint load (resume)", "routing replay"]
CPU = {"RECIPE": "recipes/tiny_cpu.yaml", "ACCEL": "cpu", "ENGINE": "embedded", "NODE_GPUS": "2",
       "TRAINER_CMD": "", "ROUTER_CMD": "", "JUDGE_CMD": "", "OMP_NUM_THREADS": "1",
       "PYTHONWARNINGS": "ignore", "HEALTH_POLL": "0.5", "HEALTH_TIMEOUT": "180", "TEARDOWN_GRACE": "15",
       "PREFLIGHT_TIMEOUT": "280"}


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from megatron_tg.models.tiny import build_tiny_policy

    return build_tiny_policy(tmp_path_factory.mktemp("policy"))


def table(tmp_path) -> dict[str, tuple[str, str]]:
    rows = [line.split("\t", 2) for line in (tmp_path / "job" / "preflight.tsv").read_text().splitlines()]
    return {name: (state, detail) for name, state, detail in rows}


def submit(tiny_job, policy_dir, env):
    # tiny_cpu generates in-process; here, as on a cluster, from engine servers over HTTP
    return tiny_job("slurm/preflight.sh", "rollout.engine=sglang", "parallel.backend=gloo",
                    f"model.hf_config={policy_dir}", f"model.hf_checkpoint={policy_dir}",
                    "rollout.max_new_tokens=24", "rollout.sampling_seed=3", env={**CPU, **env})


def test_preflight_passes_on_the_cpu_cluster(slurm_cluster, tiny_job, tmp_path, policy_dir):
    job = submit(tiny_job, policy_dir, {"ENGINE_CMD": ""})
    info = slurm_cluster.wait_done(job, timeout=330)
    log = (tmp_path / "job.log").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-4000:]
    rows = table(tmp_path)
    assert list(rows) == CHECKS, rows
    # CPU torch has no NCCL (gloo syncs the weights), and one engine needs no router
    skipped = {"NCCL versions", "router health"}
    assert all(rows[c][0] == "PASS" for c in CHECKS if c not in skipped), rows
    assert rows["NCCL versions"][0] == "SKIP" and "NCCL none" in rows["NCCL versions"][1], rows
    assert rows["router health"] == ("SKIP", "no router in this plan (one engine, or rollout.router_url unset)")
    assert rows["routing replay"][1].startswith("rollout.routing_replay=true")
    assert "weight version {'http://127.0.0.1" in rows["weight sync to engines"][1]
    assert "step_00000001" in rows["checkpoint save"][1]
    assert "-m megatron_tg.rollout.engine --model" in rows["engines started"][1]
    assert "preflight: all checks passed" in log and "check" in log and "result" in log


def test_preflight_names_what_failed(slurm_cluster, tiny_job, tmp_path, policy_dir):
    job = submit(tiny_job, policy_dir, {"ENGINE_CMD": "false"})  # an engine that exits at once
    info = slurm_cluster.wait_done(job, timeout=200)
    log = (tmp_path / "job.log").read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", log[-4000:]
    rows = table(tmp_path)
    assert list(rows) == CHECKS and rows["plan"][0] == "PASS", rows
    assert rows["engines started"][0] == "FAIL"
    assert rows["NCCL versions"][0] == "SKIP"  # it runs before the engines start
    assert all(rows[c] == ("SKIP", "after 'engines started' failed") for c in CHECKS[3:]), rows
    assert "preflight: FAILED: engines started" in log
