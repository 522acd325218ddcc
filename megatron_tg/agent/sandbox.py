"""Running model-written commands: bubblewrap isolation plus resource limits.

Every command of a rollout runs as (unprivileged caller)::

    bwrap --unshare-all --die-with-parent --new-session --cap-drop ALL --clearenv
          --ro-bind /usr /usr --symlink usr/bin /bin ... --ro-bind-try /etc/FILE ... (system)
          --ro-bind PYTHON PYTHON (the interpreter's prefixes)  --tmpfs /tmp /run /var /home /root
          --bind WORKDIR WORKDIR --dev /dev --proc /proc --chdir WORKDIR --setenv ...
          -- prlimit --as --cpu --nproc --fsize --core=0 -- /bin/sh -c COMMAND

or, when we are root::

    bwrap --unshare-ipc --unshare-pid --unshare-net --unshare-uts ... (same mounts)
          -- setpriv --reuid U --regid U --clear-groups --bounding-set=-all -- prlimit ... sh -c

Why each piece:

* new network and pid namespaces: no network (only ``lo``) and no abstract unix socket of
  the host; when the command exits, bwrap (pid 1 there) exits and the kernel kills every
  process left behind, so background jobs cannot outlive the call.
* nothing of the host is visible unless bound: the root is an empty tmpfs holding read-only
  system directories (``/usr`` and its links, a short list of ``/etc`` files), the running
  Python's prefixes read-only, and the workspace. ``/tmp``, ``/run``, ``/var`` and the home
  directories are fresh, size-capped tmpfs, so no host socket file (a container runtime's,
  munge's, dbus') and no home directory (keys, tokens) or checkout (task files) is reachable.
* root: the kernel does not enforce ``RLIMIT_NPROC`` for uid 0 (nor for a user namespace's
  uid that maps to 0), so bwrap runs without a user namespace and the command drops to an
  unprivileged uid of its own (one per task directory; the directory is chowned to it).
* limits (:mod:`megatron_tg.agent.proc`): per-process rlimits plus one memory / process
  budget for the whole call and a workspace disk quota, a wall-clock timeout and an output
  cap.

``mode="none"`` runs the same ``prlimit ... sh -c`` directly in the task directory: no
network or filesystem isolation. It needs explicit consent (``allow_unsandboxed``) and logs
a warning, because model-written code then runs with our permissions.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import sys
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Sequence

from megatron_tg.agent.proc import ExecResult, Limits, execute, kill_group

log = logging.getLogger(__name__)

SANDBOX_MODES = ("bwrap", "none")
BWRAP_APT_HINT = "apt-get install -y bubblewrap   (Debian/Ubuntu; run apt-get update first if needed)"
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Top-level system directories: bound read-only when real, recreated as links when merged-usr.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# What programs read from /etc (the loader, users and groups for `id`/`ls -l`, time zone,
# Debian's alternatives links, public CA certificates, Python's site hooks); nothing secret.
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "passwd", "group", "nsswitch.conf", "hosts",
             "localtime", "timezone", "alternatives", "ssl/certs", "mime.types", "protocols", "services",
             "python3", "python3.11", "python3.12", "python3.13", "gitconfig")
# Fresh tmpfs: host content there (sockets, other users' files, homes) must not be reachable.
TMPFS_DIRS = ("/run", "/var", "/home", "/root", "/mnt", "/media", "/srv", "/opt")


class SandboxError(RuntimeError):
    """The sandbox cannot be used (bwrap missing or failing, no consent to run unsandboxed)."""


@dataclass(frozen=True)
class Bind:
    """An extra mount for one command (the grader's runner read-only, its report directory)."""
    src: str
    dest: str
    writable: bool = False


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


class Sandbox:
    """Runs shell commands in a task directory with isolation and limits (see module doc).

    ``hide``: host paths the sandbox must not see even though they lie under a bound path:
    directories are covered by an empty tmpfs, files by ``/dev/null``. ``expose``: host paths
    the sandbox needs to read; by default the running Python (so ``python`` and ``pytest``
    work inside).
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
        # Both the path as named and where it resolves to: a venv's bin/python is a link.
        paths = {os.path.abspath(p) for p in expose} | {os.path.realpath(p) for p in expose}
        self.expose = sorted(p for p in paths if not _under_system(p))
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
                        memory_mb=cfg.tool_memory_mb, max_procs=cfg.tool_max_procs, disk_mb=cfg.tool_disk_mb)
        return cls(cfg.sandbox, allow_unsandboxed=cfg.allow_unsandboxed, limits=limits, **kw)

    def for_task(self, task) -> "Sandbox":
        """The sandbox for one task's commands: its task file hidden too (it holds the hidden
        tests; it is not bound anyway unless it lies under an exposed path)."""
        return self.with_hidden([task.source]) if task.source else self

    def path_in(self, workdir: str | os.PathLike) -> str:
        """Where ``workdir`` is seen by the command (bwrap binds it at its own path)."""
        return os.path.abspath(workdir)

    def with_hidden(self, paths: Iterable[str | os.PathLike]) -> "Sandbox":
        """The same sandbox (limits, checks) that also hides ``paths``."""
        sb = copy_of(self)
        sb.hide = self.hide + [os.path.abspath(p) for p in paths]
        return sb

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

        def give(name, dir_fd=None) -> None:
            # A regular file with more than one link shares its inode with a name elsewhere
            # (possibly a host file): changing its owner would change that file's. Skipped.
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                    return
                os.chown(name, uid, uid, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                pass  # gone meanwhile (a sandboxed command may still be removing it)

        give(p)
        if p.is_dir() and not p.is_symlink():
            # Relative to each directory's descriptor: a tree nested past PATH_MAX (which a
            # sandboxed command can make) has names no path-based call can reach.
            try:
                for _, dirs, files, root_fd in os.fwalk(p, follow_symlinks=False):
                    for name in dirs + files:
                        give(name, root_fd)
            except RecursionError:
                pass  # nested deeper than the interpreter recurses: what is left is the policy's own

    # ------------------------------------------------------------------ command line
    def _prlimit(self, limits: Limits) -> list[str]:
        return [self.prlimit, f"--as={limits.memory_mb << 20}", f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
                f"--nproc={limits.max_procs}", f"--fsize={limits.max_file_mb << 20}", "--core=0", "--"]

    def _env(self, workdir: str) -> dict[str, str]:
        return {"PATH": f"{self.python_bin_dir}:{_SYSTEM_PATH}", "HOME": workdir, "TMPDIR": "/tmp",
                "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}

    def _system(self) -> list[str]:
        args: list[str] = []
        for d in SYSTEM_DIRS:
            if os.path.islink(d):
                args += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                args += ["--ro-bind", d, d]
        made = {"/etc"}
        args += ["--perms", "0755", "--dir", "/etc"]  # bwrap's own would be 0700
        for name in ETC_FILES:
            p = os.path.join("/etc", name)
            if os.path.lexists(p):
                if os.path.dirname(p) not in made:
                    args += ["--perms", "0755", "--dir", os.path.dirname(p)]
                    made.add(os.path.dirname(p))
                args += ["--ro-bind-try", p, p]
        return args

    def argv(self, command: str, workdir: str | os.PathLike, limits: Limits | None = None,
             binds: Sequence[Bind] = (), readonly_workdir: bool = False) -> list[str]:
        """The full command line (:meth:`run` executes it). ``readonly_workdir``: the task
        directory is mounted read-only (the grader's checkout)."""
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
        args += ["--die-with-parent", "--new-session", "--clearenv"] + self._system()
        args += ["--perms", "1777", "--size", str(self.tmp_mb << 20), "--tmpfs", "/tmp"]
        for d in TMPFS_DIRS:
            args += ["--perms", "0755", "--size", str(16 << 20), "--tmpfs", d]
        made: set[str] = set()
        mounts = [(p, p, False) for p in self.expose if os.path.exists(p)]
        mounts += [(b.src, b.dest, b.writable) for b in binds] + [(wd, wd, not readonly_workdir)]
        for src, dest, writable in mounts:
            # bwrap would create missing parents 0700 (untraversable by the dropped uid)
            for d in reversed(Path(dest).parents):
                if str(d) != "/" and str(d) not in made and not _under_system(str(d)):
                    args += ["--perms", "0755", "--dir", str(d)]
                    made.add(str(d))
            args += ["--bind" if writable else "--ro-bind", src, dest]
            made.add(dest)
        for h in self.hide:
            if os.path.isdir(h):
                args += ["--size", str(1 << 20), "--tmpfs", h]
            elif os.path.exists(h):
                args += ["--ro-bind", "/dev/null", h]
        # The grader's run (a read-only checkout) gets no /proc: the tested code shares the
        # runner's process, whose memory (/proc/self/mem: the nonce, the records' writer) and
        # descriptors are there for any route that opens them, a callback of C callables
        # included, which no audit attribution sees.
        args += ["--dev", "/dev"] + ([] if readonly_workdir else ["--proc", "/proc"]) + ["--chdir", wd]
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

    async def run(self, command: str, workdir: str | os.PathLike, limits: Limits | None = None, *,
                  binds: Sequence[Bind] = (), pass_fds: Sequence[int] = (),
                  readonly_workdir: bool = False) -> ExecResult:
        limits = limits or self.limits
        if not self._checked:
            await self.self_test(workdir)
        wd = os.path.abspath(workdir)
        return await execute(self.argv(command, wd, limits, binds, readonly_workdir), cwd=wd, env=self._exec_env(wd),
                             limits=limits, workdir=wd, pass_fds=pass_fds)

    def _exec_env(self, wd: str) -> dict[str, str]:
        return self._env(wd) if self.mode == "none" else {"PATH": _SYSTEM_PATH}

    async def self_test(self, workdir: str | os.PathLike) -> None:
        """Fail early and clearly if the sandbox cannot be built on this machine (e.g. user
        namespaces disabled), instead of every tool call returning bwrap's error to the model."""
        self._checked = True
        wd = os.path.abspath(workdir)
        lim = replace(self.limits, wall_s=30.0)
        res = await execute(self.argv("true", wd, lim), cwd=wd, env=self._exec_env(wd), limits=lim,
                            workdir=None)
        if res.exit_code != 0:
            self._checked = False
            raise SandboxError(f"the {self.mode} sandbox does not work on this machine "
                               f"(exit {res.exit_code}): {res.output.strip()[:500]}")
        # The grader runs pytest with this interpreter inside; say so now, with the fix, if the
        # sandbox user cannot reach it rather than grading every rollout FAIL.
        py = os.path.join(self.python_bin_dir, "python")
        res = await execute(self.argv(f"{py} -I -c 'import pytest'", wd, lim), cwd=wd, env=self._exec_env(wd),
                            limits=lim, workdir=None)
        if res.exit_code != 0:
            self._checked = False
            blocked = _untraversable(py, self.uid_for(wd))
            raise SandboxError(
                f"the sandbox cannot run {py} with pytest (exit {res.exit_code}): {res.output.strip()[-300:]}"
                + (f"; {blocked} is not traversable by the sandbox uid: `chmod o+x {blocked}` or install the "
                   "environment elsewhere" if blocked else "; install pytest into this environment "
                   "(it is a runtime dependency of grading)"))


def _untraversable(path: str, uid: int | None) -> str | None:
    """The first directory above ``path`` that ``uid`` (None: us) cannot traverse."""
    cur = "/"
    for part in Path(path).parts[1:-1]:
        cur = os.path.join(cur, part)
        try:
            st = os.stat(cur)
        except OSError:
            return cur
        if uid is not None and st.st_uid != uid and not st.st_mode & stat.S_IXOTH:
            return cur
    return None


def _under_system(p: str) -> bool:
    return any(p == d or p.startswith(d + "/") for d in SYSTEM_DIRS)


def copy_of(sb: "Sandbox") -> "Sandbox":
    import copy
    return copy.copy(sb)


def rmtree(path: str | os.PathLike) -> None:
    """Remove a workspace even if sandboxed code left unreadable / unwritable entries. The
    retry after an error never follows a link: ``chmod`` only acts on an entry ``lstat``
    shows to be a real directory or file (a link there would chmod the host file it names),
    and only inside ``path``: an error on ``path`` itself (a top directory that will not go)
    once made it chmod ``path``'s parent -- ``/tmp`` -- to 0700."""
    top = os.path.abspath(path)

    def inside(q: str) -> bool:
        q = os.path.abspath(q)
        return q == top or q.startswith(top + os.sep)

    def onerror(fn, p, exc):
        try:
            for q in (os.path.dirname(p), p):
                if not inside(q):
                    continue
                st = os.lstat(q)
                if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
                    os.chmod(q, 0o700)
            fn(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=onerror)


__all__ = ["BWRAP_APT_HINT", "Bind", "ExecResult", "Limits", "SANDBOX_MODES", "Sandbox", "SandboxError",
           "bwrap_path", "kill_group", "rmtree"]
