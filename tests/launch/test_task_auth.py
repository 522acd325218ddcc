"""The job's API key in the Slurm scripts: the plan and its dry-run name the key file, never a
key; slurm/task.sh gives every server the file (SGLang its --config YAML, the router and the
embedded engine the key file, the rollout service the config path), refuses to start a server
when the file is missing, and filters SGLang's output so the key it logs never reaches the
log. The real servers behind these flags: tests/rollout/test_router.py, test_engine_auth.py."""

from __future__ import annotations

import re
from pathlib import Path

from megatron_tg.auth import read_key
from megatron_tg.launch import render as R
from megatron_tg.launch.plan import Knobs, make_plan
from tests.launch.task_argv import task_argv
from tests.launch.test_scripts import WRAPPERS, fake_slurm, run_script  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[2]
R30 = str(ROOT / "recipes" / "tg_30b.yaml")
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")
JUDGE = Knobs(judge_model="models/judge", job_dir="JOB")
CPU = Knobs(engine="embedded", accel="cpu", gpus_per_node=1, train_nodes=1, rollout_nodes=1, service=True,
            job_dir="JOB")
CPU_OVERRIDES = ["rollout.engine=sglang", "parallel.backend=gloo"]


def test_plan_passes_the_key_file_to_trainer_service_and_judge():
    plan = make_plan(R30, [], JUDGE)
    assert plan.key_file == "JOB/secret/api_key" and plan.sglang_auth == "JOB/secret/sglang_auth.yaml"
    assert "rollout.api_key_file=JOB/secret/api_key" in plan.train_args
    assert "judge.api_key_file=JOB/secret/api_key" in plan.train_args  # the job serves the judge
    env = R.render_env(plan)
    assert "TG_KEY_FILE=JOB/secret/api_key" in env and "TG_SGLANG_AUTH=JOB/secret/sglang_auth.yaml" in env
    assert "auth: every server requires the job's API key, file JOB/secret/api_key" in R.render_text(plan)
    external = make_plan(R30, [], Knobs(judge_url="http://judge:8000", judge_name="j", job_dir="JOB"))
    assert not any(a.startswith("judge.api_key_file") for a in external.train_args)  # not ours to key
    svc = make_plan(TINY, CPU_OVERRIDES, CPU)
    assert "rollout.api_key_file=JOB/secret/api_key" in svc.service_args


def test_dry_runs_show_the_key_file_and_no_key(fake_slurm):  # noqa: F811
    for script in WRAPPERS:
        out = run_script(script, "--dry-run", fake_slurm=fake_slurm)
        assert out.returncode == 0, out.stderr
        assert re.search(r"^auth: every server requires the job's API key, file runs/slurm/JOB/secret/api_key ",
                         out.stdout, re.M), out.stdout
        assert "rollout.api_key_file=runs/slurm/JOB/secret/api_key" in out.stdout
        assert "api-key" not in out.stdout  # no key flag with a value: files only


def test_task_gives_each_server_the_key_file_and_never_the_key(tmp_path):
    plan = make_plan(R30, [], JUDGE)
    steps = {s.role: i for i, s in enumerate(plan.steps)}
    job = tmp_path / "engine" / "job"
    engine = task_argv(plan, tmp_path / "engine", step=steps["engine"])
    assert engine[engine.index("--config") + 1] == str(job / "secret" / "sglang_auth.yaml")
    key = read_key(job / "secret" / "api_key")
    judge = task_argv(plan, tmp_path / "judge", step=steps["judge"])
    assert judge[judge.index("--config") + 1] == str(tmp_path / "judge" / "job" / "secret" / "sglang_auth.yaml")
    router = task_argv(plan, tmp_path / "router", step=steps["router"])
    assert router[router.index("--api-key-file") + 1] == str(tmp_path / "router" / "job" / "secret" / "api_key")
    assert router[-4:-2] == ["--host", "0.0.0.0"]
    cpu = make_plan(TINY, CPU_OVERRIDES, CPU)
    cpu_steps = {s.role: i for i, s in enumerate(cpu.steps)}
    embedded = task_argv(cpu, tmp_path / "cpu", step=cpu_steps["engine"])
    assert embedded[embedded.index("--api-key-file") + 1] == str(tmp_path / "cpu" / "job" / "secret" / "api_key")
    service = task_argv(cpu, tmp_path / "svc", step=cpu_steps["rollout_service"])
    assert f"rollout.api_key_file={tmp_path / 'svc' / 'job' / 'secret' / 'api_key'}" in service
    assert not any(key in a for a in engine + judge + router)
    assert not any("--api-key" == a for a in engine + judge + router + embedded + service)


def test_task_refuses_to_start_a_server_without_the_key_file(tmp_path):
    plan = make_plan(R30, [], JUDGE)
    key_dir = tmp_path / "job" / "secret"
    assert task_argv(plan, tmp_path, check=False, make_key=False) == []  # the server was never started
    log = Path(plan.servers[0].log.replace("JOB/logs", str(tmp_path / "job" / "logs"))).read_text()
    assert f"the job's API key {key_dir / 'api_key'} is missing" in log


def test_sglangs_own_logging_of_its_key_is_filtered_out_of_the_log(tmp_path):
    # A stand-in for SGLang that prints its --config file, as SGLang prints server_args=...
    # with api_key in it; the job's log gets "<redacted>", and the server's exit status.
    fake = tmp_path / "sglang.sh"
    fake.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = --config ] && cat "$2"; shift; done\n'
                    'echo "ARG:last line"\nexit 0\n')
    fake.chmod(0o755)
    plan = make_plan(R30, [], JUDGE)
    out = task_argv(plan, tmp_path, recorder=str(fake))
    log = Path(plan.servers[0].log.replace("JOB/logs", str(tmp_path / "job" / "logs"))).read_text()
    key = read_key(tmp_path / "job" / "secret" / "api_key")
    assert "api-key: <redacted>" in log and key not in log and out == ["last line"]
