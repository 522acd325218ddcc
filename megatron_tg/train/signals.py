"""Signal dispositions for the trainer's helper processes; stdlib only.

Slurm delivers a step's signals (the time-limit warning, ``scancel --signal``, preemption's
SIGTERM) to every process of the step, not only to the trainer, whose contract is to finish
the step, checkpoint and exit 75. A long-lived helper that the checkpoint needs must ignore
them. Helpers are started with ``spawn``, which imports the initializer's module in the new
process: this one imports nothing heavy (no torch).
"""

from __future__ import annotations

import faulthandler
import signal

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
#: ``kill -USR2 <pid>`` prints every thread's Python stack to the process's stderr and goes
#: on: how a hung rank (a collective one rank never reached, a lock) is diagnosed in place.
STACK_DUMP_SIGNAL = signal.SIGUSR2


def ignore_stop_signals() -> None:
    """Initializer for helper processes: SIGUSR1 and SIGTERM do nothing (process-wide)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def dump_stacks_on_signal() -> None:
    """Install the stack dump on :data:`STACK_DUMP_SIGNAL` (faulthandler, C level: it works
    while the main thread is blocked inside a collective or a lock)."""
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True, chain=False)
