"""Container runtimes behind the sandbox interface: the exact command lines, each flag one
the runtime documents. None of the runtimes is installable on this CI machine (Debian ships
no apptainer; enroot and pyxis need their own kernels' setup and a Slurm plugin), so what is
checked is the construction, and the shared inner command (prlimit + sh) really runs."""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile

import pytest

from megatron_tg.agent.runtimes import IMAGE_PATH, ContainerSandbox, sandbox_from_config
from megatron_tg.agent.sandbox import Bind, Limits, Sandbox, SandboxError
from megatron_tg.agent.tasks import Task
from megatron_tg.config.rollout import RolloutConfig

# The options each runtime documents for the subcommand used: `apptainer exec --help`
# (apptainer 1.4 man page apptainer-exec(1)), enroot's doc/cmd/start.md, pyxis' README
# (`srun --help`, "Options provided by plugins", pyxis 0.24) and srun(1).
APPTAINER_EXEC = {"--containall", "--net", "--network", "--writable-tmpfs", "--no-privs", "--bind", "--pwd",
                  "--env", "--cleanenv", "--contain", "--no-home", "--pid", "--ipc"}
ENROOT_START = {"--conf", "--env", "--rc", "--root", "--rw", "--mount"}
SRUN_PYXIS = {"--container-image", "--container-mounts", "--container-workdir", "--container-name",
              "--no-container-mount-home", "--container-writable", "--container-readonly", "--container-unshare",
              "--container-remap-root", "--container-env"}
SRUN = {"--ntasks", "--nodes", "--overlap", "--job-name", "--export", "--time", "--mem"}

TASK = Task(id="django__django-1", instruction="fix", fail_to_pass=["t.py::test_a"],
            image="docker://swebench/sweb.eval.x86_64.django_1776_django-1:latest")
LIM = Limits(wall_s=5, cpu_s=3, memory_mb=512, max_procs=16, max_file_mb=8)


def options(argv: list[str], stop: str) -> list[str]:
    """The runtime's own options: up to the image / command."""
    out = []
    for a in argv[2 if argv[1] in ("exec", "start") else 1: argv.index(stop)]:
        if a.startswith("--"):
            out.append(a.split("=", 1)[0])
    return out


def test_apptainer_command_line():
    sb = ContainerSandbox("apptainer", binary="/opt/apptainer/bin/apptainer", limits=LIM).for_task(TASK)
    argv = sb.argv("pytest -q", "/ws/a", binds=[Bind("/g", "/tg-grader"), Bind("/r", "/tg-report", writable=True)])
    prl = ["prlimit", f"--as={512 << 20}", "--cpu=3:4", "--nproc=16", f"--fsize={8 << 20}", "--core=0", "--"]
    expect = ["/opt/apptainer/bin/apptainer", "exec", "--containall", "--net", "--network", "none", "--writable-tmpfs"]
    expect += ["--no-privs"] if os.geteuid() == 0 else []
    expect += ["--bind", "/ws/a:/testbed", "--bind", "/g:/tg-grader:ro", "--bind", "/r:/tg-report", "--pwd", "/testbed"]
    expect += ["--env", f"PATH={IMAGE_PATH}", "--env", "HOME=/testbed", "--env", "TMPDIR=/tmp", "--env", "LANG=C.UTF-8",
               "--env", "PYTHONDONTWRITEBYTECODE=1", "--env", "PYTHONUNBUFFERED=1"]
    assert argv == expect + [TASK.image] + prl + ["/bin/sh", "-c", "pytest -q"]
    assert set(options(argv, TASK.image)) <= APPTAINER_EXEC
    assert sb.path_in("/ws/a") == "/testbed" and not sb.drops_uid


def test_enroot_needs_consent_and_its_command_line():
    with pytest.raises(SandboxError, match="shares the node's network"):
        ContainerSandbox("enroot", binary="enroot")
    sb = ContainerSandbox("enroot", binary="enroot", limits=LIM, allow_unsandboxed=True).for_task(TASK)
    argv = sb.argv("ls", "/ws/b", binds=[Bind("/g", "/tg-grader")])
    assert argv[:8] == ["enroot", "start", "--rw", "--mount", "/ws/b:/testbed:none:bind",
                        "--mount", "/g:/tg-grader:none:bind,ro", "--env"]
    i = argv.index(TASK.image)
    assert argv[i + 1:i + 6] == ["/bin/sh", "-c", 'cd /testbed && exec "$@"', "sh", "prlimit"]
    assert set(options(argv, TASK.image)) <= ENROOT_START
    # the wrapper really changes directory and runs the rest of argv (run here with sh)
    out = subprocess.run(["/bin/sh", "-c", 'cd / && exec "$@"', "sh", "/bin/sh", "-c", "pwd; echo $0 ok"],
                         capture_output=True, text=True).stdout
    assert out.split() == ["/", "/bin/sh", "ok"]


def test_pyxis_command_line():
    sb = ContainerSandbox("pyxis", binary="srun", limits=LIM, srun_args=["--time=00:05:00"]).for_task(TASK)
    argv = sb.argv("python -V", "/shared/ws/c", binds=[Bind("/shared/r", "/tg-report", writable=True)])
    assert argv[argv.index("--export=NONE") + 1:argv.index("--export=NONE") + 3] == ["/usr/bin/env", "-i"]
    assert f"--container-image={TASK.image}" in argv and "--container-unshare=net,ipc,uts" in argv
    assert "--container-mounts=/shared/ws/c:/testbed,/shared/r:/tg-report" in argv
    assert "--container-workdir=/testbed" in argv and "--no-container-mount-home" in argv
    assert f"PATH={IMAGE_PATH}" in argv and argv[-3:] == ["/bin/sh", "-c", "python -V"]
    opts = options(argv, "/usr/bin/env")
    assert set(opts) <= SRUN_PYXIS | SRUN, set(opts) - SRUN_PYXIS - SRUN
    again = sb.argv("true", "/shared/ws/c")
    assert [a for a in again if a.startswith("--job-name")] == [a for a in argv if a.startswith("--job-name")]


def test_a_task_without_an_image_is_refused_and_config_picks_the_runtime(monkeypatch):
    sb = ContainerSandbox("apptainer", binary="apptainer")
    with pytest.raises(SandboxError, match="has no image"):
        sb.for_task(Task(id="x", instruction="i", fail_to_pass=["a.py::b"]))
    with pytest.raises(SandboxError, match="no image"):
        sb.argv("true", "/ws")
    with monkeypatch.context() as m:
        m.setenv("PATH", "/nonexistent")
        with pytest.raises(SandboxError, match=r"none of \('apptainer', 'singularity'\) is on PATH"):
            sandbox_from_config(RolloutConfig(sandbox="apptainer"))
    cfg = RolloutConfig(sandbox="bwrap")
    cfg.validate()
    assert type(sandbox_from_config(cfg)) is Sandbox


def test_the_inner_command_is_the_same_limited_shell(sandbox):
    """The part of every runtime's command line that runs inside the image: prlimit + sh.
    Run here as it would run there (on this machine's util-linux)."""
    sb = ContainerSandbox("apptainer", binary="apptainer", limits=LIM).for_task(TASK)
    argv = sb.argv("awk '/Max processes/{print $3} /Max address space/{print $4}' /proc/self/limits; echo inner",
                   "/ws")
    inner = argv[argv.index(TASK.image) + 1:]
    inner[0] = sandbox.prlimit
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run(inner, cwd=d, capture_output=True, text=True, timeout=10).stdout.split()
    assert out == ["16", str(512 << 20), "inner"], (shlex.join(inner), out)
