"""The grader against a hostile policy: every way of earning the reward without doing the
task fails, and each hostile snippet has a positive control (the correct solution, graded
the same way, passes)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from megatron_tg.agent.grading import Grader
from megatron_tg.agent.sandbox import Limits, rmtree
from megatron_tg.agent.tasks import Task, builtin_tasks, materialize, write_files

from .conftest import NOBODY, REPO, as_nobody
LIMITS = Limits(wall_s=30.0, cpu_s=20, memory_mb=1024, max_procs=32)
CORRECT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return 0\n"

TASK = Task(
    id="add", instruction="Implement add(a, b) in calc.py.",
    files={"calc.py": "def add(a, b):\n    raise NotImplementedError\n",
           "tests/conftest.py": "import pytest\n\n\n@pytest.fixture\ndef pair():\n    return (2, 3)\n",
           "tests/test_calc.py": "import calc\n\n\ndef test_importable():\n    assert callable(calc.add)\n"},
    hidden_files={"tests/test_add.py": "from calc import add\n\n\ndef test_small(pair):\n    assert add(*pair) == 5\n\n\n"
                                       "def test_negative():\n    assert add(-2, -3) == -5\n"},
    fail_to_pass=["tests/test_add.py::test_small", "tests/test_add.py::test_negative"],
    pass_to_pass=["tests/test_calc.py::test_importable"])


@pytest.fixture(scope="module")
def grader(sandbox):
    return Grader(sandbox, LIMITS)


def grade(grader, files: dict[str, str], task: Task = TASK, after=None):
    ws = tempfile.mkdtemp(prefix="tg-test-grade-")
    try:
        materialize(task, ws)
        write_files(ws, files)
        if after:
            after(ws)
        grader.sandbox.adopt(ws, ws)
        return asyncio.run(grader.grade(task, ws))
    finally:
        rmtree(ws)


def test_correct_solution_passes_and_wrong_one_fails(grader):
    g = grade(grader, {"calc.py": CORRECT})
    assert g.passed and g.reason == "" and set(g.tests.values()) == {"passed"}, (g.reason, g.output)
    assert g.metadata()["tests"]["counts"]["passed"] == 3
    g = grade(grader, {"calc.py": WRONG})
    assert not g.passed and g.tests["tests/test_add.py::test_small"] == "failed"
    assert g.tests["tests/test_calc.py::test_importable"] == "passed"  # a per-test result
    g = grade(grader, {})
    assert not g.passed and "did not pass" in g.reason


@pytest.mark.parametrize("snippet", ["import os\nos._exit(0)\n", "import sys\nsys.exit(0)\n",
                                     "raise SystemExit(0)\n" + CORRECT],
                         ids=["os._exit", "sys.exit", "SystemExit-at-import"])
def test_exit_codes_do_not_pass(grader, snippet):
    """Issue #18 probe: `import os; os._exit(0)` was graded as passing."""
    g = grade(grader, {"calc.py": snippet})
    assert not g.passed, g.reason


def test_exit_hook_rewriting_the_report_does_not_pass(grader):
    hook = WRONG + (
        "import atexit, glob, os\n"
        "FAKE = '<testsuites><testsuite>' + ''.join(\n"
        "    f'<testcase classname=\"{c}\" name=\"{n}\"/>' for c, n in [('tests.test_add', 'test_small'),\n"
        "    ('tests.test_add', 'test_negative'), ('tests.test_calc', 'test_importable')]) + '</testsuite></testsuites>'\n"
        "def forge():\n"
        "    for p in glob.glob('/tg-report/*.xml') + glob.glob('/tmp/**/*.xml', recursive=True):\n"
        "        open(p, 'w').write(FAKE)\n"
        "atexit.register(forge)\n"
        "os._exit = lambda code: None  # so that exit hooks run after the runner's exit\n")
    g = grade(grader, {"calc.py": hook})
    assert not g.passed and g.reason.startswith("tampering detected: os: _exit patched"), g.reason


def test_forged_report_does_not_pass(grader):
    forge = WRONG + (
        "import os\n"
        "os.makedirs('/tg-report', exist_ok=True)\n"
        "open('/tg-report/junit.xml', 'w').write('<testsuites><testsuite><testcase classname=\"tests.test_add\" '\n"
        "    'name=\"test_small\"/></testsuite></testsuites>')\n"
        "open('/tg-report/junit.xml.sig', 'w').write('0' * 64)\n"
        "os._exit(0)\n")
    g = grade(grader, {"calc.py": forge})
    assert not g.passed and g.reason.startswith("the tests could not be collected: tests/test_add.py"), g.reason


# Each steers only the task's tests (not the grader's canaries), so only removing or
# ignoring the file stops it.
FLIP = ("import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
        "    out = yield\n    if item.nodeid.startswith('tests/'):\n        out.get_result().outcome = 'passed'\n")


@pytest.mark.parametrize("steer", [
    {"conftest.py": FLIP},
    {"tests/conftest.py": FLIP + "\n\n@pytest.fixture\ndef pair():\n    return (2, 3)\n"},
    {"pytest.ini": "[pytest]\naddopts = -p tgflip\n", "tgflip.py": FLIP},
    {"pyproject.toml": "[tool.pytest.ini_options]\naddopts = '-p tgflip'\n", "tgflip.py": FLIP},
    {"setup.cfg": "[tool:pytest]\naddopts = -p tgflip\n", "tgflip.py": FLIP},
    {"sitecustomize.py": "import sys\nsys.argv += ['-p', 'tgflip']\n", "tgflip.py": FLIP,
     "x.pth": "import sitecustomize\n"},
    {"tests/__init__.py": "import _pytest.config\n_pm = _pytest.config.get_plugin_manager\n" + FLIP.replace(
        "import pytest", "import pytest, sys") + "\nimport _pytest.python\n_orig = _pytest.python.Function.runtest\n"
        "def _rt(self):\n    if not self.nodeid.startswith('tests/'):\n        return _orig(self)\n"
        "_pytest.python.Function.runtest = _rt\n"},
], ids=["conftest-root", "conftest-tests", "pytest.ini", "pyproject", "setup.cfg", "sitecustomize", "tests-init"])
def test_files_that_steer_the_test_runner_do_not_pass(grader, steer):
    g = grade(grader, {"calc.py": WRONG, **steer})
    assert not g.passed, (g.reason, g.output)
    g = grade(grader, {"calc.py": CORRECT, **steer})  # positive control: the task's own conftest is back
    assert g.passed, (g.reason, g.output)


def test_deleting_or_replacing_the_tasks_tests_does_not_help(grader):
    """Test support always comes from the pristine source: the policy's deletions and
    rewrites of it are listed as ignored, never graded."""
    g = grade(grader, {"calc.py": CORRECT}, after=lambda ws: (os.unlink(Path(ws, "tests/conftest.py")),
                                                             os.unlink(Path(ws, "tests/test_calc.py"))))
    assert g.passed and g.ignored == ["tests/conftest.py", "tests/test_calc.py"], (g.reason, g.ignored)
    fake = {"tests/test_add.py": "def test_small():\n    pass\n\n\ndef test_negative():\n    pass\n"}
    g = grade(grader, {"calc.py": WRONG, **fake})  # the task's test files replace the agent's
    assert not g.passed and g.tests["tests/test_add.py::test_small"] == "failed"
    assert g.metadata()["tests"]["ignored"] == ["tests/test_add.py"]


@pytest.mark.parametrize("patch", [
    "import _pytest.reports as R\n_orig = R.TestReport.from_item_and_call.__func__\n"
    "def _fake(cls, item, call):\n    rep = _orig(cls, item, call)\n    rep.outcome, rep.longrepr = 'passed', None\n"
    "    return rep\nR.TestReport.from_item_and_call = classmethod(_fake)\n",
    "import _pytest.python as P\nP.Function.runtest = lambda self: None\n",
    "import builtins\n_real = builtins.__import__\n"
    "def _imp(name, *a, **k):\n    m = _real(name, *a, **k)\n    if name == '_pytest.outcomes':\n"
    "        m.fail = lambda *a, **k: None\n    return m\nbuiltins.__import__ = _imp\n"
    "import _pytest.runner as Rn\nRn.check_interactive_exception = lambda *a: False\n"
    "_orig_call = Rn.call_runtest_hook\n"
    "def _no_fail(item, when, **kw):\n    ci = _orig_call(item, when, **kw)\n    ci.excinfo = None\n    return ci\n"
    "Rn.call_runtest_hook = _no_fail\n",
    "import _pytest.reports as R\n_orig = R.TestReport.from_item_and_call.__func__\n"
    "def _fake(cls, item, call):\n    rep = _orig(cls, item, call)\n    if item.nodeid.startswith('tests/'):\n"
    "        rep.outcome, rep.longrepr = 'passed', None\n    return rep\nR.TestReport.from_item_and_call = classmethod(_fake)\n",
], ids=["report-outcome", "skip-test-bodies", "swallow-exceptions", "only-under-tests"])
def test_monkeypatching_pytest_from_the_solution_does_not_pass(grader, patch):
    g = grade(grader, {"calc.py": patch + WRONG})
    assert not g.passed and g.reason.startswith("tampering detected: "), (g.reason, g.output)
    g = grade(grader, {"calc.py": CORRECT})
    assert g.passed


def test_unreadable_files_are_still_graded_and_special_files_refused(grader):
    """Issue #18 probe: a `chmod 000` file made grading raise. A FIFO is refused, by name."""
    def lock(ws):
        os.chmod(Path(ws, "calc.py"), 0)
        os.chmod(Path(ws, "tests"), 0o300)
    g = grade(grader, {"calc.py": CORRECT}, after=lock)
    assert g.passed, (g.reason, g.output)
    g = grade(grader, {"calc.py": CORRECT}, after=lambda ws: os.mkfifo(Path(ws, "pipe")))
    assert not g.passed and g.reason == "not graded: pipe is a FIFO (only regular files are graded)", g.reason


def test_unreadable_files_are_read_by_an_unprivileged_grader():
    """The non-root path of the extraction (as root, permissions never stop a read): a file
    and a directory the policy chmod'ed away are read through O_PATH descriptors."""
    src = tempfile.mkdtemp(prefix="tg-nobody-")
    orig = tempfile.mkdtemp(prefix="tg-nobody-orig-")
    try:
        Path(src, "d").mkdir()
        Path(src, "d", "f.py").write_text("X = 1\n")
        os.chmod(Path(src, "d", "f.py"), 0)
        os.chmod(Path(src, "d"), 0o100)
        code = (f"from megatron_tg.agent.changes import extract; c = extract({src!r}, {orig!r}, max_bytes=1 << 20, "
                f"max_files=100); print(c.written)")
        if os.geteuid() != 0:
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        else:
            for p in (src, f"{src}/d", f"{src}/d/f.py", orig):
                os.chown(p, NOBODY, NOBODY)
            r = subprocess.run(as_nobody([sys.executable, "-c", code]), env={"PYTHONPATH": str(REPO),
                               "PATH": os.environ["PATH"]}, capture_output=True, text=True, timeout=60, cwd="/")
        assert r.returncode == 0 and r.stdout == "{'d/f.py': b'X = 1\\n'}\n", r.stdout + r.stderr
    finally:
        rmtree(src)
        rmtree(orig)


def test_builtin_tasks_reference_solutions_pass_and_starting_files_fail(grader):
    tasks = builtin_tasks()
    assert len(tasks) == 16
    for t in tasks:
        g = grade(grader, t.privileged["reference"], task=t)
        assert g.passed, (t.id, g.reason, g.output)
    for t in tasks[:3]:
        g = grade(grader, {}, task=t)
        assert not g.passed, t.id


def test_grading_as_an_unprivileged_caller():
    """The user-namespace path end to end (run as `nobody` when we are root): a correct
    solution the agent made unreadable passes, a wrong one fails."""
    if os.geteuid() != 0:
        pytest.skip("already unprivileged: the other tests of this file cover this path")
    script = ("import asyncio, os, tempfile\n"
              "from megatron_tg.agent.grading import Grader\n"
              "from megatron_tg.agent.sandbox import Limits, Sandbox\n"
              "from megatron_tg.agent.tasks import materialize, write_files\n"
              "from tests.agent.test_grading import CORRECT, LIMITS, TASK, WRONG\n"
              "sb = Sandbox('bwrap', limits=Limits(max_procs=512))\n"
              "assert not sb.root\n"
              "for code, lock in ((CORRECT, True), (WRONG, False)):\n"
              "    ws = tempfile.mkdtemp()\n"
              "    materialize(TASK, ws)\n"
              "    write_files(ws, {'calc.py': code})\n"
              "    if lock:\n"
              "        os.chmod(os.path.join(ws, 'calc.py'), 0)\n"
              "    g = asyncio.run(Grader(sb, LIMITS).grade(TASK, ws))\n"
              "    print('GRADE', g.passed, g.reason)\n")
    r = subprocess.run(as_nobody([sys.executable, "-c", script]),
                       env={"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"], "HOME": "/nonexistent"},
                       capture_output=True, text=True, timeout=120, cwd="/")
    grades = [ln for ln in r.stdout.splitlines() if ln.startswith("GRADE")]
    assert r.returncode == 0 and len(grades) == 2, r.stdout + r.stderr
    assert grades[0] == "GRADE True " and grades[1].startswith("GRADE False 2 of 3 required tests"), grades
