"""Running one sandboxed command: output capture, limits on the whole process tree, result.

Per-process rlimits (prlimit) alone let a command run ``max_procs`` processes of
``memory_mb`` each. The :class:`TreeWatch` here turns them into one budget for the whole
tool call: while the command runs it sums the resident memory and counts the processes of
the command's pid namespace (every process the sandbox started lives there and none can
leave it, unlike a process group or session) and kills the sandbox when either exceeds
its limit. It also measures the workspace's disk use and kills the call past its quota.
This is the fallback that works without a delegated cgroup (containers and Slurm steps
rarely give one); it polls, so a limit can be overshot for up to one poll interval (the
per-process rlimits still cap each process in between).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Sequence

POLL_S = 0.1  # one /proc scan per interval serves every call being watched
DISK_POLL_S = 1.0  # a directory walk; a big repository makes it the costly poll
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Limits:
    wall_s: float = 30.0
    """Wall-clock seconds before the whole sandbox is killed (catches sleeps and deadlocks)."""
    cpu_s: int = 30
    """CPU seconds per process (RLIMIT_CPU soft limit): a busy loop gets SIGXCPU (then SIGKILL
    one second later, the hard limit)."""
    memory_mb: int = 2048
    """Memory of the whole call: resident memory summed over all its processes (polled), and
    the address space of each one (RLIMIT_AS; Python raises MemoryError beyond it)."""
    max_procs: int = 64
    """Processes of the whole call (counted in its pid namespace; RLIMIT_NPROC backs it)."""
    max_file_mb: int = 64
    """Largest file a process may write (RLIMIT_FSIZE)."""
    disk_mb: int = 1024
    """Disk quota of the workspace (apparent sizes, so sparse files count in full): a call is
    killed past it, and a workspace over it is not graded."""
    max_output_bytes: int = 16384
    """Output (stdout+stderr, interleaved) kept for the observation; the rest is dropped."""
    kill_output_bytes: int = 8 << 20
    """A command that prints more than this in total is killed (it would only burn CPU)."""


@dataclass
class ExecResult:
    exit_code: int | None
    """The command's exit status; negative = killed by that signal; None if never started."""
    output: str
    timed_out: bool = False
    output_truncated: bool = False
    output_killed: bool = False
    output_bytes: int = 0
    duration_s: float = 0.0
    limit_killed: str | None = None
    """Why the tree watch killed the call ("memory", "processes", "disk"), if it did."""
    peak_rss_mb: float = 0.0
    peak_procs: int = 0

    @property
    def ok(self) -> bool:
        return (self.exit_code == 0 and not self.timed_out and not self.output_killed
                and self.limit_killed is None)

    def describe(self) -> str:
        """The observation the agent sees."""
        head = f"exit code: {self.exit_code}"
        if self.timed_out:
            head = f"killed: wall-clock limit reached after {self.duration_s:.1f} s"
        elif self.output_killed:
            head = f"killed: output exceeded the limit ({self.output_bytes} bytes)"
        elif self.limit_killed:
            head = f"killed: {self.limit_killed} limit of the whole command exceeded"
        elif self.exit_code is not None and (self.exit_code < 0 or 128 < self.exit_code < 160):
            # < 0: we saw the signal; 129..159: the shell reports its child's signal as 128+N
            try:
                name = signal.Signals(abs(self.exit_code) % 128).name
            except ValueError:
                name = str(abs(self.exit_code) % 128)
            why = {"SIGXCPU": "CPU time limit", "SIGKILL": "killed", "SIGXFSZ": "file size limit"}.get(name)
            head += f" (signal {name}" + (f": {why})" if why else ")")
        out = self.output
        if self.output_truncated:
            out += f"\n[output truncated: {self.output_bytes} bytes in total]"
        return f"{head}\n{out}" if out else head


def disk_usage_bytes(root: str | os.PathLike) -> int:
    """Bytes under ``root``: the larger of each entry's apparent size and its allocated
    blocks, so a sparse file counts what a copy of it would write (links not followed)."""
    total = 0
    stack = [os.fspath(root)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += max(st.st_blocks * 512, st.st_size if not e.is_dir(follow_symlinks=False) else 0)
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
        except OSError:
            continue
    return total


class TreeWatch:
    """Polls the pid namespace of a sandbox whose outermost process is ``pid``."""

    def __init__(self, pid: int, limits: Limits, workdir: str | None):
        self.pid, self.limits, self.workdir = pid, limits, workdir
        self.peak_rss = 0
        self.peak_procs = 0

    def _members(self) -> list[int]:
        # The call's processes are the runtime's descendants: in a pid namespace an orphan is
        # re-parented to the namespace's init, itself a child of bwrap, so nothing escapes the
        # walk (without a namespace, "none" mode, a double fork can).
        children: dict[int, list[int]] = {}
        for pid, ppid in _parents().items():
            children.setdefault(ppid, []).append(pid)
        out, todo = [], list(children.get(self.pid, []))
        while todo:
            p = todo.pop()
            out.append(p)
            todo += children.get(p, [])
        return out

    def check(self, disk: bool) -> str | None:
        members = self._members()
        rss = sum(_rss(p) for p in members)
        self.peak_rss, self.peak_procs = max(self.peak_rss, rss), max(self.peak_procs, len(members))
        if rss > self.limits.memory_mb << 20:
            return "memory"
        if len(members) > self.limits.max_procs:
            return "processes"
        if disk and self.workdir and disk_usage_bytes(self.workdir) > self.limits.disk_mb << 20:
            return "disk"
        return None


_snapshot_lock = threading.Lock()
_snapshot: tuple[float, dict[int, int]] = (0.0, {})


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process, from one /proc scan shared by all the calls
    watched at the same time (at most one scan per poll interval)."""
    global _snapshot
    with _snapshot_lock:
        t, snap = _snapshot
        if time.monotonic() - t < POLL_S / 2:
            return snap
        snap = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                s = _read(f"/proc/{name}/stat")
                if s and ")" in s:
                    fields = s[s.rindex(")") + 2:].split()  # comm may hold spaces and parentheses
                    if len(fields) > 1:
                        snap[int(name)] = int(fields[1])
        _snapshot = (time.monotonic(), snap)
        return snap


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("ascii", "replace")
    except OSError:
        return None


def _rss(pid: int) -> int:
    s = _read(f"/proc/{pid}/statm")
    try:
        return int(s.split()[1]) * _PAGE if s else 0
    except (IndexError, ValueError):
        return 0


def kill_group(proc) -> None:
    # The whole process group: in "none" mode the command's children are in it; with bwrap,
    # killing bwrap tears down its pid namespace (and --die-with-parent covers the rest).
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass


async def execute(argv: Sequence[str], *, cwd: str, env: dict[str, str], limits: Limits,
                  workdir: str | None, pass_fds: Sequence[int] = ()) -> ExecResult:
    """Run ``argv``, capture its output within the limits, watch its process tree."""
    t0 = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, pass_fds=tuple(pass_fds))
    except OSError as e:
        return ExecResult(None, f"could not start the command: {e}", duration_s=time.monotonic() - t0)
    kept = bytearray()
    total = 0
    killed_for_output = False
    killed_for: list[str] = []
    watch = TreeWatch(proc.pid, limits, workdir)

    async def pump():
        nonlocal total, killed_for_output
        while True:
            chunk = await proc.stdout.read(65536)
            if not chunk:
                return
            total += len(chunk)
            if len(kept) < limits.max_output_bytes:
                kept.extend(chunk[: limits.max_output_bytes - len(kept)])
            if total > limits.kill_output_bytes and not killed_for_output:
                killed_for_output = True
                kill_group(proc)

    async def police():
        last_disk = 0.0
        while proc.returncode is None:
            now = time.monotonic()
            disk = now - last_disk >= DISK_POLL_S
            last_disk = now if disk else last_disk
            why = await asyncio.to_thread(watch.check, disk)
            if why:
                killed_for.append(why)
                kill_group(proc)
                return
            await asyncio.sleep(POLL_S)

    timed_out = False
    watcher = asyncio.ensure_future(police())
    try:
        await asyncio.wait_for(asyncio.gather(pump(), proc.wait()), timeout=limits.wall_s)
    except asyncio.TimeoutError:
        timed_out = True
        kill_group(proc)
    finally:
        if proc.returncode is None:
            kill_group(proc)
            await proc.wait()
        watcher.cancel()
        try:
            await watcher
        except asyncio.CancelledError:
            pass
    if not killed_for and workdir and disk_usage_bytes(workdir) > limits.disk_mb << 20:
        killed_for.append("disk")  # written faster than the poll saw
    return ExecResult(
        exit_code=proc.returncode, output=kept.decode("utf-8", errors="replace"), timed_out=timed_out,
        output_truncated=total > len(kept), output_killed=killed_for_output, output_bytes=total,
        duration_s=time.monotonic() - t0, limit_killed=killed_for[0] if killed_for else None,
        peak_rss_mb=watch.peak_rss / 2**20, peak_procs=watch.peak_procs)
