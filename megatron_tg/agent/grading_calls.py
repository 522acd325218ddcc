"""Grading by calls: the tests run where the tested code cannot reach them.

For a task with ``grading: calls``. The policy's change is extracted and applied to a pristine
checkout as for the runner (:mod:`megatron_tg.agent.grading`); then two processes, joined
only by two pipes:

- the **tested side** (:mod:`calls_subject`), in a fresh sandbox on the graded checkout
  (read-only; no hidden test in it, not even a stub), imports the task's modules and answers
  calls;
- the **test side** (:mod:`calls_driver`), outside the sandbox, runs pytest on the task's test
  support from the pristine source only (hidden tests, conftest, helpers) in a private
  directory, and writes the per-test records.

What the tested code can send is data (:mod:`calls_wire`): exact built-in types, judged by the
tests' own ``==`` in an interpreter that runs none of the policy's code; its other objects are
opaque handles with no equality, truth value or hash of their own. So the in-process attacks
of the runner's threat model (patched comparisons, swapped test items, frame reads of the
caller's assertion, forged records, closures over the runner's state) have nothing to act on.
The test side's records are read after both sides ended, with the grader's nonce, by the same
:func:`~megatron_tg.agent.grading_verdict.verdict` (canaries included).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from megatron_tg.agent.changes import extract
from megatron_tg.agent.grading_checkout import (MAX_FILES, PREPARE_S, apply_changes, canary, grading_files,
                                                is_test_support)
from megatron_tg.agent.grading_verdict import GradeResult, verdict
from megatron_tg.agent.proc import Limits
from megatron_tg.agent.sandbox import Bind, Sandbox
from megatron_tg.agent.tasks import Task, materialize, write_files

HERE = Path(__file__).parent
SUBJECT_FILES = {"subject.py": HERE / "calls_subject.py", "calls_wire.py": HERE / "calls_wire.py"}
DRIVER_FILES = {"driver.py": HERE / "calls_driver.py", "calls_wire.py": HERE / "calls_wire.py"}
OUTPUT_BYTES = 32 << 10
"""Bytes of the test side's output kept at its head and at its tail (pytest's report; the rest
is read and dropped)."""
TEST_SIDE_MEMORY_MB = 1024
"""Address space of the test side (python, pytest, the tests and what the tested code sends)."""
TEST_SIDE_CPU_S = 120.0
"""CPU seconds of the test side."""
DRIVER_GRACE_S = 30.0
"""How long past the test run's wall-clock limit the test side may take (pytest's start and
its report) before it is killed and the grade is a FAIL."""


def task_modules(tree: Path, roots: list[str]) -> list[str]:
    """The top-level module names the pristine checkout defines at the task's roots: the only
    imports the test side sends to the tested side (a module the policy adds cannot stand in
    for one the test side's own libraries would try to import)."""
    names = set()
    for root in roots:
        d = tree / root
        if not d.is_dir():
            continue
        for entry in os.scandir(d):
            rel = os.path.relpath(entry.path, tree)
            if entry.is_symlink() or is_test_support(rel + ("/x" if entry.is_dir() else "")):
                continue
            if entry.is_file() and entry.name.endswith(".py"):
                names.add(entry.name[:-3])
            elif entry.is_dir() and entry.name.isidentifier():
                names.add(entry.name)
    return sorted(n for n in names if n.isidentifier())


def prepare(task: Task, workspace: Path, base: Path, limits: Limits):
    """The graded checkout (``base/ws``: the change applied, no hidden file), the test side's
    directory (``base/driver/tests``: pristine test support, hidden tests, canaries), the
    modules it may import from the tested side, and the change's ignored paths."""
    orig, ev, grader, driver = base / "orig", base / "ws", base / "grader", base / "driver"
    for d in (orig, grader, driver):
        d.mkdir()
    os.chmod(driver, 0o700)  # the test side's files: never the sandbox's to read
    materialize(task, orig)
    changes = extract(workspace, orig, max_bytes=limits.disk_mb << 20, max_files=MAX_FILES,
                      deadline=time.monotonic() + PREPARE_S)
    files = grading_files(task)
    keep = frozenset(files)
    shutil.copytree(orig, ev, symlinks=True)
    ignored = apply_changes(ev, changes, keep)
    tests = driver / "tests"
    tests.mkdir()
    for root, _dirs, names in os.walk(orig):  # test support from the pristine source only
        for n in names:
            p = Path(root) / n
            rel = os.path.relpath(p, orig)
            if is_test_support(rel, keep) and not p.is_symlink() and p.is_file():
                write_files(tests, {rel: ""})
                shutil.copyfile(p, tests / rel)
    test_dirs = sorted({os.path.dirname(t.split("::", 1)[0]) for t in task.required_tests})
    canaries = []
    for d in test_dirs:
        body, ok, bad = canary(secrets.token_hex(4))
        rel = os.path.join(d, f"test_{secrets.token_hex(5)}.py")
        files[rel] = body
        canaries.append((rel, ok, bad))
    write_files(tests, files)
    (tests / "pytest.ini").write_text("[pytest]\naddopts =\n")
    for root, dirs, names in os.walk(ev):  # our tree: readable, not writable, by the sandbox uid
        for n in dirs:
            os.chmod(os.path.join(root, n), 0o755)
        for n in names:
            if not os.path.islink(os.path.join(root, n)):
                os.chmod(os.path.join(root, n), 0o644)
    for name, src in SUBJECT_FILES.items():
        shutil.copyfile(src, grader / name)
    for d in (grader, base, ev):
        os.chmod(d, 0o755)
    return ev, driver, task_modules(orig, task.pythonpath), canaries, ignored


def _limit_test_side(pid: int) -> None:
    """An address-space and a CPU-time limit on the test side (set from here right after it
    starts, before it reads a frame), so no value the tested code sends (a frame that
    parses big, a set whose hashes collide) can take more of the host than that."""
    resource.prlimit(pid, resource.RLIMIT_AS, (TEST_SIDE_MEMORY_MB << 20,) * 2)
    cpu = int(TEST_SIDE_CPU_S)
    resource.prlimit(pid, resource.RLIMIT_CPU, (cpu, cpu + 5))


class _Zygote:
    """The test sides' fork server (:func:`calls_driver.serve`), one per grader process, started
    on first use: pytest is imported there once, and each grade's test side is a fork of it.
    It runs from a private copy of the driver's files, ends when this process's socket closes
    (so also when this process dies), and is restarted if it is gone."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.dir: Path | None = None

    def _start(self) -> None:
        self.close()
        self.dir = Path(tempfile.mkdtemp(prefix="tg-calls-"))  # 0700: the grader's alone
        for name, src in DRIVER_FILES.items():
            shutil.copyfile(src, self.dir / name)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
               "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-B", str(self.dir / "driver.py"), "--serve", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env=env, cwd=str(self.dir), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        self.sock = ours

    def spawn(self, cfg: dict, fds: list[int]) -> int:
        """A test side started on ``cfg`` with ``fds`` (request write end, response read end,
        output write end); its pid."""
        with self.lock:
            for _ in range(2):  # a zygote that died since the last grade is started again
                if self.proc is None or self.proc.poll() is not None:
                    self._start()
                try:
                    socket.send_fds(self.sock, [json.dumps(cfg).encode()], fds)
                    answer = self.sock.recv(4096)
                    if answer:
                        return int(json.loads(answer)["pid"])
                except OSError:
                    pass
                self.close()
            raise RuntimeError("the test side could not be started (its zygote does not answer)")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()  # the zygote reads its end and exits
            self.sock = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


ZYGOTE = _Zygote()
atexit.register(ZYGOTE.close)


class _Output:
    """The test side's output, its head and tail kept (the rest read and dropped)."""

    def __init__(self) -> None:
        self.head, self.tail = bytearray(), bytearray()

    def add(self, chunk: bytes) -> None:
        room = OUTPUT_BYTES - len(self.head)
        if room > 0:
            self.head.extend(chunk[:room])
            chunk = chunk[room:]
        self.tail.extend(chunk)
        del self.tail[:-OUTPUT_BYTES]

    def text(self, note: str = "") -> str:
        return (self.head + (b"\n[...]\n" if self.tail else b"") + self.tail).decode("utf-8", "replace") + note


class _TestSide:
    """A running test side: its pid (held as a pidfd, so a signal never reaches another
    process that reused the number) and its output, read on the event loop (no thread is
    held for a grade's length: an independent review stalled honest grades for a minute by
    holding every worker of the loop's default pool)."""

    def __init__(self, pid: int, out_r: int) -> None:
        try:
            self.pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # already gone: its output ends at once
            self.pidfd = None
        self.pid, self.out_r, self.output = pid, out_r, _Output()

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                    os.fdopen(self.out_r, "rb", 0))
        try:
            while chunk := await reader.read(1 << 16):
                self.output.add(chunk)
        finally:
            transport.close()  # closes the descriptor

    def kill(self) -> None:
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def wait(self, timeout: float) -> str:
        """Its output once it exited; killed past ``timeout``, or when this wait is cancelled
        (the caller gave up on the grade: nothing of it keeps running)."""
        reading = asyncio.ensure_future(self._read())
        try:
            _limit_test_side(self.pid)
        except ProcessLookupError:  # it has already exited
            pass
        try:
            await asyncio.wait_for(asyncio.shield(reading), timeout=timeout)
            return self.output.text()
        except (asyncio.TimeoutError, OSError):
            self.kill()
            await reading  # the pipe ends with the process
            return self.output.text("\n(the test side outlived its limit and was killed)")
        except BaseException:
            self.kill()
            reading.cancel()
            raise
        finally:
            if self.pidfd is not None:
                os.close(self.pidfd)
                self.pidfd = None


async def _start_test_side(cfg: dict, req_w: int, resp_r: int) -> _TestSide:
    """The grade's test side, forked by the zygote; this process's copies of its descriptors
    closed (it holds its own)."""
    out_r, out_w = os.pipe()
    try:
        pid = await asyncio.to_thread(ZYGOTE.spawn, cfg, [req_w, resp_r, out_w])
    except BaseException:
        os.close(out_r)
        raise
    finally:
        for fd in (req_w, resp_r, out_w):
            os.close(fd)
    return _TestSide(pid, out_r)


async def run(sandbox: Sandbox, limits: Limits, task: Task, workspace: Path, base: Path) -> GradeResult:
    """The verdict of a grade by calls (see module doc)."""
    ev, driver, modules, canaries, ignored = await asyncio.to_thread(prepare, task, workspace, base, limits)
    ev_in = sandbox.path_in(ev)
    isolated = sandbox.mode != "none"
    g_dir = "/tg-grader" if isolated else str(base / "grader")
    nonce = secrets.token_hex(16)
    report = driver / "report.jsonl"
    test_files = sorted({t.split("::", 1)[0] for t in task.required_tests} | {c[0] for c in canaries})
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    (base / "grader" / "config.json").write_text(json.dumps({
        "req_fd": req_r, "resp_fd": resp_w, "workspace": ev_in,
        "roots": [os.path.normpath(os.path.join(ev_in, p)) for p in task.pythonpath]}))
    cfg = {"nonce": nonce, "report": str(report), "modules": modules,
           "tests": str(driver / "tests"), "roots": task.pythonpath, "timeout_s": limits.wall_s,
           "pytest_args": ["-c", str(driver / "tests" / "pytest.ini"), f"--rootdir={driver / 'tests'}",
                           "-p", "no:cacheprovider", "--import-mode=importlib", "-q",
                           "-o", "console_output_style=classic", *test_files]}
    try:  # the test side first: the tested side's wall clock starts when there is someone to call it
        side = await _start_test_side(cfg, req_w, resp_r)
    except BaseException:
        os.close(req_r)
        os.close(resp_w)
        raise
    subject = asyncio.ensure_future(sandbox.run(
        f"exec python -I -B {g_dir}/subject.py {g_dir}/config.json", ev, limits,
        pass_fds=[req_r, resp_w], readonly_workdir=True, binds=[Bind(str(base / "grader"), g_dir)] if isolated else []))

    async def subject_done():
        try:
            return await subject
        finally:  # the tested side is gone: the test side's reads end at once, not at its deadline
            os.close(req_r)
            os.close(resp_w)

    watcher = asyncio.ensure_future(subject_done())
    try:
        driver_out = await side.wait(limits.wall_s + DRIVER_GRACE_S)
    except BaseException:  # cancelled (or failed): the sandbox is killed too, not waited out
        subject.cancel()
        await asyncio.wait([watcher])
        raise
    res = await watcher
    data = report.read_bytes() if report.exists() else b""
    output = f"{res.describe()}\n--- tests ---\n{driver_out[-4000:]}"
    return verdict(task, data, nonce, canaries, output, ignored)
