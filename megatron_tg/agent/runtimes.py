"""The container runtimes of H100 Slurm clusters behind the :class:`Sandbox` interface, with
the task's per-instance image (SWE-bench, SWE-rebench, SWE-smith and R2E-Gym each publish
one per instance, with the repository's dependencies installed).

The workspace stays on the host (the file tools read it there) and is bind-mounted at
``/testbed``, where those images keep the repository; commands run there through the same
``prlimit ... /bin/sh -c`` as with bubblewrap (the images are Debian/Ubuntu based and ship
util-linux). Flags, as each runtime documents them:

* **apptainer** / **singularity** ``exec``: ``--containall`` (own pid and ipc namespaces,
  clean environment, minimal ``/dev``, empty ``/tmp`` and home: nothing of the host's
  filesystem but what is bound), ``--net --network none`` (loopback only; the network mode
  an unprivileged user may ask for), ``--writable-tmpfs`` (installs inside the image land in
  memory and vanish), ``--no-privs`` when started as root, ``--bind SRC:DST[:ro]``,
  ``--pwd``, ``--env``.
* **enroot** ``start``: ``--rw`` (a per-call writable root), ``--mount SRC:DST:none:bind[,ro]``
  (fstab fields, colon-separated), ``--env``. Enroot has no network namespace of its own: the
  command shares the node's network, so this mode needs the same explicit consent as running
  unsandboxed (``allow_unsandboxed``).
* **pyxis** (``srun`` with the pyxis plugin, one job step per call, inside the trainer's
  allocation): ``--container-image``, ``--container-mounts=SRC:DST[:ro],...``,
  ``--container-workdir``, ``--no-container-mount-home``, ``--container-writable``,
  ``--container-unshare=net,ipc,uts`` (pyxis 0.24 and later), ``--export=NONE`` and
  ``env -i`` (nothing of the caller's environment reaches the step).

Whole-call limits: the runtimes start their own process trees (apptainer's starter, srun's
step), so the tree watch counts the call's process group; memory and process rlimits still
apply to each process inside.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from typing import Iterable, Sequence

from megatron_tg.agent.proc import Limits
from megatron_tg.agent.sandbox import Bind, Sandbox, SandboxError

log = logging.getLogger(__name__)

RUNTIMES = ("apptainer", "enroot", "pyxis")
WORKDIR_IN = "/testbed"
# SWE-bench's images put the task environment's interpreter here; R2E-Gym's and SWE-smith's
# images use the same conda layout.
IMAGE_PATH = "/opt/miniconda3/envs/testbed/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_BINARIES = {"apptainer": ("apptainer", "singularity"), "enroot": ("enroot",), "pyxis": ("srun",)}


class ContainerSandbox(Sandbox):
    """A sandbox whose commands run in the task's image under a container runtime."""

    def __init__(self, runtime: str, *, image: str | None = None, binary: str | None = None,
                 limits: Limits | None = None, allow_unsandboxed: bool = False, image_path: str = IMAGE_PATH,
                 workdir_in: str = WORKDIR_IN, srun_args: Sequence[str] = ()):
        if runtime not in RUNTIMES:
            raise SandboxError(f"container runtime must be one of {RUNTIMES}, got {runtime!r}")
        if runtime == "enroot" and not allow_unsandboxed:
            raise SandboxError("enroot shares the node's network namespace with the command (it has no "
                               "option to unshare it); use apptainer or pyxis (--container-unshare), or accept "
                               "it with rollout.allow_unsandboxed=true")
        if binary is None:
            binary = next((shutil.which(b) for b in _BINARIES[runtime] if shutil.which(b)), None)
            if binary is None:
                raise SandboxError(f"rollout.sandbox={runtime!r}: none of {_BINARIES[runtime]} is on PATH")
        self.mode, self.runtime, self.binary, self.image = runtime, runtime, binary, image
        self.limits = limits or Limits()
        self.hide: list[str] = []
        self.expose: list[str] = []
        self.image_path, self.workdir_in, self.srun_args = image_path, workdir_in, list(srun_args)
        self.root = os.geteuid() == 0
        self.python_bin_dir = image_path.split(":", 1)[0]
        self.prlimit = "prlimit"  # the image's
        self.uid_base, self.uid_span, self.tmp_mb = 0, 1, 0
        self._checked = True  # each image is checked by its first command (its error is the observation)

    @classmethod
    def from_config(cls, cfg, **kw) -> "ContainerSandbox":
        limits = Limits(wall_s=cfg.tool_timeout_s, cpu_s=max(1, int(cfg.tool_timeout_s + 0.999)),
                        memory_mb=cfg.tool_memory_mb, max_procs=cfg.tool_max_procs, disk_mb=cfg.tool_disk_mb)
        return cls(cfg.sandbox, limits=limits, allow_unsandboxed=cfg.allow_unsandboxed, **kw)

    def for_task(self, task) -> "ContainerSandbox":
        if not task.image:
            raise SandboxError(f"task {task.id!r} has no image, which rollout.sandbox={self.runtime!r} needs")
        sb = self.with_hidden(())
        sb.image = task.image
        return sb

    @property
    def drops_uid(self) -> bool:
        return False  # the runtimes run the command as the caller (apptainer/enroot) or the job's user

    def path_in(self, workdir: str | os.PathLike) -> str:
        return self.workdir_in

    def with_hidden(self, paths: Iterable[str | os.PathLike]) -> "ContainerSandbox":
        import copy
        return copy.copy(self)  # nothing of the host is visible unless bound

    def _env(self, workdir: str) -> dict[str, str]:
        return {"PATH": self.image_path, "HOME": self.workdir_in, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
                "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}

    def argv(self, command: str, workdir: str | os.PathLike, limits: Limits | None = None,
             binds: Sequence[Bind] = ()) -> list[str]:
        if self.image is None:
            raise SandboxError("no image: use for_task(task) to get the task's container sandbox")
        limits = limits or self.limits
        wd = os.path.abspath(workdir)
        inner = self._prlimit(limits) + ["/bin/sh", "-c", command]
        mounts = [(wd, self.workdir_in, True)] + [(b.src, b.dest, b.writable) for b in binds]
        env = self._env(wd)
        if self.runtime == "apptainer":
            args = [self.binary, "exec", "--containall", "--net", "--network", "none", "--writable-tmpfs"]
            args += ["--no-privs"] if self.root else []
            for src, dest, rw in mounts:
                args += ["--bind", f"{src}:{dest}" + ("" if rw else ":ro")]
            args += ["--pwd", self.workdir_in]
            for k, v in env.items():
                args += ["--env", f"{k}={v}"]
            return args + [self.image] + inner
        if self.runtime == "enroot":
            args = [self.binary, "start", "--rw"]
            for src, dest, rw in mounts:
                args += ["--mount", f"{src}:{dest}:none:" + ("bind" if rw else "bind,ro")]
            for k, v in env.items():
                args += ["--env", f"{k}={v}"]
            # enroot has no working-directory option: the command changes into it first
            return args + [self.image, "/bin/sh", "-c", f'cd {self.workdir_in} && exec "$@"', "sh"] + inner
        name = "tg-" + hashlib.sha1(f"{self.image}\0{wd}".encode()).hexdigest()[:16]
        args = [self.binary, "--ntasks=1", "--nodes=1", "--overlap", f"--job-name={name}", *self.srun_args,
                f"--container-image={self.image}",
                "--container-mounts=" + ",".join(f"{s}:{d}" + ("" if rw else ":ro") for s, d, rw in mounts),
                f"--container-workdir={self.workdir_in}", "--no-container-mount-home", "--container-writable",
                "--container-unshare=net,ipc,uts", "--export=NONE"]
        return args + ["/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items())] + inner

    def _exec_env(self, wd: str) -> dict[str, str]:
        # The runtime itself needs the caller's environment (Slurm's job variables, apptainer's
        # cache settings); what reaches the command is only what argv sets.
        return dict(os.environ)

    async def self_test(self, workdir: str | os.PathLike) -> None:
        self._checked = True


def sandbox_from_config(cfg, **kw) -> Sandbox:
    """The sandbox ``rollout.sandbox`` names."""
    if cfg.sandbox in RUNTIMES:
        return ContainerSandbox.from_config(cfg)
    return Sandbox.from_config(cfg, **kw)


__all__ = ["ContainerSandbox", "IMAGE_PATH", "RUNTIMES", "WORKDIR_IN", "sandbox_from_config"]
