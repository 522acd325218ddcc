"""Signal dispositions for the trainer's helper processes; stdlib only.

Slurm delivers a step's signals (the time-limit warning, ``scancel --signal``, preemption's
SIGTERM) to every process of the step, not only to the trainer, whose contract is to finish
the step, checkpoint and exit 75. A long-lived helper that the checkpoint needs must ignore
them. Helpers are started with ``spawn``, which imports the initializer's module in the new
process: this one imports nothing heavy (no torch).
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def ignore_stop_signals() -> None:
    """Initializer for helper processes: SIGUSR1 and SIGTERM do nothing (process-wide)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
