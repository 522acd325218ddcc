"""Waiting on trainer processes in tests, so that a hang fails with its stacks.

A trainer installs a stack dump on SIGUSR2 (:func:`megatron_tg.train.signals.dump_stacks_on_signal`).
A test that only raises ``TimeoutExpired`` when a run outlives its wait shows nothing of
where it hung; this sends SIGUSR2 first, so every thread's stack lands in the run's log,
then kills the processes and fails with the log's tail.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Sequence


def wait_or_dump(procs: Sequence[subprocess.Popen], timeout: float,
                 tail: Callable[[], str] = lambda: "") -> list[int]:
    """The processes' exit codes, waiting at most ``timeout`` seconds for all of them. Past
    it, the live ones get SIGUSR2 (stack dump), then SIGKILL, and the test fails with
    ``tail()`` (the logs, read after the dump)."""
    import pytest

    deadline = time.monotonic() + timeout
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        live = [p for p in procs if p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGUSR2)
        time.sleep(3)  # faulthandler writes at once; this covers a loaded machine
        for p in live:
            p.kill()
            p.wait()
        pytest.fail(f"still running after {timeout} s; their stacks and logs:\n{tail()}")
    return codes
