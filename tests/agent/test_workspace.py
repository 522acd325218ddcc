"""Workspaces of a dead run are removed when the next run starts; a live run's are kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import megatron_tg
from megatron_tg.agent.workspace import WorkspacePool, reap

REPO = Path(megatron_tg.__file__).resolve().parent.parent
CHILD = ("import os, sys, time\n"
         "from megatron_tg.agent.workspace import WorkspacePool\n"
         "p = WorkspacePool(sys.argv[1])\n"
         "ws = p.new()\n"
         "open(os.path.join(ws, 'big.bin'), 'wb').write(b'x' * 4096)\n"
         "os.chmod(ws, 0o500)  # made hard to remove, as sandboxed code can\n"
         "print(ws, flush=True)\n"
         "time.sleep(60)\n")


def _start(root):
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(root)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    return p, Path(p.stdout.readline().strip())


def test_a_sigkilled_runs_workspaces_are_removed_at_the_next_start(tmp_path):
    """Issue #18 probe: a SIGKILLed trainer left its workspaces behind."""
    dead, dead_ws = _start(tmp_path)
    alive, alive_ws = _start(tmp_path)
    try:
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(10)
        assert dead_ws.is_dir() and alive_ws.is_dir()
        pool = WorkspacePool(tmp_path)
        mine = pool.new()  # first use: reaps
        assert not dead_ws.parent.exists(), "the dead run's directory is still there"
        assert alive_ws.is_dir()  # positive control: a live run keeps its workspaces
        assert Path(mine).is_dir() and reap(tmp_path) == []
        pool.close()
        assert not Path(mine).exists()
    finally:
        alive.kill()
        alive.wait(10)
    time.sleep(0.1)
    assert [Path(p).name for p in reap(tmp_path)] == [alive_ws.parent.name]  # now dead too
