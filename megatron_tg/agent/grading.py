"""Grading a policy's change so that the policy cannot influence the verdict.

The rule (docs/grading.md has the threat model): the verdict is decided by code the
solution cannot reach, from evidence it cannot forge, and a solution that tries is graded
FAIL with the reason recorded. A task passes only if every required test (its
``fail_to_pass`` and ``pass_to_pass``) ran and passed and nothing was flagged:

1. **a diff, not a workspace** (:mod:`megatron_tg.agent.changes`): the policy's change is
   read from the workspace without following anything, bounded and text-only (links,
   devices, FIFOs, sockets, binary or oversized files: FAIL with the path named), and
   applied to a fresh pristine checkout of the task. Changes to the task's test support
   (hidden tests, every test file and test directory, ``conftest.py``, interpreter start-up
   hooks) are dropped and listed: those files always come from the pristine source.
2. **a read-only tree**: the graded checkout is mounted read-only in a fresh sandbox (and,
   as root, owned by root), so the solution cannot rewrite a test or leave a file for later;
   the hidden Python test files are stubs there, their sources sent to the runner through a
   pipe (:mod:`megatron_tg.agent.grading_sources`), so no read from disk finds them.
3. **the runner** (:mod:`megatron_tg.agent.grading_runner`) runs pytest with
   ``--import-mode=importlib``, the task's roots appended after the standard library and
   pytest, no user site; an audit hook and namespace checks flag tampering in-process.
4. **evidence after death**: results and flags go, with a per-run nonce, to a pipe this
   process reads only after the sandbox's pid namespace is gone (every process the
   solution started is dead by then), and a record without the nonce fails the grade.
5. :meth:`Grader.grade` does not raise on anything a workspace can hold: it returns a FAIL
   with the reason. Only a broken sandbox (:class:`SandboxError`) propagates.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import logging
import os
import secrets
import select
import shutil
import tempfile
import threading
import time
from pathlib import Path

from megatron_tg.agent import grading_calls
from megatron_tg.agent.changes import Refused, extract
from megatron_tg.agent.grading_checkout import (MAX_FILES, PREPARE_S, apply_changes, canary, grading_files,
                                                is_test_support)
from megatron_tg.agent.grading_sources import STUB
from megatron_tg.agent.grading_verdict import GradeResult, verdict
from megatron_tg.agent.proc import Limits
from megatron_tg.agent.sandbox import Bind, Sandbox, SandboxError, rmtree
from megatron_tg.agent.tasks import Task, materialize, write_files

log = logging.getLogger(__name__)
RUNNER = Path(__file__).with_name("grading_runner.py")
# The runner's files as the sandbox sees them (its directory, read-only): the entry point is
# run.py, the modules it loads from beside itself keep their names.
RUNNER_FILES = {"run.py": RUNNER, **{name: RUNNER.with_name(name) for name in (
    "grading_asserts.py", "grading_attribution.py", "grading_equality.py", "grading_hook.py", "grading_items.py",
    "grading_namespaces.py", "grading_sources.py")}}
EVIDENCE_REPLACED = 3  # the runner's exit status when the evidence pipe was not the one it was given
FLAGS_EXHAUSTED = 4  # the runner's exit status when a flag came past its budget of distinct flags
GRADER_INI = "[pytest]\naddopts =\n"
MAX_EVIDENCE_BYTES = 16 << 20


class Grader:
    """Grades policies' changes in fresh sandboxes (one per grading, nothing shared)."""

    def __init__(self, sandbox: Sandbox, limits: Limits, workspace_root: str | None = None):
        self.sandbox, self.limits, self.workspace_root = sandbox, limits, workspace_root
        raise_open_file_limit()

    async def grade(self, task: Task, workspace: str | os.PathLike) -> GradeResult:
        missing = {t: "missing" for t in task.required_tests}
        base = None
        try:
            base = Path(tempfile.mkdtemp(prefix="tg-grade-", dir=self.workspace_root))
            return await self._grade(task, Path(workspace), base, missing)
        except SandboxError:
            raise  # the machine, not the policy: every grade would be wrong
        except Refused as e:
            return GradeResult(False, missing, f"not graded: {e}")
        except Exception as e:  # never drop a rollout (or its GRPO group) on a grader error
            log.exception("grading %s failed", task.id)
            return GradeResult(False, missing, f"the grader failed on this workspace: {type(e).__name__}: {e}")
        finally:
            if base is not None:
                await asyncio.to_thread(rmtree, base)

    def _prepare(self, task: Task, workspace: Path, base: Path) -> tuple[Path, list[str], dict, list]:
        orig, ev, grader = base / "orig", base / "ws", base / "grader"
        for d in (orig, grader):
            d.mkdir()
        materialize(task, orig)
        changes = extract(workspace, orig, max_bytes=self.limits.disk_mb << 20, max_files=MAX_FILES,
                          deadline=time.monotonic() + PREPARE_S)
        files = grading_files(task)
        keep = frozenset(files)
        shutil.copytree(orig, ev, symlinks=True)
        ignored = apply_changes(ev, changes, keep)
        test_dirs = sorted({os.path.dirname(t.split("::", 1)[0]) for t in task.required_tests})
        canaries = []
        for d in test_dirs:
            body, ok, bad = canary(secrets.token_hex(4))
            rel = os.path.join(d, f"test_{secrets.token_hex(5)}.py")
            files[rel] = body
            canaries.append((rel, ok, bad))
        # The hidden Python files are served to the runner from memory (grading_sources): on
        # disk, where the tested code could read them, each is a stub.
        served = {rel: text for rel, text in files.items() if rel.endswith(".py")}
        write_files(ev, {rel: STUB if rel in served else text for rel, text in files.items()})
        protected = []
        for root, dirs, names in os.walk(ev):  # our own tree: readable, not writable, by the sandbox uid
            for n in dirs:
                os.chmod(os.path.join(root, n), 0o755)
            for n in names:
                p = os.path.join(root, n)
                if is_test_support(os.path.relpath(p, ev), frozenset(files)):
                    protected.append(os.path.relpath(p, ev))
                if not os.path.islink(p):
                    os.chmod(p, 0o644)
        solution = [p for p in changes.written if not is_test_support(p, keep)]
        for name, src in RUNNER_FILES.items():
            shutil.copyfile(src, grader / name)
        (grader / "pytest.ini").write_text(GRADER_INI)
        for d in (grader, base, ev):
            os.chmod(d, 0o755)
        return ev, ignored, {"protected": protected, "solution": solution, "served": served}, canaries

    async def _grade(self, task: Task, workspace: Path, base: Path, missing: dict) -> GradeResult:
        if task.grading == "calls":
            return await grading_calls.run(self.sandbox, self.limits, task, workspace, base)
        ev, ignored, paths, canaries = await asyncio.to_thread(self._prepare, task, workspace, base)
        grader = base / "grader"
        ev_in = self.sandbox.path_in(ev)  # where the command sees the checkout
        isolated = self.sandbox.mode != "none"
        g_dir = "/tg-grader" if isolated else str(grader)
        test_files = sorted({t.split("::", 1)[0] for t in task.required_tests} | {c[0] for c in canaries})
        nonce = secrets.token_hex(16)
        ev_r, ev_w = os.pipe()
        key_r, key_w = os.pipe()
        initpaths = set(test_files)
        key = (nonce + "\n" + json.dumps({os.path.join(ev_in, rel): [text, rewritten_by_pytest(rel, initpaths)]
                                          for rel, text in paths["served"].items()})).encode()
        # Written while the runner reads it (the sources can be larger than a pipe holds); a
        # runner that never reads it gets the writer an EPIPE once our read end is closed.
        writer = asyncio.ensure_future(asyncio.to_thread(_write_all, key_w, key))
        cfg = {"evidence_fd": ev_w, "nonce_fd": key_r, "workspace": ev_in, "roots": [
            os.path.normpath(os.path.join(ev_in, p)) for p in task.pythonpath],
            "solution_files": paths["solution"], "protected_files": paths["protected"],
            "pytest_args": ["-c", f"{g_dir}/pytest.ini", f"--rootdir={ev_in}", "-p", "no:cacheprovider",
                            "--import-mode=importlib", "-q", "-o", "console_output_style=classic", *test_files]}
        (grader / "config.json").write_text(json.dumps(cfg))
        cmd = f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 exec python -I -B {g_dir}/run.py {g_dir}/config.json"
        stop_reading = threading.Event()
        reader = asyncio.ensure_future(asyncio.to_thread(_drain, ev_r, stop_reading))
        try:
            res = await self.sandbox.run(cmd, ev, self.limits, pass_fds=[ev_w, key_r], readonly_workdir=True,
                                         binds=[Bind(str(grader), g_dir)] if isolated else [])
        finally:
            os.close(ev_w)  # the sandbox is gone: with our end closed the reader sees EOF
            os.close(key_r)
            try:
                data = await asyncio.wait_for(asyncio.shield(reader), timeout=10)
                await asyncio.wait_for(writer, timeout=10)
            except asyncio.TimeoutError:  # a process outside any namespace ("none" mode) holds it
                data = None
                # the reader must leave its read before the descriptor is closed (a blocked
                # read would hold the process at exit, and the number could be reused)
                stop_reading.set()
                await reader  # shielded above: this waits for the thread itself
            os.close(ev_r)
        if res.exit_code == EVIDENCE_REPLACED:
            return GradeResult(False, missing, "the test run's evidence pipe was replaced (its descriptor pointed "
                               "elsewhere: the records would have gone where the grader does not read)",
                               res.describe(), [], ignored)
        if res.exit_code == FLAGS_EXHAUSTED:
            return GradeResult(False, missing, "tampering detected: more flags than the runner records (it stopped "
                               "at the first one past its budget)", res.describe(), [], ignored)
        return verdict(task, data, nonce, canaries, res.describe(), ignored)


def raise_open_file_limit() -> None:
    """The soft limit on open descriptors raised to the hard one: every grade in flight holds
    pipes and a walk's directory descriptors, and a process at the common default (1024)
    fails the grades beside a workspace that takes many (an independent review made honest
    grades in the same process FAIL that way)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # an infinite hard limit the kernel caps (nr_open)
            pass


def rewritten_by_pytest(rel: str, initpaths: set[str]) -> bool:
    """Whether pytest's assertion rewriter loads ``rel`` (the grader's ini keeps pytest's
    default ``python_files``): a conftest, a file named on the command line, a test file's
    name. The runner compiles a served source the same way."""
    name = os.path.basename(rel)
    return (name == "conftest.py" or rel in initpaths or fnmatch.fnmatch(name, "test_*.py")
            or fnmatch.fnmatch(name, "*_test.py"))


def _write_all(fd: int, data: bytes) -> None:
    """``data`` into the pipe ``fd``, then closed (the reader sees its end)."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError:  # the sandbox ended without reading it all
        pass
    finally:
        os.close(fd)


def _drain(fd: int, stop: threading.Event | None = None) -> bytes | None:
    """Everything written to the evidence pipe, or None past its bound. Past the bound the
    pipe is still read to its end (and dropped), so a writer that floods it never blocks on a
    full pipe: the sandbox ends when its tests do, not at the wall-clock limit. ``stop`` set:
    give up (a process outside the sandbox still holds the write end, e.g. a fork of this
    one); the read never blocks, so the thread ends and the process can exit."""
    out: bytearray | None = bytearray()
    poller = select.poll()  # not select(): a descriptor numbered past 1023 is refused there
    poller.register(fd, select.POLLIN)
    while True:
        if stop is not None:
            ready = poller.poll(200)
            if not ready:
                if stop.is_set():
                    return None
                continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        if out is not None:
            out += chunk
            if len(out) > MAX_EVIDENCE_BYTES:
                out = None
    return None if out is None else bytes(out)


__all__ = ["Grader"]
