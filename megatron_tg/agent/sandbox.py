"""Running model-written commands: bubblewrap isolation plus resource limits.

Every command of a rollout runs as (unprivileged caller)::

    bwrap --unshare-all --die-with-parent --new-session --cap-drop ALL --clearenv
          --ro-bind / / --tmpfs /tmp [--tmpfs/--ro-bind-dev-null HIDDEN ...]
          --bind WORKDIR WORKDIR --dev /dev --proc /proc --chdir WORKDIR --setenv ...
          -- prlimit --as --cpu --nproc --fsize --core=0 -- /bin/sh -c COMMAND

or, when we are root::

    bwrap --unshare-ipc --unshare-pid --unshare-net --unshare-uts ... (same mounts)
          [--tmpfs /root --dir ... --ro-bind PYTHON PYTHON]
          -- setpriv --reuid U --regid U --clear-groups --bounding-set=-all -- prlimit ... sh -c

Why each piece:

* new network and pid namespaces: no network (only ``lo``); when the command exits, bwrap
  (pid 1 there) exits and the kernel kills every process left behind, so background jobs
  (``sleep 1000 &``) cannot outlive the call. ``--die-with-parent`` does the same when we kill
  bwrap on a timeout.
* ``--ro-bind / /`` + ``--bind WORKDIR``: the only writable places are the task directory and
  a private, size-capped ``/tmp`` that vanishes with the sandbox.
* root: the kernel does not enforce ``RLIMIT_NPROC`` for uid 0 (nor for a user namespace's
  uid that maps to 0), so a fork bomb could exhaust the machine's pids. bwrap therefore runs
  without a user namespace and the command drops to an unprivileged uid of its own (one per
  task directory, so concurrent rollouts do not share a process budget; the directory is
  chowned to it). That uid cannot traverse e.g. ``/root`` (mode 0700), which may hold the
  Python we need (pyenv): such directories are covered with a tmpfs and only the needed path
  is bound back, read-only, which also hides the rest of them.
* ``prlimit``: address space (memory hog -> MemoryError / failed mmap), CPU seconds (busy loop
  -> SIGXCPU), processes (fork bomb -> fork fails), file size, no core dumps. A wall-clock
  timeout (SIGKILL to bwrap) backs all of them up; output beyond a cap is dropped, and a
  command that keeps printing far beyond it is killed.

``mode="none"`` runs the same ``prlimit ... sh -c`` directly in the task directory: no
network or filesystem isolation. It needs explicit consent (``allow_unsandboxed``) and logs
a warning, because model-written code then runs with our permissions.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Sequence

log = logging.getLogger(__name__)

SANDBOX_MODES = ("bwrap", "none")
BWRAP_APT_HINT = "apt-get install -y bubblewrap   (Debian/Ubuntu; run apt-get update first if needed)"
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class SandboxError(RuntimeError):
    """The sandbox cannot be used (bwrap missing or failing, no consent to run unsandboxed)."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 30.0
    """Wall-clock seconds before the whole sandbox is killed (catches sleeps and deadlocks)."""
    cpu_s: int = 30
    """CPU seconds per process (RLIMIT_CPU soft limit): a busy loop gets SIGXCPU (then SIGKILL
    one second later, the hard limit)."""
    memory_mb: int = 2048
    """Address space per process (RLIMIT_AS); Python raises MemoryError beyond it."""
    max_procs: int = 64
    """Processes of the sandbox user (RLIMIT_NPROC): bounds a fork bomb."""
    max_file_mb: int = 64
    """Largest file a process may write (RLIMIT_FSIZE)."""
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

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_killed

    def describe(self) -> str:
        """The observation the agent sees."""
        head = f"exit code: {self.exit_code}"
        if self.timed_out:
            head = f"killed: wall-clock limit reached after {self.duration_s:.1f} s"
        elif self.output_killed:
            head = f"killed: output exceeded the limit ({self.output_bytes} bytes)"
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


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


class Sandbox:
    """Runs shell commands in a task directory with isolation and limits (see module doc).

    ``hide``: host paths the sandbox must not see (e.g. the task file holding hidden tests):
    directories are covered by an empty tmpfs, files by ``/dev/null``. ``expose``: host paths
    the sandbox needs to read; by default the running Python (so ``python`` and ``pytest`` work
    inside) — only matters when we are root and the command drops to another uid.
    """

    def __init__(self, mode: str = "bwrap", *, allow_unsandboxed: bool = False, limits: Limits | None = None,
                 hide: Iterable[str | os.PathLike] = (), expose: Iterable[str | os.PathLike] | None = None,
                 uid_base: int = 300000, uid_span: int = 100000, tmp_mb: int = 256,
                 python_bin_dir: str | None = None):
        if mode not in SANDBOX_MODES:
            raise SandboxError(f"sandbox mode must be one of {SANDBOX_MODES}, got {mode!r}")
        self.limits = limits or Limits()
        self.hide = [os.path.abspath(p) for p in hide]
        # The interpreter's own bin dir (a venv's, unresolved) goes first in PATH, so
        # `python` / `pytest` inside are the ones this process runs with.
        self.python_bin_dir = python_bin_dir or os.path.dirname(os.path.abspath(sys.executable))
        if expose is None:
            expose = {sys.prefix, sys.base_prefix, sys.exec_prefix,
                      os.path.dirname(os.path.realpath(sys.executable)), self.python_bin_dir}
        self.expose = sorted({os.path.realpath(p) for p in expose})
        self.uid_base, self.uid_span, self.tmp_mb = uid_base, uid_span, tmp_mb
        self.prlimit = shutil.which("prlimit")
        if self.prlimit is None:
            raise SandboxError("prlimit (util-linux) not found: resource limits cannot be applied")
        self.root = os.geteuid() == 0
        if mode == "bwrap":
            self.bwrap = bwrap_path()
            if self.bwrap is None:
                if not allow_unsandboxed:
                    raise SandboxError(
                        "bubblewrap (bwrap) is not installed, and tool calls run model-written code. "
                        f"Install it: {BWRAP_APT_HINT}; or accept the weaker unsandboxed mode with "
                        "rollout.allow_unsandboxed=true.")
                mode = "none"
            elif self.root and shutil.which("setpriv") is None:
                raise SandboxError("running as root needs setpriv (util-linux) to drop to an "
                                   "unprivileged uid inside the sandbox")
        if mode == "none":
            if not allow_unsandboxed:
                raise SandboxError("sandbox mode 'none' runs model-written code unconfined; it needs "
                                   "allow_unsandboxed=True (rollout.allow_unsandboxed)")
            log.warning("UNSANDBOXED tool execution: commands run as this user with network and full "
                        "filesystem access; only resource limits (prlimit) and timeouts apply. This is "
                        "much weaker than bubblewrap (%s).", BWRAP_APT_HINT)
        self.mode = mode
        self._checked = False

    @classmethod
    def from_config(cls, cfg, **kw) -> "Sandbox":
        """From a :class:`~megatron_tg.config.rollout.RolloutConfig`."""
        limits = Limits(wall_s=cfg.tool_timeout_s, cpu_s=max(1, int(cfg.tool_timeout_s + 0.999)),
                        memory_mb=cfg.tool_memory_mb, max_procs=cfg.tool_max_procs)
        return cls(cfg.sandbox, allow_unsandboxed=cfg.allow_unsandboxed, limits=limits, **kw)

    # ------------------------------------------------------------------ uid per task directory
    @property
    def drops_uid(self) -> bool:
        return self.mode == "bwrap" and self.root

    def uid_for(self, workdir: str | os.PathLike) -> int | None:
        """The uid commands in ``workdir`` run as (root only; stable per directory)."""
        if not self.drops_uid:
            return None
        return self.uid_base + zlib.crc32(os.path.realpath(workdir).encode()) % self.uid_span

    def adopt(self, path: str | os.PathLike, workdir: str | os.PathLike) -> None:
        """Give ``path`` (and everything under it) to ``workdir``'s sandbox uid, so commands
        there can change what our own tools created. No-op unless we drop to another uid."""
        uid = self.uid_for(workdir)
        if uid is None:
            return
        p = Path(path)
        os.chown(p, uid, uid, follow_symlinks=False)
        if p.is_dir() and not p.is_symlink():
            for root, dirs, files in os.walk(p):
                for name in dirs + files:
                    os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)

    # ------------------------------------------------------------------ command line
    def _prlimit(self, limits: Limits) -> list[str]:
        return [self.prlimit, f"--as={limits.memory_mb << 20}", f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
                f"--nproc={limits.max_procs}", f"--fsize={limits.max_file_mb << 20}", "--core=0", "--"]

    def _env(self, workdir: str) -> dict[str, str]:
        return {"PATH": f"{self.python_bin_dir}:{_SYSTEM_PATH}", "HOME": workdir, "TMPDIR": "/tmp",
                "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}

    def _reexpose(self, paths: Sequence[str]) -> list[str]:
        """Paths under a directory other users cannot traverse: cover that directory with a
        tmpfs, recreate the way down (mode 0755) and bind the paths back read-only."""
        groups: dict[str, list[str]] = {}
        for p in paths:
            parts = Path(p).parts
            for i in range(2, len(parts)):
                anc = os.path.join(*parts[:i])
                try:
                    mode = os.stat(anc).st_mode
                except OSError:
                    break
                if not mode & stat.S_IXOTH:
                    groups.setdefault(anc, []).append(p)
                    break
        args: list[str] = []
        for anc in sorted(groups):
            args += ["--perms", "0755", "--size", str(1 << 20), "--tmpfs", anc]
            made = {anc}
            wanted = sorted(set(groups[anc]))
            for p in wanted:
                if not os.path.exists(p) or any(Path(q) in Path(p).parents for q in wanted):
                    continue  # missing, or inside another bound path
                for d in reversed(Path(p).parents):
                    if str(d) not in made and Path(anc) in d.parents:
                        args += ["--perms", "0755", "--dir", str(d)]
                        made.add(str(d))
                args += ["--ro-bind", p, p]
        return args

    def argv(self, command: str, workdir: str | os.PathLike, limits: Limits | None = None) -> list[str]:
        """The full command line (:meth:`run` executes it)."""
        limits = limits or self.limits
        wd = os.path.abspath(workdir)
        inner = self._prlimit(limits) + ["/bin/sh", "-c", command]
        if self.mode == "none":
            return inner
        args = [self.bwrap]
        if self.root:  # no user namespace: its uid 0 would map to real root (see module doc)
            args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        else:
            args += ["--unshare-all", "--cap-drop", "ALL"]
        args += ["--die-with-parent", "--new-session", "--clearenv", "--ro-bind", "/", "/",
                 "--perms", "1777", "--size", str(self.tmp_mb << 20), "--tmpfs", "/tmp"]
        # The tmpfs on /tmp hides whatever the host has there, the running Python's venv
        # included when the checkout lives under /tmp (as CI clones may): bind it back.
        # Its parents are recreated traversable (bwrap would make them 0700, unreadable to the
        # unprivileged uid commands run as).
        made: set[str] = set()
        for p in self.expose:
            if p.startswith("/tmp/") and os.path.exists(p):
                for d in reversed(Path(p).parents):
                    if str(d).startswith("/tmp/") and str(d) not in made:
                        args += ["--perms", "0755", "--dir", str(d)]
                        made.add(str(d))
                args += ["--ro-bind", p, p]
                made.add(p)
        if self.root:
            args += self._reexpose(self.expose + ([] if wd.startswith("/tmp/") else [wd]))
        for h in self.hide:
            if os.path.isdir(h):
                args += ["--size", str(1 << 20), "--tmpfs", h]
            elif os.path.exists(h):
                args += ["--ro-bind", "/dev/null", h]
        args += ["--bind", wd, wd, "--dev", "/dev", "--proc", "/proc", "--chdir", wd]
        for k, v in self._env(wd).items():
            args += ["--setenv", k, v]
        args.append("--")
        if self.root:
            uid = self.uid_for(wd)
            args += [shutil.which("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                     "--bounding-set=-all", "--inh-caps=-all", "--"]
        return args + inner

    # ------------------------------------------------------------------ running
    @property
    def checked(self) -> bool:
        return self._checked

    async def run(self, command: str, workdir: str | os.PathLike, limits: Limits | None = None) -> ExecResult:
        limits = limits or self.limits
        if not self._checked:
            await self.self_test(workdir)
        return await self._exec(self.argv(command, workdir, limits), os.path.abspath(workdir), limits)

    async def self_test(self, workdir: str | os.PathLike) -> None:
        """Fail early and clearly if the sandbox cannot be built on this machine (e.g. user
        namespaces disabled), instead of every tool call returning bwrap's error to the model."""
        self._checked = True
        res = await self._exec(self.argv("true", workdir, self.limits), os.path.abspath(workdir),
                               replace(self.limits, wall_s=30.0))
        if res.exit_code != 0:
            self._checked = False
            raise SandboxError(f"the {self.mode} sandbox does not work on this machine "
                               f"(exit {res.exit_code}): {res.output.strip()[:500]}")

    async def _exec(self, argv: list[str], workdir: str, limits: Limits) -> ExecResult:
        t0 = time.monotonic()
        env = self._env(workdir) if self.mode == "none" else {"PATH": _SYSTEM_PATH}
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True)  # own group: killable as a whole
        except OSError as e:
            return ExecResult(None, f"could not start the command: {e}", duration_s=time.monotonic() - t0)
        kept = bytearray()
        total = 0
        killed_for_output = False

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
                    _kill(proc)

        timed_out = False
        try:
            await asyncio.wait_for(asyncio.gather(pump(), proc.wait()), timeout=limits.wall_s)
        except asyncio.TimeoutError:
            timed_out = True
            _kill(proc)
        finally:
            if proc.returncode is None:
                _kill(proc)
                await proc.wait()
        return ExecResult(
            exit_code=proc.returncode, output=kept.decode("utf-8", errors="replace"), timed_out=timed_out,
            output_truncated=total > len(kept), output_killed=killed_for_output, output_bytes=total,
            duration_s=time.monotonic() - t0)


def _kill(proc) -> None:
    # The whole process group: in "none" mode the command's children are in it; with bwrap,
    # killing bwrap tears down its pid namespace (and --die-with-parent covers the rest).
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass


def rmtree(path: str | os.PathLike) -> None:
    """Remove a workspace even if sandboxed code left unreadable / unwritable entries."""
    def onerror(fn, p, exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            fn(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=onerror)
