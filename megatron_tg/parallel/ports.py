"""Free TCP ports on this host, for process-group stores, engines and tests.

A port the OS picks with ``bind(0)`` comes from the kernel's ephemeral range, the same range
every outgoing connection takes its local port from. Between ``free_port`` returning and the
store binding it, any client connection on the host (an HTTP request to an engine, a gloo
pair) can be handed that very port, and the store fails with EADDRINUSE. That was measured:
a trainer's TCPStore failed on port 40945 in CI while engines and other tests were talking.
So the port is drawn below the ephemeral range, where the kernel never assigns one on its
own, at random (two callers rarely draw the same), and checked by binding it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default ephemeral range, where the file cannot be read.
_DEFAULT_EPHEMERAL = (32768, 60999)
# Below 10000 sit many well-known services; from 10000 to 21199 the tests' Slurm cluster and
# its jobs take fixed port ranges (tests/slurm/conftest.py), which a random draw must not hit
# before their servers bind; above that, up to the ephemeral range, the kernel assigns
# nothing by itself.
_LOW = 21200


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for automatically assigned local ports (inclusive)."""
    try:
        lo, hi = (int(x) for x in _RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # The same option TCPStore and HTTP servers set, so a port in TIME_WAIT after a
        # closed test server counts as free here exactly when it is free to them.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _candidates(lo: int, hi: int, rng: random.Random):
    """Non-ephemeral ports in random order: below the range, then above it."""
    below = range(_LOW, lo) if lo > _LOW else range(0)
    above = range(hi + 1, 65536)
    pool = [*below, *above]
    for _ in range(min(len(pool), 256)):
        yield pool[rng.randrange(len(pool))]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now and outside the ephemeral range, so no
    outgoing connection can take it before the caller binds it. Another ``free_port`` caller
    can still draw the same port (rarely: at random among about 20,000); callers that can
    retry should. Where no such port is free (a tiny or exotic range), the OS picks one."""
    lo, hi = ephemeral_range()
    rng = random.SystemRandom()
    for port in _candidates(lo, hi, rng):
        if _bindable(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
