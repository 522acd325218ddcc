"""Where rollouts' workspaces live, and removing those a dead run left behind.

Every process that creates workspaces gets one run directory ``tg-run-<pid>-<random>``
under the workspace root, holding an exclusive ``flock`` on its ``lock`` file for as long as
the process lives; workspaces are created inside it. The kernel drops the lock when the
process dies, however it dies (SIGKILL included), so at start any ``tg-run-*`` directory
whose lock can be taken belongs to a dead run and is removed. Locks, unlike pid files, are
not fooled by pid reuse.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from pathlib import Path

from megatron_tg.agent.sandbox import rmtree

log = logging.getLogger(__name__)
PREFIX = "tg-run-"


def reap(root: str | os.PathLike) -> list[str]:
    """Remove the run directories of dead runs under ``root``; returns what was removed."""
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for e in entries:
        if not e.name.startswith(PREFIX) or not e.is_dir(follow_symlinks=False):
            continue
        try:
            fd = os.open(os.path.join(e.path, "lock"), os.O_RDONLY)
        except FileNotFoundError:
            fd = None  # a run killed before it wrote its lock
        except OSError:
            continue
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # alive
        finally:
            if fd is not None:
                os.close(fd)
        rmtree(e.path)
        removed.append(e.path)
    if removed:
        log.info("removed %d workspace director%s of dead runs under %s", len(removed),
                 "y" if len(removed) == 1 else "ies", root)
    return removed


class WorkspacePool:
    """Creates workspaces in this process's run directory (made, and dead runs reaped, on
    first use; a forked child gets its own)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = os.path.abspath(root or tempfile.gettempdir())
        self._pid: int | None = None
        self._dir: Path | None = None
        self._lock_fd: int | None = None

    @property
    def run_dir(self) -> Path:
        if self._pid != os.getpid():
            os.makedirs(self.root, exist_ok=True)
            reap(self.root)
            d = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=self.root))
            os.chmod(d, 0o755)  # the sandbox uid must reach the workspaces inside (when root)
            fd = os.open(d / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._pid, self._dir, self._lock_fd = os.getpid(), d, fd
        return self._dir

    def new(self, prefix: str = "ws-") -> str:
        return tempfile.mkdtemp(prefix=prefix, dir=self.run_dir)

    def close(self) -> None:
        if self._dir is not None and self._pid == os.getpid():
            rmtree(self._dir)
            os.close(self._lock_fd)
            self._dir = self._pid = self._lock_fd = None
