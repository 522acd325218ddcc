"""The argv slurm/task.sh starts a server with, read back through a recorder command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megatron_tg.auth import write_key_dir
from megatron_tg.launch import render as R

ROOT = Path(__file__).resolve().parents[2]


def task_argv(plan, tmp_path: Path, step: int = 0, local_id: int = 0, recorder: str = "printf ARG:%s\\n",
              check: bool = True, make_key: bool = True) -> list[str]:
    """Run slurm/task.sh for ``step`` with a recorder as the server command; return the
    argv the server would have been started with (after the command itself). The job's
    key is made first, as slurm/lib.sh makes it (``job_dir`` must be "JOB")."""
    job = tmp_path / "job"
    (job / "logs").mkdir(parents=True, exist_ok=True)
    env_text = R.render_env(plan).replace("JOB/logs", str(job / "logs")).replace("JOB/secret", str(job / "secret"))
    (job / "plan.env").write_text(env_text)
    if plan.key_file and make_key:
        write_key_dir(job / "secret")
    env = dict(os.environ, TG_JOB_DIR=str(job), TG_STEP_INDEX=str(step), SLURM_LOCALID=str(local_id),
               SLURM_NODEID="0", ENGINE_CMD=recorder, JUDGE_CMD=recorder, ROUTER_CMD=recorder, SERVICE_CMD=recorder,
               PYTHON=sys.executable)
    subprocess.run(["bash", str(ROOT / "slurm" / "task.sh")], env=env, check=check, timeout=60)
    server = plan.steps[step].first + local_id
    log = Path(plan.servers[server].log.replace("JOB/logs", str(job / "logs")))
    return [line[4:] for line in log.read_text().splitlines() if line.startswith("ARG:")]
