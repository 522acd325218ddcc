"""A real Slurm controller for the session (tests/slurm/cluster.sh), and job helpers.

The cluster has 3 emulated nodes with 8 fake GPUs each, its own state dir under pytest's
temp dir and its own ports, so it neither uses nor disturbs a Slurm or munged already on
the machine; the fixture stops only the daemons it started. Jobs are submitted from the
repo root (as on a cluster: recipes and rubrics resolve from there) but write their
output, job dir and checkpoints under each test's tmp_path.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SH = ROOT / "tests" / "slurm" / "cluster.sh"
NODES = 3
APT = "apt-get install -y slurm-wlm munge"


def _ports_free(ports) -> bool:
    for port in ports:
        with socket.socket() as s:
            # as the servers bind (ThreadingHTTPServer, slurmctld): a port in TIME_WAIT after an
            # earlier job's server is free to them
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _free_base(start: int, span: int, stride: int, tries: int = 20) -> int:
    for k in range(tries):
        base = start + k * stride
        if _ports_free(range(base, base + span)):
            return base
    raise RuntimeError(f"no free port range of {span} from {start}")


@dataclass
class Cluster:
    env: dict[str, str]
    state: Path
    args: list[str]
    """cluster.sh and its options: ``bash args[0] COMMAND args[1:]``."""

    def run(self, *cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, check=check, capture_output=True, text=True, **kw)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol -o show job`` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait(self, job_id: str, until, timeout: float = 90.0, what: str = "") -> dict[str, str]:
        """Poll ``scontrol show job`` (``sbatch --wait`` polls far too slowly) until ``until(info)``."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if until(info):
                return info
            time.sleep(0.3)
        raise AssertionError(f"job {job_id}: {what or until} not reached in {timeout} s; last: "
                             f"JobState={info.get('JobState')} Reason={info.get('Reason')} "
                             f"Restarts={info.get('Restarts')}")

    def wait_done(self, job_id: str, timeout: float = 90.0) -> dict[str, str]:
        return self.wait(job_id, lambda i: i.get("JobState") in
                         {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"},
                         timeout, "a final state")


@pytest.fixture(scope="session")
def slurm_cluster() -> Cluster:
    if shutil.which("slurmctld") is None or shutil.which("munged") is None:
        pytest.skip(f"slurm-wlm/munge not installed (CI: {APT})")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm controller needs root (slurmd starts steps as the submitting user)")
    # Not under pytest's tmp dir: that is private to root, and munged runs as user munge.
    state = Path(tempfile.mkdtemp(prefix="megatron-tg-slurm-"))
    base = _free_base(17200, NODES + 1, 50)  # below free_port's draws and the ephemeral range
    args = [str(CLUSTER_SH), "--state-dir", str(state), "--nodes", str(NODES), "--port-base", str(base)]
    started = subprocess.run(["bash", args[0], "start", *args[1:]], capture_output=True, text=True)
    env = {**os.environ, "SLURM_CONF": str(state / "etc" / "slurm.conf")}
    cluster = Cluster(env=env, state=state, args=args)
    try:
        assert started.returncode == 0, f"cluster.sh start failed:\n{started.stdout}\n{started.stderr}"
        yield cluster
    finally:
        subprocess.run(["bash", args[0], "stop", *args[1:]], capture_output=True, text=True)
        shutil.rmtree(state, ignore_errors=True)


# Each job gets its own PORT_BASE (the plan offsets every port from it by up to ~2,600):
# the emulated nodes share one address, and a torn-down server's port may linger briefly.
# The bases sit below the kernel's ephemeral range (32768-60999 here) and below free_port's
# draws (21200 and up): a port in the ephemeral range can be handed to any outgoing
# connection between the check below and the job's server binding it (measured: a job's
# rollout service failed with EADDRINUSE on 48800 in CI).
_job_slots = iter(range(10_000))
JOB_BASES = (10000, 11600, 13200, 14800, 18000, 19600)  # each uses base..base+1507; the cluster sits at 17200+

def _job_port_base() -> int:
    for _ in range(12):
        base = JOB_BASES[next(_job_slots) % len(JOB_BASES)]
        if _ports_free([base, base + 100, base + 500, base + 600, *range(base + 1500, base + 1508)]):
            return base
    raise RuntimeError("no free port range for a job")


@pytest.fixture
def tiny_job(slurm_cluster, tmp_path):
    """Submit slurm/tg_tiny.sh (or another wrapper) with fake servers and the stand-in trainer.

    Returns ``submit(script="slurm/tg_tiny.sh", *overrides, env={...}, sbatch=[...]) -> job id``;
    the job's log is tmp_path/job.log, its job dir tmp_path/job, checkpoints tmp_path/ckpt,
    fake-server records tmp_path/servers.
    """
    py = sys.executable
    fake = f"{py} {ROOT}/tests/slurm/fake_server.py --record {tmp_path}/servers"
    base = _job_port_base()

    def submit(script: str = "slurm/tg_tiny.sh", *overrides: str, env: dict | None = None,
               sbatch: tuple[str, ...] = ()) -> str:
        job_env = {
            **slurm_cluster.env, "PYTHON": py, "TRAINER_CMD": f"{py} {ROOT}/tests/slurm/fake_trainer.py",
            "ENGINE_CMD": fake, "ROUTER_CMD": fake, "JUDGE_CMD": fake, "SERVICE_CMD": fake,
            "JOB_DIR": str(tmp_path / "job"), "PORT_BASE": str(base),
            "HEALTH_POLL": "0.3", "TEARDOWN_GRACE": "5", "TRAIN_EXIT_WAIT": "10", "FAKE_STEP_S": "0.2",
            **(env or {}),
        }
        out = subprocess.run(
            ["sbatch", "--parsable", f"--output={tmp_path}/job.log", *sbatch, script,
             f"checkpoint.dir={tmp_path}/ckpt", *overrides],
            cwd=ROOT, env=job_env, capture_output=True, text=True, check=True)
        return out.stdout.strip().split(";")[0]

    return submit
