"""The trainer's signal dispositions: SIGUSR2 prints every thread's stack and the process goes
on (how a hung rank is diagnosed in place); helpers ignore the stop signals."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

CHILD = """
import threading, time
from megatron_tg.train.signals import dump_stacks_on_signal, ignore_stop_signals
dump_stacks_on_signal()
ignore_stop_signals()
def parked_in_a_side_thread():
    time.sleep(60)
threading.Thread(target=parked_in_a_side_thread, daemon=True).start()
print("ready", flush=True)
def blocked_like_a_collective():
    time.sleep(2)
blocked_like_a_collective()
print("still alive", flush=True)
"""


def test_sigusr2_dumps_every_thread_and_the_process_goes_on():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    proc.send_signal(signal.SIGUSR2)
    proc.send_signal(signal.SIGUSR1)  # a stop signal: ignored by a helper
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "still alive" in out
    assert "blocked_like_a_collective" in err and "parked_in_a_side_thread" in err, err
