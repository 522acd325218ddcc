"""Hostile snippets run through the sandbox are contained, and the machine stays healthy.

Every snippet runs under short limits (conftest.FAST: 4 s wall, 2 CPU-s, 384 MiB, 24 procs)."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

import megatron_tg
from megatron_tg.agent.sandbox import Limits, Sandbox, SandboxError, rmtree

REPO = Path(megatron_tg.__file__).resolve().parent.parent


def run(sandbox, cmd, wd, limits=None):
    return asyncio.run(sandbox.run(cmd, wd, limits))


def leftovers(wd: str) -> list[int]:
    """Processes still running in the task directory (their cwd is in it)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.readlink(f"/proc/{pid}/cwd").startswith(wd):
                    out.append(int(pid))
            except OSError:
                continue
    return out


def test_basic_command_and_workspace_is_writable(sandbox, workdir):
    r = run(sandbox, "echo hello > f.txt && cat f.txt && python -c 'print(6*7)'", workdir)
    assert r.ok and r.output.split() == ["hello", "42"], r.describe()
    assert Path(workdir, "f.txt").read_text() == "hello\n"


def test_no_network(sandbox, workdir):
    r = run(sandbox, "python -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)\"", workdir)
    assert r.exit_code != 0 and "unreachable" in r.output.lower(), r.describe()
    r = run(sandbox, "cat /proc/net/dev", workdir)
    ifaces = [ln.split(":")[0].strip() for ln in r.output.splitlines() if ":" in ln]
    assert ifaces == ["lo"], r.output


def test_cannot_write_outside_the_task_dir(sandbox, workdir):
    outside = tempfile.mkdtemp(prefix="tg-outside-")
    os.chmod(outside, 0o777)
    try:
        marker = REPO / "SANDBOX_ESCAPE_MARKER"
        r = run(sandbox, f"echo x > {marker}; echo x > {outside}/escape; echo x > /etc/escape; "
                         f"touch $HOME/../escape; mount -o remount,rw / ; echo done", workdir)
        assert "done" in r.output
        assert "Read-only file system" in r.output, r.output
        assert not marker.exists() and not Path(outside, "escape").exists() and not Path("/etc/escape").exists()
        assert not Path(workdir).parent.joinpath("escape").exists()
    finally:
        rmtree(outside)


def test_fork_bomb_is_contained(sandbox, workdir):
    t0 = time.monotonic()
    r = run(sandbox, "bomb() { bomb | bomb & }; bomb; sleep 30", workdir,
            Limits(wall_s=3.0, cpu_s=2, memory_mb=256, max_procs=16))
    assert not r.ok and time.monotonic() - t0 < 10
    time.sleep(0.2)
    assert leftovers(workdir) == []
    pid = os.fork()  # the machine can still start processes
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0


def test_memory_hog_is_killed(sandbox, workdir):
    r = run(sandbox, "python -c \"a = []\nwhile True: a.append(bytearray(10**7))\"", workdir)
    assert r.exit_code not in (0, None) and not r.timed_out and "MemoryError" in r.output, r.describe()


def test_infinite_loop_hits_the_cpu_limit(sandbox, workdir):
    t0 = time.monotonic()
    r = run(sandbox, "python -c 'while True: pass'", workdir, Limits(wall_s=10.0, cpu_s=1))
    dt = time.monotonic() - t0
    # SIGXCPU after ~1 CPU-second: the shell reports 128+24, or we see the signal directly
    assert r.exit_code in (128 + signal.SIGXCPU, -signal.SIGXCPU) and not r.timed_out and dt < 9, (r, dt)


def test_sleep_hits_the_wall_clock_limit_and_background_jobs_die(sandbox, workdir):
    t0 = time.monotonic()
    r = run(sandbox, "sleep 1000", workdir, Limits(wall_s=1.0))
    assert r.timed_out and time.monotonic() - t0 < 5 and "wall-clock" in r.describe()
    r = run(sandbox, "(sleep 1000 &) ; setsid sleep 1001 & echo started", workdir)
    assert r.ok and "started" in r.output
    time.sleep(0.2)
    assert leftovers(workdir) == []


def test_huge_output_is_truncated_and_endless_output_killed(sandbox, workdir):
    r = run(sandbox, "head -c 100000 /dev/zero | tr '\\0' x", workdir)
    assert r.ok and r.output_truncated and len(r.output) == 4096 and r.output_bytes == 100000
    assert "[output truncated: 100000 bytes" in r.describe()
    t0 = time.monotonic()
    r = run(sandbox, "yes", workdir)
    assert r.output_killed and not r.timed_out and len(r.output) == 4096 and time.monotonic() - t0 < 4


def test_hidden_paths_are_invisible(sandbox, workdir):
    # /var/tmp: visible inside the sandbox unless hidden (unlike /tmp, which gets a tmpfs), so
    # the positive control below means something wherever the checkout lives.
    secret_dir = tempfile.mkdtemp(prefix="tg-secret-", dir="/var/tmp")
    try:
        Path(secret_dir, "answer.txt").write_text("SECRET-7319")
        os.chmod(secret_dir, 0o755)
        os.chmod(Path(secret_dir, "answer.txt"), 0o644)
        task_file = REPO / "megatron_tg" / "agent" / "data" / "tasks.jsonl"  # holds hidden tests
        sb = Sandbox("bwrap", limits=sandbox.limits, hide=[secret_dir, task_file])
        r = run(sb, f"ls {secret_dir}; cat {secret_dir}/answer.txt; "
                    f"grep -o hidden_test_command {task_file} | head -1", workdir)
        assert "SECRET-7319" not in r.output and "hidden_test_command" not in r.output, r.output
        r = run(sandbox, f"cat {secret_dir}/answer.txt; grep -o hidden_test_command {task_file} | head -1", workdir)
        assert "SECRET-7319" in r.output  # visible without hide
        if not str(REPO).startswith("/tmp/"):  # a checkout under /tmp is hidden by its tmpfs
            assert "hidden_test_command" in r.output
    finally:
        rmtree(secret_dir)


def test_unsandboxed_mode_needs_consent(monkeypatch):
    with pytest.raises(SandboxError, match="allow_unsandboxed"):
        Sandbox("none")
    monkeypatch.setattr("megatron_tg.agent.sandbox.bwrap_path", lambda: None)
    with pytest.raises(SandboxError, match="apt-get install -y bubblewrap"):
        Sandbox("bwrap")
    sb = Sandbox("bwrap", allow_unsandboxed=True, limits=Limits(wall_s=3))  # falls back, loudly
    assert sb.mode == "none"
    d = tempfile.mkdtemp()
    try:
        r = asyncio.run(sb.run("echo $HOME; pwd", d))
        assert r.ok and r.output.split() == [d, os.path.realpath(d)]
    finally:
        rmtree(d)
