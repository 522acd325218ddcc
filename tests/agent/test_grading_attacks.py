"""Hostile solutions against the grader, one per class of docs/grading.md. Each is a
solution that does not implement the task (or tries to reach the host); each must come out
FAIL with its reason recorded, while the correct solution graded the same way passes.

``ATTACKS`` is data on purpose: the same solutions can be graded by another version of the
grader (the earlier one passed every attack marked ``passed_before``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megatron_tg.agent.grading import Grader
from megatron_tg.agent.sandbox import Limits, rmtree
from megatron_tg.agent.tasks import Task, materialize, write_files
from megatron_tg.agent.tools import Tools

from .conftest import NOBODY, REPO
from .hostile_review2 import REVIEW2, REVIEW2_LEFT_OPEN, marshal_plugin, sourceless_pyc
from .hostile_review3 import MEND_PROBES, REVIEW3
from .hostile_review4 import ATTACKS as REVIEW4
from .hostile_review5 import ATTACKS as REVIEW5
from .hostile_review5 import LEFT_OPEN as REVIEW5_LEFT_OPEN
from .hostile_review6 import ATTACKS as REVIEW6
from .hostile_review6 import HOST_SIDE as REVIEW6_HOST_SIDE
from .hostile_review6 import LEFT_OPEN as REVIEW6_LEFT_OPEN
from .hostile_review7 import ATTACKS as REVIEW7
from .hostile_review7 import HOST_SIDE as REVIEW7_HOST_SIDE
from .hostile_review7 import PASSED_ON_63030D4 as REVIEW7_PASSED
from .test_grading import CORRECT, LIMITS, TASK, WRONG, grade

# ---------------------------------------------------------------- in-process tampering
ALWAYS_EQUAL = ("class _Eq:\n    def __eq__(self, other):\n        return True\n\n"
                "    def __ne__(self, other):\n        return False\n\n\n"
                "def add(a, b):\n    return _Eq()\n")
INT_SUBCLASS = "class _I(int):\n    __eq__ = lambda self, other: True\n\n\ndef add(a, b):\n    return _I(0)\n"
PARTIAL_EQ = ("import functools\n\n\nclass _E:\n    __eq__ = functools.partial(lambda *a: True)\n\n\n"
              "def add(a, b):\n    return _E()\n")
STATIC_EQ = ("class _E:\n    __eq__ = staticmethod(lambda *a: True)\n\n\ndef add(a, b):\n    return _E()\n")
# The runner's own record event, raised by the solution.
FORGED_EVENT = ("import sys\nfor _t in ('test_small', 'test_negative'):\n"
                "    sys.audit('tg.emit', f'tests/test_add.py::{_t}', 'call', 'passed')\n" + WRONG)
NESTED_EQ = ALWAYS_EQUAL.replace("return _Eq()", "return [_Eq()]")  # inside a container, still seen
# Read the expected value from the caller's assert (its source line), as reward hackers do.
FRAME_GETFRAME = ("import linecache, re, sys\n\n\ndef add(a, b):\n    f = sys._getframe(1)\n"
                  "    line = linecache.getline(f.f_code.co_filename, f.f_lineno)\n"
                  "    return int(re.search(r'==\\s*(-?\\d+)', line).group(1))\n")
FRAME_INSPECT = ("import inspect, re\n\n\ndef add(a, b):\n    line = inspect.stack()[1].code_context[0]\n"
                 "    return int(re.search(r'==\\s*(-?\\d+)', line).group(1))\n")
FRAME_TRACEBACK = ("import linecache, re\n\n\ndef add(a, b):\n    try:\n        raise RuntimeError\n"
                   "    except RuntimeError as e:\n        f = e.__traceback__.tb_frame.f_back\n"
                   "    line = linecache.getline(f.f_code.co_filename, f.f_lineno)\n"
                   "    return int(re.search(r'==\\s*(-?\\d+)', line).group(1))\n")
# The hidden test read from the graded copy: its expected values, in order, as a lookup table.
READ_HIDDEN = ("import os, re\n_src = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tests', "
               "'test_add.py')).read()\n_want = [int(x) for x in re.findall(r'==\\s*(-?\\d+)', _src)]\n\n\n"
               "def add(a, b):\n    return {(2, 3): _want[0], (-2, -3): _want[1]}.get((a, b), 0)\n")
# Outcome flips that leave the (formerly fixed-prefix) canaries alone.
FLIP_CLASS = ("import _pytest.reports as R\n_orig = R.TestReport.from_item_and_call.__func__\n\n\n"
              "def _fake(cls, item, call):\n    rep = _orig(cls, item, call)\n"
              "    if 'tgcanary' not in item.nodeid and 'test_add' in item.nodeid:\n"
              "        rep.outcome, rep.longrepr = 'passed', None\n    return rep\n\n\n"
              "R.TestReport.from_item_and_call = classmethod(_fake)\n" + WRONG)
FLIP_PLUGIN = ("import sys\n\n\nclass _Flip:\n    import pytest\n\n    @pytest.hookimpl(hookwrapper=True)\n"
               "    def pytest_runtest_makereport(self, item, call):\n        out = yield\n"
               "        if 'test_add' in item.nodeid:\n            out.get_result().outcome = 'passed'\n\n\n"
               "for _h in sys.meta_path:\n    if hasattr(_h, 'config') and _h.config is not None:\n"
               "        _h.config.pluginmanager.register(_Flip(), 'tgflip')\n" + WRONG)
# The old runner signed whatever `open` gave it: rewrite the report just before it is read.
PATCH_OPEN = ("import builtins, re\n_open = builtins.open\n\n\n"
              "def _patched(p, mode='r', *a, **k):\n"
              "    if str(p).endswith('junit.xml') and mode == 'rb':\n        data = _open(p).read()\n"
              "        data = re.sub(r'(<testcase classname=\"tests\\.test_add\"[^>]*?)>.*?</testcase>', r'\\1 />', data,"
              " flags=re.S)\n        _open(p, 'w').write(data)\n    return _open(p, mode, *a, **k)\n\n\n"
              "builtins.open = _patched\n" + WRONG)
CODE_WRITE = ("import _pytest.python as P\nP.Function.runtest.__code__ = (lambda self: None).__code__\n" + WRONG)
SIGNAL = "import os, signal\nos.kill(1, signal.SIGCONT)\n" + CORRECT
CTYPES = "import ctypes\n" + CORRECT
GC_WALK = "import gc\n_objs = gc.get_objects()\n" + CORRECT
SETTRACE = "import sys\nsys.settrace(lambda *a: None)\nsys.settrace(None)\n" + CORRECT
# A plain, honest solution using logging and typing (their frame use is benign).
HONEST = ("import logging\nfrom typing import NamedTuple, TypeVar\nT = TypeVar('T')\n\n\n"
          "class P(NamedTuple):\n    x: int\n\n\ndef add(a, b):\n    logging.getLogger(__name__).warning('adding')\n"
          "    return P(a + b, ).x\n")

# Found by a hostile review: comparisons that say yes only to a builtin, pytest's approx as a result,
# the runner's comparison shadowed in a test's globals, code compiled under a library's or a made-up
# file name, a patch removed again before the end of the test, the hidden test read through a
# subprocess, a directory descriptor or the test module's loader.
SELECTIVE_EQ = 'class _R:\n    def __eq__(self, other):\n        return isinstance(other, int)\n    __hash__ = object.__hash__\n\n\ndef add(a, b):\n    return _R()\n'
INT_SELECTIVE_EQ = 'class _I(int):\n    def __eq__(self, other):\n        return type(other) is int or int.__eq__(self, other)\n    __hash__ = int.__hash__\n\n\ndef add(a, b):\n    return _I(0)\n'
APPROX_RESULT = 'import pytest\n\ndef add(a, b):\n    return pytest.approx(0, abs=1e9)\n'
SHADOW_CMP = "import sys\nfor _n, _m in list(sys.modules.items()):\n    if getattr(_m, '__file__', '') and str(_m.__file__).endswith('test_add.py'):\n        _m.__dict__['@tg_cmp'] = lambda op, l, r: True\ndef add(a, b):\n    return 0\n"
FROZEN_NAME_PLUGIN = "import sys\nSRC = '''\nimport pytest\nclass _Flip:\n    @pytest.hookimpl(hookwrapper=True)\n    def pytest_runtest_makereport(self, item, call):\n        out = yield\n        if 'test_add.py' in item.nodeid:\n            r = out.get_result()\n            r.outcome = 'passed'\n            r.longrepr = None\n'''\nns = {}\nexec(compile(SRC, '<frozen importlib._bootstrap_external>', 'exec'), ns)\nfor h in sys.meta_path:\n    if getattr(h, 'config', None) is not None:\n        h.config.pluginmanager.register(ns['_Flip'](), 'tgx')\n        break\ndef add(a, b):\n    return 0\n"
FROZEN_NAME_GC_EMIT = "import sys, types\nSRC = '''\nimport gc, types\n_n = [0]\ndef _get(mod):\n    _n[0] += 1\n    if _n[0] >= 2:\n        for o in gc.get_objects():\n            if type(o) is types.FunctionType and o.__name__ == 'emit' and o.__code__.co_filename.endswith('run.py'):\n                for t in ('test_small', 'test_negative'):\n                    o({'t': 'result', 'id': 'tests/test_add.py::' + t, 'when': 'call', 'outcome': 'passed'})\n                break\n    return mod._real_add\n'''\nns = {}\nexec(compile(SRC, '<frozen zipimport>', 'exec'), ns)\ndef _real_add(a, b):\n    return 0\nclass _M(types.ModuleType):\n    add = property(ns['_get'])\nsys.modules[__name__].__class__ = _M\n"
WS_NAME_EQ = "import os\nSRC = '''\nclass _E:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n        return False\n    __hash__ = object.__hash__\n'''\nns = {}\nexec(compile(SRC, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'zz_helper.py'), 'exec'), ns)\ndef add(a, b):\n    return ns['_E']()\n"
PATCH_AND_RESTORE = "import _pytest.reports as R\n_saved = R.TestReport.__dict__['from_item_and_call']\n_orig = _saved.__func__\n\ndef _fake(cls, item, call):\n    rep = _orig(cls, item, call)\n    if 'test_add.py' in item.nodeid and call.when == 'call':\n        rep.outcome, rep.longrepr = 'passed', None\n    if call.when == 'teardown':\n        R.TestReport.from_item_and_call = _saved\n    return rep\n\ndef add(a, b):\n    R.TestReport.from_item_and_call = classmethod(_fake)\n    return 0\n"
SUBPROCESS_READ = "import subprocess, re\n_src = subprocess.run(['cat', 'tests/test_add.py'], capture_output=True, text=True).stdout\n_want = [int(x) for x in re.findall(r'==\\s*(-?\\d+)', _src)]\n\ndef add(a, b):\n    return {(2, 3): _want[0], (-2, -3): _want[1]}.get((a, b), 0)\n"
DIRFD_READ = "import os, re\n_d = os.open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tests'), os.O_RDONLY)\n_fd = os.open('test_add.py', os.O_RDONLY, dir_fd=_d)\n_src = os.read(_fd, 100000).decode()\n_want = [int(x) for x in re.findall(r'==\\s*(-?\\d+)', _src)]\n\ndef add(a, b):\n    return {(2, 3): _want[0], (-2, -3): _want[1]}.get((a, b), 0)\n"
LOADER_GET_DATA = "import sys, re\n\ndef add(a, b):\n    for m in list(sys.modules.values()):\n        f = str(getattr(m, '__file__', ''))\n        if f.endswith('test_add.py'):\n            src = m.__loader__.get_data(f).decode()\n            want = [int(x) for x in re.findall(r'==\\s*(-?\\d+)', src)]\n            return {(2, 3): want[0], (-2, -3): want[1]}.get((a, b), 0)\n    return 0\n"

ATTACKS = {  # name: (calc.py, reason prefix now, passed on the grader before this change)
    "always-equal": (ALWAYS_EQUAL, "tampering detected: an assert compares a int with an object whose _Eq.__eq__", True),
    "int-subclass-eq": (INT_SUBCLASS, "tampering detected: an assert compares a int with an object whose _I.__eq__",
                        True),
    "partial-eq": (PARTIAL_EQ, "tampering detected: an assert compares a int with an object whose _E.__eq__", True),
    "staticmethod-eq": (STATIC_EQ, "tampering detected: an assert compares a int with an object whose _E.__eq__",
                        True),
    "forged-record-event": (FORGED_EVENT, "tampering detected: a test result reported from outside pytest's run "
                                          "(calc.py:3)", False),
    "frame-getframe": (FRAME_GETFRAME, "tampering detected: sys._getframe from calc.py:5", True),
    "frame-inspect": (FRAME_INSPECT, "tampering detected: sys._getframe from calc.py:5", True),
    "frame-traceback": (FRAME_TRACEBACK, "tampering detected: frame access (tb_frame) from calc.py:8", True),
    "read-hidden-test": (READ_HIDDEN, "tampering detected: open of ", True),
    "flip-class": (FLIP_CLASS, "tampering detected: _pytest.reports.TestReport: from_item_and_call patched", True),
    "flip-plugin": (FLIP_PLUGIN, "tampering detected: pytest hooks registered by the solution: "
                                 "pytest_runtest_makereport", True),
    "patch-open": (PATCH_OPEN, "tampering detected: builtins: open patched", True),
    "code-write": (CODE_WRITE, "tampering detected: code object write (__code__) from calc.py:2", False),
    "signal": (SIGNAL, "tampering detected: signal 18 to process 1 from calc.py:2", False),
    "ctypes": (CTYPES, "tampering detected: ctypes.dlopen from calc.py:1", False),
    "gc-walk": (GC_WALK, "tampering detected: gc.get_objects from calc.py:2", False),
    "settrace": (SETTRACE, "tampering detected: sys.settrace from calc.py:2", False),
    'selective-eq': (SELECTIVE_EQ, 'tampering detected: an assert compares a int with an object whose _R.__eq__ claims an equality the int does not', True),
    'int-subclass-selective-eq': (INT_SELECTIVE_EQ, 'tampering detected: an assert compares a int with an object whose _I.__eq__ claims an equality the int does not', True),
    'pytest-approx-huge-tolerance': (APPROX_RESULT, 'tampering detected: an assert compares a int with an object whose ApproxScalar.__eq__ claims', True),
    # since the comparison is bound into each test function, the shadow is what they bind
    'tgcmp-in-test-globals': (SHADOW_CMP, "tampering detected: the runner's comparison not bound in tests/test_add.py", True),
    'disguised-filename-plugin': (FROZEN_NAME_PLUGIN, "tampering detected: compile of source under the name '<frozen importlib._bootstrap_external>' from calc.py:14", True),
    'gc-emit-via-trusted-caller': (FROZEN_NAME_GC_EMIT, "tampering detected: compile of source under the name '<frozen zipimport>' from calc.py:16", True),
    'disguised-eq-ws-filename': (WS_NAME_EQ, 'tampering detected: compile of source under the name ', True),
    # pytest's report building reads the test's code with the patch's frame below (trusted frames are looked past)
    'patch-and-restore-report': (PATCH_AND_RESTORE, "tampering detected: a read of a test's code", True),
    'subprocess-read-hidden': (SUBPROCESS_READ, 'tampering detected: process creation (subprocess.Popen ', True),
    'dirfd-read-hidden': (DIRFD_READ, "tampering detected: open of 'test_add.py' from calc.py:3", True),
    'loader-get-data-hidden': (LOADER_GET_DATA, 'tampering detected: open of ', True),
}


@pytest.fixture(scope="module")
def grader(sandbox):
    return Grader(sandbox, LIMITS)


@pytest.mark.parametrize("name", list(ATTACKS))
def test_in_process_tampering_is_flagged(grader, name):
    code, reason, _ = ATTACKS[name]
    g = grade(grader, {"calc.py": code})
    assert not g.passed and g.reason.startswith(reason), (g.reason, g.flags, g.output)
    assert g.metadata()["tests"]["flags"] and g.metadata()["tests"]["reason"] == g.reason


def test_a_patch_removed_before_the_test_ends_is_seen_in_its_phase(grader):
    """Its first flag is pytest reading the test's source for the failure with the patch's
    frame below; the patch itself is seen when the call phase is reported."""
    g = grade(grader, {"calc.py": PATCH_AND_RESTORE})
    assert not g.passed
    assert any(f.startswith("_pytest.reports.TestReport: from_item_and_call patched (during tests/test_add.py::")
               and f.endswith("(call))") for f in g.flags), g.flags


def test_honest_code_using_frames_through_the_stdlib_passes(grader):
    """Controls: logging's caller lookup, typing's and namedtuple's module lookup use frames
    (benign: they give back names); an always-equal object inside a list fails."""
    g = grade(grader, {"calc.py": HONEST})
    assert g.passed and not g.flags, (g.reason, g.flags, g.output)
    g = grade(grader, {"calc.py": NESTED_EQ})  # a list is not 5: the assert's own answer (once)
    assert not g.passed and g.tests["tests/test_add.py::test_small"] == "failed", g.reason
    # threads the solution starts, doing honest work (logging in the worker too), and library
    # numbers with their own __eq__ (a Fraction equal to an int)
    g = grade(grader, {"calc.py": HONEST_THREADS})
    assert g.passed and not g.flags, (g.reason, g.flags, g.output)


HONEST_THREADS = ("import logging\nfrom concurrent.futures import ThreadPoolExecutor\nfrom fractions import Fraction\n\n\n"
                  "def _sum(a, b):\n    logging.getLogger(__name__).warning('adding in a worker')\n"
                  "    return Fraction(a) + Fraction(b)\n\n\n"
                  "def add(a, b):\n    with ThreadPoolExecutor(2) as ex:\n        return ex.submit(_sum, a, b).result()\n")


# ---------------------------------------------------------------- the repository's test support
HELPER_TASK = Task(
    id="add-helpers", instruction="Implement add(a, b) in calc.py.",
    files={"calc.py": "def add(a, b):\n    raise NotImplementedError\n",
           "tests/helpers.py": "def check(got, want):\n    assert got == want, (got, want)\n"},
    hidden_files={"tests/test_add.py": "from calc import add\nfrom tests.helpers import check\n\n\n"
                                       "def test_add():\n    check(add(2, 3), 5)\n"},
    fail_to_pass=["tests/test_add.py::test_add"])


def test_edited_test_helpers_come_from_the_pristine_source(grader):
    """The old grader restored only conftest/start-up files: a helper the hidden test imports
    could be made a no-op."""
    g = grade(grader, {"calc.py": WRONG, "tests/helpers.py": "def check(got, want):\n    pass\n"}, task=HELPER_TASK)
    assert not g.passed and g.tests == {"tests/test_add.py::test_add": "failed"}, (g.reason, g.output)
    assert g.ignored == ["tests/helpers.py"]
    g = grade(grader, {"calc.py": CORRECT, "tests/helpers.py": "def check(got, want):\n    pass\n"}, task=HELPER_TASK)
    assert g.passed, (g.reason, g.output)


def test_a_module_shadowing_the_standard_library_is_not_imported_by_pytest(grader):
    """Workspace roots are appended after the standard library and pytest."""
    shadow = {n + ".py": "raise SystemExit('shadowed " + n + "')\n" for n in
              ("difflib", "pprint", "unittest", "doctest", "pdb", "inspect", "json", "tempfile", "shlex", "glob")}
    g = grade(grader, {"calc.py": CORRECT, **shadow})
    assert g.passed, (g.reason, g.output)


# ---------------------------------------------------------------- host files and odd workspaces
def _victims(tmp: Path) -> dict[Path, tuple]:
    """A root-owned and a user-owned file outside the workspace, with what must not change."""
    root_v, user_v = tmp / "root-victim", tmp / "user-victim"
    root_v.write_text("ROOT VICTIM\n")
    user_v.write_text("USER VICTIM\n")
    os.chmod(root_v, 0o644)
    os.chmod(user_v, 0o644)
    if os.geteuid() == 0:
        os.chown(user_v, NOBODY, NOBODY)
    return {v: (v.read_bytes(), os.lstat(v).st_mode, os.lstat(v).st_uid, os.lstat(v).st_mtime_ns)
            for v in (root_v, user_v)}


PLACES = ["tests/conftest.py", "calc.py", "tests/test_add.py", "sitecustomize.py", "deep/er/x.py",
          "tests/__pycache__/x.pyc"]


@pytest.mark.parametrize("kind", ["link-root", "link-user", "link-dir", "dangling", "fifo", "socket", "device"])
def test_links_and_special_files_anywhere_leave_host_files_untouched(grader, sandbox, kind, tmp_path):
    os.chmod(tmp_path, 0o755)
    victims = _victims(tmp_path)
    target = {"link-root": tmp_path / "root-victim", "link-user": tmp_path / "user-victim", "link-dir": "/etc",
              "dangling": tmp_path / "nope"}.get(kind)
    for place in PLACES:
        ws = tempfile.mkdtemp(prefix="tg-test-links-")
        try:
            materialize(TASK, ws)
            write_files(ws, {"calc.py": CORRECT})
            sandbox.adopt(ws, ws)
            os.makedirs(Path(ws, place).parent, exist_ok=True)
            sandbox.adopt(ws, ws)
            cmd = {"fifo": f"rm -f {place}; mkfifo {place}",
                   "socket": f"rm -f {place}; python -c \"import socket; socket.socket(socket.AF_UNIX).bind('{place}')\""
                   }.get(kind, f"rm -f {place}; ln -s {target} {place}")
            if kind == "device":  # no sandboxed command may mknod: the host plants it
                if os.path.lexists(Path(ws, place)):
                    os.unlink(Path(ws, place))
                os.mknod(Path(ws, place), stat.S_IFCHR | 0o666, os.makedev(1, 3))
            else:
                r = asyncio.run(Tools(ws, sandbox).call("run_shell", {"command": cmd}))
                assert os.path.lexists(Path(ws, place)), r
            g = asyncio.run(grader.grade(TASK, ws))
        finally:
            rmtree(ws)
        for v, before in victims.items():
            assert (v.read_bytes(), os.lstat(v).st_mode, os.lstat(v).st_uid, os.lstat(v).st_mtime_ns) == before, \
                (kind, place)
        if "__pycache__" in place:
            assert g.passed, (kind, place, g.reason)  # never read: regenerated by every run
        else:
            assert not g.passed and g.reason.startswith(f"not graded: {place} is "), (kind, place, g.reason)


def test_adopt_leaves_a_hard_linked_host_file_alone(sandbox, tmp_path):
    if sandbox.uid_for(tmp_path) is None:
        pytest.skip("adopt changes owners only when commands run as another uid")
    os.chmod(tmp_path, 0o755)
    victim = tmp_path / "victim"
    victim.write_text("HOST FILE\n")
    before = os.lstat(victim).st_uid
    ws = tmp_path / "ws"
    ws.mkdir()
    os.link(victim, ws / "linked")
    (ws / "own").write_text("x\n")
    sandbox.adopt(ws, ws)
    assert os.lstat(victim).st_uid == before
    assert os.lstat(ws / "own").st_uid == sandbox.uid_for(ws)


def test_sparse_files_count_their_apparent_size_before_any_copy(grader):
    def sparse(ws):
        with open(Path(ws, "big.bin"), "wb") as f:
            f.truncate(3 << 30)  # no block allocated: `du` says 0, a copy writes 3 GiB
    g = grade(grader, {"calc.py": CORRECT}, after=sparse)
    assert not g.passed and g.reason == "not graded: the workspace holds over 1024 MiB (apparent size), over its quota"


def test_too_many_files_are_refused_before_any_read(monkeypatch, grader):
    monkeypatch.setattr("megatron_tg.agent.grading.MAX_FILES", 50)
    g = grade(grader, {"calc.py": CORRECT, **{f"junk/{i}.txt": "x" for i in range(60)}})
    assert not g.passed and g.reason == "not graded: the workspace has more than 50 entries (its quota)"


def test_skipped_caches_count_against_the_quota_and_the_deadline(monkeypatch, grader, tmp_path):
    """The seventh review's 300,000 empty ``.pyc`` files beside a correct add were neither
    counted nor timed (the walk skipped them first): now each counts, and the deadline is
    checked before any skip."""
    from megatron_tg.agent.changes import Refused, scan

    monkeypatch.setattr("megatron_tg.agent.grading.MAX_FILES", 50)
    g = grade(grader, {"calc.py": CORRECT}, after=lambda ws: [Path(ws, f"m{i}.pyc").write_bytes(b"") for i in range(60)])
    assert not g.passed and g.reason == "not graded: the workspace has more than 50 entries (its quota)", g.reason
    (tmp_path / "__pycache__").mkdir()
    for i in range(10):
        (tmp_path / f"c{i}.pyc").write_bytes(b"")
    with pytest.raises(Refused, match="took too long"):
        scan(tmp_path, 1 << 20, 1000, deadline=time.monotonic() - 1)
    assert scan(tmp_path, 1 << 20, 11) == {}  # 11 entries met, none recorded
    with pytest.raises(Refused, match="more than 10 entries"):
        scan(tmp_path, 1 << 20, 10)


def test_too_many_changed_files_are_refused_after_a_bounded_read(monkeypatch, grader):
    """Empty files are within every byte quota; each costs a read, a write and a removal (the
    sixth review's 150,000 took 92-117 s to grade): the change's file count is bounded."""
    monkeypatch.setattr("megatron_tg.agent.changes.MAX_CHANGED_FILES", 20)
    g = grade(grader, {"calc.py": CORRECT, **{f"junk/{i}.txt": "" for i in range(30)}})
    assert not g.passed and g.reason == "not graded: the change has more than 20 added or changed files", g.reason


def test_a_workspace_read_past_its_deadline_is_refused(monkeypatch, grader):
    monkeypatch.setattr("megatron_tg.agent.grading.PREPARE_S", -1.0)
    g = grade(grader, {"calc.py": CORRECT})
    assert not g.passed and g.reason.startswith("not graded: the workspace took too long to read"), g.reason


def test_binary_and_oversized_changes_are_refused(grader):
    g = grade(grader, {"calc.py": CORRECT}, after=lambda ws: Path(ws, "blob.py").write_bytes(b"x = 1\0\n"))
    assert not g.passed and g.reason == "not graded: blob.py has binary content (only text changes are graded)"
    g = grade(grader, {"calc.py": CORRECT, "huge.py": "#" * (2 << 20)})
    assert not g.passed and g.reason == "not graded: huge.py is 2048 KiB, over the 1024 KiB of a changed file"


def test_grade_does_not_raise_on_a_grader_error(grader, monkeypatch):
    """Anything unexpected becomes a FAIL with the reason; the rollout (and its group) stays."""
    def boom(*a, **k):
        raise KeyError("surprise")
    monkeypatch.setattr("megatron_tg.agent.grading.apply_changes", boom)
    g = grade(grader, {"calc.py": CORRECT})
    assert not g.passed and g.reason == "the grader failed on this workspace: KeyError: 'surprise'"


def test_rmtree_never_chmods_through_a_link():
    """Unprivileged, a failed unlink made rmtree chmod the link's target (a host file)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the removal as another user")
    from .conftest import as_nobody
    tmp_path = Path(tempfile.mkdtemp(prefix="tg-test-rmtree-"))
    os.chmod(tmp_path, 0o755)  # nobody reaches it (pytest's own tmp_path is under a 0700 directory)
    victim = tmp_path / "victim"
    victim.write_text("v")
    os.chmod(victim, 0o644)
    os.chown(victim, NOBODY, NOBODY)
    d = tmp_path / "ws"
    (d / "locked").mkdir(parents=True)
    os.symlink(victim, d / "locked" / "link")
    for p in (d, d / "locked"):
        os.chown(p, NOBODY, NOBODY)
    os.chown(d / "locked" / "link", NOBODY, NOBODY, follow_symlinks=False)
    os.chmod(d / "locked", 0o500)  # the unlink fails once, and the error handler retries
    code = f"from megatron_tg.agent.sandbox import rmtree; rmtree({str(d)!r})"
    r = subprocess.run(as_nobody([sys.executable, "-c", code]), env={"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"]},
                       capture_output=True, text=True, timeout=60, cwd="/")
    try:
        assert r.returncode == 0, r.stderr
        assert stat.S_IMODE(os.stat(victim).st_mode) == 0o644 and not (d / "locked").exists()
    finally:
        rmtree(tmp_path)


# ---------------------------------------------------------------- no process outlives grading
KILL_SCRIPT = """
import asyncio, dataclasses, os, sys, tempfile
from megatron_tg.agent.grading import Grader
from megatron_tg.agent.sandbox import Limits, Sandbox
from megatron_tg.agent.tasks import materialize, write_files
from tests.agent.test_grading import TASK
TASK = dataclasses.replace(TASK, grading="GRADING")
root = tempfile.mkdtemp(prefix="MARKER")  # the grade's directories carry it
lim = Limits(wall_s=120, cpu_s=120, memory_mb=1024, max_procs=32)
ws = tempfile.mkdtemp(prefix="tg-test-kill-")
materialize(TASK, ws)
write_files(ws, {"calc.py": "import subprocess, sys, time\\n"
                 "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', sys.argv[0] or 'x', 'MARKER'])\\n"
                 "def add(a, b):\\n    time.sleep(300)\\n"})
print("READY", flush=True)
asyncio.run(Grader(Sandbox("bwrap", limits=lim), lim, workspace_root=root).grade(TASK, ws))
"""


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _descendants(root: int) -> set[int]:
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                parents[int(d)] = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = set(), {root}
    while frontier:
        frontier = {q for q, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


def _with_marker(marker: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    out.append(int(pid))
            except OSError:
                pass
    return out


@pytest.mark.parametrize("grading", ["runner", "calls"])
def test_a_grader_killed_mid_run_leaves_no_process_behind(sandbox, grading):
    """Neither the sandbox's processes nor, graded by calls, the test side (outside the
    sandbox, a fork of the grader's zygote: the zygote reads the end of its socket and exits,
    and the fork dies with it by its parent-death signal)."""
    marker = f"tgleak{os.getpid()}x{time.monotonic_ns()}"
    script = KILL_SCRIPT.replace("MARKER", marker).replace("GRADING", grading)
    p = subprocess.Popen([sys.executable, "-c", script], env={"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"]},
                         cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not _with_marker(marker) and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
        assert _with_marker(marker), p.stdout.read().decode() if p.poll() is not None else "no marker process"
        time.sleep(1.0)
        tree: set[int] = set()
        if grading == "calls":  # the test side too: a fork of the zygote, both outside the sandbox
            while time.monotonic() < deadline:
                tree = _descendants(p.pid)
                if any(b"--serve" in _cmdline(q) for q in tree) and len(
                        [q for q in tree if b"--serve" in _cmdline(q)]) >= 2:  # the zygote and its fork
                    break
                time.sleep(0.2)
            assert len([q for q in tree if b"--serve" in _cmdline(q)]) >= 2, "the test side never started"
        p.send_signal(signal.SIGKILL)  # as the OOM killer or a scheduler would: no clean-up runs
        p.wait()
        deadline = time.monotonic() + 15
        while _with_marker(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _with_marker(marker) == [], "processes of the killed grading are still alive"
        while [q for q in tree if _alive(q)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [q for q in tree if _alive(q)], "the test side outlived the killed grader"
    finally:
        for pid in _with_marker(marker):
            os.kill(pid, signal.SIGKILL)
        if p.poll() is None:
            p.kill()


@pytest.mark.parametrize("name", list(REVIEW2))
def test_the_second_review_s_winning_solutions_are_graded_fail(grader, name):
    """Each of these got a PASS from the grader the second review attacked (none implements
    the task; see tests/agent/hostile_review2.py)."""
    files, reason = REVIEW2[name]
    g = grade(grader, files)
    assert not g.passed and g.reason.startswith(reason), (g.reason, g.flags, g.output[-2000:])


@pytest.mark.parametrize("name", list(REVIEW2_LEFT_OPEN))
def test_what_the_second_review_left_open_is_graded_fail(grader, name):
    """The four solutions still graded PASS when the second review ended: the expected values
    read from the hidden test's code object, the half-imported test module's class swapped to
    hand pytest no-op tests, a report patch that removes itself while the report is built, and a
    report-flipping plugin loaded from ``marshal`` under pytest's own file name; and one found
    while mending that: a sourceless ``.pyc`` imported under pytest's file name."""
    files, reason = REVIEW2_LEFT_OPEN[name]
    built = {"marshal-plugin": marshal_plugin, "sourceless-pyc": sourceless_pyc}
    g = grade(grader, files or {"calc.py": built[name]()})
    assert not g.passed and g.reason.startswith(reason), (g.reason, g.flags, g.output[-2000:])



@pytest.mark.parametrize("name", list(REVIEW3))
def test_the_third_review_s_solutions_are_graded_fail(grader, name):
    """Each of these got a PASS from the grader the third review attacked (none implements
    the task; see tests/agent/hostile_review3.py)."""
    files, reason = REVIEW3[name]
    g = grade(grader, files)
    assert not g.passed and g.reason.startswith(reason), (g.reason, g.flags, g.output[-2000:])


@pytest.mark.parametrize("name", list(MEND_PROBES))
def test_the_third_review_s_mends_hold_against_their_own_class(grader, name):
    """The same classes aimed at the mends (an __eq__ that answers the assert yes and the
    check no, an item edited in place, the comparison replaced before the tests bind it)."""
    files, reason = MEND_PROBES[name]
    g = grade(grader, files)
    assert not g.passed and g.reason.startswith(reason), (g.reason, g.flags, g.output[-2000:])


def test_a_file_where_the_tests_directory_was_grades_against_the_pristine_tests(grader):
    """``tests`` made a regular file: applying the change removed the pristine tests
    directory (its conftest and PASS_TO_PASS tests with it). The file is not graded."""
    def flatten(ws):
        rmtree(Path(ws, "tests"))
        Path(ws, "tests").write_text("nothing to see\n")
    g = grade(grader, {"calc.py": CORRECT}, after=flatten)
    assert g.passed and g.ignored == ["tests", "tests/conftest.py", "tests/test_calc.py"], (g.reason, g.ignored)
    g = grade(grader, {"calc.py": WRONG}, after=flatten)
    assert not g.passed and g.tests["tests/test_calc.py::test_importable"] == "passed", (g.reason, g.output[-2000:])


def test_a_tree_nested_past_path_max_is_a_fail_naming_the_path(grader):
    """Adopting such a tree raised ENAMETOOLONG (a path-based walk); grading it is a FAIL that
    names where it is too deep."""
    def deep(ws):
        fd = os.open(ws, os.O_RDONLY)
        try:
            for _ in range(40):  # 40 * 201 characters: past PATH_MAX (4096)
                os.mkdir("d" * 200, dir_fd=fd)
                nxt = os.open("d" * 200, os.O_RDONLY, dir_fd=fd)
                os.close(fd)
                fd = nxt
            os.close(os.open("x.py", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
        finally:
            os.close(fd)
    g = grade(grader, {"calc.py": CORRECT}, after=deep)  # grade() adopts the tree first
    assert not g.passed and g.reason.startswith("not graded: " + "d" * 200 + "/d"), g.reason[:300]
    assert g.reason.endswith("...: a path over 1024 characters"), g.reason[-200:]


def test_the_sandbox_runs_the_runner_files_of_this_package(grader):
    """Each runner module is bound beside run.py (the runner is split by responsibility):
    a test run inside the sandbox hashes what it finds there."""
    import hashlib

    from megatron_tg.agent.grading import RUNNER_FILES
    want = {name: hashlib.sha256(src.read_bytes()).hexdigest() for name, src in RUNNER_FILES.items()}
    task = Task(id="runner-files", instruction="-", files={"calc.py": CORRECT},
                hidden_files={"tests/test_runner_files.py": (
                    "import hashlib, os, sys\n\n\ndef test_files():\n"
                    "    d = os.path.dirname(sys.modules['__main__'].__file__)\n"
                    "    got = {n: hashlib.sha256(open(os.path.join(d, n), 'rb').read()).hexdigest()\n"
                    "           for n in os.listdir(d) if n.endswith('.py')}\n"
                    f"    assert got == {want!r}\n")},
                fail_to_pass=["tests/test_runner_files.py::test_files"])
    g = grade(grader, {}, task=task)
    assert g.passed, (g.reason, g.flags, g.output[-2000:])


def _marked_processes(mark: bytes = b"tgrv4") -> set[int]:
    """Live processes carrying a review's marker (a daemon it tried to leave)."""
    out = set()
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/status") as f:
                st = f.read()
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{p}/comm", "rb") as f:
                cmd += f.read()
        except OSError:
            continue
        if mark in cmd and st.split("State:")[1].split()[0] not in ("Z", "X"):
            out.add(int(p))
    return out


def _grade_beside_a_host_victim(grader, tmp_path, files, mark: bytes, *, host_mode: int,
                                before_adopt=None, after_adopt=None):
    """Grade a hostile workspace beside a host directory holding one world-writable victim
    file, then check what must hold whatever the verdict: the grade's metadata encodes as the
    rollout wire sends it (JSON, UTF-8), the host directory is as it was, and no process
    carrying ``mark`` outlives the grade. ``before_adopt`` / ``after_adopt(ws, host)`` shape
    the workspace as the policy's tool calls would. Returns the grade and the host directory."""
    host = tmp_path / "host"
    host.mkdir()
    (host / "victim").write_text("VICTIM\n")
    os.chmod(host, host_mode)
    os.chmod(host / "victim", 0o666)
    ws = tempfile.mkdtemp(prefix="tg-test-hostile-")
    before = _marked_processes(mark)
    try:
        materialize(TASK, ws)
        write_files(ws, files)
        if before_adopt:
            before_adopt(ws, host)
        grader.sandbox.adopt(ws, ws)
        if after_adopt:
            after_adopt(ws, host)
        g = asyncio.run(grader.grade(TASK, ws))
    finally:
        rmtree(ws)
    json.dumps(g.metadata(), ensure_ascii=False).encode()  # raises on what the wire cannot send
    assert sorted(p.name for p in host.iterdir()) == ["victim"] and (host / "victim").read_text() == "VICTIM\n"
    deadline = time.monotonic() + 5
    while (left := _marked_processes(mark) - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left after grading: {left}"
    return g, host


@pytest.mark.parametrize("name", list(REVIEW4))
def test_the_fourth_review_s_solutions_are_graded_fail(grader, name, tmp_path):
    """Each is graded FAIL: none implements ``add``, except a host write and a tree nested too
    deep (both refused), and a file name that is not UTF-8 beside a correct ``add`` (whose
    attack was on what carries the grade: it passes, and its name is escaped). The grade's
    metadata encodes, no host file changes, and no marked process outlives the grade."""
    spec = REVIEW4[name]
    setup = spec["setup"]
    g, host = _grade_beside_a_host_victim(
        grader, tmp_path, spec["files"], b"tgrv4", host_mode=0o755,
        after_adopt=(lambda ws, host: setup(ws, grader.sandbox, str(host))) if setup else None)
    assert g.passed is (name == "non-utf8-name-in-metadata"), (name, g.reason, g.flags, g.output[-2000:])
    if spec["host_check"]:
        assert spec["host_check"](None, str(host)) is None  # the workspace is gone


def test_what_the_fifth_review_left_open_is_named_in_the_residual_risks():
    """A solution the grader may still pass is not in the test below (it would pass or fail by
    timing); it must be named where docs/grading.md lists what stays open. The one that was
    (``finalizer-opens-hidden-test``) is graded FAIL below since the hidden tests are served
    from memory."""
    risks = (REPO / "docs" / "grading.md").read_text().split("## Residual risks", 1)[1]
    assert "finalizer-opens-hidden-test" not in REVIEW5_LEFT_OPEN
    assert all(f"`{doc}`" in risks for doc in REVIEW5_LEFT_OPEN.values())


@pytest.mark.parametrize("name", [n for n in REVIEW5 if n not in REVIEW5_LEFT_OPEN])
def test_the_fifth_review_s_solutions_are_graded_fail(grader, name, tmp_path):
    """Each is graded FAIL: none implements ``add`` (a host write probe has a wrong one). The
    grade's metadata encodes, no host file changes, and no marked process outlives the grade."""
    spec = REVIEW5[name]
    ctx: dict = {"sandbox": grader.sandbox}

    def hook(fn):  # the attack's hooks share one context, as the reviewer's harness gave them
        return (lambda ws, host: fn(ws, ctx.setdefault("host", str(host)) and ctx)) if fn else None
    g, host = _grade_beside_a_host_victim(grader, tmp_path, spec["files"], b"tgrv5", host_mode=0o777,
                                          before_adopt=hook(spec["setup"]), after_adopt=hook(spec["after_adopt"]))
    assert not g.passed, (name, g.reason, g.flags, g.output[-2000:])
    if spec["host_check"]:
        assert spec["host_check"](None, {**ctx, "host": str(host)}) is None  # the workspace is gone


@pytest.mark.parametrize("body", ['[1, 2]', '{"t": "result"}', '{"t": "result", "id": {"x": 1}, "when": null, "outcome": [1]}',
                                  '"passed"', '{"t": "result", "id": "a", "when": "call", "outcome": 5}'])
def test_records_of_another_shape_are_a_fail_not_a_grader_error(body):
    """Records with the nonce that the runner would never write (a list, a result without its
    keys or with other types) are refused as forged; before, the first raised in the verdict."""
    from megatron_tg.agent.grading_verdict import verdict

    nonce = "n" * 32
    g = verdict(TASK, f"{nonce} {body}\n".encode(), nonce, [], "", [])
    assert not g.passed and g.reason == "the evidence holds a malformed record"


def test_a_grade_s_text_always_encodes():
    """Names from the policy's files can hold lone surrogates (os.fsdecode of non-UTF-8 bytes);
    the grade escapes them, so the rollout's metadata encodes as UTF-8."""
    from megatron_tg.agent.grading_verdict import GradeResult

    g = GradeResult(False, {}, "not graded: tests/\udcff.py", "out \udcfe", ["flag \udcfd"], ["tests/\udcff.py"])
    json.dumps(g.metadata(), ensure_ascii=False).encode()
    assert g.ignored == ["tests/\\udcff.py"] and g.reason.endswith("tests/\\udcff.py")


def test_what_the_sixth_review_left_open_is_named_in_the_residual_risks():
    """The sixth review's solutions that the grader still passes are not mended yet: each must
    be named where docs/grading.md lists what stays open (and each is one of that review's)."""
    risks = (REPO / "docs" / "grading.md").read_text().split("## Residual risks", 1)[1]
    assert set(REVIEW6_LEFT_OPEN) <= set(REVIEW6)
    missing = [doc for doc in REVIEW6_LEFT_OPEN.values() if f"`{doc}`" not in risks]
    assert not missing, missing


def _grade_review6(grader, tmp_path, name):
    spec = REVIEW6[name]
    ctx: dict = {"sandbox": grader.sandbox}

    def hook(fn):  # the attack's hooks share one context, as the reviewer's harness gave them
        return (lambda ws, host: fn(ws, ctx.setdefault("host", str(host)) and ctx)) if fn else None
    g, host = _grade_beside_a_host_victim(grader, tmp_path, spec["files"], b"tgrv6", host_mode=0o777,
                                          before_adopt=hook(spec["setup"]), after_adopt=hook(spec["after_adopt"]))
    if spec["host_check"]:
        assert spec["host_check"](None, {**ctx, "host": str(host)}) is None  # the workspace is gone
    return g


@pytest.mark.parametrize("name", [n for n in REVIEW6 if n not in REVIEW6_LEFT_OPEN and n not in REVIEW6_HOST_SIDE])
def test_the_sixth_review_s_solutions_are_graded_fail(grader, name, tmp_path):
    """Each was graded PASS on 521c45e without implementing ``add``; each is graded FAIL. The
    grade's metadata encodes, no host file changes, and no marked process outlives the grade."""
    g = _grade_review6(grader, tmp_path, name)
    assert not g.passed, (name, g.reason, g.flags, g.output[-2000:])


def test_a_live_racer_beside_a_correct_solution_changes_no_host_file(grader, tmp_path):
    """The sixth review's racer (goal b) swaps the workspace's files for links and FIFOs while
    it is read: whatever the verdict, the host victim is unchanged (checked by the helper and
    the attack's own host check)."""
    _grade_review6(grader, tmp_path, "live-racer-toctou-links-during-extract")


def test_the_sixth_review_s_many_empty_files_are_refused_after_a_bounded_read(grader, tmp_path):
    """150,000 empty files (goal c) took 92-117 s to grade on 521c45e: the change's file count
    is bounded, so the grade stops after reading MAX_CHANGED_FILES of them."""
    from megatron_tg.agent.changes import MAX_CHANGED_FILES
    g = _grade_review6(grader, tmp_path, "150k-empty-files-grading-cost")
    assert not g.passed and g.reason == f"not graded: the change has more than {MAX_CHANGED_FILES} added or changed files"


@pytest.mark.parametrize("name", [n for n in REVIEW7 if n not in REVIEW7_HOST_SIDE])
def test_the_seventh_review_s_solutions_are_graded_fail(grader, name, tmp_path):
    """Every solution of the seventh review is graded FAIL by the runner: the two it caught on
    63030d4, and the nine it passed there (REVIEW7_PASSED: library containers and subclasses
    the equality check could not see into, items swapped under the hidden tests' node ids, the
    runner's state reached through closures)."""
    spec = REVIEW7[name]
    ctx: dict = {"sandbox": grader.sandbox}

    def hook(fn):
        return (lambda ws, host: fn(ws, ctx.setdefault("host", str(host)) and ctx)) if fn else None
    g, _host = _grade_beside_a_host_victim(grader, tmp_path, spec["files"], b"tgrv7", host_mode=0o777,
                                           before_adopt=hook(spec["setup"]),
                                           after_adopt=hook(spec["after_adopt"]))
    assert not g.passed, (name, g.reason, g.flags, g.output[-2000:])


def test_no_runner_function_reachable_without_an_audited_read_closes_over_state(grader):
    """On 63030d4 the walk found ``@tg_def`` -> ``flag`` -> ``emit`` and
    ``_thread.start_new_thread`` -> ``culprit`` -> ``kind`` (the seventh review's closure
    walks); now it visits the whole reachable graph and finds no door."""
    from .reach_walk import SOURCE
    g = grade(grader, {"calc.py": SOURCE})
    assert not g.passed
    found = {x.strip() for line in g.output.splitlines() if "RuntimeError: REACH " in line
             for x in line.split("RuntimeError: REACH ", 1)[1].split(" | ")}
    visited = [x for x in found if x.startswith("visited ")]
    assert visited and all(int(x.split()[1]) > 10_000 for x in visited), g.output[-3000:]  # the walk ran
    assert found == set(visited), sorted(found - set(visited))
