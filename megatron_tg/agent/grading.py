"""Grading a final workspace so that the agent cannot influence the verdict.

A task passes only if pytest's own per-test report says every required test (the task's
``fail_to_pass`` and ``pass_to_pass``) ran and passed. How each way of earning the reward
without doing the task is closed:

* **exit codes** (``os._exit(0)`` at import, ``sys.exit`` in a fixture): never read; a test
  that did not run is "missing", and missing fails.
* **the workspace steering the test runner**: grading runs on a fresh copy, never the
  workspace; in the copy every ``conftest.py``, ``sitecustomize.py``, ``usercustomize.py``,
  ``*.pth`` and ``__init__.py`` of a test directory the agent added is removed and the
  task's own are restored as they were;
  ``__pycache__``/``*.pyc`` are removed; pytest gets the grader's own ini file (``-c``), so
  ``pytest.ini`` / ``tox.ini`` / ``setup.cfg`` / ``pyproject.toml`` of the workspace are not
  read, plugin autoloading is off and its cache is not used; the task's test files are
  written from the task (its ``hidden_files`` and the test patch applied to the base commit),
  never taken from the workspace.
* **monkeypatching from the solution** (pytest's reports, ``unittest`` asserts, ``builtins``):
  canary tests the grader adds in every directory of required tests (randomly named), one
  that must fail and one that must pass; a tampered runner that turns failures into passes
  (or a crash into silence) flips one of them, and the whole grade fails.
* **a forged report** (written by the tested code at import time, or rewritten by an exit
  hook or a leftover process): the report lives in a directory only the grading run can
  write (the agent's own tool calls never see it), and the runner signs it with a key the
  tested code never had the chance to read from the environment or disk; a report whose
  signature does not match fails.
* **files the agent made unreadable** are made readable in the copy before grading, and
  FIFOs, sockets and devices are skipped (copying a FIFO would block).

Not closed: the tested code runs inside pytest's process, so code written to defeat this
grader in particular can read the signing key there (from the inherited pipe or the
runner's memory), or rewrite the report in the moment between pytest writing it and the
runner signing it, with results consistent with the canaries. No in-process check stops
that; the transcript the judge reads (which shows such code) is the defence left.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import shutil
import stat
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _pytest.junitxml import mangle_test_address

from megatron_tg.agent.proc import Limits, disk_usage_bytes
from megatron_tg.agent.sandbox import Bind, Sandbox, rmtree
from megatron_tg.agent.tasks import Task, materialize, write_files

RUNNER = Path(__file__).with_name("grading_runner.py")
STEERING_NAMES = ("conftest.py", "sitecustomize.py", "usercustomize.py")
GRADER_INI = "[pytest]\naddopts =\njunit_family = xunit1\njunit_logging = no\n"
MAX_REPORT_BYTES = 64 << 20
OUTPUT_CHARS = 2000
CANARY = ("def test_must_pass():\n    assert [1, 2] + [3] == [1, 2, 3]\n\n\n"
          "def test_must_fail():\n    assert sum([1, 2]) == 4, 'the grader canary fails on purpose'\n")


@dataclass
class GradeResult:
    passed: bool
    tests: dict[str, str] = field(default_factory=dict)
    """Required test id -> "passed" | "failed" | "error" | "skipped" | "missing"."""
    reason: str = ""
    """Why the task did not pass (empty when it did)."""
    output: str = ""

    def metadata(self) -> dict[str, Any]:
        """What the rollout carries: ``tests_passed`` is what the judge's tests_pass reads."""
        counts = {k: sum(v == k for v in self.tests.values()) for k in ("passed", "failed", "error", "skipped",
                                                                         "missing")}
        return {"tests_passed": self.passed,
                "tests": {"reason": self.reason, "counts": counts, "results": self.tests,
                          "output": self.output[-OUTPUT_CHARS:]}}


def junit_key(node_id: str) -> tuple[str, str]:
    """(classname, name) under which pytest's junitxml reports ``node_id``."""
    names = mangle_test_address(node_id)
    return ".".join(names[:-1]), names[-1]


def parse_junit(data: bytes) -> dict[tuple[str, str], str]:
    """Outcome per (classname, name); a test reported twice (e.g. a teardown error after a
    pass) keeps its worst outcome."""
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    out: dict[tuple[str, str], str] = {}
    for tc in ET.fromstring(data).iter("testcase"):
        tags = {child.tag for child in tc}
        outcome = ("error" if "error" in tags else "failed" if "failure" in tags
                   else "skipped" if "skipped" in tags else "passed")
        key = (tc.get("classname", ""), tc.get("name", ""))
        if key not in out or rank[outcome] > rank[out[key]]:
            out[key] = outcome
    return out


def prepare_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy a workspace for grading: unreadable entries made readable first (we own them,
    or are root), special files, VCS metadata and bytecode left out."""
    for root, dirs, files in os.walk(src):
        for name in dirs + files:
            p = os.path.join(root, name)
            try:
                st = os.lstat(p)
                if stat.S_ISDIR(st.st_mode):
                    os.chmod(p, stat.S_IMODE(st.st_mode) | 0o700)
                elif stat.S_ISREG(st.st_mode):
                    os.chmod(p, stat.S_IMODE(st.st_mode) | 0o600)
            except OSError:
                continue
        dirs[:] = [d for d in dirs if os.access(os.path.join(root, d), os.R_OK | os.X_OK)]

    def ignore(d: str, names: list[str]) -> list[str]:
        out = []
        for n in names:
            try:
                m = os.lstat(os.path.join(d, n)).st_mode
            except OSError:
                out.append(n)
                continue
            if n in (".git", "__pycache__", ".pytest_cache") or n.endswith((".pyc", ".pth")) or not (
                    stat.S_ISREG(m) or stat.S_ISDIR(m) or stat.S_ISLNK(m)):
                out.append(n)
        return out

    shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True, ignore=ignore)


def reset_steering_files(copy: Path, original: Path, test_dirs: list[str] = ()) -> list[str]:
    """Remove the runner-steering files the agent added, restore the task's own; returns
    the relative paths changed. In the directories of the required tests ``__init__.py``
    counts too (code run at collection, like a conftest; elsewhere it is the solution's)."""
    changed = []

    def steering(rel: str) -> bool:
        name, d = os.path.basename(rel), os.path.dirname(rel)
        return name in STEERING_NAMES or (name == "__init__.py" and d in test_dirs)

    for root, dirs, files in os.walk(copy):
        for n in files:
            if steering(os.path.relpath(os.path.join(root, n), copy)):
                rel = os.path.relpath(os.path.join(root, n), copy)
                orig = original / rel
                if orig.is_file() and not orig.is_symlink():
                    if Path(root, n).read_bytes() != orig.read_bytes():
                        shutil.copyfile(orig, Path(root, n))
                        changed.append(rel)
                else:
                    os.unlink(os.path.join(root, n))
                    changed.append(rel)
    for root, dirs, files in os.walk(original):  # the task's own, if the agent deleted them
        for n in files:
            if steering(os.path.relpath(os.path.join(root, n), original)):
                rel = os.path.relpath(os.path.join(root, n), original)
                if not (copy / rel).exists():
                    write_files(copy, {rel: Path(root, n).read_text(encoding="utf-8", errors="replace")})
                    changed.append(rel)
    return changed


def grading_files(task: Task) -> dict[str, str]:
    """The test files written over the copy: the task's hidden files; for a task from a git
    mirror also the files of its required tests and those its test patch touches, as the
    base commit has them with the patch applied."""
    files = dict(task.hidden_files)
    if task.repo is not None and task.base_commit is not None:
        from megatron_tg.agent.swe.repos import patched_files

        test_files = sorted({t.split("::", 1)[0] for t in task.required_tests} - set(files))
        files.update(patched_files(task.repo, task.base_commit, task.test_patch, test_files))
    return files


class Grader:
    """Grades final workspaces in fresh sandboxes (one per grading, nothing shared)."""

    def __init__(self, sandbox: Sandbox, limits: Limits, workspace_root: str | None = None):
        self.sandbox, self.limits, self.workspace_root = sandbox, limits, workspace_root

    async def grade(self, task: Task, workspace: str | os.PathLike) -> GradeResult:
        used = await asyncio.to_thread(disk_usage_bytes, workspace)
        if used > self.limits.disk_mb << 20:
            return GradeResult(False, {t: "missing" for t in task.required_tests},
                               f"workspace uses {used >> 20} MiB, over its {self.limits.disk_mb} MiB quota")
        base = Path(tempfile.mkdtemp(prefix="tg-grade-", dir=self.workspace_root))
        try:
            return await self._grade(task, Path(workspace), base)
        finally:
            await asyncio.to_thread(rmtree, base)

    async def _grade(self, task: Task, workspace: Path, base: Path) -> GradeResult:
        ev, orig, grader, report = base / "ws", base / "orig", base / "grader", base / "report"
        # A canary next to every directory of required tests, so that tampering aimed at
        # "the tests under tests/" hits a canary too.
        nonce = secrets.token_hex(6)
        test_dirs = sorted({os.path.dirname(t.split("::", 1)[0]) for t in task.required_tests})
        # distinct basenames: pytest refuses two rootless test modules of one name
        canaries = [os.path.join(d, f"test_tgcanary_{nonce}_{i}.py") for i, d in enumerate(test_dirs)]

        def prepare() -> None:
            for d in (ev, orig, grader, report):
                d.mkdir()
            materialize(task, orig)
            prepare_copy(workspace, ev)
            reset_steering_files(ev, orig, test_dirs)
            write_files(ev, {**grading_files(task), **{c: CANARY for c in canaries}})
            shutil.copyfile(RUNNER, grader / "run.py")
            (grader / "pytest.ini").write_text(GRADER_INI)
            for d in (grader, base):
                os.chmod(d, 0o755)
            self.sandbox.adopt(ev, ev)
            self.sandbox.adopt(report, ev)

        await asyncio.to_thread(prepare)
        test_files = sorted({t.split("::", 1)[0] for t in task.required_tests} | set(canaries))
        ev_in = Path(self.sandbox.path_in(ev))  # where the command sees the copy (/testbed in an image)
        roots = os.pathsep.join(str(ev_in / p) for p in task.pythonpath)
        # Without isolation there are no private mount points: the real directories are used.
        isolated = self.sandbox.mode != "none"
        g_dir, r_dir = ("/tg-grader", "/tg-report") if isolated else (str(grader), str(report))
        report_file = f"{r_dir}/junit.xml"
        args = ["-c", f"{g_dir}/pytest.ini", f"--rootdir={ev_in}", "-p", "no:cacheprovider", "-q",
                "-o", "console_output_style=classic", *test_files]
        cmd = (f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 exec python -I -B {g_dir}/run.py {{fd}} {report_file} "
               f"{_q(roots)} -- " + " ".join(_q(a) for a in args))
        key = secrets.token_bytes(32)
        r, w = os.pipe()
        try:
            os.write(w, key)
            os.close(w)
            res = await self.sandbox.run(cmd.format(fd=r), ev, self.limits, pass_fds=[r],
                                         binds=[Bind(str(grader), g_dir), Bind(str(report), r_dir, writable=True)]
                                         if isolated else [])
        finally:
            os.close(r)
        return self._verdict(task, report / "junit.xml", key, canaries, res.describe())

    def _verdict(self, task: Task, report: Path, key: bytes, canaries: list[str], output: str) -> GradeResult:
        missing = {t: "missing" for t in task.required_tests}
        sig = report.with_name("junit.xml.sig")
        if not report.is_file() or report.is_symlink() or report.stat().st_size > MAX_REPORT_BYTES:
            return GradeResult(False, missing, "pytest wrote no report (the run was stopped before it ended)", output)
        data = report.read_bytes()
        want = hmac.new(key, data, hashlib.sha256).hexdigest()
        if not sig.is_file() or not hmac.compare_digest(sig.read_text().strip(), want):
            return GradeResult(False, missing, "the report is not the one pytest wrote (signature mismatch)", output)
        try:
            outcomes = parse_junit(data)
        except ET.ParseError as e:
            return GradeResult(False, missing, f"the report is not valid junitxml ({e})", output)
        if any(outcomes.get(junit_key(f"{c}::test_must_fail")) != "failed"
               or outcomes.get(junit_key(f"{c}::test_must_pass")) != "passed" for c in canaries):
            return GradeResult(False, missing, "the grader's canary tests did not come out as they must "
                               "(the test run was tampered with)", output)
        results = {t: outcomes.get(junit_key(t), "missing") for t in task.required_tests}
        bad = {t: v for t, v in results.items() if v != "passed"}
        reason = "" if not bad else (f"{len(bad)} of {len(results)} required tests did not pass: "
                                     + ", ".join(f"{t} ({v})" for t, v in list(bad.items())[:5]))
        return GradeResult(not bad, results, reason, output)


def _q(s: str) -> str:
    import shlex
    return shlex.quote(s)


__all__ = ["GradeResult", "Grader", "grading_files", "junit_key", "parse_junit", "prepare_copy",
           "reset_steering_files"]
